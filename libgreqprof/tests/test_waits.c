/* test_waits.c -- wait sites: a greenlet attached to a profile that switches
 * out is charged, at its site, the wall time until it runs again. */
#include "harness.h"
#include "testutil.h"

#define SITE1 UINT64_C(0x55000100)
#define SITE2 UINT64_C(0x55000200)
#define SITE3 UINT64_C(0x55000300)
#define HUB UINT64_C(0x7f0000009000)

static gqp_wait_stat get_wait(const gqp_profile *p, size_t i)
{
    gqp_wait_stat w;
    memset(&w, 0xa5, sizeof w);
    ASSERT_OK(gqp_profile_wait(p, i, &w));
    return w;
}

/* g (running, attached) switches out to the hub at site, the hub runs
 * `idle` ns, then switches back to g.  Returns wait_at's result. */
static int wait_once(gqp_tracer *t, fake_clock *c, uint64_t g, uint64_t site,
                     int64_t idle, size_t *index)
{
    int ev = EV(gqp_tracer_switch(t, g, HUB, 0));
    ASSERT_HAS_FLAG(ev, GQP_EV_WAIT);
    int rc = EV(gqp_tracer_wait_at(t, g, site, NULL, index));
    fc_idle(c, idle);
    ev = EV(gqp_tracer_switch(t, HUB, g, 0));
    ASSERT_NO_FLAG(ev, GQP_EV_WAIT); /* the hub is attached to nothing */
    return rc;
}

TEST(waits_defaults_and_params)
{
    gqp_profile *p = new_profile();
    int64_t v = -1;
    ASSERT_OK(gqp_profile_get(p, GQP_PROFILE_MAX_WAIT_SITES, &v));
    ASSERT_EQ_I64(v, 256);
    ASSERT_OK(gqp_profile_set(p, GQP_PROFILE_MAX_WAIT_SITES, 3));
    ASSERT_OK(gqp_profile_get(p, GQP_PROFILE_MAX_WAIT_SITES, &v));
    ASSERT_EQ_I64(v, 3);
    ASSERT_OK(gqp_profile_get(p, GQP_PROFILE_MAX_WAIT_EVENTS, &v));
    ASSERT_EQ_I64(v, 1024);
    ASSERT_OK(gqp_profile_set(p, GQP_PROFILE_MAX_WAIT_EVENTS, 0));
    ASSERT_OK(gqp_profile_get(p, GQP_PROFILE_MAX_WAIT_EVENTS, &v));
    ASSERT_EQ_I64(v, 0);
    ASSERT_RC(gqp_profile_set(p, GQP_PROFILE_MAX_WAIT_EVENTS,
                              (INT64_C(1) << 24) + 1), GQP_ERANGE);
    ASSERT_EQ_SIZE(gqp_profile_wait_event_count(NULL), 0);
    ASSERT_EQ_U64(gqp_profile_wait_events_dropped(NULL), 0);
    ASSERT_RC(gqp_profile_set(p, GQP_PROFILE_MAX_WAIT_SITES, -1), GQP_ERANGE);
    ASSERT_RC(gqp_profile_set(p, GQP_PROFILE_MAX_WAIT_SITES,
                              (INT64_C(1) << 20) + 1), GQP_ERANGE);
    ASSERT_EQ_SIZE(gqp_profile_wait_count(p), 0);
    ASSERT_EQ_U64(gqp_profile_waits_dropped(p), 0);
    gqp_wait_stat w;
    ASSERT_RC(gqp_profile_wait(p, 0, &w), GQP_ERANGE);
    ASSERT_RC(gqp_profile_wait(p, 0, NULL), GQP_EINVAL);
    ASSERT_RC(gqp_profile_wait(NULL, 0, &w), GQP_EINVAL);
    ASSERT_RC(gqp_profile_wait_set_tag(p, 0, 1), GQP_ERANGE);
    ASSERT_RC(gqp_profile_wait_set_tag(NULL, 0, 1), GQP_EINVAL);
    ASSERT_EQ_SIZE(gqp_profile_wait_count(NULL), 0);
    ASSERT_EQ_U64(gqp_profile_waits_dropped(NULL), 0);
    gqp_profile_free(p);
}

