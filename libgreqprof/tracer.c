/* tracer.c -- turns switch/call/return events into spans and statistics.
 *
 * Every live greenlet has an entry with its own call stack.  A switch closes
 * the running greenlet's span and pauses its stack; the target's stack
 * resumes.  Call times are taken on a per-greenlet clock: with
 * GQP_CLOCK_CPU it only advances while that greenlet runs, so time spent in
 * other greenlets is never charged to its frames. */
#define _POSIX_C_SOURCE 200809L
#include "internal.h"

#include <stdatomic.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>

/* The event paths stay as they were without a session profile: its code
 * is kept out of line, the shared part inlined. */
#if defined(__GNUC__) || defined(__clang__)
#define GQP__NOINLINE __attribute__((noinline))
#define GQP__ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define GQP__NOINLINE
#define GQP__ALWAYS_INLINE inline
#endif

typedef struct frame {
    uint32_t func;  /* index in the profile's function table, or NOIDX */
    uint32_t edge;  /* index of the caller->func edge, or NOIDX */
    uint32_t slow;  /* FRAME_SLOW_*: counted in the greenlet's own map */
    int64_t start;  /* greenlet clock at entry */
    int64_t child;  /* inclusive time of finished callees */
} frame;

#define FRAME_SLOW_FUNC 0x1u
#define FRAME_SLOW_EDGE 0x2u

typedef struct gqp__greenlet {
    uint64_t key;
    uint64_t id;
    gqp_profile *profile;   /* attachment (a reference), NULL = default */
    gqp_profile *spawn;     /* what children inherit if not `profile` */
    int64_t span_start;     /* wall ns */
    int64_t span_cpu0;      /* estimated CPU clock at span start */
    int64_t cpu_total;      /* CPU of finished spans (greenlet clock base) */
    uint64_t stack_serial;  /* profile generation the frames' indexes
                               refer to */
    frame *stack;
    uint32_t depth, alloc;
    uint32_t lost;          /* frames above max_depth, not stored */
    bool continued;         /* the running span began at a split */
    uint32_t gstat_hint;    /* index of its totals in its profile */
    /* A wait: switched out at wait_start while attached to `profile` (of
     * generation wait_gen), at its wait site wait_site (NOIDX until the
     * caller says, gqp_tracer_wait_at).  Cleared when its profile changes. */
    bool wait_pending;
    uint32_t wait_site;
    int64_t wait_start;
    uint64_t wait_gen;
    gqp__map rec;           /* active count per func / edge (recursion) */
    struct gqp__greenlet *next_free;
    /* The session profile's view (gqp_tracer_set_session) while g's data
     * goes to another profile: a second call stack, since frames hold
     * indexes into one profile's tables.  Only its stack fields (stack,
     * depth, alloc, lost, rec, stack_serial) and id are used.  Allocated
     * at g's first call recorded so, freed with g. */
    struct gqp__greenlet *shadow;
    uint32_t sgstat_hint;   /* index of its totals in the session profile */
} gqp__greenlet;

typedef struct hist_entry {
    uint64_t greenlet_id;
    uint64_t serial;        /* profile serial, 0 = none */
    int64_t start, end;
} hist_entry;

#define TRACER_MAGIC 0x67717472u /* "gqtr" */
/* Dead greenlets that had a profile, remembered so children that start
 * after their spawner died can still inherit it. */
#define TOMBS 256

typedef struct tomb {
    uint64_t key;
    gqp_profile *profile;  /* a reference */
} tomb;
#define FREE_POOL_MAX 256

struct gqp_tracer {
    uint32_t magic;
    int cpu_mode;
    int call_clock;
    int64_t window;
    int64_t others_window;  /* 0: window (GQP_TRACER_CPU_WINDOW_OTHERS_NS) */
    int64_t wide;           /* others_window in effect, or 0: wide_update */
    int64_t long_ns;
    uint32_t max_depth;
    size_t max_greenlets;
    gqp_clock_fn wall_fn, cpu_fn;
    void *clock_ctx;

    gqp__map gmap;          /* key -> gqp__greenlet * */
    gqp__greenlet *cur;
    gqp__greenlet *pool;
    size_t pool_len;
    gqp_profile *deflt;
    gqp_profile *session;   /* also receives every other profile's data */

    /* CPU estimator: L is the estimated thread CPU clock. */
    bool est_init;
    int64_t L, last_wall, sync_wall, offset;

    /* The span closed by the last switch. */
    bool have_last;
    gqp_span last;
    gqp_profile *last_profile;  /* a reference */
    size_t last_index;

    /* Readable from other threads (watchdogs) without touching entries. */
    _Atomic int64_t running_start;
    _Atomic uint64_t running_id;

    tomb tombs[TOMBS];
    size_t tomb_next;
    gqp__map tmap;          /* key -> index + 1 of its tomb */

    /* Greenlets attached to a profile.  While there are none (and no
     * default or session profile), nobody's waiting time is being
     * measured: spans go to no profile and skip the history. */
    size_t attached;
    /* Greenlets with a spawn profile, and tombs that hold a profile: with
     * attached, whether a new greenlet could inherit anything
     * (gqp_tracer_can_inherit). */
    size_t spawns, tombed;
    hist_entry *hist;
    size_t hist_cap, hist_len, hist_head;
    uint64_t hist_overwritten_end; /* end of the newest entry overwritten */
};

static bool tracer_live(const gqp_tracer *t)
{
    return t && t->magic == TRACER_MAGIC;
}

#define CHECK_TRACER(t)                                \
    do {                                               \
        if (!(t)) return GQP_EINVAL;                   \
        if (!tracer_live(t)) return GQP_EHANDLE;       \
    } while (0)

static int64_t real_wall(void *ctx)
{
    (void)ctx;
    return gqp_clock_wall_ns();
}

static int64_t real_cpu(void *ctx)
{
    (void)ctx;
    return gqp_clock_thread_cpu_ns();
}

/* The wider window of greenlets in no profile, or 0 when every span gets
 * the narrow one: worked out when a setting it depends on changes, not at
 * every switch. */
static void wide_update(gqp_tracer *t)
{
    t->wide = t->cpu_mode == GQP_CPU_ESTIMATE && t->others_window > t->window
              && !t->deflt && !t->session ? t->others_window : 0;
}

GQP_API int gqp_tracer_new(gqp_tracer **out)
{
    if (!out) {
        return GQP_EINVAL;
    }
    *out = NULL;
    gqp_tracer *t = gqp__calloc(1, sizeof *t);
    if (!t) {
        return GQP_ENOMEM;
    }
    t->magic = TRACER_MAGIC;
    t->cpu_mode = GQP_CPU_ESTIMATE;
    t->call_clock = GQP_CLOCK_CPU;
    t->window = 100000;
    t->max_depth = 1024;
    t->max_greenlets = (size_t)1 << 20;
    t->wall_fn = real_wall;
    t->cpu_fn = real_cpu;
    t->hist_cap = 4096;
    t->hist = gqp__malloc(t->hist_cap * sizeof *t->hist);
    if (!t->hist) {
        gqp__free(t);
        return GQP_ENOMEM;
    }
    gqp__map_init(&t->gmap);
    gqp__map_init(&t->tmap);
    *out = t;
    return GQP_OK;
}

/* Points g's spans at p (may be NULL), keeping references and the
 * profiles' attached counts right. */
