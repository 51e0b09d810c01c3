/* _hooks/trace.c -- the greenlet switch hook and what it does for a new
 * greenlet.
 * A part of _hooks.c (one translation unit, see there). */
#include "hooks.h"

/* 1 when g is a gevent Hub (only once gevent.hub has been imported).  The
 * type is looked up once: until the hub is seen, every new greenlet asks. */
static PyTypeObject *hub_type;

static int is_hub(PyObject *g)
{
    if (!hub_type) {
        PyObject *mod = PyImport_GetModule(hub_module_name);
        if (!mod) {
            err_clear();
            return 0;
        }
        PyObject *t = PyObject_GetAttrString(mod, "Hub");
        Py_DECREF(mod);
        if (!t || !PyType_Check(t)) {
            Py_XDECREF(t);
            err_clear();
            return 0;
        }
        hub_type = (PyTypeObject *)t; /* kept for the process's life */
    }
    return PyObject_TypeCheck(g, hub_type);
}

/* target.spawning_greenlet (a new reference, or NULL with an exception
 * set).  gevent's Greenlet has it as a getset descriptor and the generic
 * attribute lookup: its getter is called straight from the type's
 * (cached) lookup, a third of PyObject_GetAttr's walk.  Asked for every
 * new greenlet while some profile is open, neighbours' included. */
static PyObject *spawning_of(PyObject *target)
{
#ifndef Py_GIL_DISABLED
    PyTypeObject *tp = Py_TYPE(target);
    if (tp->tp_getattro == PyObject_GenericGetAttr) {
        PyObject *d = _PyType_Lookup(tp, spawning_str);   /* (borrowed) */
        if (d && Py_IS_TYPE(d, &PyGetSetDescr_Type)) {
            /* (a data descriptor: the instance's dict is not asked) */
            Py_INCREF(d);
            PyObject *v = PyGetSetDescr_Type.tp_descr_get(d, target,
                                                          (PyObject *)tp);
            Py_DECREF(d);
            return v;
        }
    }
#endif
    return PyObject_GetAttr(target, spawning_str);
}

static void on_new_greenlet(gqp_py_thread *st, PyObject *target)
{
    uint64_t key = (uint64_t)(uintptr_t)target;
    if (st->inherit) {
        /* gevent records who spawned a Greenlet (a weak reference); only
         * asked when some greenlet has a profile to pass on (not on the
         * unsampled requests' path). */
        if (gqp_tracer_can_inherit(st->tracer) > 0) {
            PyObject *ref = spawning_of(target);
            err_clear();
            PyObject *parent = NULL;
            if (ref && PyWeakref_Check(ref) &&
                PyWeakref_GetRef(ref, &parent) > 0 && st_live(st)) {
                uint64_t pkey = (uint64_t)(uintptr_t)parent;
                gqp_tracer_inherit(st->tracer, key, pkey);
            }
            Py_XDECREF(parent);
            Py_XDECREF(ref);
            err_clear();
        }
        run_remember(st, target, key);
        if (!st->hub_key && is_hub(target) && st_live(st)) {
            st->hub_key = key;
            PyObject *parent = parent_getter.get ? getter_call(&parent_getter,
                                                               target)
                                                 : NULL;
            err_clear();
            st->hub_parent_key = (uint64_t)(uintptr_t)parent;
            Py_XDECREF(parent);   /* (the main greenlet: it stays) */
            /* (told once, from this thread: the watchdog reads ids, never
             * this thread's state) */
            uint64_t hid = 0;
            gqp_tracer_greenlet_id(st->tracer, key, &hid);
            PyObject *k = PyLong_FromUnsignedLong(st->thread_id);
            PyObject *v = hid ? PyLong_FromUnsignedLongLong(hid) : NULL;
            if (k && v) {
                PyDict_SetItem(reg_hub_ids, k, v);
            }
            Py_XDECREF(k);
            Py_XDECREF(v);
            err_clear();
        }
    }
    uint64_t id = 0;
    gqp_profile *p = NULL;
    if (st_live(st) &&
        gqp_tracer_current(st->tracer, NULL, &id, &p) == GQP_OK) {
        /* Names cost a few attribute lookups: only for greenlets whose
         * spans are recorded (and the hub); others get named if they ever
         * hold the loop too long (on_long_span). */
        if (p || !st->inherit || st->hub_key == key) {
            name_in_profile(st, target, id, p);
        }
    }
}

