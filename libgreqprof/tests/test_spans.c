/* test_spans.c -- spans, greenlet ids and totals, span caps, CPU modes. */
#include <stdlib.h>

#include "harness.h"
#include "testutil.h"

TEST(spans_basic_sequence)
{
    fake_clock c;
    gqp_profile *p;
    gqp_greenlet_stat g;
    int rc;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU, &p);

    rc = EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_HAS_FLAG(rc, GQP_EV_NEW_GREENLET);
    uint64_t ig = gid(t, KG);
    fc_run(&c, 10);
    rc = EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_HAS_FLAG(rc, GQP_EV_NEW_GREENLET);
    ASSERT_NO_FLAG(rc, GQP_EV_LONG_SPAN);
    ASSERT_NO_FLAG(rc, GQP_EV_DROPPED);
    uint64_t ih = gid(t, KH);
    ASSERT_NE_U64(ig, ih);
    fc_run(&c, 5);
    fc_idle(&c, 3);
    rc = EV(gqp_tracer_switch(t, KH, KG, 0));
    ASSERT_NO_FLAG(rc, GQP_EV_NEW_GREENLET);
    fc_run(&c, 1);
    ASSERT_OK(gqp_tracer_flush(t));

    ASSERT_EQ_SIZE(gqp_profile_span_count(p), 3);
    ASSERT_EQ_U64(gqp_profile_spans_dropped(p), 0);
    ASSERT_SPAN(get_span(p, 0), ig, W0, W0 + 10, 10, FIRST);
    ASSERT_SPAN(get_span(p, 1), ih, W0 + 10, W0 + 18, 5, 0);
    ASSERT_SPAN(get_span(p, 2), ig, W0 + 18, W0 + 19, 1, GQP_SPAN_SPLIT);
    ASSERT_EQ_U64(get_span(p, 0).tag, 0);

    ASSERT_EQ_SIZE(gqp_profile_greenlet_count(p), 2);
    GET_GREENLET(p, ig, &g);
    ASSERT_EQ_I64(g.wall_ns, 11);
    ASSERT_EQ_I64(g.cpu_ns, 11);
    ASSERT_EQ_U64(g.switches, 1); /* the first span began mid-run */
    ASSERT_EQ_I64(g.first_ns, W0);
    ASSERT_EQ_I64(g.last_ns, W0 + 19);
    ASSERT_EQ_U64(g.finished, 0);
    GET_GREENLET(p, ih, &g);
    ASSERT_EQ_I64(g.wall_ns, 8);
    ASSERT_EQ_I64(g.cpu_ns, 5);
    ASSERT_EQ_U64(g.switches, 1);
    ASSERT_EQ_I64(g.first_ns, W0 + 10);
    ASSERT_EQ_I64(g.last_ns, W0 + 18);
    ASSERT_EQ_U64(g.finished, 0);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

TEST(greenlet_ids_unique_nonzero_across_tracers)
{
    enum { N = 100 };
    fake_clock c1, c2;
    uint64_t ids[2 * N];
    fc_init(&c1);
    fc_init(&c2);
    gqp_tracer *t1 = new_tracer(&c1, GQP_CPU_OFF, GQP_CLOCK_WALL);
    gqp_tracer *t2 = new_tracer(&c2, GQP_CPU_OFF, GQP_CLOCK_WALL);
    uint64_t prev1 = 0, prev2 = 0;
    for (int i = 0; i < N; i++) {
        /* the same keys in both tracers */
        uint64_t k = UINT64_C(0x1000) + (uint64_t)i * 16;
        EV(gqp_tracer_switch(t1, prev1, k, 0));
        EV(gqp_tracer_switch(t2, prev2, k, 0));
        prev1 = prev2 = k;
        ids[i] = gid(t1, k);
        ids[N + i] = gid(t2, k);
    }
    ASSERT_EQ_SIZE(gqp_tracer_greenlet_count(t1), N);
    ASSERT_EQ_SIZE(gqp_tracer_greenlet_count(t2), N);
    for (int i = 0; i < 2 * N; i++) {
        ASSERT_NE_U64(ids[i], 0);
        for (int j = 0; j < i; j++)
            ASSERT_NE_U64(ids[i], ids[j]);
    }
    /* ids are stable */
    ASSERT_EQ_U64(gid(t1, 0x1000), ids[0]);
    gqp_tracer_free(t1);
    gqp_tracer_free(t2);
}