TEST(waits_charged_to_site_until_switch_in)
{
    fake_clock c;
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    gqp_profile *p = new_profile();
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_OK(gqp_tracer_attach(t, KG, p));
    fc_run(&c, 10);
    size_t idx = 99;
    int rc = wait_once(t, &c, KG, SITE1, 500, &idx);
    ASSERT_HAS_FLAG(rc, GQP_EV_NEW_SITE);
    ASSERT_EQ_SIZE(idx, 0);
    ASSERT_OK(gqp_profile_wait_set_tag(p, idx, 7));
    fc_run(&c, 10);
    idx = 99;
    rc = wait_once(t, &c, KG, SITE1, 300, &idx);
    ASSERT_EQ_I64(rc, 0); /* known site */
    ASSERT_EQ_SIZE(idx, 0);
    ASSERT_EQ_SIZE(gqp_profile_wait_count(p), 1);
    gqp_wait_stat w = get_wait(p, 0);
    ASSERT_EQ_U64(w.site, SITE1);
    ASSERT_EQ_I64(w.wait_ns, 800);
    ASSERT_EQ_U64(w.count, 2);
    ASSERT_EQ_U64(w.greenlets, 1);
    ASSERT_EQ_U64(w.tag, 7);
    /* one by one: when and where */
    ASSERT_EQ_SIZE(gqp_profile_wait_event_count(p), 2);
    gqp_wait_event e;
    ASSERT_OK(gqp_profile_wait_event(p, 0, &e));
    ASSERT_EQ_U64(e.greenlet_id, gid(t, KG));
    ASSERT_EQ_I64(e.start_ns, W0 + 10);
    ASSERT_EQ_I64(e.end_ns, W0 + 510);
    ASSERT_EQ_U64(e.site, 0);
    ASSERT_OK(gqp_profile_wait_event(p, 1, &e));
    ASSERT_EQ_I64(e.start_ns, W0 + 520);
    ASSERT_EQ_I64(e.end_ns, W0 + 820);
    ASSERT_RC(gqp_profile_wait_event(p, 2, &e), GQP_ERANGE);
    ASSERT_RC(gqp_profile_wait_event(p, 0, NULL), GQP_EINVAL);
    ASSERT_EQ_U64(gqp_profile_wait_events_dropped(p), 0);
    /* a wait still pending is not charged yet */
    EV(gqp_tracer_switch(t, KG, HUB, 0));
    gqp_profile *wp = NULL;
    size_t wi = 99;
    ASSERT_HAS_FLAG(EV(gqp_tracer_wait_at(t, KG, SITE2, &wp, &wi)),
                    GQP_EV_NEW_SITE);
    ASSERT_TRUE(wp == p);
    ASSERT_EQ_SIZE(wi, 1);
    fc_idle(&c, 1000);
    ASSERT_EQ_SIZE(gqp_profile_wait_count(p), 2);
    ASSERT_EQ_U64(get_wait(p, 1).count, 0);
    ASSERT_EQ_I64(get_wait(p, 1).wait_ns, 0);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

TEST(waits_greenlets_counted_per_site)
{
    fake_clock c;
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    gqp_profile *p = new_profile();
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_OK(gqp_tracer_attach(t, KG, p));
    ASSERT_OK(gqp_tracer_inherit(t, KH, KG));
    ASSERT_OK(gqp_tracer_inherit(t, KI, KG));
    /* KG waits at SITE1 while KH and KI wait at SITE2, then KH at SITE1 */
    int ev = EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_HAS_FLAG(ev, GQP_EV_WAIT);
    EV(gqp_tracer_wait_at(t, KG, SITE1, NULL, NULL));
    fc_run(&c, 100);
    EV(gqp_tracer_switch(t, KH, KI, 0));
    EV(gqp_tracer_wait_at(t, KH, SITE2, NULL, NULL));
    fc_run(&c, 50);
    EV(gqp_tracer_switch(t, KI, KG, 0)); /* KG waited 150 */
    EV(gqp_tracer_wait_at(t, KI, SITE2, NULL, NULL));
    fc_run(&c, 20);
    EV(gqp_tracer_switch(t, KG, KH, 0)); /* KH waited 70 */
    EV(gqp_tracer_wait_at(t, KG, SITE3, NULL, NULL));
    fc_run(&c, 5);
    EV(gqp_tracer_switch(t, KH, KI, 0)); /* KI waited 25 */
    EV(gqp_tracer_wait_at(t, KH, SITE1, NULL, NULL));
    fc_run(&c, 5);
    EV(gqp_tracer_switch(t, KI, KH, GQP_SWITCH_FROM_DEAD)); /* KH waited 5 */
    ASSERT_EQ_SIZE(gqp_profile_wait_count(p), 3);
    gqp_wait_stat s1 = get_wait(p, 0), s2 = get_wait(p, 1);
    ASSERT_EQ_U64(s1.site, SITE1);
    ASSERT_EQ_I64(s1.wait_ns, 155);
    ASSERT_EQ_U64(s1.count, 2);
    ASSERT_EQ_U64(s1.greenlets, 2);
    ASSERT_EQ_U64(s2.site, SITE2);
    ASSERT_EQ_I64(s2.wait_ns, 95);
    ASSERT_EQ_U64(s2.count, 2);
    ASSERT_EQ_U64(s2.greenlets, 2);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

/* Only greenlets attached to a profile wait: not those of the tracer's
 * default profile, nor unattached ones, nor one that died. */
TEST(waits_only_for_attached_greenlets)
{
    fake_clock c;
    gqp_profile *d;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU, &d);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    int ev = EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_NO_FLAG(ev, GQP_EV_WAIT);
    ASSERT_RC(gqp_tracer_wait_at(t, KG, SITE1, NULL, NULL), GQP_ENOTFOUND);
    gqp_profile *p = new_profile();
    ASSERT_OK(gqp_tracer_attach(t, KH, p));
    ev = EV(gqp_tracer_switch(t, KH, KG, GQP_SWITCH_FROM_DEAD));
    ASSERT_NO_FLAG(ev, GQP_EV_WAIT);
    ASSERT_EQ_SIZE(gqp_profile_wait_count(d), 0);
    ASSERT_EQ_SIZE(gqp_profile_wait_count(p), 0);
    /* a profile with no room for sites accounts no waits */
    gqp_profile *z = new_profile();
    ASSERT_OK(gqp_profile_set(z, GQP_PROFILE_MAX_WAIT_SITES, 0));
    ASSERT_OK(gqp_tracer_attach(t, KG, z));
    ev = EV(gqp_tracer_switch(t, KG, KI, 0));
    ASSERT_NO_FLAG(ev, GQP_EV_WAIT);
    ASSERT_EQ_U64(gqp_profile_waits_dropped(z), 0);
    gqp_tracer_free(t);
    gqp_profile_free(d);
    gqp_profile_free(p);
    gqp_profile_free(z);
}

/* A greenlet detached (or moved) while it waits is not charged when it
 * runs again, nor after; a closed or cleared profile takes no charge. */
TEST(waits_not_charged_after_detach_close_or_clear)
{
    fake_clock c;
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    gqp_profile *p = new_profile();
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_OK(gqp_tracer_attach(t, KG, p));
    EV(gqp_tracer_switch(t, KG, HUB, 0));
    EV(gqp_tracer_wait_at(t, KG, SITE1, NULL, NULL));
    fc_idle(&c, 100);
    ASSERT_OK(gqp_tracer_attach(t, KG, NULL)); /* detached while waiting */
    ASSERT_RC(gqp_tracer_wait_at(t, KG, SITE1, NULL, NULL), GQP_ENOTFOUND);
    /* (and attached again: the wait began before, it is not p's) */
    ASSERT_OK(gqp_tracer_attach(t, KG, p));
    ASSERT_RC(gqp_tracer_wait_at(t, KG, SITE1, NULL, NULL), GQP_ENOTFOUND);
    EV(gqp_tracer_switch(t, HUB, KG, 0));
    ASSERT_EQ_U64(get_wait(p, 0).count, 0);
    ASSERT_OK(gqp_tracer_attach(t, KG, NULL));
    EV(gqp_tracer_switch(t, KG, HUB, 0));
    EV(gqp_tracer_switch(t, HUB, KG, 0));
    ASSERT_EQ_U64(get_wait(p, 0).count, 0);
    int ev = EV(gqp_tracer_switch(t, KG, HUB, 0));
    ASSERT_NO_FLAG(ev, GQP_EV_WAIT);
    EV(gqp_tracer_switch(t, HUB, KG, 0));
    ASSERT_EQ_U64(get_wait(p, 0).count, 0);
    ASSERT_EQ_I64(get_wait(p, 0).wait_ns, 0);

    /* cleared while waiting: the new generation gets nothing */
    ASSERT_OK(gqp_tracer_attach(t, KG, p));
    EV(gqp_tracer_switch(t, KG, HUB, 0));
    EV(gqp_tracer_wait_at(t, KG, SITE1, NULL, NULL));
    ASSERT_OK(gqp_profile_clear(p));
    ASSERT_RC(gqp_tracer_wait_at(t, KG, SITE1, NULL, NULL), GQP_ENOTFOUND);
    fc_idle(&c, 100);
    EV(gqp_tracer_switch(t, HUB, KG, 0));
    ASSERT_EQ_SIZE(gqp_profile_wait_count(p), 0);

    /* closed while waiting */
    EV(gqp_tracer_switch(t, KG, HUB, 0));
    EV(gqp_tracer_wait_at(t, KG, SITE2, NULL, NULL));
    ASSERT_OK(gqp_profile_close(p));
    fc_idle(&c, 100);
    EV(gqp_tracer_switch(t, HUB, KG, 0));
    ASSERT_EQ_SIZE(gqp_profile_wait_count(p), 1);
    ASSERT_EQ_U64(get_wait(p, 0).count, 0);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

TEST(waits_cap_counts_overflow)
{
    fake_clock c;
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    gqp_profile *p = new_profile();
    ASSERT_OK(gqp_profile_set(p, GQP_PROFILE_MAX_WAIT_SITES, 2));
    ASSERT_OK(gqp_profile_set(p, GQP_PROFILE_MAX_WAIT_EVENTS, 2));
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_OK(gqp_tracer_attach(t, KG, p));
    ASSERT_HAS_FLAG(wait_once(t, &c, KG, SITE1, 10, NULL), GQP_EV_NEW_SITE);
    ASSERT_HAS_FLAG(wait_once(t, &c, KG, SITE2, 20, NULL), GQP_EV_NEW_SITE);
    size_t idx = 77;
    int rc = wait_once(t, &c, KG, SITE3, 30, &idx);
    ASSERT_HAS_FLAG(rc, GQP_EV_DROPPED);
    ASSERT_NO_FLAG(rc, GQP_EV_NEW_SITE);
    ASSERT_EQ_SIZE(idx, 77);
    ASSERT_EQ_I64(wait_once(t, &c, KG, SITE1, 40, NULL), 0);
    ASSERT_EQ_SIZE(gqp_profile_wait_count(p), 2);
    ASSERT_EQ_U64(gqp_profile_waits_dropped(p), 1);
    ASSERT_EQ_I64(get_wait(p, 0).wait_ns, 50);
    ASSERT_EQ_I64(get_wait(p, 1).wait_ns, 20);
    /* 3 waits were charged (one at a dropped site): 2 events kept */
    ASSERT_EQ_SIZE(gqp_profile_wait_event_count(p), 2);
    ASSERT_EQ_U64(gqp_profile_wait_events_dropped(p), 1);
    /* caps are fixed once data came in */
    ASSERT_RC(gqp_profile_set(p, GQP_PROFILE_MAX_WAIT_SITES, 5), GQP_ESTATE);
        ASSERT_OK(gqp_profile_clear(p));
    ASSERT_EQ_SIZE(gqp_profile_wait_count(p), 0);
    ASSERT_EQ_SIZE(gqp_profile_wait_event_count(p), 0);
    ASSERT_EQ_U64(gqp_profile_wait_events_dropped(p), 0);
    ASSERT_EQ_U64(gqp_profile_waits_dropped(p), 0);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

TEST(waits_flush_charges_pending)
{
    fake_clock c;
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    gqp_profile *p = new_profile();
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_OK(gqp_tracer_attach(t, KG, p));
    EV(gqp_tracer_switch(t, KG, HUB, 0));
    EV(gqp_tracer_wait_at(t, KG, SITE1, NULL, NULL));
    fc_idle(&c, 250);
    ASSERT_OK(gqp_tracer_flush(t));
    ASSERT_EQ_I64(get_wait(p, 0).wait_ns, 250);
    ASSERT_EQ_U64(get_wait(p, 0).count, 1);
    /* charged once: running again later adds nothing */
    fc_idle(&c, 1000);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_EQ_I64(get_wait(p, 0).wait_ns, 250);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

TEST(waits_wait_at_errors)
{
    fake_clock c;
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    gqp_profile *p = new_profile();
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_OK(gqp_tracer_attach(t, KG, p));
    EV(gqp_tracer_switch(t, KG, HUB, 0));
    ASSERT_RC(gqp_tracer_wait_at(NULL, KG, SITE1, NULL, NULL), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_wait_at(t, 0, SITE1, NULL, NULL), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_wait_at(t, KG, 0, NULL, NULL), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_wait_at(t, KI, SITE1, NULL, NULL), GQP_ENOTFOUND);
    ASSERT_RC(gqp_tracer_wait_at(t, HUB, SITE1, NULL, NULL), GQP_ENOTFOUND);
    /* a wait with no site said is not charged anywhere */
    fc_idle(&c, 10);
    EV(gqp_tracer_switch(t, HUB, KG, 0));
    ASSERT_EQ_SIZE(gqp_profile_wait_count(p), 0);
    /* said twice: the last site wins */
    EV(gqp_tracer_switch(t, KG, HUB, 0));
    EV(gqp_tracer_wait_at(t, KG, SITE1, NULL, NULL));
    EV(gqp_tracer_wait_at(t, KG, SITE2, NULL, NULL));
    fc_idle(&c, 10);
    EV(gqp_tracer_switch(t, HUB, KG, 0));
    ASSERT_EQ_U64(get_wait(p, 0).count, 0);
    ASSERT_EQ_U64(get_wait(p, 1).count, 1);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}
