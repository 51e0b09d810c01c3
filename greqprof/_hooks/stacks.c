/* _hooks/stacks.c -- stack text: format_stack and the stacks registry, long
 * spans (on_long_span) and a thread's stack for watchdogs.
 * A part of _hooks.c (one translation unit, see there). */
#include "hooks.h"

static uint32_t next_tag = 1;   /* store_stack's */

/* Traceback-style text of a frame chain (outermost first), or NULL. */
static PyObject *format_stack(PyObject *frame_obj)
{
    if (!frame_obj || !PyFrame_Check(frame_obj)) {
        return NULL;
    }
    PyObject *lines[GQP_PY_STACK_DEPTH];
    int n = 0;
    PyFrameObject *f = (PyFrameObject *)frame_obj;
    Py_INCREF(f);
    while (f && n < GQP_PY_STACK_DEPTH) {
        /* (attributes, not PyCodeObject's fields: its layout is private) */
        PyCodeObject *co = PyFrame_GetCode(f);
        PyObject *file = PyObject_GetAttr((PyObject *)co, co_filename_str);
        PyObject *func = file ? PyObject_GetAttr((PyObject *)co, co_name_str)
                              : NULL;
        Py_DECREF(co);
        if (!func || !PyUnicode_Check(file) || !PyUnicode_Check(func)) {
            Py_XDECREF(file);
            Py_XDECREF(func);
            PyErr_Clear();
            break;
        }
        if (own_dir && PyUnicode_Tailmatch(file, own_dir, 0,
                                           PY_SSIZE_T_MAX, -1) == 1) {
            /* greqprof's own frames say nothing about the app. */
            Py_DECREF(file);
            Py_DECREF(func);
            PyFrameObject *back = PyFrame_GetBack(f);
            Py_DECREF(f);
            f = back;
            continue;
        }
        int line = PyFrame_GetLineNumber(f);
        lines[n] = PyUnicode_FromFormat("  File \"%.300U\", line %d, in %.200U\n",
                                        file, line, func);
        Py_DECREF(file);
        Py_DECREF(func);
        if (!lines[n]) {
            PyErr_Clear();
            break;
        }
        n++;
        PyFrameObject *back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
    }
    Py_XDECREF(f);
    PyObject *out = PyUnicode_FromString("");
    for (int i = n - 1; i >= 0; i--) {
        if (out) {
            PyObject *cat = PyUnicode_Concat(out, lines[i]);
            Py_DECREF(out);
            out = cat;
        }
        Py_DECREF(lines[i]);
    }
    if (!out) {
        PyErr_Clear();
    }
    return out;
}

static uint32_t store_stack(PyObject *text)
{
    if (!text) {
        return 0;
    }
    if (PyDict_GET_SIZE(reg_stacks) >= GQP_PY_MAX_STACKS) {
        /* Drop the oldest entry (dicts keep insertion order). */
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        if (PyDict_Next(reg_stacks, &pos, &k, &v)) {
            Py_INCREF(k);
            PyDict_DelItem(reg_stacks, k);
            Py_DECREF(k);
        }
    }
    uint32_t tag = next_tag++;
    if (next_tag == 0) {
        next_tag = 1;
    }
    PyObject *key = PyLong_FromUnsignedLong(tag);
    if (!key || PyDict_SetItem(reg_stacks, key, text) < 0) {
        tag = 0;
    }
    Py_XDECREF(key);
    PyErr_Clear();
    return tag;
}

