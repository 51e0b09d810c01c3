/* test_calls.c -- function and caller->callee statistics (cProfile
 * semantics) under the CPU and WALL call clocks. */
#include "harness.h"
#include "testutil.h"

/*
 * The seed scenario: greenlet G runs a(), which blocks once (H runs), then
 * calls b(), which spins, blocks (H runs again) and sleeps off-CPU, then
 * c(), which spins.
 *
 *   G: call a; run 1; ->H (H runs 10, idles 20) ->G; run 2;
 *      call b; run 5; ->H (H runs 3) ->G; idle 4; return b;
 *      call c; run 7; return c; run 1; return a
 */
static void seed_scenario(gqp_tracer *t, fake_clock *c)
{
    int rc;
    rc = EV(gqp_tracer_switch(t, 0, KG, 0));
    rc = EV(gqp_tracer_call(t, FA));
    ASSERT_HAS_FLAG(rc, GQP_EV_NEW_FUNC);
    fc_run(c, 1);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    fc_run(c, 10);
    fc_idle(c, 20);
    EV(gqp_tracer_switch(t, KH, KG, 0));
    fc_run(c, 2);
    rc = EV(gqp_tracer_call(t, FB));
    ASSERT_HAS_FLAG(rc, GQP_EV_NEW_FUNC);
    fc_run(c, 5);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    fc_run(c, 3);
    EV(gqp_tracer_switch(t, KH, KG, 0));
    fc_idle(c, 4);
    EV(gqp_tracer_return(t));
    rc = EV(gqp_tracer_call(t, FC));
    ASSERT_HAS_FLAG(rc, GQP_EV_NEW_FUNC);
    fc_run(c, 7);
    EV(gqp_tracer_return(t));
    fc_run(c, 1);
    EV(gqp_tracer_return(t));
    ASSERT_OK(gqp_tracer_flush(t));
}

static void check_seed_cpu(const gqp_profile *p)
{
    /* only G's own on-CPU time is charged */
    ASSERT_EQ_SIZE(gqp_profile_func_count(p), 3);
    ASSERT_FUNC(p, FA, 1, 1, 16, 4);
    ASSERT_FUNC(p, FB, 1, 1, 5, 5);
    ASSERT_FUNC(p, FC, 1, 1, 7, 7);
    ASSERT_EDGE(p, FA, FB, 1, 1, 5, 5);
    ASSERT_EDGE(p, FA, FC, 1, 1, 7, 7);
    ASSERT_EQ_SIZE(count_real_edges(p), 2);
    ASSERT_EQ_U64(gqp_profile_calls_dropped(p), 0);
}

static void check_seed_wall(const gqp_profile *p)
{
    /* elapsed time, switched-out and off-CPU time included:
     * a: 1 + (10 + 20) + 2 + 1 = 34 own;  b: 5 + 3 + 4 = 12;  c: 7 */
    ASSERT_EQ_SIZE(gqp_profile_func_count(p), 3);
    ASSERT_FUNC(p, FA, 1, 1, 53, 34);
    ASSERT_FUNC(p, FB, 1, 1, 12, 12);
    ASSERT_FUNC(p, FC, 1, 1, 7, 7);
    ASSERT_EDGE(p, FA, FB, 1, 1, 12, 12);
    ASSERT_EDGE(p, FA, FC, 1, 1, 7, 7);
    ASSERT_EQ_SIZE(count_real_edges(p), 2);
}

TEST(calls_seed_scenario_cpu_clock)
{
    fake_clock c;
    gqp_profile *p;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU, &p);
    seed_scenario(t, &c);
    check_seed_cpu(p);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

TEST(calls_seed_scenario_cpu_clock_estimate_window_1)
{
    fake_clock c;
    gqp_profile *p;
    fc_init(&c);
    gqp_tracer *t =
        new_tracer_profile(&c, GQP_CPU_ESTIMATE, GQP_CLOCK_CPU, &p);
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_CPU_WINDOW_NS, 1));
    seed_scenario(t, &c);
    check_seed_cpu(p);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

TEST(calls_seed_scenario_wall_clock)
{
    fake_clock c;
    gqp_profile *p;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_WALL, &p);
    seed_scenario(t, &c);
    check_seed_wall(p);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

/* GQP_PROFILE_CALL_CLOCK: a profile's own clock wins over the tracer's,
 * both ways. */
