/* _hooks/install.c -- gqp_py_init, and installing/uninstalling the hooks in
 * a thread (start, stop, the call hook on/off, free).
 * A part of _hooks.c (one translation unit, see there). */
#include "hooks.h"

/* Loads the registry and puts the C functions and types the Python side
 * builds on (the middleware's base type) into it; called at import and by
 * every start, once effective.  0 on success; -1 when greenlet or the
 * registry cannot be loaded. */
static int gqp_py_init(void)
{
    PyGILState_STATE gs = PyGILState_Ensure();
    int rc = -1;
    if (reg_codes) {
        rc = 0;
        goto out;
    }
    PyObject *reg = PyImport_ImportModule("greqprof._registry");
    PyObject *gm = PyImport_ImportModule("greenlet");
    if (!reg || !gm) {
        Py_XDECREF(reg);
        Py_XDECREF(gm);
        PyErr_Clear();
        goto out;
    }
    hub_module_name = PyUnicode_InternFromString("gevent.hub");
    name_str = PyUnicode_InternFromString("name");
    run_str = PyUnicode_InternFromString("_run");
    spawning_str = PyUnicode_InternFromString("spawning_greenlet");
    co_filename_str = PyUnicode_InternFromString("co_filename");
    co_name_str = PyUnicode_InternFromString("co_name");
    fn_names = PyDict_New();
    PyObject *file = PyObject_GetAttrString(reg, "__file__");
    if (file && PyUnicode_Check(file)) {
        Py_ssize_t n = PyUnicode_GetLength(file);
        Py_ssize_t slash = PyUnicode_FindChar(file, '/', 0, n, -1);
        if (slash > 0) {
            own_dir = PyUnicode_Substring(file, 0, slash + 1);
        }
    }
    Py_XDECREF(file);
    PyErr_Clear();
    PyObject *gtype = PyObject_GetAttrString(gm, "greenlet");
    greenlet_settrace = PyObject_GetAttrString(gm, "settrace");
    greenlet_gettrace = PyObject_GetAttrString(gm, "gettrace");
    greenlet_getcurrent = PyObject_GetAttrString(gm, "getcurrent");
    reg_codes = PyObject_GetAttrString(reg, "codes");
    reg_stacks = PyObject_GetAttrString(reg, "stacks");
    reg_long = PyObject_GetAttrString(reg, "long_spans");
    reg_names = PyObject_GetAttrString(reg, "names");
    reg_hub_ids = PyObject_GetAttrString(reg, "hub_ids");
    reg_wait_sites = PyObject_GetAttrString(reg, "wait_sites");
    greenlet_dir = module_dir(gm);
    {
        PyObject *tm = PyImport_ImportModule("greqprof._text");
        text_clean = tm ? PyObject_GetAttrString(tm, "clean") : NULL;
        Py_XDECREF(tm);
        PyErr_Clear();
    }
    if (gtype && PyType_Check(gtype) && !greenlet_type) {
        greenlet_type = (PyTypeObject *)Py_NewRef(gtype);
    }
    if (gtype) {
        dead_getter = find_getter(gtype, "dead");
        frame_getter = find_getter(gtype, "gr_frame");
        parent_getter = find_getter(gtype, "parent");
    }
    Py_XDECREF(gtype);
    PyMethodDef *defs[] = {&attach_def,
                           &greenlet_id_def, &running_since_def,
                           &wall_ns_def, &own_work_def};
    for (size_t i = 0; i < sizeof defs / sizeof defs[0]; i++) {
        PyObject *fn = PyCFunction_New(defs[i], NULL);
        if (!fn || PyObject_SetAttrString(reg, defs[i]->ml_name, fn) < 0) {
            PyErr_Clear();
        }
        Py_XDECREF(fn);
    }
    int fast = gqp_py_fast_init(reg);
    Py_DECREF(reg);
    Py_DECREF(gm);
    if (fast < 0 || PyType_Ready(&gqp_hookref_type) < 0) {
        PyErr_Clear();
        Py_CLEAR(reg_codes);
        goto out;
    }
    if (greenlet_settrace && greenlet_gettrace && greenlet_getcurrent &&
        reg_codes &&
        reg_stacks && reg_long && reg_names && reg_hub_ids &&
        PyDict_Check(reg_hub_ids) && reg_wait_sites &&
        PyDict_Check(reg_wait_sites) &&
        dead_getter.get && frame_getter.get && PyDict_Check(reg_codes) &&
        PyDict_Check(reg_stacks) && PyList_Check(reg_long) &&
        PyDict_Check(reg_names)) {
        rc = 0;
    } else {
        Py_CLEAR(reg_codes);
        PyErr_Clear();
    }
out:
    PyGILState_Release(gs);
    return rc;
}

/* ---- installing ------------------------------------------------------- */