/* A span closed long: keep where its greenlet was and queue a record. */
static void on_long_span(gqp_py_thread *st, PyObject *origin, int dead)
{
    if (st->inherit && st->hub_key == (uint64_t)(uintptr_t)origin) {
        /* The hub's span includes its wait for I/O: not blocking. */
        return;
    }
    gqp_span sp;
    gqp_profile *p = NULL;
    size_t idx = SIZE_MAX;
    if (gqp_tracer_last_span(st->tracer, &sp, &p, &idx) != GQP_OK) {
        return;
    }
    /* Retained: what runs below may run Python (a garbage collection's
     * finalizers, a greenlet's attributes) that ends the request. */
    if (p) {
        gqp_profile_retain(p);
    }
    uint32_t tag = 0;
    if (st->stacks && !dead) {
        PyObject *fr = getter_call(&frame_getter, origin);
        PyErr_Clear();
        if (!fr || fr == Py_None) {
            /* A running greenlet (a split span): where it is now. */
            Py_XDECREF(fr);
            fr = (PyObject *)PyThreadState_GetFrame(PyThreadState_Get());
        }
        PyObject *text = format_stack(fr);
        Py_XDECREF(fr);
        tag = store_stack(text);
        Py_XDECREF(text);
        if (tag && p && idx != SIZE_MAX) {
            gqp_profile_span_set_tag(p, idx, tag);
        }
    }
    if (!st->inherit || PyList_GET_SIZE(reg_long) >= GQP_PY_MAX_LONG) {
        /* Only the middleware's engines drain blocking records; the
         * whole-process Profiler just keeps the stack with the span. */
        goto out;
    }
    /* Name it now if nobody did: only greenlets in profiles are named
     * eagerly. */
    if (!p) {
        name_in_profile(st, origin, sp.greenlet_id, NULL);
    }
    /* The greenlet's spawners and the request it ran in, as they are now:
     * spawners are followed through live objects, and a note goes when
     * its greenlet dies, maybe before Python drains this record. */
    PyObject *chain = spawner_chain(st, origin, sp.greenlet_id);
    PyObject *note = chain ? note_find(st, chain) : NULL;
    /* Its names too: the registry drops a dead greenlet's soon.  (Held:
     * building the record may collect garbage, whose finalizers may.) */
    PyObject *key = PyLong_FromUnsignedLongLong(sp.greenlet_id);
    PyObject *names = NULL;
    if (key) {
        PyDict_GetItemRef(reg_names, key, &names);
    }
    Py_XDECREF(key);
    PyErr_Clear();
    /* A dead greenlet's function, from its start (a new reference). */
    PyObject *fixed = dead ? run_names(st, (uint64_t)(uintptr_t)origin,
                                       names) : NULL;
    PyObject *rec = Py_BuildValue(
        "(kKLLLIIKKNNN)", st->thread_id, (unsigned long long)sp.greenlet_id,
        (long long)sp.start_ns, (long long)sp.end_ns, (long long)sp.cpu_ns,
        (unsigned)sp.flags, (unsigned)tag,
        (unsigned long long)(uintptr_t)p,
        (unsigned long long)(uintptr_t)origin,
        note ? note : Py_NewRef(Py_None),
        chain ? chain : PyTuple_New(0),
        fixed ? Py_NewRef(fixed) : names ? Py_NewRef(names)
                                         : Py_NewRef(Py_None));
    Py_XDECREF(fixed);
    Py_XDECREF(names);
    if (rec) {
        PyList_Append(reg_long, rec);
        Py_DECREF(rec);
    }
    PyErr_Clear();
out:
    if (p) {
        gqp_profile_free(p);
    }
}

/* Stack of a thread's running frame (for watchdogs), stored under a tag;
 * 0 when nothing could be captured. */
static uint32_t gqp_py_capture_thread(unsigned long thread_id)
{
    PyGILState_STATE gs = PyGILState_Ensure();
    uint32_t tag = 0;
    /* sys._current_frames(), the documented way to another thread's frame
     * (its C function, _PyThread_CurrentFrames, is private). */
    PyObject *fn = PySys_GetObject("_current_frames");   /* borrowed */
    Py_XINCREF(fn);
    PyObject *frames = fn ? PyObject_CallNoArgs(fn) : NULL;
    Py_XDECREF(fn);
    if (frames && PyDict_Check(frames)) {
        PyObject *k = PyLong_FromUnsignedLong(thread_id);
        PyObject *fr = NULL;
        if (k && PyDict_GetItemRef(frames, k, &fr) > 0) {
            PyObject *text = format_stack(fr);
            tag = store_stack(text);
            Py_XDECREF(text);
        }
        Py_XDECREF(fr);
        Py_XDECREF(k);
    }
    Py_XDECREF(frames);
    PyErr_Clear();
    PyGILState_Release(gs);
    return tag;
}