TEST(calls_profile_clock_overrides_the_tracers)
{
    for (int wall = 0; wall < 2; wall++) {
        fake_clock c;
        fc_init(&c);
        gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT,
                                   wall ? GQP_CLOCK_CPU : GQP_CLOCK_WALL);
        gqp_profile *p = new_profile();
        int64_t v = -1;
        ASSERT_OK(gqp_profile_get(p, GQP_PROFILE_CALL_CLOCK, &v));
        ASSERT_EQ_I64(v, GQP_CLOCK_TRACER);
        ASSERT_RC(gqp_profile_set(p, GQP_PROFILE_CALL_CLOCK, 3), GQP_ERANGE);
        ASSERT_OK(gqp_profile_set(p, GQP_PROFILE_CALL_CLOCK,
                                  wall ? GQP_CLOCK_WALL : GQP_CLOCK_CPU));
        ASSERT_OK(gqp_profile_get(p, GQP_PROFILE_CALL_CLOCK, &v));
        ASSERT_EQ_I64(v, wall ? GQP_CLOCK_WALL : GQP_CLOCK_CPU);
        ASSERT_OK(gqp_tracer_set_default(t, p));
        seed_scenario(t, &c);
        if (wall) {
            check_seed_wall(p);
        } else {
            check_seed_cpu(p);
        }
        gqp_tracer_free(t);
        gqp_profile_free(p);
    }
}

/* One tracer, two profiles with different clocks at once: G attached to a
 * CPU-clock profile while a WALL-clock session profile sees it too (two
 * middlewares in one thread, or a Profiler beside a middleware).  Each
 * gets its own clock's times, including the frames a re-attach or the end
 * of the greenlet unwinds. */
TEST(calls_attached_and_session_profiles_with_different_clocks)
{
    for (int swap = 0; swap < 2; swap++) {
        fake_clock c;
        fc_init(&c);
        gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
        gqp_profile *a = new_profile(), *s = new_profile();
        ASSERT_OK(gqp_profile_set(a, GQP_PROFILE_CALL_CLOCK,
                                  swap ? GQP_CLOCK_WALL : GQP_CLOCK_CPU));
        ASSERT_OK(gqp_profile_set(s, GQP_PROFILE_CALL_CLOCK,
                                  swap ? GQP_CLOCK_CPU : GQP_CLOCK_WALL));
        ASSERT_OK(gqp_tracer_set_session(t, s));
        ASSERT_OK(gqp_tracer_attach(t, KG, a));
        seed_scenario(t, &c);
        check_seed_cpu(swap ? s : a);
        check_seed_wall(swap ? a : s);

        /* frames still open when G is detached, then when it dies */
        gqp_profile *a2 = new_profile(), *s2 = new_profile();
        ASSERT_OK(gqp_profile_set(a2, GQP_PROFILE_CALL_CLOCK, GQP_CLOCK_CPU));
        ASSERT_OK(gqp_profile_set(s2, GQP_PROFILE_CALL_CLOCK,
                                  GQP_CLOCK_WALL));
        ASSERT_OK(gqp_tracer_set_session(t, s2));
        ASSERT_OK(gqp_tracer_attach(t, KG, a2));
        EV(gqp_tracer_switch(t, 0, KG, 0));
        EV(gqp_tracer_call(t, FD));
        fc_run(&c, 3);
        EV(gqp_tracer_switch(t, KG, KH, 0));
        fc_idle(&c, 10);
        EV(gqp_tracer_switch(t, KH, KG, 0));
        fc_run(&c, 2);
        ASSERT_OK(gqp_tracer_attach(t, KG, NULL)); /* unwinds FD */
        ASSERT_FUNC(a2, FD, 1, 1, 5, 5);
        ASSERT_FUNC(s2, FD, 1, 1, 15, 15);
        EV(gqp_tracer_call(t, FE)); /* the session's only now */
        fc_run(&c, 4);
        fc_idle(&c, 6);
        EV(gqp_tracer_switch(t, KG, KH, GQP_SWITCH_FROM_DEAD));
        ASSERT_FUNC(s2, FE, 1, 1, 10, 10);
        ASSERT_EQ_I64(find_func(a2, FE, NULL), 0);
        gqp_tracer_free(t);
        gqp_profile_free(a);
        gqp_profile_free(s);
        gqp_profile_free(a2);
        gqp_profile_free(s2);
    }
}

