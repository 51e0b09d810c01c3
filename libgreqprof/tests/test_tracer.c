/* test_tracer.c -- tracer parameters and state, flush, attach / detach /
 * inherit, profile close and reference counting, caps, waited. */
#include "harness.h"
#include "testutil.h"

static int64_t tget(const gqp_tracer *t, gqp_tracer_param k)
{
    int64_t v = -12345;
    ASSERT_OK(gqp_tracer_get(t, k, &v));
    return v;
}

TEST(tracer_new_defaults)
{
    gqp_tracer *t = NULL;
    ASSERT_OK(gqp_tracer_new(&t));
    ASSERT_NOT_NULL(t);
    ASSERT_EQ_I64(tget(t, GQP_TRACER_CPU_MODE), GQP_CPU_ESTIMATE);
    ASSERT_EQ_I64(tget(t, GQP_TRACER_CPU_WINDOW_NS), 100000);
    ASSERT_EQ_I64(tget(t, GQP_TRACER_CALL_CLOCK), GQP_CLOCK_CPU);
    ASSERT_EQ_I64(tget(t, GQP_TRACER_LONG_SPAN_NS), 0);
    ASSERT_EQ_I64(tget(t, GQP_TRACER_MAX_DEPTH), 1024);
    ASSERT_EQ_I64(tget(t, GQP_TRACER_MAX_GREENLETS), INT64_C(1) << 20);
    ASSERT_EQ_I64(tget(t, GQP_TRACER_HISTORY), 4096);
    ASSERT_EQ_I64(tget(t, GQP_TRACER_CPU_WINDOW_OTHERS_NS), 0);
    ASSERT_EQ_SIZE(gqp_tracer_greenlet_count(t), 0);
    gqp_tracer_free(t);
}

TEST(tracer_set_get_roundtrip)
{
    gqp_tracer *t = NULL;
    ASSERT_OK(gqp_tracer_new(&t));
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_CPU_MODE, GQP_CPU_EXACT));
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_CPU_WINDOW_NS, 5000));
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_CALL_CLOCK, GQP_CLOCK_WALL));
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_LONG_SPAN_NS, 777));
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_MAX_DEPTH, 3));
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_MAX_GREENLETS, 10));
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_HISTORY, 16));
    ASSERT_EQ_I64(tget(t, GQP_TRACER_CPU_MODE), GQP_CPU_EXACT);
    ASSERT_EQ_I64(tget(t, GQP_TRACER_CPU_WINDOW_NS), 5000);
    ASSERT_EQ_I64(tget(t, GQP_TRACER_CALL_CLOCK), GQP_CLOCK_WALL);
    ASSERT_EQ_I64(tget(t, GQP_TRACER_LONG_SPAN_NS), 777);
    ASSERT_EQ_I64(tget(t, GQP_TRACER_MAX_DEPTH), 3);
    ASSERT_EQ_I64(tget(t, GQP_TRACER_MAX_GREENLETS), 10);
    ASSERT_EQ_I64(tget(t, GQP_TRACER_HISTORY), 16);
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_CPU_WINDOW_OTHERS_NS, 9000));
    ASSERT_EQ_I64(tget(t, GQP_TRACER_CPU_WINDOW_OTHERS_NS), 9000);
    ASSERT_RC2(gqp_tracer_set(t, GQP_TRACER_CPU_WINDOW_OTHERS_NS, -1),
               GQP_EINVAL, GQP_ERANGE);
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_CPU_MODE, GQP_CPU_OFF));
    ASSERT_EQ_I64(tget(t, GQP_TRACER_CPU_MODE), GQP_CPU_OFF);
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_CPU_MODE, GQP_CPU_ESTIMATE));
    ASSERT_EQ_I64(tget(t, GQP_TRACER_CPU_MODE), GQP_CPU_ESTIMATE);
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_CALL_CLOCK, GQP_CLOCK_CPU));
    ASSERT_EQ_I64(tget(t, GQP_TRACER_CALL_CLOCK), GQP_CLOCK_CPU);
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_LONG_SPAN_NS, 0));
    ASSERT_EQ_I64(tget(t, GQP_TRACER_LONG_SPAN_NS), 0);
    gqp_tracer_free(t);
}

TEST(tracer_set_get_invalid)
{
    gqp_tracer *t = NULL;
    int64_t v;
    ASSERT_OK(gqp_tracer_new(&t));
    ASSERT_RC(gqp_tracer_set(t, (gqp_tracer_param)0, 1), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_set(t, (gqp_tracer_param)9, 1), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_get(t, (gqp_tracer_param)0, &v), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_get(t, (gqp_tracer_param)99, &v), GQP_EINVAL);
    ASSERT_RC2(gqp_tracer_set(t, GQP_TRACER_CPU_MODE, 3), GQP_EINVAL,
               GQP_ERANGE);
    ASSERT_RC2(gqp_tracer_set(t, GQP_TRACER_CPU_MODE, -1), GQP_EINVAL,
               GQP_ERANGE);
    ASSERT_RC2(gqp_tracer_set(t, GQP_TRACER_CALL_CLOCK, 2), GQP_EINVAL,
               GQP_ERANGE);
    ASSERT_RC2(gqp_tracer_set(t, GQP_TRACER_CPU_WINDOW_NS, -1), GQP_EINVAL,
               GQP_ERANGE);
    ASSERT_RC2(gqp_tracer_set(t, GQP_TRACER_LONG_SPAN_NS, -1), GQP_EINVAL,
               GQP_ERANGE);
    ASSERT_RC2(gqp_tracer_set(t, GQP_TRACER_MAX_DEPTH, -1), GQP_EINVAL,
               GQP_ERANGE);
    ASSERT_RC2(gqp_tracer_set(t, GQP_TRACER_MAX_GREENLETS, -1), GQP_EINVAL,
               GQP_ERANGE);
    ASSERT_RC2(gqp_tracer_set(t, GQP_TRACER_HISTORY, INT64_MIN), GQP_EINVAL,
               GQP_ERANGE);
    ASSERT_EQ_I64(tget(t, GQP_TRACER_CPU_MODE), GQP_CPU_ESTIMATE);
    ASSERT_EQ_I64(tget(t, GQP_TRACER_CALL_CLOCK), GQP_CLOCK_CPU);
    ASSERT_EQ_I64(tget(t, GQP_TRACER_CPU_WINDOW_NS), 100000);
    ASSERT_EQ_I64(tget(t, GQP_TRACER_HISTORY), 4096);
    gqp_tracer_free(t);
}

TEST(tracer_params_rejected_while_running)
{
    static const gqp_tracer_param params[] = {
        GQP_TRACER_CPU_MODE,   GQP_TRACER_CPU_WINDOW_NS,
        GQP_TRACER_CALL_CLOCK, GQP_TRACER_LONG_SPAN_NS,
        GQP_TRACER_MAX_DEPTH,  GQP_TRACER_MAX_GREENLETS,
        GQP_TRACER_HISTORY};
    static const int64_t values[] = {GQP_CPU_OFF, 1234, GQP_CLOCK_WALL, 99,
                                     7, 100, 8};
    fake_clock c, c2;
    int64_t before[7];
    fc_init(&c);
    fc_init(&c2);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    for (int i = 0; i < 7; i++)
        before[i] = tget(t, params[i]);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    for (int i = 0; i < 7; i++) {
        if (params[i] == GQP_TRACER_LONG_SPAN_NS ||
            params[i] == GQP_TRACER_CPU_WINDOW_NS)
            continue; /* "may be changed at any time" */
        ASSERT_RC(gqp_tracer_set(t, params[i], values[i]), GQP_ESTATE);
        ASSERT_EQ_I64(tget(t, params[i]), before[i]);
    }
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_LONG_SPAN_NS, 5));
    ASSERT_EQ_I64(tget(t, GQP_TRACER_LONG_SPAN_NS), 5);
    ASSERT_RC(gqp_tracer_set_clocks(t, fake_wall_fn, fake_cpu_fn, &c2),
              GQP_ESTATE);
    ASSERT_RC(gqp_tracer_set_clocks(t, NULL, NULL, NULL), GQP_ESTATE);
    /* still running on the old clocks */
    EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_EQ_U64(c2.wall_reads, 0);
    ASSERT_RC(gqp_tracer_set(t, GQP_TRACER_MAX_DEPTH, 5), GQP_ESTATE);

    ASSERT_OK(gqp_tracer_flush(t));
    for (int i = 0; i < 7; i++) {
        ASSERT_OK(gqp_tracer_set(t, params[i], values[i]));
        ASSERT_EQ_I64(tget(t, params[i]), values[i]);
    }
    ASSERT_OK(gqp_tracer_set_clocks(t, fake_wall_fn, fake_cpu_fn, &c2));
    /* and running again locks them again */
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_TRUE(c2.wall_reads > 0);
    ASSERT_RC(gqp_tracer_set(t, GQP_TRACER_CPU_MODE, GQP_CPU_EXACT),
              GQP_ESTATE);
    gqp_tracer_free(t);
}

