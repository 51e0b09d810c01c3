/* test_null.c -- NULL handling of every public function: free functions
 * accept NULL, int-returning functions return GQP_EINVAL, counters and
 * origins return 0. */
#include "harness.h"
#include "testutil.h"

TEST(null_free_functions_accept_null)
{
    gqp_profile_free(NULL);
    gqp_tracer_free(NULL);
}

TEST(null_profile_functions)
{
    gqp_profile *p = new_profile();
    gqp_span s;
    gqp_greenlet_stat g;
    gqp_func_stat f;
    gqp_edge_stat e;
    int64_t v;

    ASSERT_RC(gqp_profile_new(NULL), GQP_EINVAL);
    ASSERT_RC(gqp_profile_set(NULL, GQP_PROFILE_MAX_SPANS, 1), GQP_EINVAL);
    ASSERT_RC(gqp_profile_get(NULL, GQP_PROFILE_MAX_SPANS, &v), GQP_EINVAL);
    ASSERT_RC(gqp_profile_get(p, GQP_PROFILE_MAX_SPANS, NULL), GQP_EINVAL);
    ASSERT_RC(gqp_profile_retain(NULL), GQP_EINVAL);
    ASSERT_RC(gqp_profile_close(NULL), GQP_EINVAL);
    ASSERT_RC(gqp_profile_is_closed(NULL), GQP_EINVAL);
    ASSERT_RC(gqp_profile_clear(NULL), GQP_EINVAL);

    ASSERT_EQ_SIZE(gqp_profile_span_count(NULL), 0);
    ASSERT_EQ_U64(gqp_profile_spans_dropped(NULL), 0);
    ASSERT_RC(gqp_profile_span(NULL, 0, &s), GQP_EINVAL);
    ASSERT_RC(gqp_profile_span(p, 0, NULL), GQP_EINVAL);
    ASSERT_RC(gqp_profile_span_set_tag(NULL, 0, 1), GQP_EINVAL);
    ASSERT_RC(gqp_profile_longest_span(NULL, &s), GQP_EINVAL);
    ASSERT_RC(gqp_profile_longest_span(p, NULL), GQP_EINVAL);
    ASSERT_RC(gqp_profile_longest_cpu_span(NULL, &s), GQP_EINVAL);
    ASSERT_RC(gqp_profile_longest_cpu_span(p, NULL), GQP_EINVAL);

    ASSERT_EQ_SIZE(gqp_profile_greenlet_count(NULL), 0);
    ASSERT_EQ_U64(gqp_profile_greenlets_dropped(NULL), 0);
    ASSERT_RC(gqp_profile_greenlet(NULL, 0, &g), GQP_EINVAL);
    ASSERT_OK(gqp_profile_name_greenlet(p, 1, NULL, NULL));
    ASSERT_RC(gqp_profile_greenlet(p, 0, NULL), GQP_EINVAL);
    ASSERT_RC(gqp_profile_name_greenlet(NULL, 1, "a", "b"), GQP_EINVAL);

    ASSERT_EQ_SIZE(gqp_profile_func_count(NULL), 0);
    ASSERT_RC(gqp_profile_func(NULL, 0, &f), GQP_EINVAL);
    ASSERT_RC(gqp_profile_func(p, 0, NULL), GQP_EINVAL);
    ASSERT_EQ_SIZE(gqp_profile_edge_count(NULL), 0);
    ASSERT_RC(gqp_profile_edge(NULL, 0, &e), GQP_EINVAL);
    ASSERT_RC(gqp_profile_edge(p, 0, NULL), GQP_EINVAL);
    ASSERT_EQ_U64(gqp_profile_calls_dropped(NULL), 0);

    ASSERT_EQ_I64(gqp_profile_epoch_origin(NULL), 0);
    ASSERT_EQ_I64(gqp_profile_wall_origin(NULL), 0);
    gqp_profile_free(p);
}

/* Out-of-range indexes on an empty profile. */
TEST(profile_readers_empty_ranges)
{
    gqp_profile *p = new_profile();
    gqp_greenlet_stat g;
    gqp_func_stat f;
    gqp_edge_stat e;
    ASSERT_RC(gqp_profile_greenlet(p, 0, &g), GQP_ERANGE);
    ASSERT_RC(gqp_profile_func(p, 0, &f), GQP_ERANGE);
    ASSERT_RC(gqp_profile_edge(p, 0, &e), GQP_ERANGE);
    ASSERT_RC(gqp_profile_func(p, SIZE_MAX, &f), GQP_ERANGE);
    gqp_profile_free(p);
}

TEST(null_tracer_functions)
{
    gqp_profile *p = new_profile();
    fake_clock c;
    gqp_span s;
    int64_t v, since;
    uint64_t key, id, ids[2];
    int64_t ns[2], total;
    int complete;
    size_t idx;
    gqp_profile *cp;
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_OFF, GQP_CLOCK_WALL);

    ASSERT_RC(gqp_tracer_new(NULL), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_set(NULL, GQP_TRACER_CPU_MODE, 0), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_get(NULL, GQP_TRACER_CPU_MODE, &v), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_get(t, GQP_TRACER_CPU_MODE, NULL), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_set_clocks(NULL, fake_wall_fn, fake_cpu_fn, &c),
              GQP_EINVAL);
    ASSERT_RC(gqp_tracer_set_default(NULL, p), GQP_EINVAL);
    ASSERT_OK(gqp_tracer_set_default(t, NULL));
    ASSERT_RC(gqp_tracer_set_session(NULL, p), GQP_EINVAL);
    ASSERT_OK(gqp_tracer_set_session(t, NULL));
    ASSERT_RC(gqp_tracer_switch(NULL, 0, KG, 0), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_call(NULL, FA), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_return(NULL), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_attach(NULL, KG, p), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_attach(NULL, KG, NULL), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_inherit(NULL, KH, KG), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_current(NULL, &key, &id, &cp), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_greenlet_id(NULL, KG, &id), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_last_span(NULL, &s, &cp, &idx), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_running_since(NULL, &since, &id), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_forget(NULL, KG), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_flush(NULL), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_flush_ex(NULL, 0), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_set_spawn_profile(NULL, KG, p), GQP_EINVAL);
    ASSERT_EQ_SIZE(gqp_profile_attached(NULL), 0);
    ASSERT_EQ_SIZE(gqp_profile_refs(NULL), 0);
    ASSERT_OK(gqp_set_allocator(NULL)); /* NULL restores malloc */
    ASSERT_EQ_SIZE(gqp_tracer_greenlet_count(NULL), 0);
    ASSERT_RC(gqp_tracer_waited(NULL, p, 0, 10, &total, ids, ns, 2,
                                &complete),
              GQP_EINVAL);

    /* with a span available, a NULL span output is still invalid */
    EV(gqp_tracer_switch(t, 0, KG, 0));
    EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_RC(gqp_tracer_last_span(t, NULL, &cp, &idx), GQP_EINVAL);
    /* the tracer survived all that */
    ASSERT_OK(gqp_tracer_current(t, &key, NULL, NULL));
    ASSERT_EQ_U64(key, KH);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}