TEST(greenlet_id_lookup_errors)
{
    fake_clock c;
    uint64_t id = 123;
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_OFF, GQP_CLOCK_WALL);
    ASSERT_RC(gqp_tracer_greenlet_id(t, KG, &id), GQP_ENOTFOUND);
    ASSERT_RC(gqp_tracer_greenlet_id(t, 0, &id), GQP_EINVAL);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_RC(gqp_tracer_greenlet_id(t, KH, &id), GQP_ENOTFOUND);
    ASSERT_RC(gqp_tracer_greenlet_id(t, KG, NULL), GQP_EINVAL);
    gqp_tracer_free(t);
}

/* A finished greenlet's address can be reused by a new greenlet: it must
 * get a fresh id and be reported as new. */
TEST(dead_greenlet_key_reuse_gets_new_id)
{
    fake_clock c;
    gqp_profile *p;
    gqp_greenlet_stat g;
    uint64_t id = 0;
    int rc;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU, &p);
    EV(gqp_tracer_switch(t, 0, KH, 0));
    fc_run(&c, 1);
    EV(gqp_tracer_switch(t, KH, KG, 0));
    uint64_t old = gid(t, KG);
    ASSERT_EQ_SIZE(gqp_tracer_greenlet_count(t), 2);
    fc_run(&c, 4);
    rc = EV(gqp_tracer_switch(t, KG, KH, GQP_SWITCH_FROM_DEAD));
    ASSERT_NO_FLAG(rc, GQP_EV_NEW_GREENLET);
    ASSERT_RC(gqp_tracer_greenlet_id(t, KG, &id), GQP_ENOTFOUND);
    ASSERT_EQ_SIZE(gqp_tracer_greenlet_count(t), 1);

    /* the finished span and the finished flag of the totals */
    ASSERT_EQ_SIZE(gqp_profile_span_count(p), 2);
    ASSERT_SPAN(get_span(p, 1), old, W0 + 1, W0 + 5, 4, GQP_SPAN_FINISHED);
    GET_GREENLET(p, old, &g);
    ASSERT_EQ_U64(g.finished, 1);
    ASSERT_EQ_I64(g.wall_ns, 4);

    fc_run(&c, 2);
    rc = EV(gqp_tracer_switch(t, KH, KG, 0));
    ASSERT_HAS_FLAG(rc, GQP_EV_NEW_GREENLET);
    uint64_t fresh = gid(t, KG);
    ASSERT_NE_U64(fresh, old);
    ASSERT_EQ_SIZE(gqp_tracer_greenlet_count(t), 2);
    fc_run(&c, 3);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_SPAN(get_span(p, 3), fresh, W0 + 7, W0 + 10, 3, 0);
    GET_GREENLET(p, fresh, &g);
    ASSERT_EQ_U64(g.finished, 0);
    ASSERT_EQ_I64(g.wall_ns, 3);
    ASSERT_EQ_U64(g.switches, 1);
    /* the old entry is untouched */
    GET_GREENLET(p, old, &g);
    ASSERT_EQ_U64(g.finished, 1);
    ASSERT_EQ_I64(g.wall_ns, 4);
    ASSERT_EQ_U64(g.switches, 1);
    ASSERT_EQ_SIZE(gqp_profile_greenlet_count(p), 3);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

/* Records spans of the given walls (cpu[i] of it on CPU) alternating
 * between KG and KH; returns the greenlet ids in ids[i]. */
static void feed_spans(gqp_tracer *t, fake_clock *c, const int64_t *wall,
                       const int64_t *cpu, int n, uint64_t *ids, int *rcs)
{
    uint64_t keys[2] = {KG, KH};
    EV(gqp_tracer_switch(t, 0, keys[0], 0));
    for (int i = 0; i < n; i++) {
        ids[i] = gid(t, keys[i % 2]);
        fc_run(c, cpu[i]);
        fc_idle(c, wall[i] - cpu[i]);
        rcs[i] = EV(gqp_tracer_switch(t, keys[i % 2], keys[(i + 1) % 2], 0));
    }
}

