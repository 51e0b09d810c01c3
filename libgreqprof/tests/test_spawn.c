/* test_spawn.c -- gqp_profile_attached, gqp_tracer_set_spawn_profile and
 * inheritance from greenlets that already died. */
#include "harness.h"
#include "testutil.h"

/* The profile the greenlet `key` records into when it runs next. */
static gqp_profile *profile_of(gqp_tracer *t, uint64_t key)
{
    uint64_t cur = 0;
    gqp_profile *p = NULL;
    if (gqp_tracer_current(t, &cur, NULL, NULL) != GQP_OK)
        cur = 0;
    EV(gqp_tracer_switch(t, cur, key, 0));
    ASSERT_OK(gqp_tracer_current(t, NULL, NULL, &p));
    return p;
}

TEST(profile_attached_counts_live_attachments)
{
    fake_clock c;
    gqp_profile *d, *p = new_profile();
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_OFF, GQP_CLOCK_WALL, &d);
    ASSERT_EQ_SIZE(gqp_profile_attached(p), 0);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_OK(gqp_tracer_attach(t, KG, p));
    ASSERT_EQ_SIZE(gqp_profile_attached(p), 1);
    ASSERT_OK(gqp_tracer_attach(t, KG, p)); /* again: still one */
    ASSERT_EQ_SIZE(gqp_profile_attached(p), 1);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_OK(gqp_tracer_attach(t, KH, p));
    ASSERT_EQ_SIZE(gqp_profile_attached(p), 2);
    ASSERT_OK(gqp_tracer_inherit(t, KI, KH));
    EV(gqp_tracer_switch(t, KH, KI, 0));
    ASSERT_EQ_SIZE(gqp_profile_attached(p), 3);
    /* a greenlet ending, being forgotten, being detached */
    EV(gqp_tracer_switch(t, KI, KG, GQP_SWITCH_FROM_DEAD));
    ASSERT_EQ_SIZE(gqp_profile_attached(p), 2);
    ASSERT_OK(gqp_tracer_forget(t, KH));
    ASSERT_EQ_SIZE(gqp_profile_attached(p), 1);
    ASSERT_OK(gqp_tracer_attach(t, KG, NULL));
    ASSERT_EQ_SIZE(gqp_profile_attached(p), 0);
    /* the tracer going away drops its attachments */
    ASSERT_OK(gqp_tracer_attach(t, KG, p));
    EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_OK(gqp_tracer_attach(t, KH, p));
    ASSERT_EQ_SIZE(gqp_profile_attached(p), 2);
    ASSERT_OK(gqp_tracer_flush(t)); /* flush keeps greenlets alive */
    ASSERT_EQ_SIZE(gqp_profile_attached(p), 2);
    gqp_tracer_free(t);
    ASSERT_EQ_SIZE(gqp_profile_attached(p), 0);
    ASSERT_EQ_SIZE(gqp_profile_attached(NULL), 0);
    gqp_profile_free(d);
    gqp_profile_free(p);
}

TEST(profile_attached_across_tracers)
{
    fake_clock c1, c2;
    gqp_profile *p = new_profile();
    fc_init(&c1);
    fc_init(&c2);
    gqp_tracer *t1 = new_tracer(&c1, GQP_CPU_OFF, GQP_CLOCK_WALL);
    gqp_tracer *t2 = new_tracer(&c2, GQP_CPU_OFF, GQP_CLOCK_WALL);
    EV(gqp_tracer_switch(t1, 0, KG, 0));
    EV(gqp_tracer_switch(t2, 0, KG, 0));
    ASSERT_OK(gqp_tracer_attach(t1, KG, p));
    ASSERT_OK(gqp_tracer_attach(t2, KG, p));
    ASSERT_EQ_SIZE(gqp_profile_attached(p), 2);
    gqp_tracer_free(t1);
    ASSERT_EQ_SIZE(gqp_profile_attached(p), 1);
    gqp_tracer_free(t2);
    ASSERT_EQ_SIZE(gqp_profile_attached(p), 0);
    gqp_profile_free(p);
}

