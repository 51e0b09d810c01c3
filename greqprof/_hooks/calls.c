/* _hooks/calls.c -- the call hook (PyEval_SetProfile).
 * A part of _hooks.c (one translation unit, see there). */
#include "hooks.h"

/* ---- the call hook ---------------------------------------------------- */

static int gqp__profile(PyObject *obj, PyFrameObject *frame, int what,
                        PyObject *arg)
{
    gqp_py_thread *st = ((gqp_hookref *)obj)->st;
    if (!st) {
        return 0;
    }
    st_enter(st);
    if (st->active && st->calls) {
        switch (what) {
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
