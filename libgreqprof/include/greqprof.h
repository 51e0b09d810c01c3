/*
 * greqprof.h -- the public API of libgreqprof.
 *
 * libgreqprof does the accounting for a greenlet-aware profiler: it turns a
 * stream of events ("greenlet A switched to greenlet B", "function F was
 * called", "F returned") into execution spans, per-greenlet totals and
 * function statistics.  It knows nothing about Python: greenlets and
 * functions are opaque non-zero 64-bit keys chosen by the caller (the Python
 * binding uses object addresses).
 *
 * Objects
 *   gqp_profile  a container of results: spans, greenlet totals, function
 *                and caller->callee statistics.  Reference counted.
 *   gqp_tracer   the per-OS-thread event sink.  It owns the table of live
 *                greenlets with their call stacks and routes each event to
 *                the profile the running greenlet is attached to.
 *
 * Conventions
 *   - Functions returning int return GQP_OK (0) or a negative GQP_E* code;
 *     event functions return a non-negative set of GQP_EV_* flags on success.
 *   - Every free/release function accepts NULL.
 *   - Nothing returned points into memory the caller must free unless the
 *     function says so; strings returned by readers live as long as the
 *     profile that holds them.
 *
 * Thread safety
 *   A gqp_tracer must be used by one thread at a time (normally: the thread
 *   whose events it records).  A gqp_profile may be fed by one tracer and read
 *   by any thread provided the caller serialises reads with the tracer's
 *   events (the Python binding does so with the GIL).  gqp_version*,
 *   gqp_strerror, gqp_err_name and the gqp_clock_* functions are safe from any
 *   thread.  Greenlet ids come from one process-wide atomic counter, so ids
 *   are unique across tracers and threads.
 *
 * Misuse: what is detected and what is undefined
 *   Detected (the call changes nothing and returns the code; never a crash):
 *   - a NULL handle or NULL output pointer: GQP_EINVAL (counters and
 *     origins return 0; free/release functions accept NULL and do nothing;
 *     libgreqprof/tests/test_null.c calls every function so);
 *   - a zero greenlet or function key, an unknown option key, a flag or
 *     policy value outside its enum: GQP_EINVAL / GQP_ERANGE;
 *   - an option value outside its documented range (e.g. MAX_SPANS above
 *     2^32, a negative value): GQP_ERANGE;
 *   - an option set after data was recorded, an operation in the wrong
 *     state: GQP_ESTATE;
 *   - a read index past the end: GQP_ERANGE; a greenlet the tracer does
 *     not know: GQP_ENOTFOUND;
 *   - a handle whose magic number is not that of a live object of its type
 *     (a released profile or freed tracer overwrites it): GQP_EHANDLE.
 *     This is a best-effort check for debugging, not a guarantee: reading
 *     a freed handle is itself undefined (below), so it only catches a
 *     stale handle whose memory was not reused yet.
 *   - an allocation failure: GQP_ENOMEM with the object unchanged; a cap
 *     reached: data dropped and counted (GQP_ELIMIT or a counter).
 *   Undefined behaviour (the library cannot detect it; ASan, valgrind or a
 *   crash may report it, or memory may be silently corrupted):
 *   - using a handle after it was freed or its last reference released
 *     (use after free), including through a copy of the pointer; the
 *     GQP_EHANDLE check above reads freed memory and may pass or crash;
 *   - freeing or releasing a handle twice (double free), or more releases
 *     than retains;
 *   - a pointer that never came from this library, or a corrupted one;
 *   - concurrent use of one gqp_tracer from two threads, or reading a
 *     gqp_profile while a tracer feeds it, without the serialisation the
 *     "Thread safety" section asks for (data races);
 *   - output buffers smaller than the length passed with them, strings that
 *     are not NUL-terminated where a C string is expected;
 *   - changing the allocator (gqp_set_allocator) while objects made by the
 *     previous one are alive, or from several threads.
 */
#ifndef GREQPROF_H
#define GREQPROF_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- version ---------------------------------------------------------- */
#define GQP_VERSION_MAJOR 0
#define GQP_VERSION_MINOR 4
#define GQP_VERSION_PATCH 0
#define GQP_VERSION_NUMBER \
    (GQP_VERSION_MAJOR * 10000 + GQP_VERSION_MINOR * 100 + GQP_VERSION_PATCH)
