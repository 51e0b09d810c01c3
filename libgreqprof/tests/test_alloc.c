/* test_alloc.c -- gqp_set_allocator: every allocation goes through it, and
 * injected allocation failures give GQP_ENOMEM with nothing changed. */
#include <stdlib.h>

#include "harness.h"
#include "testutil.h"

#define CA_MAGIC UINT64_C(0x6771706d656d2121)

typedef struct counting_alloc {
    long live;       /* blocks handed out and not freed */
    long total;      /* allocation requests (malloc + growing reallocs) */
    long fail_at;    /* fail request number fail_at (1-based); 0 = never */
    long fail_from;  /* fail every request from this number on; 0 = never */
    long failures;
    long bad_frees;  /* frees of blocks we did not hand out */
} counting_alloc;

/* Each block carries a header so frees of foreign memory are caught. */
typedef struct ca_hdr {
    uint64_t magic;
    uint64_t size;
} ca_hdr;

static int ca_should_fail(counting_alloc *a)
{
    a->total++;
    if ((a->fail_at && a->total == a->fail_at) ||
        (a->fail_from && a->total >= a->fail_from)) {
        a->failures++;
        return 1;
    }
    return 0;
}

static void *ca_malloc(void *ctx, size_t n)
{
    counting_alloc *a = ctx;
    ca_hdr *h;
    if (ca_should_fail(a))
        return NULL;
    h = malloc(sizeof *h + n);
    if (h == NULL)
        return NULL;
    h->magic = CA_MAGIC;
    h->size = n;
    a->live++;
    return h + 1;
}

static void *ca_realloc(void *ctx, void *ptr, size_t n)
{
    counting_alloc *a = ctx;
    ca_hdr *h, *nh;
    if (ptr == NULL)
        return ca_malloc(ctx, n);
    h = (ca_hdr *)ptr - 1;
    if (h->magic != CA_MAGIC) {
        a->bad_frees++;
        return NULL;
    }
    if (ca_should_fail(a))
        return NULL; /* the old block stays valid */
    nh = realloc(h, sizeof *nh + n);
    if (nh == NULL)
        return NULL;
    nh->size = n;
    return nh + 1;
}

static void ca_free(void *ctx, void *ptr)
{
    counting_alloc *a = ctx;
    ca_hdr *h;
    if (ptr == NULL)
        return;
    h = (ca_hdr *)ptr - 1;
    if (h->magic != CA_MAGIC) {
        a->bad_frees++;
        return;
    }
    h->magic = 0;
    a->live--;
    free(h);
}

static void ca_install(counting_alloc *a)
{
    gqp_allocator al;
    memset(a, 0, sizeof *a);
    al.malloc_fn = ca_malloc;
    al.realloc_fn = ca_realloc;
    al.free_fn = ca_free;
    al.ctx = a;
    ASSERT_OK(gqp_set_allocator(&al));
}