/* The spans of the seed scenario, for completeness. */
TEST(calls_seed_scenario_spans)
{
    fake_clock c;
    gqp_profile *p;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU, &p);
    seed_scenario(t, &c);
    uint64_t g = gid(t, KG), h = gid(t, KH);
    ASSERT_EQ_SIZE(gqp_profile_span_count(p), 5);
    ASSERT_SPAN(get_span(p, 0), g, W0, W0 + 1, 1, FIRST);
    ASSERT_SPAN(get_span(p, 1), h, W0 + 1, W0 + 31, 10, 0);
    ASSERT_SPAN(get_span(p, 2), g, W0 + 31, W0 + 38, 7, 0);
    ASSERT_SPAN(get_span(p, 3), h, W0 + 38, W0 + 41, 3, 0);
    ASSERT_SPAN(get_span(p, 4), g, W0 + 41, W0 + 53, 8, GQP_SPAN_SPLIT);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

/* m -> r -> r -> r: r has ncall 3, nactual 1 and its inclusive time is
 * counted once (for the outermost frame), as cProfile does. */
TEST(calls_recursion_like_cprofile)
{
    fake_clock c;
    gqp_profile *p;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU, &p);
    const uint64_t M = FD, R = FE;
    EV(gqp_tracer_switch(t, 0, KG, 0));
    EV(gqp_tracer_call(t, M));
    fc_run(&c, 100);
    int rc1 = EV(gqp_tracer_call(t, R));
    ASSERT_HAS_FLAG(rc1, GQP_EV_NEW_FUNC);
    fc_run(&c, 1);
    int rc2 = EV(gqp_tracer_call(t, R));
    ASSERT_NO_FLAG(rc2, GQP_EV_NEW_FUNC);
    fc_run(&c, 2);
    EV(gqp_tracer_call(t, R));
    fc_run(&c, 3);
    EV(gqp_tracer_return(t)); /* r3: 3 */
    fc_run(&c, 4);
    EV(gqp_tracer_return(t)); /* r2: 2 + 3 + 4 = 9, own 6 */
    fc_run(&c, 5);
    EV(gqp_tracer_return(t)); /* r1: 1 + 9 + 5 = 15, own 6 */
    fc_run(&c, 200);
    EV(gqp_tracer_return(t)); /* m: 315, own 300 */

    ASSERT_FUNC(p, R, 3, 1, 15, 15);
    ASSERT_FUNC(p, M, 1, 1, 315, 300);
    ASSERT_EDGE(p, M, R, 1, 1, 15, 6);
    /* pair r->r: entered twice, the inner entry is recursive */
    ASSERT_EDGE(p, R, R, 2, 1, 9, 9);
    ASSERT_EQ_SIZE(count_real_edges(p), 2);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

/* a -> b -> a -> b (mutual recursion). */
TEST(calls_mutual_recursion)
{
    fake_clock c;
    gqp_profile *p;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU, &p);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    EV(gqp_tracer_call(t, FA));
    fc_run(&c, 1);
    EV(gqp_tracer_call(t, FB));
    fc_run(&c, 2);
    EV(gqp_tracer_call(t, FA));
    fc_run(&c, 3);
    EV(gqp_tracer_call(t, FB));
    fc_run(&c, 4);
    EV(gqp_tracer_return(t)); /* b2: 4 */
    fc_run(&c, 5);
    EV(gqp_tracer_return(t)); /* a2: 12, own 8 */
    fc_run(&c, 6);
    EV(gqp_tracer_return(t)); /* b1: 20, own 8 */
    fc_run(&c, 7);
    EV(gqp_tracer_return(t)); /* a1: 28, own 8 */
    ASSERT_FUNC(p, FA, 2, 1, 28, 16);
    ASSERT_FUNC(p, FB, 2, 1, 20, 12);
    ASSERT_EDGE(p, FA, FB, 2, 1, 20, 12);
    ASSERT_EDGE(p, FB, FA, 1, 1, 12, 8);
    ASSERT_EQ_SIZE(count_real_edges(p), 2);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

/* Two greenlets run the same function interleaved: each greenlet has its
 * own stack, so both frames are outermost (no false recursion). */