/* The CPU window may change while greenlets run.  A wide window lets the
 * estimate count off-CPU time as CPU; narrowing it makes the next event
 * read the real clock, so the spans after it are within the new window. */
TEST(tracer_cpu_window_changes_while_running)
{
    fake_clock c;
    fc_init(&c);
    gqp_profile *p = NULL;
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_ESTIMATE, GQP_CLOCK_CPU,
                                       &p);
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_CPU_WINDOW_NS, 10000000));
    EV(gqp_tracer_switch(t, 0, KG, 0));
    fc_run(&c, 1000);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    fc_idle(&c, 50000); /* KH waits off CPU: inside the 10 ms window */
    EV(gqp_tracer_switch(t, KH, KG, 0));
    gqp_span s1 = get_span(p, 1);
    ASSERT_EQ_I64(s1.cpu_ns, 50000); /* counted as CPU: within the window */
    ASSERT_RC(gqp_tracer_set(t, GQP_TRACER_CPU_WINDOW_NS, -1), GQP_ERANGE);
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_CPU_WINDOW_NS, 100));
    ASSERT_EQ_I64(tget(t, GQP_TRACER_CPU_WINDOW_NS), 100);
    fc_run(&c, 3000);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    fc_idle(&c, 50000);
    fc_run(&c, 2000);
    EV(gqp_tracer_switch(t, KH, KG, 0));
    ASSERT_EQ_U64(gqp_profile_span_count(p), 4);
    gqp_span s3 = get_span(p, 3);
    ASSERT_TRUE(s3.cpu_ns >= 2000 - 100 && s3.cpu_ns <= 2000 + 100);
    ASSERT_OK(gqp_tracer_flush(t));
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

/* Flush charges open frames up to now and closes the running span. */
TEST(tracer_flush_unwinds_stacks_cpu_clock)
{
    fake_clock c;
    gqp_profile *p;
    uint64_t key, id;
    int64_t since;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU, &p);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    EV(gqp_tracer_call(t, FA));
    fc_run(&c, 3);
    EV(gqp_tracer_call(t, FB));
    fc_run(&c, 4);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    EV(gqp_tracer_call(t, FC));
    fc_run(&c, 2);
    ASSERT_OK(gqp_tracer_flush(t));

    ASSERT_FUNC(p, FA, 1, 1, 7, 3);
    ASSERT_FUNC(p, FB, 1, 1, 4, 4);
    ASSERT_FUNC(p, FC, 1, 1, 2, 2);
    ASSERT_EDGE(p, FA, FB, 1, 1, 4, 4);
    ASSERT_EQ_SIZE(count_real_edges(p), 1);
    ASSERT_EQ_SIZE(gqp_profile_span_count(p), 2);
    ASSERT_SPAN(get_span(p, 1), gid(t, KH), W0 + 7, W0 + 9, 2,
                GQP_SPAN_SPLIT);

    ASSERT_RC(gqp_tracer_current(t, &key, &id, NULL), GQP_ENOTFOUND);
    ASSERT_RC(gqp_tracer_running_since(t, &since, &id), GQP_ENOTFOUND);
    /* flushing an idle tracer is harmless */
    ASSERT_OK(gqp_tracer_flush(t));
    ASSERT_EQ_SIZE(gqp_profile_span_count(p), 2);
    ASSERT_FUNC(p, FA, 1, 1, 7, 3);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

TEST(tracer_flush_unwinds_stacks_wall_clock)
{
    fake_clock c;
    gqp_profile *p;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_WALL, &p);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    EV(gqp_tracer_call(t, FA));
    fc_run(&c, 3);
    EV(gqp_tracer_call(t, FB));
    fc_run(&c, 4);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    EV(gqp_tracer_call(t, FC));
    fc_run(&c, 2);
    ASSERT_OK(gqp_tracer_flush(t));
    /* wall: G's frames keep accruing while H runs */
    ASSERT_FUNC(p, FA, 1, 1, 9, 3);
    ASSERT_FUNC(p, FB, 1, 1, 6, 6);
    ASSERT_FUNC(p, FC, 1, 1, 2, 2);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

/* After a flush the stacks are empty: late returns of flushed frames must
 * not be charged again, and new calls start at the top level. */
TEST(tracer_flush_then_feed_again)
{
    fake_clock c;
    gqp_profile *p;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU, &p);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    EV(gqp_tracer_call(t, FA));
    fc_run(&c, 3);
    EV(gqp_tracer_call(t, FB));
    fc_run(&c, 4);
    ASSERT_OK(gqp_tracer_flush(t));
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_LONG_SPAN_NS, 1000));

    EV(gqp_tracer_switch(t, 0, KG, 0));
    fc_run(&c, 1);
    (void)gqp_tracer_return(t); /* b (already flushed) */
    (void)gqp_tracer_return(t); /* a (already flushed) */
    EV(gqp_tracer_call(t, FD));
    fc_run(&c, 2);
    EV(gqp_tracer_return(t));
    fc_run(&c, 1000);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_OK(gqp_tracer_flush(t));

    ASSERT_FUNC(p, FA, 1, 1, 7, 3);
    ASSERT_FUNC(p, FB, 1, 1, 4, 4);
    ASSERT_FUNC(p, FD, 1, 1, 2, 2);
    ASSERT_FALSE(find_edge(p, FA, FD, NULL));
    ASSERT_FALSE(find_edge(p, FB, FD, NULL));
    /* the new LONG_SPAN_NS applies */
    gqp_span s = get_span(p, 1);
    ASSERT_EQ_I64(s.end_ns - s.start_ns, 1003);
    ASSERT_EQ_U64(s.flags & GQP_SPAN_LONG, GQP_SPAN_LONG);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

TEST(tracer_max_greenlets_cap)
{
    fake_clock c;
    uint64_t key = 0, id;
    int rc;
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_OFF, GQP_CLOCK_WALL);
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_MAX_GREENLETS, 2));
    EV(gqp_tracer_switch(t, 0, KG, 0));
    EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_EQ_SIZE(gqp_tracer_greenlet_count(t), 2);
    rc = gqp_tracer_switch(t, KH, KI, 0);
    /* either refused with ELIMIT or accepted with data dropped */
    if (rc < 0)
        ASSERT_RC(rc, GQP_ELIMIT);
    else
        ASSERT_HAS_FLAG(rc, GQP_EV_DROPPED);
    ASSERT_LE_U64(gqp_tracer_greenlet_count(t), 2);
    ASSERT_RC(gqp_tracer_greenlet_id(t, KI, &id), GQP_ENOTFOUND);
    rc = gqp_tracer_inherit(t, KI, KG);
    ASSERT_TRUE(rc == GQP_ELIMIT || rc == GQP_OK);
    ASSERT_LE_U64(gqp_tracer_greenlet_count(t), 2);
    /* room again after a greenlet ends */
    if (gqp_tracer_current(t, &key, NULL, NULL) != GQP_OK)
        key = 0;
    if (key != KG) {
        EV(gqp_tracer_switch(t, key, KG, 0));
    }
    EV(gqp_tracer_switch(t, KG, KH, GQP_SWITCH_FROM_DEAD));
    ASSERT_EQ_SIZE(gqp_tracer_greenlet_count(t), 1);
    rc = EV(gqp_tracer_switch(t, KH, KI, 0));
    ASSERT_HAS_FLAG(rc, GQP_EV_NEW_GREENLET);
    ASSERT_NO_FLAG(rc, GQP_EV_DROPPED);
    ASSERT_EQ_SIZE(gqp_tracer_greenlet_count(t), 2);
    gid(t, KI);
    gqp_tracer_free(t);
}

TEST(tracer_zero_keys_rejected)
{
    fake_clock c;
    gqp_profile *p;
    uint64_t key = 0, id = 0;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_OFF, GQP_CLOCK_WALL, &p);
    ASSERT_RC(gqp_tracer_switch(t, 0, 0, 0), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_current(t, &key, &id, NULL), GQP_ENOTFOUND);
    ASSERT_EQ_SIZE(gqp_tracer_greenlet_count(t), 0);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    fc_idle(&c, 5);
    ASSERT_RC(gqp_tracer_switch(t, KG, 0, 0), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_switch(t, KG, 0, GQP_SWITCH_FROM_DEAD), GQP_EINVAL);
    /* nothing changed */
    ASSERT_OK(gqp_tracer_current(t, &key, &id, NULL));
    ASSERT_EQ_U64(key, KG);
    ASSERT_EQ_SIZE(gqp_tracer_greenlet_count(t), 1);
    ASSERT_EQ_SIZE(gqp_profile_span_count(p), 0);
    ASSERT_RC(gqp_tracer_call(t, 0), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_attach(t, 0, p), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_attach(t, 0, NULL), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_inherit(t, 0, KG), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_inherit(t, KH, 0), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_greenlet_id(t, 0, &id), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_forget(t, 0), GQP_EINVAL);
    ASSERT_EQ_SIZE(gqp_profile_span_count(p), 0);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

