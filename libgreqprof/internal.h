/* internal.h -- private declarations shared by libgreqprof's sources.
 * Names here start with gqp__ and are not exported. */
#ifndef GQP_INTERNAL_H
#define GQP_INTERNAL_H

#include "greqprof.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define GQP__HIDDEN __attribute__((visibility("hidden")))

/* ---- memory (alloc.c): every allocation goes through these ---------- */
GQP__HIDDEN void *gqp__malloc(size_t n);
GQP__HIDDEN void *gqp__calloc(size_t count, size_t size);
GQP__HIDDEN void *gqp__realloc(void *p, size_t n);
GQP__HIDDEN void gqp__free(void *p);

/* ---- u64 -> u64 open-addressing map (map.c) -------------------------- */
/* Key 0 means "empty", so callers must never insert 0. */
typedef struct gqp__map {
    uint64_t *keys;
    uint64_t *vals;
    size_t cap;   /* power of two, or 0 */
    size_t len;
    bool borrowed; /* keys/vals are the caller's until the map grows */
} gqp__map;

GQP__HIDDEN void gqp__map_init(gqp__map *m);
/* A map that starts in the caller's arrays (cap a power of two, e.g. on
 * the stack): no allocation until it outgrows them. */
GQP__HIDDEN void gqp__map_init_buf(gqp__map *m, uint64_t *keys,
                                   uint64_t *vals, size_t cap);
GQP__HIDDEN void gqp__map_free(gqp__map *m);
GQP__HIDDEN void gqp__map_clear(gqp__map *m);
/* Pointer to the value of key, or NULL.  Inline: it is on the per-call
 * path. */
static inline uint64_t *gqp__map_get(const gqp__map *m, uint64_t key)
{
    if (m->cap == 0 || key == 0) {
        return NULL;
    }
    size_t mask = m->cap - 1;
    /* Fibonacci hashing: object addresses have zero low bits. */
    for (size_t i = (size_t)((key * 0x9E3779B97F4A7C15ull) >> 17) & mask;;
         i = (i + 1) & mask) {
        if (m->keys[i] == key) {
            return &m->vals[i];
        }
        if (m->keys[i] == 0) {
            return NULL;
        }
    }
}
/* Pointer to the value of key, inserting it with value 0 when missing
 * (*added set to true).  NULL on allocation failure. */
GQP__HIDDEN uint64_t *gqp__map_put(gqp__map *m, uint64_t key, bool *added);
GQP__HIDDEN bool gqp__map_del(gqp__map *m, uint64_t key);

/* ---- spans (spans.c) ------------------------------------------------- */
typedef struct gqp__spans {
    gqp_span *buf;
    size_t cap;     /* configured cap */
    size_t alloc;   /* allocated slots (grows to cap) */
    size_t len;     /* spans kept */
    size_t head;    /* index of the oldest kept span (ring, KEEP_LAST) */
    int policy;
    uint64_t dropped;
    bool have_longest;
    gqp_span longest;
    gqp_span longest_cpu;
} gqp__spans;

GQP__HIDDEN void gqp__spans_init(gqp__spans *s, size_t cap, int policy);
GQP__HIDDEN void gqp__spans_free(gqp__spans *s);
GQP__HIDDEN void gqp__spans_clear(gqp__spans *s);
/* Appends; returns the kept index or SIZE_MAX when dropped. */
GQP__HIDDEN size_t gqp__spans_push(gqp__spans *s, const gqp_span *span);
GQP__HIDDEN gqp_span *gqp__spans_at(const gqp__spans *s, size_t i);

/* ---- call statistics (calls.c) --------------------------------------- */
/* Which greenlet has frames of a function (or edge) active, and how many.
 * Recursion is per greenlet; this covers the common case (one greenlet at
 * a time) without a hash lookup.  When another greenlet has it active,
 * counting falls back to that greenlet's own map (tracer.c). */
typedef struct gqp__active {
    uint64_t owner;  /* greenlet id */
    uint64_t depth;
} gqp__active;

typedef struct gqp__calls {
    gqp__map func_index;  /* key -> index + 1 */
    gqp_func_stat *funcs;
    gqp__active *fact;    /* parallel to funcs */
    size_t nfuncs, funcs_alloc, max_funcs;
    gqp__map edge_index;  /* ((caller+1) << 32 | (callee+1)) -> index + 1 */
    gqp_edge_stat *edges;
    gqp__active *eact;    /* parallel to edges */
    size_t nedges, edges_alloc, max_edges;
    uint64_t dropped;
} gqp__calls;

#define GQP__NOIDX UINT32_MAX

