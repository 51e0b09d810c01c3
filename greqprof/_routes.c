/* Per-route aggregates of every request (docs/fleet.md), counted in C.
 *
 * mw_call hands each request it owns (an environ not marked by an outer
 * middleware) to routes_call, which passes the app a start_response that
 * keeps the status, and takes the end of the request from the body: a
 * list or tuple ends when the app returns it, anything else when the
 * server closes it (or drops it).  The route is then named here (a
 * set_route name, the template a framework hook left in the environ, or
 * PATH_INFO through a bounded cache) or, for what C does not decide, by
 * the middleware's Python namer, and counted in a table of at most
 * max_routes routes plus "<other>".  A sampled request's route is also
 * left on its gqp_req, so its profile's CPU and waiting are added to the
 * route when it is delivered (middleware._route_sampled).
 *
 * Included by _core.c after _sampled.c (it uses gqp_body and gqp_req). */
#include <math.h>
#include <string.h>
#include <time.h>

#define RT_BUCKETS (8 * 34)      /* routes.WallHistogram's */
#define RT_NB (RT_BUCKETS + 2)
#define RT_CACHE_MAX 4096        /* PATH_INFO -> route entries ... */
#define RT_CACHE_PATH 256        /* ... of paths this long at most */

typedef struct {
    uint64_t requests, errors, status[6];   /* 1xx..5xx, other */
    double total, min, max;
    uint64_t hist[RT_NB];
} rt_cell;

typedef struct {
    PyObject_HEAD
    PyObject *table;      /* route (str) -> cell index (int) */
    PyObject *cache;      /* PATH_INFO -> its route name */
    PyObject *named;      /* set_route's: greenlet -> name */
    PyObject *namer;      /* environ -> route name (Python) */
    PyObject *getcurrent;
    PyObject *metrics_path, *metrics_app;   /* metrics_path, or NULL */
    PyObject *ticker;     /* called once a second by requests' ends, or
                             NULL (set_ticker) */
    int64_t tick_due;     /* CLOCK_MONOTONIC ns of the next call */
    rt_cell *cells;       /* cells[0] is "<other>" */
    Py_ssize_t ncells, cap, max_routes;
    uint64_t overflowed, namer_errors;
    int path_cache;       /* no route= callable: the path names the rest */
} gqp_rt;

typedef struct {
    PyObject_HEAD
    gqp_rt *rt;
    PyObject *environ, *start_response, *result, *it;
    PyObject *gref;       /* a weak reference to the greenlet it began in
                             (a strong one: a suspended greenlet held by
                             its own body would never be freed; its
                             address alone: a later greenlet may have it),
                             or NULL */
    int64_t t0;
    int status;
    char error, done;
    char sent;            /* a first non-empty chunk went to the server */
    char unsent_error;    /* the app failed before it: the server answers
                             500, whatever status it started */
    char slow;            /* served by Python (_call_slow), which may say
                             "not counted" (greqprof.no_route) */
} gqp_rtw;

static PyObject *str_rt_route_key, *str_rt_script, *str_rt_wzreq,
    *str_rt_other, *str_rt_sampled, *str_rt_skip, *str_rt_file_wrapper;
static PyTypeObject gqp_rtw_iter_type, gqp_rtw_seq_type;

static int64_t rt_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ---- the table ----------------------------------------------------------- */

static rt_cell *rt_cell_of(gqp_rt *rt, PyObject *route)
{
    PyObject *ix = PyDict_GetItemWithError(rt->table, route);
    if (ix) {
        return &rt->cells[PyLong_AsSsize_t(ix)];
    }
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (PyUnicode_GET_LENGTH(route) == PyUnicode_GET_LENGTH(str_rt_other) &&
        PyUnicode_Compare(route, str_rt_other) == 0) {
        return &rt->cells[0];   /* (a route the app named "<other>": one
                                 * row, never a key of the table) */
    }
    if (rt->ncells > rt->max_routes) {   /* (cells[0] is "<other>") */
        rt->overflowed++;
        return &rt->cells[0];
    }
    if (rt->ncells == rt->cap) {
        Py_ssize_t cap = rt->cap * 2;
        rt_cell *c = PyMem_Realloc(rt->cells, (size_t)cap * sizeof *c);
        if (!c) {
            PyErr_NoMemory();
            return NULL;
        }
        rt->cells = c;
        rt->cap = cap;
    }
    PyObject *n = PyLong_FromSsize_t(rt->ncells);
    if (!n || PyDict_SetItem(rt->table, route, n) < 0) {
        Py_XDECREF(n);
        return NULL;
    }
    Py_DECREF(n);
    rt_cell *c = &rt->cells[rt->ncells++];
    memset(c, 0, sizeof *c);
    c->min = INFINITY;
    return c;
}

/* 1 when route gets a row of its own: it has one, or the table has room
 * (0: it is counted under "<other>"). */