/* ---- attach / detach / inherit ---------------------------------------- */

TEST(attach_splits_running_span)
{
    fake_clock c;
    gqp_profile *d, *p = new_profile(), *lp = NULL;
    gqp_span s;
    gqp_greenlet_stat g;
    size_t idx = 7;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU, &d);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    uint64_t ig = gid(t, KG);
    fc_run(&c, 10);
    ASSERT_OK(gqp_tracer_attach(t, KG, p));
    ASSERT_OK(gqp_tracer_last_span(t, &s, &lp, &idx));
    ASSERT_SPAN(s, ig, W0, W0 + 10, 10, FIRST | GQP_SPAN_SPLIT);
    ASSERT_EQ_PTR(lp, d);
    ASSERT_EQ_U64(idx, 0);
    int64_t since = 0;
    ASSERT_OK(gqp_tracer_running_since(t, &since, NULL));
    ASSERT_EQ_I64(since, W0 + 10);
    fc_run(&c, 15);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_EQ_SIZE(gqp_profile_span_count(d), 1);
    ASSERT_SPAN(get_span(d, 0), ig, W0, W0 + 10, 10, FIRST | GQP_SPAN_SPLIT);
    ASSERT_EQ_SIZE(gqp_profile_span_count(p), 1);
    /* the part after the split continues the same run */
    ASSERT_SPAN(get_span(p, 0), ig, W0 + 10, W0 + 25, 15, GQP_SPAN_CONTINUED);

    /* detach: back to the default, split again */
    fc_run(&c, 1); /* H */
    EV(gqp_tracer_switch(t, KH, KG, 0));
    fc_run(&c, 5);
    ASSERT_OK(gqp_tracer_attach(t, KG, NULL));
    ASSERT_OK(gqp_tracer_last_span(t, &s, &lp, &idx));
    ASSERT_EQ_PTR(lp, p);
    ASSERT_EQ_U64(idx, 1);
    ASSERT_SPAN(s, ig, W0 + 26, W0 + 31, 5, GQP_SPAN_SPLIT);
    fc_run(&c, 2);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_EQ_SIZE(gqp_profile_span_count(p), 2);
    ASSERT_SPAN(get_span(p, 1), ig, W0 + 26, W0 + 31, 5, GQP_SPAN_SPLIT);
    /* d: G's first part, H's span, G's last part */
    ASSERT_EQ_SIZE(gqp_profile_span_count(d), 3);
    ASSERT_SPAN(get_span(d, 2), ig, W0 + 31, W0 + 33, 2, GQP_SPAN_CONTINUED);

    GET_GREENLET(p, ig, &g);
    ASSERT_EQ_I64(g.wall_ns, 20);
    ASSERT_EQ_I64(g.cpu_ns, 20);
    ASSERT_EQ_U64(g.switches, 1); /* [26,31]; [10,25] continued a run */
    GET_GREENLET(d, ig, &g);
    ASSERT_EQ_I64(g.wall_ns, 12);
    ASSERT_EQ_U64(g.switches, 0); /* [0,10] began mid-run, [31,33] split */
    ASSERT_FALSE(find_greenlet(p, gid(t, KH), NULL));
    gqp_tracer_free(t);
    gqp_profile_free(d);
    gqp_profile_free(p);
}

/* Attaching a switched-out greenlet routes its next spans. */
TEST(attach_switched_out_greenlet)
{
    fake_clock c;
    gqp_profile *d, *p = new_profile(), *cp = NULL;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU, &d);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    fc_run(&c, 4);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_OK(gqp_tracer_attach(t, KG, p));
    ASSERT_OK(gqp_tracer_current(t, NULL, NULL, &cp));
    ASSERT_EQ_PTR(cp, d); /* H is unaffected */
    fc_run(&c, 6);
    EV(gqp_tracer_switch(t, KH, KG, 0));
    ASSERT_OK(gqp_tracer_current(t, NULL, NULL, &cp));
    ASSERT_EQ_PTR(cp, p);
    fc_run(&c, 8);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_EQ_SIZE(gqp_profile_span_count(d), 2);
    ASSERT_SPAN(get_span(d, 0), gid(t, KG), W0, W0 + 4, 4, FIRST);
    ASSERT_SPAN(get_span(d, 1), gid(t, KH), W0 + 4, W0 + 10, 6, 0);
    ASSERT_EQ_SIZE(gqp_profile_span_count(p), 1);
    ASSERT_SPAN(get_span(p, 0), gid(t, KG), W0 + 10, W0 + 18, 8, 0);
    gqp_tracer_free(t);
    gqp_profile_free(d);
    gqp_profile_free(p);
}

/* Frames entered before the attach are not charged to the new profile,
 * neither as functions nor as callers. */
TEST(attach_frames_before_not_charged)
{
    fake_clock c;
    gqp_profile *d, *p = new_profile();
    int rc;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU, &d);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    EV(gqp_tracer_call(t, FA));
    fc_run(&c, 10);
    ASSERT_OK(gqp_tracer_attach(t, KG, p));
    rc = EV(gqp_tracer_call(t, FB));
    ASSERT_HAS_FLAG(rc, GQP_EV_NEW_FUNC);
    fc_run(&c, 5);
    EV(gqp_tracer_return(t)); /* b */
    fc_run(&c, 3);
    EV(gqp_tracer_return(t)); /* a: entered before the attach */
    fc_run(&c, 2);
    EV(gqp_tracer_call(t, FC));
    fc_run(&c, 1);
    EV(gqp_tracer_return(t));
    EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_OK(gqp_tracer_flush(t));

    ASSERT_FALSE(find_func(p, FA, NULL));
    ASSERT_FUNC(p, FB, 1, 1, 5, 5);
    ASSERT_FUNC(p, FC, 1, 1, 1, 1);
    ASSERT_EQ_SIZE(gqp_profile_func_count(p), 2);
    ASSERT_EQ_SIZE(count_edges_from(p, FA), 0);
    ASSERT_EQ_SIZE(count_real_edges(p), 0);
    /* the default profile never sees b or c */
    ASSERT_FALSE(find_func(d, FB, NULL));
    ASSERT_FALSE(find_func(d, FC, NULL));
    ASSERT_SPAN(get_span(p, 0), gid(t, KG), W0 + 10, W0 + 21, 11,
                GQP_SPAN_CONTINUED);
    gqp_tracer_free(t);
    gqp_profile_free(d);
    gqp_profile_free(p);
}

/* The same for a greenlet attached while switched out with open frames. */
TEST(attach_switched_out_frames_not_charged)
{
    fake_clock c;
    gqp_profile *d, *p = new_profile();
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_WALL, &d);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    EV(gqp_tracer_call(t, FA));
    EV(gqp_tracer_call(t, FB));
    fc_run(&c, 2);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_OK(gqp_tracer_attach(t, KG, p));
    fc_run(&c, 3);
    EV(gqp_tracer_switch(t, KH, KG, 0));
    EV(gqp_tracer_call(t, FC));
    fc_run(&c, 4);
    EV(gqp_tracer_return(t)); /* c */
    EV(gqp_tracer_return(t)); /* b (before attach) */
    EV(gqp_tracer_return(t)); /* a (before attach) */
    EV(gqp_tracer_call(t, FD));
    fc_run(&c, 1);
    EV(gqp_tracer_return(t));
    ASSERT_OK(gqp_tracer_flush(t));
    ASSERT_FALSE(find_func(p, FA, NULL));
    ASSERT_FALSE(find_func(p, FB, NULL));
    ASSERT_FUNC(p, FC, 1, 1, 4, 4);
    ASSERT_FUNC(p, FD, 1, 1, 1, 1);
    ASSERT_EQ_SIZE(count_real_edges(p), 0);
    gqp_tracer_free(t);
    gqp_profile_free(d);
    gqp_profile_free(p);
}

TEST(attach_to_same_profile_twice_no_double_split)
{
    fake_clock c;
    gqp_profile *d, *p = new_profile();
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU, &d);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    fc_run(&c, 2);
    ASSERT_OK(gqp_tracer_attach(t, KG, p));
    fc_run(&c, 3);
    ASSERT_OK(gqp_tracer_attach(t, KG, p));
    fc_run(&c, 4);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    /* whether re-attaching splits is not specified; the time must add up */
    int64_t total = 0;
    for (size_t i = 0; i < gqp_profile_span_count(p); i++) {
        gqp_span s = get_span(p, i);
        total += s.end_ns - s.start_ns;
    }
    ASSERT_EQ_I64(total, 7);
    ASSERT_EQ_SIZE(gqp_profile_span_count(d), 1);
    gqp_tracer_free(t);
    gqp_profile_free(d);
    gqp_profile_free(p);
}

