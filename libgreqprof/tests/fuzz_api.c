/*
 * fuzz_api.c -- libFuzzer target for the libgreqprof API.
 *
 * The input is a program: byte 0 configures the run, then each operation is
 * an opcode byte followed by the argument bytes it reads (missing bytes read
 * as 0).  Operations drive up to two tracers (each on its own monotonic fake
 * clock) and three profiles: switches among 64 greenlet keys (including huge
 * ones and, rarely, the invalid key 0), calls/returns in any order,
 * attach/detach/inherit, profile close/clear/replace, flush, forget,
 * parameter changes (tiny caps to force overflow), names, tags, waited,
 * spawn profiles, wait sites (gqp_tracer_wait_at), and injected allocation
 * failures (gqp_set_allocator).
 * After every operation cheap invariants are checked, and every 32
 * operations (and at the end) every span, greenlet, function and edge of
 * every profile is read back and checked:
 *
 *   counts <= caps; spans: id != 0, end_ns >= start_ns, cpu_ns >= -1,
 *   known flags only; the longest span is at least as long as every kept
 *   one; greenlets: first_ns <= last_ns, wall_ns <= last_ns - first_ns,
 *   names non-NULL and within MAX_NAME; functions/edges: non-zero keys,
 *   nactual <= ncall, times >= 0; tracer: current/greenlet_id/running_since
 *   agree; last_span after a switch matches the span stored at its index;
 *   waited: entries <= n, sorted, non-zero ids, sum <= total <= interval;
 *   wait sites: count <= cap, distinct non-zero keys, times >= 0,
 *   greenlets <= count; a new site's index reads back its key;
 *   gqp_profile_attached <= live greenlets of all tracers; calls that must
 *   succeed may only fail with GQP_ENOMEM when an allocation failed.
 *
 * A violated invariant prints a message and aborts.
 *
 * Build (libFuzzer): compile the library sources and this file with
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined -Ilibgreqprof/include
 * and run it on libgreqprof/tests/corpus (see README.md, "make fuzz").
 * Build (standalone replay, any compiler): the same sources with
 *   -DGQP_FUZZ_STANDALONE
 * then run it with files and/or directories of inputs as arguments.
 *
 * The encoding is documented next to each opcode below and mirrored by
 * gen_corpus.py.
 */
#ifdef GQP_FUZZ_STANDALONE
#define _POSIX_C_SOURCE 200809L
#endif

#include <inttypes.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "greqprof.h"

#define NKEYS 64
#define NFUNCS 16
#define NPROF 3
#define NTRACER 2
#define FULL_CHECK_EVERY 32

/* Opcodes (op byte % OP__COUNT). */
enum {
    OP_SWITCH = 0,      /* t, frommode, to, flagsbyte (%6==5: FROM_DEAD)   */
    OP_CALL = 1,        /* t, func                                         */
    OP_RETURN = 2,      /* t                                               */
    OP_RUN = 3,         /* t, amount        (on CPU: wall and cpu advance) */
    OP_IDLE = 4,        /* t, amount        (off CPU: wall advances)       */
    OP_ATTACH = 5,      /* t, key, profsel                                 */
    OP_INHERIT = 6,     /* t, child, parent                                */
    OP_CLOSE = 7,       /* profsel                                         */
    OP_CLEAR = 8,       /* profsel                                         */
    OP_FLUSH = 9,       /* t (bit 1: GQP_FLUSH_FOREIGN)                    */
    OP_FORGET = 10,     /* t, key                                          */
    OP_TSET = 11,       /* t, param, value                                 */
    OP_PSET = 12,       /* profsel, param, value                           */
    OP_DEFAULT = 13,    /* t, profsel                                      */
    OP_NAME = 14,       /* profsel, idsel, key, len, bytes..., len2, bytes */
    OP_TAG = 15,        /* profsel, index, tag                             */
    OP_WAITED = 16,     /* t, profsel, startback, len, n                   */
    OP_NEWPROF = 17,    /* profsel, maxspans, policy, tinycaps             */
    OP_RETAIN = 18,     /* profsel                                         */
    OP_NEWTRACER = 19,  /* t                                               */
    OP_CHECK = 20,      /* (full check now)                                */
    OP_CLOCKS = 21,     /* t                                               */
    OP_SPAWN = 22,      /* t, key, profsel                                 */
    OP_FAILALLOC = 23,  /* n: fail the n%32+1-th allocation from now       */
    OP_WAIT_AT = 24,    /* t, key, site(func table)                        */
    OP_SESSION = 25,    /* t, profsel                                      */
    OP__COUNT = 26
};

typedef struct fake_clock {
    int64_t wall, cpu;
} fake_clock;

typedef struct fz {
    const uint8_t *d;
    size_t n, i;
    fake_clock clk[NTRACER];
    gqp_tracer *t[NTRACER];
    /* max(cap, live count) when MAX_GREENLETS was last set */
    int64_t gl_bound[NTRACER];
    gqp_profile *p[NPROF]; /* one reference each, or NULL */
    int ntracers;
    uint64_t keys[NKEYS];
    uint64_t funcs[NFUNCS];
    unsigned ops;
    long fails0; /* g_fa.failures before the current operation */
} fz;

/* Allocation failure injection (one failure at a chosen request). */
static struct {
    long total;   /* allocation requests so far */
    long fail_at; /* request number to fail, 0 = none */
    long failures;
} g_fa;

static int fa_fail(void)
{
    g_fa.total++;
    if (g_fa.fail_at && g_fa.total == g_fa.fail_at) {
        g_fa.failures++;
        return 1;
    }
    return 0;
}

static void *fa_malloc(void *ctx, size_t n)
{
    (void)ctx;
    return fa_fail() ? NULL : malloc(n);
}

static void *fa_realloc(void *ctx, void *p, size_t n)
{
    (void)ctx;
    return fa_fail() ? NULL : realloc(p, n);
}

static void fa_free(void *ctx, void *p)
{
    (void)ctx;
    free(p);
}