/* ---- the greenlet hook ----------------------------------------------- */

static PyObject *gqp__trace(PyObject *self, PyObject *const *args,
                            Py_ssize_t nargs)
{
    gqp_py_thread *st = ((gqp_hookref *)self)->st;
    PyObject *pair;
    if (nargs != 2 || !PyTuple_Check(pair = args[1]) ||
        PyTuple_GET_SIZE(pair) != 2) {
        Py_RETURN_NONE;
    }
    if (!st) {
        /* A pass-through left in another tool's chain (hookref). */
        PyObject *fwd = ((gqp_hookref *)self)->fwd_trace;
        return fwd ? PyObject_Vectorcall(fwd, args, (size_t)nargs, NULL)
                   : Py_NewRef(Py_None);
    }
    st_enter(st);
    if (st->active) {
        PyObject *origin = PyTuple_GET_ITEM(pair, 0);
        PyObject *target = PyTuple_GET_ITEM(pair, 1);
        /* The hub leaves alive except to its parent (where a dead
         * greenlet goes): most switches skip asking. */
        uint64_t okey = (uint64_t)(uintptr_t)origin;
        int dead = okey == st->hub_key && st->hub_parent_key &&
                   (uint64_t)(uintptr_t)target != st->hub_parent_key
                   ? 0 : is_dead(origin);
        uint64_t dead_id = 0;
        if (dead) {
            gqp_tracer_greenlet_id(st->tracer, (uint64_t)(uintptr_t)origin,
                                   &dead_id);
        }
        int ev = gqp_tracer_switch(st->tracer, (uint64_t)(uintptr_t)origin,
                                   (uint64_t)(uintptr_t)target,
                                   dead ? GQP_SWITCH_FROM_DEAD : 0);
        if (st->beacon) {
            atomic_store_explicit(&st->beacon->key,
                                  (uint64_t)(uintptr_t)target,
                                  memory_order_relaxed);
        }
        if (dead_id) {
            forget_later(dead_id);
        }
        if (st->own | st->own_parked) {
            own_switch(st, origin, target, dead);
        }
        if (ev > 0) {
            if (ev & GQP_EV_LONG_SPAN) {
                on_long_span(st, origin, dead);
            }
            if ((ev & GQP_EV_WAIT) && st_live(st)) {
                on_wait(st, origin);
            }
            if ((ev & GQP_EV_NEW_GREENLET) && st_live(st)) {
                on_new_greenlet(st, target);
            }
        }
        if (dead_id) {
            /* (after on_long_span: the dying greenlet's last span still
             * takes its note) */
            note_forget(st, dead_id);
            run_forget(st, (uint64_t)(uintptr_t)origin);
        }
#if PY_VERSION_HEX < 0x030C0000
        if (st->calls_on && st_live(st)) {
            calls_follow(st);   /* (after on_new_greenlet: inherited) */
        }
#endif
    }
    PyObject *res = st->prev_trace
        ? PyObject_Vectorcall(st->prev_trace, args, (size_t)nargs, NULL)
        : Py_NewRef(Py_None);
    /* (the stack sampler trusts the tracer's current greenlet only while
     * this still holds: a hook taken out without chaining to ours would
     * leave it pointing at a greenlet that may be gone) */
    st->ctx_ver = PyThreadState_Get()->context_ver;
    st_leave(st);
    return res;
}

/* METH_FASTCALL: no argument tuple is built for the call itself. */
static PyMethodDef gqp__trace_def = {"greqprof_switch_hook",
                                     (PyCFunction)(void (*)(void))gqp__trace,
                                     METH_FASTCALL,
                                     "greqprof's greenlet switch hook."};
