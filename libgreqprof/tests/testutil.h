/*
 * testutil.h -- fake clocks and lookup helpers shared by the test_*.c files.
 *
 * The fake clock models one OS thread: fc_run() advances wall and thread CPU
 * time together (code running on CPU), fc_idle() advances only wall time
 * (the thread blocked / sleeping).  Installed with gqp_tracer_set_clocks it
 * makes every timing in the library exact and deterministic.
 */
#ifndef GQP_TEST_UTIL_H
#define GQP_TEST_UTIL_H

#include <stdint.h>
#include <stdlib.h>

#include "greqprof.h"
#include "harness.h"

/* Non-zero origins, so a missing offset cannot pass by accident. */
#define W0 INT64_C(1000000000)
#define C0 INT64_C(5000000)

/* Flags of a span begun by gqp_tracer_switch(t, 0, g, 0): the library
 * treats "from == 0" as tracing having started while g was already running,
 * so that span is GQP_SPAN_CONTINUED ("did not begin with a switch") and is
 * not counted in the greenlet's `switches`.  (greqprof.h also describes
 * from == 0 as "nothing was running"; see tests/README.md.) */
#define FIRST GQP_SPAN_CONTINUED

/* Greenlet and function keys used throughout the tests. */
#define KG UINT64_C(0x7f0000001000)
#define KH UINT64_C(0x7f0000002000)
#define KI UINT64_C(0x7f0000003000)
#define FA UINT64_C(0x5500000a0)
#define FB UINT64_C(0x5500000b0)
#define FC UINT64_C(0x5500000c0)
#define FD UINT64_C(0x5500000d0)
#define FE UINT64_C(0x5500000e0)

typedef struct fake_clock {
    int64_t wall;
    int64_t cpu;
    uint64_t wall_reads;
    uint64_t cpu_reads;
} fake_clock;

static inline int64_t fake_wall_fn(void *ctx)
{
    fake_clock *c = ctx;
    c->wall_reads++;
    return c->wall;
}

static inline int64_t fake_cpu_fn(void *ctx)
{
    fake_clock *c = ctx;
    c->cpu_reads++;
    return c->cpu;
}

static inline void fc_init(fake_clock *c)
{
    c->wall = W0;
    c->cpu = C0;
    c->wall_reads = 0;
    c->cpu_reads = 0;
}

/* The thread runs on CPU for ns. */
static inline void fc_run(fake_clock *c, int64_t ns)
{
    c->wall += ns;
    c->cpu += ns;
}

/* The thread is off CPU (blocked) for ns. */
static inline void fc_idle(fake_clock *c, int64_t ns)
{
    c->wall += ns;
}

/* A tracer on the fake clock with the given CPU mode and call clock.
 *
 * The CPU window is set to 1 ns: the header says the CPU clock is read when
 * at least one window of wall time passed since the last reading and that
 * CPU time advances with wall time in between; the fake clock never moves
 * CPU time without moving wall time, so with a 1 ns window every CPU value
 * the tracer uses is exact and call times can be asserted exactly.  Tests
 * of the estimator set their own window. */
static inline gqp_tracer *new_tracer(fake_clock *c, int cpu_mode,
                                     int call_clock)
{
    gqp_tracer *t = NULL;
    ASSERT_OK(gqp_tracer_new(&t));
    ASSERT_NOT_NULL(t);
    ASSERT_OK(gqp_tracer_set_clocks(t, fake_wall_fn, fake_cpu_fn, c));
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_CPU_MODE, cpu_mode));
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_CALL_CLOCK, call_clock));
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_CPU_WINDOW_NS, 1));
    return t;
}

static inline gqp_profile *new_profile(void)
{
    gqp_profile *p = NULL;
    ASSERT_OK(gqp_profile_new(&p));
    ASSERT_NOT_NULL(p);
    return p;
}

/* A tracer whose default profile is *pp (a new profile, caller frees). */
static inline gqp_tracer *new_tracer_profile(fake_clock *c, int cpu_mode,
                                             int call_clock, gqp_profile **pp)
{
    gqp_tracer *t = new_tracer(c, cpu_mode, call_clock);
    *pp = new_profile();
    ASSERT_OK(gqp_tracer_set_default(t, *pp));
    return t;
}

static inline gqp_span get_span(const gqp_profile *p, size_t i)
{
    gqp_span s;
    memset(&s, 0xa5, sizeof s);
    ASSERT_OK(gqp_profile_span(p, i, &s));
    return s;
}

static inline uint64_t gid(const gqp_tracer *t, uint64_t key)
{
    uint64_t id = 0;
    ASSERT_OK(gqp_tracer_greenlet_id(t, key, &id));
    ASSERT_NE_U64(id, 0);
    return id;
}

static inline int find_func(const gqp_profile *p, uint64_t key,
                            gqp_func_stat *out)
{
    size_t n = gqp_profile_func_count(p);
    for (size_t i = 0; i < n; i++) {
        gqp_func_stat f;
        ASSERT_OK(gqp_profile_func(p, i, &f));
        if (f.key == key) {
            if (out)
                *out = f;
            return 1;
        }
    }
    return 0;
}

