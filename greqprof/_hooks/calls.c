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
