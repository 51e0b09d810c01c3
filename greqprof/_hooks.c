/* _hooks.c -- the CPython side of the binding, compiled into greqprof._core.
 *
 * Two hooks feed a thread's gqp_tracer without running Python code:
 *   - a C-implemented callable given to greenlet.settrace (one per switch);
 *   - a Py_tracefunc installed with PyEval_SetProfile (one per call/return).
 * Both chain to whatever was installed before them.
 *
 * Python objects cross the cffi boundary as addresses (id(obj)): the caller
 * keeps the object alive for the duration of the call.  Objects going the
 * other way are put into the dicts of greqprof._registry, which the hooks
 * fetch once at gqp_py_init().
 *
 * cffi releases the GIL around every call from Python, so each function
 * here that touches Python objects takes it back with PyGILState_Ensure. */
#include <Python.h>
#include <frameobject.h>
#include <string.h>

#include "_compat.h"

#include "greqprof.h"

typedef struct gqp_py_thread {
    gqp_tracer *tracer;        /* borrowed: owned by the Python object */
    unsigned long thread_id;
    int active;
    int calls;
    int builtins;
    int inherit;
    int stacks;                /* capture a stack for long spans */
    int profile_installed;
    uint64_t hub_key;          /* this thread's gevent hub, once seen */
    int installed;             /* still referenced by its thread's hooks */
    PyObject *trace_fn;        /* our callable given to greenlet.settrace */
    PyObject *ref;             /* hookref pointing back here */
    PyObject *prev_trace;      /* what greenlet.settrace returned */
    Py_tracefunc prev_prof;    /* the thread's previous profile function */
    PyObject *prev_prof_obj;
    uint64_t gen;              /* unique per start: _fastpath.c's arming */
    struct gqp_note *notes;    /* requests of live greenlets (_fastpath.c) */
    int open_profiles;         /* sampled profiles open (_sampled.c) */
    int busy;                  /* hooks running on it (st_enter) */
    int orphan;                /* freed while busy: the last st_leave frees */
} gqp_py_thread;

/* The calling thread's state, for install/uninstall.  The hooks themselves
 * get their state from their `self`/`obj` argument (a hookref), which is
 * cheaper than a thread-local in a shared object. */
static _Thread_local gqp_py_thread *gqp__tls;

typedef struct {
    PyObject_HEAD
    gqp_py_thread *st;
} gqp_hookref;

static PyTypeObject gqp_hookref_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "greqprof._core.hookref",
    .tp_basicsize = sizeof(gqp_hookref),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "greqprof hook state (internal)",
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

/* Fetched from greqprof._registry by gqp_py_init. */
static PyObject *reg_codes;     /* func key -> code object | C-func info */
static PyObject *reg_stacks;    /* tag -> stack text */
static PyObject *reg_long;      /* list of long-span records */
static PyObject *reg_names;     /* greenlet id -> (name, fn_name) */
static PyObject *reg_hub_ids;   /* thread ident -> its hub's id */
static PyObject *greenlet_settrace;
static PyObject *greenlet_getcurrent;
/* greenlet's `dead`, `gr_frame` and `parent` descriptors, called through
 * their type's __get__ slot: an attribute lookup per switch costs more. */
typedef struct {
    PyObject *descr;
    descrgetfunc get;
} gqp_getter;
static gqp_getter dead_getter;
static gqp_getter frame_getter;
static gqp_getter parent_getter;
static uint32_t next_tag = 1;
static PyObject *hub_module_name;
static PyObject *name_str;       /* "name", interned */
static PyObject *run_str;        /* "_run" */
static PyObject *spawning_str;   /* "spawning_greenlet" */
static PyTypeObject *greenlet_type;   /* greenlet.greenlet, kept */
static PyObject *co_filename_str, *co_name_str;
static PyObject *fn_names;       /* code address -> (code, qualified name) */
static PyObject *own_dir;       /* greqprof's package dir: its frames are
                                   left out of captured stacks */
static PyObject *reg_wait_sites; /* tag -> (code, fn_name, file, line, stack) */
static PyObject *text_clean;     /* greqprof._text.clean */
static PyObject *greenlet_dir;   /* greenlet's package dir, with '/' */
static PyObject *module_dir(PyObject *mod);

#define GQP_PY_MAX_LONG 1024
#define GQP_PY_MAX_STACKS 20000
#define GQP_PY_MAX_NAMES 65536
/* Functions named for call tables (calls=True).  Code made at run time
 * (exec, namedtuple) is new every time: past this, the oldest quarter is
 * dropped.  A profile still open across that may then show such a
 * function unnamed (or, were its address reused, under the new name). */
#define GQP_PY_MAX_CODES 20000
#define GQP_PY_STACK_DEPTH 40

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