/* rc is GQP_OK, or GQP_ENOMEM after an allocation failed in this op. */
#define OK_OR_OOM(z, rc)                                                    \
    ((rc) == GQP_OK ||                                                      \
     ((rc) == GQP_ENOMEM && g_fa.failures != (z)->fails0))

#define CHECK(cond, ...)                                                    \
    do {                                                                    \
        if (!(cond)) {                                                      \
            fprintf(stderr, "fuzz_api: invariant failed at %s:%d: %s\n  ",  \
                    __FILE__, __LINE__, #cond);                             \
            fprintf(stderr, __VA_ARGS__);                                   \
            fputc('\n', stderr);                                            \
            abort();                                                        \
        }                                                                   \
    } while (0)

static int64_t fk_wall(void *ctx) { return ((fake_clock *)ctx)->wall; }
static int64_t fk_cpu(void *ctx) { return ((fake_clock *)ctx)->cpu; }

static uint8_t rd(fz *z)
{
    return z->i < z->n ? z->d[z->i++] : 0;
}

static uint64_t rd_u64(fz *z)
{
    uint64_t v = 0;
    for (int k = 0; k < 8; k++)
        v = (v << 8) | rd(z);
    return v;
}

static int pick_tracer(fz *z)
{
    return (rd(z) & 1) % z->ntracers;
}

/* 255 is the invalid key 0; everything else maps to one of 64 keys. */
static uint64_t pick_key(fz *z)
{
    uint8_t b = rd(z);
    return b == 255 ? 0 : z->keys[b % NKEYS];
}

static uint64_t pick_func(fz *z)
{
    uint8_t b = rd(z);
    return b == 255 ? 0 : z->funcs[b % NFUNCS];
}

/* 0..2: a profile slot (may be NULL); 3: NULL. */
static gqp_profile *pick_prof(fz *z, int *slot)
{
    int s = rd(z) % (NPROF + 1);
    if (slot)
        *slot = s;
    return s < NPROF ? z->p[s] : NULL;
}

static int64_t pick_amount(fz *z)
{
    uint8_t b = rd(z);
    /* mostly small; the top bits choose a scale up to ~1e12 */
    static const int64_t scale[8] = {1,       10,       100,        1000,
                                     100000,  1000000,  100000000,
                                     INT64_C(1000000000)};
    return (int64_t)(b & 31) * scale[b >> 5];
}

static int64_t pick_value(fz *z)
{
    static const int64_t vals[16] = {0,   1,   2,     3,      4,
                                     7,   16,  100,   1000,   100000,
                                     -1,  255, 4096,  INT64_C(1) << 20,
                                     INT64_C(1) << 40, INT64_MAX};
    uint8_t b = rd(z);
    if (b == 0xff)
        return (int64_t)rd_u64(z);
    return vals[b % 16];
}

static void init_keys(fz *z)
{
    for (int i = 0; i < NKEYS; i++) {
        uint64_t k;
        switch (i % 8) {
        case 0: k = (uint64_t)i + 1; break;                        /* small */
        case 1: k = UINT64_MAX - (uint64_t)i;  break;              /* huge  */
        case 2: k = (UINT64_C(1) << 63) + (uint64_t)i; break;
        case 3: k = UINT64_C(0x7f0000000000) + (uint64_t)i * 0x40; break;
        case 4: k = UINT64_C(0x7f0000000000) + (uint64_t)i * 0x40 + 0x20; break;
        case 5: k = (uint64_t)i << 32; break;
        case 6: k = UINT64_C(0x5555555555555555) ^ (uint64_t)i; break;
        default: k = UINT64_C(0x100000) * (uint64_t)(i + 1); break;
        }
        z->keys[i] = k;
    }
    for (int i = 0; i < NFUNCS; i++)
        z->funcs[i] = i == 0    ? UINT64_MAX
                      : i == 1 ? 1
                               : UINT64_C(0x5500000000) + (uint64_t)i * 0x30;
}

/* ---- invariants --------------------------------------------------------- */

static int64_t pget(const gqp_profile *p, gqp_profile_param k)
{
    int64_t v = -1;
    int rc = gqp_profile_get(p, k, &v);
    CHECK(rc == GQP_OK, "profile_get(%d) = %d", (int)k, rc);
    return v;
}

static void check_profile(const gqp_profile *p)
{
    size_t n = gqp_profile_span_count(p);
    uint64_t dropped = gqp_profile_spans_dropped(p);
    int64_t max_spans = pget(p, GQP_PROFILE_MAX_SPANS);
    int64_t max_name = pget(p, GQP_PROFILE_MAX_NAME);
    int64_t longest_wall = -1, longest_cpu = -1;
    gqp_span s, l;
    int rc;

    CHECK((int64_t)n <= max_spans, "%zu spans > cap %" PRId64, n, max_spans);
    for (size_t i = 0; i < n; i++) {
        rc = gqp_profile_span(p, i, &s);
        CHECK(rc == GQP_OK, "span(%zu) = %d", i, rc);
        CHECK(s.greenlet_id != 0, "span %zu id 0", i);
        CHECK(s.end_ns >= s.start_ns, "span %zu %" PRId64 "..%" PRId64, i,
              s.start_ns, s.end_ns);
        CHECK(s.cpu_ns >= -1, "span %zu cpu %" PRId64, i, s.cpu_ns);
        CHECK((s.flags & ~(uint32_t)15) == 0, "span %zu flags %u", i, s.flags);
        CHECK(!((s.flags & GQP_SPAN_FINISHED) && (s.flags & GQP_SPAN_SPLIT)),
              "span %zu both finished and split", i);
        if (s.end_ns - s.start_ns > longest_wall)
            longest_wall = s.end_ns - s.start_ns;
        if (s.cpu_ns > longest_cpu)
            longest_cpu = s.cpu_ns;
    }
    rc = gqp_profile_span(p, n, &s);
    CHECK(rc == GQP_ERANGE, "span(count) = %d", rc);

    rc = gqp_profile_longest_span(p, &l);
    if (n + dropped > 0) {
        CHECK(rc == GQP_OK, "longest_span = %d with %zu+%" PRIu64 " spans", rc,
              n, dropped);
    } else {
        CHECK(rc == GQP_ENOTFOUND, "longest_span = %d with no span", rc);
    }
    if (rc == GQP_OK) {
        CHECK(l.end_ns >= l.start_ns, "longest span reversed");
        CHECK(l.end_ns - l.start_ns >= longest_wall,
              "longest %" PRId64 " < kept %" PRId64, l.end_ns - l.start_ns,
              longest_wall);
        CHECK(l.greenlet_id != 0, "longest id 0");
    }
    rc = gqp_profile_longest_cpu_span(p, &l);
    CHECK(rc == GQP_OK || rc == GQP_ENOTFOUND, "longest_cpu = %d", rc);
    if (rc == GQP_OK) {
        CHECK(l.cpu_ns >= longest_cpu,
              "longest cpu %" PRId64 " < kept %" PRId64, l.cpu_ns,
              longest_cpu);
        CHECK(l.end_ns >= l.start_ns, "longest cpu span reversed");
    } else {
        CHECK(longest_cpu < 0 || (n == 0 && dropped == 0),
              "longest_cpu ENOTFOUND but a span has cpu %" PRId64,
              longest_cpu);
    }

    size_t ng = gqp_profile_greenlet_count(p);
    int64_t max_gl = pget(p, GQP_PROFILE_MAX_GREENLETS);
    CHECK((int64_t)ng <= max_gl, "%zu greenlets > cap %" PRId64, ng, max_gl);
    for (size_t i = 0; i < ng; i++) {
        gqp_greenlet_stat g;
        rc = gqp_profile_greenlet(p, i, &g);
        CHECK(rc == GQP_OK, "greenlet(%zu) = %d", i, rc);
        CHECK(g.greenlet_id != 0, "greenlet %zu id 0", i);
        for (size_t j = 0; j < i && j < 64; j++) {
            gqp_greenlet_stat o;
            CHECK(gqp_profile_greenlet(p, j, &o) == GQP_OK, "greenlet(j)");
            CHECK(o.greenlet_id != g.greenlet_id,
                  "greenlet id %" PRIu64 " twice", g.greenlet_id);
        }
        CHECK(g.wall_ns >= 0, "greenlet wall %" PRId64, g.wall_ns);
        CHECK(g.cpu_ns >= -1, "greenlet cpu %" PRId64, g.cpu_ns);
        CHECK(g.finished <= 1, "finished %u", g.finished);
        CHECK(g.name != NULL && g.fn_name != NULL, "NULL name");
        CHECK((int64_t)strlen(g.name) <= max_name, "name too long");
        CHECK((int64_t)strlen(g.fn_name) <= max_name, "fn_name too long");
        if (g.switches > 0 || g.wall_ns > 0) {
            CHECK(g.first_ns <= g.last_ns,
                  "first %" PRId64 " > last %" PRId64, g.first_ns, g.last_ns);
            CHECK(g.wall_ns <= g.last_ns - g.first_ns,
                  "wall %" PRId64 " > last-first %" PRId64, g.wall_ns,
                  g.last_ns - g.first_ns);
        }
    }
    gqp_greenlet_stat gs;
    CHECK(gqp_profile_greenlet(p, ng, &gs) == GQP_ERANGE, "greenlet(count)");

    size_t nw = gqp_profile_wait_count(p);
    CHECK((int64_t)nw <= pget(p, GQP_PROFILE_MAX_WAIT_SITES),
          "%zu wait sites > cap", nw);
    for (size_t i = 0; i < nw; i++) {
        gqp_wait_stat w;
        CHECK(gqp_profile_wait(p, i, &w) == GQP_OK, "wait(%zu)", i);
        CHECK(w.site != 0, "wait site %zu key 0", i);
        CHECK(w.wait_ns >= 0, "wait_ns %" PRId64, w.wait_ns);
        CHECK(w.greenlets <= w.count, "greenlets %" PRIu64 " > count %"
              PRIu64, w.greenlets, w.count);
        for (size_t j = 0; j < i && j < 64; j++) {
            gqp_wait_stat o;
            CHECK(gqp_profile_wait(p, j, &o) == GQP_OK, "wait(j)");
            CHECK(o.site != w.site, "wait site %" PRIx64 " twice", w.site);
        }
    }
    gqp_wait_stat ws;
    CHECK(gqp_profile_wait(p, nw, &ws) == GQP_ERANGE, "wait(count)");
    size_t ne_ = gqp_profile_wait_event_count(p);
    CHECK((int64_t)ne_ <= pget(p, GQP_PROFILE_MAX_WAIT_EVENTS) || ne_ == 0,
          "%zu wait events > cap", ne_);
    for (size_t i = 0; i < ne_; i++) {
        gqp_wait_event e;
        CHECK(gqp_profile_wait_event(p, i, &e) == GQP_OK, "wait_event");
        CHECK(e.greenlet_id != 0 && e.end_ns >= e.start_ns && e.site < nw,
              "wait event %zu", i);
    }

    size_t nf = gqp_profile_func_count(p);
    int64_t max_f = pget(p, GQP_PROFILE_MAX_FUNCS);
    CHECK((int64_t)nf <= max_f, "%zu funcs > cap %" PRId64, nf, max_f);
    for (size_t i = 0; i < nf; i++) {
        gqp_func_stat f;
        rc = gqp_profile_func(p, i, &f);
        CHECK(rc == GQP_OK, "func(%zu) = %d", i, rc);
        CHECK(f.key != 0, "func key 0");
        CHECK(f.nactual <= f.ncall, "func nactual %" PRIu64 " > ncall %"
              PRIu64, f.nactual, f.ncall);
        CHECK(f.ttot_ns >= 0 && f.tsub_ns >= 0,
              "func times %" PRId64 " %" PRId64, f.ttot_ns, f.tsub_ns);
        for (size_t j = 0; j < i && j < 32; j++) {
            gqp_func_stat o;
            CHECK(gqp_profile_func(p, j, &o) == GQP_OK, "func(j)");
            CHECK(o.key != f.key, "func key twice");
        }
    }
    gqp_func_stat fs;
    CHECK(gqp_profile_func(p, nf, &fs) == GQP_ERANGE, "func(count)");

    size_t ne = gqp_profile_edge_count(p);
    int64_t max_e = pget(p, GQP_PROFILE_MAX_EDGES);
    CHECK((int64_t)ne <= max_e, "%zu edges > cap %" PRId64, ne, max_e);
    for (size_t i = 0; i < ne; i++) {
        gqp_edge_stat e;
        rc = gqp_profile_edge(p, i, &e);
        CHECK(rc == GQP_OK, "edge(%zu) = %d", i, rc);
        CHECK(e.callee_key != 0, "edge callee 0");
        CHECK(e.nactual <= e.ncall, "edge nactual > ncall");
        CHECK(e.ttot_ns >= 0 && e.tsub_ns >= 0, "edge times %" PRId64
              " %" PRId64, e.ttot_ns, e.tsub_ns);
    }
    gqp_edge_stat es;
    CHECK(gqp_profile_edge(p, ne, &es) == GQP_ERANGE, "edge(count)");
    CHECK(gqp_profile_is_closed(p) == 0 || gqp_profile_is_closed(p) == 1,
          "is_closed");
}

static void check_tracer(fz *z, int ti)
{
    gqp_tracer *t = z->t[ti];
    uint64_t key = 0, id = 0, id2 = 0, id3 = 0;
    int64_t since = 0, cap = 0;
    gqp_profile *cp = NULL;
    int rc, rc2;

    rc = gqp_tracer_current(t, &key, &id, &cp);
    rc2 = gqp_tracer_running_since(t, &since, &id3);
    CHECK(rc == GQP_OK || rc == GQP_ENOTFOUND, "current = %d", rc);
    CHECK(rc == rc2, "current %d vs running_since %d", rc, rc2);
    if (rc == GQP_OK) {
        CHECK(key != 0 && id != 0, "current key/id 0");
        CHECK(id == id3, "current id %" PRIu64 " vs running_since %" PRIu64,
              id, id3);
        rc = gqp_tracer_greenlet_id(t, key, &id2);
        CHECK(rc == GQP_OK && id2 == id, "greenlet_id(current) = %d", rc);
        CHECK(since <= z->clk[ti].wall, "running since the future");
    }
    CHECK(gqp_tracer_get(t, GQP_TRACER_MAX_GREENLETS, &cap) == GQP_OK, "get");
    int64_t bound = cap > z->gl_bound[ti] ? cap : z->gl_bound[ti];
    CHECK((int64_t)gqp_tracer_greenlet_count(t) <= bound,
          "%zu live greenlets > %" PRId64, gqp_tracer_greenlet_count(t),
          bound);
}

/* Right after a switch closed a span: last_span must describe it. */
static void check_last_span(fz *z, int ti)
{
    gqp_span s;
    gqp_profile *lp = NULL;
    size_t idx = 0;
    int rc = gqp_tracer_last_span(z->t[ti], &s, &lp, &idx);
    CHECK(rc == GQP_OK, "last_span after a switch = %d", rc);
    CHECK(s.end_ns == z->clk[ti].wall, "last span ends at %" PRId64
          ", now %" PRId64, s.end_ns, z->clk[ti].wall);
    CHECK(s.end_ns >= s.start_ns, "last span reversed");
    CHECK(s.greenlet_id != 0, "last span id 0");
    if (lp == NULL) {
        CHECK(idx == SIZE_MAX, "index %zu without a profile", idx);
        return;
    }
    if (idx == SIZE_MAX)
        return;
    for (int k = 0; k < NPROF; k++) {
        if (z->p[k] != lp)
            continue; /* only profiles we hold a reference to */
        gqp_span k2;
        CHECK(idx < gqp_profile_span_count(lp), "index %zu >= count %zu", idx,
              gqp_profile_span_count(lp));
        CHECK(gqp_profile_span(lp, idx, &k2) == GQP_OK, "span(idx)");
        CHECK(k2.greenlet_id == s.greenlet_id && k2.start_ns == s.start_ns &&
                  k2.end_ns == s.end_ns && k2.cpu_ns == s.cpu_ns &&
                  k2.flags == s.flags,
              "stored span %zu (id %" PRIu64 " %" PRId64 "..%" PRId64
              " cpu %" PRId64 " flags %u) differs from last_span (id %"
              PRIu64 " %" PRId64 "..%" PRId64 " cpu %" PRId64 " flags %u)",
              idx, k2.greenlet_id, k2.start_ns, k2.end_ns, k2.cpu_ns,
              k2.flags, s.greenlet_id, s.start_ns, s.end_ns, s.cpu_ns,
              s.flags);
        break;
    }
}

static void check_all(fz *z)
{
    size_t live = 0;
    for (int ti = 0; ti < z->ntracers; ti++)
        live += gqp_tracer_greenlet_count(z->t[ti]);
    for (int k = 0; k < NPROF; k++) {
        if (z->p[k] == NULL)
            continue;
        check_profile(z->p[k]);
        CHECK(gqp_profile_attached(z->p[k]) <= live,
              "%zu attached > %zu live greenlets",
              gqp_profile_attached(z->p[k]), live);
    }
    for (int ti = 0; ti < z->ntracers; ti++)
        check_tracer(z, ti);
}

/* ---- operations -------------------------------------------------------------- */

/* NULL only when an injected allocation failure made it fail. */
static gqp_tracer *make_tracer(fz *z, int ti)
{
    gqp_tracer *t = NULL;
    int rc = gqp_tracer_new(&t);
    CHECK(OK_OR_OOM(z, rc), "tracer_new = %d", rc);
    if (rc != GQP_OK)
        return NULL;
    CHECK(t != NULL, "tracer_new gave NULL");
    rc = gqp_tracer_set_clocks(t, fk_wall, fk_cpu, &z->clk[ti]);
    CHECK(rc == GQP_OK, "set_clocks on a new tracer = %d", rc);
    return t;
}

static void op_switch(fz *z)
{
    int ti = pick_tracer(z);
    uint8_t mode = rd(z);
    uint64_t to = pick_key(z);
    uint8_t fb = rd(z);
    uint64_t from, cur = 0;
    unsigned flags;
    int running = gqp_tracer_current(z->t[ti], &cur, NULL, NULL) == GQP_OK;

    if (mode < 200)
        from = running ? cur : 0; /* the well-behaved caller */
    else if (mode < 220)
        from = 0;
    else
        from = z->keys[(mode - 220) % NKEYS];
    if (fb < 224)
        flags = (fb % 6 == 5) ? GQP_SWITCH_FROM_DEAD : 0;
    else
        flags = fb; /* unknown bits */

    int rc = gqp_tracer_switch(z->t[ti], from, to, flags);
    if (to == 0) {
        CHECK(rc == GQP_EINVAL, "switch to key 0 = %d", rc);
        return;
    }
    if (rc >= 0) {
        CHECK((rc & ~0x1f) == 0, "unknown event flags 0x%x", rc);
        if (running && from == cur && flags <= 1)
            check_last_span(z, ti);
    }
}

static void op_name(fz *z)
{
    char name[80], fn[80];
    int slot;
    gqp_profile *p = pick_prof(z, &slot);
    uint8_t idsel = rd(z);
    uint64_t key = pick_key(z);
    uint64_t id = key;
    size_t len = rd(z) % 72, len2;
    for (size_t k = 0; k < len; k++)
        name[k] = (char)rd(z);
    name[len] = '\0';
    len2 = rd(z) % 72;
    for (size_t k = 0; k < len2; k++)
        fn[k] = (char)rd(z);
    fn[len2] = '\0';
    if (idsel & 1) {
        /* the id of a live greenlet */
        uint64_t gidv = 0;
        if (gqp_tracer_greenlet_id(z->t[(idsel >> 3) % z->ntracers], key,
                                   &gidv) == GQP_OK)
            id = gidv;
    }
    int rc = gqp_profile_name_greenlet(p, id, (idsel & 2) ? NULL : name,
                                       (idsel & 4) ? NULL : fn);
    if (p == NULL || id == 0)
        CHECK(rc == GQP_EINVAL, "name_greenlet(NULL/0) = %d", rc);
    else
        CHECK(rc == GQP_OK || rc == GQP_ELIMIT || rc == GQP_ESTATE ||
                  rc == GQP_ENOMEM,
              "name_greenlet = %d", rc);
}

static void op_waited(fz *z)
{
    int ti = pick_tracer(z);
    gqp_profile *p = pick_prof(z, NULL);
    int64_t back = pick_amount(z), len = pick_amount(z);
    size_t n = rd(z) % 9;
    int64_t start = z->clk[ti].wall - back, end = start + len;
    uint64_t ids[8];
    int64_t ns[8], total = -1;
    int complete = -1;
    int rc;

    if (rd(z) & 1) { /* sometimes a reversed interval */
        int64_t tmp = start;
        start = end;
        end = tmp;
    }
    rc = gqp_tracer_waited(z->t[ti], p, start, end, &total,
                           n ? ids : NULL, n ? ns : NULL, n, &complete);
    if (rc < 0) {
        CHECK(rc == GQP_EINVAL || rc == GQP_ERANGE || rc == GQP_ENOMEM,
              "waited = %d", rc);
        return;
    }
    CHECK((size_t)rc <= n, "waited wrote %d > %zu", rc, n);
    CHECK(complete == 0 || complete == 1, "complete = %d", complete);
    CHECK(total >= 0, "total %" PRId64, total);
    if (end >= start)
        CHECK(total <= end - start, "total %" PRId64 " > interval %" PRId64,
              total, end - start);
    int64_t sum = 0;
    for (int k = 0; k < rc; k++) {
        CHECK(ids[k] != 0, "waited id 0");
        CHECK(ns[k] >= 0, "waited ns %" PRId64, ns[k]);
        if (k > 0)
            CHECK(ns[k] <= ns[k - 1], "waited not sorted");
        for (int j = 0; j < k; j++)
            CHECK(ids[j] != ids[k], "waited id twice");
        sum += ns[k];
    }
    CHECK(sum <= total, "top-n sum %" PRId64 " > total %" PRId64, sum, total);
}

/* Setting a cap on a fresh profile: only 0 may be refused. */
static void pset_fresh(gqp_profile *p, gqp_profile_param k, int64_t v)
{
    int rc = gqp_profile_set(p, k, v);
    CHECK(rc == GQP_OK ||
              (v == 0 && (rc == GQP_EINVAL || rc == GQP_ERANGE)),
          "profile_set(%d, %" PRId64 ") on a fresh profile = %d", (int)k, v,
          rc);
}

static void op_newprof(fz *z)
{
    int slot = rd(z) % NPROF;
    uint8_t ms = rd(z), pol = rd(z), tiny = rd(z);
    gqp_profile *p = NULL;
    int rc;

    gqp_profile_free(z->p[slot]);
    z->p[slot] = NULL;
    if (ms == 0xee)
        return; /* leave the slot empty: NULL paths */
    rc = gqp_profile_new(&p);
    CHECK(OK_OR_OOM(z, rc), "profile_new = %d", rc);
    if (rc != GQP_OK)
        return;
    CHECK(p != NULL, "profile_new gave NULL");
    CHECK(gqp_profile_set(p, GQP_PROFILE_MAX_SPANS, ms % 17) == GQP_OK,
          "set max_spans");
    CHECK(gqp_profile_set(p, GQP_PROFILE_SPAN_POLICY, pol & 1) == GQP_OK,
          "set policy");
    if (tiny & 1)
        pset_fresh(p, GQP_PROFILE_MAX_FUNCS, (tiny >> 1) & 7);
    if (tiny & 16)
        pset_fresh(p, GQP_PROFILE_MAX_EDGES, (tiny >> 5) & 7);
    if (pol & 2)
        pset_fresh(p, GQP_PROFILE_MAX_GREENLETS, (pol >> 2) & 7);
    if (pol & 32)
        pset_fresh(p, GQP_PROFILE_MAX_NAME, (pol >> 6) * 3);
    z->p[slot] = p;
}

static void run_op(fz *z, uint8_t op)
{
    int ti, rc, slot;
    gqp_profile *p;
    uint64_t k1, k2;

    switch (op % OP__COUNT) {
    case OP_SWITCH:
        op_switch(z);
        break;
    case OP_CALL:
        ti = pick_tracer(z);
        k1 = pick_func(z);
        rc = gqp_tracer_call(z->t[ti], k1);
        if (k1 == 0)
            CHECK(rc == GQP_EINVAL, "call(0) = %d", rc);
        else
            CHECK(rc >= 0 ? (rc & ~0xf) == 0 : rc != GQP_EINVAL,
                  "call = %d", rc);
        break;
    case OP_RETURN:
        ti = pick_tracer(z);
        (void)gqp_tracer_return(z->t[ti]);
        break;
    case OP_RUN: {
        ti = pick_tracer(z);
        int64_t a = pick_amount(z);
        z->clk[ti].wall += a;
        z->clk[ti].cpu += a;
        break;
    }
    case OP_IDLE:
        ti = pick_tracer(z);
        z->clk[ti].wall += pick_amount(z);
        break;
    case OP_ATTACH: {
        ti = pick_tracer(z);
        k1 = pick_key(z);
        p = pick_prof(z, NULL);
        uint64_t cur = 0;
        int running = gqp_tracer_current(z->t[ti], &cur, NULL, NULL) ==
                      GQP_OK;
        rc = gqp_tracer_attach(z->t[ti], k1, p);
        if (k1 == 0)
            CHECK(rc == GQP_EINVAL, "attach(0) = %d", rc);
        else
            /* the library returns GQP_EV_LONG_SPAN when the split span is
             * long (not in the header; see README.md) */
            CHECK(rc == GQP_OK || rc == GQP_EV_LONG_SPAN ||
                      rc == GQP_ENOTFOUND || rc == GQP_ESTATE ||
                      rc == GQP_ELIMIT || rc == GQP_ENOMEM,
                  "attach = %d", rc);
        (void)running;
        break;
    }
    case OP_INHERIT:
        ti = pick_tracer(z);
        k1 = pick_key(z);
        k2 = pick_key(z);
        rc = gqp_tracer_inherit(z->t[ti], k1, k2);
        if (k1 == 0 || k2 == 0)
            CHECK(rc == GQP_EINVAL, "inherit(0) = %d", rc);
        break;
    case OP_CLOSE:
        p = pick_prof(z, NULL);
        rc = gqp_profile_close(p);
        if (p == NULL)
            CHECK(rc == GQP_EINVAL, "close(NULL) = %d", rc);
        else
            CHECK(rc == GQP_OK || rc == GQP_ESTATE, "close = %d", rc);
        if (p != NULL)
            CHECK(gqp_profile_is_closed(p) == 1, "not closed after close");
        break;
    case OP_CLEAR:
        p = pick_prof(z, NULL);
        rc = gqp_profile_clear(p);
        if (p == NULL) {
            CHECK(rc == GQP_EINVAL, "clear(NULL) = %d", rc);
        } else if (rc == GQP_OK || !OK_OR_OOM(z, rc)) {
            gqp_span s;
            CHECK(rc == GQP_OK, "clear = %d", rc);
            CHECK(gqp_profile_span_count(p) == 0 &&
                      gqp_profile_spans_dropped(p) == 0 &&
                      gqp_profile_func_count(p) == 0 &&
                      gqp_profile_edge_count(p) == 0 &&
                      gqp_profile_greenlet_count(p) == 0 &&
                      gqp_profile_calls_dropped(p) == 0 &&
                      gqp_profile_wait_count(p) == 0 &&
                      gqp_profile_waits_dropped(p) == 0 &&
                      gqp_profile_wait_event_count(p) == 0,
                  "clear left data");
            CHECK(gqp_profile_longest_span(p, &s) == GQP_ENOTFOUND,
                  "longest after clear");
        }
        break;
    case OP_FLUSH: {
        uint8_t b = rd(z);
        ti = (b & 1) % z->ntracers;
        /* bit 1: as if from another thread (no CPU clock reading) */
        rc = (b & 2) ? gqp_tracer_flush_ex(z->t[ti], GQP_FLUSH_FOREIGN)
                     : gqp_tracer_flush(z->t[ti]);
        CHECK(OK_OR_OOM(z, rc), "flush = %d", rc);
        if (rc == GQP_OK)
            CHECK(gqp_tracer_current(z->t[ti], NULL, NULL, NULL) ==
                      GQP_ENOTFOUND,
                  "running after flush");
        break;
    }
    case OP_FORGET:
        ti = pick_tracer(z);
        k1 = pick_key(z);
        rc = gqp_tracer_forget(z->t[ti], k1);
        if (k1 == 0)
            CHECK(rc == GQP_EINVAL, "forget(0) = %d", rc);
        else
            CHECK(rc == GQP_OK || rc == GQP_ENOTFOUND || rc == GQP_ESTATE ||
                      OK_OR_OOM(z, rc),
                  "forget = %d", rc);
        break;
    case OP_TSET: {
        ti = pick_tracer(z);
        int param = rd(z) % 11; /* 0 and 10 are invalid */
        int64_t v = pick_value(z);
        size_t live = gqp_tracer_greenlet_count(z->t[ti]);
        rc = gqp_tracer_set(z->t[ti], (gqp_tracer_param)param, v);
        /* the value may be checked before the parameter (ERANGE) */
        if (param == 0 || param == 9)
            CHECK(rc == GQP_EINVAL || rc == GQP_ESTATE || rc == GQP_ERANGE,
                  "tracer_set(bad param) = %d", rc);
        if (rc == GQP_OK) {
            int64_t back = 0;
            CHECK(gqp_tracer_get(z->t[ti], (gqp_tracer_param)param, &back) ==
                          GQP_OK &&
                      back == v,
                  "tracer_get after set");
            if (param == GQP_TRACER_MAX_GREENLETS)
                z->gl_bound[ti] = (int64_t)live > v ? (int64_t)live : v;
        }
        break;
    }
    case OP_PSET: {
        p = pick_prof(z, NULL);
        int param = rd(z) % 11; /* 0 and 10 are invalid */
        int64_t v = pick_value(z);
        rc = gqp_profile_set(p, (gqp_profile_param)param, v);
        if (p == NULL)
            CHECK(rc == GQP_EINVAL, "profile_set(NULL) = %d", rc);
        else if (param == 0 || param == 10)
            CHECK(rc == GQP_EINVAL || rc == GQP_ESTATE || rc == GQP_ERANGE,
                  "profile_set(bad param) = %d", rc);
        if (rc == GQP_OK) {
            int64_t back = 0;
            CHECK(gqp_profile_get(p, (gqp_profile_param)param, &back) ==
                          GQP_OK &&
                      back == v,
                  "profile_get after set");
        }
        break;
    }
    case OP_DEFAULT:
        ti = pick_tracer(z);
        p = pick_prof(z, NULL);
        rc = gqp_tracer_set_default(z->t[ti], p);
        CHECK(rc == GQP_ESTATE || OK_OR_OOM(z, rc), "set_default = %d", rc);
        break;
    case OP_SESSION:
        ti = pick_tracer(z);
        p = pick_prof(z, NULL);
        rc = gqp_tracer_set_session(z->t[ti], p);
        CHECK(OK_OR_OOM(z, rc), "set_session = %d", rc);
        break;
    case OP_NAME:
        op_name(z);
        break;
    case OP_TAG: {
        p = pick_prof(z, NULL);
        size_t idx = rd(z);
        uint32_t tag = (uint32_t)rd(z) * 0x01010101u;
        rc = gqp_profile_span_set_tag(p, idx, tag);
        if (p == NULL) {
            CHECK(rc == GQP_EINVAL, "set_tag(NULL) = %d", rc);
        } else if (idx < gqp_profile_span_count(p)) {
            gqp_span s;
            CHECK(rc == GQP_OK, "set_tag = %d", rc);
            CHECK(gqp_profile_span(p, idx, &s) == GQP_OK && s.tag == tag,
                  "tag not stored");
        } else {
            CHECK(rc == GQP_ERANGE, "set_tag out of range = %d", rc);
        }
        break;
    }
    case OP_WAITED:
        op_waited(z);
        break;
    case OP_NEWPROF:
        op_newprof(z);
        break;
    case OP_RETAIN:
        p = pick_prof(z, &slot);
        if (p != NULL) {
            CHECK(gqp_profile_retain(p) == GQP_OK, "retain");
            gqp_profile_free(p);
        } else {
            CHECK(gqp_profile_retain(NULL) == GQP_EINVAL, "retain(NULL)");
        }
        break;
    case OP_NEWTRACER: {
        ti = pick_tracer(z);
        gqp_tracer *nt = make_tracer(z, ti);
        if (nt != NULL) {
            gqp_tracer_free(z->t[ti]);
            z->t[ti] = nt;
            z->gl_bound[ti] = 0;
        }
        break;
    }
    case OP_CHECK:
        check_all(z);
        break;
    case OP_CLOCKS: {
        ti = pick_tracer(z);
        int running =
            gqp_tracer_current(z->t[ti], NULL, NULL, NULL) == GQP_OK;
        rc = gqp_tracer_set_clocks(z->t[ti], fk_wall, fk_cpu, &z->clk[ti]);
        if (running)
            CHECK(rc == GQP_ESTATE, "set_clocks while running = %d", rc);
        else
            CHECK(OK_OR_OOM(z, rc), "set_clocks while idle = %d", rc);
        break;
    }
    case OP_SPAWN:
        ti = pick_tracer(z);
        k1 = pick_key(z);
        p = pick_prof(z, NULL);
        rc = gqp_tracer_set_spawn_profile(z->t[ti], k1, p);
        if (k1 == 0)
            CHECK(rc == GQP_EINVAL, "set_spawn_profile(0) = %d", rc);
        else
            CHECK(rc == GQP_ENOTFOUND || OK_OR_OOM(z, rc),
                  "set_spawn_profile = %d", rc);
        break;
    case OP_FAILALLOC:
        g_fa.fail_at = g_fa.total + 1 + rd(z) % 32;
        break;
    case OP_WAIT_AT: {
        size_t idx = SIZE_MAX;
        ti = pick_tracer(z);
        k1 = pick_key(z);
        k2 = pick_func(z);
        gqp_profile *wp = NULL;
        rc = gqp_tracer_wait_at(z->t[ti], k1, k2, &wp, &idx);
        if (k1 == 0 || k2 == 0) {
            CHECK(rc == GQP_EINVAL, "wait_at(0) = %d", rc);
        } else if (rc == GQP_EV_NEW_SITE) {
            /* the index was given; in a slot's profile it reads back the
             * key (the greenlet's profile may have left the slots) */
            CHECK(idx != SIZE_MAX && wp != NULL, "new site without an index");
            CHECK(idx < gqp_profile_wait_count(wp), "new site index");
            for (int k = 0; k < NPROF; k++) {
                gqp_wait_stat w;
                if (z->p[k] && idx < gqp_profile_wait_count(z->p[k]) &&
                    gqp_profile_wait(z->p[k], idx, &w) == GQP_OK)
                    CHECK(w.site != 0, "site %zu key 0", idx);
            }
        } else {
            CHECK(rc == 0 || rc == GQP_EV_DROPPED || rc == GQP_ENOTFOUND ||
                      OK_OR_OOM(z, rc),
                  "wait_at = %d", rc);
        }
        break;
    }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz z;
    uint8_t cfg;

    memset(&z, 0, sizeof z);
    z.d = data;
    z.n = size;
    init_keys(&z);
    {
        gqp_allocator al = {fa_malloc, fa_realloc, fa_free, NULL};
        memset(&g_fa, 0, sizeof g_fa);
        CHECK(gqp_set_allocator(&al) == GQP_OK, "set_allocator");
    }
    cfg = rd(&z);
    z.ntracers = (cfg & 1) ? 2 : 1;
    for (int ti = 0; ti < z.ntracers; ti++) {
        z.clk[ti].wall = INT64_C(1000000000) * (ti + 1);
        z.clk[ti].cpu = INT64_C(7000000) * (ti + 1);
        z.t[ti] = make_tracer(&z, ti);
        CHECK(z.t[ti] != NULL, "tracer_new");
        if (cfg & 2)
            CHECK(gqp_tracer_set(z.t[ti], GQP_TRACER_CPU_MODE,
                                 (cfg >> 2) % 3) == GQP_OK,
                  "cpu mode");
        if (cfg & 16)
            CHECK(gqp_tracer_set(z.t[ti], GQP_TRACER_CALL_CLOCK,
                                 GQP_CLOCK_WALL) == GQP_OK,
                  "call clock");
        if (cfg & 32)
            CHECK(gqp_tracer_set(z.t[ti], GQP_TRACER_MAX_DEPTH, 3) == GQP_OK,
                  "max depth");
        if (cfg & 64)
            CHECK(gqp_tracer_set(z.t[ti], GQP_TRACER_HISTORY, 4) == GQP_OK,
                  "history");
        CHECK(gqp_tracer_set(z.t[ti], GQP_TRACER_CPU_WINDOW_NS, 1000) ==
                  GQP_OK,
              "window");
    }
    for (int k = 0; k < NPROF; k++) {
        CHECK(gqp_profile_new(&z.p[k]) == GQP_OK, "profile_new");
        /* profiles with clocks of their own beside the tracer's (0.4) */
        CHECK(gqp_profile_set(z.p[k], GQP_PROFILE_CALL_CLOCK,
                              k % 3 == 1 ? GQP_CLOCK_CPU
                              : k % 3 == 2 ? GQP_CLOCK_WALL
                                           : GQP_CLOCK_TRACER) == GQP_OK,
              "profile clock");
    }
    if (cfg & 128) { /* small caps on profile 0 */
        CHECK(gqp_profile_set(z.p[0], GQP_PROFILE_MAX_SPANS, 4) == GQP_OK,
              "caps");
        CHECK(gqp_profile_set(z.p[0], GQP_PROFILE_MAX_FUNCS, 3) == GQP_OK,
              "caps");
        CHECK(gqp_profile_set(z.p[0], GQP_PROFILE_MAX_EDGES, 2) == GQP_OK,
              "caps");
        CHECK(gqp_profile_set(z.p[0], GQP_PROFILE_MAX_GREENLETS, 2) == GQP_OK,
              "caps");
        CHECK(gqp_profile_set(z.p[0], GQP_PROFILE_MAX_NAME, 5) == GQP_OK,
              "caps");
    }
    CHECK(gqp_tracer_set_default(z.t[0], z.p[0]) == GQP_OK, "default");

    while (z.i < z.n) {
        uint8_t op = rd(&z);
        z.fails0 = g_fa.failures;
        run_op(&z, op);
        z.ops++;
        for (int ti = 0; ti < z.ntracers; ti++)
            check_tracer(&z, ti);
        if (z.ops % FULL_CHECK_EVERY == 0)
            check_all(&z);
    }
    g_fa.fail_at = 0;
    z.fails0 = g_fa.failures;
    check_all(&z);
    /* flush everything, check again, then tear down in a mixed order */
    for (int ti = 0; ti < z.ntracers; ti++)
        CHECK(gqp_tracer_flush(z.t[ti]) == GQP_OK, "final flush");
    check_all(&z);
    gqp_profile_free(z.p[1]);
    z.p[1] = NULL;
    for (int ti = 0; ti < z.ntracers; ti++)
        gqp_tracer_free(z.t[ti]);
    for (int k = 0; k < NPROF; k++)
        gqp_profile_free(z.p[k]);
    CHECK(gqp_set_allocator(NULL) == GQP_OK, "restore allocator");
    return 0;
}

#ifdef GQP_FUZZ_STANDALONE
#include <dirent.h>
#include <sys/stat.h>

static int run_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    uint8_t *buf;
    long len;
    if (f == NULL) {
        perror(path);
        return -1;
    }
    if (fseek(f, 0, SEEK_END) != 0 || (len = ftell(f)) < 0 ||
        fseek(f, 0, SEEK_SET) != 0) {
        perror(path);
        fclose(f);
        return -1;
    }
    buf = malloc(len > 0 ? (size_t)len : 1);
    if (buf == NULL || fread(buf, 1, (size_t)len, f) != (size_t)len) {
        fprintf(stderr, "%s: read error\n", path);
        free(buf);
        fclose(f);
        return -1;
    }
    fclose(f);
    LLVMFuzzerTestOneInput(buf, (size_t)len);
    free(buf);
    return 0;
}

static int run_path(const char *path, int *count)
{
    struct stat st;
    if (stat(path, &st) != 0) {
        perror(path);
        return -1;
    }
    if (S_ISDIR(st.st_mode)) {
        DIR *d = opendir(path);
        struct dirent *e;
        int rc = 0;
        if (d == NULL) {
            perror(path);
            return -1;
        }
        while ((e = readdir(d)) != NULL) {
            char sub[4096];
            if (e->d_name[0] == '.')
                continue;
            snprintf(sub, sizeof sub, "%s/%s", path, e->d_name);
            if (run_path(sub, count) != 0)
                rc = -1;
        }
        closedir(d);
        return rc;
    }
    if (run_file(path) != 0)
        return -1;
    (*count)++;
    return 0;
}

int main(int argc, char **argv)
{
    int count = 0, rc = 0;
    if (argc < 2) {
        fprintf(stderr, "usage: %s FILE|DIR...\n", argv[0]);
        return 2;
    }
    for (int i = 1; i < argc; i++) {
        /* libFuzzer-style flags are accepted and ignored */
        if (argv[i][0] == '-')
            continue;
        if (run_path(argv[i], &count) != 0)
            rc = 1;
    }
    printf("fuzz_api: replayed %d inputs\n", count);
    return rc;
}
#endif
