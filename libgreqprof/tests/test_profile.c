/* test_profile.c -- gqp_profile_*: lifecycle, parameters, names, readers. */
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "testutil.h"

static int64_t pget(const gqp_profile *p, gqp_profile_param k)
{
    int64_t v = -12345;
    ASSERT_OK(gqp_profile_get(p, k, &v));
    return v;
}

/* Records one span of `ns` wall/CPU time for greenlet KG into p. */
static void feed_one_span(gqp_profile *p, int64_t ns)
{
    fake_clock c;
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    ASSERT_OK(gqp_tracer_set_default(t, p));
    EV(gqp_tracer_switch(t, 0, KG, 0));
    fc_run(&c, ns);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    gqp_tracer_free(t);
}

TEST(profile_new_defaults)
{
    gqp_profile *p = new_profile();
    ASSERT_EQ_I64(pget(p, GQP_PROFILE_MAX_SPANS), 10000);
    ASSERT_EQ_I64(pget(p, GQP_PROFILE_SPAN_POLICY), GQP_KEEP_FIRST);
    ASSERT_EQ_I64(pget(p, GQP_PROFILE_MAX_FUNCS), 65536);
    ASSERT_EQ_I64(pget(p, GQP_PROFILE_MAX_EDGES), 262144);
    ASSERT_EQ_I64(pget(p, GQP_PROFILE_MAX_GREENLETS), 65536);
    ASSERT_EQ_I64(pget(p, GQP_PROFILE_MAX_NAME), 255);
    ASSERT_EQ_I64(gqp_profile_is_closed(p), 0);
    ASSERT_EQ_SIZE(gqp_profile_span_count(p), 0);
    ASSERT_EQ_U64(gqp_profile_spans_dropped(p), 0);
    ASSERT_EQ_SIZE(gqp_profile_greenlet_count(p), 0);
    ASSERT_EQ_U64(gqp_profile_greenlets_dropped(p), 0);
    ASSERT_EQ_SIZE(gqp_profile_func_count(p), 0);
    ASSERT_EQ_SIZE(gqp_profile_edge_count(p), 0);
    ASSERT_EQ_U64(gqp_profile_calls_dropped(p), 0);
    gqp_profile_free(p);
}

TEST(profile_set_get_roundtrip)
{
    gqp_profile *p = new_profile();
    ASSERT_OK(gqp_profile_set(p, GQP_PROFILE_MAX_SPANS, 7));
    ASSERT_OK(gqp_profile_set(p, GQP_PROFILE_SPAN_POLICY, GQP_KEEP_LAST));
    ASSERT_OK(gqp_profile_set(p, GQP_PROFILE_MAX_FUNCS, 11));
    ASSERT_OK(gqp_profile_set(p, GQP_PROFILE_MAX_EDGES, 13));
    ASSERT_OK(gqp_profile_set(p, GQP_PROFILE_MAX_GREENLETS, 17));
    ASSERT_OK(gqp_profile_set(p, GQP_PROFILE_MAX_NAME, 19));
    ASSERT_EQ_I64(pget(p, GQP_PROFILE_MAX_SPANS), 7);
    ASSERT_EQ_I64(pget(p, GQP_PROFILE_SPAN_POLICY), GQP_KEEP_LAST);
    ASSERT_EQ_I64(pget(p, GQP_PROFILE_MAX_FUNCS), 11);
    ASSERT_EQ_I64(pget(p, GQP_PROFILE_MAX_EDGES), 13);
    ASSERT_EQ_I64(pget(p, GQP_PROFILE_MAX_GREENLETS), 17);
    ASSERT_EQ_I64(pget(p, GQP_PROFILE_MAX_NAME), 19);
    /* 0 spans is documented ("0 = none") */
    ASSERT_OK(gqp_profile_set(p, GQP_PROFILE_MAX_SPANS, 0));
    ASSERT_EQ_I64(pget(p, GQP_PROFILE_MAX_SPANS), 0);
    ASSERT_OK(gqp_profile_set(p, GQP_PROFILE_SPAN_POLICY, GQP_KEEP_FIRST));
    ASSERT_EQ_I64(pget(p, GQP_PROFILE_SPAN_POLICY), GQP_KEEP_FIRST);
    gqp_profile_free(p);
}

