/*
 * tsan_threads.c -- libgreqprof under several OS threads at once, built with
 * -fsanitize=thread by `make tsan` (a standalone program with its own main).
 *
 * It exercises what greqprof.h (and the binding's watchdog) rely on being
 * safe across threads:
 *
 *   1. gqp_version*, gqp_strerror, gqp_err_name and the gqp_clock_*
 *      functions called from many threads at once;
 *   2. greenlet ids unique across tracers in different threads (one
 *      process-wide atomic counter), with the same keys in every tracer and
 *      greenlets dying and being re-created;
 *   3. one tracer per thread, each with its own profiles, at full speed
 *      (switch/call/return/attach/close/waited/flush on the real clocks),
 *      with exact per-thread span accounting checked afterwards;
 *   4. gqp_profile_retain/gqp_profile_free of one shared profile from several
 *      threads, including the final release racing between threads, and a
 *      closed profile held as the default by tracers of several threads;
 *   5. a profile fed by one tracer and read by another thread, reads
 *      serialised with the events by a mutex (the header's rule);
 *   6. gqp_tracer_running_since read from a watchdog thread while the owner
 *      thread switches (the binding's Watchdog does this without the GIL).
 *
 * A data race makes ThreadSanitizer abort (TSAN_OPTIONS=halt_on_error=1 in
 * the Makefile); a failed check is counted and printed.  The last line is
 * "N passed, N failed"; the exit status is 0 only when nothing failed.
 */
#define _POSIX_C_SOURCE 200809L

#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "greqprof.h"

#define NTHREADS 4

static _Atomic int g_check_failures;

