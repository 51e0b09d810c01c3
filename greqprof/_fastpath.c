/* _fastpath.c -- ProfilingMiddleware's per-request path for the common
 * case, in C.  #included into greqprof._core after _hooks.c (it uses the
 * hooks' thread state).
 *
 * Most requests are not sampled.  For them the middleware only has to draw
 * the sampling number, count the request and note its method and path so a
 * blocking report can name it: that runs here, in the type's tp_call, with
 * no Python frame of greqprof's under the app (gevent.spawn walks the line
 * table of every frame of the spawning stack).  Everything else (a sampled
 * request, the trigger header, the inspector, observers, a thread whose
 * engine is not set up yet) goes to the Python methods `_call_slow`
 * (decides everything itself) or `_call_drawn` (the draw said: sample).
 *
 * Notes: a ring of the last GQP_NOTES_KEPT unsampled requests of one
 * thread: (greenlet id, start ns, method, path, request id).  It holds
 * only str objects (nothing for the garbage collector), truncated to the
 * lengths the Python side keeps. */

#define GQP_NOTES_KEPT 4096
#define GQP_NOTE_MAX_METHOD 32
#define GQP_NOTE_MAX_PATH 2048
#define GQP_NOTE_MAX_RID 200

typedef struct {
    uint64_t gid;
    int64_t start_ns;
    PyObject *method, *path, *rid;   /* str or NULL */
} gqp_note;

typedef struct {
    PyObject_HEAD
    gqp_note *ring;                  /* GQP_NOTES_KEPT entries, lazily */
    size_t next;
} gqp_notes;

static void notes_clear_entry(gqp_note *n)
{
    Py_CLEAR(n->method);
    Py_CLEAR(n->path);
    Py_CLEAR(n->rid);
}

static void notes_dealloc(gqp_notes *self)
{
    if (self->ring) {
        for (size_t i = 0; i < GQP_NOTES_KEPT; i++) {
            notes_clear_entry(&self->ring[i]);
        }
        PyMem_Free(self->ring);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* v if it is a str (cut to max characters), else NULL; a new reference. */
static PyObject *note_str(PyObject *v, Py_ssize_t max)
{
    if (!v || !PyUnicode_CheckExact(v)) {
        return NULL;
    }
    if (PyUnicode_GET_LENGTH(v) > max) {
        PyObject *cut = PyUnicode_Substring(v, 0, max);
        PyErr_Clear();
        return cut;
    }
    Py_INCREF(v);
    return v;
}

/* 0, or -1 with no exception set when there is no memory for the ring
 * (the request then just goes unnamed in a blocking report). */
static int notes_add(gqp_notes *self, uint64_t gid, int64_t start_ns,
                     PyObject *method, PyObject *path, PyObject *rid)
{
    if (!self->ring) {
        self->ring = PyMem_Calloc(GQP_NOTES_KEPT, sizeof *self->ring);
        if (!self->ring) {
            return -1;
        }
    }
    gqp_note *n = &self->ring[self->next];
    self->next = (self->next + 1) % GQP_NOTES_KEPT;
    notes_clear_entry(n);
    n->gid = gid;
    n->start_ns = start_ns;
    n->method = note_str(method, GQP_NOTE_MAX_METHOD);
    n->path = note_str(path, GQP_NOTE_MAX_PATH);
    n->rid = note_str(rid, GQP_NOTE_MAX_RID);
    return 0;
}

static PyObject *or_none(PyObject *v)
{
    return v ? v : Py_None;   /* borrowed */
}

/* notes.add(greenlet_id, method, path, request_id): notes a request that
 * begins now (strings; anything else is kept as None). */
static PyObject *notes_add_py(gqp_notes *self, PyObject *const *args,
                              Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "add takes 4 arguments");
        return NULL;
    }
    uint64_t gid = PyLong_AsUnsignedLongLong(args[0]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    notes_add(self, gid, gqp_clock_wall_ns(), args[1], args[2], args[3]);
    Py_RETURN_NONE;
}

/* notes.find(greenlet_id, end_ns): (method, path, request_id) of the
 * latest request of that greenlet that began by end_ns, or None. */
static PyObject *notes_find_py(gqp_notes *self, PyObject *const *args,
                               Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "find takes 2 arguments");
        return NULL;
    }
    uint64_t gid = PyLong_AsUnsignedLongLong(args[0]);
    long long end_ns = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (!self->ring || !gid) {
        Py_RETURN_NONE;
    }
    for (size_t k = 1; k <= GQP_NOTES_KEPT; k++) {
        gqp_note *n = &self->ring[(self->next + GQP_NOTES_KEPT - k)
                                  % GQP_NOTES_KEPT];
        if (n->gid == gid && n->start_ns <= end_ns) {
            return PyTuple_Pack(3, or_none(n->method), or_none(n->path),
                                or_none(n->rid));
        }
    }
    Py_RETURN_NONE;
}