TEST(profile_set_get_invalid)
{
    gqp_profile *p = new_profile();
    int64_t v = 99;
    ASSERT_RC(gqp_profile_set(p, (gqp_profile_param)0, 1), GQP_EINVAL);
    ASSERT_RC(gqp_profile_set(p, (gqp_profile_param)10, 1), GQP_EINVAL);
    ASSERT_RC(gqp_profile_set(p, (gqp_profile_param)-1, 1), GQP_EINVAL);
    ASSERT_RC(gqp_profile_get(p, (gqp_profile_param)0, &v), GQP_EINVAL);
    ASSERT_RC(gqp_profile_get(p, (gqp_profile_param)1000, &v), GQP_EINVAL);
    /* invalid values: the header has both EINVAL and ERANGE, accept either */
    ASSERT_RC2(gqp_profile_set(p, GQP_PROFILE_SPAN_POLICY, 2), GQP_EINVAL,
               GQP_ERANGE);
    ASSERT_RC2(gqp_profile_set(p, GQP_PROFILE_SPAN_POLICY, -1), GQP_EINVAL,
               GQP_ERANGE);
    ASSERT_RC2(gqp_profile_set(p, GQP_PROFILE_MAX_SPANS, -1), GQP_EINVAL,
               GQP_ERANGE);
    ASSERT_RC2(gqp_profile_set(p, GQP_PROFILE_MAX_FUNCS, -5), GQP_EINVAL,
               GQP_ERANGE);
    ASSERT_RC2(gqp_profile_set(p, GQP_PROFILE_MAX_EDGES, INT64_MIN),
               GQP_EINVAL, GQP_ERANGE);
    ASSERT_RC2(gqp_profile_set(p, GQP_PROFILE_MAX_GREENLETS, -1), GQP_EINVAL,
               GQP_ERANGE);
    ASSERT_RC2(gqp_profile_set(p, GQP_PROFILE_MAX_NAME, -1), GQP_EINVAL,
               GQP_ERANGE);
    /* rejected values change nothing */
    ASSERT_EQ_I64(pget(p, GQP_PROFILE_MAX_SPANS), 10000);
    ASSERT_EQ_I64(pget(p, GQP_PROFILE_SPAN_POLICY), GQP_KEEP_FIRST);
    ASSERT_EQ_I64(pget(p, GQP_PROFILE_MAX_NAME), 255);
    gqp_profile_free(p);
}

TEST(profile_caps_rejected_after_data)
{
    gqp_profile *p = new_profile();
    feed_one_span(p, 10);
    ASSERT_EQ_SIZE(gqp_profile_span_count(p), 1);
    ASSERT_RC(gqp_profile_set(p, GQP_PROFILE_MAX_SPANS, 5), GQP_ESTATE);
    ASSERT_RC(gqp_profile_set(p, GQP_PROFILE_MAX_FUNCS, 5), GQP_ESTATE);
    ASSERT_RC(gqp_profile_set(p, GQP_PROFILE_MAX_EDGES, 5), GQP_ESTATE);
    ASSERT_RC(gqp_profile_set(p, GQP_PROFILE_MAX_GREENLETS, 5), GQP_ESTATE);
    ASSERT_RC(gqp_profile_set(p, GQP_PROFILE_MAX_NAME, 5), GQP_ESTATE);
    ASSERT_EQ_I64(pget(p, GQP_PROFILE_MAX_SPANS), 10000);
    /* reading is always allowed */
    ASSERT_EQ_I64(pget(p, GQP_PROFILE_MAX_FUNCS), 65536);
    gqp_profile_free(p);
}

TEST(profile_retain_free_balance)
{
    gqp_profile *p = new_profile();
    ASSERT_EQ_SIZE(gqp_profile_refs(p), 1);
    ASSERT_OK(gqp_profile_retain(p));
    ASSERT_OK(gqp_profile_retain(p));
    ASSERT_OK(gqp_profile_retain(p));
    ASSERT_EQ_SIZE(gqp_profile_refs(p), 4);
    gqp_profile_free(p);
    gqp_profile_free(p);
    gqp_profile_free(p);
    ASSERT_EQ_SIZE(gqp_profile_refs(p), 1);
    /* still one reference: still usable */
    ASSERT_EQ_I64(gqp_profile_is_closed(p), 0);
    ASSERT_EQ_I64(pget(p, GQP_PROFILE_MAX_SPANS), 10000);
    gqp_profile_free(p); /* last: ASan/valgrind check nothing leaks */
}