static void interleaved_same_func(gqp_tracer *t, fake_clock *c)
{
    EV(gqp_tracer_switch(t, 0, KG, 0));
    EV(gqp_tracer_call(t, FA)); /* G's a, at 0 */
    fc_run(c, 2);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    EV(gqp_tracer_call(t, FA)); /* H's a, at 2 */
    fc_run(c, 3);
    EV(gqp_tracer_switch(t, KH, KG, 0));
    fc_run(c, 4);
    EV(gqp_tracer_return(t)); /* G's a returns at 9 */
    EV(gqp_tracer_switch(t, KG, KH, 0));
    fc_run(c, 5);
    EV(gqp_tracer_return(t)); /* H's a returns at 14 */
    ASSERT_OK(gqp_tracer_flush(t));
}

TEST(calls_interleaved_greenlets_cpu_clock)
{
    fake_clock c;
    gqp_profile *p;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU, &p);
    interleaved_same_func(t, &c);
    /* G's frame: 2 + 4;  H's frame: 3 + 5 */
    ASSERT_FUNC(p, FA, 2, 2, 14, 14);
    ASSERT_EQ_SIZE(count_real_edges(p), 0);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

TEST(calls_interleaved_greenlets_wall_clock)
{
    fake_clock c;
    gqp_profile *p;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_WALL, &p);
    interleaved_same_func(t, &c);
    /* G's frame: 0..9;  H's frame: 2..14 */
    ASSERT_FUNC(p, FA, 2, 2, 21, 21);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

TEST(calls_repeated_calls_accumulate)
{
    fake_clock c;
    gqp_profile *p;
    int rc;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU, &p);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    EV(gqp_tracer_call(t, FA));
    for (int i = 1; i <= 10; i++) {
        rc = EV(gqp_tracer_call(t, FB));
        if (i == 1)
            ASSERT_HAS_FLAG(rc, GQP_EV_NEW_FUNC);
        else
            ASSERT_NO_FLAG(rc, GQP_EV_NEW_FUNC);
        fc_run(&c, i);
        EV(gqp_tracer_return(t));
        fc_run(&c, 1);
    }
    EV(gqp_tracer_return(t));
    ASSERT_FUNC(p, FB, 10, 10, 55, 55);
    ASSERT_FUNC(p, FA, 1, 1, 65, 10);
    ASSERT_EDGE(p, FA, FB, 10, 10, 55, 55);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

/* Functions are counted per profile: NEW_FUNC again in another profile. */
TEST(calls_new_func_is_per_profile)
{
    fake_clock c;
    gqp_profile *p, *q = new_profile();
    int rc;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU, &p);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    rc = EV(gqp_tracer_call(t, FA));
    ASSERT_HAS_FLAG(rc, GQP_EV_NEW_FUNC);
    EV(gqp_tracer_return(t));
    EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_OK(gqp_tracer_attach(t, KH, q));
    rc = EV(gqp_tracer_call(t, FA));
    ASSERT_HAS_FLAG(rc, GQP_EV_NEW_FUNC);
    EV(gqp_tracer_return(t));
    rc = EV(gqp_tracer_call(t, FA));
    ASSERT_NO_FLAG(rc, GQP_EV_NEW_FUNC);
    EV(gqp_tracer_return(t));
    ASSERT_FUNC(p, FA, 1, 1, 0, 0);
    ASSERT_FUNC(q, FA, 2, 2, 0, 0);
    gqp_tracer_free(t);
    gqp_profile_free(p);
    gqp_profile_free(q);
}