/* rc is `expected` or GQP_ENOMEM. */
#define ASSERT_OR_ENOMEM(rc, expected)                                      \
    do {                                                                    \
        int hr2_ = (rc);                                                    \
        if (hr2_ != (expected) && hr2_ != GQP_ENOMEM)                       \
            FAIL("%s: got %d %s, expected %s or GQP_ENOMEM", #rc, hr2_,     \
                 gqp_err_name(hr2_), #expected);                            \
    } while (0)

/* An event result: flags (>= 0) or GQP_ENOMEM.  (Event functions may also
 * report a failed allocation as GQP_EV_DROPPED: data dropped, event done.) */
#define ASSERT_EV_OR_ENOMEM(rc)                                             \
    do {                                                                    \
        int hr2_ = (rc);                                                    \
        if (hr2_ < 0 && hr2_ != GQP_ENOMEM)                                 \
            FAIL("%s: got %d %s", #rc, hr2_, gqp_err_name(hr2_));           \
    } while (0)

/*
 * A scenario touching every allocating path: profiles, tracer, greenlets
 * (table growth), spans (array growth, both policies), names, functions and
 * edges, deep stacks, attach/inherit/spawn, history and waited, flush.
 * Without failures every call succeeds; with failures every call must
 * succeed or return GQP_ENOMEM.  Returns the number of ENOMEM results.
 */
static int scenario(void)
{
    fake_clock c;
    gqp_profile *p = NULL, *q = NULL;
    gqp_tracer *t = NULL;
    int enomem = 0, rc;
    fc_init(&c);

#define COUNT(expr) (rc = (expr), enomem += (rc == GQP_ENOMEM), rc)
    if (COUNT(gqp_profile_new(&p)) != GQP_OK)
        return enomem;
    if (COUNT(gqp_profile_new(&q)) != GQP_OK) {
        gqp_profile_free(p);
        return enomem;
    }
    ASSERT_OK(gqp_profile_set(q, GQP_PROFILE_SPAN_POLICY, GQP_KEEP_LAST));
    ASSERT_OK(gqp_profile_set(q, GQP_PROFILE_MAX_SPANS, 40));
    if (COUNT(gqp_tracer_new(&t)) != GQP_OK) {
        gqp_profile_free(p);
        gqp_profile_free(q);
        return enomem;
    }
    ASSERT_OR_ENOMEM(COUNT(gqp_tracer_set_clocks(t, fake_wall_fn,
                                                 fake_cpu_fn, &c)),
                     GQP_OK);
    ASSERT_OR_ENOMEM(COUNT(gqp_tracer_set(t, GQP_TRACER_HISTORY, 16)),
                     GQP_OK);
    ASSERT_OR_ENOMEM(COUNT(gqp_tracer_set_default(t, p)), GQP_OK);
    /* (p also sees q's greenlets: their session stacks are allocated) */
    ASSERT_OK(gqp_tracer_set_session(t, p));

    uint64_t prev = 0;
    for (uint64_t k = 1; k <= 40; k++) {
        uint64_t key = k * 0x100;
        rc = COUNT(gqp_tracer_switch(t, prev, key, 0));
        ASSERT_EV_OR_ENOMEM(rc);
        /* a dropped switch may leave nothing running */
        if (gqp_tracer_current(t, &prev, NULL, NULL) != GQP_OK)
            prev = 0;
        if (prev == 0)
            continue;
        fc_run(&c, (int64_t)k);
        for (uint64_t f = 0; f < 6; f++)
            ASSERT_EV_OR_ENOMEM(COUNT(gqp_tracer_call(t, FA + f + k % 7)));
        for (uint64_t f = 0; f < 6; f++)
            ASSERT_EV_OR_ENOMEM(COUNT(gqp_tracer_return(t)));
        if (k % 5 == 0)
            ASSERT_OR_ENOMEM(COUNT(gqp_tracer_attach(t, prev, q)), GQP_OK);
        if (k % 7 == 0) {
            rc = COUNT(gqp_tracer_inherit(t, key + 1, prev));
            ASSERT_OR_ENOMEM(rc, GQP_OK);
            rc = COUNT(gqp_tracer_set_spawn_profile(t, prev, p));
            ASSERT_OR_ENOMEM(rc, GQP_OK);
        }
        if (k % 3 == 0) {
            uint64_t id = 0;
            if (gqp_tracer_greenlet_id(t, prev, &id) == GQP_OK)
                ASSERT_OR_ENOMEM(COUNT(gqp_profile_name_greenlet(
                                     p, id, "a-greenlet-name", "fn.name")),
                                 GQP_OK);
        }
        if (k % 11 == 0 && prev != 0) {
            rc = COUNT(gqp_tracer_switch(t, prev, key + 7,
                                         GQP_SWITCH_FROM_DEAD));
            ASSERT_EV_OR_ENOMEM(rc);
            if (gqp_tracer_current(t, &prev, NULL, NULL) != GQP_OK)
                prev = 0;
        }
    }
    /* deep recursion grows the stack */
    for (int d = 0; d < 300; d++)
        ASSERT_EV_OR_ENOMEM(COUNT(gqp_tracer_call(t, FE)));
    for (int d = 0; d < 300; d++)
        ASSERT_EV_OR_ENOMEM(COUNT(gqp_tracer_return(t)));
    {
        uint64_t ids[4];
        int64_t ns[4], total;
        int complete;
        rc = COUNT(gqp_tracer_waited(t, p, W0, c.wall, &total, ids, ns, 4,
                                     &complete));
        ASSERT_TRUE(rc >= 0 || rc == GQP_ENOMEM);
    }
    ASSERT_OR_ENOMEM(COUNT(gqp_tracer_flush(t)), GQP_OK);
    ASSERT_OR_ENOMEM(COUNT(gqp_profile_clear(q)), GQP_OK);
    gqp_profile_free(q); /* the tracer may still hold it */
    gqp_tracer_free(t);
    gqp_profile_free(p);
#undef COUNT
    return enomem;
}

TEST(allocator_routes_every_allocation)
{
    counting_alloc a;
    ca_install(&a);
    ASSERT_EQ_I64(scenario(), 0);
    ASSERT_GT_I64(a.total, 10);
    ASSERT_EQ_I64(a.live, 0);
    ASSERT_EQ_I64(a.bad_frees, 0);
    ASSERT_OK(gqp_set_allocator(NULL));
    /* back on malloc: still works */
    ASSERT_EQ_I64(scenario(), 0);
    ASSERT_EQ_I64(a.total > 0, 1);
}

TEST(allocator_rejects_incomplete)
{
    counting_alloc a;
    gqp_allocator al = {ca_malloc, ca_realloc, ca_free, &a};
    al.malloc_fn = NULL;
    ASSERT_RC(gqp_set_allocator(&al), GQP_EINVAL);
    al.malloc_fn = ca_malloc;
    al.realloc_fn = NULL;
    ASSERT_RC(gqp_set_allocator(&al), GQP_EINVAL);
    al.realloc_fn = ca_realloc;
    al.free_fn = NULL;
    ASSERT_RC(gqp_set_allocator(&al), GQP_EINVAL);
    ASSERT_OK(gqp_set_allocator(NULL));
}

/* Fail each allocation of the scenario in turn: every call succeeds or
 * returns GQP_ENOMEM, nothing crashes, nothing leaks. */
TEST(allocator_failure_sweep)
{
    counting_alloc a;
    long clean_total;
    ca_install(&a);
    ASSERT_EQ_I64(scenario(), 0);
    clean_total = a.total;
    ASSERT_EQ_I64(a.live, 0);
    for (long k = 1; k <= clean_total + 2; k++) {
        ca_install(&a);
        a.fail_at = k;
        scenario();
        if (a.live != 0 || a.bad_frees != 0)
            FAIL("failing allocation %ld of %ld: %ld blocks leaked, %ld bad "
                 "frees", k, clean_total, a.live, a.bad_frees);
        if (k <= clean_total)
            ASSERT_EQ_I64(a.failures, 1);
    }
    ASSERT_OK(gqp_set_allocator(NULL));
}

/* Everything fails from some point on (out of memory for good). */
TEST(allocator_failure_from_sweep)
{
    counting_alloc a;
    long clean_total;
    ca_install(&a);
    ASSERT_EQ_I64(scenario(), 0);
    clean_total = a.total;
    for (long k = 1; k <= clean_total + 1; k += (k < 50 ? 1 : 7)) {
        ca_install(&a);
        a.fail_from = k;
        scenario();
        if (a.live != 0 || a.bad_frees != 0)
            FAIL("failing from allocation %ld: %ld blocks leaked, %ld bad "
                 "frees", k, a.live, a.bad_frees);
    }
    ASSERT_OK(gqp_set_allocator(NULL));
}

/* ---- "ENOMEM: an allocation failed; nothing was changed" ---------------- */

typedef struct snap {
    int cur_rc;
    uint64_t cur_key, cur_id;
    int64_t since;
    size_t live, spans, funcs, edges, greenlets;
    uint64_t spans_dropped, calls_dropped;
    gqp_span last;
    int last_rc;
} snap;

static snap take(const gqp_tracer *t, const gqp_profile *p)
{
    snap s;
    memset(&s, 0, sizeof s);
    s.cur_rc = gqp_tracer_current(t, &s.cur_key, &s.cur_id, NULL);
    if (s.cur_rc == GQP_OK)
        ASSERT_OK(gqp_tracer_running_since(t, &s.since, NULL));
    s.live = gqp_tracer_greenlet_count(t);
    s.spans = gqp_profile_span_count(p);
    s.funcs = gqp_profile_func_count(p);
    s.edges = gqp_profile_edge_count(p);
    s.greenlets = gqp_profile_greenlet_count(p);
    s.spans_dropped = gqp_profile_spans_dropped(p);
    s.calls_dropped = gqp_profile_calls_dropped(p);
    s.last_rc = gqp_tracer_last_span(t, &s.last, NULL, NULL);
    return s;
}

static void same(const snap *a, const snap *b)
{
    ASSERT_EQ_I64(a->cur_rc, b->cur_rc);
    ASSERT_EQ_U64(a->cur_key, b->cur_key);
    ASSERT_EQ_U64(a->cur_id, b->cur_id);
    ASSERT_EQ_I64(a->since, b->since);
    ASSERT_EQ_SIZE(a->live, b->live);
    ASSERT_EQ_SIZE(a->spans, b->spans);
    ASSERT_EQ_SIZE(a->funcs, b->funcs);
    ASSERT_EQ_SIZE(a->edges, b->edges);
    ASSERT_EQ_SIZE(a->greenlets, b->greenlets);
    ASSERT_EQ_U64(a->spans_dropped, b->spans_dropped);
    ASSERT_EQ_U64(a->calls_dropped, b->calls_dropped);
    ASSERT_EQ_I64(a->last_rc, b->last_rc);
    if (a->last_rc == GQP_OK) {
        ASSERT_EQ_I64(a->last.start_ns, b->last.start_ns);
        ASSERT_EQ_I64(a->last.end_ns, b->last.end_ns);
        ASSERT_EQ_U64(a->last.greenlet_id, b->last.greenlet_id);
    }
}

/* A switch that needs memory either fails with GQP_ENOMEM and changes
 * nothing, or (events never lose the interpreter's state) completes with
 * GQP_EV_DROPPED: the origin's span is closed and the target is not
 * tracked. */
TEST(enomem_switch_changes_nothing)
{
    counting_alloc a;
    fake_clock c;
    gqp_profile *p;
    int hit = 0;
    ca_install(&a);
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU, &p);
    EV(gqp_tracer_switch(t, 0, 1, 0));
    uint64_t prev = 1, id;
    a.fail_from = a.total + 1; /* out of memory from now on */
    for (uint64_t k = 2; k < 5000 && !hit; k++) {
        fc_run(&c, 3);
        snap before = take(t, p);
        int rc = gqp_tracer_switch(t, prev, k, 0);
        if (rc == GQP_ENOMEM) {
            snap after = take(t, p);
            same(&before, &after);
            hit = 1;
        } else if (rc >= 0 && (rc & GQP_EV_DROPPED)) {
            snap after = take(t, p);
            hit = 2;
            ASSERT_NO_FLAG(rc, GQP_EV_NEW_GREENLET);
            ASSERT_EQ_SIZE(after.live, before.live);
            ASSERT_RC(gqp_tracer_greenlet_id(t, k, &id), GQP_ENOTFOUND);
            /* the origin's span was closed (kept or counted as dropped) */
            ASSERT_EQ_I64(after.last_rc, GQP_OK);
            ASSERT_EQ_I64(after.last.end_ns, c.wall);
            ASSERT_EQ_U64(after.spans + after.spans_dropped,
                          before.spans + before.spans_dropped + 1);
            /* whatever runs now is consistent */
            uint64_t key = 0;
            if (gqp_tracer_current(t, &key, &id, NULL) == GQP_OK)
                ASSERT_EQ_U64(gid(t, key), id);
        } else {
            ASSERT_TRUE(rc >= 0);
            prev = k;
        }
    }
    ASSERT_TRUE(hit); /* some switch needed memory */
    /* memory is back: a new greenlet can be tracked again */
    a.fail_from = 0;
    uint64_t cur = 0;
    if (gqp_tracer_current(t, &cur, NULL, NULL) != GQP_OK)
        cur = 0;
    int rc = EV(gqp_tracer_switch(t, cur, 99999, 0));
    ASSERT_HAS_FLAG(rc, GQP_EV_NEW_GREENLET);
    gqp_tracer_free(t);
    gqp_profile_free(p);
    ASSERT_EQ_I64(a.live, 0);
    ASSERT_OK(gqp_set_allocator(NULL));
}

/* gqp_tracer_waited over more greenlets than its table on the stack holds
 * needs memory: without it, GQP_ENOMEM and nothing leaked; with it, the
 * answer. */
TEST(enomem_waited_many_greenlets)
{
    counting_alloc a;
    fake_clock c;
    gqp_profile *p;
    uint64_t ids[2];
    int64_t ns[2], total = -1;
    ca_install(&a);
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU, &p);
    EV(gqp_tracer_switch(t, 0, 1, 0));
    uint64_t prev = 1;
    for (uint64_t k = 2; k < 400; k++) {
        fc_run(&c, 1);
        EV(gqp_tracer_switch(t, prev, k, 0));
        prev = k;
    }
    fc_run(&c, 1);
    a.fail_from = a.total + 1;
    ASSERT_RC(gqp_tracer_waited(t, NULL, W0, c.wall, &total, ids, ns, 2,
                                NULL), GQP_ENOMEM);
    ASSERT_EQ_I64(total, -1);
    a.fail_from = 0;
    ASSERT_EQ_I64(gqp_tracer_waited(t, NULL, W0, c.wall, &total, ids, ns, 2,
                                    NULL), 2);
    ASSERT_EQ_I64(total, 398);
    gqp_tracer_free(t);
    gqp_profile_free(p);
    ASSERT_EQ_I64(a.live, 0);
    ASSERT_OK(gqp_set_allocator(NULL));
}

