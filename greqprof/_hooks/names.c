/* _hooks/names.c -- greenlet names: qualified names of callables, the names
 * put into a profile, and the ring that drops dead greenlets' names later.
 * A part of _hooks.c (one translation unit, see there). */
#include "hooks.h"

/* "module.qualname" of a callable, or NULL. */
static PyObject *qualified_name(PyObject *fn)
{
    PyObject *qn = PyObject_GetAttrString(fn, "__qualname__");
    if (!qn) {
        PyErr_Clear();
        qn = PyObject_GetAttrString(fn, "__name__");
    }
    if (!qn) {
        /* (the type held: the lookups above may have changed fn's class,
         * dropping the old one) */
        PyObject *type = Py_NewRef((PyObject *)Py_TYPE(fn));
        PyErr_Clear();
        qn = PyObject_GetAttrString(type, "__qualname__");
        Py_DECREF(type);
    }
    if (!qn || !PyUnicode_Check(qn)) {
        Py_XDECREF(qn);
        PyErr_Clear();
        return NULL;
    }
    PyObject *mod = PyObject_GetAttrString(fn, "__module__");
    PyErr_Clear();
    PyObject *res = qn;
    if (mod && PyUnicode_Check(mod)) {
        res = PyUnicode_FromFormat("%U.%U", mod, qn);
        Py_DECREF(qn);
    }
    Py_XDECREF(mod);
    if (!res) {
        PyErr_Clear();
    }
    return res;
}

/* qualified_name of a greenlet's run callable, cached by code object when
 * it is a Python function or method: a greenlet per request usually runs
 * one of a few functions.  Keys are code addresses; each entry holds its
 * code object, so an address cannot be reused while it is cached. */
#define GQP_PY_MAX_FN_NAMES 4096

static PyObject *run_name(PyObject *run)
{
    PyObject *f = PyMethod_Check(run) ? PyMethod_GET_FUNCTION(run) : run;
    if (!fn_names || !PyFunction_Check(f)) {
        return qualified_name(run);
    }
    /* Held: the function's __code__ may be replaced (and the old code
     * freed) by Python that runs below (the name's lookups, a garbage
     * collection's finalizers). */
    PyObject *code = Py_NewRef(PyFunction_GetCode(f));
    PyObject *key = PyLong_FromVoidPtr(code);
    if (!key) {
        PyErr_Clear();
        Py_DECREF(code);
        return qualified_name(run);
    }
    PyObject *hit = NULL;
    if (PyDict_GetItemRef(fn_names, key, &hit) > 0 && PyTuple_Check(hit) &&
        PyTuple_GET_SIZE(hit) == 2 && PyTuple_GET_ITEM(hit, 0) == code) {
        PyObject *res = Py_NewRef(PyTuple_GET_ITEM(hit, 1));
        Py_DECREF(hit);
        Py_DECREF(key);
        Py_DECREF(code);
        return res;
    }
    Py_XDECREF(hit);
    PyErr_Clear();
    PyObject *res = qualified_name(run);
    if (res) {
        if (PyDict_GET_SIZE(fn_names) >= GQP_PY_MAX_FN_NAMES) {
            PyDict_Clear(fn_names);
        }
        PyObject *val = PyTuple_Pack(2, code, res);
        if (!val || PyDict_SetItem(fn_names, key, val) < 0) {
            PyErr_Clear();
        }
        Py_XDECREF(val);
    }
    Py_DECREF(key);
    Py_DECREF(code);
    return res;
}