/* Without any profile nothing is recorded and nothing is "new". */
TEST(calls_without_profile_record_nothing)
{
    fake_clock c;
    int rc;
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    rc = EV(gqp_tracer_call(t, FA));
    ASSERT_NO_FLAG(rc, GQP_EV_NEW_FUNC);
    ASSERT_NO_FLAG(rc, GQP_EV_DROPPED);
    fc_run(&c, 5);
    EV(gqp_tracer_return(t));
    /* a profile attached afterwards starts from a clean stack */
    gqp_profile *p = new_profile();
    ASSERT_OK(gqp_tracer_attach(t, KG, p));
    rc = EV(gqp_tracer_call(t, FB));
    ASSERT_HAS_FLAG(rc, GQP_EV_NEW_FUNC);
    fc_run(&c, 2);
    EV(gqp_tracer_return(t));
    ASSERT_EQ_SIZE(gqp_profile_func_count(p), 1);
    ASSERT_FUNC(p, FB, 1, 1, 2, 2);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

TEST(calls_zero_key_rejected)
{
    fake_clock c;
    gqp_profile *p;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU, &p);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_RC(gqp_tracer_call(t, 0), GQP_EINVAL);
    EV(gqp_tracer_call(t, FA));
    ASSERT_RC(gqp_tracer_call(t, 0), GQP_EINVAL);
    fc_run(&c, 3);
    EV(gqp_tracer_return(t)); /* pops FA: the rejected call pushed nothing */
    ASSERT_EQ_SIZE(gqp_profile_func_count(p), 1);
    ASSERT_FUNC(p, FA, 1, 1, 3, 3);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

/* Depth cap: deeper frames are not recorded, but their returns are still
 * matched, so the frames that are kept get the right times. */
TEST(calls_max_depth_overflow_keeps_stack_in_sync)
{
    fake_clock c;
    gqp_profile *p;
    int rc;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU, &p);
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_MAX_DEPTH, 2));
    EV(gqp_tracer_switch(t, 0, KG, 0));
    rc = EV(gqp_tracer_call(t, FA)); /* depth 1 */
    ASSERT_NO_FLAG(rc, GQP_EV_DROPPED);
    fc_run(&c, 1);
    rc = EV(gqp_tracer_call(t, FB)); /* depth 2 */
    ASSERT_NO_FLAG(rc, GQP_EV_DROPPED);
    fc_run(&c, 1);
    rc = EV(gqp_tracer_call(t, FC)); /* depth 3: over the cap */
    ASSERT_HAS_FLAG(rc, GQP_EV_DROPPED);
    fc_run(&c, 1);
    rc = EV(gqp_tracer_call(t, FD)); /* depth 4 */
    ASSERT_HAS_FLAG(rc, GQP_EV_DROPPED);
    fc_run(&c, 1);
    /* a switch in the middle must not disturb the bookkeeping */
    EV(gqp_tracer_switch(t, KG, KH, 0));
    EV(gqp_tracer_call(t, FE)); /* H's own stack is not full */
    fc_run(&c, 50);
    EV(gqp_tracer_return(t));
    EV(gqp_tracer_switch(t, KH, KG, 0));
    EV(gqp_tracer_return(t)); /* d */
    fc_run(&c, 1);
    EV(gqp_tracer_return(t)); /* c */
    fc_run(&c, 1);
    EV(gqp_tracer_return(t)); /* b, returns at G-time 6 */
    fc_run(&c, 1);
    EV(gqp_tracer_return(t)); /* a, returns at G-time 7 */
    /* back at depth 0: a new top-level call has no caller */
    EV(gqp_tracer_call(t, FE));
    fc_run(&c, 1);
    EV(gqp_tracer_return(t));
    ASSERT_OK(gqp_tracer_flush(t));

    ASSERT_FALSE(find_func(p, FC, NULL));
    ASSERT_FALSE(find_func(p, FD, NULL));
    ASSERT_EQ_U64(gqp_profile_calls_dropped(p), 2);
    gqp_func_stat fa, fb;
    GET_FUNC(p, FA, &fa);
    GET_FUNC(p, FB, &fb);
    ASSERT_EQ_U64(fa.ncall, 1);
    ASSERT_EQ_I64(fa.ttot_ns, 7);
    ASSERT_EQ_U64(fb.ncall, 1);
    ASSERT_EQ_I64(fb.ttot_ns, 5);
    ASSERT_EQ_I64(fa.tsub_ns, 2);
    /* no recorded callee: the unrecorded frames' time is b's own */
    ASSERT_EQ_I64(fb.tsub_ns, 5);
    ASSERT_EDGE(p, FA, FB, 1, 1, 5, 5);
    /* e: once in H (50), once top-level in G (1) */
    ASSERT_FUNC(p, FE, 2, 2, 51, 51);
    ASSERT_FALSE(find_edge(p, FA, FE, NULL));
    ASSERT_FALSE(find_edge(p, FB, FE, NULL));
    ASSERT_EQ_SIZE(count_real_edges(p), 1);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