static PyMethodDef notes_methods[] = {
    {"add", (PyCFunction)(void (*)(void))notes_add_py, METH_FASTCALL,
     "add(greenlet_id, method, path, request_id): notes a request."},
    {"find", (PyCFunction)(void (*)(void))notes_find_py, METH_FASTCALL,
     "find(greenlet_id, end_ns): (method, path, request_id) or None."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject gqp_notes_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "greqprof._core.RequestNotes",
    .tp_basicsize = sizeof(gqp_notes),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The last unsampled requests of one thread (internal).",
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)notes_dealloc,
    .tp_methods = notes_methods,
};

/* ---- the middleware's base type --------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *app;
    PyObject *stats;         /* the middleware's stats dict */
    PyObject *rng;           /* callable returning [0, 1) */
    PyObject *trigger_key;   /* environ key of the trigger header, or NULL */
    double pct;
    int enabled;             /* 0: a plain pass-through */
    int slow_only;           /* inspector / observers: every request slow */
    int blocking;            /* unsampled requests are noted */
    /* Armed for one thread's engine (set by Python's _arm): */
    gqp_py_thread *armed_st;
    uint64_t armed_gen;
    PyObject *notes;         /* that engine's RequestNotes */
    PyObject *lingering;     /* that engine's dict of lingering requests */
} gqp_mw;

static PyObject *str_call_slow, *str_call_drawn, *str_requests,
    *str_internal_error, *str_begin, *str_method_key, *str_path_key,
    *str_rid_key;

static int mw_traverse(gqp_mw *self, visitproc visit, void *arg)
{
    Py_VISIT(self->app);
    Py_VISIT(self->stats);
    Py_VISIT(self->rng);
    Py_VISIT(self->notes);
    Py_VISIT(self->lingering);
    return 0;
}

static int mw_clear(gqp_mw *self)
{
    Py_CLEAR(self->app);
    Py_CLEAR(self->stats);
    Py_CLEAR(self->rng);
    Py_CLEAR(self->trigger_key);
    Py_CLEAR(self->notes);
    Py_CLEAR(self->lingering);
    self->armed_st = NULL;
    return 0;
}

static void mw_dealloc(gqp_mw *self)
{
    PyObject_GC_UnTrack(self);
    mw_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *call2(PyObject *fn, PyObject *a, PyObject *b)
{
    PyObject *args[] = {a, b};
    return PyObject_Vectorcall(fn, args, 2, NULL);
}

static PyObject *call_method2(PyObject *self, PyObject *name, PyObject *a,
                              PyObject *b)
{
    PyObject *args[] = {self, a, b};
    return PyObject_VectorcallMethod(name, args, 3, NULL);
}

/* requests += 1 in the stats dict (which Python code also updates). */
static void count_request(gqp_mw *self)
{
    if (!self->stats || !PyDict_CheckExact(self->stats)) {
        return;
    }
    PyObject *old = PyDict_GetItemWithError(self->stats, str_requests);
    long long n = old && PyLong_CheckExact(old) ? PyLong_AsLongLong(old) : -1;
    PyObject *next = n >= 0 ? PyLong_FromLongLong(n + 1) : NULL;
    if (next) {
        PyDict_SetItem(self->stats, str_requests, next);
        Py_DECREF(next);
    }
    PyErr_Clear();
}

/* The armed thread state, if this thread's engine is ready for the fast
 * path: hooks active, nothing lingering (a lingering profile must learn
 * that its greenlet began a new request: Python's _stop_lingering). */
static gqp_py_thread *armed(gqp_mw *self)
{
    gqp_py_thread *st = gqp__tls;
    if (!st || st != self->armed_st || st->gen != self->armed_gen ||
        !st->active || !st->tracer || !self->notes ||
        (self->lingering && PyDict_GET_SIZE(self->lingering) != 0)) {
        return NULL;
    }
    return st;
}

/* The draw failed (a raising rng): greqprof never breaks the app, so the
 * error goes to _internal_error and the request is not profiled. */
static void draw_failed(gqp_mw *self)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    PyObject *r = value ? call_method2((PyObject *)self, str_internal_error,
                                       str_begin, value) : NULL;
    Py_XDECREF(r);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    PyErr_Clear();
}

