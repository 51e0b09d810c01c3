/*
 * test_estimate.c -- randomized checks of the span and call accounting.
 *
 * A model of one OS thread runs random sequences of events (switches among
 * a few greenlets, greenlets finishing and their keys being reused, calls,
 * returns, on-CPU runs and off-CPU waits of random lengths) against a
 * tracer on the fake clock, and computes the exact wall and CPU time of
 * every span and every frame.  Each frame gets its own function key, so a
 * function's ttot_ns/tsub_ns are that one frame's times.
 *
 * The accuracy claim checked is the header comment of
 * GQP_TRACER_CPU_WINDOW_NS (greqprof.h, as of this writing):
 *
 *   "The thread CPU clock costs a system call, so it is read only when at
 *    least this much wall time passed since the last reading (default
 *    100000 ns; GQP_CPU_EXACT also reads it at every switch).  Between
 *    readings CPU time advances with wall time; each reading realigns the
 *    estimate with the real clock.  Accuracy (docs/accuracy.md):
 *      GQP_CPU_EXACT:    spans exact; a frame within 2 windows.
 *      GQP_CPU_ESTIMATE: a span within 1 window; a frame within 1 window
 *                        per span it ran in, plus 1.
 *    Estimates are clamped at 0."
 *
 * checked as, with W the window and k the number of spans of its greenlet a
 * frame was open in (partially or wholly):
 *   EXACT:    span.cpu_ns == exact;          |ttot - exact| <= 2 W
 *   ESTIMATE: |span.cpu_ns - exact| <= W;    |ttot - exact| <= W (k + 1)
 *   all:      cpu_ns >= 0 and ttot_ns >= 0 (clamped, never negative)
 * (An earlier header said "every span's and frame's CPU time is within
 * 2 * window"; the span bound above is stricter, the frame bound looser.)
 *
 * Exact equality is also required where the header leaves no room for
 * error: with GQP_CLOCK_WALL (no CPU clock involved) and with a 1 ns window
 * (the CPU clock is then read whenever wall time moved, and the fake clock
 * never moves CPU time without wall time).  There spans, greenlet totals,
 * ttot and tsub of every frame, and the caller->callee edges must match the
 * model exactly.
 *
 * Environment: GQP_SEED=N runs only seed N (to reproduce a failure);
 * GQP_SEEDS=N changes the number of seeds per test.
 */
#include <stdlib.h>

#include "harness.h"
#include "testutil.h"

#define NG 6        /* greenlet slots */
#define MAXD 24     /* model stack depth (below the tracer's cap) */
#define MAXF 4096   /* frames per run */
#define MAXS 16384  /* spans per run */

typedef struct frame {
    uint64_t key;
    int64_t cpu0, wall0;     /* greenlet CPU / wall at the call */
    int64_t child_cpu, child_wall;
    uint64_t span0;          /* the greenlet's span serial at the call */
} frame;

typedef struct gslot {
    uint64_t key;
    int alive;
    int depth;
    frame st[MAXD];
    int64_t gcpu; /* CPU consumed while this greenlet ran */
    uint64_t id;
    uint64_t nspan; /* spans started (serial of the current one) */
} gslot;

typedef struct expect_frame {
    uint64_t key, parent;
    int64_t incl_cpu, excl_cpu, incl_wall, excl_wall;
    uint64_t spans; /* spans the frame ran in */
} expect_frame;

typedef struct expect_span {
    uint64_t id;
    int64_t start, end, cpu;
    uint32_t flags;
} expect_span;

typedef struct model {
    fake_clock c;
    gqp_tracer *t;
    gqp_profile *p;
    int cpu_mode, call_clock;
    int64_t window;
    gslot g[NG];
    int run; /* running slot */
    int64_t span_start, span_cpu0;
    uint32_t span_flags; /* GQP_SPAN_CONTINUED for the first span */
    expect_span *spans;
    size_t nspans;
    expect_frame *frames;
    size_t nframes;
    uint64_t next_func;
    uint64_t rng;
    uint64_t seed;
    int64_t max_span_err;    /* largest |span error| seen (ESTIMATE) */
    double max_frame_ratio;  /* largest |frame error| / bound */
} model;