TEST(inherit_child_gets_parent_profile)
{
    fake_clock c;
    gqp_profile *d, *p = new_profile(), *cp = NULL;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU, &d);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_OK(gqp_tracer_attach(t, KG, p));
    ASSERT_OK(gqp_tracer_inherit(t, KI, KG)); /* KI not seen yet */
    fc_run(&c, 3);
    EV(gqp_tracer_switch(t, KG, KI, 0));
    ASSERT_OK(gqp_tracer_current(t, NULL, NULL, &cp));
    ASSERT_EQ_PTR(cp, p);
    EV(gqp_tracer_call(t, FA));
    fc_run(&c, 4);
    EV(gqp_tracer_return(t));
    EV(gqp_tracer_switch(t, KI, KG, 0));
    /* an unattached parent passes on the default */
    ASSERT_OK(gqp_tracer_attach(t, KI, NULL));
    ASSERT_OK(gqp_tracer_inherit(t, UINT64_MAX, KI));
    EV(gqp_tracer_switch(t, KG, UINT64_MAX, 0));
    ASSERT_OK(gqp_tracer_current(t, NULL, NULL, &cp));
    ASSERT_EQ_PTR(cp, d);
    fc_run(&c, 9);
    EV(gqp_tracer_switch(t, UINT64_MAX, KG, 0));

    uint64_t ii = gid(t, KI);
    gqp_greenlet_stat g;
    GET_GREENLET(p, ii, &g);
    ASSERT_EQ_I64(g.wall_ns, 4);
    ASSERT_FALSE(find_greenlet(d, ii, NULL));
    ASSERT_FUNC(p, FA, 1, 1, 4, 4);
    ASSERT_FALSE(find_func(d, FA, NULL));
    GET_GREENLET(d, gid(t, UINT64_MAX), &g);
    ASSERT_EQ_I64(g.wall_ns, 9);
    ASSERT_FALSE(find_greenlet(p, gid(t, UINT64_MAX), NULL));
    gqp_tracer_free(t);
    gqp_profile_free(d);
    gqp_profile_free(p);
}

TEST(inherit_unknown_parent)
{
    fake_clock c;
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_OFF, GQP_CLOCK_WALL);
    ASSERT_RC(gqp_tracer_inherit(t, KI, KG), GQP_ENOTFOUND);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_RC(gqp_tracer_inherit(t, KI, 0xbad0), GQP_ENOTFOUND);
    ASSERT_OK(gqp_tracer_inherit(t, KI, KG));
    gqp_tracer_free(t);
}

/* ---- close / clear while attached ---------------------------------------- */

TEST(close_profile_ignores_further_events)
{
    fake_clock c;
    gqp_profile *d, *p = new_profile();
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU, &d);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_OK(gqp_tracer_attach(t, KG, p));
    fc_run(&c, 5);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    fc_run(&c, 1);
    EV(gqp_tracer_switch(t, KH, KG, 0));
    EV(gqp_tracer_call(t, FA));
    fc_run(&c, 1);
    EV(gqp_tracer_return(t));
    EV(gqp_tracer_call(t, FB)); /* still open at close */
    fc_run(&c, 1);
    size_t spans = gqp_profile_span_count(p);
    gqp_greenlet_stat before, after;
    GET_GREENLET(p, gid(t, KG), &before);
    ASSERT_EQ_SIZE(spans, 1);

    ASSERT_OK(gqp_profile_close(p));
    ASSERT_EQ_I64(gqp_profile_is_closed(p), 1);
    fc_run(&c, 3);
    EV(gqp_tracer_return(t)); /* b */
    EV(gqp_tracer_switch(t, KG, KH, 0));
    fc_run(&c, 1);
    EV(gqp_tracer_switch(t, KH, KG, 0));
    EV(gqp_tracer_call(t, FC));
    fc_run(&c, 1);
    EV(gqp_tracer_return(t));
    EV(gqp_tracer_call(t, FA));
    EV(gqp_tracer_return(t));
    ASSERT_OK(gqp_tracer_flush(t));

    ASSERT_EQ_SIZE(gqp_profile_span_count(p), spans);
    ASSERT_EQ_U64(gqp_profile_spans_dropped(p), 0);
    ASSERT_FUNC(p, FA, 1, 1, 1, 1);
    ASSERT_FALSE(find_func(p, FC, NULL));
    /* b was open at the close: at most its time until the close */
    gqp_func_stat fb;
    if (find_func(p, FB, &fb)) {
        ASSERT_LE_U64(fb.ncall, 1);
        ASSERT_LE_I64(fb.ttot_ns, 1);
    }
    ASSERT_LE_U64(gqp_profile_func_count(p), 2);
    GET_GREENLET(p, gid(t, KG), &after);
    ASSERT_EQ_I64(after.wall_ns, before.wall_ns);
    ASSERT_EQ_U64(after.switches, before.switches);
    /* reattaching to a closed profile is pointless but must not crash;
     * either it is refused or events keep being ignored */
    int rc = gqp_tracer_attach(t, KG, p);
    ASSERT_TRUE(rc == GQP_OK || rc == GQP_ESTATE);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    fc_run(&c, 2);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_EQ_SIZE(gqp_profile_span_count(p), spans);
    gqp_tracer_free(t);
    gqp_profile_free(d);
    gqp_profile_free(p);
}

TEST(close_default_profile)
{
    fake_clock c;
    gqp_profile *d;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU, &d);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    fc_run(&c, 1);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_OK(gqp_profile_close(d));
    gqp_profile_free(d); /* the tracer still holds it */
    for (int i = 0; i < 10; i++) {
        EV(gqp_tracer_call(t, FA));
        fc_run(&c, 1);
        EV(gqp_tracer_return(t));
        EV(gqp_tracer_switch(t, i % 2 ? KG : KH, i % 2 ? KH : KG, 0));
    }
    gqp_profile *cp = NULL;
    uint64_t key;
    int rc = gqp_tracer_current(t, &key, NULL, &cp);
    ASSERT_OK(rc);
    if (cp != NULL) {
        ASSERT_EQ_PTR(cp, d);
        ASSERT_EQ_SIZE(gqp_profile_span_count(cp), 1);
        ASSERT_EQ_SIZE(gqp_profile_func_count(cp), 0);
    }
    gqp_tracer_free(t);
}

/* ---- reference counting (run under ASan / valgrind) ------------------- */

TEST(refcount_attached_profile_outlives_caller)
{
    fake_clock c;
    gqp_profile *p = new_profile(), *cp = NULL;
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_OK(gqp_tracer_attach(t, KG, p));
    gqp_profile_free(p); /* the caller's reference */
    for (int i = 0; i < 20; i++) {
        EV(gqp_tracer_call(t, FA + (uint64_t)(i % 3)));
        fc_run(&c, 1);
        EV(gqp_tracer_return(t));
        EV(gqp_tracer_switch(t, KG, KH, 0));
        EV(gqp_tracer_switch(t, KH, KG, 0));
    }
    ASSERT_OK(gqp_tracer_current(t, NULL, NULL, &cp));
    ASSERT_EQ_PTR(cp, p);
    ASSERT_EQ_SIZE(gqp_profile_span_count(cp), 20);
    ASSERT_EQ_SIZE(gqp_profile_func_count(cp), 3);
    gqp_tracer_free(t); /* frees p: LeakSanitizer/valgrind check */
}

TEST(refcount_default_profile)
{
    fake_clock c;
    gqp_profile *p1 = new_profile(), *p2 = new_profile(), *cp = NULL;
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    ASSERT_OK(gqp_tracer_set_default(t, p1));
    ASSERT_OK(gqp_tracer_set_default(t, p1)); /* same again: no extra ref */
    gqp_profile_free(p1);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    fc_run(&c, 2);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_OK(gqp_tracer_current(t, NULL, NULL, &cp));
    ASSERT_EQ_PTR(cp, p1);
    ASSERT_EQ_SIZE(gqp_profile_span_count(cp), 1);
    /* replacing the default drops the tracer's reference to p1 */
    ASSERT_OK(gqp_tracer_set_default(t, p2));
    gqp_profile_free(p2);
    fc_run(&c, 2);
    EV(gqp_tracer_switch(t, KH, KG, 0));
    ASSERT_OK(gqp_tracer_current(t, NULL, NULL, &cp));
    ASSERT_EQ_PTR(cp, p2);
    ASSERT_OK(gqp_tracer_set_default(t, NULL));
    EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_OK(gqp_tracer_current(t, NULL, NULL, &cp));
    ASSERT_NULL(cp);
    gqp_tracer_free(t);
}

