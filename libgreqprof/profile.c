/* profile.c -- the profile object: a reference-counted container of spans,
 * per-greenlet totals and call statistics. */
#include "internal.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

static _Atomic uint64_t next_serial = 1;
static _Atomic uint64_t next_greenlet = 1;

uint64_t gqp__next_serial(void)
{
    return atomic_fetch_add(&next_serial, 1);
}

uint64_t gqp__next_greenlet_id(void)
{
    return atomic_fetch_add(&next_greenlet, 1);
}

bool gqp__profile_live(const gqp_profile *p)
{
    return p && p->magic == GQP__PROFILE_MAGIC && p->refs > 0;
}

GQP_API int gqp_profile_new(gqp_profile **out)
{
    if (!out) {
        return GQP_EINVAL;
    }
    *out = NULL;
    gqp_profile *p = gqp__calloc(1, sizeof *p);
    if (!p) {
        return GQP_ENOMEM;
    }
    p->magic = GQP__PROFILE_MAGIC;
    p->refs = 1;
    p->serial = gqp__next_serial();
    p->generation = gqp__next_serial();
    p->max_name = 255;
    p->call_clock = GQP_CLOCK_TRACER;
    p->max_greenlets = 65536;
    gqp__spans_init(&p->spans, 10000, GQP_KEEP_FIRST);
    gqp__calls_init(&p->calls);
    gqp__map_init(&p->gindex);
    gqp__map_init_buf(&p->waits.index, p->waits.index_keys,
                      p->waits.index_vals, GQP__WAIT_INLINE_MAP);
    gqp__map_init_buf(&p->waits.seen, p->waits.seen_keys,
                      p->waits.seen_vals, GQP__WAIT_INLINE_MAP);
    p->waits.sites = p->waits.sites_inline;
    p->waits.alloc = GQP__WAIT_INLINE_SITES;
    p->waits.events = p->waits.events_inline;
    p->waits.ev_alloc = GQP__WAIT_INLINE_EVENTS;
    p->waits.max = 256;
    p->waits.max_events = 1024;
    p->epoch_origin = gqp_clock_epoch_ns();
    p->wall_origin = gqp_clock_wall_ns();
    *out = p;
    return GQP_OK;
}

GQP_API int gqp_profile_set(gqp_profile *p, gqp_profile_param param,
                            int64_t value)
{
    if (!gqp__profile_live(p)) {
        return p ? GQP_EHANDLE : GQP_EINVAL;
    }
    if (p->has_data) {
        return GQP_ESTATE;
    }
    if (value < 0) {
        return GQP_ERANGE;
    }
    switch (param) {
    case GQP_PROFILE_MAX_SPANS:
        if (value > (int64_t)1 << 32) return GQP_ERANGE;
        p->spans.cap = (size_t)value;
        return GQP_OK;
    case GQP_PROFILE_SPAN_POLICY:
        if (value != GQP_KEEP_FIRST && value != GQP_KEEP_LAST) {
            return GQP_ERANGE;
        }
        p->spans.policy = (int)value;
        return GQP_OK;
    case GQP_PROFILE_MAX_FUNCS:
        if (value > (int64_t)1 << 30) return GQP_ERANGE;
        p->calls.max_funcs = (size_t)value;
        return GQP_OK;
    case GQP_PROFILE_MAX_EDGES:
        if (value > (int64_t)1 << 30) return GQP_ERANGE;
        p->calls.max_edges = (size_t)value;
        return GQP_OK;
    case GQP_PROFILE_MAX_GREENLETS:
        if (value > (int64_t)1 << 30) return GQP_ERANGE;
        p->max_greenlets = (size_t)value;
        return GQP_OK;
    case GQP_PROFILE_MAX_NAME:
        if (value > 65536) return GQP_ERANGE;
        p->max_name = (size_t)value;
        return GQP_OK;
    case GQP_PROFILE_MAX_WAIT_SITES:
        if (value > GQP__WAIT_MAX_SITES) return GQP_ERANGE;
        p->waits.max = (size_t)value;
        return GQP_OK;
    case GQP_PROFILE_MAX_WAIT_EVENTS:
        if (value > (int64_t)1 << 24) return GQP_ERANGE;
        p->waits.max_events = (size_t)value;
        return GQP_OK;
    case GQP_PROFILE_CALL_CLOCK:
        if (value != GQP_CLOCK_TRACER && value != GQP_CLOCK_CPU &&
            value != GQP_CLOCK_WALL) {
            return GQP_ERANGE;
        }
        p->call_clock = (int)value;
        return GQP_OK;
    }
    return GQP_EINVAL;
}