/* defined with their functions below */
static PyMethodDef attach_def;
static PyMethodDef greenlet_id_def;
static PyMethodDef running_since_def;
static PyMethodDef wall_ns_def;
/* _fastpath.c */
static int gqp_py_fast_init(PyObject *reg);
static void note_forget(gqp_py_thread *st, uint64_t gid);
static PyObject *spawner_chain(gqp_py_thread *st, PyObject *g, uint64_t gid);
static PyObject *note_find(gqp_py_thread *st, PyObject *chain);
static void notes_free(gqp_py_thread *st);
static uint64_t thread_generation;            /* gqp_py_thread_start's */

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
                           &wall_ns_def};
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
    if (greenlet_settrace && greenlet_getcurrent && reg_codes &&
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

/* ---- the state's lifetime -------------------------------------------- */

/* The hooks run Python (a greenlet's attributes, a garbage collection's
 * finalizers), which may stop the profiler and free the state they work
 * on: while a hook runs, the state is only marked (orphan) and the hook
 * frees it when it leaves.  After any call that can run Python a hook
 * checks st_live before touching the tracer again. */
static void st_release(gqp_py_thread *st)
{
    if (st->busy) {
        st->active = 0;
        st->tracer = NULL;
        st->orphan = 1;
        return;
    }
    ((gqp_hookref *)st->ref)->st = NULL;
    Py_XDECREF(st->trace_fn);
    Py_XDECREF(st->ref);
    Py_XDECREF(st->prev_trace);
    Py_XDECREF(st->prev_prof_obj);
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
/* _fastpath.c: the function each live greenlet runs, kept from its start
 * (gevent drops a Greenlet's _run before its last switch). */
static void run_remember(gqp_py_thread *st, PyObject *g, uint64_t key);
static void run_forget(gqp_py_thread *st, uint64_t key);
static PyObject *run_names(gqp_py_thread *st, uint64_t key, PyObject *names);

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

/* 1 when g is a gevent Hub (only once gevent.hub has been imported).  The
 * type is looked up once: until the hub is seen, every new greenlet asks. */
static PyTypeObject *hub_type;

static int is_hub(PyObject *g)
{
    if (!hub_type) {
        PyObject *mod = PyImport_GetModule(hub_module_name);
        if (!mod) {
            PyErr_Clear();
            return 0;
        }
        PyObject *t = PyObject_GetAttrString(mod, "Hub");
        Py_DECREF(mod);
        if (!t || !PyType_Check(t)) {
            Py_XDECREF(t);
            PyErr_Clear();
            return 0;
        }
        hub_type = (PyTypeObject *)t; /* kept for the process's life */
    }
    return PyObject_TypeCheck(g, hub_type);
}

static void on_new_greenlet(gqp_py_thread *st, PyObject *target)
{
    uint64_t key = (uint64_t)(uintptr_t)target;
    if (st->inherit) {
        /* gevent records who spawned a Greenlet (a weak reference). */
        PyObject *ref = PyObject_GetAttr(target, spawning_str);
        PyErr_Clear();
        PyObject *parent = NULL;
        if (ref && PyWeakref_Check(ref) &&
            PyWeakref_GetRef(ref, &parent) > 0 && st_live(st)) {
            uint64_t pkey = (uint64_t)(uintptr_t)parent;
            gqp_tracer_inherit(st->tracer, key, pkey);
        }
        Py_XDECREF(parent);
        Py_XDECREF(ref);
        PyErr_Clear();
        run_remember(st, target, key);
        if (!st->hub_key && is_hub(target) && st_live(st)) {
            st->hub_key = key;
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
            PyErr_Clear();
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

/* ---- wait sites ------------------------------------------------------- */
/* A greenlet of a sampled request switched out (GQP_EV_WAIT): the site is
 * the innermost frame of its suspended stack outside gevent, greenlet and
 * greqprof, keyed by (code object, line).  Two caches keep this cheap, both
 * keyed by code address with each entry holding its code object (so an
 * address is not reused while it is cached), both emptied when half full:
 *   - per code object: whether it is gevent's, greenlet's or greqprof's,
 *     and its cleaned name and file name;
 *   - per (code object, instruction): the line and the "file:line in
 *     function" text of a frame stopped there (PyFrame_GetLineNumber
 *     scans the code's line table: computed once, not per switch).
 * A new site of a profile gets a record in _registry.wait_sites (its texts
 * and the code object, which keeps the key's address from being reused
 * while the profile is open). */

#define GQP_PY_WAIT_DEPTH 64      /* frames looked at for the site */
#define GQP_PY_CODE_SLOTS 2048    /* caches (powers of two) */
#define GQP_PY_LINE_SLOTS 8192
#define GQP_PY_MAX_WAIT_SITES 20000

#define CODE_INSIDE 0x1  /* gevent, greenlet or greqprof: not a site */
#define CODE_OWN 0x2     /* greqprof: left out of stacks */

static PyObject *gevent_dir;     /* gevent's package dir (once imported) */
static uint32_t next_site_tag = 1;

typedef struct {
    PyObject *code;      /* a reference, NULL = empty */
    int kind;            /* CODE_* */
    PyObject *fn_name;   /* cleaned, NULL until asked */
    PyObject *filename;
} code_slot;
static code_slot code_cache[GQP_PY_CODE_SLOTS];
static size_t code_cache_len;

typedef struct {
    PyObject *code;      /* a reference, NULL = empty */
    int lasti;
    int line;
    PyObject *entry;     /* "file:line in function", NULL until asked */
    PyObject *record;    /* the last site record made here (store_site) */
} line_slot;
static line_slot line_cache[GQP_PY_LINE_SLOTS];
static size_t line_cache_len;

/* The directory of a module's __file__, with its trailing '/'. */
static PyObject *module_dir(PyObject *mod)
{
    PyObject *file = PyObject_GetAttrString(mod, "__file__");
    PyObject *dir = NULL;
    if (file && PyUnicode_Check(file)) {
        Py_ssize_t n = PyUnicode_GetLength(file);
        Py_ssize_t slash = PyUnicode_FindChar(file, '/', 0, n, -1);
        if (slash > 0) {
            dir = PyUnicode_Substring(file, 0, slash + 1);
        }
    }
    Py_XDECREF(file);
    PyErr_Clear();
    return dir;
}

static int starts_with(PyObject *s, PyObject *prefix)
{
    return prefix && PyUnicode_Tailmatch(s, prefix, 0, PY_SSIZE_T_MAX, -1) == 1;
}

/* s cleaned by the text contract: printable ASCII as it is, anything else
 * through greqprof._text.clean.  A new reference, or NULL. */
static PyObject *clean_text(PyObject *s)
{
    if (PyUnicode_Check(s) && PyUnicode_IS_ASCII(s)) {
        const unsigned char *c = PyUnicode_1BYTE_DATA(s);
        Py_ssize_t n = PyUnicode_GET_LENGTH(s), i = 0;
        while (i < n && c[i] >= 0x20 && c[i] <= 0x7e) {
            i++;
        }
        if (i == n) {
            return Py_NewRef(s);
        }
    }
    if (!text_clean) {
        return PyObject_Str(s);
    }
    return PyObject_CallOneArg(text_clean, s);
}

static size_t slot_of(const void *code, int lasti, size_t mask)
{
    uint64_t a = (uint64_t)(uintptr_t)code ^ ((uint64_t)(unsigned)lasti << 40);
    return (size_t)((a * 0x9E3779B97F4A7C15ull) >> 40) & mask;
}

/* Empties a cache: its slots are moved out at once, and only then their
 * objects dropped (a deallocation may run Python code, which may let
 * another thread use the cache: it finds it empty, never half emptied).
 * (If the copy cannot be allocated: slot by slot, each emptied before its
 * objects go.) */
static void empty_code_cache(void)
{
    code_slot *old = PyMem_RawMalloc(sizeof code_cache);
    size_t n = old ? GQP_PY_CODE_SLOTS : 1;
    code_cache_len = 0;
    for (size_t k = 0; k < GQP_PY_CODE_SLOTS; k += n) {
        code_slot one, *o = old ? old : &one;
        memcpy(o, &code_cache[k], n * sizeof *o);
        memset(&code_cache[k], 0, n * sizeof *o);
        for (size_t j = 0; j < n; j++) {
            Py_XDECREF(o[j].code);
            Py_XDECREF(o[j].fn_name);
            Py_XDECREF(o[j].filename);
        }
    }
    PyMem_RawFree(old);
}

/* The cache entry of code object co (NULL when it cannot be made yet:
 * gevent's directory is not known before gevent is imported). */
static code_slot *code_info(PyCodeObject *co)
{
    size_t mask = GQP_PY_CODE_SLOTS - 1;
    size_t i = slot_of(co, 0, mask);
    for (; code_cache[i].code; i = (i + 1) & mask) {
        if (code_cache[i].code == (PyObject *)co) {
            return &code_cache[i];
        }
    }
    if (!gevent_dir) {
        PyObject *name = PyUnicode_InternFromString("gevent");
        PyObject *mod = name ? PyImport_GetModule(name) : NULL;
        Py_XDECREF(name);
        if (mod) {
            gevent_dir = module_dir(mod);
            Py_DECREF(mod);
        }
        PyErr_Clear();
        if (!gevent_dir) {
            return NULL;
        }
    }
    if (code_cache_len >= GQP_PY_CODE_SLOTS / 2) {
        /* Start over (code made at run time would grow it forever). */
        empty_code_cache();
        for (i = slot_of(co, 0, mask); code_cache[i].code; i = (i + 1) & mask) {
        }
    }
    PyObject *f = co->co_filename;
    int own = starts_with(f, own_dir);
    code_slot *s = &code_cache[i];
    s->code = Py_NewRef((PyObject *)co);
    s->kind = (own ? CODE_OWN | CODE_INSIDE : 0) |
              (starts_with(f, gevent_dir) || starts_with(f, greenlet_dir)
                   ? CODE_INSIDE : 0);
    s->fn_name = s->filename = NULL;
    code_cache_len++;
    return s;
}

static int code_kind(PyCodeObject *co)
{
    code_slot *s = code_info(co);
    if (s) {
        return s->kind;
    }
    /* (gevent not imported yet: no gevent frame can exist) */
    int own = starts_with(co->co_filename, own_dir);
    return (own ? CODE_OWN | CODE_INSIDE : 0) |
           (starts_with(co->co_filename, greenlet_dir) ? CODE_INSIDE : 0);
}

#if PY_VERSION_HEX < 0x030B0000
/* 3.10 has no co_qualname: the qualified name of a code object is found
 * once (the code cache keeps it) from its frame's globals: a function of
 * that module whose code it is (its __qualname__), or, for a function
 * defined inside another (or a class body), the name the compiler put
 * right after the code object in the enclosing code's constants (3.10's
 * MAKE_FUNCTION takes both from there).  Only C-level reads: no Python
 * code runs and nothing is allocated.  Borrowed, or NULL (then co_name). */
#define QN_BUDGET 20000   /* objects looked at, at most */

static PyObject *qn_in_consts(PyCodeObject *co, PyCodeObject *in, int depth,
                              int *budget)
{
    PyObject *consts = in->co_consts;
    if (!consts || !PyTuple_Check(consts)) {
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(consts);
    for (Py_ssize_t i = 0; i < n && --*budget > 0; i++) {
        PyObject *c = PyTuple_GET_ITEM(consts, i);
        if (c == (PyObject *)co) {
            PyObject *next = i + 1 < n ? PyTuple_GET_ITEM(consts, i + 1) : NULL;
            if (next && PyUnicode_Check(next) &&
                PyUnicode_Tailmatch(next, co->co_name, 0, PY_SSIZE_T_MAX,
                                    1) == 1) {
                return next;
            }
            return NULL;
        }
        if (PyCode_Check(c) && depth < 8) {
            PyObject *r = qn_in_consts(co, (PyCodeObject *)c, depth + 1,
                                       budget);
            if (r) {
                return r;
            }
        }
    }
    return NULL;
}

static PyObject *qn_in(PyCodeObject *co, PyObject *v, PyObject *globals,
                       PyObject *modname, int depth, int *budget)
{
    if (--*budget <= 0) {
        return NULL;
    }
    if (Py_IS_TYPE(v, &PyStaticMethod_Type) ||
        Py_IS_TYPE(v, &PyClassMethod_Type)) {
        /* (their __func__ is a C member) */
        PyObject *fn = PyObject_GetAttrString(v, "__func__");
        PyObject *r = fn ? qn_in(co, fn, globals, modname, depth, budget)
                         : NULL;
        PyErr_Clear();
        Py_XDECREF(fn); /* (the wrapper holds it: r stays valid) */
        return r;
    }
    if (PyFunction_Check(v)) {
        PyFunctionObject *fn = (PyFunctionObject *)v;
        if (fn->func_globals != globals) {
            return NULL; /* (another module's) */
        }
        if (fn->func_code == (PyObject *)co) {
            return PyUnicode_Check(fn->func_qualname) ? fn->func_qualname
                                                      : NULL;
        }
        return PyCode_Check(fn->func_code)
            ? qn_in_consts(co, (PyCodeObject *)fn->func_code, 0, budget)
            : NULL;
    }
    if (PyType_Check(v) && depth < 4 && modname) {
        /* (a class of this module: its methods, nested classes) */
        PyObject *dict = ((PyTypeObject *)v)->tp_dict;
        if (!dict || !PyDict_Check(dict)) {
            return NULL;
        }
        PyObject *mod = PyDict_GetItemString(dict, "__module__");
        if (!mod || !PyUnicode_CheckExact(mod) ||
            PyUnicode_Compare(mod, modname) != 0) {
            PyErr_Clear();
            return NULL;
        }
        Py_ssize_t pos = 0;
        PyObject *k, *item;
        while (PyDict_Next(dict, &pos, &k, &item)) {
            PyObject *r = qn_in(co, item, globals, modname, depth + 1, budget);
            if (r || *budget <= 0) {
                return r;
            }
        }
    }
    return NULL;
}
/* The qualified name of co, borrowed, or NULL. */
static PyObject *qualname_310(PyCodeObject *co, PyFrameObject *f)
{
    PyObject *globals = f ? f->f_globals : NULL;
    if (!globals || !PyDict_Check(globals)) {
        return NULL;
    }
    PyObject *modname = PyDict_GetItemString(globals, "__name__");
    if (modname && !PyUnicode_CheckExact(modname)) {
        modname = NULL;
    }
    PyErr_Clear();
    int budget = QN_BUDGET;
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (budget > 0 && PyDict_Next(globals, &pos, &k, &v)) {
        PyObject *r = qn_in(co, v, globals, modname, 0, &budget);
        if (r) {
            return r;
        }
    }
    return NULL;
}
#endif

/* Cleaned (fn_name, filename) of co (running in frame f), new
 * references, or -1. */
static int code_names(PyCodeObject *co, PyFrameObject *f, PyObject **fn,
                      PyObject **file)
{
    code_slot *s = code_info(co);
    if (!s) {
        return -1;
    }
    if (s->fn_name) {
        *fn = Py_NewRef(s->fn_name);
        *file = Py_NewRef(s->filename);
        return 0;
    }
    /* Made in locals: clean_text may run Python code, and the GIL may then
     * pass to another thread whose hook empties the cache (s may be
     * another code object's slot by then). */
#if PY_VERSION_HEX >= 0x030B0000
    (void)f;
    PyObject *name = clean_text(co->co_qualname);
#else
    /* (held: it is borrowed from a function or constants that the Python
     * code clean_text may run could drop) */
    PyObject *qn = Py_XNewRef(qualname_310(co, f));
    PyObject *name = clean_text(qn ? qn : co->co_name);
    Py_XDECREF(qn);
#endif
    PyObject *fname = name ? clean_text(co->co_filename) : NULL;
    if (!fname) {
        Py_XDECREF(name);
        return -1;
    }
    s = code_info(co);
    if (s && !s->fn_name) {
        s->fn_name = Py_NewRef(name);
        s->filename = Py_NewRef(fname);
    }
    *fn = name;
    *file = fname;
    return 0;
}

static int frame_lasti(PyFrameObject *f)
{
#if PY_VERSION_HEX >= 0x030B0000
    return PyFrame_GetLasti(f);
#else
    return f->f_lasti;
#endif
}

/* (as empty_code_cache) */
static void empty_line_cache(void)
{
    line_slot *old = PyMem_RawMalloc(sizeof line_cache);
    size_t n = old ? GQP_PY_LINE_SLOTS : 1;
    line_cache_len = 0;
    for (size_t k = 0; k < GQP_PY_LINE_SLOTS; k += n) {
        line_slot one, *o = old ? old : &one;
        memcpy(o, &line_cache[k], n * sizeof *o);
        memset(&line_cache[k], 0, n * sizeof *o);
        for (size_t j = 0; j < n; j++) {
            Py_XDECREF(o[j].code);
            Py_XDECREF(o[j].entry);
            Py_XDECREF(o[j].record);
        }
    }
    PyMem_RawFree(old);
}

/* The line cache entry of frame f (of code co).  Like code_info's, the
 * pointer is good only until something that may run Python code: then
 * the GIL may pass to another thread whose hook empties or reuses the
 * slot (look it up again). */
static line_slot *line_info(PyFrameObject *f, PyCodeObject *co)
{
    size_t mask = GQP_PY_LINE_SLOTS - 1;
    int lasti = frame_lasti(f);
    size_t i = slot_of(co, lasti, mask);
    for (; line_cache[i].code; i = (i + 1) & mask) {
        if (line_cache[i].code == (PyObject *)co &&
            line_cache[i].lasti == lasti) {
            return &line_cache[i];
        }
    }
    if (line_cache_len >= GQP_PY_LINE_SLOTS / 2) {
        empty_line_cache();
        for (i = slot_of(co, lasti, mask); line_cache[i].code;
             i = (i + 1) & mask) {
        }
    }
    line_slot *s = &line_cache[i];
    s->code = Py_NewRef((PyObject *)co);
    s->lasti = lasti;
    /* (code without a line table, e.g. made at run time, says -1: such a
     * site's line is 0, as RequestProfile documents) */
    int line = PyFrame_GetLineNumber(f);
    s->line = line < 0 ? 0 : line;
    s->entry = NULL;
    s->record = NULL;
    line_cache_len++;
    return s;
}

/* "file:line in function" of a frame (a new reference), or NULL. */
static PyObject *frame_entry(PyFrameObject *f, PyCodeObject *co)
{
    line_slot *s = line_info(f, co);
    if (s->entry) {
        return Py_NewRef(s->entry);
    }
    int line = s->line;
    PyObject *fn, *file;
    if (code_names(co, f, &fn, &file) < 0) {
        return NULL;
    }
    PyObject *e = PyUnicode_FromFormat("%U:%d in %U", file, line, fn);
    Py_DECREF(fn);
    Py_DECREF(file);
    if (!e) {
        return NULL;
    }
    /* (looked up again: code_names may have run Python code) */
    s = line_info(f, co);
    if (s->entry) {
        /* (another thread's: the cache's object, so same_stack's identity
         * check holds) */
        Py_SETREF(e, Py_NewRef(s->entry));
    } else {
        s->entry = Py_NewRef(e);
    }
    return e;
}

/* ("file:line in function", ...) from frame f outwards, outermost first,
 * greqprof's own frames left out.  Steals f. */
static PyObject *site_stack(PyFrameObject *f)
{
    PyObject *lines[GQP_PY_STACK_DEPTH];
    int n = 0, ok = 1;
    while (f && n < GQP_PY_STACK_DEPTH) {
        PyCodeObject *co = PyFrame_GetCode(f);
        if (!(code_kind(co) & CODE_OWN)) {
            PyObject *e = frame_entry(f, co);
            if (!e) {
                ok = 0;
                Py_DECREF(co);
                break;
            }
            lines[n++] = e;
        }
        Py_DECREF(co);
        PyFrameObject *back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
    }
    Py_XDECREF(f);
    PyObject *t = ok ? PyTuple_New(n) : NULL;
    for (int i = 0; i < n; i++) {
        if (t) {
            PyTuple_SET_ITEM(t, i, lines[n - 1 - i]); /* (steals) */
        } else {
            Py_DECREF(lines[n - 1 - i]);
        }
    }
    return t;
}

/* 1 when stack (a site record's, outermost first) is the stack of frame f
 * outwards as site_stack would make it: its entries are the line cache's
 * objects, so identity is enough. */
static int same_stack(PyFrameObject *f, PyObject *stack)
{
    Py_ssize_t k = PyTuple_GET_SIZE(stack);
    int same = 1;
    Py_INCREF(f);
    while (f && same && k > 0) {
        PyCodeObject *co = PyFrame_GetCode(f);
        if (!(code_kind(co) & CODE_OWN)) {
            PyObject *e = frame_entry(f, co);
            same = e == PyTuple_GET_ITEM(stack, --k);
            Py_XDECREF(e);
        }
        Py_DECREF(co);
        PyFrameObject *back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
    }
    /* (the rest of the chain must be only greqprof's own frames, or be
     * past site_stack's depth) */
    while (f && same && PyTuple_GET_SIZE(stack) < GQP_PY_STACK_DEPTH) {
        PyCodeObject *co = PyFrame_GetCode(f);
        same = (code_kind(co) & CODE_OWN) != 0;
        Py_DECREF(co);
        PyFrameObject *back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
    }
    Py_XDECREF(f);
    return same && k == 0;
}

/* Drops a profile's reference (an owner capsule's destructor). */
static void owner_free(PyObject *cap)
{
    gqp_profile_free(PyCapsule_GetPointer(cap, "greqprof.wait_owner"));
}

/* profile address -> owner capsule: one per profile with records in the
 * registry; the capsule holds a reference to the profile (its address is
 * not reused while its records are there). */
static PyObject *wait_owners;
static Py_ssize_t wait_sites_sweep_at = GQP_PY_MAX_WAIT_SITES;
static Py_ssize_t wait_owners_sweep_at = 256;

/* Records of dropped profiles out of the registry: a profile held by
 * nothing but its owner capsule will never be read out.  Records of other
 * profiles stay (open ones still gain sites, closed ones are yet to be
 * read): their number is bounded by the open and finishing profiles' site
 * tables. */
static void sweep_wait_sites(void)
{
    PyObject *gone = PySet_New(NULL);
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (gone && PyDict_Next(wait_owners, &pos, &k, &v)) {
        gqp_profile *p = PyCapsule_GetPointer(v, "greqprof.wait_owner");
        if (p && gqp_profile_refs(p) == 1 && PySet_Add(gone, v) < 0) {
            Py_CLEAR(gone);
        }
    }
    PyObject *keys = gone && PySet_GET_SIZE(gone) ? PyList_New(0) : NULL;
    PyObject *owners = keys ? PyList_New(0) : NULL;
    if (!owners) {
        Py_CLEAR(keys);
    }
    pos = 0;
    while (keys && PyDict_Next(reg_wait_sites, &pos, &k, &v)) {
        if (PyTuple_Check(v) && PyTuple_GET_SIZE(v) == 2 &&
            PySet_Contains(gone, PyTuple_GET_ITEM(v, 1)) == 1 &&
            PyList_Append(keys, k) < 0) {
            Py_CLEAR(keys);
        }
    }
    pos = 0;
    while (keys && PyDict_Next(wait_owners, &pos, &k, &v)) {
        if (PySet_Contains(gone, v) == 1 && PyList_Append(owners, k) < 0) {
            Py_CLEAR(keys);
        }
    }
    /* (from lists: a deallocation may run Python code, and another
     * thread's hook may change the dicts meanwhile) */
    for (Py_ssize_t i = 0; keys && i < PyList_GET_SIZE(keys); i++) {
        if (PyDict_DelItem(reg_wait_sites, PyList_GET_ITEM(keys, i)) < 0) {
            PyErr_Clear();
        }
    }
    for (Py_ssize_t i = 0; keys && i < PyList_GET_SIZE(owners); i++) {
        if (PyDict_DelItem(wait_owners, PyList_GET_ITEM(owners, i)) < 0) {
            PyErr_Clear();
        }
    }
    Py_XDECREF(keys);
    Py_XDECREF(owners);
    Py_XDECREF(gone);
    PyErr_Clear();
    Py_ssize_t n = PyDict_GET_SIZE(reg_wait_sites);
    Py_ssize_t no = PyDict_GET_SIZE(wait_owners);
    wait_sites_sweep_at = n + GQP_PY_MAX_WAIT_SITES / 2;
    if (wait_sites_sweep_at < GQP_PY_MAX_WAIT_SITES) {
        wait_sites_sweep_at = GQP_PY_MAX_WAIT_SITES;
    }
    wait_owners_sweep_at = no < 128 ? 256 : 2 * no;
}

/* The owner capsule of p (new reference), or NULL. */
static PyObject *wait_owner(gqp_profile *p)
{
    if (!wait_owners && !(wait_owners = PyDict_New())) {
        return NULL;
    }
    PyObject *key = PyLong_FromVoidPtr(p);
    if (!key) {
        return NULL;
    }
    PyObject *cap = PyDict_GetItemWithError(wait_owners, key);
    if (cap) {
        Py_INCREF(cap);
    } else if (!PyErr_Occurred() && gqp_profile_retain(p) == GQP_OK) {
        cap = PyCapsule_New(p, "greqprof.wait_owner", owner_free);
        if (!cap) {
            gqp_profile_free(p);
        } else if (PyDict_SetItem(wait_owners, key, cap) < 0) {
            Py_CLEAR(cap);
        }
    }
    Py_DECREF(key);
    return cap;
}

/* Records a new site of profile p (site frame f, borrowed) in the
 * registry as (record, owner); its tag.  The record made last time at
 * this instruction is used again when the stack above is the same (a
 * request's sites are mostly the previous request's). */
static uint32_t store_site(PyFrameObject *f, PyCodeObject *co,
                           gqp_profile *p)
{
    if (PyDict_GET_SIZE(reg_wait_sites) >= wait_sites_sweep_at ||
        (wait_owners && PyDict_GET_SIZE(wait_owners) >= wait_owners_sweep_at)) {
        sweep_wait_sites();
    }
    line_slot *ls = line_info(f, co);
    PyObject *rec = ls->record ? Py_NewRef(ls->record) : NULL;
    if (rec && !same_stack(f, PyTuple_GET_ITEM(rec, 4))) {
        Py_CLEAR(rec);
    }
    PyObject *fn, *file;
    if (!rec && code_names(co, f, &fn, &file) == 0) {
        /* (the slots are looked up again after code that may run Python
         * code: see line_info) */
        int line = line_info(f, co)->line;
        PyObject *stack = site_stack((PyFrameObject *)Py_NewRef(f));
        rec = stack ? Py_BuildValue("(OOOiN)", (PyObject *)co, fn, file, line,
                                    stack)
                    : NULL;
        Py_DECREF(fn);
        Py_DECREF(file);
        if (rec) {
            ls = line_info(f, co);
            Py_XSETREF(ls->record, Py_NewRef(rec));
        }
    }
    uint32_t tag = 0;
    PyObject *owner = rec ? wait_owner(p) : NULL;
    PyObject *val = owner ? PyTuple_Pack(2, rec, owner) : NULL;
    PyObject *key = val ? PyLong_FromUnsignedLong(next_site_tag) : NULL;
    if (key && PyDict_SetItem(reg_wait_sites, key, val) == 0) {
        tag = next_site_tag++;
        if (next_site_tag == 0) {
            next_site_tag = 1;
        }
    }
    Py_XDECREF(key);
    Py_XDECREF(val);
    Py_XDECREF(owner);
    Py_XDECREF(rec);
    PyErr_Clear();
    return tag;
}

/* 1 while on_wait runs: an allocation in it may run the garbage
 * collector, whose finalizers may switch greenlets (a greenlet collected
 * unfinished is killed by switching into it) and so call the hook again.
 * Such a nested wait gets no site (it is not charged).  Per thread: while
 * Python code runs in one thread's hook (clean_text, a collection), the GIL
 * may pass to another thread, whose hook uses the same caches (their
 * slots are looked up again after such code: see line_info). */
static _Thread_local int in_on_wait;
static void on_wait_at(gqp_py_thread *st, PyObject *origin);

/* origin switched out alive while attached to a profile: say where. */
static void on_wait(gqp_py_thread *st, PyObject *origin)
{
    if (in_on_wait) {
        return;
    }
    in_on_wait = 1;
    on_wait_at(st, origin);
    in_on_wait = 0;
}

static void on_wait_at(gqp_py_thread *st, PyObject *origin)
{
    PyObject *fr = getter_call(&frame_getter, origin);
    if (!fr || !PyFrame_Check(fr)) {
        Py_XDECREF(fr);
        PyErr_Clear();
        return;
    }
    PyFrameObject *top = (PyFrameObject *)fr;
    PyFrameObject *f = (PyFrameObject *)Py_NewRef(fr);
    PyCodeObject *co = NULL;
    for (int depth = 0; f && depth < GQP_PY_WAIT_DEPTH; depth++) {
        co = PyFrame_GetCode(f);
        if (!(code_kind(co) & CODE_INSIDE)) {
            break;
        }
        Py_CLEAR(co);
        PyFrameObject *back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
    }
    if (!co) {
        /* Only gevent's own frames (e.g. the server writing a response):
         * the innermost one. */
        Py_XDECREF(f);
        f = (PyFrameObject *)Py_NewRef(top);
        co = PyFrame_GetCode(f);
    }
    int line = line_info(f, co)->line;
    /* Code addresses fit 48 bits; lines past 65535 share a key. */
    uint64_t site = (uint64_t)(uintptr_t)co ^
                    ((uint64_t)(line > 0xffff ? 0xffff : line & 0xffff) << 48);
    gqp_profile *p = NULL;
    size_t idx = 0;
    int ev = gqp_tracer_wait_at(st->tracer, (uint64_t)(uintptr_t)origin,
                                site ? site : 1, &p, &idx);
    /* (p held: store_site runs Python code, and the GIL may pass to a
     * thread that drops it) */
    if (ev > 0 && (ev & GQP_EV_NEW_SITE) && p &&
        gqp_profile_retain(p) == GQP_OK) {
        uint32_t tag = store_site(f, co, p);
        if (tag) {
            gqp_profile_wait_set_tag(p, idx, tag);
        }
        gqp_profile_free(p);
    }
    Py_DECREF(co);
    Py_DECREF(f);
    Py_DECREF(fr);
    PyErr_Clear();
}

/* read_waits(profile, take): the profile's wait sites, as a tuple
 *   (records, stats, dropped, events, events_dropped)
 * records: per site, in table order, its registry record (code, fn_name,
 * filename, lineno, stack), or None when the registry dropped it; stats:
 * the gqp_wait_stat structs as bytes (_collect.WAIT_SITE_ROW); events: the
 * gqp_wait_event structs as bytes (_collect.WAIT_EVENT_ROW).  take: the
 * records go out of the registry (the profile is done).  Rows are bytes
 * and the records are shared: the public WaitSite objects are made only
 * if someone reads them. */

_Static_assert(sizeof(gqp_wait_event) == 32,
               "_collect.WAIT_EVENT_ROW is '=QqqII'");
_Static_assert(sizeof(gqp_wait_stat) == 40,
               "_collect.WAIT_SITE_ROW is '=QqQQII'");

static PyObject *read_waits(gqp_profile *p, int take)
{
    size_t n = gqp_profile_wait_count(p);
    size_t ne = gqp_profile_wait_event_count(p);
    PyObject *recs = PyTuple_New((Py_ssize_t)n);
    PyObject *stats = PyBytes_FromStringAndSize(
        NULL, (Py_ssize_t)(n * sizeof(gqp_wait_stat)));
    PyObject *events = PyBytes_FromStringAndSize(
        NULL, (Py_ssize_t)(ne * sizeof(gqp_wait_event)));
    if (!recs || !stats || !events) {
        goto fail;
    }
    gqp_wait_stat *ws = (gqp_wait_stat *)(void *)PyBytes_AS_STRING(stats);
    for (size_t i = 0; i < n; i++) {
        if (gqp_profile_wait(p, i, &ws[i]) != GQP_OK) {
            memset(&ws[i], 0, sizeof ws[i]);
        }
        PyObject *rec = NULL;
        if (ws[i].tag) {
            PyObject *key = PyLong_FromUnsignedLong(ws[i].tag);
            if (!key) {
                goto fail;
            }
            PyObject *v = PyDict_GetItemWithError(reg_wait_sites, key);
            rec = v && PyTuple_Check(v) && PyTuple_GET_SIZE(v) == 2
                ? Py_NewRef(PyTuple_GET_ITEM(v, 0)) : NULL;
            if (rec && take && PyDict_DelItem(reg_wait_sites, key) < 0) {
                PyErr_Clear();
            }
            Py_DECREF(key);
            PyErr_Clear();
        }
        PyTuple_SET_ITEM(recs, (Py_ssize_t)i, rec ? rec : Py_NewRef(Py_None));
    }
    if (take && wait_owners) {
        /* (its records are out: its owner goes too) */
        PyObject *key = PyLong_FromVoidPtr(p);
        if (!key || PyDict_DelItem(wait_owners, key) < 0) {
            PyErr_Clear();
        }
        Py_XDECREF(key);
    }
    gqp_wait_event *ev = (gqp_wait_event *)(void *)PyBytes_AS_STRING(events);
    for (size_t k = 0; k < ne; k++) {
        if (gqp_profile_wait_event(p, k, &ev[k]) != GQP_OK) {
            memset(&ev[k], 0, sizeof ev[k]);
        }
    }
    return Py_BuildValue(
        "(NNKNK)", recs, stats,
        (unsigned long long)gqp_profile_waits_dropped(p), events,
        (unsigned long long)gqp_profile_wait_events_dropped(p));
fail:
    Py_XDECREF(recs);
    Py_XDECREF(stats);
    Py_XDECREF(events);
    return NULL;
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
        Py_RETURN_NONE;
    }
    st_enter(st);
    if (st->active) {
        PyObject *origin = PyTuple_GET_ITEM(pair, 0);
        PyObject *target = PyTuple_GET_ITEM(pair, 1);
        int dead = is_dead(origin);
        uint64_t dead_id = 0;
        if (dead) {
            gqp_tracer_greenlet_id(st->tracer, (uint64_t)(uintptr_t)origin,
                                   &dead_id);
        }
        int ev = gqp_tracer_switch(st->tracer, (uint64_t)(uintptr_t)origin,
                                   (uint64_t)(uintptr_t)target,
                                   dead ? GQP_SWITCH_FROM_DEAD : 0);
        if (dead_id) {
            forget_later(dead_id);
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
    }
    PyObject *res = st->prev_trace
        ? PyObject_Vectorcall(st->prev_trace, args, (size_t)nargs, NULL)
        : Py_NewRef(Py_None);
    st_leave(st);
    return res;
}

/* METH_FASTCALL: no argument tuple is built for the call itself. */
static PyMethodDef gqp__trace_def = {"greqprof_switch_hook",
                                     (PyCFunction)(void (*)(void))gqp__trace,
                                     METH_FASTCALL,
                                     "greqprof's greenlet switch hook."};

/* ---- the call hook ---------------------------------------------------- */

/* Room for one more function in reg_codes (see GQP_PY_MAX_CODES). */
static void codes_make_room(void)
{
    Py_ssize_t n = PyDict_GET_SIZE(reg_codes);
    if (n < GQP_PY_MAX_CODES) {
        return;
    }
    PyObject *old = PyList_New(0);
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (old && PyList_GET_SIZE(old) < n / 4 &&
           PyDict_Next(reg_codes, &pos, &key, &value)) {
        if (PyList_Append(old, key) < 0) {
            Py_CLEAR(old);
        }
    }
    for (Py_ssize_t i = 0; old && i < PyList_GET_SIZE(old); i++) {
        PyDict_DelItem(reg_codes, PyList_GET_ITEM(old, i));
    }
    Py_XDECREF(old);
    PyErr_Clear();
}

static void register_code(uint64_t key, PyObject *obj)
{
    codes_make_room();
    PyObject *k = PyLong_FromUnsignedLongLong(key);
    if (k) {
        PyObject *r = PyDict_SetDefault(reg_codes, k, obj);
        (void)r;
        Py_DECREF(k);
    }
    PyErr_Clear();
}

static void register_cfunc(uint64_t key, PyObject *fn)
{
    PyObject *k = PyLong_FromUnsignedLongLong(key);
    if (!k) {
        PyErr_Clear();
        return;
    }
    int known = PyDict_Contains(reg_codes, k);
    if (known == 0) {
        codes_make_room();
        /* fn is a builtin_function_or_method: these attributes are its
         * fields (no Python runs); self is held by fn. */
        PyObject *self = PyCFunction_GetSelf(fn);
        const char *owner = NULL;
        if (self && !PyModule_Check(self)) {
            owner = PyType_Check(self) ? ((PyTypeObject *)self)->tp_name
                                       : Py_TYPE(self)->tp_name;
        }
        PyObject *name = PyObject_GetAttrString(fn, "__name__");
        PyObject *mod = name ? PyObject_GetAttrString(fn, "__module__")
                             : NULL;
        PyObject *info = mod ? Py_BuildValue("(sOOz)", "builtin", name,
                                             mod, owner)
                             : NULL;
        if (info) {
            PyDict_SetItem(reg_codes, k, info);
            Py_DECREF(info);
        }
        Py_XDECREF(name);
        Py_XDECREF(mod);
    }
    Py_DECREF(k);
    PyErr_Clear();
}

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

/* ---- installing ------------------------------------------------------- */

#define GQP_PY_CALLS 0x1
#define GQP_PY_BUILTINS 0x2
#define GQP_PY_INHERIT 0x4
#define GQP_PY_STACKS 0x8
#define GQP_PY_CALLS_LATER 0x10 /* install the call hook on gqp_py_calls */

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
            PyEval_SetProfile(old->prev_prof, old->prev_prof_obj);
        }
        PyObject *r = PyObject_CallFunctionObjArgs(
            greenlet_settrace, old->prev_trace ? old->prev_trace : Py_None,
            NULL);
        Py_XDECREF(r);
        PyErr_Clear();
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
    st->active = 1;
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
    st->active = 0;
    int own = gqp__tls == st;
    if (own) {
        if (st->profile_installed) {
            PyEval_SetProfile(st->prev_prof, st->prev_prof_obj);
            st->profile_installed = 0;
        }
        PyObject *r = PyObject_CallFunctionObjArgs(
            greenlet_settrace, st->prev_trace ? st->prev_trace : Py_None, NULL);
        Py_XDECREF(r);
        PyErr_Clear();
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
    } else if (on && !st->profile_installed) {
        PyEval_SetProfile(gqp__profile, st->ref);
        st->profile_installed = 1;
    } else if (!on && st->profile_installed) {
        PyEval_SetProfile(st->prev_prof, st->prev_prof_obj);
        st->profile_installed = 0;
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
        st->active = 0;
        st->tracer = NULL;
    } else {
        st_release(st);
    }
    PyGILState_Release(gs);
}

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

/* Bulk readers: copy under the GIL so a hook in another thread cannot
 * change the profile mid-read.  Return the number of entries written. */
#define GQP_PY_READER(name, type, getter)                               \
    static size_t name(gqp_profile *p, type *out, size_t n)            \
    {                                                                  \
        PyGILState_STATE gs = PyGILState_Ensure();                     \
        size_t i = 0;                                                  \
        for (; i < n && getter(p, i, &out[i]) == GQP_OK; i++) {        \
        }                                                              \
        PyGILState_Release(gs);                                        \
        return i;                                                      \
    }

GQP_PY_READER(gqp_py_read_spans, gqp_span, gqp_profile_span)
GQP_PY_READER(gqp_py_read_funcs, gqp_func_stat, gqp_profile_func)
GQP_PY_READER(gqp_py_read_edges, gqp_edge_stat, gqp_profile_edge)
GQP_PY_READER(gqp_py_read_greenlets, gqp_greenlet_stat, gqp_profile_greenlet)

/* ---- one-call profile reader ------------------------------------------ */
/* read_profile(profile, tracer, start_ns, end_ns, top, take) (build_profile):
 * what a request's RequestProfile needs, read out in one call, because its
 * sources do not last: the profile's memory goes when the request is
 * finalized, the tracer's history moves on, and the registry drops stacks
 * and the names of dead greenlets.  Rows are copied as packed bytes, not
 * tuples: the records are built from them only if someone reads them
 * (greqprof._collect.request_records).
 *   (spans, greenlets, longest, end_ns, waited_ns, waited_top, complete,
 *    spans_dropped, calls_dropped, epoch_origin, wall_origin, names,
 *    stacks, waits)
 * spans: gqp_span structs (_collect.SPAN_ROW); greenlets:
 * gqp_py_greenlet_row structs (_collect.GREENLET_ROW); longest: one span's
 * bytes, or None; end_ns: the later of end_ns and the last span's end, the
 * window waited_* cover; waited_top: ((greenlet_id, ns, the registry's
 * names or None), ...); names: {greenlet_id: (name, fn_name)} for the
 * greenlets of the rows, the registry's names, else the profile's; stacks:
 * {tag: text} of the spans' stacks, taken out of the registry (take true)
 * or copied (take false: the profile is still open), or None; waits:
 * read_waits' (sites, dropped).  profile and
 * tracer are the addresses of live objects the caller owns (internal:
 * greqprof.middleware only). */

typedef struct gqp_py_greenlet_row {
    uint64_t greenlet_id;
    int64_t wall_ns;
    int64_t cpu_ns;
    uint64_t switches;
    int64_t first_ns;
    int64_t last_ns;
    uint64_t finished;
} gqp_py_greenlet_row;

_Static_assert(sizeof(gqp_span) == 40 && offsetof(gqp_span, tag) == 36,
               "_collect.SPAN_ROW is '=QqqqII'");
_Static_assert(sizeof(gqp_py_greenlet_row) == 56,
               "_collect.GREENLET_ROW is '=QqqQqqQ'");

#define GQP_PY_WAITED_TOP 16

/* names[id] = the registry's names of greenlet id, unless names has it. */
static int name_from_registry(PyObject *names, uint64_t id)
{
    PyObject *key = PyLong_FromUnsignedLongLong(id);
    if (!key) {
        return -1;
    }
    int rc = PyDict_Contains(names, key);
    if (rc == 0) {
        PyObject *n = NULL;
        rc = PyDict_GetItemRef(reg_names, key, &n);
        if (rc > 0) {
            rc = PyDict_SetItem(names, key, n);
            Py_DECREF(n);
        }
    }
    Py_DECREF(key);
    return rc < 0 ? -1 : 0;
}

/* (*stacks)[tag] = the registry's stack of tag (created on first use), taken
 * out of the registry when take is set. */
static int stack_of(PyObject **stacks, uint32_t tag, int take)
{
    PyObject *key = PyLong_FromUnsignedLong(tag);
    if (!key) {
        return -1;
    }
    int rc = 0;
    PyObject *text = PyDict_GetItemWithError(reg_stacks, key); /* borrowed */
    if (text) {
        Py_INCREF(text);
        if (!*stacks) {
            *stacks = PyDict_New();
        }
        if (!*stacks || PyDict_SetItem(*stacks, key, text) < 0 ||
            (take && PyDict_DelItem(reg_stacks, key) < 0)) {
            rc = -1;
        }
        Py_DECREF(text);
    } else if (PyErr_Occurred()) {
        rc = -1;
    }
    Py_DECREF(key);
    return rc;
}

/* The (name, fn_name) of a greenlet row: the registry's (known, borrowed,
 * may be NULL), else the profile's, else None.  The hooks name a greenlet
 * in both at once, the registry in full (the profile truncates them to
 * GQP_PROFILE_MAX_NAME bytes), so the profile's only matter once the
 * registry forgot the greenlet; they are decoded only then.  Names that
 * are not UTF-8 (cut in a character) count as none. */
static PyObject *row_names(const gqp_greenlet_stat *g, PyObject *known)
{
    const char *nm = g->name ? g->name : "";
    const char *fn = g->fn_name ? g->fn_name : "";
    if (known || (!*nm && !*fn)) {
        return Py_NewRef(known ? known : Py_None);
    }
    PyObject *name = PyUnicode_DecodeUTF8(nm, (Py_ssize_t)strlen(nm), NULL);
    PyObject *fn_name = name ? PyUnicode_DecodeUTF8(
        fn, (Py_ssize_t)strlen(fn), NULL) : NULL;
    PyObject *pair = fn_name ? PyTuple_Pack(2, name, fn_name) : NULL;
    Py_XDECREF(name);
    Py_XDECREF(fn_name);
    if (!pair && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
        PyErr_Clear();
        return Py_NewRef(Py_None);
    }
    return pair;
}

/* gid has a row among the first n (a short scan; 0 when there are many
 * rows, and the caller looks in the dict instead). */
static int has_row(const gqp_py_greenlet_row *rows, size_t n, uint64_t gid)
{
    if (n > 16) {
        return 0;
    }
    for (size_t i = 0; i < n; i++) {
        if (rows[i].greenlet_id == gid) {
            return 1;
        }
    }
    return 0;
}

#define GQP_PY_PROFILE_ITEMS 14

static PyObject *read_profile(PyObject *self, PyObject *const *args,
                              Py_ssize_t nargs)
{
    (void)self;
    if (want_args(nargs, 6, "read_profile") < 0) {
        return NULL;
    }
    gqp_profile *p = (gqp_profile *)PyLong_AsVoidPtr(args[0]);
    gqp_tracer *t = (gqp_tracer *)PyLong_AsVoidPtr(args[1]);
    long long start_ns = gqp_long_as_ll(args[2]);
    long long end_ns = gqp_long_as_ll(args[3]);
    Py_ssize_t top = PyLong_AsSsize_t(args[4]);
    int take = PyObject_IsTrue(args[5]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (!p || top < 0) {
        PyErr_SetString(PyExc_ValueError, "read_profile: bad arguments");
        return NULL;
    }
    if (top > GQP_PY_WAITED_TOP) {
        top = GQP_PY_WAITED_TOP;
    }
    PyObject *it[GQP_PY_PROFILE_ITEMS] = {NULL};
    PyObject *spans = NULL, *greenlets = NULL, *names = NULL;
    PyObject *stacks = NULL, *res = NULL;

    /* spans: copied into the bytes object as they are */
    size_t n = gqp_profile_span_count(p);
    spans = PyBytes_FromStringAndSize(NULL,
                                      (Py_ssize_t)(n * sizeof(gqp_span)));
    if (!spans) {
        goto done;
    }
    gqp_span *sp = (gqp_span *)(void *)PyBytes_AS_STRING(spans);
    size_t nspans = 0;
    for (; nspans < n; nspans++) {
        if (gqp_profile_span(p, nspans, &sp[nspans]) != GQP_OK) {
            break;
        }
        if (sp[nspans].end_ns > end_ns) {
            end_ns = sp[nspans].end_ns;
        }
        if (sp[nspans].tag && stack_of(&stacks, sp[nspans].tag, take) < 0) {
            goto done;
        }
    }

    /* greenlets: numbers as rows; names now (the registry forgets dead
     * greenlets, the profile goes with the request) */
    names = PyDict_New();
    if (!names) {
        goto done;
    }
    n = gqp_profile_greenlet_count(p);
    greenlets = PyBytes_FromStringAndSize(
        NULL, (Py_ssize_t)(n * sizeof(gqp_py_greenlet_row)));
    if (!greenlets) {
        goto done;
    }
    gqp_py_greenlet_row *rows =
        (gqp_py_greenlet_row *)(void *)PyBytes_AS_STRING(greenlets);
    size_t ngreenlets = 0;
    for (; ngreenlets < n; ngreenlets++) {
        gqp_greenlet_stat g;
        if (gqp_profile_greenlet(p, ngreenlets, &g) != GQP_OK) {
            break;
        }
        rows[ngreenlets] = (gqp_py_greenlet_row){
            g.greenlet_id, g.wall_ns, g.cpu_ns, g.switches, g.first_ns,
            g.last_ns, g.finished ? 1 : 0};
        PyObject *key = PyLong_FromUnsignedLongLong(g.greenlet_id);
        if (!key) {
            goto done;
        }
        PyObject *known = NULL;
        PyObject *pair = PyDict_GetItemRef(reg_names, key, &known) >= 0
                             ? row_names(&g, known) : NULL;
        int rc = pair ? 0 : -1;
        if (pair && pair != Py_None) {
            rc = PyDict_SetItem(names, key, pair);
        }
        Py_DECREF(key);
        Py_XDECREF(known);
        Py_XDECREF(pair);
        if (rc < 0) {
            goto done;
        }
    }
    /* (the getters stopped early: keep what was read) */
    if (nspans < gqp_profile_span_count(p)) {
        PyObject *cut = PyBytes_FromStringAndSize(
            (const char *)sp, (Py_ssize_t)(nspans * sizeof(gqp_span)));
        Py_SETREF(spans, cut);
        if (!spans) {
            goto done;
        }
        sp = (gqp_span *)(void *)PyBytes_AS_STRING(spans);
    }
    if (ngreenlets < n) {
        PyObject *cut = PyBytes_FromStringAndSize(
            (const char *)rows,
            (Py_ssize_t)(ngreenlets * sizeof(gqp_py_greenlet_row)));
        Py_SETREF(greenlets, cut);
        if (!greenlets) {
            goto done;
        }
        rows = (gqp_py_greenlet_row *)(void *)PyBytes_AS_STRING(greenlets);
    }
    /* spans of greenlets without a row (the profile's table was full) */
    for (size_t i = 0; i < nspans; i++) {
        uint64_t gid = sp[i].greenlet_id;
        if ((i > 0 && gid == sp[i - 1].greenlet_id) ||
            has_row(rows, ngreenlets, gid)) {
            continue;
        }
        if (name_from_registry(names, gid) < 0) {
            goto done;
        }
    }

    gqp_span lg;
    if (gqp_profile_longest_span(p, &lg) == GQP_OK) {
        it[2] = PyBytes_FromStringAndSize((const char *)&lg, sizeof lg);
        if (!it[2] || name_from_registry(names, lg.greenlet_id) < 0) {
            goto done;
        }
    } else {
        it[2] = Py_NewRef(Py_None);
    }

    /* waiting: from the tracer's history, which moves on */
    int64_t total = 0;
    int complete = 1;
    uint64_t ids[GQP_PY_WAITED_TOP];
    int64_t ns[GQP_PY_WAITED_TOP];
    int got = 0;
    if (t) {
        got = gqp_tracer_waited(t, p, start_ns, end_ns, &total, ids, ns,
                                (size_t)top, &complete);
        if (got < 0) {
            PyErr_Format(PyExc_RuntimeError, "gqp_tracer_waited: %s",
                         gqp_strerror(got));
            goto done;
        }
    }
    it[5] = PyTuple_New(got);
    if (!it[5]) {
        goto done;
    }
    for (int i = 0; i < got; i++) {
        PyObject *key = PyLong_FromUnsignedLongLong(ids[i]);
        /* (held: the tuples below may collect garbage, whose finalizers
         * may change the registry) */
        PyObject *known = NULL;
        if (!key || PyDict_GetItemRef(reg_names, key, &known) < 0) {
            Py_XDECREF(key);
            goto done;
        }
        PyObject *row = PyTuple_New(3);
        PyObject *w = PyLong_FromLongLong(ns[i]);
        if (!row || !w) {
            Py_DECREF(key);
            Py_XDECREF(known);
            Py_XDECREF(row);
            Py_XDECREF(w);
            goto done;
        }
        PyTuple_SET_ITEM(row, 0, key);
        PyTuple_SET_ITEM(row, 1, w);
        PyTuple_SET_ITEM(row, 2, known ? known : Py_NewRef(Py_None));
        PyTuple_SET_ITEM(it[5], i, row);
    }

    it[0] = spans;
    it[1] = greenlets;
    it[11] = names;
    it[12] = stacks ? stacks : Py_NewRef(Py_None);
    spans = greenlets = names = stacks = NULL;
    it[3] = PyLong_FromLongLong(end_ns);
    it[4] = PyLong_FromLongLong((long long)total);
    it[6] = PyBool_FromLong(complete);
    it[7] = PyLong_FromUnsignedLongLong(gqp_profile_spans_dropped(p));
    it[8] = PyLong_FromUnsignedLongLong(gqp_profile_calls_dropped(p));
    it[9] = PyLong_FromLongLong((long long)gqp_profile_epoch_origin(p));
    it[10] = PyLong_FromLongLong((long long)gqp_profile_wall_origin(p));
    it[13] = read_waits(p, take);
    for (int i = 0; i < GQP_PY_PROFILE_ITEMS; i++) {
        if (!it[i]) {
            goto done;
        }
    }
    res = PyTuple_New(GQP_PY_PROFILE_ITEMS);
    if (res) {
        for (int i = 0; i < GQP_PY_PROFILE_ITEMS; i++) {
            PyTuple_SET_ITEM(res, i, it[i]); /* (steals) */
            it[i] = NULL;
        }
    }
done:
    for (int i = 0; i < GQP_PY_PROFILE_ITEMS; i++) {
        Py_XDECREF(it[i]);
    }
    Py_XDECREF(spans);
    Py_XDECREF(greenlets);
    Py_XDECREF(names);
    Py_XDECREF(stacks);
    return res;
}


/* ---- fault injection (tests only) ------------------------------------ */
/* After `after` more successful allocations, the next `count` fail.  The
 * failing allocator frees with free(), so memory from before stays valid. */
static long gqp__fail_after = -1;
static long gqp__fail_count = 0;

static void *failing_malloc(void *ctx, size_t n)
{
    (void)ctx;
    if (gqp__fail_after == 0 && gqp__fail_count > 0) {
        gqp__fail_count--;
        return NULL;
    }
    if (gqp__fail_after > 0) {
        gqp__fail_after--;
    }
    return malloc(n);
}

static void *failing_realloc(void *ctx, void *p, size_t n)
{
    (void)ctx;
    if (gqp__fail_after == 0 && gqp__fail_count > 0) {
        gqp__fail_count--;
        return NULL;
    }
    if (gqp__fail_after > 0) {
        gqp__fail_after--;
    }
    return realloc(p, n);
}

static void plain_free(void *ctx, void *p)
{
    (void)ctx;
    free(p);
}

static int gqp_py_inject_alloc_failures(long after, long count)
{
    PyGILState_STATE gs = PyGILState_Ensure();
    int rc;
    if (count <= 0) {
        rc = gqp_set_allocator(NULL);
        gqp__fail_after = -1;
        gqp__fail_count = 0;
    } else {
        static const gqp_allocator failing = {failing_malloc, failing_realloc,
                                              plain_free, NULL};
        gqp__fail_after = after;
        gqp__fail_count = count;
        rc = gqp_set_allocator(&failing);
    }
    PyGILState_Release(gs);
    return rc;
}

static long gqp_py_alloc_failures_left(void)
{
    return gqp__fail_count;
}
