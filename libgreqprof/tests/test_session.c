/* test_session.c -- gqp_tracer_set_session: a whole-thread profile that also
 * receives the data of greenlets attached to other profiles, while those
 * profiles see exactly what they would without it. */
#include "harness.h"
#include "testutil.h"

/* Span count and the total wall time of one greenlet's spans in p. */
static int64_t wall_of(const gqp_profile *p, uint64_t id, size_t *n)
{
    int64_t w = 0;
    *n = 0;
    for (size_t i = 0; i < gqp_profile_span_count(p); i++) {
        gqp_span s;
        ASSERT_OK(gqp_profile_span(p, i, &s));
        if (s.greenlet_id == id) {
            w += s.end_ns - s.start_ns;
            ++*n;
        }
    }
    return w;
}

/* The scenario of a Profiler sharing a middleware thread: the session is
 * also the default; KH is attached to a request profile and calls FA->FB
 * there; KG, unattached, calls FC. */
static void request_scenario(gqp_tracer *t, fake_clock *c, gqp_profile *req)
{
    EV(gqp_tracer_switch(t, 0, KG, 0));
    EV(gqp_tracer_call(t, FC));
    fc_run(c, 5);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    EV(gqp_tracer_attach(t, KH, req));
    EV(gqp_tracer_call(t, FA));
    fc_run(c, 2);
    EV(gqp_tracer_call(t, FB));
    fc_run(c, 3);
    EV(gqp_tracer_return(t));
    fc_run(c, 1);
    EV(gqp_tracer_switch(t, KH, KG, 0)); /* FA paused in KH */
    fc_run(c, 7);
    EV(gqp_tracer_return(t));             /* FC */
    EV(gqp_tracer_switch(t, KG, KH, 0));
    fc_run(c, 4);
    EV(gqp_tracer_return(t));             /* FA */
    EV(gqp_tracer_switch(t, KH, KG, GQP_SWITCH_FROM_DEAD));
}

static void check_request(const gqp_profile *req)
{
    ASSERT_EQ_SIZE(gqp_profile_func_count(req), 2);
    ASSERT_FUNC(req, FA, 1, 1, 10, 7);
    ASSERT_FUNC(req, FB, 1, 1, 3, 3);
    ASSERT_FALSE(find_func(req, FC, NULL));
    ASSERT_EQ_SIZE(gqp_profile_greenlet_count(req), 1);
}

TEST(session_gets_attached_greenlets_and_requests_stay_the_same)
{
    fake_clock c;
    fc_init(&c);
    gqp_profile *whole = new_profile(), *req = new_profile();
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    ASSERT_OK(gqp_tracer_set_default(t, whole));
    ASSERT_OK(gqp_tracer_set_session(t, whole));
    request_scenario(t, &c, req);
    check_request(req);
    /* The session has both greenlets' calls, each once. */
    ASSERT_EQ_SIZE(gqp_profile_func_count(whole), 3);
    ASSERT_FUNC(whole, FA, 1, 1, 10, 7);
    ASSERT_FUNC(whole, FB, 1, 1, 3, 3);
    ASSERT_FUNC(whole, FC, 1, 1, 12, 12);
    ASSERT_EQ_SIZE(gqp_profile_greenlet_count(whole), 2);
    /* ... and every span of KH the request has, plus KG's, once each. */
    uint64_t idh = 0;
    gqp_greenlet_stat gs;
    ASSERT_OK(gqp_profile_greenlet(req, 0, &gs));
    idh = gs.greenlet_id;
    size_t nreq, nwhole;
    int64_t wreq = wall_of(req, idh, &nreq);
    int64_t wwhole = wall_of(whole, idh, &nwhole);
    ASSERT_EQ_SIZE(nreq, 2);
    ASSERT_EQ_SIZE(nwhole, 2 + 1); /* + its span before the attach */
    ASSERT_EQ_I64(wreq, 10);
    ASSERT_EQ_I64(wwhole, 10);
    ASSERT_EQ_SIZE(gqp_profile_span_count(whole), 2 + 3);
    gqp_tracer_free(t);
    gqp_profile_free(whole);
    gqp_profile_free(req);
}