#define GQP__STR2(x) #x
#define GQP__STR(x) GQP__STR2(x)
#define GQP_VERSION_STRING                                         \
    GQP__STR(GQP_VERSION_MAJOR) "." GQP__STR(GQP_VERSION_MINOR) "." \
    GQP__STR(GQP_VERSION_PATCH)

#if defined(_WIN32) && defined(GQP_BUILD_DLL)
#define GQP_API __declspec(dllexport)
#elif defined(__GNUC__) || defined(__clang__)
#define GQP_API __attribute__((visibility("default")))
#else
#define GQP_API
#endif

/* GQP_VERSION_NUMBER of the library actually loaded. */
GQP_API unsigned gqp_version(void);
GQP_API const char *gqp_version_string(void);

/* ---- errors ----------------------------------------------------------- */
/* Fixed numbers: part of the ABI. */
#define GQP_OK 0
#define GQP_EINVAL (-1)   /* an argument is invalid (NULL, zero key, ...)   */
#define GQP_ENOMEM (-2)   /* an allocation failed; nothing was changed      */
#define GQP_ESTATE (-3)   /* not allowed in the object's current state      */
#define GQP_ERANGE (-4)   /* index or value out of range                    */
#define GQP_EHANDLE (-5)  /* the handle is not a live object of that type   */
#define GQP_ENOTFOUND (-6) /* no such greenlet / entry                      */
#define GQP_ELIMIT (-7)   /* a configured cap was reached; data was dropped */
#define GQP__ELAST (-7)

/* A static English sentence for an error code ("unknown error" otherwise). */
GQP_API const char *gqp_strerror(int code);
/* The code's name, e.g. "GQP_ENOMEM". */
GQP_API const char *gqp_err_name(int code);

/* ---- memory ----------------------------------------------------------- */
/* Where the library gets memory.  Process-wide; set it before creating any
 * object (objects must be freed with the allocator that made them).  NULL
 * restores malloc/realloc/free.  Used for embedding and for injecting
 * allocation failures in tests.  Not thread-safe against concurrent use of
 * the library. */
typedef struct gqp_allocator {
    void *(*malloc_fn)(void *ctx, size_t size);
    void *(*realloc_fn)(void *ctx, void *ptr, size_t size);
    void (*free_fn)(void *ctx, void *ptr);
    void *ctx;
} gqp_allocator;

GQP_API int gqp_set_allocator(const gqp_allocator *a);

/* ---- clocks (nanoseconds) -------------------------------------------- */
/* Monotonic wall clock; cheap (vDSO on Linux). */
GQP_API int64_t gqp_clock_wall_ns(void);
/* Wall clock as nanoseconds since the Unix epoch. */
GQP_API int64_t gqp_clock_epoch_ns(void);
/* CPU time consumed by the calling thread; a system call on Linux (~300 ns),
 * so the tracer reads it sparingly (see GQP_TRACER_CPU_MODE). Falls back to
 * process CPU time where per-thread time is unavailable. */
GQP_API int64_t gqp_clock_thread_cpu_ns(void);

/* A clock the tracer can read instead of the real ones (tests, replays). */
typedef int64_t (*gqp_clock_fn)(void *ctx);

/* ---- spans ------------------------------------------------------------ */
/* One uninterrupted run of one greenlet between two switches. */
typedef struct gqp_span {
    uint64_t greenlet_id; /* id assigned by the tracer (never 0)           */
    int64_t start_ns;     /* wall clock (gqp_clock_wall_ns domain)         */
    int64_t end_ns;
    int64_t cpu_ns;       /* CPU time of the span; -1 when not measured    */
    uint32_t flags;       /* GQP_SPAN_*                                    */
    uint32_t tag;         /* caller data (e.g. a stack id), 0 = none       */
} gqp_span;

#define GQP_SPAN_FINISHED 0x1u /* the greenlet ended at the end of the span  */
#define GQP_SPAN_SPLIT 0x2u    /* ended by attach/detach/flush, not a switch */
#define GQP_SPAN_LONG 0x4u     /* wall >= the tracer's long-span threshold   */
#define GQP_SPAN_CONTINUED 0x8u /* did not begin with a switch: tracing
                                   started mid-run, or a split continued
                                   the run of the span before it           */

/* ---- profiles --------------------------------------------------------- */
typedef struct gqp_profile gqp_profile;