GQP_API int gqp_profile_get(const gqp_profile *p, gqp_profile_param param,
                            int64_t *value)
{
    if (!value) {
        return GQP_EINVAL;
    }
    if (!gqp__profile_live(p)) {
        return p ? GQP_EHANDLE : GQP_EINVAL;
    }
    switch (param) {
    case GQP_PROFILE_MAX_SPANS: *value = (int64_t)p->spans.cap; return GQP_OK;
    case GQP_PROFILE_SPAN_POLICY: *value = p->spans.policy; return GQP_OK;
    case GQP_PROFILE_MAX_FUNCS: *value = (int64_t)p->calls.max_funcs; return GQP_OK;
    case GQP_PROFILE_MAX_EDGES: *value = (int64_t)p->calls.max_edges; return GQP_OK;
    case GQP_PROFILE_MAX_GREENLETS: *value = (int64_t)p->max_greenlets; return GQP_OK;
    case GQP_PROFILE_MAX_NAME: *value = (int64_t)p->max_name; return GQP_OK;
    case GQP_PROFILE_MAX_WAIT_SITES: *value = (int64_t)p->waits.max; return GQP_OK;
    case GQP_PROFILE_MAX_WAIT_EVENTS: *value = (int64_t)p->waits.max_events; return GQP_OK;
    case GQP_PROFILE_CALL_CLOCK: *value = p->call_clock; return GQP_OK;
    }
    return GQP_EINVAL;
}

GQP_API int gqp_profile_retain(gqp_profile *p)
{
    if (!gqp__profile_live(p)) {
        return p ? GQP_EHANDLE : GQP_EINVAL;
    }
    if (atomic_load(&p->refs) == UINT32_MAX) {
        return GQP_ELIMIT;
    }
    atomic_fetch_add(&p->refs, 1);
    return GQP_OK;
}

static void free_gstats(gqp_profile *p)
{
    for (size_t i = 0; i < p->ngstats; i++) {
        gqp__free(p->gstats[i].name);
        gqp__free(p->gstats[i].fn_name);
    }
    p->ngstats = 0;
}

GQP_API void gqp_profile_free(gqp_profile *p)
{
    if (!gqp__profile_live(p)) {
        return;
    }
    if (atomic_fetch_sub(&p->refs, 1) > 1) {
        return;
    }
    gqp__spans_free(&p->spans);
    gqp__calls_free(&p->calls);
    free_gstats(p);
    gqp__free(p->gstats);
    gqp__map_free(&p->gindex);
    gqp__map_free(&p->waits.index);
    gqp__map_free(&p->waits.seen);
    if (p->waits.sites != p->waits.sites_inline) {
        gqp__free(p->waits.sites);
    }
    if (p->waits.events != p->waits.events_inline) {
        gqp__free(p->waits.events);
    }
    p->magic = GQP__DEAD_MAGIC;
    gqp__free(p);
}

GQP_API int gqp_profile_close(gqp_profile *p)
{
    if (!gqp__profile_live(p)) {
        return p ? GQP_EHANDLE : GQP_EINVAL;
    }
    if (p->closed) {
        return GQP_ESTATE;
    }
    p->closed = true;
    return GQP_OK;
}

GQP_API int gqp_profile_is_closed(const gqp_profile *p)
{
    if (!gqp__profile_live(p)) {
        return p ? GQP_EHANDLE : GQP_EINVAL;
    }
    return p->closed ? 1 : 0;
}

GQP_API size_t gqp_profile_attached(const gqp_profile *p)
{
    return gqp__profile_live(p) ? atomic_load(&p->attached) : 0;
}