static int rt_admits(gqp_rt *rt, PyObject *route)
{
    if (rt->ncells <= rt->max_routes) {
        return 1;
    }
    int in = PyDict_Contains(rt->table, route);
    if (in < 0) {
        err_clear();
        return 1;
    }
    return in;
}

static void rt_record(gqp_rt *rt, PyObject *route, int status, int error,
                      double wall)
{
    rt_cell *c = rt_cell_of(rt, route);
    if (!c) {
        err_clear();
        return;
    }
    c->requests++;
    if (error && status == 0) {
        status = 500;   /* (what the server answers) */
    }
    if (error || status >= 500) {
        c->errors++;
    }
    c->status[status >= 100 && status < 600 ? status / 100 - 1 : 5]++;
    int i = 0;
    if (wall >= 1e-6) {
        i = (int)(log(wall / 1e-6) / log(2.0) * 8) + 1;
        if (i > RT_BUCKETS + 1) {
            i = RT_BUCKETS + 1;
        }
    }
    c->hist[i]++;
    c->total += wall;
    if (wall < c->min) {
        c->min = wall;
    }
    if (wall > c->max) {
        c->max = wall;
    }
}

/* routes.ID_SEGMENT in C: digits, a UUID, or 16+ hex digits with a digit
 * among them. */
static int rt_is_id(const char *p, Py_ssize_t n)
{
    Py_ssize_t digits = 0, hex = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        char c = p[i];
        if (c >= '0' && c <= '9') {
            digits++;
            hex++;
        } else if ((c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F')) {
            hex++;
        }
    }
    if (n > 0 && digits == n) {
        return 1;
    }
    if (n >= 16 && hex == n && digits > 0) {
        return 1;
    }
    if (n == 36 && hex == 32 && p[8] == '-' && p[13] == '-' &&
        p[18] == '-' && p[23] == '-') {
        return 1;
    }
    return 0;
}

#define RT_MAX_ROUTE 200         /* routes.MAX_ROUTE */

/* routes.path_route(path) in C for the common case, a short printable
 * ASCII path whose name needs no cut: a new reference, or NULL (no error
 * set) for Python to name.  (A path not in the cache, an id in it most
 * likely, costs no Python call then.) */
static PyObject *rt_path_route(PyObject *path)
{
    if (!PyUnicode_IS_ASCII(path)) {
        return NULL;
    }
    Py_ssize_t n = PyUnicode_GET_LENGTH(path);
    const char *s = (const char *)PyUnicode_1BYTE_DATA(path);
    if (n > RT_CACHE_PATH) {
        return NULL;
    }
    if (n == 0) {
        return PyUnicode_FromStringAndSize("/", 1);
    }
    char out[RT_MAX_ROUTE + 8];
    Py_ssize_t len = 0, start = 0;
    for (Py_ssize_t i = 0; i <= n; i++) {
        if (i < n && (s[i] < 0x20 || s[i] == 0x7f)) {
            return NULL;   /* (escaped by clean(): Python) */
        }
        if (i < n && s[i] != '/') {
            continue;
        }
        const char *seg = s + start;
        Py_ssize_t k = i - start;
        if (rt_is_id(seg, k)) {
            seg = "{id}";
            k = 4;
        }
        if (len + k + 1 > RT_MAX_ROUTE) {
            return NULL;   /* (cut with "...": Python) */
        }
        memcpy(out + len, seg, (size_t)k);
        len += k;
        if (i < n) {
            out[len++] = '/';
        }
        start = i + 1;
    }
    return PyUnicode_FromStringAndSize(out, len);
}

/* The greenlet whose set_route name is the request's (a new reference, or
 * NULL): the running one, unless the request began in another (gref, a
 * weak reference to it).  That one's name is the request's unless late
 * and it is alive: it may serve its next request by now, whose name it
 * would be.  Gone, it never named one (the named hold their greenlets). */
static PyObject *rt_named_key(gqp_rt *rt, PyObject *gref, int late)
{
    PyObject *owner = NULL;
    if (gref && PyWeakref_GetRef(gref, &owner) <= 0) {
        err_clear();
        return NULL;
    }
    PyObject *cur = PyObject_CallNoArgs(rt->getcurrent);
    if (!cur || !owner || cur == owner) {
        Py_XDECREF(owner);
        return cur;
    }
    Py_DECREF(cur);
    if (late && !is_dead(owner)) {
        Py_DECREF(owner);
        return NULL;
    }
    return owner;
}

/* The request's route (a new reference; NULL only with no error set when
 * nothing named it).  When the route= callable raised what is not an
 * Exception (an interrupt, a greenlet's kill), the request is named by
 * its path and *interrupt holds it, to be passed on. */