typedef enum gqp_profile_param {
    GQP_PROFILE_MAX_SPANS = 1,     /* spans kept (default 10000, 0 = none)  */
    GQP_PROFILE_SPAN_POLICY = 2,   /* GQP_KEEP_FIRST (default)/GQP_KEEP_LAST */
    GQP_PROFILE_MAX_FUNCS = 3,     /* distinct functions (default 65536)    */
    GQP_PROFILE_MAX_EDGES = 4,     /* caller->callee pairs (default 262144) */
    GQP_PROFILE_MAX_GREENLETS = 5, /* greenlet totals kept (default 65536)  */
    GQP_PROFILE_MAX_NAME = 6,      /* bytes kept of a name (default 255)    */
    GQP_PROFILE_MAX_WAIT_SITES = 7, /* wait sites kept (default 256, 0 = no
                                       wait accounting; since 0.2)        */
    GQP_PROFILE_MAX_WAIT_EVENTS = 8, /* waits kept one by one (default 1024,
                                       the first ones; 0 = none; 0.2)     */
    /* The clock this profile's call statistics are timed with:
     * GQP_CLOCK_TRACER (default: the tracer's GQP_TRACER_CALL_CLOCK),
     * GQP_CLOCK_CPU or GQP_CLOCK_WALL.  Profiles with different clocks can
     * share one tracer (and a session profile can differ from the profile
     * a greenlet is attached to): each frame is timed with the clock of
     * the profile it is recorded in.  GQP_CLOCK_CPU needs a tracer CPU
     * mode other than GQP_CPU_OFF (with it off, CPU time advances like wall
     * time).  Since 0.4. */
    GQP_PROFILE_CALL_CLOCK = 9
} gqp_profile_param;

#define GQP_KEEP_FIRST 0
#define GQP_KEEP_LAST 1

/* Creates an open profile with one reference, owned by the caller. */
GQP_API int gqp_profile_new(gqp_profile **out);
/* Caps may only be set before the profile receives data (GQP_ESTATE). */
GQP_API int gqp_profile_set(gqp_profile *p, gqp_profile_param param,
                            int64_t value);
GQP_API int gqp_profile_get(const gqp_profile *p, gqp_profile_param param,
                            int64_t *value);
/* Reference counting: tracers hold a reference to each profile a greenlet
 * is attached to.  gqp_profile_free drops the caller's reference. */
GQP_API int gqp_profile_retain(gqp_profile *p);
GQP_API void gqp_profile_free(gqp_profile *p);
/* Closes the profile: no more data is accepted.  Greenlets still attached
 * to it are detached at their next event and go back to their tracer's
 * default profile.  Closing twice returns GQP_ESTATE. */
GQP_API int gqp_profile_close(gqp_profile *p);
GQP_API int gqp_profile_is_closed(const gqp_profile *p);
/* Number of live greenlets whose spans currently go to the profile. */
GQP_API size_t gqp_profile_attached(const gqp_profile *p);
/* Number of references held (retain/new minus free); 0 for an invalid
 * handle.  (since 0.2) */
GQP_API size_t gqp_profile_refs(const gqp_profile *p);
/* Empties the profile's data (caps and open/closed state are kept). */
GQP_API int gqp_profile_clear(gqp_profile *p);

/* Spans: count kept, counted-but-dropped, and read by index (0 = oldest). */
GQP_API size_t gqp_profile_span_count(const gqp_profile *p);
GQP_API uint64_t gqp_profile_spans_dropped(const gqp_profile *p);
GQP_API int gqp_profile_span(const gqp_profile *p, size_t i, gqp_span *out);
/* Tag the i-th kept span (e.g. with a stack id); GQP_ERANGE if gone. */
GQP_API int gqp_profile_span_set_tag(gqp_profile *p, size_t i, uint32_t tag);
/* Longest span by wall time, and longest by CPU time (GQP_ENOTFOUND when
 * the profile has no span).  Kept even when the span itself was dropped. */
GQP_API int gqp_profile_longest_span(const gqp_profile *p, gqp_span *out);
GQP_API int gqp_profile_longest_cpu_span(const gqp_profile *p, gqp_span *out);