static int64_t rand_duration(model *m)
{
    int64_t w = m->window;
    switch (rng_below(&m->rng, 10)) {
    case 0:
        return 0;
    case 1: case 2: case 3: case 4:
        return (int64_t)rng_below(&m->rng, (uint64_t)(w / 10 + 1)) + 1;
    case 5: case 6: case 7:
        return (int64_t)rng_below(&m->rng, (uint64_t)(2 * w + 1));
    default:
        return w + (int64_t)rng_below(&m->rng, (uint64_t)(4 * w + 1));
    }
}

static void close_span(model *m, uint32_t flags)
{
    expect_span *s;
    if (m->nspans >= MAXS)
        FAIL("seed %" PRIu64 ": model span overflow", m->seed);
    s = &m->spans[m->nspans++];
    s->id = m->g[m->run].id;
    s->start = m->span_start;
    s->end = m->c.wall;
    s->cpu = m->c.cpu - m->span_cpu0;
    s->flags = flags | m->span_flags;
    m->span_flags = 0;
    m->span_start = m->c.wall;
    m->span_cpu0 = m->c.cpu;
}

static void do_switch(model *m, int to, int dead)
{
    gslot *from = &m->g[m->run], *dst = &m->g[to];
    int rc = gqp_tracer_switch(m->t, from->key, dst->key,
                               dead ? GQP_SWITCH_FROM_DEAD : 0);
    if (rc < 0)
        FAIL("seed %" PRIu64 ": switch: %s", m->seed, gqp_err_name(rc));
    close_span(m, dead ? GQP_SPAN_FINISHED : 0);
    if (dead)
        from->alive = 0;
    if (!dst->alive) {
        if (!(rc & GQP_EV_NEW_GREENLET))
            FAIL("seed %" PRIu64 ": new greenlet not flagged", m->seed);
        dst->alive = 1;
        dst->depth = 0;
        dst->gcpu = 0;
        dst->nspan = 0;
        dst->id = gid(m->t, dst->key);
    } else if (rc & GQP_EV_NEW_GREENLET) {
        FAIL("seed %" PRIu64 ": known greenlet flagged new", m->seed);
    }
    dst->nspan++;
    m->run = to;
}

static void do_call(model *m)
{
    gslot *g = &m->g[m->run];
    frame *f;
    if (g->depth >= MAXD || m->nframes >= MAXF)
        return;
    f = &g->st[g->depth++];
    f->key = m->next_func++;
    f->cpu0 = g->gcpu;
    f->wall0 = m->c.wall;
    f->child_cpu = f->child_wall = 0;
    f->span0 = g->nspan;
    int rc = gqp_tracer_call(m->t, f->key);
    if (rc < 0 || !(rc & GQP_EV_NEW_FUNC) || (rc & GQP_EV_DROPPED))
        FAIL("seed %" PRIu64 ": call returned %d", m->seed, rc);
}

static void do_return(model *m)
{
    gslot *g = &m->g[m->run];
    frame *f;
    expect_frame *e;
    if (g->depth == 0)
        return;
    f = &g->st[--g->depth];
    int rc = gqp_tracer_return(m->t);
    if (rc < 0)
        FAIL("seed %" PRIu64 ": return: %s", m->seed, gqp_err_name(rc));
    e = &m->frames[m->nframes++];
    e->key = f->key;
    e->parent = g->depth > 0 ? g->st[g->depth - 1].key : 0;
    e->incl_cpu = g->gcpu - f->cpu0;
    e->incl_wall = m->c.wall - f->wall0;
    e->excl_cpu = e->incl_cpu - f->child_cpu;
    e->excl_wall = e->incl_wall - f->child_wall;
    e->spans = g->nspan - f->span0 + 1;
    if (g->depth > 0) {
        g->st[g->depth - 1].child_cpu += e->incl_cpu;
        g->st[g->depth - 1].child_wall += e->incl_wall;
    }
}