static PyObject *rt_name(gqp_rt *rt, PyObject *environ, PyObject *gref,
                         int late, PyObject **interrupt)
{
    PyObject *v;
    if (PyDict_GET_SIZE(rt->named) > 0) {
        PyObject *g = rt_named_key(rt, gref, late);
        v = g ? PyDict_GetItemWithError(rt->named, g) : NULL;
        if (v && PyUnicode_CheckExact(v)) {
            Py_INCREF(v);
            if (PyDict_DelItem(rt->named, g) < 0) {
                err_clear();
            }
            Py_DECREF(g);
            return v;
        }
        Py_XDECREF(g);
        err_clear();
    }
    if (!PyDict_CheckExact(environ)) {
        goto python;
    }
    PyObject *script = PyDict_GetItemWithError(environ, str_rt_script);
    int at_root = !script || (PyUnicode_Check(script) &&
                              PyUnicode_GET_LENGTH(script) == 0);
    v = PyDict_GetItemWithError(environ, str_rt_route_key);
    if (v && PyUnicode_CheckExact(v) && PyUnicode_GET_LENGTH(v) > 0 &&
        at_root) {
        return Py_NewRef(v);   /* (cleaned when read out) */
    }
    if (v || !at_root || !rt->path_cache ||
        PyDict_GetItemWithError(environ, str_rt_wzreq)) {
        goto python;
    }
    PyObject *path = PyDict_GetItemWithError(environ, str_path_key);
    if (!path || !PyUnicode_CheckExact(path)) {
        goto python;
    }
    v = PyDict_GetItemWithError(rt->cache, path);
    if (v) {
        return Py_NewRef(v);
    }
    Py_INCREF(path);
    err_clear();
    v = rt_path_route(path);
    if (!v) {
        err_clear();
        v = PyObject_CallOneArg(rt->namer, environ);
    }
    if (v && PyUnicode_CheckExact(v) &&
        PyUnicode_GET_LENGTH(path) <= RT_CACHE_PATH) {
        if (PyDict_GET_SIZE(rt->cache) >= RT_CACHE_MAX) {
            /* Full of paths seen once (/items/1, /items/2, ...): start
             * again, so the paths seen often come back in. */
            PyDict_Clear(rt->cache);
        }
        if (PyDict_SetItem(rt->cache, path, v) < 0) {
            err_clear();
        }
    }
    Py_DECREF(path);
    goto checked;
python:
    err_clear();
    v = PyObject_CallOneArg(rt->namer, environ);
checked:
    if (!v && PyErr_Occurred() &&
        !PyErr_ExceptionMatches(PyExc_Exception)) {
        *interrupt = PyErr_GetRaisedException();
        v = PyObject_CallFunctionObjArgs(rt->namer, environ, Py_True, NULL);
    }
    if (v && PyUnicode_Check(v) && !PyUnicode_CheckExact(v)) {
        /* (a str subclass could run Python while the table is updated) */
        Py_SETREF(v, PyUnicode_FromObject(v));
    }
    if (!v || !PyUnicode_Check(v)) {
        rt->namer_errors++;
        Py_XDECREF(v);
        err_clear();
        return NULL;
    }
    return v;
}

/* ---- RouteCounts: the table, read by Python ------------------------------ */

static PyObject *rt_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    Py_ssize_t max_routes;
    PyObject *namer, *named, *getcurrent;
    int path_cache;
    static char *kwlist[] = {"max_routes", "namer", "named", "getcurrent",
                             "path_cache", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "nOO!Op", kwlist, &max_routes,
                                     &namer, &PyDict_Type, &named,
                                     &getcurrent, &path_cache)) {
        return NULL;
    }
    if (max_routes < 1 || !PyCallable_Check(namer) ||
        !PyCallable_Check(getcurrent)) {
        PyErr_SetString(PyExc_ValueError, "RouteCounts: max_routes >= 1, "
                        "namer and getcurrent callables");
        return NULL;
    }
    gqp_rt *rt = (gqp_rt *)type->tp_alloc(type, 0);
    if (!rt) {
        return NULL;
    }
    rt->cap = 8;
    rt->cells = PyMem_Calloc((size_t)rt->cap, sizeof(rt_cell));
    rt->table = PyDict_New();
    rt->cache = PyDict_New();
    if (!rt->cells || !rt->table || !rt->cache) {
        Py_DECREF(rt);
        return PyErr_NoMemory();
    }
    rt->cells[0].min = INFINITY;
    rt->ncells = 1;
    rt->max_routes = max_routes;
    rt->namer = Py_NewRef(namer);
    rt->named = Py_NewRef(named);
    rt->getcurrent = Py_NewRef(getcurrent);
    rt->path_cache = path_cache;
    return (PyObject *)rt;
}

static int rt_traverse(gqp_rt *rt, visitproc visit, void *arg)
{
    Py_VISIT(rt->table);
    Py_VISIT(rt->cache);
    Py_VISIT(rt->named);
    Py_VISIT(rt->namer);
    Py_VISIT(rt->getcurrent);
    Py_VISIT(rt->metrics_path);
    Py_VISIT(rt->metrics_app);
    Py_VISIT(rt->ticker);
    return 0;
}