TEST(spawn_profile_routes_children)
{
    fake_clock c;
    gqp_profile *d, *p = new_profile(), *q = new_profile(),
                    *r = new_profile();
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_OFF, GQP_CLOCK_WALL, &d);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_OK(gqp_tracer_attach(t, KG, p));
    ASSERT_OK(gqp_tracer_set_spawn_profile(t, KG, q));
    ASSERT_OK(gqp_tracer_inherit(t, 0x1001, KG));
    ASSERT_EQ_PTR(profile_of(t, 0x1001), q);
    ASSERT_EQ_PTR(profile_of(t, KG), p); /* G's own spans still go to p */

    /* NULL: children get G's own profile again */
    ASSERT_OK(gqp_tracer_set_spawn_profile(t, KG, NULL));
    ASSERT_OK(gqp_tracer_inherit(t, 0x1002, KG));
    ASSERT_EQ_PTR(profile_of(t, 0x1002), p);

    /* attach clears the spawn profile */
    ASSERT_OK(gqp_tracer_set_spawn_profile(t, KG, q));
    ASSERT_OK(gqp_tracer_attach(t, KG, r));
    ASSERT_OK(gqp_tracer_inherit(t, 0x1003, KG));
    ASSERT_EQ_PTR(profile_of(t, 0x1003), r);

    /* the request case: G detached, its later children still join p */
    ASSERT_OK(gqp_tracer_attach(t, KG, NULL));
    ASSERT_OK(gqp_tracer_set_spawn_profile(t, KG, p));
    ASSERT_OK(gqp_tracer_inherit(t, 0x1004, KG));
    ASSERT_EQ_PTR(profile_of(t, 0x1004), p);
    ASSERT_EQ_PTR(profile_of(t, KG), d);

    /* a switched-out greenlet can get a spawn profile too */
    EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_OK(gqp_tracer_set_spawn_profile(t, KG, q));
    ASSERT_OK(gqp_tracer_inherit(t, 0x1005, KG));
    ASSERT_EQ_PTR(profile_of(t, 0x1005), q);
    gqp_tracer_free(t);
    gqp_profile_free(d);
    gqp_profile_free(p);
    gqp_profile_free(q);
    gqp_profile_free(r);
}

TEST(spawn_profile_errors)
{
    fake_clock c;
    gqp_profile *p = new_profile();
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_OFF, GQP_CLOCK_WALL);
    ASSERT_RC(gqp_tracer_set_spawn_profile(NULL, KG, p), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_set_spawn_profile(t, 0, p), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_set_spawn_profile(t, KG, p), GQP_ENOTFOUND);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_OK(gqp_tracer_set_spawn_profile(t, KG, p));
    ASSERT_OK(gqp_tracer_set_spawn_profile(t, KG, NULL));
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

/* The tracer keeps what it needs of a spawn profile: the caller may drop
 * its own reference (run under ASan/valgrind). */
TEST(spawn_profile_holds_reference)
{
    fake_clock c;
    gqp_profile *q = new_profile(), *cp = NULL;
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_OFF, GQP_CLOCK_WALL);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_OK(gqp_tracer_set_spawn_profile(t, KG, q));
    gqp_profile_free(q);
    ASSERT_OK(gqp_tracer_inherit(t, 0x2001, KG));
    cp = profile_of(t, 0x2001);
    ASSERT_EQ_PTR(cp, q);
    fc_idle(&c, 5);
    EV(gqp_tracer_switch(t, 0x2001, KG, 0));
    ASSERT_EQ_SIZE(gqp_profile_span_count(cp), 1);
    gqp_tracer_free(t);
}