GQP_API size_t gqp_profile_refs(const gqp_profile *p)
{
    return gqp__profile_live(p) ? atomic_load(&p->refs) : 0;
}

GQP_API int gqp_profile_clear(gqp_profile *p)
{
    if (!gqp__profile_live(p)) {
        return p ? GQP_EHANDLE : GQP_EINVAL;
    }
    gqp__spans_clear(&p->spans);
    gqp__calls_clear(&p->calls);
    /* A new generation makes tracers drop call stacks that index the old
     * tables. */
    p->generation = gqp__next_serial();
    free_gstats(p);
    gqp__map_clear(&p->gindex);
    p->greenlets_dropped = 0;
    gqp__map_clear(&p->waits.index);
    gqp__map_clear(&p->waits.seen);
    p->waits.len = 0;
    p->waits.dropped = 0;
    p->waits.nev = 0;
    p->waits.events_dropped = 0;
    p->has_data = false;
    return GQP_OK;
}

/* ---- spans ------------------------------------------------------------ */

size_t gqp__profile_add_span(gqp_profile *p, const gqp_span *s,
                             bool *dropped, uint32_t *hint)
{
    p->has_data = true;
    gqp__gstat *g;
    if (*hint < p->ngstats &&
        p->gstats[*hint].pub.greenlet_id == s->greenlet_id) {
        g = &p->gstats[*hint];
    } else {
        g = gqp__profile_gstat(p, s->greenlet_id);
        if (g) {
            *hint = (uint32_t)(g - p->gstats);
        }
    }
    *dropped = g == NULL;
    if (g) {
        gqp_greenlet_stat *st = &g->pub;
        int64_t wall = s->end_ns - s->start_ns;
        if (!g->has_span) {
            st->first_ns = s->start_ns;
            g->has_span = true;
        }
        st->wall_ns += wall;
        if (s->cpu_ns >= 0) {
            st->cpu_ns = (st->cpu_ns < 0 ? 0 : st->cpu_ns) + s->cpu_ns;
        }
        if (!(s->flags & GQP_SPAN_CONTINUED)) {
            st->switches++;
        }
        st->last_ns = s->end_ns;
        if (s->flags & GQP_SPAN_FINISHED) {
            st->finished = 1;
        }
    }
    size_t idx = gqp__spans_push(&p->spans, s);
    if (idx == SIZE_MAX || (p->spans.policy == GQP_KEEP_LAST &&
                            p->spans.dropped && idx == p->spans.len - 1 &&
                            p->spans.len == p->spans.cap)) {
        /* Dropped, or kept by evicting the oldest. */
        *dropped = true;
    }
    return idx;
}

GQP_API size_t gqp_profile_span_count(const gqp_profile *p)
{
    return gqp__profile_live(p) ? p->spans.len : 0;
}

GQP_API uint64_t gqp_profile_spans_dropped(const gqp_profile *p)
{
    return gqp__profile_live(p) ? p->spans.dropped : 0;
}

GQP_API int gqp_profile_span(const gqp_profile *p, size_t i, gqp_span *out)
{
    if (!out) {
        return GQP_EINVAL;
    }
    if (!gqp__profile_live(p)) {
        return p ? GQP_EHANDLE : GQP_EINVAL;
    }
    gqp_span *s = gqp__spans_at(&p->spans, i);
    if (!s) {
        return GQP_ERANGE;
    }
    *out = *s;
    return GQP_OK;
}

GQP_API int gqp_profile_span_set_tag(gqp_profile *p, size_t i, uint32_t tag)
{
    if (!gqp__profile_live(p)) {
        return p ? GQP_EHANDLE : GQP_EINVAL;
    }
    gqp_span *s = gqp__spans_at(&p->spans, i);
    if (!s) {
        return GQP_ERANGE;
    }
    s->tag = tag;
    /* Keep the copies of the longest spans in step with the stored one. */
    if (p->spans.longest.start_ns == s->start_ns &&
        p->spans.longest.greenlet_id == s->greenlet_id) {
        p->spans.longest.tag = tag;
    }
    if (p->spans.longest_cpu.start_ns == s->start_ns &&
        p->spans.longest_cpu.greenlet_id == s->greenlet_id) {
        p->spans.longest_cpu.tag = tag;
    }
    return GQP_OK;
}