TEST(profile_close_twice)
{
    gqp_profile *p = new_profile();
    ASSERT_EQ_I64(gqp_profile_is_closed(p), 0);
    ASSERT_OK(gqp_profile_close(p));
    ASSERT_EQ_I64(gqp_profile_is_closed(p), 1);
    ASSERT_RC(gqp_profile_close(p), GQP_ESTATE);
    ASSERT_EQ_I64(gqp_profile_is_closed(p), 1);
    gqp_profile_free(p);
}

TEST(profile_closed_keeps_data_readable)
{
    gqp_profile *p = new_profile();
    feed_one_span(p, 25);
    ASSERT_OK(gqp_profile_close(p));
    ASSERT_EQ_SIZE(gqp_profile_span_count(p), 1);
    gqp_span s = get_span(p, 0);
    ASSERT_EQ_I64(s.end_ns - s.start_ns, 25);
    gqp_profile_free(p);
}

TEST(profile_clear_empties_keeps_caps_and_state)
{
    gqp_profile *p = new_profile();
    gqp_span s;
    ASSERT_OK(gqp_profile_set(p, GQP_PROFILE_MAX_SPANS, 3));
    ASSERT_OK(gqp_profile_set(p, GQP_PROFILE_SPAN_POLICY, GQP_KEEP_LAST));
    ASSERT_OK(gqp_profile_set(p, GQP_PROFILE_MAX_NAME, 9));
    for (int i = 0; i < 5; i++)
        feed_one_span(p, 10 + i);
    ASSERT_OK(gqp_profile_name_greenlet(p, 99, "n", "f"));
    ASSERT_EQ_SIZE(gqp_profile_span_count(p), 3);
    ASSERT_EQ_U64(gqp_profile_spans_dropped(p), 2);
    ASSERT_TRUE(gqp_profile_greenlet_count(p) > 0);

    ASSERT_OK(gqp_profile_clear(p));
    ASSERT_EQ_SIZE(gqp_profile_span_count(p), 0);
    ASSERT_EQ_U64(gqp_profile_spans_dropped(p), 0);
    ASSERT_EQ_SIZE(gqp_profile_greenlet_count(p), 0);
    ASSERT_EQ_U64(gqp_profile_greenlets_dropped(p), 0);
    ASSERT_EQ_SIZE(gqp_profile_func_count(p), 0);
    ASSERT_EQ_SIZE(gqp_profile_edge_count(p), 0);
    ASSERT_EQ_U64(gqp_profile_calls_dropped(p), 0);
    ASSERT_RC(gqp_profile_longest_span(p, &s), GQP_ENOTFOUND);
    ASSERT_RC(gqp_profile_longest_cpu_span(p, &s), GQP_ENOTFOUND);
    ASSERT_RC(gqp_profile_span(p, 0, &s), GQP_ERANGE);
    ASSERT_EQ_I64(pget(p, GQP_PROFILE_MAX_SPANS), 3);
    ASSERT_EQ_I64(pget(p, GQP_PROFILE_SPAN_POLICY), GQP_KEEP_LAST);
    ASSERT_EQ_I64(pget(p, GQP_PROFILE_MAX_NAME), 9);
    ASSERT_EQ_I64(gqp_profile_is_closed(p), 0);

    /* still open: accepts data again, caps still apply */
    for (int i = 0; i < 4; i++)
        feed_one_span(p, 100 + i);
    ASSERT_EQ_SIZE(gqp_profile_span_count(p), 3);
    ASSERT_EQ_U64(gqp_profile_spans_dropped(p), 1);
    s = get_span(p, 0);
    ASSERT_EQ_I64(s.end_ns - s.start_ns, 101);

    /* a closed profile stays closed across clear */
    ASSERT_OK(gqp_profile_close(p));
    ASSERT_OK(gqp_profile_clear(p));
    ASSERT_EQ_I64(gqp_profile_is_closed(p), 1);
    ASSERT_EQ_SIZE(gqp_profile_span_count(p), 0);
    ASSERT_RC(gqp_profile_close(p), GQP_ESTATE);
    gqp_profile_free(p);
}