/* New references to (name, fn_name) strings for a greenlet. */
static void greenlet_names(PyObject *g, PyObject **name, PyObject **fn_name)
{
    *name = NULL;
    *fn_name = NULL;
    /* A name the app gave a gevent Greenlet (g.name = ...) is in its
     * __dict__.  The generated "Greenlet-N" is not read: gevent builds it
     * from an ident registry (microseconds per greenlet) and shows it in
     * the greenlet's repr from then on, so reading it would change the app.
     * Other greenlets go by their class name. */
    PyObject *n = NULL;
    /* The dict is held while searched: a key whose hash equals "name"'s
     * has its __eq__ run, which may replace g.__dict__ and free it. */
    PyObject *dict = PyObject_GenericGetDict(g, NULL);
    if (dict && PyDict_Check(dict) &&
        PyDict_GetItemRef(dict, name_str, &n) > 0 && !PyUnicode_Check(n)) {
        Py_CLEAR(n);
    }
    Py_XDECREF(dict);
    PyErr_Clear();
    if (!n) {
        const char *tn = Py_TYPE(g)->tp_name;
        const char *dot = strrchr(tn, '.');
        n = PyUnicode_FromString(dot ? dot + 1 : tn);
    }
    *name = n;
    PyObject *run = PyObject_GetAttr(g, run_str);
    int from_underscore = run != NULL;
    if (!run || run == Py_None) {
        Py_XDECREF(run);
        PyErr_Clear();
        from_underscore = 0;
        if (PyObject_IsTrue(g) == 1 || is_dead(g)) {
            /* A started greenlet has no `run` of its own (greenlet raises
             * that error as a C++ exception, microseconds to unwind): only
             * a subclass's run method (gevent's Hub) names it. */
            PyErr_Clear();
            PyObject *type = Py_NewRef((PyObject *)Py_TYPE(g));
            run = PyObject_GetAttrString(type, "run");
            Py_DECREF(type);
            if (run && Py_IS_TYPE(run, &PyGetSetDescr_Type)) {
                Py_CLEAR(run);
            }
        } else {
            PyErr_Clear();
            run = PyObject_GetAttrString(g, "run");
        }
    }
    PyErr_Clear();
    if (run) {
        /* A finished gevent Greenlet no longer has its own `_run`: the
         * lookup then finds the class's method, bound to g itself, which
         * names no function of the app. */
        PyObject *self = NULL;
        if (from_underscore && PyMethod_Check(run)) {
            self = Py_NewRef(PyMethod_GET_SELF(run));
        } else if (from_underscore && !PyFunction_Check(run)) {
            /* (a plain function has no __self__: not asked, since the
             * AttributeError costs microseconds per spawned greenlet) */
            self = PyObject_GetAttrString(run, "__self__");
        }
        PyErr_Clear();
        if (self != g) {
            *fn_name = run_name(run);
        }
        Py_XDECREF(self);
        Py_DECREF(run);
    }
    if (!*fn_name && parent_getter.get) {
        PyObject *parent = getter_call(&parent_getter, g);
        PyErr_Clear();
        if (parent == Py_None) {
            *fn_name = PyUnicode_FromString("<main>");
        }
        Py_XDECREF(parent);
    }
    PyErr_Clear();
}

static void name_in_profile(gqp_py_thread *st, PyObject *g, uint64_t id,
                            gqp_profile *p)
{
    PyObject *name = NULL, *fn = NULL;
    PyObject *key = PyLong_FromUnsignedLongLong(id);
    /* The profile is retained: naming runs the app's Python, which may end
     * the request and free it. */
    if (p) {
        gqp_profile_retain(p);
    }
    /* Ids are never reused, so names found once stay right: a connection
     * greenlet attached to every sampled request it serves is named once. */
    PyObject *known = NULL;
    if (key) {
        PyDict_GetItemRef(reg_names, key, &known);
    }
    PyErr_Clear();
    if (known && PyTuple_Check(known) && PyTuple_GET_SIZE(known) == 2) {
        name = Py_NewRef(PyTuple_GET_ITEM(known, 0));
        fn = Py_NewRef(PyTuple_GET_ITEM(known, 1));
    } else {
        greenlet_names(g, &name, &fn);
        /* Remember every greenlet's names for reports about others. */
        if (PyDict_GET_SIZE(reg_names) >= GQP_PY_MAX_NAMES) {
            PyDict_Clear(reg_names);
        }
        PyObject *val = PyTuple_Pack(2, name ? name : Py_None,
                                     fn ? fn : Py_None);
        if (key && val) {
            PyDict_SetItem(reg_names, key, val);
        }
        Py_XDECREF(val);
    }
    if (p) {
        const char *cn = name && name != Py_None ? PyUnicode_AsUTF8(name)
                                                 : NULL;
        PyErr_Clear();
        const char *cf = fn && fn != Py_None ? PyUnicode_AsUTF8(fn) : NULL;
        PyErr_Clear();
        gqp_profile_name_greenlet(p, id, cn ? cn : "", cf ? cf : "");
        gqp_profile_free(p);
    }
    Py_XDECREF(known);
    Py_XDECREF(key);
    Py_XDECREF(name);
    Py_XDECREF(fn);
    PyErr_Clear();
    (void)st;
}

/* Names of dead greenlets are kept a while (a profile finished after some
 * of the greenlets it waited on ended still wants them), then dropped: the
 * registry stays the size of the live greenlets plus this ring.  Blocking
 * records carry their names.  Kept short: every entry is memory held
 * across requests, which costs all requests (4096: ~2 % of throughput at
 * pct=1.0, where every request's greenlets are named). */
#define GQP_PY_DEAD_KEPT 256
static uint64_t dead_ring[GQP_PY_DEAD_KEPT];
static size_t dead_pos;

static void forget_later(uint64_t id)
{
    uint64_t old = dead_ring[dead_pos];
    dead_ring[dead_pos] = id;
    dead_pos = (dead_pos + 1) % GQP_PY_DEAD_KEPT;
    if (!old) {
        return;
    }
    PyObject *k = PyLong_FromUnsignedLongLong(old);
    if (k) {
        /* Most greenlets were never named: look before deleting, since a
         * failed PyDict_DelItem raises a KeyError (microseconds, once per
         * greenlet). */
        if (PyDict_GetItemWithError(reg_names, k) &&
            PyDict_DelItem(reg_names, k) < 0) {
            PyErr_Clear();
        }
        Py_DECREF(k);
    }
    PyErr_Clear();
}
