/* _hooks/reader.c -- bulk readers and the one-call profile reader
 * (read_profile).
 * A part of _hooks.c (one translation unit, see there). */
#include "hooks.h"

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

/* Names for a greenlet of the waiting top that was never named (only
 * greenlets in profiles are, and the hub): by the function it runs, or
 * "<main>" for the thread's main greenlet; kept in the registry for the
 * next profile.  A new reference, or NULL (none known, or t is not the
 * calling thread's). */
static PyObject *name_waited_on(gqp_tracer *t, PyObject *key, uint64_t id)
{
    gqp_py_thread *st = gqp__tls;
    if (!st || st->tracer != t || !st->active) {
        return NULL;
    }
    PyObject *names = run_names_of_id(st, id);
    if (!names && parent_getter.get) {
        /* the root of the running greenlet's parents */
        PyObject *g = PyObject_CallNoArgs(greenlet_getcurrent);
        while (g && g != Py_None) {
            PyObject *parent = getter_call(&parent_getter, g);
            if (!parent || parent == Py_None) {
                Py_XDECREF(parent);
                break;
            }
            Py_SETREF(g, parent);
        }
        uint64_t rid = 0;
        if (g && g != Py_None &&
            gqp_tracer_greenlet_id(t, (uint64_t)(uintptr_t)g, &rid) == GQP_OK
            && rid == id) {
            PyObject *name = NULL, *fn = NULL;
            greenlet_names(g, &name, &fn);
            if (name && fn) {
                names = PyTuple_Pack(2, name, fn);
            }
            Py_XDECREF(name);
            Py_XDECREF(fn);
        }
        Py_XDECREF(g);
    }
    PyErr_Clear();
    if (names && PyDict_GET_SIZE(reg_names) < GQP_PY_MAX_NAMES &&
        PyDict_SetItem(reg_names, key, names) < 0) {
        PyErr_Clear();
    }
    return names;
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
        if (!known) {
            known = name_waited_on(t, key, ids[i]);
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