static void set_profile(gqp_tracer *t, gqp__greenlet *g, gqp_profile *p)
{
    if (p == g->profile) {
        return;
    }
    t->attached += (p != NULL) - (g->profile != NULL);
    g->wait_pending = false; /* a wait is charged only where it began */
    if (p) {
        gqp_profile_retain(p);
        atomic_fetch_add(&p->attached, 1);
    }
    if (g->profile) {
        atomic_fetch_sub(&g->profile->attached, 1);
        gqp_profile_free(g->profile);
    }
    g->profile = p;
}

static void set_spawn(gqp_tracer *t, gqp__greenlet *g, gqp_profile *p)
{
    t->spawns += (p != NULL) - (g->spawn != NULL);
    if (p) {
        gqp_profile_retain(p);
    }
    gqp_profile_free(g->spawn);
    g->spawn = p;
}

static void shadow_free(gqp__greenlet *g)
{
    gqp__greenlet *sh = g->shadow;
    if (sh) {
        gqp__free(sh->stack);
        gqp__map_free(&sh->rec);
        gqp__free(sh);
        g->shadow = NULL;
    }
}

static void greenlet_release(gqp_tracer *t, gqp__greenlet *g)
{
    shadow_free(g);
    set_profile(t, g, NULL);
    set_spawn(t, g, NULL);
    gqp__free(g->stack);
    gqp__map_free(&g->rec);
    gqp__free(g);
}

GQP_API void gqp_tracer_free(gqp_tracer *t)
{
    if (!tracer_live(t)) {
        return;
    }
    for (size_t i = 0; i < t->gmap.cap; i++) {
        if (t->gmap.keys[i]) {
            greenlet_release(t, (gqp__greenlet *)(uintptr_t)t->gmap.vals[i]);
        }
    }
    gqp__map_free(&t->gmap);
    while (t->pool) {
        gqp__greenlet *n = t->pool->next_free;
        gqp__free(t->pool);
        t->pool = n;
    }
    for (size_t i = 0; i < TOMBS; i++) {
        gqp_profile_free(t->tombs[i].profile);
    }
    gqp__map_free(&t->tmap);
    gqp_profile_free(t->deflt);
    gqp_profile_free(t->session);
    gqp_profile_free(t->last_profile);
    gqp__free(t->hist);
    t->magic = 0;
    gqp__free(t);
}

GQP_API int gqp_tracer_set(gqp_tracer *t, gqp_tracer_param param,
                           int64_t value)
{
    CHECK_TRACER(t);
    if (param == GQP_TRACER_LONG_SPAN_NS) {
        /* Read only when a span closes: may change at any time. */
        if (value < 0) return GQP_ERANGE;
        t->long_ns = value;
        return GQP_OK;
    }
    if (param == GQP_TRACER_CPU_WINDOW_OTHERS_NS) {
        if (value < 0) return GQP_ERANGE;
        t->others_window = value;
        wide_update(t);
        return GQP_OK;
    }
    if (param == GQP_TRACER_CPU_WINDOW_NS) {
        /* Only compared with the age of the last reading: may change at any
         * time; a smaller window takes effect at the next event. */
        if (value < 0) return GQP_ERANGE;
        t->window = value;
        wide_update(t);
        return GQP_OK;
    }
    if (t->cur) {
        return GQP_ESTATE;
    }
    switch (param) {
    case GQP_TRACER_CPU_MODE:
        if (value != GQP_CPU_OFF && value != GQP_CPU_ESTIMATE &&
            value != GQP_CPU_EXACT) {
            return GQP_ERANGE;
        }
        t->cpu_mode = (int)value;
        t->est_init = false;
        wide_update(t);
        return GQP_OK;
    case GQP_TRACER_CALL_CLOCK:
        if (value != GQP_CLOCK_CPU && value != GQP_CLOCK_WALL) {
            return GQP_ERANGE;
        }
        t->call_clock = (int)value;
        return GQP_OK;
    case GQP_TRACER_LONG_SPAN_NS:  /* handled above */
    case GQP_TRACER_CPU_WINDOW_NS:
    case GQP_TRACER_CPU_WINDOW_OTHERS_NS:
        return GQP_EINVAL;
    case GQP_TRACER_MAX_DEPTH:
        if (value < 1 || value > (1 << 24)) return GQP_ERANGE;
        t->max_depth = (uint32_t)value;
        return GQP_OK;
    case GQP_TRACER_MAX_GREENLETS:
        if (value < 1 || value > ((int64_t)1 << 30)) return GQP_ERANGE;
        t->max_greenlets = (size_t)value;
        return GQP_OK;
    case GQP_TRACER_HISTORY: {
        if (value < 0 || value > (1 << 24)) return GQP_ERANGE;
        hist_entry *h = NULL;
        if (value > 0) {
            h = gqp__malloc((size_t)value * sizeof *h);
            if (!h) return GQP_ENOMEM;
        }
        gqp__free(t->hist);
        t->hist = h;
        t->hist_cap = (size_t)value;
        t->hist_len = t->hist_head = 0;
        t->hist_overwritten_end = 0;
        return GQP_OK;
    }
    }
    return GQP_EINVAL;
}

GQP_API int gqp_tracer_get(const gqp_tracer *t, gqp_tracer_param param,
                           int64_t *value)
{
    CHECK_TRACER(t);
    if (!value) {
        return GQP_EINVAL;
    }
    switch (param) {
    case GQP_TRACER_CPU_MODE: *value = t->cpu_mode; return GQP_OK;
    case GQP_TRACER_CPU_WINDOW_NS: *value = t->window; return GQP_OK;
    case GQP_TRACER_CALL_CLOCK: *value = t->call_clock; return GQP_OK;
    case GQP_TRACER_LONG_SPAN_NS: *value = t->long_ns; return GQP_OK;
    case GQP_TRACER_MAX_DEPTH: *value = t->max_depth; return GQP_OK;
    case GQP_TRACER_MAX_GREENLETS: *value = (int64_t)t->max_greenlets; return GQP_OK;
    case GQP_TRACER_HISTORY: *value = (int64_t)t->hist_cap; return GQP_OK;
    case GQP_TRACER_CPU_WINDOW_OTHERS_NS: *value = t->others_window; return GQP_OK;
    }
    return GQP_EINVAL;
}

GQP_API int gqp_tracer_set_clocks(gqp_tracer *t, gqp_clock_fn wall,
                                  gqp_clock_fn cpu, void *ctx)
{
    CHECK_TRACER(t);
    if (t->cur) {
        return GQP_ESTATE;
    }
    t->wall_fn = wall ? wall : real_wall;
    t->cpu_fn = cpu ? cpu : real_cpu;
    t->clock_ctx = ctx;
    t->est_init = false;
    return GQP_OK;
}

GQP_API int gqp_tracer_set_default(gqp_tracer *t, gqp_profile *p)
{
    CHECK_TRACER(t);
    if (p && !gqp__profile_live(p)) {
        return GQP_EHANDLE;
    }
    if (p) {
        gqp_profile_retain(p);
    }
    gqp_profile_free(t->deflt);
    t->deflt = p;
    wide_update(t);
    return GQP_OK;
}

static void shadow_reset(gqp__greenlet *g, gqp_profile *s);

GQP_API int gqp_tracer_set_session(gqp_tracer *t, gqp_profile *p)
{
    CHECK_TRACER(t);
    if (p && !gqp__profile_live(p)) {
        return GQP_EHANDLE;
    }
    if (p == t->session) {
        return GQP_OK;
    }
    /* The session stacks hold the old session's indexes. */
    for (size_t i = 0; i < t->gmap.cap; i++) {
        if (t->gmap.keys[i]) {
            shadow_reset((gqp__greenlet *)(uintptr_t)t->gmap.vals[i],
                         t->session);
        }
    }
    if (p) {
        gqp_profile_retain(p);
    }
    gqp_profile_free(t->session);
    t->session = p;
    wide_update(t);
    return GQP_OK;
}