TEST(profile_span_index_range)
{
    gqp_profile *p = new_profile();
    gqp_span s;
    ASSERT_RC(gqp_profile_span(p, 0, &s), GQP_ERANGE);
    ASSERT_RC(gqp_profile_span_set_tag(p, 0, 1), GQP_ERANGE);
    feed_one_span(p, 5);
    feed_one_span(p, 6);
    ASSERT_OK(gqp_profile_span(p, 1, &s));
    ASSERT_RC(gqp_profile_span(p, 2, &s), GQP_ERANGE);
    ASSERT_RC(gqp_profile_span(p, SIZE_MAX, &s), GQP_ERANGE);
    ASSERT_RC(gqp_profile_span_set_tag(p, 2, 1), GQP_ERANGE);
    ASSERT_RC(gqp_profile_span_set_tag(p, SIZE_MAX, 1), GQP_ERANGE);
    gqp_profile_free(p);
}

TEST(profile_span_set_tag)
{
    gqp_profile *p = new_profile();
    feed_one_span(p, 5);
    feed_one_span(p, 6);
    feed_one_span(p, 7);
    ASSERT_EQ_U64(get_span(p, 0).tag, 0);
    ASSERT_EQ_U64(get_span(p, 1).tag, 0);
    ASSERT_OK(gqp_profile_span_set_tag(p, 1, 0xdeadbeefu));
    ASSERT_EQ_U64(get_span(p, 0).tag, 0);
    ASSERT_EQ_U64(get_span(p, 1).tag, 0xdeadbeefu);
    ASSERT_EQ_U64(get_span(p, 2).tag, 0);
    ASSERT_EQ_I64(get_span(p, 1).end_ns - get_span(p, 1).start_ns, 6);
    ASSERT_OK(gqp_profile_span_set_tag(p, 1, 0));
    ASSERT_EQ_U64(get_span(p, 1).tag, 0);
    ASSERT_OK(gqp_profile_span_set_tag(p, 2, UINT32_MAX));
    ASSERT_EQ_U64(get_span(p, 2).tag, UINT32_MAX);
    gqp_profile_free(p);
}

TEST(profile_longest_span_empty)
{
    gqp_profile *p = new_profile();
    gqp_span s;
    ASSERT_RC(gqp_profile_longest_span(p, &s), GQP_ENOTFOUND);
    ASSERT_RC(gqp_profile_longest_cpu_span(p, &s), GQP_ENOTFOUND);
    gqp_profile_free(p);
}

/* --- greenlet names ---------------------------------------------------- */

TEST(name_greenlet_creates_entry)
{
    gqp_profile *p = new_profile();
    gqp_greenlet_stat g;
    ASSERT_OK(gqp_profile_name_greenlet(p, 77, "worker-1", "mod.fn"));
    ASSERT_EQ_SIZE(gqp_profile_greenlet_count(p), 1);
    ASSERT_OK(gqp_profile_greenlet(p, 0, &g));
    ASSERT_EQ_U64(g.greenlet_id, 77);
    ASSERT_STREQ(g.name, "worker-1");
    ASSERT_STREQ(g.fn_name, "mod.fn");
    ASSERT_EQ_U64(g.switches, 0);
    ASSERT_EQ_I64(g.wall_ns, 0);
    ASSERT_EQ_U64(g.finished, 0);
    ASSERT_RC(gqp_profile_greenlet(p, 1, &g), GQP_ERANGE);
    /* naming again updates the same entry */
    ASSERT_OK(gqp_profile_name_greenlet(p, 77, "worker-2", "mod.fn2"));
    ASSERT_EQ_SIZE(gqp_profile_greenlet_count(p), 1);
    GET_GREENLET(p, 77, &g);
    ASSERT_STREQ(g.name, "worker-2");
    ASSERT_STREQ(g.fn_name, "mod.fn2");
    /* huge ids are fine */
    ASSERT_OK(gqp_profile_name_greenlet(p, UINT64_MAX, "max", NULL));
    GET_GREENLET(p, UINT64_MAX, &g);
    ASSERT_STREQ(g.name, "max");
    ASSERT_STREQ(g.fn_name, "");
    gqp_profile_free(p);
}