static void model_init(model *m, uint64_t seed, int cpu_mode, int call_clock,
                       int64_t window)
{
    memset(m, 0, sizeof *m);
    m->seed = seed;
    m->rng = seed * UINT64_C(0x9E3779B97F4A7C15) + 1;
    m->cpu_mode = cpu_mode;
    m->call_clock = call_clock;
    m->window = window;
    fc_init(&m->c);
    m->spans = calloc(MAXS, sizeof *m->spans);
    m->frames = calloc(MAXF, sizeof *m->frames);
    ASSERT_NOT_NULL(m->spans);
    ASSERT_NOT_NULL(m->frames);
    m->t = new_tracer_profile(&m->c, cpu_mode, call_clock, &m->p);
    ASSERT_OK(gqp_tracer_set(m->t, GQP_TRACER_CPU_WINDOW_NS, window));
    ASSERT_OK(gqp_tracer_set(m->t, GQP_TRACER_HISTORY, 64));
    ASSERT_OK(gqp_profile_set(m->p, GQP_PROFILE_MAX_SPANS, MAXS));
    for (int i = 0; i < NG; i++) {
        /* slot 5 uses a huge key */
        m->g[i].key = i == NG - 1 ? UINT64_MAX - 7
                                  : UINT64_C(0x7f00aa000000) + (uint64_t)i * 64;
    }
    m->next_func = UINT64_C(0x100000);
    /* first event */
    int rc = gqp_tracer_switch(m->t, 0, m->g[0].key, 0);
    if (rc < 0 || !(rc & GQP_EV_NEW_GREENLET))
        FAIL("seed %" PRIu64 ": first switch returned %d", seed, rc);
    m->g[0].alive = 1;
    m->g[0].nspan = 1;
    m->g[0].id = gid(m->t, m->g[0].key);
    m->run = 0;
    m->span_start = m->c.wall;
    m->span_cpu0 = m->c.cpu;
    m->span_flags = GQP_SPAN_CONTINUED; /* begun by switch(0, g) */
}

static void model_free(model *m)
{
    gqp_tracer_free(m->t);
    gqp_profile_free(m->p);
    free(m->spans);
    free(m->frames);
}

static void model_steps(model *m, int steps)
{
    for (int i = 0; i < steps; i++) {
        uint64_t r = rng_below(&m->rng, 100);
        if (r < 30) {
            int64_t d = rand_duration(m);
            fc_run(&m->c, d);
            m->g[m->run].gcpu += d;
        } else if (r < 42) {
            fc_idle(&m->c, rand_duration(m));
        } else if (r < 62) {
            int to = (int)rng_below(&m->rng, NG);
            if (to == m->run)
                to = (to + 1) % NG;
            /* a greenlet may finish once its own frames returned */
            int dead = m->g[m->run].depth == 0 && rng_below(&m->rng, 4) == 0;
            do_switch(m, to, dead);
        } else if (r < 82) {
            do_call(m);
        } else {
            do_return(m);
        }
    }
    /* unwind every greenlet, then flush */
    for (int i = 0; i < NG; i++) {
        if (!m->g[i].alive || m->g[i].depth == 0)
            continue;
        if (i != m->run)
            do_switch(m, i, 0);
        while (m->g[i].depth > 0) {
            int64_t d = rand_duration(m);
            fc_run(&m->c, d);
            m->g[i].gcpu += d;
            do_return(m);
        }
    }
    fc_run(&m->c, 3);
    m->g[m->run].gcpu += 3;
    ASSERT_OK(gqp_tracer_flush(m->t));
    close_span(m, GQP_SPAN_SPLIT);
}

