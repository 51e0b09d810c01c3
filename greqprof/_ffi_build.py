"""cffi API-mode build of greqprof._core: libgreqprof plus the CPython hooks.

Run by setuptools through ``cffi_modules`` (see setup.py).
"""
import glob
import os

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LIB = os.path.join(ROOT, "libgreqprof")
LIB_SOURCES = ["alloc.c", "calls.c", "clock.c", "error.c", "map.c", "profile.c",
               "spans.c", "tracer.c"]

CDEF = """
#define GQP_VERSION_NUMBER ...
#define GQP_OK ...
#define GQP_EINVAL ...
#define GQP_ENOMEM ...
#define GQP_ESTATE ...
#define GQP_ERANGE ...
#define GQP_EHANDLE ...
#define GQP_ENOTFOUND ...
#define GQP_ELIMIT ...
#define GQP_SPAN_FINISHED ...
#define GQP_SPAN_SPLIT ...
#define GQP_SPAN_LONG ...
#define GQP_SPAN_CONTINUED ...
#define GQP_KEEP_FIRST ...
#define GQP_KEEP_LAST ...
#define GQP_CPU_OFF ...
#define GQP_CPU_ESTIMATE ...
#define GQP_CPU_EXACT ...
#define GQP_CLOCK_CPU ...
#define GQP_CLOCK_WALL ...
#define GQP_CLOCK_TRACER ...
#define GQP_PY_CALLS ...
#define GQP_PY_BUILTINS ...
#define GQP_PY_INHERIT ...
#define GQP_PY_STACKS ...
#define GQP_PY_CALLS_LATER ...

typedef enum { GQP_PROFILE_MAX_SPANS, GQP_PROFILE_SPAN_POLICY,
    GQP_PROFILE_MAX_FUNCS, GQP_PROFILE_MAX_EDGES, GQP_PROFILE_MAX_GREENLETS,
    GQP_PROFILE_MAX_NAME, GQP_PROFILE_CALL_CLOCK, ... } gqp_profile_param;
typedef enum { GQP_TRACER_CPU_MODE, GQP_TRACER_CPU_WINDOW_NS,
    GQP_TRACER_CALL_CLOCK, GQP_TRACER_LONG_SPAN_NS, GQP_TRACER_MAX_DEPTH,
    GQP_TRACER_MAX_GREENLETS, GQP_TRACER_HISTORY,
    GQP_TRACER_CPU_WINDOW_OTHERS_NS, ... } gqp_tracer_param;

typedef struct gqp_profile gqp_profile;
typedef struct gqp_tracer gqp_tracer;
typedef struct gqp_py_thread gqp_py_thread;

typedef struct gqp_span {
    uint64_t greenlet_id; int64_t start_ns; int64_t end_ns; int64_t cpu_ns;
    uint32_t flags; uint32_t tag;
} gqp_span;
typedef struct gqp_greenlet_stat {
    uint64_t greenlet_id; int64_t wall_ns; int64_t cpu_ns; uint64_t switches;
    int64_t first_ns; int64_t last_ns; uint32_t finished; uint32_t reserved;
    const char *name; const char *fn_name;
} gqp_greenlet_stat;
typedef struct gqp_func_stat {
    uint64_t key; uint64_t ncall; uint64_t nactual; int64_t ttot_ns;
    int64_t tsub_ns;
} gqp_func_stat;
typedef struct gqp_edge_stat {
    uint64_t caller_key; uint64_t callee_key; uint64_t ncall;
    uint64_t nactual; int64_t ttot_ns; int64_t tsub_ns;
} gqp_edge_stat;

unsigned gqp_version(void);
const char *gqp_version_string(void);
const char *gqp_strerror(int code);
const char *gqp_err_name(int code);
int64_t gqp_clock_wall_ns(void);
int64_t gqp_clock_epoch_ns(void);
int64_t gqp_clock_thread_cpu_ns(void);

int gqp_profile_new(gqp_profile **out);
int gqp_profile_set(gqp_profile *p, gqp_profile_param param, int64_t value);
int gqp_profile_get(const gqp_profile *p, gqp_profile_param param,
                    int64_t *value);
void gqp_profile_free(gqp_profile *p);
int gqp_profile_close(gqp_profile *p);
int gqp_profile_is_closed(const gqp_profile *p);
int gqp_profile_clear(gqp_profile *p);
size_t gqp_profile_span_count(const gqp_profile *p);
uint64_t gqp_profile_spans_dropped(const gqp_profile *p);
int gqp_profile_longest_span(const gqp_profile *p, gqp_span *out);
int gqp_profile_longest_cpu_span(const gqp_profile *p, gqp_span *out);
size_t gqp_profile_greenlet_count(const gqp_profile *p);
uint64_t gqp_profile_greenlets_dropped(const gqp_profile *p);
size_t gqp_profile_func_count(const gqp_profile *p);
size_t gqp_profile_edge_count(const gqp_profile *p);
uint64_t gqp_profile_calls_dropped(const gqp_profile *p);
int64_t gqp_profile_epoch_origin(const gqp_profile *p);
int64_t gqp_profile_wall_origin(const gqp_profile *p);

int gqp_tracer_new(gqp_tracer **out);
void gqp_tracer_free(gqp_tracer *t);
int gqp_tracer_set(gqp_tracer *t, gqp_tracer_param param, int64_t value);
int gqp_tracer_get(const gqp_tracer *t, gqp_tracer_param param,
                   int64_t *value);
int gqp_tracer_set_default(gqp_tracer *t, gqp_profile *p);
int gqp_tracer_set_session(gqp_tracer *t, gqp_profile *p);
int gqp_tracer_attach(gqp_tracer *t, uint64_t greenlet, gqp_profile *p);
int gqp_tracer_set_spawn_profile(gqp_tracer *t, uint64_t greenlet,
                                 gqp_profile *p);
size_t gqp_profile_attached(const gqp_profile *p);
int gqp_tracer_greenlet_id(const gqp_tracer *t, uint64_t key, uint64_t *id);
int gqp_tracer_running_since(const gqp_tracer *t, int64_t *start_ns,
                             uint64_t *id);
int gqp_tracer_flush(gqp_tracer *t);
size_t gqp_tracer_greenlet_count(const gqp_tracer *t);
int gqp_tracer_waited(const gqp_tracer *t, const gqp_profile *mine,
                      int64_t start_ns, int64_t end_ns, int64_t *total_ns,
                      uint64_t *ids, int64_t *ns, size_t n, int *complete);

int gqp_py_init(void);
gqp_py_thread *gqp_py_thread_start(gqp_tracer *t, int flags, int *err);
int gqp_py_thread_stop(gqp_py_thread *st);
int gqp_py_calls(gqp_py_thread *st, int on);
int gqp_py_reinstall_calls(gqp_py_thread *st);
void gqp_py_thread_free(gqp_py_thread *st);
uint32_t gqp_py_capture_thread(unsigned long thread_id);
int gqp_py_sampler_init(void);
int gqp_py_inject_alloc_failures(long after, long count);
long gqp_py_alloc_failures_left(void);
size_t gqp_py_read_spans(gqp_profile *p, gqp_span *out, size_t n);
size_t gqp_py_read_funcs(gqp_profile *p, gqp_func_stat *out, size_t n);
size_t gqp_py_read_edges(gqp_profile *p, gqp_edge_stat *out, size_t n);
size_t gqp_py_read_greenlets(gqp_profile *p, gqp_greenlet_stat *out,
                             size_t n);
int gqp_render_init(void);
"""