/* ---- the CPU estimator ------------------------------------------------ */

/* Estimated thread CPU clock at wall time `now`.  Between readings of the
 * real clock it advances with wall time; each reading puts it back on the
 * real clock (it may step back), so its error never exceeds the off-CPU time
 * within one window. */
static inline int64_t cpu_at_within(gqp_tracer *t, int64_t now, bool force,
                                    int64_t window);

static inline int64_t cpu_at(gqp_tracer *t, int64_t now, bool force)
{
    return cpu_at_within(t, now, force, t->window);
}

static inline int64_t cpu_at_within(gqp_tracer *t, int64_t now, bool force,
                                    int64_t window)
{
    if (!t->est_init) {
        int64_t c = t->cpu_fn(t->clock_ctx);
        t->offset = now - c;
        t->L = c;
        t->last_wall = t->sync_wall = now;
        t->est_init = true;
        return t->L;
    }
    int64_t gap = now - t->last_wall;
    if (gap > 0) {
        t->L += gap;
        t->last_wall = now;
    }
    if (force || now - t->sync_wall >= window) {
        t->L = t->cpu_fn(t->clock_ctx);
        t->sync_wall = now;
    }
    return t->L;
}

static inline int64_t wall_now(gqp_tracer *t)
{
#ifdef CLOCK_MONOTONIC
    if (t->wall_fn == real_wall) {
        /* The real clock, read inline: this is on the per-call path. */
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
    }
#endif
    return t->wall_fn(t->clock_ctx);
}

/* The call clock of profile p's frames (GQP_CLOCK_CPU or GQP_CLOCK_WALL):
 * its own, else the tracer's. */
static inline int clock_of(const gqp_tracer *t, const gqp_profile *p)
{
    return p && p->call_clock != GQP_CLOCK_TRACER ? p->call_clock
                                                  : t->call_clock;
}

/* Greenlet clock of g (`clock`: clock_of) at wall `now` given the
 * estimated CPU clock L. */
static inline int64_t gclock_at(int clock, const gqp__greenlet *g,
                                int64_t now, int64_t L)
{
    if (clock == GQP_CLOCK_WALL) {
        return now;
    }
    int64_t run = L - g->span_cpu0;
    return g->cpu_total + (run > 0 ? run : 0);
}

/* Greenlet clock of a paused greenlet (or the running one after its span
 * was closed). */
static inline int64_t gclock_paused(int clock, const gqp__greenlet *g,
                                    int64_t now)
{
    return clock == GQP_CLOCK_WALL ? now : g->cpu_total;
}

/* The clock a greenlet's frames are timed with. */
static inline int64_t greenlet_clock(gqp_tracer *t, int clock,
                                     gqp__greenlet *g, int64_t now)
{
    if (clock == GQP_CLOCK_WALL) {
        return now; /* without touching the CPU estimator */
    }
    return gclock_at(clock, g, now,
                     t->cpu_mode == GQP_CPU_OFF ? now : cpu_at(t, now, false));
}

/* ---- greenlet entries ------------------------------------------------- */

static gqp__greenlet *lookup(const gqp_tracer *t, uint64_t key)
{
    uint64_t *v = gqp__map_get(&t->gmap, key);
    return v ? (gqp__greenlet *)(uintptr_t)*v : NULL;
}

/* Empties tomb i (a map lookup, not a scan: create() runs per greenlet). */
static void tomb_clear(gqp_tracer *t, size_t i)
{
    tomb *tb = &t->tombs[i];
    if (tb->key) {
        uint64_t *v = gqp__map_get(&t->tmap, tb->key);
        if (v && *v == i + 1) {
            gqp__map_del(&t->tmap, tb->key);
        }
    }
    if (tb->profile) {
        t->tombed--;
    }
    gqp_profile_free(tb->profile);
    tb->key = 0;
    tb->profile = NULL;
}

static gqp__greenlet *create(gqp_tracer *t, uint64_t key)
{
    if (t->gmap.len >= t->max_greenlets) {
        return NULL;
    }
    gqp__greenlet *g = t->pool;
    if (g) {
        t->pool = g->next_free;
        t->pool_len--;
    } else {
        g = gqp__malloc(sizeof *g);
        if (!g) {
            return NULL;
        }
    }
    memset(g, 0, sizeof *g);
    bool added;
    uint64_t *v = gqp__map_put(&t->gmap, key, &added);
    if (!v) {
        gqp__free(g);
        return NULL;
    }
    *v = (uint64_t)(uintptr_t)g;
    g->key = key;
    g->id = gqp__next_greenlet_id();
    /* The key is live again, so the dead greenlet it named is gone. */
    uint64_t *tv = gqp__map_get(&t->tmap, key);
    if (tv) {
        tomb_clear(t, (size_t)(*tv - 1));
    }
    gqp__map_init(&g->rec);
    return g;
}

/* Gives back the owner counts of g's frames without recording them (the
 * frames are being discarded), when the profile they index is still here:
 * otherwise g would look recursive the next time it calls them. */
static void discard_in(gqp__greenlet *g, gqp_profile *p);

static void discard_frames(gqp_tracer *t, gqp__greenlet *g)
{
    gqp_profile *p = NULL;
    if (g->profile && g->profile->generation == g->stack_serial) {
        p = g->profile;
    } else if (t->deflt && t->deflt->generation == g->stack_serial) {
        p = t->deflt;
    }
    if (p) {
        discard_in(g, p);
    }
}

/* discard_frames() for a stack whose frames index p. */
static void discard_in(gqp__greenlet *g, gqp_profile *p)
{
    for (uint32_t i = 0; i < g->depth; i++) {
        const frame *f = &g->stack[i];
        if (f->func != GQP__NOIDX && !(f->slow & FRAME_SLOW_FUNC)) {
            gqp__active *a = &p->calls.fact[f->func];
            if (a->owner == g->id && a->depth > 0) {
                a->depth--;
            }
        }
        if (f->edge != GQP__NOIDX && !(f->slow & FRAME_SLOW_EDGE)) {
            gqp__active *a = &p->calls.eact[f->edge];
            if (a->owner == g->id && a->depth > 0) {
                a->depth--;
            }
        }
    }
}

static void reset_stack(gqp__greenlet *g, uint64_t serial)
{
    g->depth = 0;
    g->lost = 0;
    gqp__map_clear(&g->rec);
    g->stack_serial = serial;
}

/* Empties g's session stack; its frames' owner counts go back to s when
 * they index it (s: the session they were recorded for, may be NULL). */
static void shadow_reset(gqp__greenlet *g, gqp_profile *s)
{
    gqp__greenlet *sh = g->shadow;
    if (!sh) {
        return;
    }
    if (sh->depth && s && s->generation == sh->stack_serial) {
        discard_in(sh, s);
    }
    reset_stack(sh, 0); /* (0 is no profile's generation) */
}