TEST(refcount_profile_outlives_tracer)
{
    fake_clock c;
    gqp_profile *p = new_profile();
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    ASSERT_OK(gqp_tracer_set_default(t, p));
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_OK(gqp_tracer_attach(t, KG, p));
    EV(gqp_tracer_call(t, FA));
    fc_run(&c, 4);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    gqp_tracer_free(t); /* with a frame still open */
    ASSERT_EQ_I64(gqp_profile_is_closed(p), 0);
    ASSERT_TRUE(gqp_profile_span_count(p) >= 1);
    gqp_greenlet_stat g;
    ASSERT_OK(gqp_profile_greenlet(p, 0, &g));
    ASSERT_OK(gqp_profile_clear(p));
    gqp_profile_free(p);
}

TEST(refcount_many_greenlets_attached)
{
    fake_clock c;
    gqp_profile *p = new_profile(), *q = new_profile();
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_OFF, GQP_CLOCK_WALL);
    uint64_t prev = 0;
    for (uint64_t k = 1; k <= 50; k++) {
        EV(gqp_tracer_switch(t, prev, k, 0));
        ASSERT_OK(gqp_tracer_attach(t, k, (k % 2) ? p : q));
        prev = k;
    }
    gqp_profile_free(p);
    gqp_profile_free(q);
    /* half of them die, the rest are forgotten or left live */
    for (uint64_t k = 1; k <= 50; k++) {
        if (k % 3 == 0)
            ASSERT_OK(gqp_tracer_forget(t, k));
    }
    for (uint64_t k = 1; k <= 25; k++) {
        if (k % 3 == 0)
            continue;
        EV(gqp_tracer_switch(t, prev, k, 0));
        EV(gqp_tracer_switch(t, k, 100 + k, GQP_SWITCH_FROM_DEAD));
        prev = 100 + k;
    }
    gqp_tracer_free(t);
}

/* ---- waited --------------------------------------------------------------- */

/* G (profile "mine") and two others H1, H2:
 *   G [0,10]  H1 [10,30]  G [30,35]  H2 [35,40]  H1 [40,45]  H2 [45,46]
 *   G [46,50] H1 [50,...)                                                */
static gqp_tracer *waited_setup(fake_clock *c, gqp_profile *mine,
                                int64_t history)
{
    const uint64_t H1 = KH, H2 = KI;
    fc_init(c);
    gqp_tracer *t = new_tracer(c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    if (history)
        ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_HISTORY, history));
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_OK(gqp_tracer_attach(t, KG, mine));
    fc_run(c, 10);
    EV(gqp_tracer_switch(t, KG, H1, 0));
    fc_run(c, 20);
    EV(gqp_tracer_switch(t, H1, KG, 0));
    fc_run(c, 5);
    EV(gqp_tracer_switch(t, KG, H2, 0));
    fc_run(c, 5);
    EV(gqp_tracer_switch(t, H2, H1, 0));
    fc_run(c, 5);
    EV(gqp_tracer_switch(t, H1, H2, 0));
    fc_run(c, 1);
    EV(gqp_tracer_switch(t, H2, KG, 0));
    fc_run(c, 4);
    EV(gqp_tracer_switch(t, KG, H1, 0));
    fc_run(c, 10);
    return t;
}

TEST(waited_totals_and_top_n)
{
    fake_clock c;
    gqp_profile *mine = new_profile();
    gqp_tracer *t = waited_setup(&c, mine, 0);
    uint64_t h1 = gid(t, KH), h2 = gid(t, KI);
    uint64_t ids[4] = {0};
    int64_t ns[4] = {0}, total = -1;
    int complete = -1, rc;

    rc = gqp_tracer_waited(t, mine, W0 + 1, W0 + 50, &total, ids, ns, 4,
                           &complete);
    ASSERT_EQ_I64(rc, 2);
    ASSERT_EQ_I64(total, 31);
    ASSERT_EQ_U64(ids[0], h1);
    ASSERT_EQ_I64(ns[0], 25);
    ASSERT_EQ_U64(ids[1], h2);
    ASSERT_EQ_I64(ns[1], 6);
    ASSERT_EQ_I64(complete, 1);

    /* top 1 */
    memset(ids, 0, sizeof ids);
    rc = gqp_tracer_waited(t, mine, W0 + 1, W0 + 50, &total, ids, ns, 1,
                           &complete);
    ASSERT_EQ_I64(rc, 1);
    ASSERT_EQ_I64(total, 31);
    ASSERT_EQ_U64(ids[0], h1);
    ASSERT_EQ_I64(ns[0], 25);
    ASSERT_EQ_U64(ids[1], 0); /* untouched */

    /* n = 0: only the total */
    rc = gqp_tracer_waited(t, mine, W0 + 1, W0 + 50, &total, NULL, NULL, 0,
                           &complete);
    ASSERT_EQ_I64(rc, 0);
    ASSERT_EQ_I64(total, 31);

    /* partial overlaps are clipped to the interval */
    rc = gqp_tracer_waited(t, mine, W0 + 15, W0 + 42, &total, ids, ns, 4,
                           &complete);
    ASSERT_EQ_I64(rc, 2);
    ASSERT_EQ_I64(total, 22);
    ASSERT_EQ_U64(ids[0], h1);
    ASSERT_EQ_I64(ns[0], 17);
    ASSERT_EQ_U64(ids[1], h2);
    ASSERT_EQ_I64(ns[1], 5);

    /* an interval where only mine ran */
    rc = gqp_tracer_waited(t, mine, W0 + 31, W0 + 34, &total, ids, ns, 4,
                           &complete);
    ASSERT_EQ_I64(rc, 0);
    ASSERT_EQ_I64(total, 0);
    ASSERT_EQ_I64(complete, 1);

    /* relative to another profile, G's time counts too */
    gqp_profile *other = new_profile();
    rc = gqp_tracer_waited(t, other, W0 + 1, W0 + 50, &total, ids, ns, 4,
                           &complete);
    ASSERT_EQ_I64(rc, 3);
    ASSERT_EQ_I64(total, 49);
    ASSERT_EQ_U64(ids[0], h1);
    ASSERT_EQ_I64(ns[0], 25);
    ASSERT_EQ_U64(ids[1], gid(t, KG));
    ASSERT_EQ_I64(ns[1], 18);
    ASSERT_EQ_U64(ids[2], h2);
    ASSERT_EQ_I64(ns[2], 6);
    gqp_profile_free(other);
    gqp_tracer_free(t);
    gqp_profile_free(mine);
}

/* GQP_TRACER_CPU_WINDOW_OTHERS_NS: switches between greenlets in no
 * profile read the CPU clock only with the wider window, while a span of
 * a greenlet in a profile starts and ends with the narrow one (its CPU
 * time stays within it). */
TEST(others_window_spares_clock_reads)
{
    fake_clock c;
    gqp_profile *mine = new_profile();
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_ESTIMATE, GQP_CLOCK_CPU);
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_CPU_WINDOW_NS, 10));
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_CPU_WINDOW_OTHERS_NS, 1000));
    EV(gqp_tracer_switch(t, 0, KH, 0));
    EV(gqp_tracer_switch(t, KH, KI, 0));  /* (I new: a narrow start) */
    fc_run(&c, 20);
    EV(gqp_tracer_switch(t, KI, KH, 0));
    uint64_t reads = c.cpu_reads;
    for (int i = 0; i < 20; i++) {  /* 20 ns each, both in no profile */
        fc_run(&c, 20);
        EV(gqp_tracer_switch(t, i % 2 ? KI : KH, i % 2 ? KH : KI, 0));
    }
    ASSERT_EQ_U64(c.cpu_reads, reads);  /* (400 ns < 1000) */
    /* G in mine: off CPU 50 ns (the estimate runs ahead), then G runs */
    EV(gqp_tracer_switch(t, KH, KG, 0));
    ASSERT_OK(gqp_tracer_attach(t, KG, mine));
    fc_run(&c, 5);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    fc_idle(&c, 50);
    reads = c.cpu_reads;
    EV(gqp_tracer_switch(t, KH, KG, 0));
    ASSERT_EQ_U64(c.cpu_reads, reads + 1); /* G's span starts exact */
    fc_run(&c, 30);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    gqp_span sp;
    ASSERT_OK(gqp_tracer_last_span(t, &sp, NULL, NULL));
    ASSERT_EQ_I64(sp.cpu_ns, 30);
    ASSERT_EQ_U64(c.cpu_reads, reads + 2); /* and ends exact */
    /* with the option off (0), every span takes the narrow window */
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_CPU_WINDOW_OTHERS_NS, 0));
    reads = c.cpu_reads;
    fc_run(&c, 20);
    EV(gqp_tracer_switch(t, KH, KI, 0));
    ASSERT_EQ_U64(c.cpu_reads, reads + 1);
    gqp_tracer_free(t);
    gqp_profile_free(mine);
}