TEST(name_greenlet_null_leaves_unchanged)
{
    gqp_profile *p = new_profile();
    gqp_greenlet_stat g;
    ASSERT_OK(gqp_profile_name_greenlet(p, 5, "alpha", "fa"));
    ASSERT_OK(gqp_profile_name_greenlet(p, 5, NULL, "fb"));
    GET_GREENLET(p, 5, &g);
    ASSERT_STREQ(g.name, "alpha");
    ASSERT_STREQ(g.fn_name, "fb");
    ASSERT_OK(gqp_profile_name_greenlet(p, 5, "beta", NULL));
    GET_GREENLET(p, 5, &g);
    ASSERT_STREQ(g.name, "beta");
    ASSERT_STREQ(g.fn_name, "fb");
    ASSERT_OK(gqp_profile_name_greenlet(p, 5, NULL, NULL));
    GET_GREENLET(p, 5, &g);
    ASSERT_STREQ(g.name, "beta");
    ASSERT_STREQ(g.fn_name, "fb");
    /* "" is a name, not "unchanged" */
    ASSERT_OK(gqp_profile_name_greenlet(p, 5, "", NULL));
    GET_GREENLET(p, 5, &g);
    ASSERT_STREQ(g.name, "");
    ASSERT_STREQ(g.fn_name, "fb");
    /* an entry created with NULL names has "" names */
    ASSERT_OK(gqp_profile_name_greenlet(p, 6, NULL, NULL));
    GET_GREENLET(p, 6, &g);
    ASSERT_STREQ(g.name, "");
    ASSERT_STREQ(g.fn_name, "");
    gqp_profile_free(p);
}

TEST(name_greenlet_copies_strings)
{
    gqp_profile *p = new_profile();
    gqp_greenlet_stat g;
    char *name = malloc(16), *fn = malloc(16);
    ASSERT_NOT_NULL(name);
    ASSERT_NOT_NULL(fn);
    strcpy(name, "copied");
    strcpy(fn, "fn.copied");
    ASSERT_OK(gqp_profile_name_greenlet(p, 9, name, fn));
    memset(name, 'X', 15);
    memset(fn, 'Y', 15);
    free(name); /* ASan would flag a kept pointer */
    free(fn);
    GET_GREENLET(p, 9, &g);
    ASSERT_STREQ(g.name, "copied");
    ASSERT_STREQ(g.fn_name, "fn.copied");
    gqp_profile_free(p);
}

TEST(name_greenlet_truncates_to_max_name)
{
    gqp_profile *p = new_profile();
    gqp_greenlet_stat g;
    ASSERT_OK(gqp_profile_set(p, GQP_PROFILE_MAX_NAME, 4));
    ASSERT_OK(gqp_profile_name_greenlet(p, 1, "abcdefgh", "0123456789"));
    GET_GREENLET(p, 1, &g);
    ASSERT_STREQ(g.name, "abcd");
    ASSERT_STREQ(g.fn_name, "0123");
    ASSERT_OK(gqp_profile_name_greenlet(p, 2, "wxyz", "abc"));
    GET_GREENLET(p, 2, &g);
    ASSERT_STREQ(g.name, "wxyz");
    ASSERT_STREQ(g.fn_name, "abc");
    gqp_profile_free(p);

    p = new_profile();
    ASSERT_OK(gqp_profile_set(p, GQP_PROFILE_MAX_NAME, 0));
    ASSERT_OK(gqp_profile_name_greenlet(p, 1, "abc", "def"));
    GET_GREENLET(p, 1, &g);
    ASSERT_STREQ(g.name, "");
    ASSERT_STREQ(g.fn_name, "");
    gqp_profile_free(p);
}

TEST(name_greenlet_default_max_name_255)
{
    gqp_profile *p = new_profile();
    gqp_greenlet_stat g;
    char longname[400];
    memset(longname, 'n', sizeof longname - 1);
    longname[sizeof longname - 1] = '\0';
    longname[0] = 'A';
    longname[254] = 'Z';
    ASSERT_OK(gqp_profile_name_greenlet(p, 3, longname, longname));
    GET_GREENLET(p, 3, &g);
    ASSERT_EQ_SIZE(strlen(g.name), 255);
    ASSERT_EQ_SIZE(strlen(g.fn_name), 255);
    ASSERT_TRUE(g.name[0] == 'A' && g.name[254] == 'Z');
    ASSERT_TRUE(strncmp(g.name, longname, 255) == 0);
    gqp_profile_free(p);
}

TEST(name_greenlet_rejects_zero_id_and_null)
{
    gqp_profile *p = new_profile();
    ASSERT_RC(gqp_profile_name_greenlet(p, 0, "x", "y"), GQP_EINVAL);
    ASSERT_RC(gqp_profile_name_greenlet(NULL, 1, "x", "y"), GQP_EINVAL);
    ASSERT_EQ_SIZE(gqp_profile_greenlet_count(p), 0);
    gqp_profile_free(p);
}