static void destroy(gqp_tracer *t, gqp__greenlet *g)
{
    gqp_profile *heir = g->spawn ? g->spawn : g->profile;
    if (heir && !heir->closed) {
        uint64_t *old = gqp__map_get(&t->tmap, g->key);
        if (old) {
            tomb_clear(t, (size_t)(*old - 1));
        }
        size_t i = t->tomb_next;
        t->tomb_next = (i + 1) % TOMBS;
        tomb_clear(t, i);
        bool added;
        uint64_t *v = gqp__map_put(&t->tmap, g->key, &added);
        if (v) { /* (out of memory: no tomb, children inherit nothing) */
            *v = i + 1;
            gqp_profile_retain(heir);
            t->tombs[i].key = g->key;
            t->tombs[i].profile = heir;
            t->tombed++;
        }
    }
    gqp__map_del(&t->gmap, g->key);
    if (t->cur == g) {
        t->cur = NULL;
    }
    shadow_free(g);
    set_profile(t, g, NULL);
    set_spawn(t, g, NULL);
    gqp__free(g->stack);
    gqp__map_free(&g->rec);
    if (t->pool_len < FREE_POOL_MAX) {
        g->next_free = t->pool;
        t->pool = g;
        t->pool_len++;
    } else {
        gqp__free(g);
    }
}

/* The profile a greenlet's data goes to now.  Closed attachments are
 * dropped here, and a stack built for another profile is discarded, since
 * its frames hold that profile's indexes. */
static gqp_profile *effective_slow(gqp_tracer *t, gqp__greenlet *g);

/* The fast path of effective(): the greenlet's stack already belongs to
 * the open profile it is routed to. */
static inline gqp_profile *effective(gqp_tracer *t, gqp__greenlet *g)
{
    gqp_profile *p = g->profile ? g->profile : t->deflt;
    if (p && !p->closed && p->generation == g->stack_serial) {
        return p;
    }
    return effective_slow(t, g);
}

static gqp_profile *effective_slow(gqp_tracer *t, gqp__greenlet *g)
{
    if (g->profile && g->profile->closed) {
        set_profile(t, g, NULL);
    }
    gqp_profile *p = g->profile;
    if (!p && t->deflt && !t->deflt->closed) {
        p = t->deflt;
    }
    uint64_t gen = p ? p->generation : 0;
    if (gen != g->stack_serial) {
        if (g->depth) {
            discard_frames(t, g);
        }
        reset_stack(g, gen);
        /* Routed elsewhere (its profile closed, the default changed): the
         * session stack restarts too, so that it and the main stack never
         * both hold frames of the session profile. */
        shadow_reset(g, t->session);
    }
    return p;
}

static void history_push(gqp_tracer *t, const gqp_span *s, uint64_t serial)
{
    if (t->hist_cap == 0) {
        return;
    }
    /* (a neighbour of a sampled request pays this per span: no
     * divisions) */
    size_t i = t->hist_head + t->hist_len;
    if (i >= t->hist_cap) {
        i -= t->hist_cap;
    }
    if (t->hist_len < t->hist_cap) {
        t->hist_len++;
    } else {   /* (full: i is the oldest, head) */
        t->hist_overwritten_end = (uint64_t)t->hist[i].end;
        t->hist_head = i + 1 < t->hist_cap ? i + 1 : 0;
    }
    hist_entry *h = &t->hist[i];
    h->greenlet_id = s->greenlet_id;
    h->serial = serial;
    h->start = s->start_ns;
    h->end = s->end_ns;
}

/* The session profile's copy of g's span s (out of line: rare). */
static GQP__NOINLINE void session_span(gqp_tracer *t, gqp__greenlet *g,
                                       const gqp_span *s)
{
    if (!t->session->closed) {
        bool dropped; /* (counted in the session profile) */
        gqp__profile_add_span(t->session, s, &dropped, &g->sgstat_hint);
    }
}

/* Ends g's running span at `now`.  Returns GQP_EV_* flags. */
static int close_span(gqp_tracer *t, gqp__greenlet *g, int64_t now, int64_t L,
                      uint32_t flags)
{
    int ev = 0;
    gqp_span s;
    s.greenlet_id = g->id;
    s.start_ns = g->span_start;
    s.end_ns = now > g->span_start ? now : g->span_start;
    int64_t run = L - g->span_cpu0;
    if (run < 0) {
        run = 0;
    }
    s.cpu_ns = t->cpu_mode == GQP_CPU_OFF ? -1 : run;
    s.flags = flags | (g->continued ? GQP_SPAN_CONTINUED : 0);
    g->continued = false;
    s.tag = 0;
    g->cpu_total += run;
    if (t->long_ns > 0 && s.end_ns - s.start_ns >= t->long_ns) {
        s.flags |= GQP_SPAN_LONG;
        ev |= GQP_EV_LONG_SPAN;
    }
    /* (an unattached greenlet with no stack to drop goes to no profile:
     * the common case of a server's unsampled requests) */
    gqp_profile *p = g->profile || t->deflt || g->stack_serial
                         ? effective(t, g) : NULL;
    size_t idx = SIZE_MAX;
    if (p) {
        bool dropped;
        idx = gqp__profile_add_span(p, &s, &dropped, &g->gstat_hint);
        if (dropped) {
            ev |= GQP_EV_DROPPED;
        }
    }
    if (t->session && t->session != p) {
        session_span(t, g, &s);
    }
    if (p || t->attached || t->session) {
        history_push(t, &s, p ? p->serial : 0);
    }
    if (p != t->last_profile) {
        /* Switches mostly stay within one profile: skip the atomics. */
        if (p) {
            gqp_profile_retain(p);
        }
        gqp_profile_free(t->last_profile);
        t->last_profile = p;
    }
    t->last = s;
    t->last_index = idx;
    t->have_last = true;
    return ev;
}

static void start_span(gqp_tracer *t, gqp__greenlet *g, int64_t now,
                       int64_t L)
{
    g->span_start = now;
    g->span_cpu0 = L;
    g->continued = false;
    t->cur = g;
    atomic_store_explicit(&t->running_start, now, memory_order_relaxed);
    atomic_store_explicit(&t->running_id, g->id, memory_order_relaxed);
}

/* Ends g's pending wait at `now`, charging it to its site when g is
 * still in the profile (and generation) it waited in. */
static void end_wait(gqp__greenlet *g, int64_t now)
{
    gqp_profile *p = g->profile;
    g->wait_pending = false;
    if (p && !p->closed && p->generation == g->wait_gen &&
        g->wait_site != GQP__NOIDX) {
        gqp__profile_wait_charge(p, g->wait_site, g->id, g->wait_start,
                                 now);
    }
}

/* g switches out alive at `now`: a wait begins when g is attached to an
 * open profile that accounts waits.  Returns GQP_EV_WAIT then. */
static inline int begin_wait(gqp__greenlet *g, int64_t now)
{
    gqp_profile *p = g->profile;
    if (!p || p->closed || p->waits.max == 0) {
        return 0;
    }
    g->wait_pending = true;
    g->wait_site = GQP__NOIDX;
    g->wait_start = now;
    g->wait_gen = p->generation;
    return GQP_EV_WAIT;
}

static inline int64_t span_clock(gqp_tracer *t, int64_t now)
{
    if (t->cpu_mode == GQP_CPU_OFF) {
        return now;
    }
    return cpu_at(t, now, t->cpu_mode == GQP_CPU_EXACT);
}

/* Pops every frame of g into its profile at greenlet clock `gnow`. */
static void unwind(gqp_tracer *t, gqp__greenlet *g, gqp_profile *p,
                   int64_t gnow);
static gqp__greenlet *session_stack(gqp_tracer *t, gqp__greenlet *g,
                                    gqp_profile *p, gqp_profile **sp);

/* ---- events ----------------------------------------------------------- */