static int rt_clear(gqp_rt *rt)
{
    Py_CLEAR(rt->table);
    Py_CLEAR(rt->cache);
    Py_CLEAR(rt->named);
    Py_CLEAR(rt->namer);
    Py_CLEAR(rt->getcurrent);
    Py_CLEAR(rt->metrics_path);
    Py_CLEAR(rt->metrics_app);
    Py_CLEAR(rt->ticker);
    return 0;
}

static void rt_dealloc(gqp_rt *rt)
{
    PyObject_GC_UnTrack(rt);
    rt_clear(rt);
    PyMem_Free(rt->cells);
    Py_TYPE(rt)->tp_free((PyObject *)rt);
}

static PyObject *rt_cell_tuple(PyObject *route, rt_cell *c)
{
    PyObject *hist = PyBytes_FromStringAndSize((const char *)c->hist,
                                               sizeof c->hist);
    if (!hist) {
        return NULL;
    }
    return Py_BuildValue("(OKK(KKKKKK)Nddd)", route, c->requests, c->errors,
                         c->status[0], c->status[1], c->status[2],
                         c->status[3], c->status[4], c->status[5], hist,
                         c->total, c->requests ? c->min : 0.0,
                         c->max);
}

/* 1 when `known` (a dict, or NULL) says the route had c's requests. */
static int rt_unchanged(PyObject *known, PyObject *key, const rt_cell *c)
{
    if (!known) {
        return 0;
    }
    PyObject *n = PyDict_GetItemWithError(known, key);
    if (!n || !PyLong_CheckExact(n)) {
        err_clear();
        return 0;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(n);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        err_clear();
        return 0;
    }
    return v == c->requests;
}

/* snapshot([known]) -> [(route, requests, errors, (1xx..5xx, other),
 * histogram bytes (uint64 counts), total, min, max)], "<other>" included
 * when it counted anything; with `known` (route -> requests), only the
 * rows that counted requests since (a once-a-second reader skips a large
 * table's idle routes without building their rows). */
static PyObject *rt_snapshot(gqp_rt *rt, PyObject *args)
{
    PyObject *known = NULL;
    if (!PyArg_ParseTuple(args, "|O!:snapshot", &PyDict_Type, &known)) {
        return NULL;
    }
    PyObject *out = PyList_New(0), *key, *ix;
    Py_ssize_t pos = 0;
    while (out && PyDict_Next(rt->table, &pos, &key, &ix)) {
        rt_cell *c = &rt->cells[PyLong_AsSsize_t(ix)];
        if (rt_unchanged(known, key, c)) {
            continue;
        }
        PyObject *t = rt_cell_tuple(key, c);
        if (!t || PyList_Append(out, t) < 0) {
            Py_CLEAR(out);
        }
        Py_XDECREF(t);
    }
    if (out && rt->cells[0].requests &&
        !rt_unchanged(known, str_rt_other, &rt->cells[0])) {
        PyObject *t = rt_cell_tuple(str_rt_other, &rt->cells[0]);
        if (!t || PyList_Append(out, t) < 0) {
            Py_CLEAR(out);
        }
        Py_XDECREF(t);
    }
    return out;
}

/* record(route, status, error, wall): counts one request (Python's
 * requests that do not pass through the C path). */
static PyObject *rt_record_py(gqp_rt *rt, PyObject *args)
{
    PyObject *route;
    int status, error;
    double wall;
    if (!PyArg_ParseTuple(args, "Uipd", &route, &status, &error, &wall)) {
        return NULL;
    }
    if (!PyUnicode_CheckExact(route)) {
        PyErr_SetString(PyExc_TypeError, "record: route must be a str");
        return NULL;
    }
    rt_record(rt, route, status, error, wall);
    Py_RETURN_NONE;
}

/* set_metrics(path, app): requests whose PATH_INFO is path go to app,
 * not counted (the metrics page, greqprof/metrics.py). */
static PyObject *rt_set_metrics(gqp_rt *rt, PyObject *args)
{
    PyObject *path, *app;
    if (!PyArg_ParseTuple(args, "UO", &path, &app)) {
        return NULL;
    }
    if (!PyCallable_Check(app)) {
        PyErr_SetString(PyExc_TypeError, "set_metrics: app is not callable");
        return NULL;
    }
    Py_XSETREF(rt->metrics_path, Py_NewRef(path));
    Py_XSETREF(rt->metrics_app, Py_NewRef(app));
    Py_RETURN_NONE;
}

/* set_ticker(fn or None): fn() is called by the end of a request at
 * most once a second (the routes summary and the metrics sync of a
 * middleware that has no drain loop: no hooks, nothing sampled). */
static PyObject *rt_set_ticker(gqp_rt *rt, PyObject *fn)
{
    if (fn != Py_None && !PyCallable_Check(fn)) {
        PyErr_SetString(PyExc_TypeError, "set_ticker: fn is not callable");
        return NULL;
    }
    Py_XSETREF(rt->ticker, fn == Py_None ? NULL : Py_NewRef(fn));
    rt->tick_due = rt_now();   /* (the first request's end calls it) */
    Py_RETURN_NONE;
}