/* Per-greenlet totals. */
typedef struct gqp_greenlet_stat {
    uint64_t greenlet_id;
    int64_t wall_ns;       /* sum of the greenlet's span wall times        */
    int64_t cpu_ns;        /* sum of span CPU times; -1 when not measured  */
    uint64_t switches;     /* times it was switched to (spans that began
                              with a switch)                              */
    int64_t first_ns;      /* start of its first span                      */
    int64_t last_ns;       /* end of its last span                         */
    uint32_t finished;     /* 1 once the greenlet ended                    */
    uint32_t reserved;
    const char *name;      /* "" when not named; owned by the profile      */
    const char *fn_name;
} gqp_greenlet_stat;

GQP_API size_t gqp_profile_greenlet_count(const gqp_profile *p);
GQP_API uint64_t gqp_profile_greenlets_dropped(const gqp_profile *p);
GQP_API int gqp_profile_greenlet(const gqp_profile *p, size_t i,
                                 gqp_greenlet_stat *out);
/* Names a greenlet (copies both strings, truncated to GQP_PROFILE_MAX_NAME);
 * creates its entry when needed.  NULL leaves a name unchanged. */
GQP_API int gqp_profile_name_greenlet(gqp_profile *p, uint64_t greenlet_id,
                                      const char *name, const char *fn_name);

/* Function statistics, cProfile semantics: ncall counts every call,
 * nactual the non-recursive (outermost) ones; ttot is inclusive time counted
 * once per outermost frame, tsub exclusive time.  Times use the profile's
 * call clock (GQP_PROFILE_CALL_CLOCK; by default the tracer's,
 * GQP_TRACER_CALL_CLOCK). */
typedef struct gqp_func_stat {
    uint64_t key;
    uint64_t ncall;
    uint64_t nactual;
    int64_t ttot_ns;
    int64_t tsub_ns;
} gqp_func_stat;

typedef struct gqp_edge_stat {
    uint64_t caller_key;
    uint64_t callee_key;
    uint64_t ncall;
    uint64_t nactual;
    int64_t ttot_ns;
    int64_t tsub_ns;
} gqp_edge_stat;

GQP_API size_t gqp_profile_func_count(const gqp_profile *p);
GQP_API int gqp_profile_func(const gqp_profile *p, size_t i,
                             gqp_func_stat *out);
GQP_API size_t gqp_profile_edge_count(const gqp_profile *p);
GQP_API int gqp_profile_edge(const gqp_profile *p, size_t i,
                             gqp_edge_stat *out);
/* Calls not recorded because a cap (functions, edges, stack depth) was hit. */
GQP_API uint64_t gqp_profile_calls_dropped(const gqp_profile *p);

/* Wait sites (since 0.2): where the profile's greenlets waited.  Each time
 * a greenlet attached to the profile switches out, the tracer asks the
 * caller where (GQP_EV_WAIT, gqp_tracer_wait_at); the wall time until the
 * greenlet runs again is charged to that site when it does.  The table
 * holds GQP_PROFILE_MAX_WAIT_SITES sites, in order of first use; waits at
 * sites past the cap are counted in gqp_profile_waits_dropped. */
typedef struct gqp_wait_stat {
    uint64_t site;      /* the caller's key of the site (never 0)         */
    int64_t wait_ns;    /* wall time from switch-outs to switch-ins       */
    uint64_t count;     /* waits charged (switch-outs that resumed)       */
    uint64_t greenlets; /* distinct greenlets charged (counted up to
                           65536 (greenlet, site) pairs per profile)      */
    uint32_t tag;       /* caller data (e.g. a stack id), 0 = none        */
    uint32_t reserved;
} gqp_wait_stat;

GQP_API size_t gqp_profile_wait_count(const gqp_profile *p);
GQP_API int gqp_profile_wait(const gqp_profile *p, size_t i,
                             gqp_wait_stat *out);
/* Tag the i-th site (e.g. with the id of its formatted stack). */
GQP_API int gqp_profile_wait_set_tag(gqp_profile *p, size_t i, uint32_t tag);
/* Switch-outs not recorded because the site table was full. */
GQP_API uint64_t gqp_profile_waits_dropped(const gqp_profile *p);

/* The waits one by one, in the order they ended (the first
 * GQP_PROFILE_MAX_WAIT_EVENTS; the others are counted): when each greenlet
 * waited, and where. */
typedef struct gqp_wait_event {
    uint64_t greenlet_id;
    int64_t start_ns;   /* switch-out (wall clock)                        */
    int64_t end_ns;     /* switch-in                                      */
    uint32_t site;      /* index of its site (gqp_profile_wait)           */
    uint32_t reserved;
} gqp_wait_event;

