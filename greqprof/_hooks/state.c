/* _hooks/state.c -- the hookref type, argument checks, descriptor getters,
 * the thread state's lifetime (st_enter/st_leave) and small helpers.
 * A part of _hooks.c (one translation unit, see there). */
#include "hooks.h"

static void hookref_dealloc(gqp_hookref *self)
{
    Py_XDECREF(self->fwd_trace);
    Py_XDECREF(self->fwd_prof_obj);
    PyObject_Free(self);
}

static PyTypeObject gqp_hookref_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "greqprof._core.hookref",
    .tp_basicsize = sizeof(gqp_hookref),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "greqprof hook state (internal)",
    .tp_dealloc = (destructor)hookref_dealloc,
};

/* The argument count check of the METH_FASTCALL functions below: 0, or
 * -1 with a TypeError naming the function. */
static int want_args(Py_ssize_t nargs, Py_ssize_t n, const char *name)
{
    if (nargs != n) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", name, n);
        return -1;
    }
    return 0;
}

/* A data descriptor of type (kept for the process's life), or {NULL}. */
static gqp_getter find_getter(PyObject *type, const char *name)
{
    gqp_getter g = {NULL, NULL};
    PyObject *d = PyObject_GetAttrString(type, name);
    if (d && Py_IS_TYPE(d, &PyGetSetDescr_Type)) {
        g.get = (descrgetfunc)PyType_GetSlot(Py_TYPE(d), Py_tp_descr_get);
    }
    if (g.get) {
        g.descr = d;
    } else {
        Py_XDECREF(d);
    }
    PyErr_Clear();
    return g;
}

/* obj.<descriptor>: a new reference, or NULL with an exception set. */
static PyObject *getter_call(const gqp_getter *g, PyObject *obj)
{
    return g->get(g->descr, obj, (PyObject *)Py_TYPE(obj));
}

/* ---- the state's lifetime -------------------------------------------- */

/* Threads whose hooks are active: the stack sampler's loop compares it,
 * without the GIL, with the threads it watches (when it watches them all,
 * a tick with every one in its hub needs no watchdog check either). */
static atomic_int gqp_active_threads;

static void st_set_active(gqp_py_thread *st, int on)
{
    if (!st->active != !on) {
        atomic_fetch_add(&gqp_active_threads, on ? 1 : -1);
    }
    st->active = on;
}

/* The hooks run Python (a greenlet's attributes, a garbage collection's
 * finalizers), which may stop the profiler and free the state they work
 * on: while a hook runs, the state is only marked (orphan) and the hook
 * frees it when it leaves.  After any call that can run Python a hook
 * checks st_live before touching the tracer again. */
static void st_release(gqp_py_thread *st)
{
    if (st->busy) {
        st_set_active(st, 0);
        st->tracer = NULL;
        st->orphan = 1;
        return;
    }
    /* The hookref outlives st when another tool still calls our hooks:
     * they go on forwarding to what they had replaced. */
    st_set_active(st, 0);
    gqp_hookref *ref = (gqp_hookref *)st->ref;
    ref->st = NULL;
    if (st->beacon) {
        atomic_store(&st->beacon->key, 0);   /* (the loop looks again) */
        st->beacon = NULL;
    }
    Py_XSETREF(ref->fwd_trace, st->prev_trace);
    ref->fwd_prof = st->prev_prof;
    Py_XSETREF(ref->fwd_prof_obj, st->prev_prof_obj);
    Py_XDECREF(st->trace_fn);
    Py_XDECREF(st->ref);
    notes_free(st);
    free(st);
}

static void st_enter(gqp_py_thread *st)
{
    st->busy++;
}

static void st_leave(gqp_py_thread *st)
{
    if (--st->busy == 0 && st->orphan) {
        st_release(st);
    }
}

/* Still profiling (after something that may have run Python). */
static int st_live(const gqp_py_thread *st)
{
    return st->active && st->tracer;
}

/* ---- helpers (GIL held) ---------------------------------------------- */

static int is_dead(PyObject *g)
{
    PyObject *v = getter_call(&dead_getter, g);
    if (!v) {
        PyErr_Clear();
        return 0;
    }
    int r = v == Py_True;
    Py_DECREF(v);
    return r;
}