static PyObject *rt_admits_py(gqp_rt *rt, PyObject *route)
{
    if (!PyUnicode_Check(route)) {
        PyErr_SetString(PyExc_TypeError, "admits: route must be a str");
        return NULL;
    }
    return PyBool_FromLong(rt_admits(rt, route));
}

static PyObject *rt_get_overflowed(gqp_rt *rt, void *c)
{
    (void)c;
    return PyLong_FromUnsignedLongLong(rt->overflowed);
}

static PyObject *rt_get_errors(gqp_rt *rt, void *c)
{
    (void)c;
    return PyLong_FromUnsignedLongLong(rt->namer_errors);
}

/* (summed when read, once a summary period: nothing per request) */
static PyObject *rt_get_requests(gqp_rt *rt, void *c)
{
    (void)c;
    uint64_t n = 0;
    for (Py_ssize_t i = 0; i < rt->ncells; i++) {
        n += rt->cells[i].requests;
    }
    return PyLong_FromUnsignedLongLong(n);
}

static PyMethodDef rt_methods[] = {
    {"snapshot", (PyCFunction)rt_snapshot, METH_VARARGS,
     "snapshot([known]) -> [(route, requests, errors, status classes, "
     "histogram, total, min, max)]; with known (route -> requests), only "
     "the routes that counted requests since."},
    {"admits", (PyCFunction)rt_admits_py, METH_O,
     "admits(route): False when route's requests go to <other> (the table "
     "is full without it)."},
    {"set_metrics", (PyCFunction)rt_set_metrics, METH_VARARGS,
     "set_metrics(path, app): serves that path with app, uncounted."},
    {"set_ticker", (PyCFunction)rt_set_ticker, METH_O,
     "set_ticker(fn): fn() at most once a second, at a request's end."},
    {"record", (PyCFunction)rt_record_py, METH_VARARGS,
     "record(route, status, error, wall): counts one request."},
    {NULL, NULL, 0, NULL},
};

static PyObject *rt_get_cached(gqp_rt *rt, void *c)
{
    (void)c;
    return PyLong_FromSsize_t(rt->cache ? PyDict_GET_SIZE(rt->cache) : 0);
}

