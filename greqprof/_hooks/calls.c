/* _hooks/calls.c -- the call hook (PyEval_SetProfile).
 * A part of _hooks.c (one translation unit, see there). */
#include "hooks.h"

/* ---- greqprof's own work ----------------------------------------------
 * What greqprof does in a greenlet on its own account (logging a WARNING,
 * delivering or rendering a profile) is not the app's, though it may run
 * in a greenlet of a request being profiled: from _registry.own_work()
 * until the Python function that called it returns, the call hook records
 * nothing (it counts frames to find that return).  Per greenlet: the
 * switch hook parks the state of a greenlet that switches out in its own
 * work and gives it back when the greenlet runs again. */

static PyObject *own_work(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    gqp_py_thread *st = gqp__tls;
    if (st && st->active && st->calls && st->profile_installed &&
        !st->own) {
        /* This very call was recorded (a builtin); its return will come
         * in own work, unrecorded: it ends here. */
        if (st->builtins) {
            gqp_tracer_return(st->tracer);
        }
        st->own = 1;
        st->own_depth = 0;
    }
    Py_RETURN_NONE;
}

static PyMethodDef own_work_def = {
    "own_work", own_work, METH_NOARGS,
    "own_work(): the calls made until the caller returns are greqprof's "
    "own work, left out of profiles."};

/* The call hook goes back in after events were missed (it was off, or
 * replaced): frames counted before mean nothing now. */
static void own_reset(gqp_py_thread *st)
{
    st->own = 0;
    st->own_parked = 0;
}

/* An event of own work: only the caller's return is recorded. */
static void own_event(gqp_py_thread *st, int what)
{
    if (what == PyTrace_CALL) {
        st->own_depth++;
    } else if (what == PyTrace_RETURN && st->own_depth-- == 0) {
        st->own = 0;
        gqp_tracer_return(st->tracer);
    }
}

/* The switch hook's part, when a greenlet is or was in own work. */
static void own_switch(gqp_py_thread *st, PyObject *from, PyObject *to,
                       int dead)
{
    if (st->own) {
        st->own = 0;
        uint64_t key = (uint64_t)(uintptr_t)from, id = 0;
        if (!dead && gqp_tracer_greenlet_id(st->tracer, key, &id) == GQP_OK) {
            int i = st->own_parked < GQP_OWN_PARK ? st->own_parked++
                                                  : st->own_next;
            /* (full: the oldest goes, its greenlet's calls are recorded
             * again when it runs) */
            st->own_next = (i + 1) % GQP_OWN_PARK;
            st->own_park[i] = (struct gqp_own_park){key, id, st->own_depth};
        }
    }
    uint64_t key = (uint64_t)(uintptr_t)to, id = 0;
    for (int i = 0; i < st->own_parked; i++) {
        if (st->own_park[i].key != key) {
            continue;
        }
        /* (an id, never reused, tells a new greenlet at the same address:
         * not in own work) */
        if (gqp_tracer_greenlet_id(st->tracer, key, &id) == GQP_OK &&
            id == st->own_park[i].id) {
            st->own = 1;
            st->own_depth = st->own_park[i].depth;
        }
        st->own_park[i] = st->own_park[--st->own_parked];
        st->own_next = 0;
        break;
    }
}

/* ---- the call hook ---------------------------------------------------- */

static int gqp__profile(PyObject *obj, PyFrameObject *frame, int what,
                        PyObject *arg)
{
    gqp_py_thread *st = ((gqp_hookref *)obj)->st;
    if (!st) {
        gqp_hookref *ref = (gqp_hookref *)obj;   /* (a pass-through) */
        return ref->fwd_prof ? ref->fwd_prof(ref->fwd_prof_obj, frame, what,
                                             arg)
                             : 0;
    }
    st_enter(st);
    if (st->active && st->calls) {
        if (st->own) {
            own_event(st, what);
        } else switch (what) {
        case PyTrace_CALL: {
            PyCodeObject *co = PyFrame_GetCode(frame);
            uint64_t key = (uint64_t)(uintptr_t)co;
            int ev = gqp_tracer_call(st->tracer, key);
            if (ev > 0 && (ev & GQP_EV_NEW_FUNC)) {
                register_code(key, (PyObject *)co);
            }
            Py_DECREF(co);
            break;
        }
        case PyTrace_RETURN:
            gqp_tracer_return(st->tracer);
            break;
        case PyTrace_C_CALL:
            if (st->builtins && PyCFunction_Check(arg)) {
                /* Keyed by its C function: one per builtin, and no read
                 * of PyCFunctionObject's private fields. */
                uint64_t key = (uint64_t)(uintptr_t)PyCFunction_GET_FUNCTION(arg);
                int ev = gqp_tracer_call(st->tracer, key);
                if (ev > 0 && (ev & GQP_EV_NEW_FUNC)) {
                    register_cfunc(key, arg);
                }
            }
            break;
        case PyTrace_C_RETURN:
        case PyTrace_C_EXCEPTION:
            if (st->builtins && PyCFunction_Check(arg)) {
                gqp_tracer_return(st->tracer);
            }
            break;
        default:
            break;
        }
    }
    int rc = st->prev_prof ? st->prev_prof(st->prev_prof_obj, frame, what, arg)
                           : 0;
    st_leave(st);
    return rc;
}

/* ---- on only where a profile wants calls ------------------------------
 * The call hook is the thread's (PyEval_SetProfile): left on for every
 * greenlet while one request's profile wanted calls, CPython's per-call
 * tracing cost every request beside it (5 % of requests sampled
 * with calls=True cost 37 % of throughput).  So while calls are wanted the
 * switch hook puts it in only while the running greenlet is in a profile
 * (its request's, one it inherited, or the default a shared Profiler
 * set), and takes it out otherwise.  greenlet recomputes the thread's
 * use_tracing from the profile function when the switch hook returns, so
 * setting the function is enough.  On 3.12+ PyEval_SetProfile turns the
 * interpreter's PEP 669 events on and off, after which every code object
 * is instrumented again: there the hook stays on thread-wide. */

/* Puts the call hook in (want) or takes it out, unless some other code
 * replaced the thread's profile function meanwhile (left alone). */
static void calls_set(gqp_py_thread *st, int want)
{
    if (want == st->profile_installed) {
        return;
    }
    PyThreadState *ts = PyThreadState_Get();
    Py_tracefunc now = st->profile_installed ? gqp__profile : st->prev_prof;
    if (ts->c_profilefunc != now) {
        return;
    }
    if (want) {
        PyEval_SetProfile(gqp__profile, st->ref);
    } else {
        PyEval_SetProfile(st->prev_prof, st->prev_prof_obj);
    }
    st->profile_installed = want;
}

/* The call hook as the running greenlet wants it (calls wanted). */
static void calls_follow(gqp_py_thread *st)
{
#if PY_VERSION_HEX < 0x030C0000
    gqp_profile *p = NULL;
    calls_set(st, gqp_tracer_current(st->tracer, NULL, NULL, &p) == GQP_OK
                      && p != NULL);
#else
    calls_set(st, 1);
#endif
}
