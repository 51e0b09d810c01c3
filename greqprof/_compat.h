/* _compat.h -- the CPython C API calls greqprof's C uses, on every
 * supported interpreter (3.10 to 3.14).
 *
 * _hooks.c, _fastpath.c and _sampled.c are written against the current
 * API (3.13/3.14): calls CPython has scheduled for removal
 * (PyErr_Fetch/Restore/NormalizeException, PyWeakref_GetObject, the
 * structmember.h names) and private _Py* calls are not used.  This header
 * gives older versions the new calls, each defined only where the running
 * headers lack it, so on a current interpreter it adds nothing.
 * docs/architecture.md ("CPython C API use") lists what is still
 * version-specific and why. */
#ifndef GQP_COMPAT_H
#define GQP_COMPAT_H

#include <Python.h>

#if PY_VERSION_HEX < 0x030A0000
#error "greqprof needs Python 3.10 or newer"
#endif

/* Py_T_OBJECT_EX, Py_T_BOOL, Py_READONLY: descrobject.h from 3.12 on;
 * before, structmember.h's T_* names (the same numbers). */
#if PY_VERSION_HEX < 0x030C0000
#include <structmember.h>
#ifndef Py_T_OBJECT_EX
#define Py_T_OBJECT_EX T_OBJECT_EX
#define Py_T_BOOL T_BOOL
#define Py_T_INT T_INT
#define Py_READONLY READONLY
#endif
#endif

/* Py_NewRef / Py_XNewRef: public from 3.10 (3.9 lacked them: the floor
 * above). */

/* PyType_GetName (3.11): the type's own name, a new reference, read as
 * 3.11 reads it (a heap type's stored name, else tp_name after its last
 * dot): never through type.__name__, which a metaclass may override with
 * Python that returns anything. */
#if PY_VERSION_HEX < 0x030B0000
#include <string.h>
static inline PyObject *gqp_compat_type_name(PyTypeObject *t)
{
    if ((t->tp_flags & Py_TPFLAGS_HEAPTYPE) &&
        ((PyHeapTypeObject *)t)->ht_name) {
        return Py_NewRef(((PyHeapTypeObject *)t)->ht_name);
    }
    const char *dot = strrchr(t->tp_name, '.');
    return PyUnicode_FromString(dot ? dot + 1 : t->tp_name);
}
#define PyType_GetName gqp_compat_type_name
#endif

/* PyErr_GetRaisedException / PyErr_SetRaisedException (3.12): the
 * exception being raised as one object (normalized, its traceback set on
 * it), replacing the Fetch/Normalize/Restore triple. */
#if PY_VERSION_HEX < 0x030C0000
static inline PyObject *gqp_compat_get_raised(void)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (!type) {
        return NULL;
    }
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb && value) {
        PyException_SetTraceback(value, tb);
    }
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
}

static inline void gqp_compat_set_raised(PyObject *exc)
{
    if (!exc) {
        PyErr_Clear();
        return;
    }
    PyObject *type = (PyObject *)Py_TYPE(exc);
    Py_INCREF(type);
    PyErr_Restore(type, exc, PyException_GetTraceback(exc));
}
#define PyErr_GetRaisedException gqp_compat_get_raised
#define PyErr_SetRaisedException gqp_compat_set_raised
#endif

/* PyWeakref_GetRef (3.13): 1 and a new reference to the referent, 0 and
 * NULL when it is dead, -1 with TypeError when ref is no weak reference. */
#if PY_VERSION_HEX < 0x030D0000
static inline int gqp_compat_weakref_getref(PyObject *ref, PyObject **pobj)
{
    if (!PyWeakref_Check(ref)) {
        *pobj = NULL;
        PyErr_SetString(PyExc_TypeError, "expected a weakref");
        return -1;
    }
    PyObject *obj = PyWeakref_GetObject(ref);
    if (!obj || obj == Py_None) {
        *pobj = NULL;
        return obj ? 0 : -1;
    }
    *pobj = Py_NewRef(obj);
    return 1;
}
#define PyWeakref_GetRef gqp_compat_weakref_getref
#endif

/* PyDict_GetItemRef (3.13): a strong reference to d[key] (1), none (0),
 * or an error (-1).  The value found stays alive while the caller goes on
 * to anything that can run Python, which a borrowed one would not. */
#if PY_VERSION_HEX < 0x030D0000
static inline int gqp_compat_dict_getitemref(PyObject *d, PyObject *key,
                                             PyObject **result)
{
    PyObject *v = PyDict_GetItemWithError(d, key);
    if (v) {
        *result = Py_NewRef(v);
        return 1;
    }
    *result = NULL;
    return PyErr_Occurred() ? -1 : 0;
}
#define PyDict_GetItemRef gqp_compat_dict_getitemref
#endif

/* PyLong_AsLongLong, fast for an exact int: CPython converts an int of
 * more than one 30-bit digit (a nanosecond timestamp) to long long through
 * _PyLong_AsByteArray (~140 instructions); PyLong_AsLongAndOverflow sums
 * the digits (~30).  Anything else, an overflow included, goes to
 * PyLong_AsLongLong itself: same results, same errors. */
static inline long long gqp_long_as_ll(PyObject *v)
{
#if LONG_MAX == LLONG_MAX
    if (PyLong_CheckExact(v)) {
        int overflow = 0;
        long r = PyLong_AsLongAndOverflow(v, &overflow);
        if (!overflow) {
            return r;
        }
    }
#endif
    return PyLong_AsLongLong(v);
}

#endif /* GQP_COMPAT_H */