/* A call that needs memory fails with GQP_ENOMEM changing nothing, or is
 * dropped (GQP_EV_DROPPED, counted in calls_dropped) with its return still
 * matched, so the enclosing frame's times stay right. */
TEST(enomem_call_changes_nothing)
{
    counting_alloc a;
    fake_clock c;
    gqp_profile *p;
    int hit = 0;
    ca_install(&a);
    fc_init(&c);
    gqp_tracer *t = new_tracer_profile(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU, &p);
    EV(gqp_tracer_switch(t, 0, KG, 0));
    int64_t cpu0 = c.cpu;
    EV(gqp_tracer_call(t, FA)); /* the outer frame */
    a.fail_from = a.total + 1;
    for (uint64_t f = 1; f < 5000 && !hit; f++) {
        snap before = take(t, p);
        int rc = gqp_tracer_call(t, 0x10000 + f); /* a new function */
        if (rc == GQP_ENOMEM) {
            snap after = take(t, p);
            same(&before, &after);
            hit = 1;
        } else {
            ASSERT_TRUE(rc >= 0);
            if (rc & GQP_EV_DROPPED) {
                hit = 2;
                ASSERT_EQ_U64(gqp_profile_calls_dropped(p),
                              before.calls_dropped + 1);
            }
            fc_run(&c, 1);
            EV(gqp_tracer_return(t));
        }
    }
    ASSERT_TRUE(hit);
    a.fail_from = 0;
    /* the stack is intact: the next return closes FA */
    fc_run(&c, 5);
    EV(gqp_tracer_return(t));
    gqp_func_stat fa;
    GET_FUNC(p, FA, &fa);
    ASSERT_EQ_U64(fa.ncall, 1);
    ASSERT_EQ_I64(fa.ttot_ns, c.cpu - cpu0);
    gqp_tracer_free(t);
    gqp_profile_free(p);
    ASSERT_EQ_I64(a.live, 0);
    ASSERT_OK(gqp_set_allocator(NULL));
}