GQP_API int gqp_tracer_switch(gqp_tracer *t, uint64_t from, uint64_t to,
                              unsigned flags)
{
    CHECK_TRACER(t);
    if (to == 0 || (flags & ~(unsigned)GQP_SWITCH_FROM_DEAD)) {
        return GQP_EINVAL;
    }
    int ev = 0;
    int64_t now = wall_now(t);
    gqp__greenlet *g = t->cur;
    if (from != 0 && (!g || g->key != from)) {
        /* We missed a switch (or tracing started elsewhere): trust `from`. */
        g = lookup(t, from);
    }
    /* (a span of a greenlet in no profile may take the wider window, at
     * both ends: see GQP_TRACER_CPU_WINDOW_OTHERS_NS) */
    int64_t wide = t->wide;
    bool narrow = !wide || (g && g == t->cur && g->profile);
    int64_t L = narrow ? span_clock(t, now)
                       : cpu_at_within(t, now, false, wide);
    if (g && g == t->cur) {
        bool dead = flags & GQP_SWITCH_FROM_DEAD;
        ev |= close_span(t, g, now, L, dead ? GQP_SPAN_FINISHED : 0);
        if (dead) {
            gqp_profile *p = effective(t, g);
            if (p && g->depth) {
                unwind(t, g, p, gclock_paused(clock_of(t, p), g, now));
            }
            gqp_profile *s;
            gqp__greenlet *sh = g->shadow ? session_stack(t, g, p, &s)
                                          : NULL;
            if (sh && sh->depth) {
                unwind(t, sh, s, gclock_paused(clock_of(t, s), g, now));
            }
            destroy(t, g);
        } else {
            ev |= begin_wait(g, now);
        }
    } else if (g && (flags & GQP_SWITCH_FROM_DEAD)) {
        destroy(t, g);
    }
    t->cur = NULL;
    gqp__greenlet *n = lookup(t, to);
    if (!n) {
        n = create(t, to);
        if (!n) {
            atomic_store_explicit(&t->running_id, 0, memory_order_relaxed);
            return ev | GQP_EV_DROPPED;
        }
        ev |= GQP_EV_NEW_GREENLET;
    } else if (n->wait_pending) {
        end_wait(n, now);
    }
    if (!narrow && n->profile) {
        L = span_clock(t, now); /* (its span starts with the narrow one) */
    }
    start_span(t, n, now, L);
    if (from == 0) {
        n->continued = true; /* tracing began while it ran: no switch */
    }
    return ev;
}

static GQP__ALWAYS_INLINE bool push_frame(gqp__greenlet *g, uint32_t func,
                                          uint32_t edge, uint32_t slow,
                                          int64_t start)
{
    if (g->depth == g->alloc) {
        uint32_t n = g->alloc ? g->alloc * 2 : 16;
        frame *ns = gqp__realloc(g->stack, n * sizeof *ns);
        if (!ns) {
            return false;
        }
        g->stack = ns;
        g->alloc = n;
    }
    frame *f = &g->stack[g->depth++];
    f->func = func;
    f->edge = edge;
    f->slow = slow;
    f->start = start;
    f->child = 0;
    return true;
}

/* Active-frame counters live in g->rec: key func+1 for a function, the edge
 * key (caller+1)<<32 | (callee+1) for a pair; both are never 0. */
static inline uint64_t func_rkey(uint32_t func)
{
    return (uint64_t)func + 1;
}

static inline uint64_t edge_rkey(uint32_t edge)
{
    return ((uint64_t)edge + 1) << 32;
}

/* Counts one more active frame of a function/edge in greenlet g: in the
 * entry's owner slot when g owns it (or nobody has it active), else in g's
 * own map (slow path, flagged in *slow).  false: no memory. */
static inline bool enter(gqp__greenlet *g, gqp__active *a, uint64_t rkey,
                         uint32_t *slow, uint32_t flag)
{
    if (a->owner == g->id) {
        a->depth++;
        return true;
    }
    if (a->depth == 0) {
        /* Nobody else has it active; take it unless g counts it in its
         * own map already (it was entered while another greenlet owned
         * it). */
        uint64_t *cnt = g->rec.len ? gqp__map_get(&g->rec, rkey) : NULL;
        if (!cnt || *cnt == 0) {
            a->owner = g->id;
            a->depth = 1;
            return true;
        }
    }
    bool fresh;
    uint64_t *cnt = gqp__map_put(&g->rec, rkey, &fresh);
    if (!cnt) {
        return false;
    }
    ++*cnt;
    *slow |= flag;
    return true;
}

/* Undoes enter(); returns true when the frame was the outermost active
 * one (its inclusive time counts). */
static inline bool leave(gqp__greenlet *g, gqp__active *a, uint64_t rkey,
                         uint32_t slow)
{
    if (!slow) {
        return a->owner == g->id && a->depth > 0 && --a->depth == 0;
    }
    uint64_t *cnt = gqp__map_get(&g->rec, rkey);
    return cnt && *cnt > 0 && --*cnt == 0;
}

/* The session stack of g while g's data goes to p, with the session
 * profile in *sp; NULL when there is no session or p is it. */
static gqp__greenlet *session_stack(gqp_tracer *t, gqp__greenlet *g,
                                    gqp_profile *p, gqp_profile **sp)
{
    gqp_profile *s = t->session;
    if (!s || s == p || s->closed) {
        return NULL;
    }
    gqp__greenlet *sh = g->shadow;
    if (!sh) {
        sh = gqp__calloc(1, sizeof *sh);
        if (!sh) {
            s->calls.dropped++;
            return NULL;
        }
        sh->key = g->key;
        sh->id = g->id; /* (owner of the session's recursion slots) */
        gqp__map_init(&sh->rec);
        sh->stack_serial = s->generation;
        g->shadow = sh;
    } else if (sh->stack_serial != s->generation) {
        /* The session profile was cleared: its tables are new. */
        reset_stack(sh, s->generation);
    }
    *sp = s;
    return sh;
}

static GQP__ALWAYS_INLINE int call_in(gqp_tracer *t, gqp__greenlet *g,
                                      gqp_profile *p, uint64_t func,
                                      int64_t start);

/* gqp_tracer_call with a session profile: the call goes to g's profile
 * (if any) and to the session's on its own stack. */
static GQP__NOINLINE int call_with_session(gqp_tracer *t, gqp__greenlet *g,
                                           gqp_profile *p, uint64_t func)
{
    int64_t now = wall_now(t);
    int pc = clock_of(t, p);
    int64_t start = greenlet_clock(t, pc, g, now);
    int ev = p ? call_in(t, g, p, func, start) : 0;
    gqp_profile *s;
    gqp__greenlet *sh = session_stack(t, g, p, &s);
    if (sh) {
        int sc = clock_of(t, s);
        ev |= call_in(t, sh, s, func,
                      sc == pc ? start : greenlet_clock(t, sc, g, now));
    }
    return ev;
}

GQP_API int gqp_tracer_call(gqp_tracer *t, uint64_t func)
{
    CHECK_TRACER(t);
    if (func == 0) {
        return GQP_EINVAL;
    }
    gqp__greenlet *g = t->cur;
    if (!g) {
        return 0;
    }
    gqp_profile *p = effective(t, g);
    if (t->session) {
        return call_with_session(t, g, p, func);
    }
    if (!p) {
        return 0;
    }
    return call_in(t, g, p, func,
                   greenlet_clock(t, clock_of(t, p), g, wall_now(t)));
}

/* Pushes func on stack g (g's own, or its session stack) for profile p,
 * entered at greenlet clock `start`. */