TEST(span_cap_keep_first)
{
    /* span 3 is the longest by wall, span 4 the longest by CPU; both are
     * dropped by the cap but must still be reported as the longest */
    static const int64_t wall[5] = {5, 1, 2, 9, 6};
    static const int64_t cpu[5] = {5, 1, 2, 1, 6};
    uint64_t ids[5];
    int rcs[5];
    fake_clock c;
    gqp_profile *p = new_profile();
    gqp_profile *lp = NULL;
    gqp_span s;
    size_t idx = 0;
    fc_init(&c);
    ASSERT_OK(gqp_profile_set(p, GQP_PROFILE_MAX_SPANS, 3));
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    ASSERT_OK(gqp_tracer_set_default(t, p));
    feed_spans(t, &c, wall, cpu, 5, ids, rcs);

    ASSERT_EQ_SIZE(gqp_profile_span_count(p), 3);
    ASSERT_EQ_U64(gqp_profile_spans_dropped(p), 2);
    int64_t at = W0;
    for (int i = 0; i < 3; i++) {
        ASSERT_NO_FLAG(rcs[i], GQP_EV_DROPPED);
        ASSERT_SPAN(get_span(p, (size_t)i), ids[i], at, at + wall[i], cpu[i],
                    i == 0 ? FIRST : 0);
        at += wall[i];
    }
    ASSERT_HAS_FLAG(rcs[3], GQP_EV_DROPPED);
    ASSERT_HAS_FLAG(rcs[4], GQP_EV_DROPPED);

    ASSERT_OK(gqp_profile_longest_span(p, &s));
    ASSERT_SPAN(s, ids[3], W0 + 8, W0 + 17, 1, 0);
    ASSERT_OK(gqp_profile_longest_cpu_span(p, &s));
    ASSERT_SPAN(s, ids[4], W0 + 17, W0 + 23, 6, 0);

    /* the last span was dropped: not kept, index SIZE_MAX */
    ASSERT_OK(gqp_tracer_last_span(t, &s, &lp, &idx));
    ASSERT_SPAN(s, ids[4], W0 + 17, W0 + 23, 6, 0);
    ASSERT_EQ_PTR(lp, p);
    ASSERT_EQ_U64(idx, SIZE_MAX);

    /* greenlet totals still count dropped spans */
    gqp_greenlet_stat g;
    GET_GREENLET(p, ids[0], &g);
    ASSERT_EQ_I64(g.wall_ns, 5 + 2 + 6);
    ASSERT_EQ_U64(g.switches, 2); /* span 0 began mid-run */
    GET_GREENLET(p, ids[1], &g);
    ASSERT_EQ_I64(g.wall_ns, 1 + 9);
    ASSERT_EQ_I64(g.cpu_ns, 1 + 1);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

TEST(span_cap_keep_last)
{
    /* span 0 longest by wall, span 1 longest by CPU: both evicted */
    static const int64_t wall[5] = {9, 6, 2, 1, 3};
    static const int64_t cpu[5] = {1, 6, 2, 1, 3};
    uint64_t ids[5];
    int rcs[5];
    fake_clock c;
    gqp_profile *p = new_profile();
    gqp_profile *lp = NULL;
    gqp_span s;
    size_t idx = 12345;
    fc_init(&c);
    ASSERT_OK(gqp_profile_set(p, GQP_PROFILE_MAX_SPANS, 3));
    ASSERT_OK(gqp_profile_set(p, GQP_PROFILE_SPAN_POLICY, GQP_KEEP_LAST));
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    ASSERT_OK(gqp_tracer_set_default(t, p));
    feed_spans(t, &c, wall, cpu, 5, ids, rcs);

    ASSERT_EQ_SIZE(gqp_profile_span_count(p), 3);
    ASSERT_EQ_U64(gqp_profile_spans_dropped(p), 2);
    /* index 0 = oldest kept = span 2 */
    ASSERT_SPAN(get_span(p, 0), ids[2], W0 + 15, W0 + 17, 2, 0);
    ASSERT_SPAN(get_span(p, 1), ids[3], W0 + 17, W0 + 18, 1, 0);
    ASSERT_SPAN(get_span(p, 2), ids[4], W0 + 18, W0 + 21, 3, 0);

    ASSERT_OK(gqp_profile_longest_span(p, &s));
    ASSERT_SPAN(s, ids[0], W0, W0 + 9, 1, FIRST);
    ASSERT_OK(gqp_profile_longest_cpu_span(p, &s));
    ASSERT_SPAN(s, ids[1], W0 + 9, W0 + 15, 6, 0);

    /* the newest span is kept, at the newest index */
    ASSERT_OK(gqp_tracer_last_span(t, &s, &lp, &idx));
    ASSERT_EQ_PTR(lp, p);
    ASSERT_EQ_U64(idx, 2);
    ASSERT_SPAN(s, ids[4], W0 + 18, W0 + 21, 3, 0);
    ASSERT_OK(gqp_profile_span_set_tag(p, idx, 77));
    ASSERT_EQ_U64(get_span(p, 2).tag, 77);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

/* With KEEP_LAST the tags move with their spans as old ones are evicted. */
TEST(span_cap_keep_last_tags_follow_spans)
{
    fake_clock c;
    gqp_profile *p = new_profile();
    gqp_span s;
    gqp_profile *lp;
    size_t idx;
    uint64_t keys[2] = {KG, KH};
    fc_init(&c);
    ASSERT_OK(gqp_profile_set(p, GQP_PROFILE_MAX_SPANS, 4));
    ASSERT_OK(gqp_profile_set(p, GQP_PROFILE_SPAN_POLICY, GQP_KEEP_LAST));
    gqp_tracer *t = new_tracer(&c, GQP_CPU_OFF, GQP_CLOCK_WALL);
    ASSERT_OK(gqp_tracer_set_default(t, p));
    EV(gqp_tracer_switch(t, 0, KG, 0));
    for (int i = 0; i < 11; i++) {
        fc_idle(&c, 100 + i); /* span i lasts 100 + i */
        EV(gqp_tracer_switch(t, keys[i % 2], keys[(i + 1) % 2], 0));
        ASSERT_OK(gqp_tracer_last_span(t, &s, &lp, &idx));
        ASSERT_EQ_PTR(lp, p);
        ASSERT_TRUE(idx < gqp_profile_span_count(p));
        ASSERT_EQ_U64(idx, gqp_profile_span_count(p) - 1);
        ASSERT_OK(gqp_profile_span_set_tag(p, idx, (uint32_t)(1000 + i)));
    }
    ASSERT_EQ_SIZE(gqp_profile_span_count(p), 4);
    ASSERT_EQ_U64(gqp_profile_spans_dropped(p), 7);
    for (size_t i = 0; i < 4; i++) {
        s = get_span(p, i);
        ASSERT_EQ_I64(s.end_ns - s.start_ns, 100 + 7 + (int64_t)i);
        ASSERT_EQ_U64(s.tag, 1000 + 7 + i);
        ASSERT_EQ_I64(s.cpu_ns, -1);
    }
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

TEST(span_cap_zero_keeps_none_but_longest)
{
    static const int64_t wall[3] = {4, 8, 2};
    static const int64_t cpu[3] = {4, 8, 2};
    uint64_t ids[3];
    int rcs[3];
    fake_clock c;
    gqp_profile *p = new_profile();
    gqp_span s;
    fc_init(&c);
    ASSERT_OK(gqp_profile_set(p, GQP_PROFILE_MAX_SPANS, 0));
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    ASSERT_OK(gqp_tracer_set_default(t, p));
    feed_spans(t, &c, wall, cpu, 3, ids, rcs);
    ASSERT_EQ_SIZE(gqp_profile_span_count(p), 0);
    ASSERT_EQ_U64(gqp_profile_spans_dropped(p), 3);
    ASSERT_RC(gqp_profile_span(p, 0, &s), GQP_ERANGE);
    ASSERT_OK(gqp_profile_longest_span(p, &s));
    ASSERT_SPAN(s, ids[1], W0 + 4, W0 + 12, 8, 0);
    ASSERT_OK(gqp_profile_longest_cpu_span(p, &s));
    ASSERT_SPAN(s, ids[1], W0 + 4, W0 + 12, 8, 0);
    /* switches count only spans that began with a switch */
    gqp_greenlet_stat g1;
    GET_GREENLET(p, ids[0], &g1);
    ASSERT_EQ_U64(g1.switches, 1);
    /* totals are still kept */
    gqp_greenlet_stat g;
    GET_GREENLET(p, ids[0], &g);
    ASSERT_EQ_I64(g.wall_ns, 6);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

TEST(long_span_flag_and_event)
{
    fake_clock c;
    gqp_profile *p;
    gqp_span s;
    int rc;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_OFF, GQP_CLOCK_WALL, &p);
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_LONG_SPAN_NS, 100));
    EV(gqp_tracer_switch(t, 0, KG, 0));
    fc_idle(&c, 99);
    rc = EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_NO_FLAG(rc, GQP_EV_LONG_SPAN);
    fc_idle(&c, 100);
    rc = EV(gqp_tracer_switch(t, KH, KG, 0));
    ASSERT_HAS_FLAG(rc, GQP_EV_LONG_SPAN);
    ASSERT_OK(gqp_tracer_last_span(t, &s, NULL, NULL));
    ASSERT_EQ_U64(s.flags & GQP_SPAN_LONG, GQP_SPAN_LONG);
    ASSERT_EQ_I64(s.end_ns - s.start_ns, 100);
    fc_idle(&c, 250);
    rc = EV(gqp_tracer_switch(t, KG, KH, GQP_SWITCH_FROM_DEAD));
    ASSERT_HAS_FLAG(rc, GQP_EV_LONG_SPAN);
    ASSERT_EQ_U64(get_span(p, 0).flags, FIRST);
    ASSERT_EQ_U64(get_span(p, 1).flags, GQP_SPAN_LONG);
    ASSERT_EQ_U64(get_span(p, 2).flags, GQP_SPAN_LONG | GQP_SPAN_FINISHED);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

TEST(long_span_default_never)
{
    fake_clock c;
    gqp_profile *p;
    int64_t v = -1;
    int rc;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_OFF, GQP_CLOCK_WALL, &p);
    ASSERT_OK(gqp_tracer_get(t, GQP_TRACER_LONG_SPAN_NS, &v));
    ASSERT_EQ_I64(v, 0);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    fc_idle(&c, INT64_C(1000000000000));
    rc = EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_NO_FLAG(rc, GQP_EV_LONG_SPAN);
    ASSERT_EQ_U64(get_span(p, 0).flags & GQP_SPAN_LONG, 0);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

/* ---- CPU modes ---------------------------------------------------------- */

TEST(cpu_mode_off_reports_minus_one)
{
    fake_clock c;
    gqp_profile *p;
    gqp_greenlet_stat g;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_OFF, GQP_CLOCK_WALL, &p);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    fc_run(&c, 10);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    fc_run(&c, 20);
    EV(gqp_tracer_switch(t, KH, KG, 0));
    ASSERT_OK(gqp_tracer_flush(t));
    for (size_t i = 0; i < gqp_profile_span_count(p); i++)
        ASSERT_EQ_I64(get_span(p, i).cpu_ns, -1);
    GET_GREENLET(p, gid(t, KG), &g);
    ASSERT_EQ_I64(g.cpu_ns, -1);
    ASSERT_EQ_I64(g.wall_ns, 10);
    GET_GREENLET(p, gid(t, KH), &g);
    ASSERT_EQ_I64(g.cpu_ns, -1);
    ASSERT_EQ_I64(g.wall_ns, 20);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

/* GQP_CPU_OFF with the WALL call clock has no reason to read the CPU clock
 * (it is a ~300 ns system call). */
TEST(cpu_mode_off_never_reads_cpu_clock)
{
    fake_clock c;
    gqp_profile *p;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_OFF, GQP_CLOCK_WALL, &p);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    EV(gqp_tracer_call(t, FA));
    fc_run(&c, 10);
    EV(gqp_tracer_return(t));
    EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_OK(gqp_tracer_flush(t));
    ASSERT_EQ_U64(c.cpu_reads, 0);
    ASSERT_TRUE(c.wall_reads > 0);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

TEST(cpu_mode_exact)
{
    fake_clock c;
    gqp_profile *p;
    gqp_greenlet_stat g;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_WALL, &p);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    fc_run(&c, 3);
    fc_idle(&c, 40);
    fc_run(&c, 2);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    fc_idle(&c, 7);
    EV(gqp_tracer_switch(t, KH, KG, 0)); /* no CPU at all */
    fc_run(&c, 1);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_SPAN(get_span(p, 0), gid(t, KG), W0, W0 + 45, 5, FIRST);
    ASSERT_SPAN(get_span(p, 1), gid(t, KH), W0 + 45, W0 + 52, 0, 0);
    ASSERT_SPAN(get_span(p, 2), gid(t, KG), W0 + 52, W0 + 53, 1, 0);
    GET_GREENLET(p, gid(t, KG), &g);
    ASSERT_EQ_I64(g.cpu_ns, 6);
    ASSERT_EQ_I64(g.wall_ns, 46);
    GET_GREENLET(p, gid(t, KH), &g);
    ASSERT_EQ_I64(g.cpu_ns, 0);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

/* ESTIMATE reads the CPU clock at a switch when >= window wall time passed
 * since the last reading: spans that are all at least one window long are
 * therefore measured exactly. */
TEST(cpu_mode_estimate_exact_for_long_spans)
{
    fake_clock c;
    gqp_profile *p;
    fc_init(&c);
    gqp_tracer *t =
        new_tracer_profile(&c, GQP_CPU_ESTIMATE, GQP_CLOCK_WALL, &p);
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_CPU_WINDOW_NS, 1000));
    EV(gqp_tracer_switch(t, 0, KG, 0));
    fc_run(&c, 1500);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    fc_idle(&c, 700);
    fc_run(&c, 600);
    EV(gqp_tracer_switch(t, KH, KG, 0));
    fc_run(&c, 2000);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    fc_idle(&c, 5000);
    EV(gqp_tracer_switch(t, KH, KG, 0));
    ASSERT_EQ_I64(get_span(p, 0).cpu_ns, 1500);
    ASSERT_EQ_I64(get_span(p, 1).cpu_ns, 600);
    ASSERT_EQ_I64(get_span(p, 2).cpu_ns, 2000);
    ASSERT_EQ_I64(get_span(p, 3).cpu_ns, 0);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

/* ESTIMATE reads the CPU clock sparingly: many switches within one window
 * cost no reading, and one is taken again once a window has passed. */
TEST(cpu_mode_estimate_reads_sparingly)
{
    fake_clock c;
    gqp_profile *p;
    fc_init(&c);
    gqp_tracer *t =
        new_tracer_profile(&c, GQP_CPU_ESTIMATE, GQP_CLOCK_WALL, &p);
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_CPU_WINDOW_NS, 100000));
    EV(gqp_tracer_switch(t, 0, KG, 0));
    uint64_t keys[2] = {KG, KH};
    for (int i = 0; i < 100; i++) {
        fc_run(&c, 4);
        fc_idle(&c, 6);
        EV(gqp_tracer_switch(t, keys[i % 2], keys[(i + 1) % 2], 0));
    }
    /* 1000 ns in total < one window */
    ASSERT_LE_U64(c.cpu_reads, 2);
    for (size_t i = 0; i < gqp_profile_span_count(p); i++) {
        gqp_span s = get_span(p, i);
        ASSERT_TRUE(s.cpu_ns >= 0);
        ASSERT_NEAR_I64(s.cpu_ns, 4, 2 * 100000);
    }
    uint64_t before = c.cpu_reads;
    fc_run(&c, 200000);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_GT_I64((int64_t)c.cpu_reads, (int64_t)before);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

