/* _hooks/hooks.h -- what the parts of _hooks.c share: the thread state,
 * the hookref, the registry's objects fetched by gqp_py_init, limits, and
 * declarations of functions used before their part.  Included by
 * _hooks.c's parts only: they form one translation unit, so everything
 * here stays static. */
#ifndef GQP_HOOKS_H
#define GQP_HOOKS_H

#include <Python.h>
#include <frameobject.h>
#include <stdatomic.h>
#include <string.h>

#include "_compat.h"

#include "greqprof.h"

/* What the stack sampler's loop reads of a watched thread without the GIL
 * (sampler.c): the greenlet running there, written at each switch, and
 * its hub.  Slots are static: a stale read is harmless, never a freed
 * one. */
typedef struct gqp_smp_beacon {
    _Atomic uint64_t key;      /* 0: not known (the loop takes the GIL) */
    _Atomic uint64_t hub_key;
} gqp_smp_beacon;

/* greenlets switched out in greqprof's own work, per thread (calls.c) */
#define GQP_OWN_PARK 8

typedef struct gqp_py_thread {
    gqp_tracer *tracer;        /* borrowed: owned by the Python object */
    unsigned long thread_id;
    int active;
    int calls;
    int builtins;
    int inherit;
    int stacks;                /* capture a stack for long spans */
    int profile_installed;     /* the call hook is in the thread now */
    int calls_on;              /* wanted (gqp_py_calls): while a greenlet
                                  of a profile runs (calls.c, calls_follow) */
    uint64_t hub_key;          /* this thread's gevent hub, once seen */
    uint64_t hub_parent_key;   /* its parent then (where it goes dead) */
    uint64_t ctx_ver;          /* the thread's context_ver after our last
                                * switch: greenlet bumps it at every switch,
                                * so a change means one we did not see */
    int installed;             /* still referenced by its thread's hooks */
    PyObject *trace_fn;        /* our callable given to greenlet.settrace */
    PyObject *ref;             /* hookref pointing back here */
    PyObject *prev_trace;      /* what greenlet.settrace returned */
    Py_tracefunc prev_prof;    /* the thread's previous profile function */
    PyObject *prev_prof_obj;
    uint64_t gen;              /* unique per start: _fastpath.c's arming */
    struct gqp_note *notes;    /* requests of live greenlets (_fastpath.c) */
    int open_profiles;         /* sampled profiles open (_sampled.c) */
    int busy;                  /* hooks running on it (st_enter) */
    gqp_smp_beacon *beacon;    /* when the stack sampler watches it */
    int orphan;                /* freed while busy: the last st_leave frees */
    /* greqprof's own work (calls.c): the running greenlet's, and those of
     * greenlets that switched out in it */
    int own;                   /* calls are not recorded */
    int own_depth;             /* frames entered since own_work() */
    int own_parked;            /* entries in own_park */
    int own_next;              /* the entry replaced when it is full */
    struct gqp_own_park {
        uint64_t key, id;
        int depth;
    } own_park[GQP_OWN_PARK];
} gqp_py_thread;

/* The calling thread's state, for install/uninstall.  The hooks themselves
 * get their state from their `self`/`obj` argument (a hookref), which is
 * cheaper than a thread-local in a shared object. */
static _Thread_local gqp_py_thread *gqp__tls;

/* PyErr_Clear when an exception is set: the hot paths clear after lookups
 * that seldom fail, and PyErr_Clear with nothing set still costs a call
 * chain (~25 instructions, a dozen times per request). */
static inline void err_clear(void)
{
    if (PyErr_Occurred()) {
        PyErr_Clear();
    }
}

typedef struct {
    PyObject_HEAD
    gqp_py_thread *st;
    /* Once st is gone (NULL), what the hooks pass every event on to: the
     * hooks they had replaced.  A hook that another tool chained on top
     * of (gevent's monitor thread does) is left in place at stop, so its
     * chain is not broken; it then only forwards. */
    PyObject *fwd_trace;
    Py_tracefunc fwd_prof;
    PyObject *fwd_prof_obj;
} gqp_hookref;