GQP_API size_t gqp_profile_wait_event_count(const gqp_profile *p);
GQP_API int gqp_profile_wait_event(const gqp_profile *p, size_t i,
                                   gqp_wait_event *out);
GQP_API uint64_t gqp_profile_wait_events_dropped(const gqp_profile *p);

/* Epoch time of the profile's clock origin: add to a span's start_ns and
 * subtract the value of gqp_profile_wall_origin to get epoch nanoseconds. */
GQP_API int64_t gqp_profile_epoch_origin(const gqp_profile *p);
GQP_API int64_t gqp_profile_wall_origin(const gqp_profile *p);

/* ---- tracers ---------------------------------------------------------- */
typedef struct gqp_tracer gqp_tracer;

typedef enum gqp_tracer_param {
    /* GQP_CPU_OFF, GQP_CPU_ESTIMATE (default) or GQP_CPU_EXACT. */
    GQP_TRACER_CPU_MODE = 1,
    /* The thread CPU clock costs a system call, so it is read only when at
     * least this much wall time passed since the last reading (default
     * 100000 ns; GQP_CPU_EXACT also reads it at every switch).  Between
     * readings CPU time advances with wall time; each reading realigns the
     * estimate with the real clock.  Accuracy (docs/accuracy.md):
     *   GQP_CPU_EXACT:    spans exact; a frame within 2 windows.
     *   GQP_CPU_ESTIMATE: a span within 1 window; a frame within 1 window
     *                     per span it ran in, plus 1.
     * Estimates are clamped at 0. */
    GQP_TRACER_CPU_WINDOW_NS = 2,
    /* GQP_CLOCK_CPU (default) or GQP_CLOCK_WALL: how call times are taken.
     * CPU: a frame only accrues time while its own greenlet runs on CPU.
     * WALL: elapsed time, including time the greenlet was switched out.
     * A profile's own GQP_PROFILE_CALL_CLOCK wins over it (0.4). */
    GQP_TRACER_CALL_CLOCK = 3,
    /* Spans at least this long (wall) raise GQP_EV_LONG_SPAN (default 0 =
     * never). */
    GQP_TRACER_LONG_SPAN_NS = 4,
    GQP_TRACER_MAX_DEPTH = 5,     /* frames kept per greenlet (default 1024) */
    GQP_TRACER_MAX_GREENLETS = 6, /* live greenlets tracked (default 1<<20)  */
    GQP_TRACER_HISTORY = 7,       /* recent spans of all greenlets kept for
                                     gqp_tracer_waited (default 4096)       */
    /* The CPU window (as GQP_TRACER_CPU_WINDOW_NS) for the spans of
     * greenlets attached to no profile while no default or session profile
     * is set (default 0: the same window).  A wider one spares them the
     * clock's system calls while a narrow window serves a profile's
     * greenlets: the span of a greenlet in a profile starts and ends with
     * the narrow window; a new greenlet's first span starts with the wide
     * one and, when gqp_tracer_inherit gives it a profile, is set then
     * on a reading of the clock less the wall time since it began.  May
     * change at any time. */
    GQP_TRACER_CPU_WINDOW_OTHERS_NS = 8
} gqp_tracer_param;

#define GQP_CPU_OFF 0
#define GQP_CPU_ESTIMATE 1
#define GQP_CPU_EXACT 2
#define GQP_CLOCK_CPU 0
#define GQP_CLOCK_WALL 1
#define GQP_CLOCK_TRACER 2 /* GQP_PROFILE_CALL_CLOCK: the tracer's (0.4) */

/* Flags in the non-negative result of event functions. */
#define GQP_EV_NEW_GREENLET 0x1 /* the target was seen for the first time   */
#define GQP_EV_LONG_SPAN 0x2    /* the span just closed is long; see
                                   gqp_tracer_last_span                     */
#define GQP_EV_NEW_FUNC 0x4     /* the function is new in its profile       */
#define GQP_EV_DROPPED 0x8      /* data was dropped (a cap was reached)     */
#define GQP_EV_WAIT 0x10        /* the origin of the switch is attached to a
                                   profile that accounts waits: say where it
                                   waits with gqp_tracer_wait_at (0.2)      */