static void model_check(model *m, int check_edges)
{
    const int64_t w = m->window;
    const uint64_t seed = m->seed;
    gqp_profile *p = m->p;
    /* see the top of the file */
    const int exact_spans = m->cpu_mode == GQP_CPU_EXACT || w == 1;
    const int exact_frames = m->call_clock == GQP_CLOCK_WALL || w == 1;

    /* the generator must have produced a meaningful run */
    if (m->nspans < 100 || m->nframes < 50)
        FAIL("seed %" PRIu64 ": only %zu spans / %zu frames", seed,
             m->nspans, m->nframes);
    if (gqp_profile_span_count(p) != m->nspans)
        FAIL("seed %" PRIu64 ": %zu spans, model has %zu", seed,
             gqp_profile_span_count(p), m->nspans);
    for (size_t i = 0; i < m->nspans; i++) {
        gqp_span s = get_span(p, i);
        const expect_span *e = &m->spans[i];
        if (s.greenlet_id != e->id || s.start_ns != e->start ||
            s.end_ns != e->end || s.flags != e->flags)
            FAIL("seed %" PRIu64 ": span %zu is (id %" PRIu64 ", %" PRId64
                 "..%" PRId64 ", flags %u), expected (id %" PRIu64
                 ", %" PRId64 "..%" PRId64 ", flags %u)",
                 seed, i, s.greenlet_id, s.start_ns, s.end_ns, s.flags,
                 e->id, e->start, e->end, e->flags);
        if (m->cpu_mode == GQP_CPU_OFF) {
            if (s.cpu_ns != -1)
                FAIL("seed %" PRIu64 ": span %zu cpu %" PRId64 " in OFF mode",
                     seed, i, s.cpu_ns);
        } else if (exact_spans) {
            if (s.cpu_ns != e->cpu)
                FAIL("seed %" PRIu64 ": window %" PRId64 ": span %zu cpu %"
                     PRId64 ", exact %" PRId64,
                     seed, w, i, s.cpu_ns, e->cpu);
        } else {
            int64_t d = s.cpu_ns - e->cpu;
            m->max_span_err = d > m->max_span_err ? d : -d > m->max_span_err ? -d : m->max_span_err;
            if (s.cpu_ns < 0 || d > w || -d > w)
                FAIL("seed %" PRIu64 ": window %" PRId64 ": span %zu (wall %"
                     PRId64 ") estimated cpu %" PRId64 ", exact %" PRId64
                     ", error %" PRId64 " > 1 window",
                     seed, w, i, e->end - e->start, s.cpu_ns, e->cpu, d);
        }
    }

    if (gqp_profile_func_count(p) != m->nframes)
        FAIL("seed %" PRIu64 ": %zu functions, model has %zu frames", seed,
             gqp_profile_func_count(p), m->nframes);
    for (size_t i = 0; i < m->nframes; i++) {
        const expect_frame *e = &m->frames[i];
        gqp_func_stat f;
        if (!find_func(p, e->key, &f))
            FAIL("seed %" PRIu64 ": frame %zu (key %" PRIu64 ") missing", seed,
                 i, e->key);
        if (f.ncall != 1 || f.nactual != 1)
            FAIL("seed %" PRIu64 ": frame key %" PRIu64 " ncall %" PRIu64
                 " nactual %" PRIu64, seed, e->key, f.ncall, f.nactual);
        int64_t incl, excl;
        if (m->call_clock == GQP_CLOCK_WALL) {
            incl = e->incl_wall;
            excl = e->excl_wall;
        } else {
            incl = e->incl_cpu;
            excl = e->excl_cpu;
        }
        if (exact_frames) {
            if (f.ttot_ns != incl || f.tsub_ns != excl)
                FAIL("seed %" PRIu64 ": window %" PRId64 ": frame key %" PRIu64
                     " ttot %" PRId64 " tsub %" PRId64 ", expected %" PRId64
                     " / %" PRId64,
                     seed, w, e->key, f.ttot_ns, f.tsub_ns, incl, excl);
        } else {
            int64_t tol = m->cpu_mode == GQP_CPU_EXACT
                              ? 2 * w
                              : w * (int64_t)(e->spans + 1);
            int64_t d = f.ttot_ns - incl;
            double r = (double)(d < 0 ? -d : d) / (double)tol;
            if (r > m->max_frame_ratio)
                m->max_frame_ratio = r;
            if (f.ttot_ns < 0 || f.tsub_ns < 0 || d > tol || -d > tol)
                FAIL("seed %" PRIu64 ": %s window %" PRId64 ": frame key %"
                     PRIu64 " (ran in %" PRIu64 " spans) ttot %" PRId64
                     ", exact %" PRId64 ", error %" PRId64 " > %" PRId64
                     " (tsub %" PRId64 ")",
                     seed,
                     m->cpu_mode == GQP_CPU_EXACT ? "EXACT" : "ESTIMATE", w,
                     e->key, e->spans, f.ttot_ns, incl, d, tol, f.tsub_ns);
        }
        if (check_edges && e->parent != 0) {
            gqp_edge_stat ed;
            if (!find_edge(p, e->parent, e->key, &ed))
                FAIL("seed %" PRIu64 ": edge %" PRIu64 "->%" PRIu64 " missing",
                     seed, e->parent, e->key);
            if (ed.ncall != 1 || ed.nactual != 1 || ed.ttot_ns != f.ttot_ns ||
                ed.tsub_ns != f.tsub_ns)
                FAIL("seed %" PRIu64 ": edge %" PRIu64 "->%" PRIu64
                     " differs from its callee's stats", seed, e->parent,
                     e->key);
        }
    }
    if (check_edges) {
        size_t nonroot = 0;
        for (size_t i = 0; i < m->nframes; i++)
            nonroot += m->frames[i].parent != 0;
        if (count_real_edges(p) != nonroot)
            FAIL("seed %" PRIu64 ": %zu edges, expected %zu", seed,
                 count_real_edges(p), nonroot);
    }
    if (gqp_profile_calls_dropped(p) != 0 || gqp_profile_spans_dropped(p) != 0)
        FAIL("seed %" PRIu64 ": unexpected drops", seed);

    /* greenlet totals: wall exact; cpu exact in EXACT mode */
    size_t ng = gqp_profile_greenlet_count(p);
    for (size_t k = 0; k < ng; k++) {
        gqp_greenlet_stat g;
        int64_t wall = 0, cpu = 0;
        uint64_t n = 0;
        ASSERT_OK(gqp_profile_greenlet(p, k, &g));
        for (size_t i = 0; i < m->nspans; i++) {
            if (m->spans[i].id == g.greenlet_id) {
                wall += m->spans[i].end - m->spans[i].start;
                cpu += m->spans[i].cpu;
                n += !(m->spans[i].flags & GQP_SPAN_CONTINUED);
            }
        }
        if (g.wall_ns != wall || g.switches != n)
            FAIL("seed %" PRIu64 ": greenlet %" PRIu64 " wall %" PRId64
                 " switches %" PRIu64 ", expected %" PRId64 " / %" PRIu64,
                 seed, g.greenlet_id, g.wall_ns, g.switches, wall, n);
        if (exact_spans && m->cpu_mode != GQP_CPU_OFF && g.cpu_ns != cpu)
            FAIL("seed %" PRIu64 ": greenlet %" PRIu64 " cpu %" PRId64
                 ", expected %" PRId64, seed, g.greenlet_id, g.cpu_ns, cpu);
        if (m->cpu_mode == GQP_CPU_OFF && g.cpu_ns != -1)
            FAIL("seed %" PRIu64 ": greenlet cpu %" PRId64 " in OFF mode",
                 seed, g.cpu_ns);
    }
}