TEST(enomem_new_objects)
{
    counting_alloc a;
    gqp_profile *q = NULL;
    gqp_tracer *t = NULL;
    ca_install(&a);
    a.fail_from = 1;
    ASSERT_RC(gqp_profile_new(&q), GQP_ENOMEM);
    ASSERT_RC(gqp_tracer_new(&t), GQP_ENOMEM);
    /* a failure at any later allocation of the constructors */
    for (long k = 1; k < 40; k++) {
        ca_install(&a);
        a.fail_at = k;
        q = NULL;
        t = NULL;
        int rc = gqp_profile_new(&q);
        ASSERT_OR_ENOMEM(rc, GQP_OK);
        if (rc == GQP_OK)
            gqp_profile_free(q);
        rc = gqp_tracer_new(&t);
        ASSERT_OR_ENOMEM(rc, GQP_OK);
        if (rc == GQP_OK)
            gqp_tracer_free(t);
        ASSERT_EQ_I64(a.live, 0);
    }
    ASSERT_OK(gqp_set_allocator(NULL));
}

/* name_greenlet failing at its k-th allocation must change nothing:
 * renaming an existing entry... */
TEST(enomem_rename_greenlet_changes_nothing)
{
    counting_alloc a;
    gqp_profile *p = NULL;
    gqp_greenlet_stat g;
    ca_install(&a);
    ASSERT_OK(gqp_profile_new(&p));
    ASSERT_OK(gqp_profile_name_greenlet(p, 5, "first", "fn"));
    for (long k = 1; k <= 4; k++) {
        a.fail_at = a.total + k;
        int rc = gqp_profile_name_greenlet(p, 5, "second", "fn2");
        a.fail_at = 0;
        ASSERT_OR_ENOMEM(rc, GQP_OK);
        GET_GREENLET(p, 5, &g);
        if (rc == GQP_ENOMEM) {
            ASSERT_STREQ(g.name, "first");
            ASSERT_STREQ(g.fn_name, "fn");
        } else {
            ASSERT_STREQ(g.name, "second");
            ASSERT_STREQ(g.fn_name, "fn2");
            ASSERT_OK(gqp_profile_name_greenlet(p, 5, "first", "fn"));
        }
    }
    gqp_profile_free(p);
    ASSERT_EQ_I64(a.live, 0);
    ASSERT_OK(gqp_set_allocator(NULL));
}