TEST(calls_max_funcs_cap)
{
    fake_clock c;
    gqp_profile *p = new_profile();
    int rc;
    fc_init(&c);
    ASSERT_OK(gqp_profile_set(p, GQP_PROFILE_MAX_FUNCS, 2));
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    ASSERT_OK(gqp_tracer_set_default(t, p));
    EV(gqp_tracer_switch(t, 0, KG, 0));
    EV(gqp_tracer_call(t, FA));
    fc_run(&c, 1);
    EV(gqp_tracer_return(t));
    EV(gqp_tracer_call(t, FB));
    fc_run(&c, 1);
    EV(gqp_tracer_return(t));
    rc = EV(gqp_tracer_call(t, FC)); /* a third function: dropped */
    ASSERT_HAS_FLAG(rc, GQP_EV_DROPPED);
    ASSERT_NO_FLAG(rc, GQP_EV_NEW_FUNC);
    fc_run(&c, 1);
    EV(gqp_tracer_return(t));
    rc = EV(gqp_tracer_call(t, FA)); /* known: fine */
    ASSERT_NO_FLAG(rc, GQP_EV_DROPPED);
    fc_run(&c, 4);
    EV(gqp_tracer_return(t));
    ASSERT_EQ_SIZE(gqp_profile_func_count(p), 2);
    ASSERT_GE_U64(gqp_profile_calls_dropped(p), 1);
    ASSERT_FALSE(find_func(p, FC, NULL));
    ASSERT_FUNC(p, FA, 2, 2, 5, 5);
    ASSERT_FUNC(p, FB, 1, 1, 1, 1);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

TEST(calls_max_edges_cap)
{
    fake_clock c;
    gqp_profile *p = new_profile();
    fc_init(&c);
    ASSERT_OK(gqp_profile_set(p, GQP_PROFILE_MAX_EDGES, 1));
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    ASSERT_OK(gqp_tracer_set_default(t, p));
    EV(gqp_tracer_switch(t, 0, KG, 0));
    EV(gqp_tracer_call(t, FA));
    EV(gqp_tracer_call(t, FB));
    fc_run(&c, 1);
    EV(gqp_tracer_return(t));
    EV(gqp_tracer_call(t, FC));
    fc_run(&c, 1);
    EV(gqp_tracer_return(t));
    EV(gqp_tracer_call(t, FD));
    fc_run(&c, 1);
    EV(gqp_tracer_return(t));
    EV(gqp_tracer_return(t));
    ASSERT_EQ_SIZE(gqp_profile_edge_count(p), 1);
    ASSERT_GE_U64(gqp_profile_calls_dropped(p), 2);
    /* the stack stayed in sync: a's times are right */
    gqp_func_stat fa;
    GET_FUNC(p, FA, &fa);
    ASSERT_EQ_U64(fa.ncall, 1);
    ASSERT_EQ_I64(fa.ttot_ns, 3);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

/* Clearing a profile makes functions new again; recording continues. */
TEST(calls_clear_then_continue)
{
    fake_clock c;
    gqp_profile *p;
    int rc;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU, &p);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    EV(gqp_tracer_call(t, FA));
    fc_run(&c, 3);
    EV(gqp_tracer_return(t));
    ASSERT_EQ_SIZE(gqp_profile_func_count(p), 1);
    ASSERT_OK(gqp_profile_clear(p));
    ASSERT_EQ_SIZE(gqp_profile_func_count(p), 0);
    rc = EV(gqp_tracer_call(t, FA));
    ASSERT_HAS_FLAG(rc, GQP_EV_NEW_FUNC);
    fc_run(&c, 2);
    EV(gqp_tracer_return(t));
    ASSERT_FUNC(p, FA, 1, 1, 2, 2);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_EQ_SIZE(gqp_profile_span_count(p), 1);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

/* GQP_CLOCK_CPU without CPU measurement (GQP_CPU_OFF): the header does not
 * say what "on CPU" means then.  At least time while the greenlet was
 * switched out must not be charged: a() gets between its CPU time (16) and
 * the wall time its greenlet ran while it was on the stack (20). */
TEST(calls_seed_scenario_cpu_clock_cpu_off)
{
    fake_clock c;
    gqp_profile *p;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_OFF, GQP_CLOCK_CPU, &p);
    seed_scenario(t, &c);
    gqp_func_stat fa;
    GET_FUNC(p, FA, &fa);
    ASSERT_GE_I64(fa.ttot_ns, 16);
    ASSERT_LE_I64(fa.ttot_ns, 20);
    ASSERT_EQ_U64(c.cpu_reads, 0);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}