static uint64_t n_seeds(uint64_t dflt)
{
    const char *e = getenv("GQP_SEEDS");
    if (e != NULL && *e)
        return strtoull(e, NULL, 10);
    return dflt;
}

static void run_random(int cpu_mode, int call_clock, int check_edges,
                       uint64_t dflt_seeds, int steps)
{
    static const int64_t windows[] = {1000, 100000, 7, 333, 25000, 1};
    const char *one = getenv("GQP_SEED");
    uint64_t first = 1, count = n_seeds(dflt_seeds);
    if (one != NULL && *one) {
        first = strtoull(one, NULL, 10);
        count = 1;
    }
    for (uint64_t seed = first; seed < first + count; seed++) {
        model m;
        int64_t w = windows[seed % (sizeof windows / sizeof windows[0])];
        model_init(&m, seed, cpu_mode, call_clock, w);
        model_steps(&m, steps);
        model_check(&m, check_edges);
        if (getenv("GQP_VERBOSE") != NULL)
            NOTE("seed %" PRIu64 " window %" PRId64 ": %zu spans, %zu frames,"
                 " max span error %" PRId64 ", max frame error/bound %.3f",
                 seed, w, m.nspans, m.nframes, m.max_span_err,
                 m.max_frame_ratio);
        model_free(&m);
    }
}

TEST(random_estimate_accuracy_cpu_clock)
{
    run_random(GQP_CPU_ESTIMATE, GQP_CLOCK_CPU, 0, 60, 3000);
}

TEST(random_estimate_accuracy_wall_clock)
{
    run_random(GQP_CPU_ESTIMATE, GQP_CLOCK_WALL, 0, 30, 3000);
}

TEST(random_exact_accuracy_cpu_clock)
{
    run_random(GQP_CPU_EXACT, GQP_CLOCK_CPU, 1, 30, 2000);
}

TEST(random_exact_wall_clock_matches_model)
{
    run_random(GQP_CPU_EXACT, GQP_CLOCK_WALL, 1, 20, 2000);
}

TEST(random_cpu_off_wall_clock_matches_model)
{
    run_random(GQP_CPU_OFF, GQP_CLOCK_WALL, 1, 10, 2000);
}