static PyObject *mw_call(gqp_mw *self, PyObject *args, PyObject *kwargs)
{
    if (kwargs || !PyTuple_Check(args) || PyTuple_GET_SIZE(args) != 2) {
        /* Not a plain WSGI call: Python reports it as it would. */
        PyObject *slow = PyObject_GetAttr((PyObject *)self, str_call_slow);
        if (!slow) {
            return NULL;
        }
        PyObject *r = PyObject_Call(slow, args, kwargs);
        Py_DECREF(slow);
        return r;
    }
    PyObject *environ = PyTuple_GET_ITEM(args, 0);
    PyObject *start_response = PyTuple_GET_ITEM(args, 1);
    if (!self->app) {
        PyErr_SetString(PyExc_RuntimeError, "ProfilingMiddleware has no app");
        return NULL;
    }
    if (!self->enabled) {
        return call2(self->app, environ, start_response);
    }
    if (self->slow_only || !PyDict_CheckExact(environ)) {
        return call_method2((PyObject *)self, str_call_slow, environ,
                            start_response);
    }
    if (self->trigger_key) {
        PyObject *v = PyDict_GetItemWithError(environ, self->trigger_key);
        if (v || PyErr_Occurred()) {
            PyErr_Clear();
            return call_method2((PyObject *)self, str_call_slow, environ,
                                start_response);
        }
    }
    gqp_py_thread *st = NULL;
    if (self->blocking && !(st = armed(self))) {
        /* This thread's engine is not ready: Python sets it up (and arms
         * this path for it). */
        return call_method2((PyObject *)self, str_call_slow, environ,
                            start_response);
    }
    int sampled = 0;
    if (self->pct >= 1.0) {
        sampled = 1;
    } else if (self->pct > 0.0) {
        PyObject *r = self->rng ? PyObject_CallNoArgs(self->rng) : NULL;
        double x = r ? PyFloat_AsDouble(r) : -1.0;
        Py_XDECREF(r);
        if (!r || (x == -1.0 && PyErr_Occurred())) {
            draw_failed(self);
            return call2(self->app, environ, start_response);
        }
        sampled = x < self->pct;
    }
    count_request(self);
    if (sampled) {
        return call_method2((PyObject *)self, str_call_drawn, environ,
                            start_response);
    }
    if (st) {
        uint64_t gid = 0;
        if (gqp_tracer_current(st->tracer, NULL, &gid, NULL) == GQP_OK &&
            gid) {
            notes_add((gqp_notes *)self->notes, gid, gqp_clock_wall_ns(),
                      PyDict_GetItemWithError(environ, str_method_key),
                      PyDict_GetItemWithError(environ, str_path_key),
                      PyDict_GetItemWithError(environ, str_rid_key));
            PyErr_Clear();
        }
    }
    return call2(self->app, environ, start_response);
}

/* _fast_setup(enabled, pct, rng, trigger_key, blocking, slow_only, stats) */
static PyObject *mw_fast_setup(gqp_mw *self, PyObject *const *args,
                               Py_ssize_t nargs)
{
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "_fast_setup takes 7 arguments");
        return NULL;
    }
    double pct = PyFloat_AsDouble(args[1]);
    if (pct == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    if (args[3] != Py_None && !PyUnicode_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "trigger_key must be a str or None");
        return NULL;
    }
    self->enabled = PyObject_IsTrue(args[0]);
    self->pct = pct;
    Py_XSETREF(self->rng, args[2] == Py_None ? NULL : Py_NewRef(args[2]));
    Py_XSETREF(self->trigger_key,
               args[3] == Py_None ? NULL : Py_NewRef(args[3]));
    self->blocking = PyObject_IsTrue(args[4]);
    self->slow_only = PyObject_IsTrue(args[5]);
    Py_XSETREF(self->stats, Py_NewRef(args[6]));
    Py_RETURN_NONE;
}

/* _arm(hooks_address, notes, lingering): unsampled requests of the calling
 * thread take the fast path from now on (the hooks at hooks_address must
 * be this thread's, installed by the engine that owns notes/lingering). */