/* ... and naming a new greenlet: no half-made entry is left behind. */
TEST(enomem_name_new_greenlet_changes_nothing)
{
    counting_alloc a;
    gqp_profile *p = NULL;
    ca_install(&a);
    ASSERT_OK(gqp_profile_new(&p));
    ASSERT_OK(gqp_profile_name_greenlet(p, 5, "first", "fn"));
    for (long k = 1; k <= 4; k++) {
        size_t n = gqp_profile_greenlet_count(p);
        a.fail_at = a.total + k;
        int rc = gqp_profile_name_greenlet(p, 100 + (uint64_t)k, "x", "y");
        a.fail_at = 0;
        ASSERT_OR_ENOMEM(rc, GQP_OK);
        if (rc == GQP_ENOMEM) {
            ASSERT_EQ_SIZE(gqp_profile_greenlet_count(p), n);
            ASSERT_FALSE(find_greenlet(p, 100 + (uint64_t)k, NULL));
        } else {
            ASSERT_EQ_SIZE(gqp_profile_greenlet_count(p), n + 1);
        }
    }
    gqp_profile_free(p);
    ASSERT_EQ_I64(a.live, 0);
    ASSERT_OK(gqp_set_allocator(NULL));
}

/* The first wait sites and events of a profile live inside it: no
 * allocation.  Past them, gqp_tracer_wait_at needs memory for a new site:
 * without it, GQP_ENOMEM, no site, no charge, nothing leaked; with it
 * again, the next wait is recorded.  An event that finds no memory is
 * counted as dropped. */