/* With a 1 ns window every event that sees time pass reads the clock, so
 * ESTIMATE must agree with EXACT. */
TEST(cpu_mode_estimate_window_1_is_exact)
{
    fake_clock c;
    gqp_profile *p;
    fc_init(&c);
    gqp_tracer *t =
        new_tracer_profile(&c, GQP_CPU_ESTIMATE, GQP_CLOCK_WALL, &p);
    ASSERT_OK(gqp_tracer_set(t, GQP_TRACER_CPU_WINDOW_NS, 1));
    EV(gqp_tracer_switch(t, 0, KG, 0));
    uint64_t keys[2] = {KG, KH};
    int64_t expect[20];
    for (int i = 0; i < 20; i++) {
        expect[i] = i % 3;
        fc_run(&c, expect[i]);
        fc_idle(&c, 5 + i);
        EV(gqp_tracer_switch(t, keys[i % 2], keys[(i + 1) % 2], 0));
    }
    for (int i = 0; i < 20; i++)
        ASSERT_EQ_I64(get_span(p, (size_t)i).cpu_ns, expect[i]);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

/* ---- last_span / running_since / current ------------------------------ */

TEST(last_span_and_running_since)
{
    fake_clock c;
    gqp_profile *p, *lp = (gqp_profile *)&c;
    gqp_span s;
    size_t idx = 99;
    int64_t since = 0;
    uint64_t id = 0, key = 0;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU, &p);

    ASSERT_RC(gqp_tracer_last_span(t, &s, &lp, &idx), GQP_ENOTFOUND);
    ASSERT_RC(gqp_tracer_running_since(t, &since, &id), GQP_ENOTFOUND);
    ASSERT_RC(gqp_tracer_current(t, &key, &id, &lp), GQP_ENOTFOUND);

    fc_run(&c, 3);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_OK(gqp_tracer_running_since(t, &since, &id));
    ASSERT_EQ_I64(since, W0 + 3);
    ASSERT_EQ_U64(id, gid(t, KG));
    fc_run(&c, 4);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_OK(gqp_tracer_last_span(t, &s, &lp, &idx));
    ASSERT_SPAN(s, gid(t, KG), W0 + 3, W0 + 7, 4, FIRST);
    ASSERT_EQ_PTR(lp, p);
    ASSERT_EQ_U64(idx, 0);
    ASSERT_OK(gqp_tracer_running_since(t, &since, &id));
    ASSERT_EQ_I64(since, W0 + 7);
    ASSERT_EQ_U64(id, gid(t, KH));
    /* tag through the index last_span gave */
    ASSERT_OK(gqp_profile_span_set_tag(p, idx, 5));
    ASSERT_EQ_U64(get_span(p, 0).tag, 5);
    /* output pointers for profile and index may be NULL */
    ASSERT_OK(gqp_tracer_last_span(t, &s, NULL, NULL));
    ASSERT_EQ_I64(s.end_ns, W0 + 7);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

TEST(last_span_without_profile)
{
    fake_clock c;
    gqp_profile *lp = (gqp_profile *)&c;
    gqp_span s;
    size_t idx = 0;
    int rc;
    fc_init(&c);
    /* no default profile: record nothing, but last_span still reports */
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    fc_run(&c, 6);
    rc = EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_NO_FLAG(rc, GQP_EV_DROPPED);
    ASSERT_OK(gqp_tracer_last_span(t, &s, &lp, &idx));
    ASSERT_NULL(lp);
    ASSERT_EQ_U64(idx, SIZE_MAX);
    ASSERT_SPAN(s, gid(t, KG), W0, W0 + 6, 6, FIRST);
    gqp_tracer_free(t);
}

TEST(current_reports_running_greenlet)
{
    fake_clock c;
    gqp_profile *p, *q = new_profile(), *cp = NULL;
    uint64_t key = 0, id = 0;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_OFF, GQP_CLOCK_WALL, &p);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_OK(gqp_tracer_current(t, &key, &id, &cp));
    ASSERT_EQ_U64(key, KG);
    ASSERT_EQ_U64(id, gid(t, KG));
    ASSERT_EQ_PTR(cp, p); /* unattached: the default profile */
    ASSERT_OK(gqp_tracer_current(t, NULL, NULL, NULL));
    ASSERT_OK(gqp_tracer_current(t, &key, NULL, NULL));
    ASSERT_OK(gqp_tracer_attach(t, KG, q));
    ASSERT_OK(gqp_tracer_current(t, NULL, NULL, &cp));
    ASSERT_EQ_PTR(cp, q);
    EV(gqp_tracer_switch(t, KG, UINT64_MAX, 0));
    ASSERT_OK(gqp_tracer_current(t, &key, &id, &cp));
    ASSERT_EQ_U64(key, UINT64_MAX);
    ASSERT_EQ_U64(id, gid(t, UINT64_MAX));
    ASSERT_EQ_PTR(cp, p);
    gqp_tracer_free(t);
    gqp_profile_free(p);
    gqp_profile_free(q);
}