static GQP__ALWAYS_INLINE int call_in(gqp_tracer *t, gqp__greenlet *g,
                                      gqp_profile *p, uint64_t func,
                                      int64_t start)
{
    p->has_data = true;
    if (g->lost || g->depth >= t->max_depth) {
        g->lost++;
        p->calls.dropped++;
        return GQP_EV_DROPPED;
    }
    int ev = 0;
    bool added = false;
    uint32_t idx = gqp__calls_func(&p->calls, func, &added);
    uint32_t edge = GQP__NOIDX;
    uint32_t slow = 0;
    if (idx == GQP__NOIDX) {
        p->calls.dropped++;
        ev |= GQP_EV_DROPPED;
    } else {
        if (added) {
            ev |= GQP_EV_NEW_FUNC;
        }
        if (!enter(g, &p->calls.fact[idx], func_rkey(idx), &slow,
                   FRAME_SLOW_FUNC)) {
            p->calls.dropped++;
            idx = GQP__NOIDX;
            ev |= GQP_EV_DROPPED;
        } else {
            uint32_t caller = g->depth ? g->stack[g->depth - 1].func
                                       : GQP__NOIDX;
            if (caller != GQP__NOIDX) {
                edge = gqp__calls_edge(&p->calls, caller, idx);
                if (edge == GQP__NOIDX ||
                    !enter(g, &p->calls.eact[edge], edge_rkey(edge), &slow,
                           FRAME_SLOW_EDGE)) {
                    edge = GQP__NOIDX;
                    p->calls.dropped++;
                    ev |= GQP_EV_DROPPED;
                }
            }
        }
    }
    if (!push_frame(g, idx, edge, slow, start)) {
        /* Keep the stack in step with the interpreter's. */
        if (idx != GQP__NOIDX) {
            leave(g, &p->calls.fact[idx], func_rkey(idx),
                  slow & FRAME_SLOW_FUNC);
        }
        if (edge != GQP__NOIDX) {
            leave(g, &p->calls.eact[edge], edge_rkey(edge),
                  slow & FRAME_SLOW_EDGE);
        }
        g->lost++;
        p->calls.dropped++;
        return ev | GQP_EV_DROPPED;
    }
    return ev;
}

/* Pops g's top frame at greenlet clock gnow. */
static void pop_frame(gqp__greenlet *g, gqp_profile *p, int64_t gnow)
{
    frame *f = &g->stack[--g->depth];
    int64_t tt = gnow - f->start;
    if (tt < 0) {
        tt = 0;
    }
    int64_t sub = tt - f->child;
    if (sub < 0) {
        sub = 0;
    }
    if (f->func != GQP__NOIDX) {
        gqp_func_stat *fs = &p->calls.funcs[f->func];
        fs->ncall++;
        if (leave(g, &p->calls.fact[f->func], func_rkey(f->func),
                  f->slow & FRAME_SLOW_FUNC)) {
            fs->nactual++;
            fs->ttot_ns += tt;
        }
        fs->tsub_ns += sub;
        if (f->edge != GQP__NOIDX) {
            gqp_edge_stat *es = &p->calls.edges[f->edge];
            es->ncall++;
            if (leave(g, &p->calls.eact[f->edge], edge_rkey(f->edge),
                      f->slow & FRAME_SLOW_EDGE)) {
                es->nactual++;
                es->ttot_ns += tt;
            }
            es->tsub_ns += sub;
        }
    }
    if (g->depth > 0) {
        g->stack[g->depth - 1].child += tt;
    }
}

static void unwind(gqp_tracer *t, gqp__greenlet *g, gqp_profile *p,
                   int64_t gnow)
{
    (void)t;
    g->lost = 0;
    while (g->depth > 0) {
        pop_frame(g, p, gnow);
    }
}

/* gqp_tracer_return with a session profile: pops g's stack and its
 * session stack, each of which may have lost or missed the frame. */
static GQP__NOINLINE int return_with_session(gqp_tracer *t,
                                             gqp__greenlet *g,
                                             gqp_profile *p)
{
    int64_t now = 0;
    if (p) {
        if (g->lost) {
            g->lost--;
        } else if (g->depth) {
            now = wall_now(t);
            pop_frame(g, p, greenlet_clock(t, clock_of(t, p), g, now));
        }
    }
    gqp_profile *s;
    gqp__greenlet *sh = session_stack(t, g, p, &s);
    if (sh) {
        if (sh->lost) {
            sh->lost--;
        } else if (sh->depth) {
            if (!now) {
                now = wall_now(t);
            }
            pop_frame(sh, s, greenlet_clock(t, clock_of(t, s), g, now));
        }
    }
    return 0;
}

GQP_API int gqp_tracer_return(gqp_tracer *t)
{
    CHECK_TRACER(t);
    gqp__greenlet *g = t->cur;
    if (!g) {
        return 0;
    }
    gqp_profile *p = effective(t, g);
    if (t->session) {
        return return_with_session(t, g, p);
    }
    if (!p) {
        return 0;
    }
    if (g->lost) {
        g->lost--;
        return 0;
    }
    if (g->depth == 0) {
        /* A frame entered before tracing (or attachment) began. */
        return 0;
    }
    pop_frame(g, p, greenlet_clock(t, clock_of(t, p), g, wall_now(t)));
    return 0;
}

/* ---- attachment ------------------------------------------------------- */

GQP_API int gqp_tracer_attach(gqp_tracer *t, uint64_t greenlet,
                              gqp_profile *p)
{
    CHECK_TRACER(t);
    if (greenlet == 0) {
        return GQP_EINVAL;
    }
    if (p && !gqp__profile_live(p)) {
        return GQP_EHANDLE;
    }
    if (p && p->closed) {
        return GQP_ESTATE;
    }
    gqp__greenlet *g = lookup(t, greenlet);
    if (!g) {
        g = create(t, greenlet);
        if (!g) {
            return t->gmap.len >= t->max_greenlets ? GQP_ELIMIT : GQP_ENOMEM;
        }
    }
    int ev = 0;
    if (g == t->cur) {
        int64_t now = wall_now(t);
        int64_t L = span_clock(t, now);
        gqp_profile *old = effective(t, g);
        if (old && g->depth) {
            unwind(t, g, old, gclock_at(clock_of(t, old), g, now, L));
        }
        gqp__greenlet *sh = g->shadow;
        gqp_profile *s = t->session;
        if (sh && sh->depth && s && !s->closed &&
            s->generation == sh->stack_serial) {
            /* (the session sees the same split) */
            unwind(t, sh, s, gclock_at(clock_of(t, s), g, now, L));
        }
        ev = close_span(t, g, now, L, GQP_SPAN_SPLIT);
        start_span(t, g, now, L);
        g->continued = true;
    }
    if (g->depth) {
        discard_frames(t, g); /* a paused greenlet's frames */
    }
    shadow_reset(g, t->session);
    set_profile(t, g, p);
    set_spawn(t, g, NULL);
    gqp_profile *eff = effective(t, g);
    reset_stack(g, eff ? eff->generation : 0);
    return ev & GQP_EV_LONG_SPAN;
}