#define GQP_EV_NEW_SITE 0x20    /* gqp_tracer_wait_at: the site is new in
                                   its profile (0.2)                        */

/* Flags for gqp_tracer_switch. */
#define GQP_SWITCH_FROM_DEAD 0x1 /* the origin greenlet has finished         */

GQP_API int gqp_tracer_new(gqp_tracer **out);
GQP_API void gqp_tracer_free(gqp_tracer *t);
/* Parameters may be changed only while no greenlet is running (before the
 * first event or after gqp_tracer_flush), else GQP_ESTATE;
 * GQP_TRACER_LONG_SPAN_NS and GQP_TRACER_CPU_WINDOW_NS may be changed at any
 * time (a narrower window reads the real clock at the next event). */
GQP_API int gqp_tracer_set(gqp_tracer *t, gqp_tracer_param param,
                           int64_t value);
GQP_API int gqp_tracer_get(const gqp_tracer *t, gqp_tracer_param param,
                           int64_t *value);
/* Replace the clocks (NULL restores the real one).  Same state rule. */
GQP_API int gqp_tracer_set_clocks(gqp_tracer *t, gqp_clock_fn wall,
                                  gqp_clock_fn cpu, void *ctx);
/* Profile for greenlets not attached to another one (NULL: record nothing
 * for them).  Takes a reference. */
GQP_API int gqp_tracer_set_default(gqp_tracer *t, gqp_profile *p);

/* A profile that receives the spans and calls of every greenlet of the
 * tracer, also of those whose data goes to another profile (attached to
 * one) or to none: a whole-thread view kept while per-greenlet profiles go
 * on, which see exactly what they would without it.  A greenlet whose
 * data goes to the session profile itself is recorded there once.  Calls
 * of greenlets routed elsewhere are tracked on a second call stack per
 * greenlet (allocated at its first such call, freed with it; same
 * GQP_TRACER_MAX_DEPTH); at an attach both stacks are split alike.  Waits,
 * span tags and greenlet names stay with the greenlet's own profile.
 * NULL: none (the default).  Takes a reference; may be changed at any
 * time (the session stacks then start afresh).  Costs nothing per event
 * while unset beyond a test.  (since 0.3) */
GQP_API int gqp_tracer_set_session(gqp_tracer *t, gqp_profile *p);

/* Events.  `from` may be 0 for "nothing was running" (the first event, or
 * the first after a flush): the target's span then has GQP_SPAN_CONTINUED
 * (tracing began while it ran) and does not count as a switch. */
GQP_API int gqp_tracer_switch(gqp_tracer *t, uint64_t from, uint64_t to,
                              unsigned flags);
GQP_API int gqp_tracer_call(gqp_tracer *t, uint64_t func);
GQP_API int gqp_tracer_return(gqp_tracer *t);

/* Routes a greenlet's future spans and calls to p (NULL: back to the
 * default).  When the greenlet is running, its current span is split at
 * this instant so p receives only the part after it (the part before goes
 * where the greenlet was routed, with its open frames unwound into it).
 * Its call stack starts afresh: frames entered before are not charged to
 * p.  Returns GQP_OK, or GQP_EV_LONG_SPAN (> 0) when the span it split was
 * long (see gqp_tracer_last_span), or a negative error. */
GQP_API int gqp_tracer_attach(gqp_tracer *t, uint64_t greenlet,
                              gqp_profile *p);
/* Gives child the profile of parent (used when child is first seen): the
 * parent's spawn profile when one is set, else its profile.  The parent may
 * have died already: the last 256 dead greenlets that had a profile are
 * remembered by key until the key is seen alive again (the caller must only
 * pass a parent object that still exists, so its key is not reused). */
GQP_API int gqp_tracer_inherit(gqp_tracer *t, uint64_t child, uint64_t parent);
/* 1 when gqp_tracer_inherit could give a child a profile now (a greenlet
 * is attached to one or has a spawn profile, or a remembered dead one
 * had one), else 0 (inherit would leave the child in no profile: a
 * caller may skip finding its parent); GQP_EHANDLE for a bad tracer. */
GQP_API int gqp_tracer_can_inherit(const gqp_tracer *t);
/* Sets the profile that greenlets spawned by `greenlet` inherit, apart from
 * where its own spans go (NULL: the same as its profile).  Lets a request's
 * children started after the request greenlet was detached still join the
 * request's profile.  Cleared by gqp_tracer_attach. */