TEST(forget_greenlet)
{
    fake_clock c;
    uint64_t id;
    int rc;
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_OFF, GQP_CLOCK_WALL);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    EV(gqp_tracer_switch(t, KG, KH, 0));
    EV(gqp_tracer_switch(t, KH, KI, 0));
    uint64_t old = gid(t, KG);
    ASSERT_EQ_SIZE(gqp_tracer_greenlet_count(t), 3);
    ASSERT_OK(gqp_tracer_forget(t, KG));
    ASSERT_EQ_SIZE(gqp_tracer_greenlet_count(t), 2);
    ASSERT_RC(gqp_tracer_greenlet_id(t, KG, &id), GQP_ENOTFOUND);
    ASSERT_RC(gqp_tracer_forget(t, KG), GQP_ENOTFOUND);
    ASSERT_RC(gqp_tracer_forget(t, 0xabcdef), GQP_ENOTFOUND);
    ASSERT_RC(gqp_tracer_forget(t, 0), GQP_EINVAL);
    /* the key comes back as a new greenlet */
    rc = EV(gqp_tracer_switch(t, KI, KG, 0));
    ASSERT_HAS_FLAG(rc, GQP_EV_NEW_GREENLET);
    ASSERT_NE_U64(gid(t, KG), old);
    ASSERT_EQ_SIZE(gqp_tracer_greenlet_count(t), 3);
    gqp_tracer_free(t);
}