GQP_API int gqp_tracer_inherit(gqp_tracer *t, uint64_t child, uint64_t parent)
{
    CHECK_TRACER(t);
    if (child == 0 || parent == 0) {
        return GQP_EINVAL;
    }
    gqp__greenlet *pg = lookup(t, parent);
    gqp_profile *p = NULL;
    if (pg) {
        p = pg->spawn ? pg->spawn : pg->profile;
    } else {
        uint64_t *tv = gqp__map_get(&t->tmap, parent);
        if (!tv) {
            return GQP_ENOTFOUND;
        }
        p = t->tombs[*tv - 1].profile;
    }
    gqp__greenlet *cg = lookup(t, child);
    if (!p && cg && !cg->profile) {
        return GQP_OK;   /* (the common case: a neighbour's child) */
    }
    /* create() may release the tomb that holds p (same key): keep it. */
    if (p) {
        gqp_profile_retain(p);
    }
    int rc = GQP_OK;
    if (!cg) {
        cg = create(t, child);
        if (!cg) {
            rc = t->gmap.len >= t->max_greenlets ? GQP_ELIMIT : GQP_ENOMEM;
        }
    }
    if (cg && cg != pg) {
        gqp_profile *np = p && !p->closed ? p : NULL;
        if (np && !cg->profile && !cg->depth && cg == t->cur && t->wide) {
            /* A new greenlet's span began with the wide window (most new
             * greenlets are neighbours' while a sample is open: they do not
             * read the clock); this one joins a profile, so its start is
             * set on the narrow one now, less the wall time since, which
             * it ran. */
            int64_t now = wall_now(t);
            int64_t ran = now - cg->span_start;
            cg->span_cpu0 = span_clock(t, now) - (ran > 0 ? ran : 0);
        }
        set_profile(t, cg, np);
    }
    gqp_profile_free(p);
    return rc;
}

GQP_API int gqp_tracer_can_inherit(const gqp_tracer *t)
{
    if (!tracer_live(t)) {
        return GQP_EHANDLE;
    }
    return t->attached || t->spawns || t->tombed;
}

GQP_API int gqp_tracer_set_spawn_profile(gqp_tracer *t, uint64_t greenlet,
                                         gqp_profile *p)
{
    CHECK_TRACER(t);
    if (greenlet == 0) {
        return GQP_EINVAL;
    }
    if (p && !gqp__profile_live(p)) {
        return GQP_EHANDLE;
    }
    gqp__greenlet *g = lookup(t, greenlet);
    if (!g) {
        return GQP_ENOTFOUND;
    }
    set_spawn(t, g, p);
    return GQP_OK;
}

/* ---- queries ---------------------------------------------------------- */

GQP_API int gqp_tracer_current(const gqp_tracer *t, uint64_t *key,
                               uint64_t *id, gqp_profile **profile)
{
    CHECK_TRACER(t);
    gqp__greenlet *g = t->cur;
    if (!g) {
        return GQP_ENOTFOUND;
    }
    if (key) *key = g->key;
    if (id) *id = g->id;
    if (profile) {
        gqp_profile *p = g->profile && !g->profile->closed ? g->profile : NULL;
        if (!p && t->deflt && !t->deflt->closed) {
            p = t->deflt;
        }
        *profile = p;
    }
    return GQP_OK;
}

GQP_API int gqp_tracer_greenlet_profile(const gqp_tracer *t, uint64_t key,
                                        gqp_profile **profile)
{
    CHECK_TRACER(t);
    if (key == 0 || !profile) {
        return GQP_EINVAL;
    }
    gqp__greenlet *g = lookup(t, key);
    if (!g) {
        return GQP_ENOTFOUND;
    }
    /* (a closed attachment is dropped at the greenlet's next event) */
    *profile = g->profile && !g->profile->closed ? g->profile : NULL;
    return GQP_OK;
}

GQP_API int gqp_tracer_greenlet_id(const gqp_tracer *t, uint64_t key,
                                   uint64_t *id)
{
    CHECK_TRACER(t);
    if (key == 0 || !id) {
        return GQP_EINVAL;
    }
    gqp__greenlet *g = lookup(t, key);
    if (!g) {
        return GQP_ENOTFOUND;
    }
    *id = g->id;
    return GQP_OK;
}

GQP_API int gqp_tracer_last_span(const gqp_tracer *t, gqp_span *out,
                                 gqp_profile **profile, size_t *index)
{
    CHECK_TRACER(t);
    if (!out) {
        return GQP_EINVAL;
    }
    if (!t->have_last) {
        return GQP_ENOTFOUND;
    }
    *out = t->last;
    if (profile) *profile = t->last_profile;
    if (index) *index = t->last_index;
    return GQP_OK;
}

GQP_API int gqp_tracer_running_since(const gqp_tracer *t, int64_t *start_ns,
                                     uint64_t *id)
{
    CHECK_TRACER(t);
    uint64_t gid = atomic_load_explicit(&t->running_id, memory_order_relaxed);
    if (gid == 0) {
        return GQP_ENOTFOUND;
    }
    if (start_ns) {
        *start_ns = atomic_load_explicit(&t->running_start,
                                         memory_order_relaxed);
    }
    if (id) *id = gid;
    return GQP_OK;
}

GQP_API int gqp_tracer_forget(gqp_tracer *t, uint64_t greenlet)
{
    CHECK_TRACER(t);
    if (greenlet == 0) {
        return GQP_EINVAL;
    }
    gqp__greenlet *g = lookup(t, greenlet);
    if (!g) {
        return GQP_ENOTFOUND;
    }
    if (g == t->cur) {
        return GQP_ESTATE;
    }
    destroy(t, g);
    return GQP_OK;
}

GQP_API int gqp_tracer_flush(gqp_tracer *t)
{
    return gqp_tracer_flush_ex(t, 0);
}

GQP_API int gqp_tracer_flush_ex(gqp_tracer *t, unsigned flags)
{
    CHECK_TRACER(t);
    if (flags & ~GQP_FLUSH_FOREIGN) {
        return GQP_EINVAL;
    }
    int64_t now = wall_now(t);
    int64_t L;
    if (t->cpu_mode == GQP_CPU_OFF) {
        L = now;
    } else if (flags & GQP_FLUSH_FOREIGN) {
        L = t->est_init ? t->L : 0; /* another thread's CPU clock is useless */
    } else {
        L = cpu_at(t, now, true);
    }
    gqp__greenlet *cur = t->cur;
    if (cur) {
        close_span(t, cur, now, L, GQP_SPAN_SPLIT);
    }
    for (size_t i = 0; i < t->gmap.cap; i++) {
        if (!t->gmap.keys[i]) {
            continue;
        }
        gqp__greenlet *g = (gqp__greenlet *)(uintptr_t)t->gmap.vals[i];
        if (g->wait_pending) {
            end_wait(g, now);
        }
        gqp_profile *p = effective(t, g);
        if (p && g->depth) {
            /* close_span already moved the running greenlet's clock on. */
            unwind(t, g, p, gclock_paused(clock_of(t, p), g, now));
        }
        reset_stack(g, g->stack_serial);
        gqp__greenlet *sh = g->shadow;
        gqp_profile *s = t->session;
        if (sh && sh->depth && s && !s->closed &&
            s->generation == sh->stack_serial) {
            unwind(t, sh, s, gclock_paused(clock_of(t, s), g, now));
        }
        if (sh) {
            reset_stack(sh, sh->stack_serial);
        }
    }
    t->cur = NULL;
    atomic_store_explicit(&t->running_id, 0, memory_order_relaxed);
    return GQP_OK;
}