/* With the wider window in effect (a sample open beside greenlets in no
 * profile), a new greenlet does not read the CPU clock for its first span
 * unless it joins a profile: a neighbour's child costs no read, a child
 * that inherits its parent's profile reads it then, and its span's CPU
 * time is exact although the estimate ran ahead while the thread was off
 * CPU. */
TEST(others_window_new_greenlets_read_only_when_inheriting)
{
    const uint64_t KN = UINT64_C(0x7f0000004000);  /* a neighbour's child */
    const uint64_t KC = UINT64_C(0x7f0000005000);  /* G's child */
    fake_clock c;
    gqp_profile *mine = new_profile();
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_ESTIMATE, GQP_CLOCK_CPU);
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_CPU_WINDOW_NS, 10));
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_CPU_WINDOW_OTHERS_NS, 1000));
    EV(gqp_tracer_switch(t, 0, KH, 0));
    EV(gqp_tracer_switch(t, KH, KG, 0));
    ASSERT_OK(gqp_tracer_attach(t, KG, mine));
    fc_run(&c, 20);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    fc_run(&c, 20);
    uint64_t reads = c.cpu_reads;
    ASSERT_EQ_I64(gqp_tracer_switch(t, KH, KN, 0) & GQP_EV_NEW_GREENLET,
                  GQP_EV_NEW_GREENLET);
    ASSERT_OK(gqp_tracer_inherit(t, KN, KH));   /* (H passes nothing on) */
    ASSERT_EQ_U64(c.cpu_reads, reads);          /* no read for N */
    fc_run(&c, 20);
    EV(gqp_tracer_switch(t, KN, KH, 0));
    ASSERT_EQ_U64(c.cpu_reads, reads);
    /* off CPU 50 ns: the estimate runs ahead of the real clock */
    fc_idle(&c, 50);
    EV(gqp_tracer_switch(t, KH, KC, 0));
    ASSERT_EQ_U64(c.cpu_reads, reads);
    fc_run(&c, 4);
    ASSERT_OK(gqp_tracer_inherit(t, KC, KG));
    ASSERT_EQ_U64(c.cpu_reads, reads + 1);      /* C joins mine: one read */
    fc_run(&c, 30);
    EV(gqp_tracer_switch(t, KC, KH, 0));
    gqp_span sp;
    gqp_profile *sp_p = NULL;
    ASSERT_OK(gqp_tracer_last_span(t, &sp, &sp_p, NULL));
    ASSERT_TRUE(sp_p == mine);
    ASSERT_EQ_I64(sp.cpu_ns, 34);               /* exact: 4 + 30 */
    ASSERT_EQ_I64(sp.end_ns - sp.start_ns, 34);
    gqp_tracer_free(t);
    gqp_profile_free(mine);
}

/* The wider window is worked out when a setting it depends on changes
 * (not at every switch): a default or session profile, the CPU mode or a
 * narrow window above it each end it, and it comes back when they go. */
TEST(others_window_follows_settings)
{
    fake_clock c;
    gqp_profile *p = new_profile();
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_ESTIMATE, GQP_CLOCK_CPU);
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_CPU_WINDOW_NS, 10));
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_CPU_WINDOW_OTHERS_NS, 1000));
    EV(gqp_tracer_switch(t, 0, KH, 0));
    EV(gqp_tracer_switch(t, KH, KI, 0));
    EV(gqp_tracer_switch(t, KI, KH, 0));
    EV(gqp_tracer_switch(t, KH, KI, 0));
    /* (I in no profile: 20 ns between switches, wide or narrow) */
#define READS_PER_SWITCH(expect)                          \
    do {                                                  \
        uint64_t r0 = c.cpu_reads;                        \
        fc_run(&c, 20);                                   \
        EV(gqp_tracer_switch(t, KI, KH, 0));              \
        fc_run(&c, 20);                                   \
        EV(gqp_tracer_switch(t, KH, KI, 0));              \
        ASSERT_EQ_U64(c.cpu_reads - r0, (expect));        \
    } while (0)
    READS_PER_SWITCH(0);
    ASSERT_OK(gqp_tracer_set_default(t, p));
    READS_PER_SWITCH(2);
    ASSERT_OK(gqp_tracer_set_default(t, NULL));
    READS_PER_SWITCH(0);
    ASSERT_OK(gqp_tracer_set_session(t, p));
    READS_PER_SWITCH(2);
    ASSERT_OK(gqp_tracer_set_session(t, NULL));
    READS_PER_SWITCH(0);
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_CPU_WINDOW_NS, 2000));
    READS_PER_SWITCH(0);   /* (the narrow one, wider still: no read) */
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_CPU_WINDOW_NS, 10));
    READS_PER_SWITCH(0);
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_CPU_WINDOW_OTHERS_NS, 5));
    READS_PER_SWITCH(2);
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_CPU_WINDOW_OTHERS_NS, 1000));
    READS_PER_SWITCH(0);
#undef READS_PER_SWITCH
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

/* Spans closed while no greenlet is attached to a profile (and there is
 * no default or session) are not kept in the history: a server's
 * unsampled requests skip it.  Once one is attached they are kept. */
TEST(waited_history_only_while_attached)
{
    fake_clock c;
    gqp_profile *mine = new_profile();
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    int64_t t0 = c.wall;
    EV(gqp_tracer_switch(t, 0, KH, 0));
    fc_run(&c, 7);
    EV(gqp_tracer_switch(t, KH, KG, 0)); /* H's span: nobody attached */
    ASSERT_OK(gqp_tracer_attach(t, KG, mine));
    fc_run(&c, 3);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    fc_run(&c, 5);
    EV(gqp_tracer_switch(t, KH, KG, 0)); /* H's span: G attached */
    uint64_t h = gid(t, KH);
    uint64_t ids[2] = {0};
    int64_t ns[2] = {0}, total = -1;
    int complete = -1;
    int rc = gqp_tracer_waited(t, mine, t0, c.wall, &total, ids, ns, 2,
                               &complete);
    ASSERT_EQ_I64(rc, 1);
    ASSERT_EQ_U64(ids[0], h);
    ASSERT_EQ_I64(ns[0], 5); /* (not 12: the first span is not kept) */
    ASSERT_EQ_I64(total, 5);
    /* detached: G's spans go to no profile and are not kept either */
    ASSERT_OK(gqp_tracer_attach(t, KG, NULL));
    int64_t t1 = c.wall;
    fc_run(&c, 4);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    fc_run(&c, 2);
    EV(gqp_tracer_switch(t, KH, KG, 0));
    rc = gqp_tracer_waited(t, NULL, t1, c.wall, &total, ids, ns, 2,
                           &complete);
    ASSERT_EQ_I64(rc, 0);
    ASSERT_EQ_I64(total, 0);
    gqp_tracer_free(t);
    gqp_profile_free(mine);
}

/* A window of n other greenlets, greenlet k running 1 + (k * 7) % 13 ns
 * between two spans of mine: the total, and the top 8 by time (ids of
 * equal times in any order).  With mine's greenlet, n = 63 fills
 * waited's table on the stack to its load limit; n = 64 makes it grow
 * (onto the heap) midway. */
static void waited_window_of(int n)
{
    fake_clock c;
    gqp_profile *mine = new_profile();
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_OK(gqp_tracer_attach(t, KG, mine));
    fc_run(&c, 10);
    uint64_t prev = KG;
    int64_t want_total = 0, dur[64], top[8] = {0};
    for (int k = 0; k < n; k++) {
        uint64_t key = KH + (uint64_t)(k + 1) * 0x100;
        EV(gqp_tracer_switch(t, prev, key, 0));
        dur[k] = 1 + (k * 7) % 13;
        fc_run(&c, dur[k]);
        want_total += dur[k];
        prev = key;
        for (int i = 0; i < 8; i++) {   /* (top 8 durations, descending) */
            if (dur[k] > top[i]) {
                memmove(&top[i + 1], &top[i], (size_t)(7 - i) * sizeof *top);
                top[i] = dur[k];
                break;
            }
        }
    }
    EV(gqp_tracer_switch(t, prev, KG, 0));
    fc_run(&c, 10);
    uint64_t ids[8];
    int64_t ns[8], total = -1;
    int complete = -1;
    int rc = gqp_tracer_waited(t, mine, W0 + 1, c.wall, &total, ids, ns, 8,
                               &complete);
    ASSERT_EQ_I64(rc, 8);
    ASSERT_EQ_I64(total, want_total);
    ASSERT_EQ_I64(complete, 1);
    for (int i = 0; i < 8; i++) {
        ASSERT_EQ_I64(ns[i], top[i]);
        int found = 0;
        for (int k = 0; k < n; k++) {
            if (gid(t, KH + (uint64_t)(k + 1) * 0x100) == ids[i]) {
                ASSERT_EQ_I64(dur[k], ns[i]);
                found = 1;
            }
        }
        ASSERT_TRUE(found);
        for (int j = 0; j < i; j++) {
            ASSERT_TRUE(ids[j] != ids[i]);
        }
    }
    gqp_tracer_free(t);
    gqp_profile_free(mine);
}