/* Fetched from greqprof._registry by gqp_py_init. */
static PyObject *reg_codes;     /* func key -> code object | C-func info */
static PyObject *reg_stacks;    /* tag -> stack text */
static PyObject *reg_long;      /* list of long-span records */
static PyObject *reg_names;     /* greenlet id -> (name, fn_name) */
static PyObject *reg_hub_ids;   /* thread ident -> its hub's id */
static PyObject *greenlet_settrace;
static PyObject *greenlet_gettrace;
static PyObject *greenlet_getcurrent;
/* greenlet's `dead`, `gr_frame` and `parent` descriptors, called through
 * their type's __get__ slot: an attribute lookup per switch costs more. */
typedef struct {
    PyObject *descr;
    descrgetfunc get;
} gqp_getter;
static gqp_getter dead_getter;
static gqp_getter frame_getter;
static gqp_getter parent_getter;
static PyObject *hub_module_name;
static PyObject *name_str;       /* "name", interned */
static PyObject *run_str;        /* "_run" */
static PyObject *spawning_str;   /* "spawning_greenlet" */
static PyTypeObject *greenlet_type;   /* greenlet.greenlet, kept */
static PyObject *co_filename_str, *co_name_str;
static PyObject *fn_names;       /* code address -> (code, qualified name) */
static PyObject *own_dir;       /* greqprof's package dir: its frames are
                                   left out of captured stacks */
static PyObject *reg_wait_sites; /* tag -> (code, fn_name, file, line, stack) */
static PyObject *text_clean;     /* greqprof._text.clean */
static PyObject *greenlet_dir;   /* greenlet's package dir, with '/' */
static PyObject *module_dir(PyObject *mod);

#define GQP_PY_MAX_LONG 1024
#define GQP_PY_MAX_STACKS 20000
#define GQP_PY_MAX_NAMES 65536
/* Functions named for call tables (calls=True).  Code made at run time
 * (exec, namedtuple) is new every time: past this, the oldest quarter is
 * dropped.  A profile still open across that may then show such a
 * function unnamed (or, were its address reused, under the new name). */
#define GQP_PY_MAX_CODES 20000
#define GQP_PY_STACK_DEPTH 40

/* calls.c */
static void own_switch(gqp_py_thread *st, PyObject *from, PyObject *to,
                       int dead);
static PyMethodDef own_work_def;
static void calls_follow(gqp_py_thread *st);

/* entries.c */
static PyMethodDef attach_def;
static PyMethodDef greenlet_id_def;
static PyMethodDef running_since_def;
static PyMethodDef wall_ns_def;
/* _fastpath.c */
static int gqp_py_fast_init(PyObject *reg);
static void note_forget(gqp_py_thread *st, uint64_t gid);
static PyObject *spawner_chain(gqp_py_thread *st, PyObject *g, uint64_t gid);
static PyObject *note_find(gqp_py_thread *st, PyObject *chain);
static void note_route_find(gqp_py_thread *st, PyObject *chain,
                            PyObject **route, PyObject **path);
static int note_name(gqp_py_thread *st, uint64_t gid, PyObject *name);
static void notes_free(gqp_py_thread *st);
static uint64_t thread_generation;            /* gqp_py_thread_start's */

/* _fastpath.c: the function each live greenlet runs, kept from its start
 * (gevent drops a Greenlet's _run before its last switch). */
static void run_remember(gqp_py_thread *st, PyObject *g, uint64_t key);
static void run_forget(gqp_py_thread *st, uint64_t key);
static PyObject *run_names(gqp_py_thread *st, uint64_t key, PyObject *names);
static PyObject *run_names_of_id(gqp_py_thread *st, uint64_t id);

#endif /* GQP_HOOKS_H */