TEST(huge_and_extreme_keys)
{
    fake_clock c;
    gqp_profile *p;
    const uint64_t keys[4] = {UINT64_MAX, UINT64_C(1) << 63, 1,
                              UINT64_MAX - 1};
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU, &p);
    uint64_t prev = 0;
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < 4; i++) {
            EV(gqp_tracer_switch(t, prev, keys[i], 0));
            EV(gqp_tracer_call(t, keys[(i + 1) % 4]));
            fc_run(&c, 1);
            EV(gqp_tracer_return(t));
            prev = keys[i];
        }
    }
    ASSERT_OK(gqp_tracer_flush(t));
    ASSERT_EQ_SIZE(gqp_tracer_greenlet_count(t), 4);
    for (int i = 0; i < 4; i++) {
        gqp_greenlet_stat g;
        GET_GREENLET(p, gid(t, keys[i]), &g);
        /* the very first span (from 0) did not begin with a switch */
        ASSERT_EQ_U64(g.switches, i == 0 ? 2 : 3);
        ASSERT_EQ_I64(g.wall_ns, 3);
        ASSERT_FUNC(p, keys[i], 3, 3, 3, 3);
    }
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

/* Profile cap on greenlet totals: spans of further greenlets are still
 * kept, their totals are counted as dropped. */