TEST(waited_window_at_the_stack_table_limit)
{
    waited_window_of(40);
    waited_window_of(63);
    waited_window_of(64);
}

TEST(waited_incomplete_history)
{
    fake_clock c;
    gqp_profile *mine = new_profile();
    gqp_tracer *t = waited_setup(&c, mine, 3);
    uint64_t ids[4];
    int64_t ns[4], total = -1;
    int complete = -1, rc;
    /* the last 3 spans: H1 [40,45]  H2 [45,46]  G [46,50] */
    rc = gqp_tracer_waited(t, mine, W0 + 41, W0 + 50, &total, ids, ns, 4,
                           &complete);
    ASSERT_EQ_I64(complete, 1);
    ASSERT_EQ_I64(rc, 2);
    ASSERT_EQ_I64(total, 5);
    ASSERT_EQ_U64(ids[0], gid(t, KH));
    ASSERT_EQ_I64(ns[0], 4);
    rc = gqp_tracer_waited(t, mine, W0 + 1, W0 + 50, &total, ids, ns, 4,
                           &complete);
    ASSERT_TRUE(rc >= 0);
    ASSERT_EQ_I64(complete, 0);
    ASSERT_GE_I64(total, 5);
    ASSERT_LE_I64(total, 31);
    gqp_tracer_free(t);
    gqp_profile_free(mine);
}

TEST(waited_argument_errors)
{
    fake_clock c;
    gqp_profile *mine = new_profile();
    gqp_tracer *t = waited_setup(&c, mine, 0);
    uint64_t ids[2];
    int64_t ns[2], total;
    int complete;
    ASSERT_RC(gqp_tracer_waited(NULL, mine, W0, W0 + 50, &total, ids, ns, 2,
                                &complete),
              GQP_EINVAL);
    ASSERT_RC(gqp_tracer_waited(t, mine, W0, W0 + 50, &total, NULL, ns, 2,
                                &complete),
              GQP_EINVAL);
    ASSERT_RC(gqp_tracer_waited(t, mine, W0, W0 + 50, &total, ids, NULL, 2,
                                &complete),
              GQP_EINVAL);
    gqp_tracer_free(t);
    gqp_profile_free(mine);
}

/* Clearing `mine` empties its data, but its greenlets are still its own:
 * their earlier spans must not turn into time "other greenlets ran". */
TEST(waited_after_clearing_mine)
{
    fake_clock c;
    gqp_profile *mine = new_profile();
    int64_t total = -1;
    uint64_t ids[4];
    int64_t ns[4];
    int complete;
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_OK(gqp_tracer_attach(t, KG, mine));
    fc_run(&c, 10);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    fc_run(&c, 5);
    EV(gqp_tracer_switch(t, KH, KG, 0));
    fc_run(&c, 3);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_EQ_I64(gqp_tracer_waited(t, mine, W0, W0 + 18, &total, ids, ns,
                                    4, &complete),
                  1);
    ASSERT_EQ_I64(total, 5);
    ASSERT_OK(gqp_profile_clear(mine));
    int rc = gqp_tracer_waited(t, mine, W0, W0 + 18, &total, ids, ns, 4,
                               &complete);
    for (int i = 0; i < rc; i++)
        if (ids[i] == gid(t, KG))
            FAIL("G (attached to mine) counted as other after clear: %"
                 PRId64, ns[i]);
    ASSERT_EQ_I64(rc, 1);
    ASSERT_EQ_I64(total, 5);
    ASSERT_EQ_U64(ids[0], gid(t, KH));
    gqp_tracer_free(t);
    gqp_profile_free(mine);
}

/* GQP_FLUSH_FOREIGN: no CPU clock reading (it would be the caller's
 * thread); the running span gets the CPU estimated at the last event. */
TEST(flush_ex_foreign_reads_no_cpu_clock)
{
    fake_clock c;
    gqp_profile *p;
    gqp_span s;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU, &p);
    EV(gqp_tracer_switch(t, 0, KH, 0));
    fc_run(&c, 2);
    EV(gqp_tracer_switch(t, KH, KG, 0));
    fc_run(&c, 4);
    EV(gqp_tracer_call(t, FA)); /* last event: CPU read (1 ns window) */
    fc_run(&c, 6);
    uint64_t reads = c.cpu_reads;
    ASSERT_OK(gqp_tracer_flush_ex(t, GQP_FLUSH_FOREIGN));
    ASSERT_EQ_U64(c.cpu_reads, reads);
    ASSERT_RC(gqp_tracer_current(t, NULL, NULL, NULL), GQP_ENOTFOUND);
    ASSERT_OK(gqp_tracer_last_span(t, &s, NULL, NULL));
    (void)s;
    ASSERT_EQ_SIZE(gqp_profile_span_count(p), 2);
    /* wall up to the flush, CPU up to the last event */
    ASSERT_SPAN(get_span(p, 1), gid(t, KG), W0 + 2, W0 + 12, 4,
                GQP_SPAN_SPLIT);
    /* a's frame: nothing known after the call */
    gqp_func_stat fa;
    GET_FUNC(p, FA, &fa);
    ASSERT_EQ_U64(fa.ncall, 1);
    ASSERT_EQ_I64(fa.ttot_ns, 0);
    /* the tracer can be fed again */
    EV(gqp_tracer_switch(t, 0, KG, 0));
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

TEST(flush_ex_plain_and_errors)
{
    fake_clock c;
    gqp_profile *p;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_WALL, &p);
    ASSERT_RC(gqp_tracer_flush_ex(NULL, 0), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_flush_ex(t, 0x2), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_flush_ex(t, ~0u), GQP_EINVAL);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    EV(gqp_tracer_call(t, FA));
    fc_run(&c, 7);
    uint64_t reads = c.cpu_reads;
    ASSERT_OK(gqp_tracer_flush_ex(t, 0)); /* = gqp_tracer_flush */
    ASSERT_TRUE(c.cpu_reads > reads);     /* EXACT: read at the end */
    ASSERT_SPAN(get_span(p, 0), gid(t, KG), W0, W0 + 7, 7,
                FIRST | GQP_SPAN_SPLIT);
    ASSERT_FUNC(p, FA, 1, 1, 7, 7);
    ASSERT_OK(gqp_tracer_flush_ex(t, GQP_FLUSH_FOREIGN)); /* idle: no-op */
    ASSERT_EQ_SIZE(gqp_profile_span_count(p), 1);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

TEST(flush_ex_foreign_cpu_off)
{
    fake_clock c;
    gqp_profile *p;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_OFF, GQP_CLOCK_WALL, &p);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    fc_run(&c, 3);
    ASSERT_OK(gqp_tracer_flush_ex(t, GQP_FLUSH_FOREIGN));
    ASSERT_SPAN(get_span(p, 0), gid(t, KG), W0, W0 + 3, -1,
                FIRST | GQP_SPAN_SPLIT);
    ASSERT_EQ_U64(c.cpu_reads, 0);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

/* LONG_SPAN_NS may change while a greenlet runs and applies to the next
 * span closed. */
TEST(tracer_long_span_changes_while_running)
{
    fake_clock c;
    gqp_profile *p;
    int rc;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_OFF, GQP_CLOCK_WALL, &p);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    fc_idle(&c, 50);
    rc = EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_NO_FLAG(rc, GQP_EV_LONG_SPAN);
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_LONG_SPAN_NS, 40));
    fc_idle(&c, 50);
    rc = EV(gqp_tracer_switch(t, KH, KG, 0));
    ASSERT_HAS_FLAG(rc, GQP_EV_LONG_SPAN);
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_LONG_SPAN_NS, 0));
    fc_idle(&c, 50);
    rc = EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_NO_FLAG(rc, GQP_EV_LONG_SPAN);
    ASSERT_EQ_U64(get_span(p, 1).flags & GQP_SPAN_LONG, GQP_SPAN_LONG);
    ASSERT_EQ_U64(get_span(p, 2).flags & GQP_SPAN_LONG, 0);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