#define GQP_PY_CALLS 0x1
#define GQP_PY_BUILTINS 0x2
#define GQP_PY_INHERIT 0x4
#define GQP_PY_STACKS 0x8
#define GQP_PY_CALLS_LATER 0x10 /* install the call hook on gqp_py_calls */

/* Takes st's switch hook out of the calling thread (st's own), putting
 * back the one it replaced, but only while it is still the installed
 * one: a tool that installed its own on top (gevent's monitor thread
 * does, and calls ours from it) keeps its hook, and ours stays in that
 * chain as a pass-through (hookref's fwd_trace once st is freed). */
static void unhook_switch(gqp_py_thread *st)
{
    PyObject *cur = PyObject_CallNoArgs(greenlet_gettrace);
    if (cur == st->trace_fn) {
        PyObject *r = PyObject_CallFunctionObjArgs(
            greenlet_settrace, st->prev_trace ? st->prev_trace : Py_None,
            NULL);
        Py_XDECREF(r);
    }
    Py_XDECREF(cur);
    PyErr_Clear();
}

/* The same for the call hook: the previous one is put back only while
 * ours is installed (a cProfile enabled later replaced it and goes on). */
static void unhook_calls(gqp_py_thread *st)
{
    PyThreadState *ts = PyThreadState_Get();
    if (ts->c_profilefunc == gqp__profile && ts->c_profileobj == st->ref) {
        PyEval_SetProfile(st->prev_prof, st->prev_prof_obj);
    }
    st->profile_installed = 0;
}

/* Installs the hooks in the calling thread, feeding tracer t.  The current
 * greenlet starts a span now.  Returns a state for gqp_py_thread_stop, or
 * NULL (*err: -1 init failed, -2 hooks already installed here, -3 no
 * memory, -4 greenlet.settrace failed). */
static gqp_py_thread *gqp_py_thread_start(gqp_tracer *t, int flags, int *err)
{
    *err = 0;
    if (gqp_py_init() != 0) {
        *err = -1;
        return NULL;
    }
    PyGILState_STATE gs = PyGILState_Ensure();
    gqp_py_thread *st = NULL;
    if (gqp__tls && !gqp__tls->active) {
        /* Left quiet by a stop from another thread: remove it now. */
        gqp_py_thread *old = gqp__tls;
        if (old->profile_installed) {
            unhook_calls(old);
        }
        unhook_switch(old);
        gqp__tls = NULL;
        old->installed = 0;
        if (!old->tracer) {
            /* Its owner already let go of it (gqp_py_thread_free). */
            st_release(old);
        } else {
            old->profile_installed = 0;
        }
    }
    if (gqp__tls) {
        *err = -2;
        goto out;
    }
    st = calloc(1, sizeof *st);
    if (!st) {
        *err = -3;
        goto out;
    }
    st->tracer = t;
    st->gen = ++thread_generation;
    st->thread_id = PyThread_get_thread_ident();
    st->calls = !!(flags & GQP_PY_CALLS);
    st->builtins = !!(flags & GQP_PY_BUILTINS);
    st->inherit = !!(flags & GQP_PY_INHERIT);
    st->stacks = !!(flags & GQP_PY_STACKS);
    gqp_hookref *ref = PyObject_New(gqp_hookref, &gqp_hookref_type);
    if (!ref) {
        PyErr_Clear();
        free(st);
        st = NULL;
        *err = -3;
        goto out;
    }
    ref->st = st;
    ref->fwd_trace = NULL;
    ref->fwd_prof = NULL;
    ref->fwd_prof_obj = NULL;
    st->ref = (PyObject *)ref;
    st->trace_fn = PyCFunction_New(&gqp__trace_def, st->ref);
    PyObject *prev = st->trace_fn
        ? PyObject_CallFunctionObjArgs(greenlet_settrace, st->trace_fn, NULL)
        : NULL;
    if (!prev) {
        PyErr_Clear();
        Py_XDECREF(st->trace_fn);
        Py_XDECREF(st->ref);
        free(st);
        st = NULL;
        *err = -4;
        goto out;
    }
    if (prev == Py_None) {
        Py_DECREF(prev);
    } else {
        st->prev_trace = prev;
    }
    gqp__tls = st;
    st->installed = 1;
    st_set_active(st, 1);
    st->ctx_ver = PyThreadState_Get()->context_ver;
    /* Start the current greenlet's span (and give it its names). */
    PyObject *gm = PyImport_ImportModule("greenlet");
    PyObject *cur = gm ? PyObject_CallMethod(gm, "getcurrent", NULL) : NULL;
    Py_XDECREF(gm);
    if (cur) {
        int ev = gqp_tracer_switch(t, 0, (uint64_t)(uintptr_t)cur, 0);
        if (ev > 0 && (ev & GQP_EV_NEW_GREENLET)) {
            uint64_t id = 0;
            gqp_profile *p = NULL;
            if (gqp_tracer_current(t, NULL, &id, &p) == GQP_OK) {
                name_in_profile(st, cur, id, p);
            }
        }
        Py_DECREF(cur);
    }
    PyErr_Clear();
    {
        PyThreadState *ts = PyThreadState_Get();
        st->prev_prof = ts->c_profilefunc;
        st->prev_prof_obj = ts->c_profileobj;
        Py_XINCREF(st->prev_prof_obj);
    }
    if (st->calls && !(flags & GQP_PY_CALLS_LATER)) {
        PyEval_SetProfile(gqp__profile, st->ref);
        st->profile_installed = 1;
    }
out:
    PyGILState_Release(gs);
    return st;
}