TEST(profile_max_greenlets_cap)
{
    fake_clock c;
    gqp_profile *p = new_profile();
    gqp_greenlet_stat g;
    int rc;
    fc_init(&c);
    ASSERT_OK(gqp_profile_set(p, GQP_PROFILE_MAX_GREENLETS, 2));
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    ASSERT_OK(gqp_tracer_set_default(t, p));
    EV(gqp_tracer_switch(t, 0, KG, 0));
    fc_run(&c, 1);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    fc_run(&c, 2);
    EV(gqp_tracer_switch(t, KH, KI, 0));
    fc_run(&c, 3);
    rc = EV(gqp_tracer_switch(t, KI, KG, 0)); /* KI's totals: no room */
    ASSERT_EQ_SIZE(gqp_profile_greenlet_count(p), 2);
    ASSERT_GE_U64(gqp_profile_greenlets_dropped(p), 1);
    ASSERT_FALSE(find_greenlet(p, gid(t, KI), &g));
    /* the span itself is kept */
    ASSERT_EQ_SIZE(gqp_profile_span_count(p), 3);
    ASSERT_SPAN(get_span(p, 2), gid(t, KI), W0 + 3, W0 + 6, 3, 0);
    /* known greenlets keep accumulating */
    fc_run(&c, 4);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    GET_GREENLET(p, gid(t, KG), &g);
    ASSERT_EQ_I64(g.wall_ns, 5);
    /* "GQP_EV_DROPPED: data was dropped (a cap was reached)" */
    ASSERT_HAS_FLAG(rc, GQP_EV_DROPPED);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}