TEST(enomem_wait_at_changes_nothing)
{
    counting_alloc a;
    fake_clock c;
    ca_install(&a);
    fc_init(&c);
    gqp_tracer *t = new_tracer(&c, GQP_CPU_EXACT, GQP_CLOCK_CPU);
    gqp_profile *p = new_profile();
    EV(gqp_tracer_switch(t, 0, KG, 0));
    ASSERT_OK(gqp_tracer_attach(t, KG, p));
    EV(gqp_tracer_switch(t, KG, KH, 0));
    EV(gqp_tracer_switch(t, KH, KG, 0));
    long before = a.total;
    for (uint64_t k = 1; k <= 4; k++) {
        EV(gqp_tracer_switch(t, KG, KH, 0));
        ASSERT_HAS_FLAG(EV(gqp_tracer_wait_at(t, KG, UINT64_C(0x7700000000) + k * 16, NULL,
                                              NULL)), GQP_EV_NEW_SITE);
        fc_idle(&c, 1);
        EV(gqp_tracer_switch(t, KH, KG, 0));
    }
    ASSERT_EQ_I64(a.total, before); /* (inside the profile) */
    ASSERT_EQ_SIZE(gqp_profile_wait_count(p), 4);
    EV(gqp_tracer_switch(t, KG, KH, 0));
    a.fail_from = a.total + 1;
    ASSERT_RC(gqp_tracer_wait_at(t, KG, UINT64_C(0x7800000000), NULL, NULL), GQP_ENOMEM);
    ASSERT_EQ_SIZE(gqp_profile_wait_count(p), 4);
    fc_idle(&c, 100);
    EV(gqp_tracer_switch(t, KH, KG, 0));
    ASSERT_EQ_SIZE(gqp_profile_wait_count(p), 4);
    ASSERT_EQ_SIZE(gqp_profile_wait_event_count(p), 4);
    /* the next allocations fail one at a time */
    for (long k = 1; k <= 3; k++) {
        a.fail_from = 0;
        a.fail_at = a.total + k;
        EV(gqp_tracer_switch(t, KG, KH, 0));
        int rc = gqp_tracer_wait_at(t, KG, UINT64_C(0x7900000000) + (uint64_t)k * 16, NULL, NULL);
        if (rc != GQP_ENOMEM && rc != GQP_EV_NEW_SITE)
            FAIL("wait_at = %d (k=%ld)", rc, k);
        EV(gqp_tracer_switch(t, KH, KG, 0));
    }
    /* events past the inline ones need memory too */
    a.fail_at = 0;
    a.fail_from = a.total + 1;
    for (int k = 0; k < 8; k++) {
        EV(gqp_tracer_switch(t, KG, KH, 0));
        EV(gqp_tracer_wait_at(t, KG, UINT64_C(0x7700000010), NULL, NULL));
        EV(gqp_tracer_switch(t, KH, KG, 0));
    }
    ASSERT_TRUE(gqp_profile_wait_events_dropped(p) > 0);
    ASSERT_EQ_U64(gqp_profile_wait_event_count(p) +
                      gqp_profile_wait_events_dropped(p),
                  4 + 3 + 8 - (7 - gqp_profile_wait_count(p)));
    a.fail_from = 0;
    EV(gqp_tracer_switch(t, KG, KH, 0));
    ASSERT_HAS_FLAG(EV(gqp_tracer_wait_at(t, KG, UINT64_C(0x7a00000000), NULL, NULL)),
                    GQP_EV_NEW_SITE);
    fc_idle(&c, 7);
    EV(gqp_tracer_switch(t, KH, KG, 0));
    gqp_wait_stat w;
    ASSERT_OK(gqp_profile_wait(p, gqp_profile_wait_count(p) - 1, &w));
    ASSERT_EQ_U64(w.site, UINT64_C(0x7a00000000));
    ASSERT_EQ_I64(w.wait_ns, 7);
    ASSERT_EQ_U64(w.count, 1);
    gqp_tracer_free(t);
    gqp_profile_free(p);
    ASSERT_EQ_I64(a.live, 0);
    ASSERT_EQ_I64(a.bad_frees, 0);
    ASSERT_OK(gqp_set_allocator(NULL));
}