GQP_API int gqp_profile_longest_span(const gqp_profile *p, gqp_span *out)
{
    if (!out) {
        return GQP_EINVAL;
    }
    if (!gqp__profile_live(p)) {
        return p ? GQP_EHANDLE : GQP_EINVAL;
    }
    if (!p->spans.have_longest) {
        return GQP_ENOTFOUND;
    }
    *out = p->spans.longest;
    return GQP_OK;
}

GQP_API int gqp_profile_longest_cpu_span(const gqp_profile *p, gqp_span *out)
{
    if (!out) {
        return GQP_EINVAL;
    }
    if (!gqp__profile_live(p)) {
        return p ? GQP_EHANDLE : GQP_EINVAL;
    }
    if (!p->spans.have_longest) {
        return GQP_ENOTFOUND;
    }
    *out = p->spans.longest_cpu;
    return GQP_OK;
}

/* ---- greenlet totals -------------------------------------------------- */

gqp__gstat *gqp__profile_gstat(gqp_profile *p, uint64_t id)
{
    uint64_t *v = gqp__map_get(&p->gindex, id);
    if (v) {
        return &p->gstats[*v - 1];
    }
    if (p->ngstats >= p->max_greenlets) {
        p->greenlets_dropped++;
        return NULL;
    }
    if (p->ngstats == p->gstats_alloc) {
        size_t n = p->gstats_alloc ? p->gstats_alloc * 2 : 16;
        gqp__gstat *ng = gqp__realloc(p->gstats, n * sizeof *ng);
        if (!ng) {
            return NULL;
        }
        p->gstats = ng;
        p->gstats_alloc = n;
    }
    bool added;
    v = gqp__map_put(&p->gindex, id, &added);
    if (!v) {
        return NULL;
    }
    *v = p->ngstats + 1;
    gqp__gstat *g = &p->gstats[p->ngstats++];
    memset(g, 0, sizeof *g);
    g->pub.greenlet_id = id;
    g->pub.cpu_ns = -1;
    return g;
}

GQP_API size_t gqp_profile_greenlet_count(const gqp_profile *p)
{
    return gqp__profile_live(p) ? p->ngstats : 0;
}

GQP_API uint64_t gqp_profile_greenlets_dropped(const gqp_profile *p)
{
    return gqp__profile_live(p) ? p->greenlets_dropped : 0;
}

GQP_API int gqp_profile_greenlet(const gqp_profile *p, size_t i,
                                 gqp_greenlet_stat *out)
{
    if (!out) {
        return GQP_EINVAL;
    }
    if (!gqp__profile_live(p)) {
        return p ? GQP_EHANDLE : GQP_EINVAL;
    }
    if (i >= p->ngstats) {
        return GQP_ERANGE;
    }
    const gqp__gstat *g = &p->gstats[i];
    *out = g->pub;
    out->name = g->name ? g->name : "";
    out->fn_name = g->fn_name ? g->fn_name : "";
    return GQP_OK;
}

/* A copy of s truncated to max bytes; *out stays NULL for s == NULL. */
static int copy_name(char **out, const char *s, size_t max)
{
    *out = NULL;
    if (!s) {
        return GQP_OK;
    }
    size_t n = strlen(s);
    if (n > max) {
        n = max;
    }
    char *c = gqp__malloc(n + 1);
    if (!c) {
        return GQP_ENOMEM;
    }
    memcpy(c, s, n);
    c[n] = '\0';
    *out = c;
    return GQP_OK;
}