/* The same events without a session give the request profile the same
 * data: the session changes nothing for it. */
TEST(session_absent_request_profile_identical)
{
    fake_clock c;
    fc_init(&c);
    gqp_profile *whole = new_profile(), *req = new_profile();
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    ASSERT_OK(gqp_tracer_set_default(t, whole));
    request_scenario(t, &c, req);
    check_request(req);
    ASSERT_FALSE(find_func(whole, FA, NULL));
    gqp_tracer_free(t);
    gqp_profile_free(whole);
    gqp_profile_free(req);
}

/* A session apart from the default gets every greenlet, also those that
 * go nowhere (no default) and those that go to the default. */
TEST(session_without_default_and_beside_it)
{
    fake_clock c;
    fc_init(&c);
    gqp_profile *s = new_profile(), *req = new_profile();
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    ASSERT_OK(gqp_tracer_set_session(t, s));
    request_scenario(t, &c, req);
    check_request(req);
    ASSERT_FUNC(s, FA, 1, 1, 10, 7);
    ASSERT_FUNC(s, FC, 1, 1, 12, 12);
    ASSERT_OK(gqp_tracer_flush(t));
    gqp_tracer_free(t);
    gqp_profile_free(s);
    gqp_profile_free(req);
}

/* Recursion across the two stacks: the session's recursion slots are its
 * own, so ttot counts the outermost frame once in both profiles. */
TEST(session_recursion_counted_per_profile)
{
    fake_clock c;
    fc_init(&c);
    gqp_profile *whole = new_profile(), *req = new_profile();
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    ASSERT_OK(gqp_tracer_set_default(t, whole));
    ASSERT_OK(gqp_tracer_set_session(t, whole));
    EV(gqp_tracer_switch(t, 0, KG, 0));
    EV(gqp_tracer_attach(t, KG, req));
    EV(gqp_tracer_call(t, FA));
    fc_run(&c, 1);
    EV(gqp_tracer_call(t, FA));
    fc_run(&c, 2);
    EV(gqp_tracer_return(t));
    fc_run(&c, 1);
    EV(gqp_tracer_return(t));
    ASSERT_FUNC(req, FA, 2, 1, 4, 4);
    ASSERT_FUNC(whole, FA, 2, 1, 4, 4);
    gqp_tracer_free(t);
    gqp_profile_free(whole);
    gqp_profile_free(req);
}

/* Detaching, closing the request profile, clearing or replacing the
 * session mid-frame: no frame is charged twice or to the wrong table, and
 * the session stack never outlives what it indexes. */