#define CHECK(cond, ...)                                                    \
    do {                                                                    \
        if (!(cond)) {                                                      \
            atomic_fetch_add(&g_check_failures, 1);                         \
            fprintf(stdout, "  %s:%d: CHECK(%s) failed: ", __FILE__,        \
                    __LINE__, #cond);                                       \
            fprintf(stdout, __VA_ARGS__);                                   \
            fputc('\n', stdout);                                            \
            fflush(stdout);                                                 \
        }                                                                   \
    } while (0)

#define CHECK_OK(expr)                                                      \
    do {                                                                    \
        int rc_ = (expr);                                                   \
        CHECK(rc_ >= 0, "%s returned %d (%s)", #expr, rc_,                  \
              gqp_err_name(rc_));                                           \
    } while (0)

typedef void *(*thread_fn)(void *);

static void run_threads(int n, thread_fn fn, void *args, size_t argsize)
{
    pthread_t th[16];
    for (int i = 0; i < n; i++) {
        void *arg = args ? (char *)args + (size_t)i * argsize : NULL;
        if (pthread_create(&th[i], NULL, fn, arg) != 0) {
            fprintf(stderr, "pthread_create failed\n");
            abort();
        }
    }
    for (int i = 0; i < n; i++) {
        pthread_join(th[i], NULL);
    }
}

/* A small deterministic PRNG per thread (xorshift64*). */
static uint64_t rnd(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * UINT64_C(2685821657736338717);
}

/* Burns about `ns` of wall time on the CPU. */
static void spin_ns(int64_t ns)
{
    int64_t end = gqp_clock_wall_ns() + ns;
    volatile uint64_t x = 0;
    while (gqp_clock_wall_ns() < end) {
        x++;
    }
}

/* ---- 1. version, errors, clocks ----------------------------------------- */

static void *static_fns_worker(void *arg)
{
    (void)arg;
    int64_t prev_wall = gqp_clock_wall_ns();
    int64_t prev_cpu = gqp_clock_thread_cpu_ns();
    for (int i = 0; i < 20000; i++) {
        CHECK(gqp_version() == GQP_VERSION_NUMBER, "version %u",
              gqp_version());
        CHECK(strcmp(gqp_version_string(), GQP_VERSION_STRING) == 0,
              "version string %s", gqp_version_string());
        for (int code = GQP__ELAST - 1; code <= 1; code++) {
            const char *msg = gqp_strerror(code);
            const char *name = gqp_err_name(code);
            CHECK(msg && *msg, "strerror(%d) empty", code);
            CHECK(name && strncmp(name, "GQP_", 4) == 0, "err_name(%d)=%s",
                  code, name ? name : "(null)");
        }
        CHECK(strcmp(gqp_err_name(GQP_ENOMEM), "GQP_ENOMEM") == 0, "%s",
              gqp_err_name(GQP_ENOMEM));
        int64_t w = gqp_clock_wall_ns();
        int64_t c = gqp_clock_thread_cpu_ns();
        int64_t e = gqp_clock_epoch_ns();
        CHECK(w >= prev_wall, "wall clock went back %" PRId64 " -> %" PRId64,
              prev_wall, w);
        CHECK(c >= prev_cpu, "thread CPU clock went back %" PRId64
              " -> %" PRId64, prev_cpu, c);
        CHECK(e > INT64_C(1500000000) * 1000000000, "epoch %" PRId64, e);
        prev_wall = w;
        prev_cpu = c;
    }
    return NULL;
}

static int test_static_functions(void)
{
    run_threads(NTHREADS, static_fns_worker, NULL, 0);
    return 0;
}

/* ---- 2. greenlet ids unique across tracers ------------------------------ */

#define IDS_KEYS 512
#define IDS_ROUNDS 4

typedef struct ids_arg {
    uint64_t ids[IDS_KEYS * IDS_ROUNDS];
    size_t n;
} ids_arg;

static void *ids_worker(void *argp)
{
    ids_arg *a = argp;
    gqp_tracer *t = NULL;
    CHECK_OK(gqp_tracer_new(&t));
    if (!t) {
        return NULL;
    }
    for (int round = 0; round < IDS_ROUNDS; round++) {
        uint64_t prev = 0;
        /* The same keys in every thread and every round: the key of a dead
         * greenlet is reused, as CPython reuses addresses. */
        for (uint64_t k = 1; k <= IDS_KEYS; k++) {
            uint64_t key = k * 64;
            CHECK_OK(gqp_tracer_switch(t, prev, key, 0));
            uint64_t id = 0;
            CHECK_OK(gqp_tracer_greenlet_id(t, key, &id));
            a->ids[a->n++] = id;
            prev = key;
        }
        /* Every greenlet dies (the last one by a switch from it). */
        for (uint64_t k = 1; k <= IDS_KEYS; k++) {
            uint64_t key = k * 64;
            if (key != prev) {
                CHECK_OK(gqp_tracer_forget(t, key));
            }
        }
        CHECK_OK(gqp_tracer_switch(t, prev, 1, GQP_SWITCH_FROM_DEAD));
        CHECK_OK(gqp_tracer_flush(t));
        CHECK_OK(gqp_tracer_forget(t, 1));
        CHECK(gqp_tracer_greenlet_count(t) == 0, "%zu greenlets left",
              gqp_tracer_greenlet_count(t));
    }
    gqp_tracer_free(t);
    return NULL;
}

static int cmp_u64(const void *x, const void *y)
{
    uint64_t a = *(const uint64_t *)x, b = *(const uint64_t *)y;
    return (a > b) - (a < b);
}

static int test_greenlet_ids_unique(void)
{
    static ids_arg args[NTHREADS];
    memset(args, 0, sizeof args);
    run_threads(NTHREADS, ids_worker, args, sizeof args[0]);
    size_t total = 0;
    static uint64_t all[NTHREADS * IDS_KEYS * IDS_ROUNDS];
    for (int i = 0; i < NTHREADS; i++) {
        CHECK(args[i].n == IDS_KEYS * IDS_ROUNDS, "thread %d made %zu ids", i,
              args[i].n);
        memcpy(all + total, args[i].ids, args[i].n * sizeof(uint64_t));
        total += args[i].n;
    }
    qsort(all, total, sizeof all[0], cmp_u64);
    size_t dups = 0;
    for (size_t i = 0; i < total; i++) {
        CHECK(all[i] != 0, "greenlet id 0 at %zu", i);
        if (i && all[i] == all[i - 1]) {
            dups++;
        }
    }
    CHECK(dups == 0, "%zu duplicate greenlet ids among %zu", dups, total);
    return 0;
}

/* ---- 3. one tracer per thread at full speed ----------------------------- */

#define FS_GREENLETS 64
#define FS_EVENTS 60000

typedef struct fs_arg {
    uint64_t seed;
    uint64_t switches, splits, calls, returns;
    uint64_t spans_seen;     /* kept + dropped over every profile */
    uint64_t requests;
} fs_arg;

static void *full_speed_worker(void *argp)
{
    fs_arg *a = argp;
    gqp_tracer *t = NULL;
    gqp_profile *deflt = NULL;
    CHECK_OK(gqp_tracer_new(&t));
    CHECK_OK(gqp_profile_new(&deflt));
    if (!t || !deflt) {
        return NULL;
    }
    CHECK_OK(gqp_profile_set(deflt, GQP_PROFILE_MAX_SPANS, 1 << 20));
    CHECK_OK(gqp_tracer_set(t, GQP_TRACER_LONG_SPAN_NS, 200000));
    CHECK_OK(gqp_tracer_set_default(t, deflt));
    /* Request profiles are kept until the end so their spans can be
     * counted; a request ends (is closed) after a random number of events. */
    enum { MAXREQ = 4096 };
    gqp_profile **reqs = calloc(MAXREQ, sizeof *reqs);
    int open_req = -1;
    uint64_t keys[FS_GREENLETS];
    int depth[FS_GREENLETS];
    for (int i = 0; i < FS_GREENLETS; i++) {
        keys[i] = UINT64_C(0x7f0000000000) + (uint64_t)(i + 1) * 0x40;
        depth[i] = 0;
    }
    int cur = -1;
    for (int ev = 0; ev < FS_EVENTS; ev++) {
        uint64_t r = rnd(&a->seed);
        unsigned op = (unsigned)(r % 100);
        if (cur < 0 || op < 30) {
            int to = (int)((r >> 8) % FS_GREENLETS);
            if (to == cur) {
                continue;
            }
            int rc = gqp_tracer_switch(t, cur < 0 ? 0 : keys[cur], keys[to],
                                       0);
            CHECK(rc >= 0, "switch rc %d", rc);
            a->switches++;
            cur = to;
        } else if (op < 60) {
            CHECK_OK(gqp_tracer_call(t, UINT64_C(0x5500000000) +
                                            ((r >> 16) % 32) * 16));
            depth[cur]++;
            a->calls++;
        } else if (op < 88) {
            if (depth[cur] > 0) {
                CHECK_OK(gqp_tracer_return(t));
                depth[cur]--;
                a->returns++;
            }
        } else if (op < 92) {
            /* A request starts in the running greenlet. */
            if (open_req < 0 && a->requests < MAXREQ) {
                gqp_profile *p = NULL;
                CHECK_OK(gqp_profile_new(&p));
                CHECK_OK(gqp_profile_set(p, GQP_PROFILE_MAX_SPANS, 64));
                CHECK_OK(gqp_tracer_attach(t, keys[cur], p));
                CHECK_OK(gqp_tracer_set_spawn_profile(t, keys[cur], p));
                a->splits++;
                open_req = (int)a->requests;
                reqs[a->requests++] = p;
                depth[cur] = 0;  /* attach starts the stack afresh */
            }
        } else if (op < 96) {
            /* The request ends: close its profile, query it. */
            if (open_req >= 0) {
                gqp_profile *p = reqs[open_req];
                int64_t total = 0;
                uint64_t ids[4];
                int64_t ns[4];
                int complete = 0;
                int64_t now = gqp_clock_wall_ns();
                CHECK_OK(gqp_tracer_waited(t, p, now - 1000000, now, &total,
                                           ids, ns, 4, &complete));
                CHECK_OK(gqp_profile_close(p));
                open_req = -1;
            }
        } else if (op < 98) {
            /* Read the last span and the running one. */
            gqp_span s;
            int64_t since = 0;
            uint64_t id = 0;
            int rc = gqp_tracer_last_span(t, &s, NULL, NULL);
            CHECK(rc == GQP_OK || rc == GQP_ENOTFOUND, "last_span %d", rc);
            CHECK_OK(gqp_tracer_running_since(t, &since, &id));
        } else {
            /* An occasional long span. */
            spin_ns(250000);
        }
    }
    CHECK_OK(gqp_tracer_flush(t));
    if (open_req >= 0) {
        CHECK_OK(gqp_profile_close(reqs[open_req]));
    }
    /* Every switch except the first closed one span, every attach of the
     * running greenlet split one, and the flush closed the last one; each
     * went to a profile (closed attachments fall back to the default). */
    uint64_t seen = gqp_profile_span_count(deflt) +
                    gqp_profile_spans_dropped(deflt);
    for (uint64_t i = 0; i < a->requests; i++) {
        seen += gqp_profile_span_count(reqs[i]) +
                gqp_profile_spans_dropped(reqs[i]);
        CHECK(gqp_profile_span_count(reqs[i]) <= 64, "cap not kept: %zu",
              gqp_profile_span_count(reqs[i]));
    }
    a->spans_seen = seen;
    CHECK(seen == a->switches + a->splits,
          "spans %" PRIu64 " != switches %" PRIu64 " + splits %" PRIu64, seen,
          a->switches, a->splits);
    uint64_t ncalls = 0;
    for (size_t i = 0; i < gqp_profile_func_count(deflt); i++) {
        gqp_func_stat f;
        CHECK_OK(gqp_profile_func(deflt, i, &f));
        CHECK(f.nactual <= f.ncall && f.ttot_ns >= 0 && f.tsub_ns >= 0,
              "func %zu: ncall %" PRIu64 " nactual %" PRIu64, i, f.ncall,
              f.nactual);
        ncalls += f.ncall;
    }
    CHECK(ncalls <= a->calls, "%" PRIu64 " calls recorded, %" PRIu64 " made",
          ncalls, a->calls);
    for (uint64_t i = 0; i < a->requests; i++) {
        gqp_profile_free(reqs[i]);
    }
    free(reqs);
    gqp_tracer_free(t);
    gqp_profile_free(deflt);
    return NULL;
}

static int test_tracer_per_thread(void)
{
    static fs_arg args[NTHREADS];
    memset(args, 0, sizeof args);
    for (int i = 0; i < NTHREADS; i++) {
        args[i].seed = UINT64_C(0x9E3779B97F4A7C15) * (uint64_t)(i + 1);
    }
    run_threads(NTHREADS, full_speed_worker, args, sizeof args[0]);
    for (int i = 0; i < NTHREADS; i++) {
        CHECK(args[i].switches > 1000 && args[i].requests > 10,
              "thread %d: %" PRIu64 " switches, %" PRIu64 " requests", i,
              args[i].switches, args[i].requests);
    }
    return 0;
}

/* ---- 4. retain/free of a shared profile --------------------------------- */

typedef struct share_arg {
    gqp_profile *p;
    int handoff;   /* 1: this thread owns one reference to drop at the end */
    _Atomic int *go;
} share_arg;

static void *share_worker(void *argp)
{
    share_arg *a = argp;
    while (!atomic_load(a->go)) {
    }
    if (!a->handoff) {
        for (int i = 0; i < 50000; i++) {
            int rc = gqp_profile_retain(a->p);
            CHECK(rc == GQP_OK, "retain %d", rc);
            CHECK(gqp_profile_is_closed(a->p) >= 0, "not live");
            gqp_profile_free(a->p);
        }
    } else {
        /* A burst of retains, then drop them all and the handed-over one:
         * the last thread here frees the profile. */
        for (int i = 0; i < 100; i++) {
            CHECK_OK(gqp_profile_retain(a->p));
        }
        for (int i = 0; i < 101; i++) {
            gqp_profile_free(a->p);
        }
    }
    return NULL;
}

typedef struct closed_arg {
    gqp_profile *p;
} closed_arg;

static void *closed_default_worker(void *argp)
{
    closed_arg *a = argp;
    for (int round = 0; round < 200; round++) {
        gqp_tracer *t = NULL;
        CHECK_OK(gqp_tracer_new(&t));
        CHECK_OK(gqp_tracer_set_default(t, a->p));
        for (uint64_t k = 1; k < 50; k++) {
            CHECK_OK(gqp_tracer_switch(t, k == 1 ? 0 : (k - 1) * 16, k * 16,
                                       0));
            CHECK_OK(gqp_tracer_call(t, 0x100));
            CHECK_OK(gqp_tracer_return(t));
        }
        /* Attaching to a closed profile is refused. */
        int rc = gqp_tracer_attach(t, 16, a->p);
        CHECK(rc == GQP_ESTATE, "attach to closed: %d", rc);
        CHECK_OK(gqp_tracer_flush(t));
        gqp_tracer_free(t);   /* drops the default reference */
    }
    return NULL;
}

static int test_shared_profile_refcount(void)
{
    gqp_profile *p = NULL;
    CHECK_OK(gqp_profile_new(&p));
    if (!p) {
        return 0;
    }
    _Atomic int go = 0;
    share_arg args[NTHREADS];
    pthread_t th[NTHREADS];
    for (int i = 0; i < NTHREADS; i++) {
        args[i].p = p;
        args[i].handoff = 0;
        args[i].go = &go;
        pthread_create(&th[i], NULL, share_worker, &args[i]);
    }
    atomic_store(&go, 1);
    for (int i = 0; i < NTHREADS; i++) {
        pthread_join(th[i], NULL);
    }
    /* Balanced: still live with the one original reference. */
    CHECK(gqp_profile_is_closed(p) == 0, "profile not live after balanced "
          "retain/free: %d", gqp_profile_is_closed(p));

    /* A closed profile as the default of several tracers at once. */
    CHECK_OK(gqp_profile_close(p));
    closed_arg cargs[NTHREADS];
    for (int i = 0; i < NTHREADS; i++) {
        cargs[i].p = p;
    }
    run_threads(NTHREADS, closed_default_worker, cargs, sizeof cargs[0]);
    CHECK(gqp_profile_span_count(p) == 0, "closed profile got %zu spans",
          gqp_profile_span_count(p));
    CHECK(gqp_profile_attached(p) == 0, "closed profile attached %zu",
          gqp_profile_attached(p));

    /* Hand-off: each thread owns one reference; the owner drops its own
     * while they run, and whichever thread drops last frees it. */
    atomic_store(&go, 0);
    for (int i = 0; i < NTHREADS; i++) {
        CHECK_OK(gqp_profile_retain(p));
        args[i].handoff = 1;
        pthread_create(&th[i], NULL, share_worker, &args[i]);
    }
    atomic_store(&go, 1);
    gqp_profile_free(p);
    for (int i = 0; i < NTHREADS; i++) {
        pthread_join(th[i], NULL);
    }
    return 0;
}

/* ---- 5. fed by one tracer, read by another thread (mutex) -------------- */

typedef struct feed_arg {
    pthread_mutex_t mu;
    gqp_profile *p;
    _Atomic int done;
    uint64_t reads;
} feed_arg;

static void *feed_reader(void *argp)
{
    feed_arg *a = argp;
    while (!atomic_load(&a->done)) {
        pthread_mutex_lock(&a->mu);
        size_t n = gqp_profile_span_count(a->p);
        for (size_t i = 0; i < n; i += 7) {
            gqp_span s;
            CHECK_OK(gqp_profile_span(a->p, i, &s));
            CHECK(s.end_ns >= s.start_ns && s.greenlet_id != 0,
                  "bad span %zu", i);
        }
        size_t ng = gqp_profile_greenlet_count(a->p);
        for (size_t i = 0; i < ng; i++) {
            gqp_greenlet_stat g;
            CHECK_OK(gqp_profile_greenlet(a->p, i, &g));
            CHECK(g.name != NULL && g.fn_name != NULL, "names");
        }
        size_t nf = gqp_profile_func_count(a->p);
        for (size_t i = 0; i < nf; i++) {
            gqp_func_stat f;
            CHECK_OK(gqp_profile_func(a->p, i, &f));
        }
        size_t ne = gqp_profile_edge_count(a->p);
        for (size_t i = 0; i < ne; i++) {
            gqp_edge_stat e;
            CHECK_OK(gqp_profile_edge(a->p, i, &e));
        }
        gqp_span longest;
        int rc = gqp_profile_longest_span(a->p, &longest);
        CHECK(rc == GQP_OK || rc == GQP_ENOTFOUND, "longest %d", rc);
        pthread_mutex_unlock(&a->mu);
        a->reads++;
    }
    return NULL;
}

static int test_reader_thread_with_mutex(void)
{
    feed_arg a;
    memset(&a, 0, sizeof a);
    pthread_mutex_init(&a.mu, NULL);
    gqp_tracer *t = NULL;
    CHECK_OK(gqp_tracer_new(&t));
    CHECK_OK(gqp_profile_new(&a.p));
    if (!t || !a.p) {
        return 0;
    }
    CHECK_OK(gqp_profile_set(a.p, GQP_PROFILE_SPAN_POLICY, GQP_KEEP_LAST));
    CHECK_OK(gqp_profile_set(a.p, GQP_PROFILE_MAX_SPANS, 500));
    CHECK_OK(gqp_tracer_set_default(t, a.p));
    pthread_t reader;
    pthread_create(&reader, NULL, feed_reader, &a);
    uint64_t seed = 42;
    uint64_t prev = 0;
    for (int i = 0; i < 40000; i++) {
        uint64_t r = rnd(&seed);
        pthread_mutex_lock(&a.mu);
        uint64_t to = ((r % 40) + 1) * 32;
        if (to != prev) {
            CHECK_OK(gqp_tracer_switch(t, prev, to, 0));
            if (i % 97 == 0) {
                CHECK_OK(gqp_profile_name_greenlet(a.p, 1 + (r % 50),
                                                   "worker", "mod.fn"));
            }
            prev = to;
        }
        CHECK_OK(gqp_tracer_call(t, 0x1000 + (r >> 20) % 8));
        CHECK_OK(gqp_tracer_call(t, 0x2000 + (r >> 24) % 8));
        CHECK_OK(gqp_tracer_return(t));
        CHECK_OK(gqp_tracer_return(t));
        if (i % 5000 == 4999) {
            CHECK_OK(gqp_profile_clear(a.p));
        }
        pthread_mutex_unlock(&a.mu);
    }
    atomic_store(&a.done, 1);
    pthread_join(reader, NULL);
    CHECK(a.reads > 0, "the reader never ran");
    gqp_tracer_free(t);
    gqp_profile_free(a.p);
    pthread_mutex_destroy(&a.mu);
    return 0;
}

/* ---- 6. running_since from a watchdog thread ---------------------------- */

typedef struct wd_arg {
    gqp_tracer *t;
    _Atomic int done;
    _Atomic uint64_t min_id, max_id;   /* ids the owner thread made */
    uint64_t reads, found, long_seen, bad;
    int64_t first_ns;
} wd_arg;

static void *watchdog(void *argp)
{
    wd_arg *a = argp;
    int64_t prev_start = 0;
    struct timespec pause = {0, 20000};
    while (!atomic_load(&a->done)) {
        int64_t start = 0;
        uint64_t id = 0;
        int rc = gqp_tracer_running_since(a->t, &start, &id);
        int64_t now = gqp_clock_wall_ns();
        a->reads++;
        if (rc == GQP_ENOTFOUND) {
            continue;
        }
        CHECK(rc == GQP_OK, "running_since %d", rc);
        a->found++;
        /* One atomic written with increasing values: a reader never sees
         * it go back, and never a time in the future. */
        if (start < prev_start || start > now || start < a->first_ns ||
            id == 0) {
            a->bad++;
        }
        prev_start = start;
        if (now - start >= 1000000) {
            a->long_seen++;
        }
        nanosleep(&pause, NULL);
    }
    return NULL;
}

static int test_running_since_watchdog(void)
{
    static wd_arg a;
    memset(&a, 0, sizeof a);
    CHECK_OK(gqp_tracer_new(&a.t));
    if (!a.t) {
        return 0;
    }
    CHECK_OK(gqp_tracer_set(a.t, GQP_TRACER_LONG_SPAN_NS, 1000000));
    a.first_ns = gqp_clock_wall_ns();
    pthread_t wd;
    pthread_create(&wd, NULL, watchdog, &a);
    uint64_t prev = 0;
    uint64_t min_id = UINT64_MAX, max_id = 0;
    for (int round = 0; round < 20; round++) {
        for (int i = 0; i < 2000; i++) {
            uint64_t to = (uint64_t)(i % 16 + 1) * 64;
            if (to == prev) {
                continue;
            }
            CHECK_OK(gqp_tracer_switch(a.t, prev, to, 0));
            uint64_t id = 0;
            CHECK_OK(gqp_tracer_greenlet_id(a.t, to, &id));
            min_id = id < min_id ? id : min_id;
            max_id = id > max_id ? id : max_id;
            prev = to;
        }
        /* One greenlet holds the loop for 3 ms: the watchdog can see it. */
        spin_ns(3000000);
        if (round % 5 == 4) {
            /* Idle: nothing running, then a fresh start. */
            CHECK_OK(gqp_tracer_flush(a.t));
            prev = 0;
        }
    }
    CHECK_OK(gqp_tracer_flush(a.t));
    atomic_store(&a.done, 1);
    pthread_join(wd, NULL);
    int64_t start;
    uint64_t id;
    CHECK(gqp_tracer_running_since(a.t, &start, &id) == GQP_ENOTFOUND,
          "running after flush");
    CHECK(a.bad == 0, "%" PRIu64 " inconsistent running_since readings",
          a.bad);
    CHECK(a.found > 0, "the watchdog never saw a running greenlet "
          "(%" PRIu64 " reads)", a.reads);
    (void)min_id;
    (void)max_id;
    printf("  watchdog: %" PRIu64 " reads, %" PRIu64 " with a running "
           "greenlet, %" PRIu64 " >= 1 ms\n", a.reads, a.found, a.long_seen);
    gqp_tracer_free(a.t);
    return 0;
}

/* ---- runner ------------------------------------------------------------- */

typedef struct tcase {
    const char *name;
    int (*fn)(void);
} tcase;

int main(void)
{
    static const tcase cases[] = {
        {"static_functions_from_threads", test_static_functions},
        {"greenlet_ids_unique_across_threads", test_greenlet_ids_unique},
        {"tracer_per_thread_full_speed", test_tracer_per_thread},
        {"shared_profile_retain_free", test_shared_profile_refcount},
        {"profile_read_by_other_thread_with_mutex",
         test_reader_thread_with_mutex},
        {"running_since_from_watchdog_thread", test_running_since_watchdog},
    };
    int passed = 0, failed = 0;
    printf("libgreqprof %s thread tests (ThreadSanitizer)\n",
           gqp_version_string());
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int before = atomic_load(&g_check_failures);
        int64_t t0 = gqp_clock_wall_ns();
        cases[i].fn();
        double secs = (double)(gqp_clock_wall_ns() - t0) / 1e9;
        if (atomic_load(&g_check_failures) == before) {
            passed++;
            printf("ok   %-48s %7.3fs\n", cases[i].name, secs);
        } else {
            failed++;
            printf("FAIL %-48s\n", cases[i].name);
        }
        fflush(stdout);
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed == 0 && passed > 0 ? 0 : 1;
}