GQP__HIDDEN void gqp__calls_init(gqp__calls *c);
GQP__HIDDEN void gqp__calls_free(gqp__calls *c);
GQP__HIDDEN void gqp__calls_clear(gqp__calls *c);
/* Index of func (inserted when new, *added set); GQP__NOIDX when full. */
GQP__HIDDEN uint32_t gqp__calls_func(gqp__calls *c, uint64_t key, bool *added);
GQP__HIDDEN uint32_t gqp__calls_edge(gqp__calls *c, uint32_t caller,
                                     uint32_t callee);

/* ---- wait sites (profile.c) ----------------------------------------- */
#define GQP__WAIT_INLINE_MAP 16    /* (a power of two) */
#define GQP__WAIT_INLINE_SITES 4
#define GQP__WAIT_INLINE_EVENTS 8

typedef struct gqp__waits {
    gqp__map index;        /* site key -> index + 1 */
    gqp_wait_stat *sites;
    size_t len, alloc, max;
    gqp__map seen;         /* greenlet id << 20 | (index + 1): the
                              (greenlet, site) pairs charged, for
                              `greenlets`; at most GQP__WAIT_PAIRS */
    uint64_t dropped;
    gqp_wait_event *events;
    size_t nev, ev_alloc, max_events;
    uint64_t events_dropped;
    /* A request waits at a few sites: the tables start here, inside the
     * profile (no allocation until they outgrow these). */
    uint64_t index_keys[GQP__WAIT_INLINE_MAP], index_vals[GQP__WAIT_INLINE_MAP];
    uint64_t seen_keys[GQP__WAIT_INLINE_MAP], seen_vals[GQP__WAIT_INLINE_MAP];
    gqp_wait_stat sites_inline[GQP__WAIT_INLINE_SITES];
    gqp_wait_event events_inline[GQP__WAIT_INLINE_EVENTS];
} gqp__waits;

#define GQP__WAIT_PAIRS 65536
#define GQP__WAIT_MAX_SITES (1 << 20) /* (the index fits 20 bits) */

/* Index of site in p's table (*added when new); GQP__NOIDX when the table
 * is full (counted) or with *nomem set when memory ran out (nothing
 * changed). */
GQP__HIDDEN uint32_t gqp__profile_wait_site(gqp_profile *p, uint64_t site,
                                            bool *added, bool *nomem);
/* Charges the wait of greenlet id from start to end to site index i. */
GQP__HIDDEN void gqp__profile_wait_charge(gqp_profile *p, uint32_t i,
                                          uint64_t id, int64_t start,
                                          int64_t end);

/* ---- profiles (profile.c) -------------------------------------------- */
typedef struct gqp__gstat {
    gqp_greenlet_stat pub;
    char *name;
    char *fn_name;
    bool has_span;
} gqp__gstat;

struct gqp_profile {
    uint32_t magic;
    _Atomic uint32_t refs; /* dropped by tracers and by the owner */
    uint64_t serial;      /* process-unique identity (span history)    */
    uint64_t generation;  /* new at creation and at every clear: call
                             stacks built against older tables are void */
    _Atomic uint32_t attached; /* live greenlets routed here by tracers */
    bool closed;
    bool has_data;
    int call_clock;       /* GQP_CLOCK_*: GQP_PROFILE_CALL_CLOCK */
    size_t max_name;
    gqp__spans spans;
    gqp__calls calls;
    gqp__map gindex;      /* greenlet id -> index + 1 */
    gqp__gstat *gstats;
    size_t ngstats, gstats_alloc, max_greenlets;
    uint64_t greenlets_dropped;
    gqp__waits waits;
    int64_t epoch_origin; /* epoch ns at creation */
    int64_t wall_origin;  /* monotonic ns at creation */
};

#define GQP__PROFILE_MAGIC 0x67717066u /* "gqpf" */
#define GQP__DEAD_MAGIC 0xdeadbeefu

GQP__HIDDEN bool gqp__profile_live(const gqp_profile *p);
/* Adds a closed span to the profile; returns kept index or SIZE_MAX.
 * *dropped is set when the span or the greenlet's totals were dropped.
 * *hint caches the index of the greenlet's totals (checked by id). */
GQP__HIDDEN size_t gqp__profile_add_span(gqp_profile *p, const gqp_span *s,
                                         bool *dropped, uint32_t *hint);
GQP__HIDDEN gqp__gstat *gqp__profile_gstat(gqp_profile *p, uint64_t id);
GQP__HIDDEN uint64_t gqp__next_serial(void);
GQP__HIDDEN uint64_t gqp__next_greenlet_id(void);

#endif /* GQP_INTERNAL_H */