/* "greenlets of mine (attached to it, or with totals in it)" */
/* No history kept (GQP_TRACER_HISTORY 0): nothing waited, and nothing
 * said to be complete before the window. */
TEST(waited_without_history)
{
    fake_clock c;
    gqp_profile *mine = new_profile();
    uint64_t ids[2];
    int64_t ns[2], total = -1;
    int complete = -1;
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_HISTORY, 0));
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_OK(gqp_tracer_attach(t, KG, mine));
    fc_run(&c, 5);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    fc_run(&c, 5);
    EV(gqp_tracer_switch(t, KH, KG, 0));
    ASSERT_EQ_I64(gqp_tracer_waited(t, mine, W0, c.wall, &total, ids, ns, 2,
                                    &complete), 0);
    ASSERT_EQ_I64(total, 0);
    gqp_tracer_free(t);
    gqp_profile_free(mine);
}

/* More greenlets in the window than waited's table on the stack holds
 * (it grows onto the heap): every one counted once, the top n right. */
TEST(waited_many_greenlets)
{
    enum { N = 300 };
    fake_clock c;
    gqp_profile *mine = new_profile();
    uint64_t ids[4] = {0};
    int64_t ns[4] = {0}, total = -1, want = 0;
    int complete = -1;
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_OK(gqp_tracer_attach(t, KG, mine));
    fc_run(&c, 1);
    uint64_t prev = KG;
    for (uint64_t i = 1; i <= N; i++) {   /* other i runs i ns, twice */
        uint64_t k = KH + i * 16;
        EV(gqp_tracer_switch(t, prev, k, 0));
        fc_run(&c, (int64_t)i);
        EV(gqp_tracer_switch(t, k, KG, 0));
        fc_run(&c, 1);
        EV(gqp_tracer_switch(t, KG, k, 0));
        fc_run(&c, (int64_t)i);
        prev = k;
        want += 2 * (int64_t)i;
    }
    EV(gqp_tracer_switch(t, prev, KG, 0));
    int rc = gqp_tracer_waited(t, mine, W0, c.wall, &total, ids, ns, 4,
                               &complete);
    ASSERT_EQ_I64(rc, 4);
    ASSERT_EQ_I64(total, want);
    ASSERT_EQ_I64(complete, 1);
    for (int j = 0; j < 4; j++) {
        ASSERT_EQ_U64(ids[j], gid(t, KH + (uint64_t)(N - j) * 16));
        ASSERT_EQ_I64(ns[j], 2 * (N - j));
    }
    gqp_tracer_free(t);
    gqp_profile_free(mine);
}

TEST(waited_mine_by_attachment_or_totals)
{
    fake_clock c;
    gqp_profile *mine = new_profile();
    int64_t total = -1;
    uint64_t ids[4];
    int64_t ns[4];
    int complete;
    const uint64_t KJ = UINT64_C(0x7f0000004000);
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    /* G: attached, then detached -- keeps its totals in mine */
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_OK(gqp_tracer_attach(t, KG, mine));
    fc_run(&c, 10);                          /* G [0,10] in mine */
    ASSERT_OK(gqp_tracer_attach(t, KG, NULL));
    fc_run(&c, 5);                           /* G [10,15] nowhere */
    EV(gqp_tracer_switch(t, KG, KH, 0));
    /* H: never attached, but named in mine (totals entry) */
    ASSERT_OK(gqp_profile_name_greenlet(mine, gid(t, KH), "h", NULL));
    fc_run(&c, 7);                           /* H [15,22] */
    EV(gqp_tracer_switch(t, KH, KI, 0));
    /* I: attached to mine while switched out, before any span of it */
    fc_run(&c, 3);                           /* I [22,25] */
    EV(gqp_tracer_switch(t, KI, KJ, 0));
    ASSERT_OK(gqp_tracer_attach(t, KI, mine));
    fc_run(&c, 4);                           /* J [25,29]: the only other */
    EV(gqp_tracer_switch(t, KJ, KG, 0));
    int rc = gqp_tracer_waited(t, mine, W0, W0 + 29, &total, ids, ns, 4,
                               &complete);
    ASSERT_TRUE(rc >= 1);
    for (int i = 0; i < rc; i++) {
        if (ids[i] == gid(t, KG))
            FAIL("G (detached, totals in mine) counted as other: %" PRId64,
                 ns[i]);
        if (ids[i] == gid(t, KH))
            FAIL("H (named in mine) counted as other: %" PRId64, ns[i]);
        if (ids[i] == gid(t, KI))
            FAIL("I (attached to mine now) counted as other: %" PRId64,
                 ns[i]);
    }
    ASSERT_EQ_I64(rc, 1);
    ASSERT_EQ_I64(total, 4);
    ASSERT_EQ_U64(ids[0], gid(t, KJ));
    ASSERT_EQ_I64(ns[0], 4);
    gqp_tracer_free(t);
    gqp_profile_free(mine);
}

/* A greenlet that ends with frames still open: they are charged up to its
 * end (as flush does), not lost and not left on a stack. */
TEST(dead_greenlet_open_frames_charged)
{
    fake_clock c;
    gqp_profile *p;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU, &p);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    EV(gqp_tracer_call(t, FA));
    fc_run(&c, 5);
    EV(gqp_tracer_call(t, FB));
    fc_run(&c, 2);
    EV(gqp_tracer_switch(t, KG, KH, GQP_SWITCH_FROM_DEAD));
    fc_run(&c, 9);
    EV(gqp_tracer_return(t)); /* H has no frame: ignored */
    ASSERT_OK(gqp_tracer_flush(t));
    ASSERT_FUNC(p, FA, 1, 1, 7, 5);
    ASSERT_FUNC(p, FB, 1, 1, 2, 2);
    ASSERT_EDGE(p, FA, FB, 1, 1, 2, 2);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

/* Forgetting the running greenlet: not specified; either refused or done,
 * and the tracer stays consistent. */
TEST(forget_running_greenlet)
{
    fake_clock c;
    uint64_t key = 0, id = 0;
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_OFF, GQP_CLOCK_WALL);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    int rc = gqp_tracer_forget(t, KG);
    ASSERT_RC2(rc, GQP_OK, GQP_ESTATE);
    if (rc == GQP_ESTATE) {
        ASSERT_OK(gqp_tracer_current(t, &key, &id, NULL));
        ASSERT_EQ_U64(key, KG);
        ASSERT_EQ_SIZE(gqp_tracer_greenlet_count(t), 1);
    } else {
        ASSERT_RC(gqp_tracer_greenlet_id(t, KG, &id), GQP_ENOTFOUND);
        ASSERT_EQ_SIZE(gqp_tracer_greenlet_count(t), 0);
    }
    EV(gqp_tracer_switch(t, KG, KH, 0));
    gqp_tracer_free(t);
}

TEST(inherit_self_and_closed_parent_profile)
{
    fake_clock c;
    gqp_profile *d, *p = new_profile(), *cp = NULL;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_OFF, GQP_CLOCK_WALL, &d);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_OK(gqp_tracer_attach(t, KG, p));
    ASSERT_OK(gqp_tracer_inherit(t, KG, KG)); /* no change */
    ASSERT_OK(gqp_tracer_current(t, NULL, NULL, &cp));
    ASSERT_EQ_PTR(cp, p);
    /* the parent's profile is closed: the child must not record into it */
    ASSERT_OK(gqp_profile_close(p));
    size_t n = gqp_profile_span_count(p);
    ASSERT_OK(gqp_tracer_inherit(t, KI, KG));
    EV(gqp_tracer_switch(t, KG, KI, 0));
    fc_idle(&c, 4);
    EV(gqp_tracer_switch(t, KI, KG, 0));
    ASSERT_EQ_SIZE(gqp_profile_span_count(p), n);
    gqp_tracer_free(t);
    gqp_profile_free(d);
    gqp_profile_free(p);
}

/* Attaching a greenlet not seen yet routes its spans once it runs. */
TEST(attach_unseen_greenlet)
{
    fake_clock c;
    gqp_profile *d, *p = new_profile();
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_OFF, GQP_CLOCK_WALL, &d);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    int rc = gqp_tracer_attach(t, KI, p);
    ASSERT_RC2(rc, GQP_OK, GQP_ENOTFOUND);
    if (rc == GQP_OK) {
        EV(gqp_tracer_switch(t, KG, KI, 0));
        fc_idle(&c, 6);
        EV(gqp_tracer_switch(t, KI, KG, 0));
        ASSERT_EQ_SIZE(gqp_profile_span_count(p), 1);
        ASSERT_SPAN(get_span(p, 0), gid(t, KI), W0, W0 + 6, -1, 0);
        ASSERT_EQ_SIZE(gqp_profile_attached(p), 1);
    }
    gqp_tracer_free(t);
    gqp_profile_free(d);
    gqp_profile_free(p);
}