/* Stops feeding the tracer.  In the thread that started it, the hooks are
 * removed (the previous ones restored); from any other thread the hooks
 * only go quiet.  The tracer is flushed either way.  The state is freed
 * by gqp_py_thread_free once its thread no longer uses it. */
static int gqp_py_thread_stop(gqp_py_thread *st)
{
    if (!st) {
        return GQP_EINVAL;
    }
    PyGILState_STATE gs = PyGILState_Ensure();
    int rc = GQP_OK;
    if (!st->active) {
        rc = GQP_ESTATE;
        goto out;
    }
    st_set_active(st, 0);
    if (st->beacon) {
        atomic_store(&st->beacon->key, 0);
    }
    int own = gqp__tls == st;
    if (own) {
        if (st->profile_installed) {
            unhook_calls(st);
        }
        unhook_switch(st);
        gqp__tls = NULL;
        st->installed = 0;
    }
    gqp_tracer_flush_ex(st->tracer, own ? 0 : GQP_FLUSH_FOREIGN);
out:
    PyGILState_Release(gs);
    return rc;
}

/* Turns the call hook on or off in the calling thread (which must be st's
 * own), so threads pay for per-call tracing only while some profile wants
 * calls.  Frames entered while it was off return unseen, which the tracer
 * ignores. */
static int gqp_py_calls(gqp_py_thread *st, int on)
{
    if (!st) {
        return GQP_EINVAL;
    }
    PyGILState_STATE gs = PyGILState_Ensure();
    int rc = GQP_OK;
    if (gqp__tls != st || !st->active || !st->calls) {
        rc = GQP_ESTATE;
    } else if (on) {
        if (!st->calls_on) {
            own_reset(st);
            if (!st->profile_installed) {
                /* Chain to what is installed now (it may have changed
                 * since the start: a cProfile enabled meanwhile). */
                PyThreadState *ts = PyThreadState_Get();
                if (ts->c_profilefunc != gqp__profile ||
                    ts->c_profileobj != st->ref) {
                    PyObject *old = st->prev_prof_obj;
                    st->prev_prof = ts->c_profilefunc;
                    st->prev_prof_obj = Py_XNewRef(ts->c_profileobj);
                    Py_XDECREF(old);
                }
            }
        }
        /* (put in now if the running greenlet is in a profile, then by
         * the switch hook) */
        st->calls_on = 1;
        calls_follow(st);
    } else {
        st->calls_on = 0;
        if (st->profile_installed) {
            unhook_calls(st);
        }
    }
    PyGILState_Release(gs);
    return rc;
}

/* Installs the call hook again in st's own thread after other code
 * replaced it with sys.setprofile (gevent's green threads do, through
 * threading.setprofile); the replaced hook is not chained. */
static int gqp_py_reinstall_calls(gqp_py_thread *st)
{
    if (!st) {
        return GQP_EINVAL;
    }
    PyGILState_STATE gs = PyGILState_Ensure();
    int rc = GQP_OK;
    if (gqp__tls != st || !st->active || !st->calls) {
        rc = GQP_ESTATE;
    } else if (st->profile_installed) {
        own_reset(st);
        PyEval_SetProfile(gqp__profile, st->ref);
    }
    PyGILState_Release(gs);
    return rc;
}

/* Frees a stopped state.  A state stopped from another thread stays
 * referenced by its thread's hooks, so it is only detached here: the hooks
 * see active == 0 and do nothing but chain. */
static void gqp_py_thread_free(gqp_py_thread *st)
{
    if (!st) {
        return;
    }
    PyGILState_STATE gs = PyGILState_Ensure();
    if (st->installed) {
        /* Still in its thread's hooks (stopped from another thread): leave
         * it quiet, still chaining to the hooks it replaced; that thread
         * frees it when it next starts profiling. */
        st_set_active(st, 0);
        st->tracer = NULL;
        if (st->beacon) {
            atomic_store(&st->beacon->key, 0);   /* (the sampler drops it) */
        }
    } else {
        st_release(st);
    }
    PyGILState_Release(gs);
}