GQP_API int gqp_profile_name_greenlet(gqp_profile *p, uint64_t greenlet_id,
                                      const char *name, const char *fn_name)
{
    if (!gqp__profile_live(p)) {
        return p ? GQP_EHANDLE : GQP_EINVAL;
    }
    if (greenlet_id == 0) {
        return GQP_EINVAL;
    }
    if (p->closed) {
        return GQP_ESTATE;
    }
    /* Allocate everything first so a failure changes nothing. */
    char *cn = NULL, *cf = NULL;
    if (copy_name(&cn, name, p->max_name) != GQP_OK ||
        copy_name(&cf, fn_name, p->max_name) != GQP_OK) {
        gqp__free(cn);
        return GQP_ENOMEM;
    }
    size_t before = p->ngstats;
    gqp__gstat *g = gqp__profile_gstat(p, greenlet_id);
    if (!g) {
        gqp__free(cn);
        gqp__free(cf);
        return before >= p->max_greenlets ? GQP_ELIMIT : GQP_ENOMEM;
    }
    p->has_data = true;
    if (cn) {
        gqp__free(g->name);
        g->name = cn;
    }
    if (cf) {
        gqp__free(g->fn_name);
        g->fn_name = cf;
    }
    return GQP_OK;
}

/* ---- call statistics -------------------------------------------------- */

GQP_API size_t gqp_profile_func_count(const gqp_profile *p)
{
    return gqp__profile_live(p) ? p->calls.nfuncs : 0;
}

GQP_API int gqp_profile_func(const gqp_profile *p, size_t i,
                             gqp_func_stat *out)
{
    if (!out) {
        return GQP_EINVAL;
    }
    if (!gqp__profile_live(p)) {
        return p ? GQP_EHANDLE : GQP_EINVAL;
    }
    if (i >= p->calls.nfuncs) {
        return GQP_ERANGE;
    }
    *out = p->calls.funcs[i];
    return GQP_OK;
}

GQP_API size_t gqp_profile_edge_count(const gqp_profile *p)
{
    return gqp__profile_live(p) ? p->calls.nedges : 0;
}

GQP_API int gqp_profile_edge(const gqp_profile *p, size_t i,
                             gqp_edge_stat *out)
{
    if (!out) {
        return GQP_EINVAL;
    }
    if (!gqp__profile_live(p)) {
        return p ? GQP_EHANDLE : GQP_EINVAL;
    }
    if (i >= p->calls.nedges) {
        return GQP_ERANGE;
    }
    *out = p->calls.edges[i];
    return GQP_OK;
}

GQP_API uint64_t gqp_profile_calls_dropped(const gqp_profile *p)
{
    return gqp__profile_live(p) ? p->calls.dropped : 0;
}

GQP_API int64_t gqp_profile_epoch_origin(const gqp_profile *p)
{
    return gqp__profile_live(p) ? p->epoch_origin : 0;
}

GQP_API int64_t gqp_profile_wall_origin(const gqp_profile *p)
{
    return gqp__profile_live(p) ? p->wall_origin : 0;
}

/* ---- wait sites ------------------------------------------------------- */

/* Grows *arr (which starts as the inline array `inl`) to n elements of
 * size sz, keeping the first `used`.  false: no memory, nothing changed. */
static bool grow_array(void **arr, void *inl, size_t *alloc, size_t n,
                       size_t sz, size_t used)
{
    if (n <= *alloc) {
        return false;
    }
    void *na;
    if (*arr == inl) {
        na = gqp__malloc(n * sz);
        if (na && used) {
            memcpy(na, inl, used * sz);
        }
    } else {
        na = gqp__realloc(*arr, n * sz);
    }
    if (!na) {
        return false;
    }
    *arr = na;
    *alloc = n;
    return true;
}

uint32_t gqp__profile_wait_site(gqp_profile *p, uint64_t site, bool *added,
                                bool *nomem)
{
    gqp__waits *w = &p->waits;
    *added = false;
    *nomem = false;
    p->has_data = true;
    uint64_t *v = gqp__map_get(&w->index, site);
    if (v) {
        return (uint32_t)(*v - 1);
    }
    if (w->len >= w->max) {
        w->dropped++;
        return GQP__NOIDX;
    }
    if (w->len == w->alloc) {
        size_t n = w->alloc * 2;
        if (n > w->max) {
            n = w->max;
        }
        if (!grow_array((void **)&w->sites, w->sites_inline, &w->alloc, n,
                        sizeof *w->sites, w->len)) {
            *nomem = true;
            return GQP__NOIDX;
        }
    }
    bool fresh;
    v = gqp__map_put(&w->index, site, &fresh);
    if (!v) {
        *nomem = true;
        return GQP__NOIDX;
    }
    *v = w->len + 1;
    gqp_wait_stat *s = &w->sites[w->len];
    memset(s, 0, sizeof *s);
    s->site = site;
    *added = true;
    return (uint32_t)w->len++;
}