/* Children that start after their spawner died still inherit. */
TEST(inherit_from_dead_parent)
{
    fake_clock c;
    gqp_profile *p = new_profile(), *q = new_profile();
    uint64_t id;
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_OFF, GQP_CLOCK_WALL);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_OK(gqp_tracer_attach(t, KG, p));
    EV(gqp_tracer_switch(t, KG, KH, GQP_SWITCH_FROM_DEAD));
    ASSERT_RC(gqp_tracer_greenlet_id(t, KG, &id), GQP_ENOTFOUND);
    ASSERT_OK(gqp_tracer_inherit(t, 0x3001, KG));
    ASSERT_EQ_PTR(profile_of(t, 0x3001), p);
    /* twice: the memory is not used up by one child */
    ASSERT_OK(gqp_tracer_inherit(t, 0x3002, KG));
    ASSERT_EQ_PTR(profile_of(t, 0x3002), p);

    /* a dead parent's spawn profile wins over its profile */
    EV(gqp_tracer_switch(t, 0x3002, KI, 0));
    ASSERT_OK(gqp_tracer_attach(t, KI, p));
    ASSERT_OK(gqp_tracer_set_spawn_profile(t, KI, q));
    EV(gqp_tracer_switch(t, KI, KH, GQP_SWITCH_FROM_DEAD));
    ASSERT_OK(gqp_tracer_inherit(t, 0x3003, KI));
    ASSERT_EQ_PTR(profile_of(t, 0x3003), q);

    /* once the key is alive again (a new greenlet), the dead one is
     * forgotten: inherit follows the live greenlet */
    EV(gqp_tracer_switch(t, 0x3003, KG, 0)); /* a new greenlet at KG */
    ASSERT_OK(gqp_tracer_inherit(t, 0x3004, KG));
    ASSERT_NULL(profile_of(t, 0x3004)); /* no default profile */
    /* ... and stays forgotten after that greenlet dies unprofiled */
    EV(gqp_tracer_switch(t, 0x3004, KG, 0));
    EV(gqp_tracer_switch(t, KG, KH, GQP_SWITCH_FROM_DEAD));
    ASSERT_RC(gqp_tracer_inherit(t, 0x3005, KG), GQP_ENOTFOUND);
    gqp_tracer_free(t);
    gqp_profile_free(p);
    gqp_profile_free(q);
}

/* "the last 256 dead greenlets that had a profile are remembered" */
TEST(inherit_remembers_last_256_dead)
{
    fake_clock c;
    gqp_profile *p = new_profile();
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_OFF, GQP_CLOCK_WALL);
    const uint64_t base = 0x100000;
    EV(gqp_tracer_switch(t, 0, 1, 0));
    uint64_t prev = 1;
    for (uint64_t i = 0; i < 257; i++) {
        EV(gqp_tracer_switch(t, prev, base + i, 0));
        ASSERT_OK(gqp_tracer_attach(t, base + i, p));
        EV(gqp_tracer_switch(t, base + i, 1, GQP_SWITCH_FROM_DEAD));
        prev = 1;
    }
    /* greenlets that died without a profile do not push others out */
    for (uint64_t i = 0; i < 50; i++) {
        EV(gqp_tracer_switch(t, 1, 0x900000 + i, 0));
        EV(gqp_tracer_switch(t, 0x900000 + i, 1, GQP_SWITCH_FROM_DEAD));
        ASSERT_RC(gqp_tracer_inherit(t, 0xa00000 + i, 0x900000 + i),
                  GQP_ENOTFOUND);
    }
    /* the oldest of 257 is gone, the 256 after it are remembered */
    ASSERT_RC(gqp_tracer_inherit(t, 0x5000, base), GQP_ENOTFOUND);
    for (uint64_t i = 1; i < 257; i++)
        ASSERT_OK(gqp_tracer_inherit(t, 0x6000 + i, base + i));
    ASSERT_EQ_PTR(profile_of(t, 0x6000 + 1), p);
    ASSERT_EQ_PTR(profile_of(t, 0x6000 + 256), p);
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

/* Found by fuzz_api (heap-use-after-free under ASan/valgrind): inheriting
 * from a dead parent whose key is the child's own key.  The remembered
 * profile is released when the key is "seen alive again" (the child is
 * created) and then attached to the child.  The header asks callers not to
 * reuse a live parent's key, but a wrong key must not corrupt memory. */
TEST(inherit_dead_parent_same_key_as_child)
{
    fake_clock c;
    gqp_profile *p = new_profile();
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_OFF, GQP_CLOCK_WALL);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_OK(gqp_tracer_attach(t, KG, p));
    gqp_profile_free(p); /* only the tracer holds p now */
    EV(gqp_tracer_switch(t, KG, KH, GQP_SWITCH_FROM_DEAD));
    fc_idle(&c, 1);
    EV(gqp_tracer_switch(t, KH, KI, 0)); /* last span: no profile */
    int rc = gqp_tracer_inherit(t, KG, KG);
    ASSERT_TRUE(rc == GQP_OK || rc == GQP_ENOTFOUND || rc == GQP_EINVAL);
    EV(gqp_tracer_switch(t, KI, KG, 0));
    fc_idle(&c, 1);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    gqp_tracer_free(t);
}

/* gqp_tracer_greenlet_profile: a greenlet's own attachment, running or
 * not (never the default, nor a closed profile). */