TEST(session_transitions_keep_stacks_apart)
{
    fake_clock c;
    fc_init(&c);
    gqp_profile *whole = new_profile(), *req = new_profile();
    gqp_profile *other = new_profile();
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    ASSERT_OK(gqp_tracer_set_default(t, whole));
    ASSERT_OK(gqp_tracer_set_session(t, whole));
    EV(gqp_tracer_switch(t, 0, KG, 0));
    EV(gqp_tracer_attach(t, KG, req));
    EV(gqp_tracer_call(t, FA));
    fc_run(&c, 2);
    /* detach mid-frame: both stacks are split at the same instant */
    EV(gqp_tracer_attach(t, KG, NULL));
    ASSERT_FUNC(req, FA, 1, 1, 2, 2);
    ASSERT_FUNC(whole, FA, 1, 1, 2, 2);
    EV(gqp_tracer_return(t)); /* (entered before: ignored) */
    EV(gqp_tracer_call(t, FB));
    fc_run(&c, 1);
    EV(gqp_tracer_return(t));
    ASSERT_FUNC(whole, FB, 1, 1, 1, 1);
    ASSERT_FALSE(find_func(req, FB, NULL));
    /* attach again, then the request profile closes mid-frame */
    EV(gqp_tracer_attach(t, KG, req));
    EV(gqp_tracer_call(t, FC));
    EV(gqp_tracer_call(t, FC));
    ASSERT_OK(gqp_profile_close(req));
    EV(gqp_tracer_call(t, FD)); /* back to the default, fresh stacks */
    fc_run(&c, 1);
    EV(gqp_tracer_return(t));
    EV(gqp_tracer_call(t, FC));
    fc_run(&c, 1);
    EV(gqp_tracer_return(t));
    ASSERT_FUNC(whole, FD, 1, 1, 1, 1);
    ASSERT_FUNC(whole, FC, 1, 1, 1, 1); /* not seen as recursive */
    /* the session cleared mid-frame, then replaced */
    EV(gqp_tracer_attach(t, KG, other));
    EV(gqp_tracer_call(t, FA));
    ASSERT_OK(gqp_profile_clear(whole));
    fc_run(&c, 1);
    EV(gqp_tracer_return(t));
    ASSERT_EQ_SIZE(gqp_profile_func_count(whole), 0);
    EV(gqp_tracer_call(t, FB));
    ASSERT_OK(gqp_tracer_set_session(t, other)); /* == its profile: once */
    fc_run(&c, 1);
    EV(gqp_tracer_return(t));
    EV(gqp_tracer_call(t, FE));
    fc_run(&c, 1);
    EV(gqp_tracer_return(t));
    ASSERT_FUNC(other, FE, 1, 1, 1, 1);
    ASSERT_EQ_SIZE(gqp_profile_func_count(whole), 1); /* FB, never closed */
    ASSERT_OK(gqp_tracer_set_session(t, NULL));
    ASSERT_OK(gqp_tracer_flush(t));
    gqp_tracer_free(t);
    gqp_profile_free(whole);
    gqp_profile_free(req);
    gqp_profile_free(other);
}

/* A closed session receives nothing; a frame open at a greenlet's death
 * and at a flush is unwound into the session too. */
TEST(session_closed_death_and_flush)
{
    fake_clock c;
    fc_init(&c);
    gqp_profile *s = new_profile(), *req = new_profile();
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    ASSERT_OK(gqp_tracer_set_session(t, s));
    EV(gqp_tracer_switch(t, 0, KG, 0));
    EV(gqp_tracer_attach(t, KG, req));
    EV(gqp_tracer_call(t, FA));
    fc_run(&c, 3);
    EV(gqp_tracer_switch(t, KG, KH, GQP_SWITCH_FROM_DEAD));
    ASSERT_FUNC(s, FA, 1, 1, 3, 3);
    ASSERT_FUNC(req, FA, 1, 1, 3, 3);
    EV(gqp_tracer_attach(t, KH, req));
    EV(gqp_tracer_call(t, FB));
    fc_run(&c, 2);
    ASSERT_OK(gqp_tracer_flush(t));
    ASSERT_FUNC(s, FB, 1, 1, 2, 2);
    size_t spans = gqp_profile_span_count(s);
    ASSERT_OK(gqp_profile_close(s));
    EV(gqp_tracer_switch(t, 0, KH, 0));
    EV(gqp_tracer_call(t, FC));
    fc_run(&c, 1);
    EV(gqp_tracer_return(t));
    EV(gqp_tracer_switch(t, KH, KG, 0));
    ASSERT_EQ_SIZE(gqp_profile_span_count(s), spans);
    ASSERT_FALSE(find_func(s, FC, NULL));
    ASSERT_FUNC(req, FC, 1, 1, 1, 1);
    gqp_tracer_free(t);
    gqp_profile_free(s);
    gqp_profile_free(req);
}

TEST(session_misuse)
{
    gqp_tracer *t;
    ASSERT_OK(gqp_tracer_new(&t));
    ASSERT_RC(gqp_tracer_set_session(NULL, NULL), GQP_EINVAL);
    ASSERT_OK(gqp_tracer_set_session(t, NULL));
    gqp_profile *p = new_profile();
    ASSERT_OK(gqp_tracer_set_session(t, p));
    ASSERT_OK(gqp_tracer_set_session(t, p));
    ASSERT_EQ_SIZE(gqp_profile_refs(p), 2);
    gqp_tracer_free(t);
    ASSERT_EQ_SIZE(gqp_profile_refs(p), 1);
    gqp_profile_free(p);
}
