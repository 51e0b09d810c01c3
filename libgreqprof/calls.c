/* calls.c -- function and caller->callee tables of a profile.
 * Entries are dense arrays indexed by small integers so call stacks can hold
 * 32-bit indexes; the maps only translate keys to indexes. */
#include "internal.h"

#include <stdlib.h>
#include <string.h>

void gqp__calls_init(gqp__calls *c)
{
    memset(c, 0, sizeof *c);
    gqp__map_init(&c->func_index);
    gqp__map_init(&c->edge_index);
    c->max_funcs = 65536;
    c->max_edges = 262144;
}

void gqp__calls_free(gqp__calls *c)
{
    gqp__map_free(&c->func_index);
    gqp__map_free(&c->edge_index);
    gqp__free(c->funcs);
    gqp__free(c->edges);
    gqp__free(c->fact);
    gqp__free(c->eact);
    c->funcs = NULL;
    c->edges = NULL;
    c->fact = NULL;
    c->eact = NULL;
    c->nfuncs = c->nedges = c->funcs_alloc = c->edges_alloc = 0;
}

void gqp__calls_clear(gqp__calls *c)
{
    gqp__map_clear(&c->func_index);
    gqp__map_clear(&c->edge_index);
    c->nfuncs = 0;
    c->nedges = 0;
    c->dropped = 0;
}

/* Grows a stats array and its parallel gqp__active array together, so
 * they always have the same capacity.  On failure neither changes size. */
static bool grow_pair(void **stats, void **act, size_t *alloc, size_t need,
                      size_t elem)
{
    if (need <= *alloc) {
        return true;
    }
    size_t n = *alloc ? *alloc * 2 : 64;
    while (n < need) {
        n *= 2;
    }
    void *na = gqp__realloc(*act, n * sizeof(gqp__active));
    if (!na) {
        return false;
    }
    *act = na;
    void *ns = gqp__realloc(*stats, n * elem);
    if (!ns) {
        return false; /* act is larger than needed: harmless */
    }
    *stats = ns;
    *alloc = n;
    return true;
}

uint32_t gqp__calls_func(gqp__calls *c, uint64_t key, bool *added)
{
    *added = false;
    uint64_t *v = gqp__map_get(&c->func_index, key);
    if (v) {
        return (uint32_t)(*v - 1);
    }
    if (c->nfuncs >= c->max_funcs || !grow_pair((void **)&c->funcs,
                                                (void **)&c->fact,
                                                &c->funcs_alloc, c->nfuncs + 1,
                                                sizeof *c->funcs)) {
        return GQP__NOIDX;
    }
    bool fresh;
    v = gqp__map_put(&c->func_index, key, &fresh);
    if (!v) {
        return GQP__NOIDX;
    }
    uint32_t idx = (uint32_t)c->nfuncs++;
    *v = (uint64_t)idx + 1;
    gqp_func_stat *f = &c->funcs[idx];
    memset(f, 0, sizeof *f);
    memset(&c->fact[idx], 0, sizeof c->fact[idx]);
    f->key = key;
    *added = true;
    return idx;
}

uint32_t gqp__calls_edge(gqp__calls *c, uint32_t caller, uint32_t callee)
{
    uint64_t key = ((uint64_t)caller + 1) << 32 | ((uint64_t)callee + 1);
    uint64_t *v = gqp__map_get(&c->edge_index, key);
    if (v) {
        return (uint32_t)(*v - 1);
    }
    if (c->nedges >= c->max_edges || !grow_pair((void **)&c->edges,
                                                (void **)&c->eact,
                                                &c->edges_alloc, c->nedges + 1,
                                                sizeof *c->edges)) {
        return GQP__NOIDX;
    }
    bool fresh;
    v = gqp__map_put(&c->edge_index, key, &fresh);
    if (!v) {
        return GQP__NOIDX;
    }
    uint32_t idx = (uint32_t)c->nedges++;
    *v = (uint64_t)idx + 1;
    gqp_edge_stat *e = &c->edges[idx];
    memset(e, 0, sizeof *e);
    memset(&c->eact[idx], 0, sizeof c->eact[idx]);
    e->caller_key = c->funcs[caller].key;
    e->callee_key = c->funcs[callee].key;
    return idx;
}