# _hooks.c #includes its parts from _hooks/ (one translation unit).
HOOK_PARTS = sorted(glob.glob(os.path.join(HERE, "_hooks", "*.[ch]")))

ffi = FFI()
ffi.cdef(CDEF)
ffi.set_source(
    "greqprof._core",
    '#include "greqprof.h"\n#include "_hooks.c"\n#include "_fastpath.c"\n#include "_sampled.c"\n'
    '#include "_routes.c"\n'
    '#include "_render.c"\n',
    sources=[os.path.relpath(os.path.join(LIB, s), ROOT) for s in LIB_SOURCES],
    include_dirs=[os.path.join(LIB, "include"), LIB, HERE],
    # _core.c only #includes these: rebuild when they change.
    depends=[os.path.relpath(p, ROOT) for p in (
        os.path.join(HERE, "_hooks.c"), *HOOK_PARTS,
        os.path.join(HERE, "_fastpath.c"),
        os.path.join(HERE, "_sampled.c"), os.path.join(HERE, "_render.c"),
        os.path.join(HERE, "_routes.c"),
        os.path.join(HERE, "_compat.h"),
        os.path.join(LIB, "include",
                                                     "greqprof.h"),
        os.path.join(LIB, "internal.h"))],
    # The hooks use the full C API (frames, tracing), not the limited one.
    # cffi >= 2.0 turns py_limited_api=False into this macro itself; before
    # 2.0 the generated _core.c defines Py_LIMITED_API unless it is set.
    py_limited_api=False,
    define_macros=[("_CFFI_NO_LIMITED_API", None)],
    extra_compile_args=["-std=gnu11", "-O2", "-fvisibility=hidden",
                        "-Wall", "-Wno-unused-function"],
)

if __name__ == "__main__":
    ffi.compile(verbose=True)