TEST(greenlet_profile_reads_the_attachment)
{
    fake_clock c;
    gqp_profile *d = NULL, *got = NULL, *p = new_profile(), *q = new_profile();
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_OFF, GQP_CLOCK_WALL, &d);
    ASSERT_RC(gqp_tracer_greenlet_profile(NULL, KG, &got), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_greenlet_profile(t, 0, &got), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_greenlet_profile(t, KG, NULL), GQP_EINVAL);
    ASSERT_RC(gqp_tracer_greenlet_profile(t, KG, &got), GQP_ENOTFOUND);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_OK(gqp_tracer_greenlet_profile(t, KG, &got));
    ASSERT_EQ_PTR(got, NULL);            /* the default is not its own */
    ASSERT_OK(gqp_tracer_attach(t, KG, p));
    EV(gqp_tracer_switch(t, KG, KH, 0)); /* not running: still read */
    ASSERT_OK(gqp_tracer_attach(t, KH, q));
    ASSERT_OK(gqp_tracer_greenlet_profile(t, KG, &got));
    ASSERT_EQ_PTR(got, p);
    ASSERT_OK(gqp_tracer_greenlet_profile(t, KH, &got));
    ASSERT_EQ_PTR(got, q);
    ASSERT_OK(gqp_profile_close(p));
    ASSERT_OK(gqp_tracer_greenlet_profile(t, KG, &got));
    ASSERT_EQ_PTR(got, NULL);            /* closed: attached to nothing */
    EV(gqp_tracer_switch(t, KH, KG, GQP_SWITCH_FROM_DEAD));
    ASSERT_RC(gqp_tracer_greenlet_profile(t, KH, &got), GQP_ENOTFOUND);
    gqp_tracer_free(t);
    gqp_profile_free(d);
    gqp_profile_free(p);
    gqp_profile_free(q);
}

/* gqp_tracer_can_inherit: 1 exactly while some greenlet is attached, has a
 * spawn profile, or a remembered dead one had a profile. */
TEST(can_inherit_follows_what_could_be_inherited)
{
    fake_clock c;
    gqp_profile *p = new_profile();
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_OFF, GQP_CLOCK_WALL);
    ASSERT_RC(gqp_tracer_can_inherit(NULL), GQP_EHANDLE);
    ASSERT_RC(gqp_tracer_can_inherit(t), 0);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_RC(gqp_tracer_can_inherit(t), 0);
    /* attached */
    ASSERT_OK(gqp_tracer_attach(t, KG, p));
    ASSERT_RC(gqp_tracer_can_inherit(t), 1);
    ASSERT_OK(gqp_tracer_attach(t, KG, NULL));
    ASSERT_RC(gqp_tracer_can_inherit(t), 0);
    /* a spawn profile */
    ASSERT_OK(gqp_tracer_set_spawn_profile(t, KG, p));
    ASSERT_RC(gqp_tracer_can_inherit(t), 1);
    ASSERT_OK(gqp_tracer_set_spawn_profile(t, KG, NULL));
    ASSERT_RC(gqp_tracer_can_inherit(t), 0);
    /* a dead greenlet that had one, until its key lives again */
    ASSERT_OK(gqp_tracer_attach(t, KH, p));
    EV(gqp_tracer_switch(t, KH, KG, GQP_SWITCH_FROM_DEAD));
    ASSERT_RC(gqp_tracer_can_inherit(t), 1);
    ASSERT_OK(gqp_tracer_inherit(t, KI, KH));
    ASSERT_RC(gqp_tracer_can_inherit(t), 1);   /* (KI is attached now) */
    EV(gqp_tracer_switch(t, KG, KI, 0));
    EV(gqp_tracer_switch(t, KI, KG, GQP_SWITCH_FROM_DEAD));
    ASSERT_RC(gqp_tracer_can_inherit(t), 1);   /* (two tombs) */
    EV(gqp_tracer_switch(t, KG, KH, 0));       /* KH lives again */
    EV(gqp_tracer_switch(t, KH, KI, 0));       /* and KI */
    ASSERT_RC(gqp_tracer_can_inherit(t), 0);
    /* a greenlet with a spawn profile dying, then forgotten */
    ASSERT_OK(gqp_tracer_set_spawn_profile(t, KI, p));
    EV(gqp_tracer_switch(t, KI, KG, GQP_SWITCH_FROM_DEAD));
    ASSERT_RC(gqp_tracer_can_inherit(t), 1);   /* (its tomb) */
    gqp_tracer_free(t);
    gqp_profile_free(p);
}