TEST(name_greenlet_respects_max_greenlets)
{
    gqp_profile *p = new_profile();
    gqp_greenlet_stat g;
    ASSERT_OK(gqp_profile_set(p, GQP_PROFILE_MAX_GREENLETS, 2));
    ASSERT_OK(gqp_profile_name_greenlet(p, 1, "one", NULL));
    ASSERT_OK(gqp_profile_name_greenlet(p, 2, "two", NULL));
    ASSERT_RC(gqp_profile_name_greenlet(p, 3, "three", NULL), GQP_ELIMIT);
    ASSERT_EQ_SIZE(gqp_profile_greenlet_count(p), 2);
    ASSERT_FALSE(find_greenlet(p, 3, &g));
    /* existing entries can still be renamed */
    ASSERT_OK(gqp_profile_name_greenlet(p, 2, "deux", NULL));
    GET_GREENLET(p, 2, &g);
    ASSERT_STREQ(g.name, "deux");
    gqp_profile_free(p);
}

/* A greenlet named before it runs keeps its name and gets its totals. */
TEST(name_greenlet_then_spans_share_entry)
{
    fake_clock c;
    gqp_profile *p;
    gqp_greenlet_stat g;
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU, &p);
    EV(gqp_tracer_switch(t, 0, KH, 0));
    EV(gqp_tracer_switch(t, KH, KG, 0));
    uint64_t id = gid(t, KG);
    ASSERT_OK(gqp_profile_name_greenlet(p, id, "main", "run"));
    fc_run(&c, 30);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    GET_GREENLET(p, id, &g);
    ASSERT_STREQ(g.name, "main");
    ASSERT_STREQ(g.fn_name, "run");
    ASSERT_EQ_I64(g.wall_ns, 30);
    ASSERT_EQ_U64(g.switches, 1);
    /* an unnamed greenlet has "" names, never NULL */
    fc_run(&c, 3);
    EV(gqp_tracer_switch(t, KH, KG, 0));
    GET_GREENLET(p, gid(t, KH), &g);
    ASSERT_STREQ(g.name, "");
    ASSERT_STREQ(g.fn_name, "");
    gqp_tracer_free(t);
    gqp_profile_free(p);
}

/* After a clear the profile holds no data again.  Whether caps may then be
 * changed is not spelled out; if the library accepts the change, the new
 * caps must work.  (Found by fuzz_api: KEEP_LAST with a smaller cap after a
 * clear returned uninitialised spans.) */
TEST(profile_caps_changed_after_clear)
{
    fake_clock c;
    gqp_profile *p;
    uint64_t keys[2] = {KG, KH};
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU, &p);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    fc_run(&c, 1);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_OK(gqp_profile_clear(p));
    int rc1 = gqp_profile_set(p, GQP_PROFILE_SPAN_POLICY, GQP_KEEP_LAST);
    int rc2 = gqp_profile_set(p, GQP_PROFILE_MAX_SPANS, 2);
    ASSERT_RC2(rc1, GQP_OK, GQP_ESTATE);
    ASSERT_RC2(rc2, GQP_OK, GQP_ESTATE);
    int64_t cap = 0, pol = 0;
    ASSERT_OK(gqp_profile_get(p, GQP_PROFILE_MAX_SPANS, &cap));
    ASSERT_OK(gqp_profile_get(p, GQP_PROFILE_SPAN_POLICY, &pol));
    for (int i = 0; i < 5; i++) {
        fc_run(&c, 10 + i); /* span i lasts 10 + i */
        EV(gqp_tracer_switch(t, keys[(i + 1) % 2], keys[i % 2], 0));
    }
    size_t n = gqp_profile_span_count(p);
    ASSERT_EQ_U64(n, cap < 5 ? (uint64_t)cap : 5);
    ASSERT_EQ_U64(n + gqp_profile_spans_dropped(p), 5);
    for (size_t i = 0; i < n; i++) {
        gqp_span s = get_span(p, i);
        int64_t expect = pol == GQP_KEEP_LAST ? 10 + (int64_t)(5 - n + i)
                                              : 10 + (int64_t)i;
        ASSERT_EQ_I64(s.end_ns - s.start_ns, expect);
        ASSERT_EQ_I64(s.cpu_ns, expect);
        ASSERT_TRUE(s.greenlet_id == gid(t, KG) || s.greenlet_id == gid(t, KH));
    }
    gqp_tracer_free(t);
    gqp_profile_free(p);
}