GQP_API int gqp_tracer_set_spawn_profile(gqp_tracer *t, uint64_t greenlet,
                                         gqp_profile *p);
/* The running greenlet: key, id and profile (any pointer may be NULL).
 * GQP_ENOTFOUND when no greenlet is running. */
GQP_API int gqp_tracer_current(const gqp_tracer *t, uint64_t *key,
                               uint64_t *id, gqp_profile **profile);
/* The open profile a live greenlet is attached to (NULL: none, its spans
 * go to the default), borrowed; GQP_ENOTFOUND for a greenlet not tracked.
 * Lets a caller detach a greenlet only from its own profile. */
GQP_API int gqp_tracer_greenlet_profile(const gqp_tracer *t, uint64_t key,
                                        gqp_profile **profile);
/* Id of a live greenlet by key. */
GQP_API int gqp_tracer_greenlet_id(const gqp_tracer *t, uint64_t key,
                                   uint64_t *id);
/* The span closed by the last switch/attach (out is required), with the
 * profile it went to (may be NULL) and its index there (SIZE_MAX when not
 * kept); profile and index may be NULL. */
GQP_API int gqp_tracer_last_span(const gqp_tracer *t, gqp_span *out,
                                 gqp_profile **profile, size_t *index);
/* Start of the running greenlet's current span (wall ns) and its id. */
GQP_API int gqp_tracer_running_since(const gqp_tracer *t, int64_t *start_ns,
                                     uint64_t *id);
/* Forget a greenlet (e.g. it was collected without a final switch). */
GQP_API int gqp_tracer_forget(gqp_tracer *t, uint64_t greenlet);
/* Closes the running span and unwinds every call stack into the profiles,
 * as if everything stopped now (pending waits are charged up to now).  The tracer is then idle (no greenlet
 * running) and may be reconfigured or fed again. */
GQP_API int gqp_tracer_flush(gqp_tracer *t);
/* gqp_tracer_flush with flags.  GQP_FLUSH_FOREIGN: called from a thread
 * other than the one whose events the tracer records (the caller
 * serialises with it): the thread CPU clock is not read, since it would be
 * the caller's; the running span gets the CPU time estimated at the
 * tracer's last event. */
GQP_API int gqp_tracer_flush_ex(gqp_tracer *t, unsigned flags);
#define GQP_FLUSH_FOREIGN 0x1u
/* Where `greenlet`, just switched out (the switch returned GQP_EV_WAIT),
 * waits: `site` is a non-zero key of the caller's choosing (the Python
 * binding combines a code object and a line).  The time until the greenlet
 * runs again is charged to the site in the profile it is attached to, if
 * it is still attached to that profile then (a detached greenlet, a closed
 * or cleared profile, a greenlet that died: nothing is charged).  Returns
 * GQP_EV_NEW_SITE when the site is new in the profile (*profile and
 * *index, when not NULL, say where, for gqp_profile_wait_set_tag; the
 * profile is borrowed), 0 when known,
 * GQP_EV_DROPPED when the profile's table is full (counted), or
 * GQP_EINVAL, GQP_ENOTFOUND (no wait pending for the greenlet), GQP_ENOMEM.
 * (since 0.2) */
GQP_API int gqp_tracer_wait_at(gqp_tracer *t, uint64_t greenlet,
                               uint64_t site, gqp_profile **profile,
                               size_t *index);
/* Number of live greenlets tracked. */
GQP_API size_t gqp_tracer_greenlet_count(const gqp_tracer *t);

/* Time other greenlets ran during [start_ns, end_ns] while greenlets of
 * `mine` (attached to it, or with totals in it) did not, from the tracer's
 * recent span history: the total, and the
 * top `n` greenlets by time written to ids[]/ns[].  Returns the number of
 * entries written; *complete is 0 when the history no longer reached back
 * to start_ns.  The history keeps the spans closed while some greenlet is
 * attached to a profile or a default or session profile is set (a span
 * closed while none is, in no profile, is not kept). */
GQP_API int gqp_tracer_waited(const gqp_tracer *t, const gqp_profile *mine,
                              int64_t start_ns, int64_t end_ns,
                              int64_t *total_ns, uint64_t *ids, int64_t *ns,
                              size_t n, int *complete);

#ifdef __cplusplus
}
#endif
#endif /* GREQPROF_H */