/* Appends a wait event (the first max_events; the rest are counted). */
static void wait_event(gqp__waits *w, uint32_t i, uint64_t id, int64_t start,
                       int64_t end)
{
    if (w->nev >= w->max_events) {
        w->events_dropped++;
        return;
    }
    if (w->nev == w->ev_alloc) {
        size_t n = w->ev_alloc * 2;
        if (n > w->max_events) {
            n = w->max_events;
        }
        if (!grow_array((void **)&w->events, w->events_inline, &w->ev_alloc,
                        n, sizeof *w->events, w->nev)) {
            w->events_dropped++; /* out of memory */
            return;
        }
    }
    gqp_wait_event *e = &w->events[w->nev++];
    e->greenlet_id = id;
    e->start_ns = start;
    e->end_ns = end;
    e->site = i;
    e->reserved = 0;
}

void gqp__profile_wait_charge(gqp_profile *p, uint32_t i, uint64_t id,
                              int64_t start, int64_t end)
{
    gqp__waits *w = &p->waits;
    if (i >= w->len) {
        return;
    }
    int64_t ns = end - start;
    wait_event(w, i, id, start, end > start ? end : start);
    gqp_wait_stat *s = &w->sites[i];
    s->wait_ns += ns > 0 ? ns : 0;
    s->count++;
    /* Greenlet ids come from a process-wide counter: they fit 44 bits. */
    uint64_t pair = (id << 20) | ((uint64_t)i + 1);
    if (gqp__map_get(&w->seen, pair) || w->seen.len >= GQP__WAIT_PAIRS) {
        return;
    }
    bool fresh;
    if (gqp__map_put(&w->seen, pair, &fresh)) {
        s->greenlets++;
    }
    /* (out of memory: this greenlet goes uncounted in `greenlets`) */
}

GQP_API size_t gqp_profile_wait_count(const gqp_profile *p)
{
    return gqp__profile_live(p) ? p->waits.len : 0;
}

GQP_API int gqp_profile_wait(const gqp_profile *p, size_t i,
                             gqp_wait_stat *out)
{
    if (!out) {
        return GQP_EINVAL;
    }
    if (!gqp__profile_live(p)) {
        return p ? GQP_EHANDLE : GQP_EINVAL;
    }
    if (i >= p->waits.len) {
        return GQP_ERANGE;
    }
    *out = p->waits.sites[i];
    return GQP_OK;
}

GQP_API int gqp_profile_wait_set_tag(gqp_profile *p, size_t i, uint32_t tag)
{
    if (!gqp__profile_live(p)) {
        return p ? GQP_EHANDLE : GQP_EINVAL;
    }
    if (i >= p->waits.len) {
        return GQP_ERANGE;
    }
    p->waits.sites[i].tag = tag;
    return GQP_OK;
}

GQP_API uint64_t gqp_profile_waits_dropped(const gqp_profile *p)
{
    return gqp__profile_live(p) ? p->waits.dropped : 0;
}

GQP_API size_t gqp_profile_wait_event_count(const gqp_profile *p)
{
    return gqp__profile_live(p) ? p->waits.nev : 0;
}

GQP_API int gqp_profile_wait_event(const gqp_profile *p, size_t i,
                                   gqp_wait_event *out)
{
    if (!out) {
        return GQP_EINVAL;
    }
    if (!gqp__profile_live(p)) {
        return p ? GQP_EHANDLE : GQP_EINVAL;
    }
    if (i >= p->waits.nev) {
        return GQP_ERANGE;
    }
    *out = p->waits.events[i];
    return GQP_OK;
}

GQP_API uint64_t gqp_profile_wait_events_dropped(const gqp_profile *p)
{
    return gqp__profile_live(p) ? p->waits.events_dropped : 0;
}