GQP_API int gqp_tracer_wait_at(gqp_tracer *t, uint64_t greenlet,
                               uint64_t site, gqp_profile **profile,
                               size_t *index)
{
    CHECK_TRACER(t);
    if (greenlet == 0 || site == 0) {
        return GQP_EINVAL;
    }
    gqp__greenlet *g = lookup(t, greenlet);
    if (!g || !g->wait_pending) {
        return GQP_ENOTFOUND;
    }
    gqp_profile *p = g->profile;
    if (!p || p->closed || p->generation != g->wait_gen) {
        g->wait_pending = false;
        return GQP_ENOTFOUND;
    }
    bool added, nomem;
    uint32_t i = gqp__profile_wait_site(p, site, &added, &nomem);
    if (nomem) {
        return GQP_ENOMEM; /* (the wait stays pending, at no site) */
    }
    g->wait_site = i;
    if (i == GQP__NOIDX) {
        return GQP_EV_DROPPED;
    }
    if (profile) {
        *profile = p;
    }
    if (index) {
        *index = i;
    }
    return added ? GQP_EV_NEW_SITE : 0;
}

GQP_API size_t gqp_tracer_greenlet_count(const gqp_tracer *t)
{
    return tracer_live(t) ? t->gmap.len : 0;
}

/* Per greenlet, the time waited on it, or WAIT_MINE when it is one of the
 * request's own.  The map starts in arrays on the stack: a window sees a
 * few dozen greenlets, and this runs once per sampled request. */
#define WAIT_SLOTS 128
#define WAIT_MINE UINT64_MAX

/* The waited-on map of gqp_tracer_waited: gqp__map_put's probe inlined
 * (it runs once per history entry in the window, about a hundred per
 * sampled request under load), and the slots taken while the map is still
 * in its WAIT_SLOTS stack arrays marked in a bitmap, so the top-n pass
 * visits those slots, in the same (slot) order, instead of all of them.
 * Growing the map (more than WAIT_SLOTS / 2 greenlets) goes through
 * gqp__map_put and ends the bitmap (used = false: every slot is looked at,
 * as before). */
typedef struct wait_map {
    gqp__map m;
    uint64_t taken[WAIT_SLOTS / 64];
    bool used;
} wait_map;

static GQP__ALWAYS_INLINE uint64_t *wait_put(wait_map *w, uint64_t key,
                                             bool *added)
{
    gqp__map *m = &w->m;
    if (key != 0 && m->borrowed) {
        size_t mask = m->cap - 1;
        size_t i = (size_t)((key * 0x9E3779B97F4A7C15ull) >> 17) & mask;
        for (;; i = (i + 1) & mask) {
            if (m->keys[i] == key) {
                *added = false;
                return &m->vals[i];
            }
            if (m->keys[i] == 0) {
                break;
            }
        }
        if ((m->len + 1) * 2 <= m->cap) {   /* (gqp__map_put's load) */
            m->keys[i] = key;
            m->vals[i] = 0;
            m->len++;
            w->taken[i / 64] |= (uint64_t)1 << (i % 64);
            *added = true;
            return &m->vals[i];
        }
    }
    uint64_t *v = gqp__map_put(m, key, added);
    if (!m->borrowed) {
        w->used = false;   /* (grown: the slots moved) */
    }
    return v;
}

/* Index of the lowest set bit of a non-zero word. */
static inline unsigned low_bit(uint64_t x)
{
#if defined(__GNUC__) || defined(__clang__)
    return (unsigned)__builtin_ctzll(x);
#else
    unsigned k = 0;
    while (!(x & 1)) {
        x >>= 1;
        k++;
    }
    return k;
#endif
}

GQP_API int gqp_tracer_waited(const gqp_tracer *t, const gqp_profile *mine,
                              int64_t start_ns, int64_t end_ns,
                              int64_t *total_ns, uint64_t *ids, int64_t *ns,
                              size_t n, int *complete)
{
    CHECK_TRACER(t);
    if (!total_ns || (n && (!ids || !ns)) || end_ns < start_ns) {
        return GQP_EINVAL;
    }
    if (mine && !gqp__profile_live(mine)) {
        return GQP_EHANDLE;
    }
    uint64_t serial = mine ? mine->serial : 0;
    uint64_t wkeys[WAIT_SLOTS], wvals[WAIT_SLOTS];
    wait_map wm;
    gqp__map_init_buf(&wm.m, wkeys, wvals, WAIT_SLOTS);
    memset(wm.taken, 0, sizeof wm.taken);
    wm.used = true;
    gqp__map *const wmap = &wm.m;
    if (mine && atomic_load(&mine->attached) > 0) {
        /* Greenlets attached to mine now are mine all along. */
        for (size_t i = 0; i < t->gmap.cap; i++) {
            if (!t->gmap.keys[i]) {
                continue;
            }
            const gqp__greenlet *g =
                (const gqp__greenlet *)(uintptr_t)t->gmap.vals[i];
            if (g->profile != mine) {
                continue;
            }
            bool added;
            uint64_t *v = wait_put(&wm, g->id, &added);
            if (!v) {
                gqp__map_free(wmap);
                return GQP_ENOMEM;
            }
            *v = WAIT_MINE;
        }
    }
    int64_t total = 0;
    /* Entries are in order of their end (spans of one thread do not
     * overlap).  Skip those that began after the window, by bisection: a
     * profile read after a linger would scan many.  Then newest first,
     * stopping at the first entry that ended before the window. */
    size_t lo = 0, hi = t->hist_len;   /* first entry ending after end_ns */
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (t->hist[(t->hist_head + mid) % t->hist_cap].end <= end_ns) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    size_t from = lo < t->hist_len ? lo + 1 : lo;  /* (it may overlap) */
    size_t at = t->hist_cap ? (t->hist_head + from) % t->hist_cap : 0;
    for (size_t k = from; k-- > 0;) {   /* (at: one past, wrapping) */
        at = at ? at - 1 : t->hist_cap - 1;
        const hist_entry *h = &t->hist[at];
        if (h->end <= start_ns) {
            break;
        }
        if (h->start >= end_ns || (serial && h->serial == serial)) {
            continue;
        }
        bool added;
        uint64_t *v = wait_put(&wm, h->greenlet_id, &added);
        if (!v) {
            gqp__map_free(wmap);
            return GQP_ENOMEM;
        }
        if (added && serial && gqp__map_get(&mine->gindex, h->greenlet_id)) {
            *v = WAIT_MINE; /* one of mine ran, attached or not at the time */
        }
        if (*v == WAIT_MINE) {
            continue;
        }
        int64_t a = h->start > start_ns ? h->start : start_ns;
        int64_t b = h->end < end_ns ? h->end : end_ns;
        total += b - a;
        *v += (uint64_t)(b - a);
    }
    /* Top n by time: insertion into the (short) output arrays. */
    size_t used = 0;
    for (size_t i = 0; i < wmap->cap && n; i++) {
        if (wm.used) {
            /* (on to the next taken slot, in slot order) */
            uint64_t bits = wm.taken[i / 64] >> (i % 64);
            if (!bits) {
                i |= 63;   /* (the next word) */
                continue;
            }
            i += low_bit(bits);
        }
        if (!wmap->keys[i] || wmap->vals[i] == WAIT_MINE) {
            continue;
        }
        int64_t d = (int64_t)wmap->vals[i];
        if (used == n && d <= ns[n - 1]) {
            continue;
        }
        size_t j = used < n ? used++ : n - 1;
        while (j > 0 && ns[j - 1] < d) {
            ids[j] = ids[j - 1];
            ns[j] = ns[j - 1];
            j--;
        }
        ids[j] = wmap->keys[i];
        ns[j] = d;
    }
    gqp__map_free(wmap);
    *total_ns = total;
    if (complete) {
        *complete = t->hist_overwritten_end == 0 ||
                    (int64_t)t->hist_overwritten_end <= start_ns;
    }
    return (int)used;
}