static PyGetSetDef rt_getset[] = {
    {"cached_paths", (getter)rt_get_cached, NULL,
     "Paths whose route name is cached (at most 4096).", NULL},
    {"requests", (getter)rt_get_requests, NULL,
     "Requests counted, all routes and <other>.", NULL},
    {"overflowed", (getter)rt_get_overflowed, NULL,
     "Requests counted under <other>: the table was full.", NULL},
    {"namer_errors", (getter)rt_get_errors, NULL,
     "Requests no route name could be found for (not counted).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject gqp_rt_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "greqprof._core.RouteCounts",
    .tp_basicsize = sizeof(gqp_rt),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Requests, errors, status classes and wall-time histogram "
              "per route, counted in C.",
    .tp_new = rt_new,
    .tp_dealloc = (destructor)rt_dealloc,
    .tp_traverse = (traverseproc)rt_traverse,
    .tp_clear = (inquiry)rt_clear,
    .tp_methods = rt_methods,
    .tp_getset = rt_getset,
};

/* The path route of a request to an app mounted under a SCRIPT_NAME
 * (SCRIPT_NAME + PATH_INFO, ids as {id}, through the cache), else NULL:
 * what routes() counts it under unless the app names it, for the stack
 * sampler and the blocking events meanwhile, which only see PATH_INFO.
 * Not an error (a non-ASCII path: the Python namer's, left to the end). */
static PyObject *rt_mounted_route(PyObject *routes, PyObject *environ)
{
    gqp_rt *rt = (gqp_rt *)routes;
    if (!rt || !PyDict_CheckExact(environ)) {
        return NULL;
    }
    PyObject *script = PyDict_GetItemWithError(environ, str_rt_script);
    if (!script || !PyUnicode_CheckExact(script) ||
        PyUnicode_GET_LENGTH(script) == 0) {
        err_clear();
        return NULL;
    }
    PyObject *path = PyDict_GetItemWithError(environ, str_path_key);
    PyObject *full = path && PyUnicode_CheckExact(path)
                         ? PyUnicode_Concat(script, path)
                         : Py_NewRef(script);
    PyObject *v = full ? PyDict_GetItemWithError(rt->cache, full) : NULL;
    if (v) {
        Py_INCREF(v);
    } else if (full && !PyErr_Occurred()) {
        v = rt_path_route(full);
        if (v && PyUnicode_GET_LENGTH(full) <= RT_CACHE_PATH) {
            if (PyDict_GET_SIZE(rt->cache) >= RT_CACHE_MAX) {
                PyDict_Clear(rt->cache);
            }
            if (PyDict_SetItem(rt->cache, full, v) < 0) {
                err_clear();
            }
        }
    }
    Py_XDECREF(full);
    err_clear();
    return v;
}

/* ---- the request's wrapper ------------------------------------------------ */

/* Names and counts the request (once), the app's error kept as it is.
 * close: also close the app's body first; late: from its finalizer. */
static int rtw_finish(gqp_rtw *w, int close, int late)
{
    if (w->done) {
        return 0;
    }
    w->done = 1;
    PyObject *exc = PyErr_GetRaisedException();
    PyObject *route = NULL, *interrupt = NULL;
    int skip = w->slow && w->environ && PyDict_Check(w->environ) &&
               PyDict_GetItemWithError(w->environ, str_rt_skip);
    err_clear();
    if (!skip && w->rt && w->environ) {
        route = rt_name(w->rt, w->environ, w->gref, late, &interrupt);
    }
    PyObject *res = w->result;
    if (route && res && (Py_IS_TYPE(res, &gqp_seqbody_type) ||
                         Py_IS_TYPE(res, &gqp_iterbody_type)) &&
        ((gqp_body *)res)->req) {
        /* A sampled request: its profile is counted by its route too. */
        gqp_req *req = ((gqp_body *)res)->req;
        /* (a route past max_routes: its profile is counted where the
         * request is, under "<other>") */
        Py_XSETREF(req->route, Py_NewRef(rt_admits(w->rt, route)
                                         ? route : str_rt_other));
    }
    int failed = 0;
    if (close && res && !PyList_CheckExact(res) && !PyTuple_CheckExact(res)) {
        PyObject *fn = PyObject_GetAttr(res, str_close);
        if (!fn && PyErr_ExceptionMatches(PyExc_AttributeError)) {
            err_clear();
        } else if (!fn) {
            failed = 1;
        } else {
            PyObject *r = PyObject_CallNoArgs(fn);
            Py_DECREF(fn);
            failed = r == NULL;
            Py_XDECREF(r);
        }
        if (failed) {
            w->error = 1;
            PyObject *e = PyErr_GetRaisedException();
            if (!exc) {
                exc = e;
            } else {
                Py_XDECREF(e);
            }
        }
    }
    if (route) {
        int64_t now = rt_now();
        rt_record(w->rt, route, w->unsent_error ? 0 : w->status, w->error,
                  (double)(now - w->t0) / 1e9);
        Py_DECREF(route);
        /* (not from a finalizer: the collector may be running) */
        if (w->rt->ticker && now >= w->rt->tick_due && !late) {
            w->rt->tick_due = now + 1000000000;
            PyObject *fn = Py_NewRef(w->rt->ticker);
            PyObject *r = PyObject_CallNoArgs(fn);
            Py_DECREF(fn);
            Py_XDECREF(r);
            /* (its Exceptions are its own; a kill of this greenlet while
             * a log handler waited goes on, after the app's own error) */
            PyObject *e = r ? NULL : PyErr_GetRaisedException();
            if (e && !exc &&
                !PyErr_GivenExceptionMatches(e, PyExc_Exception)) {
                exc = e;
            } else {
                Py_XDECREF(e);
            }
        }
    }
    Py_CLEAR(w->environ);
    Py_CLEAR(w->start_response);
    if (interrupt) {
        /* (the app's own error, if any, goes first) */
        if (exc) {
            Py_DECREF(interrupt);
        } else {
            exc = interrupt;
        }
    }
    PyErr_SetRaisedException(exc);
    return failed || exc ? -1 : 0;
}

/* start_response(status, headers[, exc_info]): the status is kept. */
static PyObject *rtw_start_response(gqp_rtw *w, PyObject *args, PyObject *kw)
{
    if (PyTuple_Check(args) && PyTuple_GET_SIZE(args) >= 1) {
        PyObject *s = PyTuple_GET_ITEM(args, 0);
        if (PyUnicode_Check(s) && PyUnicode_GET_LENGTH(s) >= 3) {
            int code = 0;
            for (int i = 0; i < 3; i++) {
                Py_UCS4 ch = PyUnicode_READ_CHAR(s, i);
                code = ch >= '0' && ch <= '9' ? code * 10 + (int)(ch - '0')
                                              : -1000;
            }
            w->status = code > 0 ? code : 0;
        }
    }
    if (!w->start_response) {
        PyErr_SetString(PyExc_RuntimeError,
                        "start_response called after the response ended");
        return NULL;
    }
    return PyObject_Call(w->start_response, args, kw);
}

static PyObject *rtw_close(gqp_rtw *w, PyObject *unused)
{
    (void)unused;
    if (rtw_finish(w, 1, 0) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *rtw_iternext(gqp_rtw *w)
{
    if (!w->it) {
        PyErr_SetString(PyExc_TypeError, "not an iterator");
        return NULL;
    }
    PyObject *item = PyIter_Next(w->it);
    if (!item && PyErr_Occurred()) {
        w->error = 1;
        w->unsent_error |= !w->sent;
    } else if (item && !w->sent && PyBytes_Check(item) &&
               PyBytes_GET_SIZE(item) > 0) {
        w->sent = 1;   /* (pywsgi sends the headers with it) */
    }
    return item;
}

static PyObject *rtw_iter_self(PyObject *self)
{
    return Py_NewRef(self);
}

static PyObject *rtw_seq_iter(gqp_rtw *w)
{
    return PyObject_GetIter(w->result);
}

static Py_ssize_t rtw_seq_len(gqp_rtw *w)
{
    return PyObject_Size(w->result);
}

static void rtw_finalize(gqp_rtw *w)
{
    /* Dropped without close(): counted now (the app's body closes
     * itself, if it does, when it is freed). */
    PyObject *exc = PyErr_GetRaisedException();
    if (rtw_finish(w, 0, 1) < 0) {
        err_clear();
    }
    PyErr_SetRaisedException(exc);
}

static int rtw_traverse(gqp_rtw *w, visitproc visit, void *arg)
{
    Py_VISIT(w->rt);
    Py_VISIT(w->environ);
    Py_VISIT(w->start_response);
    Py_VISIT(w->result);
    Py_VISIT(w->it);
    /* (not gref: a weak reference the collector finds unreachable is
     * cleared before finalizers run, and rtw_finalize reads it; it holds
     * nothing, so it closes no cycle) */
    return 0;
}

static int rtw_clear(gqp_rtw *w)
{
    Py_CLEAR(w->rt);
    Py_CLEAR(w->environ);
    Py_CLEAR(w->start_response);
    Py_CLEAR(w->result);
    Py_CLEAR(w->it);
    Py_CLEAR(w->gref);
    return 0;
}

static void rtw_dealloc(gqp_rtw *w)
{
    if (PyObject_CallFinalizerFromDealloc((PyObject *)w) < 0) {
        return;   /* resurrected */
    }
    PyObject_GC_UnTrack(w);
    rtw_clear(w);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static PyMethodDef rtw_methods[] = {
    {"close", (PyCFunction)rtw_close, METH_NOARGS,
     "Closes the app's body and counts the request by its route."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods rtw_as_sequence = {
    .sq_length = (lenfunc)rtw_seq_len,
};

static PyTypeObject gqp_rtw_iter_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "greqprof._core.RouteIterator",
    .tp_basicsize = sizeof(gqp_rtw),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "start_response, then the app's body passed through; close() "
              "counts the request by its route.",
    .tp_call = (ternaryfunc)rtw_start_response,
    .tp_dealloc = (destructor)rtw_dealloc,
    .tp_traverse = (traverseproc)rtw_traverse,
    .tp_clear = (inquiry)rtw_clear,
    .tp_iter = rtw_iter_self,
    .tp_iternext = (iternextfunc)rtw_iternext,
    .tp_methods = rtw_methods,
    .tp_finalize = (destructor)rtw_finalize,
};

/* A sized body (a sampled request's ClosingSequence): sized like it. */
static PyTypeObject gqp_rtw_seq_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "greqprof._core.RouteSequence",
    .tp_basicsize = sizeof(gqp_rtw),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The app's sized body; close() counts the request by its "
              "route.",
    .tp_call = (ternaryfunc)rtw_start_response,
    .tp_dealloc = (destructor)rtw_dealloc,
    .tp_traverse = (traverseproc)rtw_traverse,
    .tp_clear = (inquiry)rtw_clear,
    .tp_iter = (getiterfunc)rtw_seq_iter,
    .tp_as_sequence = &rtw_as_sequence,
    .tp_methods = rtw_methods,
    .tp_finalize = (destructor)rtw_finalize,
};

/* Serves a request (mw_serve) counted by its route: see the top. */
static PyObject *routes_call(gqp_mw *mw, PyObject *environ,
                             PyObject *start_response)
{
    gqp_rt *rt = (gqp_rt *)mw->routes;
    if (rt->metrics_app) {
        PyObject *p = PyDict_GetItemWithError(environ, str_path_key);
        if (p && PyUnicode_Check(p) &&
            PyUnicode_Compare(p, rt->metrics_path) == 0) {
            PyObject *app = Py_NewRef(rt->metrics_app);
            PyObject *r = call2(app, environ, start_response);
            Py_DECREF(app);
            return r;
        }
        err_clear();
    }
    PyObject *g = PyObject_CallNoArgs(rt->getcurrent);
    if (!g) {
        err_clear();   /* (then set_route's name is the running greenlet's) */
    } else if (PyDict_GET_SIZE(rt->named) > 0 &&
               PyDict_DelItem(rt->named, g) < 0) {
        /* (a name set_route gave this greenlet before its request began,
         * outside any request, does not name it) */
        err_clear();
    }
    gqp_rtw *w = PyObject_GC_New(gqp_rtw, &gqp_rtw_iter_type);
    if (!w) {
        Py_XDECREF(g);
        return NULL;
    }
    /* (CPython shares a live weak reference without a callback: one
     * small allocation a request at most) */
    w->gref = g ? PyWeakref_NewRef(g, NULL) : NULL;
    if (g && !w->gref) {
        err_clear();   /* (then set_route's name is the running greenlet's) */
    }
    Py_XDECREF(g);
    w->rt = (gqp_rt *)Py_NewRef(mw->routes);
    w->environ = Py_NewRef(environ);
    w->start_response = Py_NewRef(start_response);
    w->result = w->it = NULL;
    w->status = 0;
    w->error = w->done = w->slow = w->sent = w->unsent_error = 0;
    w->t0 = rt_now();
    PyObject_GC_Track(w);
    PyObject *result = mw_serve(mw, environ, (PyObject *)w);
    if (!result) {
        w->error = w->unsent_error = 1;
        rtw_finish(w, 0, 0);
        Py_DECREF(w);
        return NULL;
    }
    PyObject *fw = PyList_CheckExact(result) || PyTuple_CheckExact(result)
        ? NULL : PyDict_GetItemWithError(environ, str_rt_file_wrapper);
    err_clear();
    if ((!fw && (PyList_CheckExact(result) || PyTuple_CheckExact(result)))
        || (fw && PyType_Check(fw) &&
            PyObject_TypeCheck(result, (PyTypeObject *)fw))) {
        /* A list or tuple: its end, nothing more runs app code.  The
         * server's wsgi.file_wrapper goes back as it is (gunicorn sends
         * it with sendfile): counted now, without the sending.  (Fails
         * only with the route= callable's interrupt, passed on.) */
        int rc = rtw_finish(w, 0, 0);
        Py_DECREF(w);
        if (rc < 0) {
            Py_DECREF(result);
            return NULL;
        }
        return result;
    }
    w->result = result;
    if (Py_IS_TYPE(result, &gqp_seqbody_type) || body_is_sized(result)) {
        /* (sized: body_is_sized) */
        Py_SET_TYPE(w, &gqp_rtw_seq_type);   /* (same layout, static types) */
    } else if (!(w->it = PyObject_GetIter(result))) {
        w->error = w->unsent_error = 1;
        rtw_finish(w, 1, 0);   /* (the app's close() still runs) */
        Py_DECREF(w);
        return NULL;
    }
    return (PyObject *)w;
}

/* mw_serve hands the request to Python: if start_response is a route
 * wrapper, its end looks for greqprof.no_route (the inspector's
 * requests are not counted). */
static void routes_slow(PyObject *start_response)
{
    if (Py_IS_TYPE(start_response, &gqp_rtw_iter_type) ||
        Py_IS_TYPE(start_response, &gqp_rtw_seq_type)) {
        ((gqp_rtw *)start_response)->slow = 1;
    }
}

/* _routes_setup(counts): counts every request it owns in that
 * RouteCounts (None: off). */
static PyObject *mw_routes_setup(gqp_mw *self, PyObject *arg)
{
    if (arg != Py_None && !Py_IS_TYPE(arg, &gqp_rt_type)) {
        PyErr_SetString(PyExc_TypeError, "_routes_setup takes a RouteCounts "
                        "or None");
        return NULL;
    }
    Py_XSETREF(self->routes, arg == Py_None ? NULL : Py_NewRef(arg));
    Py_RETURN_NONE;
}

/* A delivered sampled profile of a named route: middleware._route_sampled
 * adds its CPU, waiting and blocking to the route.  Never raises. */
static void routes_sampled(gqp_mw *mw, gqp_req *req, PyObject *profile)
{
    if (!req->route) {
        return;
    }
    PyObject *r = PyObject_CallMethodObjArgs((PyObject *)mw, str_rt_sampled,
                                             req->route, profile, NULL);
    Py_XDECREF(r);
    err_clear();
}

static int gqp_py_routes_init(PyObject *reg)
{
    struct { PyObject **s; const char *v; } strs[] = {
        {&str_rt_route_key, "greqprof.route"}, {&str_rt_script, "SCRIPT_NAME"},
        {&str_rt_wzreq, "werkzeug.request"}, {&str_rt_other, "<other>"},
        {&str_rt_sampled, "_route_sampled"},
        {&str_rt_skip, "greqprof.no_route"},
        {&str_rt_file_wrapper, "wsgi.file_wrapper"},
    };
    for (size_t i = 0; i < sizeof strs / sizeof strs[0]; i++) {
        if (!*strs[i].s &&
            !(*strs[i].s = PyUnicode_InternFromString(strs[i].v))) {
            return -1;
        }
    }
    if (PyType_Ready(&gqp_rtw_iter_type) < 0 ||
        PyType_Ready(&gqp_rtw_seq_type) < 0 ||
        PyType_Ready(&gqp_rt_type) < 0 ||
        PyObject_SetAttrString(reg, "RouteCounts",
                               (PyObject *)&gqp_rt_type) < 0) {
        return -1;
    }
    return 0;
}