static inline int find_edge(const gqp_profile *p, uint64_t caller,
                            uint64_t callee, gqp_edge_stat *out)
{
    size_t n = gqp_profile_edge_count(p);
    for (size_t i = 0; i < n; i++) {
        gqp_edge_stat e;
        ASSERT_OK(gqp_profile_edge(p, i, &e));
        if (e.caller_key == caller && e.callee_key == callee) {
            if (out)
                *out = e;
            return 1;
        }
    }
    return 0;
}

static inline int find_greenlet(const gqp_profile *p, uint64_t id,
                                gqp_greenlet_stat *out)
{
    size_t n = gqp_profile_greenlet_count(p);
    for (size_t i = 0; i < n; i++) {
        gqp_greenlet_stat g;
        ASSERT_OK(gqp_profile_greenlet(p, i, &g));
        if (g.greenlet_id == id) {
            if (out)
                *out = g;
            return 1;
        }
    }
    return 0;
}

#define GET_FUNC(p, key, out)                                               \
    do {                                                                    \
        if (!find_func((p), (key), (out)))                                  \
            FAIL("function %s (0x%" PRIx64 ") not found in %s", #key,       \
                 (uint64_t)(key), #p);                                      \
    } while (0)

#define GET_EDGE(p, caller, callee, out)                                    \
    do {                                                                    \
        if (!find_edge((p), (caller), (callee), (out)))                     \
            FAIL("edge %s->%s not found in %s", #caller, #callee, #p);      \
    } while (0)

#define GET_GREENLET(p, id, out)                                            \
    do {                                                                    \
        if (!find_greenlet((p), (id), (out)))                               \
            FAIL("greenlet %s (id %" PRIu64 ") not found in %s", #id,       \
                 (uint64_t)(id), #p);                                       \
    } while (0)

#define ASSERT_FUNC(p, key, ncall_, nactual_, ttot_, tsub_)                 \
    do {                                                                    \
        gqp_func_stat af_;                                                  \
        GET_FUNC(p, key, &af_);                                             \
        ASSERT_EQ_U64(af_.ncall, ncall_);                                   \
        ASSERT_EQ_U64(af_.nactual, nactual_);                               \
        ASSERT_EQ_I64(af_.ttot_ns, ttot_);                                  \
        ASSERT_EQ_I64(af_.tsub_ns, tsub_);                                  \
    } while (0)

#define ASSERT_EDGE(p, caller, callee, ncall_, nactual_, ttot_, tsub_)      \
    do {                                                                    \
        gqp_edge_stat ae_;                                                  \
        GET_EDGE(p, caller, callee, &ae_);                                  \
        ASSERT_EQ_U64(ae_.ncall, ncall_);                                   \
        ASSERT_EQ_U64(ae_.nactual, nactual_);                               \
        ASSERT_EQ_I64(ae_.ttot_ns, ttot_);                                  \
        ASSERT_EQ_I64(ae_.tsub_ns, tsub_);                                  \
    } while (0)

#define ASSERT_SPAN(s, id_, start_, end_, cpu_, flags_)                     \
    do {                                                                    \
        gqp_span as_ = (s);                                                 \
        ASSERT_EQ_U64(as_.greenlet_id, id_);                                \
        ASSERT_EQ_I64(as_.start_ns, start_);                                \
        ASSERT_EQ_I64(as_.end_ns, end_);                                    \
        ASSERT_EQ_I64(as_.cpu_ns, cpu_);                                    \
        ASSERT_EQ_U64(as_.flags, flags_);                                   \
    } while (0)

/* Number of edges in p whose caller is `caller` (any callee). */
static inline size_t count_edges_from(const gqp_profile *p, uint64_t caller)
{
    size_t n = gqp_profile_edge_count(p), c = 0;
    for (size_t i = 0; i < n; i++) {
        gqp_edge_stat e;
        ASSERT_OK(gqp_profile_edge(p, i, &e));
        if (e.caller_key == caller)
            c++;
    }
    return c;
}

/* Number of edges with a non-zero caller.  The header does not say whether
 * an outermost call produces a "root -> callee" edge (caller_key 0), so the
 * tests only count real caller->callee edges. */
static inline size_t count_real_edges(const gqp_profile *p)
{
    size_t n = gqp_profile_edge_count(p), c = 0;
    for (size_t i = 0; i < n; i++) {
        gqp_edge_stat e;
        ASSERT_OK(gqp_profile_edge(p, i, &e));
        if (e.caller_key != 0)
            c++;
    }
    return c;
}

/* xorshift64* -- deterministic pseudo-random numbers for the tests. */
static inline uint64_t rng_next(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * UINT64_C(2685821657736338717);
}

static inline uint64_t rng_below(uint64_t *s, uint64_t n)
{
    return n ? rng_next(s) % n : 0;
}

#endif /* GQP_TEST_UTIL_H */
