/* _hooks/codes.c -- per code object and per (code, instruction) caches (what
 * wait sites and stacks need of a frame), and register_code for calls=True.
 * A part of _hooks.c (one translation unit, see there). */
#include "hooks.h"

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

#define CODE_INSIDE 0x1  /* gevent, greenlet or greqprof: not a site */
#define CODE_OWN 0x2     /* greqprof: left out of stacks */

static PyObject *gevent_dir;     /* gevent's package dir (once imported) */

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
