/* _hooks/entries.c -- fast entry points the Python side calls without cffi
 * (attach, greenlet_id, running_since, wall_ns) and gqp_py_profile_new.
 * A part of _hooks.c (one translation unit, see there). */
#include "hooks.h"

/* Attaches greenlet g of st's thread to profile p (NULL: detach) and names
 * it there; a span the attach ends long is reported.  The greenlet's id
 * (0 if the tracer never saw it), or a negative GQP_E* code (GIL held). */
static int64_t attach_greenlet(gqp_py_thread *st, PyObject *g, gqp_profile *p)
{
    if (!st->active || !st->tracer) {
        return GQP_ESTATE;
    }
    int rc = gqp_tracer_attach(st->tracer, (uint64_t)(uintptr_t)g, p);
    if (rc < 0) {
        return rc;
    }
    st_enter(st);
    if (rc & GQP_EV_LONG_SPAN) {
        on_long_span(st, g, 0);
    }
    uint64_t id = 0;
    if (st_live(st)) {
        gqp_tracer_greenlet_id(st->tracer, (uint64_t)(uintptr_t)g, &id);
    }
    if (p && id) {
        name_in_profile(st, g, id, p);
    }
    if (st->calls_on && st_live(st) && gqp__tls == st) {
        /* (the running greenlet may have joined or left a profile: the
         * call hook follows now, not at its next switch) */
        calls_follow(st);
    }
    PyErr_Clear();
    st_leave(st);
    return (int64_t)(id & INT64_MAX);
}

/* _registry.attach(hooks, greenlet, profile): attaches a greenlet of the
 * hooks' thread to profile p and names it there (profile 0: detach).  A
 * CPython call, with the GIL held: no cffi call, no GIL round trip.  hooks
 * and profile are addresses of live objects the caller owns.  Returns the
 * greenlet's tracer id, or a negative GQP_E* code. */
static PyObject *attach_fast(PyObject *self, PyObject *const *args,
                             Py_ssize_t nargs)
{
    (void)self;
    if (want_args(nargs, 3, "attach") < 0) {
        return NULL;
    }
    gqp_py_thread *st = (gqp_py_thread *)PyLong_AsVoidPtr(args[0]);
    gqp_profile *p = (gqp_profile *)PyLong_AsVoidPtr(args[2]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    int64_t rc = st ? attach_greenlet(st, args[1], p) : GQP_EINVAL;
    return rc >= 0 ? PyLong_FromUnsignedLongLong((uint64_t)rc)
                   : PyLong_FromLongLong(rc);
}

static PyMethodDef attach_def = {
    "attach", (PyCFunction)(void (*)(void))attach_fast, METH_FASTCALL,
    "Attaches a greenlet to a profile and returns its id (internal)."};

/* _registry.greenlet_id(tracer, greenlet): the tracer's id of a greenlet
 * (0 when the tracer has not seen it), without cffi. */
static PyObject *greenlet_id_fast(PyObject *self, PyObject *const *args,
                                  Py_ssize_t nargs)
{
    (void)self;
    if (want_args(nargs, 2, "greenlet_id") < 0) {
        return NULL;
    }
    gqp_tracer *t = (gqp_tracer *)PyLong_AsVoidPtr(args[0]);
    if (!t) {
        return PyErr_Occurred() ? NULL : PyLong_FromLong(0);
    }
    uint64_t id = 0;
    gqp_tracer_greenlet_id(t, (uint64_t)(uintptr_t)args[1], &id);
    return PyLong_FromUnsignedLongLong(id);
}

static PyMethodDef greenlet_id_def = {
    "greenlet_id", (PyCFunction)(void (*)(void))greenlet_id_fast,
    METH_FASTCALL, "The tracer's id of a greenlet, 0 if unseen (internal)."};

/* _registry.running_since(tracer): (start_ns, greenlet_id) of the running
 * span, or None.  Without cffi, which releases the GIL: the watchdog
 * thread calls this, and a GIL hand-off per call slowed the serving
 * thread. */
static PyObject *running_since_fast(PyObject *self, PyObject *arg)
{
    (void)self;
    gqp_tracer *t = (gqp_tracer *)PyLong_AsVoidPtr(arg);
    if (!t) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "no tracer at address 0");
        }
        return NULL;
    }
    int64_t start = 0;
    uint64_t id = 0;
    if (gqp_tracer_running_since(t, &start, &id) != GQP_OK) {
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(LK)", (long long)start, (unsigned long long)id);
}

static PyMethodDef running_since_def = {
    "running_since", (PyCFunction)running_since_fast, METH_O,
    "(start_ns, greenlet_id) of a tracer's running span, or None "
    "(internal)."};

/* _registry.wall_ns(): libgreqprof's wall clock (monotonic ns), without
 * cffi's GIL release. */
static PyObject *wall_ns_fast(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyLong_FromLongLong((long long)gqp_clock_wall_ns());
}

static PyMethodDef wall_ns_def = {
    "wall_ns", (PyCFunction)wall_ns_fast, METH_NOARGS,
    "libgreqprof's wall clock in ns (internal)."};

/* One call instead of three: a profile for one request. */
static gqp_profile *gqp_py_profile_new(size_t max_spans)
{
    gqp_profile *p = NULL;
    if (gqp_profile_new(&p) != GQP_OK) {
        return NULL;
    }
    if (gqp_profile_set(p, GQP_PROFILE_MAX_SPANS, max_spans) != GQP_OK) {
        gqp_profile_free(p);
        return NULL;
    }
    return p;
}