static PyObject *mw_arm(gqp_mw *self, PyObject *const *args,
                        Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "_arm takes 3 arguments");
        return NULL;
    }
    gqp_py_thread *st = (gqp_py_thread *)PyLong_AsVoidPtr(args[0]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (!PyObject_TypeCheck(args[1], &gqp_notes_type) ||
        !PyDict_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "_arm wants RequestNotes and a dict");
        return NULL;
    }
    if (!st || st != gqp__tls || !st->active) {
        Py_RETURN_FALSE;   /* not this thread's hooks: stay slow */
    }
    self->armed_st = st;
    self->armed_gen = st->gen;
    Py_XSETREF(self->notes, Py_NewRef(args[1]));
    Py_XSETREF(self->lingering, Py_NewRef(args[2]));
    Py_RETURN_TRUE;
}

/* _is_armed(): True when the calling thread takes the fast path. */
static PyObject *mw_is_armed(gqp_mw *self, PyObject *unused)
{
    (void)unused;
    return PyBool_FromLong(armed(self) != NULL);
}

static PyObject *mw_disarm(gqp_mw *self, PyObject *unused)
{
    (void)unused;
    self->armed_st = NULL;
    Py_CLEAR(self->notes);
    Py_CLEAR(self->lingering);
    Py_RETURN_NONE;
}

static PyObject *mw_get_app(gqp_mw *self, void *closure)
{
    (void)closure;
    if (!self->app) {
        PyErr_SetString(PyExc_AttributeError, "app");
        return NULL;
    }
    return Py_NewRef(self->app);
}

static int mw_set_app(gqp_mw *self, PyObject *value, void *closure)
{
    (void)closure;
    if (!value) {
        PyErr_SetString(PyExc_AttributeError, "app cannot be deleted");
        return -1;
    }
    Py_XSETREF(self->app, Py_NewRef(value));
    return 0;
}

static PyGetSetDef mw_getset[] = {
    {"app", (getter)mw_get_app, (setter)mw_set_app,
     "The wrapped WSGI application.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef mw_methods[] = {
    {"_fast_setup", (PyCFunction)(void (*)(void))mw_fast_setup,
     METH_FASTCALL, "Sets the options the C path reads (internal)."},
    {"_arm", (PyCFunction)(void (*)(void))mw_arm, METH_FASTCALL,
     "Lets the calling thread's requests take the C path (internal)."},
    {"_disarm", (PyCFunction)mw_disarm, METH_NOARGS,
     "Sends every request through Python again (internal)."},
    {"_is_armed", (PyCFunction)mw_is_armed, METH_NOARGS,
     "True when the calling thread takes the C path (internal)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject gqp_mw_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "greqprof._core.MiddlewareBase",
    .tp_basicsize = sizeof(gqp_mw),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "ProfilingMiddleware's C part: the unsampled request path.",
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)mw_dealloc,
    .tp_traverse = (traverseproc)mw_traverse,
    .tp_clear = (inquiry)mw_clear,
    .tp_call = (ternaryfunc)mw_call,
    .tp_methods = mw_methods,
    .tp_getset = mw_getset,
};

/* Registers the types in greqprof._registry (GIL held).  0 or -1. */
static int gqp_py_fast_init(PyObject *reg)
{
    struct { PyObject **s; const char *v; } strs[] = {
        {&str_call_slow, "_call_slow"}, {&str_call_drawn, "_call_drawn"},
        {&str_requests, "requests"}, {&str_internal_error, "_internal_error"},
        {&str_begin, "begin"}, {&str_method_key, "REQUEST_METHOD"},
        {&str_path_key, "PATH_INFO"}, {&str_rid_key, "HTTP_X_REQUEST_ID"},
    };
    for (size_t i = 0; i < sizeof strs / sizeof strs[0]; i++) {
        if (!*strs[i].s && !(*strs[i].s = PyUnicode_InternFromString(strs[i].v))) {
            return -1;
        }
    }
    if (PyType_Ready(&gqp_notes_type) < 0 || PyType_Ready(&gqp_mw_type) < 0) {
        return -1;
    }
    if (PyObject_SetAttrString(reg, "RequestNotes",
                               (PyObject *)&gqp_notes_type) < 0 ||
        PyObject_SetAttrString(reg, "MiddlewareBase",
                               (PyObject *)&gqp_mw_type) < 0) {
        return -1;
    }
    return 0;
}
