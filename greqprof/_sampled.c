/* _sampled.c -- a sampled request's path, in C.  #included into
 * greqprof._core after _fastpath.c (it extends the middleware's base type).
 *
 * A sampled request used to cost about 90 us of server CPU in Python
 * around the app: an object with 16 attributes, a closure for
 * start_response, a wrapper object for the body, a profile object made
 * through cffi (each cffi call releases the GIL, which the watchdog thread
 * may take), and a dozen method calls to begin and finish.  The types and
 * functions here do the same work with no Python frame:
 *
 *   Request        the open request (what _OpenRequest was); Python code
 *                  reads and writes the same attributes;
 *   ProfileRef     owns the request's gqp_profile (RequestRawProfile in
 *                  _lowlevel.py adds the cffi readers on top);
 *   StartResponse  records the status, then calls the server's;
 *   ClosingIterator / ClosingSequence
 *                  the body passed through; close() finishes the request.
 *
 * The common case (the thread's engine armed, no observers, calls off)
 * begins and finishes here.  Anything else goes through the Python methods
 * (_call_slow, _finish, _finalize), which use the same objects, so a
 * request may begin in Python and finish in C or the other way round.
 * Profiles are still finalized (read, built, delivered) in Python, in
 * batches, by the engine's finisher greenlet. */

/* ---- CPU clock windows (engine.CPU_WINDOW_*) ---------------------------- */

static int64_t cpu_window_profiling = 100000;
static int64_t cpu_window_idle = 10000000;

/* One more (delta 1) or one fewer (-1) sampled profile open in st's
 * thread: the first narrows the CPU clock window, the last widens it. */
static void profile_window(gqp_py_thread *st, int delta)
{
    if (!st->tracer) {
        return;
    }
    if (delta > 0) {
        if (st->open_profiles++ == 0) {
            gqp_tracer_set(st->tracer, GQP_TRACER_CPU_WINDOW_NS,
                           cpu_window_profiling);
        }
    } else if (st->open_profiles > 0 && --st->open_profiles == 0) {
        gqp_tracer_set(st->tracer, GQP_TRACER_CPU_WINDOW_NS,
                       cpu_window_idle);
    }
}

/* _registry.profile_window(hooks, delta); hooks 0 (uninstalled): nothing */
static PyObject *profile_window_py(PyObject *self, PyObject *const *args,
                                   Py_ssize_t nargs)
{
    (void)self;
    if (want_args(nargs, 2, "profile_window") < 0) {
        return NULL;
    }
    gqp_py_thread *st = (gqp_py_thread *)PyLong_AsVoidPtr(args[0]);
    long delta = PyLong_AsLong(args[1]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (st) {
        profile_window(st, delta > 0 ? 1 : -1);
    }
    Py_RETURN_NONE;
}

/* _registry.cpu_windows(profiling_ns, idle_ns) */
static PyObject *cpu_windows_py(PyObject *self, PyObject *const *args,
                                Py_ssize_t nargs)
{
    (void)self;
    if (want_args(nargs, 2, "cpu_windows") < 0) {
        return NULL;
    }
    long long busy = PyLong_AsLongLong(args[0]);
    long long idle = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (busy <= 0 || idle <= 0) {
        PyErr_SetString(PyExc_ValueError, "CPU windows must be positive");
        return NULL;
    }
    cpu_window_profiling = busy;
    cpu_window_idle = idle;
    Py_RETURN_NONE;
}

/* ---- ProfileRef --------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    gqp_profile *p;
} gqp_profref;

static void profref_dealloc(gqp_profref *self)
{
    if (self->p) {
        gqp_profile_free(self->p);
        self->p = NULL;
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *profref_close(gqp_profref *self, PyObject *unused)
{
    (void)unused;
    if (self->p && !gqp_profile_is_closed(self->p)) {
        int rc = gqp_profile_close(self->p);
        if (rc < 0) {
            PyErr_Format(PyExc_RuntimeError, "gqp_profile_close failed: %s",
                         gqp_strerror(rc));
            return NULL;
        }
    }
    Py_RETURN_NONE;
}

static PyObject *profref_addr(gqp_profref *self, void *closure)
{
    (void)closure;
    return PyLong_FromVoidPtr(self->p);
}

static PyObject *profref_closed(gqp_profref *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(!self->p || gqp_profile_is_closed(self->p));
}

static PyObject *profref_attached(gqp_profref *self, void *closure)
{
    (void)closure;
    return PyLong_FromSize_t(self->p ? gqp_profile_attached(self->p) : 0);
}

static PyGetSetDef profref_getset[] = {
    {"addr", (getter)profref_addr, NULL,
     "The profile's address, for _registry functions.", NULL},
    {"closed", (getter)profref_closed, NULL, "True once closed.", NULL},
    {"attached", (getter)profref_attached, NULL,
     "Live greenlets whose spans go to this profile.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef profref_methods[] = {
    {"close", (PyCFunction)profref_close, METH_NOARGS,
     "Closes the profile: nothing more is recorded into it."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject gqp_profref_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "greqprof._core.ProfileRef",
    .tp_basicsize = sizeof(gqp_profref),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Owns one request's gqp_profile (internal).",
    .tp_dealloc = (destructor)profref_dealloc,
    .tp_methods = profref_methods,
    .tp_getset = profref_getset,
};

/* A new profile for one request, as an instance of type (ProfileRef or a
 * subclass); NULL with an exception set. */
static PyObject *profref_make(PyTypeObject *type, size_t max_spans)
{
    if (!PyType_IsSubtype(type, &gqp_profref_type)) {
        PyErr_SetString(PyExc_TypeError, "not a ProfileRef type");
        return NULL;
    }
    gqp_profref *self = (gqp_profref *)type->tp_alloc(type, 0);
    if (!self) {
        return NULL;
    }
    if (!(self->p = gqp_py_profile_new(max_spans))) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

/* _registry.new_profile(type, max_spans) */
static PyObject *new_profile_py(PyObject *self, PyObject *const *args,
                                Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2 || !PyType_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError,
                        "new_profile takes a type and max_spans");
        return NULL;
    }
    Py_ssize_t max_spans = PyLong_AsSsize_t(args[1]);
    if (max_spans < 1) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "max_spans must be >= 1");
        }
        return NULL;
    }
    return profref_make((PyTypeObject *)args[0], (size_t)max_spans);
}

/* ---- Request ------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    PyObject *greenlet, *gid, *profile, *addr, *method, *path, *status,
        *start_ns, *end_ns, *request_id, *sampled_by, *error, *done,
        *blocking, *observed, *generation, *engine;
    PyObject *weakrefs;
    char finalizing;   /* set when a _finalize takes the request on */
} gqp_req;

/* A field reads None while unset, as structmember's T_OBJECT did (which
 * CPython deprecated: Py_T_OBJECT_EX raises AttributeError instead). */
static PyObject *req_field_get(PyObject *self, void *offset)
{
    PyObject *v = *(PyObject **)((char *)self + (size_t)offset);
    return Py_NewRef(v ? v : Py_None);
}

static int req_field_set(PyObject *self, PyObject *value, void *offset)
{
    PyObject **slot = (PyObject **)((char *)self + (size_t)offset);
    Py_XSETREF(*slot, Py_XNewRef(value));
    return 0;
}

#define REQ_FIELD(name, doc) \
    {#name, req_field_get, req_field_set, doc, \
     (void *)offsetof(gqp_req, name)}

static PyGetSetDef req_fields[] = {
    REQ_FIELD(greenlet, "The greenlet serving the request (None once done)."),
    REQ_FIELD(gid, "Its tracer id."),
    REQ_FIELD(profile, "The ProfileRef of a sampled request, else None."),
    REQ_FIELD(addr, "The profile's address."),
    REQ_FIELD(method, "REQUEST_METHOD (cut to 32 characters)."),
    REQ_FIELD(path, "PATH_INFO (cut to MAX_PATH characters)."),
    REQ_FIELD(status, "The status given to start_response."),
    REQ_FIELD(start_ns, "Wall clock at the start (ns)."),
    REQ_FIELD(end_ns, "Wall clock at the end of the response (ns)."),
    REQ_FIELD(request_id, "X-Request-ID, or None."),
    REQ_FIELD(sampled_by, "'pct', 'trigger' or None."),
    REQ_FIELD(error, "'Type: message' of what the app raised, or None."),
    REQ_FIELD(done, "True once the response is done."),
    REQ_FIELD(blocking, "Blocking events of the request."),
    REQ_FIELD(observed, "Observers' state, or None."),
    REQ_FIELD(generation, "Fork generation it began in."),
    REQ_FIELD(engine, "The engine of the thread it began in."),
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef req_members[] = {
    {"finalizing", Py_T_BOOL, offsetof(gqp_req, finalizing), Py_READONLY,
     "True once a _finalize took it on (it is finalized once)."},
    {NULL, 0, 0, 0, NULL},
};

static int req_traverse(gqp_req *self, visitproc visit, void *arg)
{
    Py_VISIT(self->greenlet);
    Py_VISIT(self->gid);
    Py_VISIT(self->profile);
    Py_VISIT(self->addr);
    Py_VISIT(self->method);
    Py_VISIT(self->path);
    Py_VISIT(self->status);
    Py_VISIT(self->start_ns);
    Py_VISIT(self->end_ns);
    Py_VISIT(self->request_id);
    Py_VISIT(self->sampled_by);
    Py_VISIT(self->error);
    Py_VISIT(self->done);
    Py_VISIT(self->blocking);
    Py_VISIT(self->observed);
    Py_VISIT(self->generation);
    Py_VISIT(self->engine);
    return 0;
}

static int req_clear(gqp_req *self)
{
    Py_CLEAR(self->greenlet);
    Py_CLEAR(self->gid);
    Py_CLEAR(self->profile);
    Py_CLEAR(self->addr);
    Py_CLEAR(self->method);
    Py_CLEAR(self->path);
    Py_CLEAR(self->status);
    Py_CLEAR(self->start_ns);
    Py_CLEAR(self->end_ns);
    Py_CLEAR(self->request_id);
    Py_CLEAR(self->sampled_by);
    Py_CLEAR(self->error);
    Py_CLEAR(self->done);
    Py_CLEAR(self->blocking);
    Py_CLEAR(self->observed);
    Py_CLEAR(self->generation);
    Py_CLEAR(self->engine);
    return 0;
}

static void req_dealloc(gqp_req *self)
{
    PyObject_GC_UnTrack(self);
    if (self->weakrefs) {
        PyObject_ClearWeakRefs((PyObject *)self);
    }
    req_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject gqp_req_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "greqprof._core.Request",
    .tp_basicsize = sizeof(gqp_req),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A request the middleware follows (internal).",
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)req_dealloc,
    .tp_traverse = (traverseproc)req_traverse,
    .tp_clear = (inquiry)req_clear,
    .tp_members = req_members,
    .tp_getset = req_fields,
    .tp_weaklistoffset = offsetof(gqp_req, weakrefs),
};

/* del d[key] if it is value (d may be NULL or not a dict: nothing). */
static void forget_entry(PyObject *d, PyObject *key, PyObject *value)
{
    if (d && PyDict_Check(d) && key &&
        PyDict_GetItemWithError(d, key) == value) {
        PyDict_DelItem(d, key);
    }
}

static void forget_request_of(PyObject *requests, PyObject *prev)
{
    if (PyObject_TypeCheck(prev, &gqp_req_type)) {
        forget_entry(requests, ((gqp_req *)prev)->gid, prev);
    }
}

/* req.error = "Type: message" of the exception being raised, unless
 * keep_first and an error is already recorded.  The exception stays set. */
static void req_note_error(gqp_req *req, int keep_first)
{
    if (keep_first && req->error && req->error != Py_None) {
        return;
    }
    PyObject *value = PyErr_GetRaisedException();
    PyObject *name = value ? PyType_GetName(Py_TYPE(value)) : NULL;
    PyObject *msg = name ? PyUnicode_FromFormat("%U: %S", name, value) : NULL;
    Py_XDECREF(name);
    if (msg) {
        Py_XSETREF(req->error, msg);
    }
    PyErr_Clear();
    PyErr_SetRaisedException(value);
}

/* ---- finishing a request ------------------------------------------------ */

static PyObject *str_finish, *str_finalize, *str_drain_blocking,
    *str_finisher_woken, *str_wake_finisher_soon, *str_sampled, *str_empty,
    *str_close,
    *str_finish_where;

/* The armed thread state when req (which has a profile) can be finished
 * here: begun by this thread's armed engine in this process, no observers
 * (they see the end of the response: Python). */
static gqp_py_thread *finish_here(gqp_mw *mw, gqp_req *req)
{
    gqp_py_thread *st = armed_state(mw);
    if (!st || mw->slow_only || req->engine != mw->armed_eng ||
        !req->profile ||
        !PyObject_TypeCheck(req->profile, &gqp_profref_type) ||
        !req->greenlet || req->greenlet == Py_None || !req->generation ||
        PyLong_AsLong(req->generation) != mw->armed_fork_gen) {
        PyErr_Clear();
        return NULL;
    }
    return st;
}

/* The response of req is done (closed, or the app raised).  0, or -1 with
 * an exception set (only if Python's _finish raised, which it does not
 * mean to). */
static int req_finish(gqp_mw *mw, gqp_req *req)
{
    if (req->done == Py_True) {
        return 0;
    }
    gqp_py_thread *st = finish_here(mw, req);
    if (!st) {
        PyObject *r = PyObject_CallMethodOneArg((PyObject *)mw, str_finish,
                                                (PyObject *)req);
        Py_XDECREF(r);
        return r ? 0 : -1;
    }
    PyObject *end = PyLong_FromLongLong((long long)gqp_clock_wall_ns());
    if (!end) {
        return -1;
    }
    Py_XSETREF(req->done, Py_NewRef(Py_True));
    Py_XSETREF(req->end_ns, end);
    /* The engine's, as armed now (finish_here): allocations below may run
     * a garbage collection, whose finalizers may let another thread
     * re-arm mw. */
    PyObject *eng = Py_NewRef(req->engine);
    PyObject *lingering = Py_NewRef(mw->lingering);
    PyObject *pending = Py_NewRef(mw->pending);
    /* Later spans of this greenlet (the next keep-alive request) are not
     * this request's; greenlets it spawned still are. */
    gqp_profile *p = ((gqp_profref *)req->profile)->p;
    attach_greenlet(st, req->greenlet, NULL);
    if (!mw->linger) {
        /* (_finalize drains the long spans first) */
        PyObject *args[] = {(PyObject *)mw, eng, (PyObject *)req};
        PyObject *r = PyObject_VectorcallMethod(str_finalize, args, 3, NULL);
        Py_XDECREF(r);
        Py_DECREF(eng);
        Py_DECREF(lingering);
        Py_DECREF(pending);
        return r ? 0 : -1;
    }
    /* Wait (up to linger) for the greenlets it spawned: the engine's
     * finisher greenlet finalizes it. */
    uint64_t key = (uint64_t)(uintptr_t)req->greenlet;
    gqp_tracer_set_spawn_profile(st->tracer, key, p);
    PyObject *k = PyLong_FromVoidPtr(req->greenlet);
    PyObject *item = k ? PyTuple_Pack(2, (PyObject *)mw, (PyObject *)req)
                       : NULL;
    /* Queued first: a request lingering but not queued would never be
     * finalized. */
    int rc = item && PyList_Append(pending, item) == 0 ? 0 : -1;
    if (rc == 0 && PyDict_SetItem(lingering, k, (PyObject *)req) < 0) {
        rc = -1;   /* (queued: finalized all the same, not lingering) */
    }
    if (rc < 0) {
        gqp_tracer_set_spawn_profile(st->tracer, key, NULL);
    }
    Py_XDECREF(k);
    Py_XDECREF(item);
    Py_DECREF(lingering);
    Py_DECREF(pending);
    if (rc < 0) {
        Py_DECREF(eng);
        return -1;
    }
    /* Python from here on (a logging handler may switch greenlets): mw's
     * armed state is not looked at again. */
    if (PyList_GET_SIZE(reg_long) > 0) {
        /* Blocking spans reported when the request ends, named after it
         * (it stays registered until it is finalized). */
        PyObject *r = PyObject_CallMethodOneArg((PyObject *)mw,
                                                str_drain_blocking, eng);
        if (!r && internal_error(mw, str_finish_where) < 0) {
            Py_DECREF(eng);
            return -1;   /* (queued: the finisher finalizes it) */
        }
        Py_XDECREF(r);
    }
    PyObject *woken = PyObject_GetAttr(eng, str_finisher_woken);
    int is_woken = woken ? PyObject_IsTrue(woken) : -1;
    Py_XDECREF(woken);
    if (is_woken == 0) {
        PyObject *r = PyObject_CallMethodOneArg((PyObject *)mw,
                                                str_wake_finisher_soon, eng);
        is_woken = r ? 1 : -1;
        Py_XDECREF(r);
    }
    Py_DECREF(eng);
    return is_woken < 0 ? -1 : 0;
}

/* req_finish for the body wrappers and the app-raised path: an error in
 * greqprof never reaches the app (Python's _finish logs its own).  A
 * BaseException raised meanwhile (a gevent.Timeout that fired in a sink)
 * goes on: -1 with it set, unless an exception was already on its way,
 * which then wins. */
static int req_finish_quiet(gqp_mw *mw, gqp_req *req)
{
    PyObject *value = PyErr_GetRaisedException();
    if (req_finish(mw, req) < 0 && internal_error(mw, str_finish_where) < 0) {
        if (!value) {
            return -1;
        }
        PyErr_Clear();
    }
    PyErr_SetRaisedException(value);
    return 0;
}

/* ---- StartResponse ------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    gqp_req *req;
    PyObject *start_response;
} gqp_startresp;

static int startresp_traverse(gqp_startresp *self, visitproc visit, void *arg)
{
    Py_VISIT(self->req);
    Py_VISIT(self->start_response);
    return 0;
}

static int startresp_clear(gqp_startresp *self)
{
    Py_CLEAR(self->req);
    Py_CLEAR(self->start_response);
    return 0;
}

static void startresp_dealloc(gqp_startresp *self)
{
    PyObject_GC_UnTrack(self);
    startresp_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* start_response(status, headers, exc_info=None): records the status and
 * calls the server's with the same arguments (exc_info only when given). */
static PyObject *startresp_call(gqp_startresp *self, PyObject *args,
                                PyObject *kwargs)
{
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    PyObject *exc_info = n == 3 ? PyTuple_GET_ITEM(args, 2) : Py_None;
    Py_ssize_t nkw = kwargs ? PyDict_GET_SIZE(kwargs) : 0;
    if (nkw == 1 && n == 2) {
        exc_info = PyDict_GetItemString(kwargs, "exc_info");
    }
    if (n < 2 || n > 3 || nkw > 1 || (nkw && n == 3) || !exc_info) {
        PyErr_SetString(PyExc_TypeError,
                        "start_response(status, headers, exc_info=None)");
        return NULL;
    }
    if (self->req) {
        Py_XSETREF(self->req->status, Py_NewRef(PyTuple_GET_ITEM(args, 0)));
    }
    PyObject *fwd[] = {PyTuple_GET_ITEM(args, 0), PyTuple_GET_ITEM(args, 1),
                       exc_info};
    return PyObject_Vectorcall(self->start_response, fwd,
                               exc_info == Py_None ? 2 : 3, NULL);
}

static PyTypeObject gqp_startresp_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "greqprof._core.StartResponse",
    .tp_basicsize = sizeof(gqp_startresp),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The server's start_response, recording the status.",
    .tp_dealloc = (destructor)startresp_dealloc,
    .tp_traverse = (traverseproc)startresp_traverse,
    .tp_clear = (inquiry)startresp_clear,
    .tp_call = (ternaryfunc)startresp_call,
};

/* ---- the body: ClosingIterator, ClosingSequence ------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *result;   /* the app's iterable */
    PyObject *it;       /* its iterator (ClosingIterator only) */
    gqp_mw *mw;
    gqp_req *req;
} gqp_body;

static int body_traverse(gqp_body *self, visitproc visit, void *arg)
{
    Py_VISIT(self->result);
    Py_VISIT(self->it);
    Py_VISIT(self->mw);
    Py_VISIT(self->req);
    return 0;
}

static int body_clear(gqp_body *self)
{
    Py_CLEAR(self->result);
    Py_CLEAR(self->it);
    Py_CLEAR(self->mw);
    Py_CLEAR(self->req);
    return 0;
}

static void body_dealloc(gqp_body *self)
{
    PyObject_GC_UnTrack(self);
    body_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject gqp_iterbody_type;

/* ClosingIterator.close(): the app's close() (if any), then the request
 * finishes, even if that close() raised. */
static PyObject *body_close(gqp_body *self, PyObject *unused)
{
    (void)unused;
    int failed = 0;
    /* (an exact list or tuple has no close(); a subclass may) */
    if (self->result && !PyList_CheckExact(self->result) &&
        !PyTuple_CheckExact(self->result)) {
        PyObject *close = PyObject_GetAttr(self->result, str_close);
        if (!close && PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();   /* getattr(result, "close", None) */
        } else if (!close) {
            failed = 1;
        } else {
            PyObject *r = PyObject_CallNoArgs(close);
            Py_DECREF(close);
            failed = r == NULL;
            Py_XDECREF(r);
        }
    }
    if (self->mw && self->req && req_finish_quiet(self->mw, self->req) < 0) {
        failed = 1;
    }
    if (failed) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *body_iternext(gqp_body *self)
{
    if (!self->it) {
        PyErr_SetString(PyExc_TypeError, "not an iterator");
        return NULL;
    }
    PyObject *item = PyIter_Next(self->it);
    if (!item && PyErr_Occurred() && self->req) {
        req_note_error(self->req, 1);
    }
    return item;
}

static PyObject *body_iter_self(PyObject *self)
{
    return Py_NewRef(self);
}

static PyObject *seq_iter(gqp_body *self)
{
    return PyObject_GetIter(self->result);
}

static Py_ssize_t seq_len(gqp_body *self)
{
    return PyObject_Size(self->result);
}

static PyMethodDef body_methods[] = {
    {"close", (PyCFunction)body_close, METH_NOARGS,
     "Closes the app's iterable and finishes the request's profile."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods seq_as_sequence = {
    .sq_length = (lenfunc)seq_len,
};

static PyTypeObject gqp_iterbody_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "greqprof._core.ClosingIterator",
    .tp_basicsize = sizeof(gqp_body),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The app's body, passed through unbuffered; close() "
              "finishes the request's profile.",
    .tp_dealloc = (destructor)body_dealloc,
    .tp_traverse = (traverseproc)body_traverse,
    .tp_clear = (inquiry)body_clear,
    .tp_iter = body_iter_self,
    .tp_iternext = (iternextfunc)body_iternext,
    .tp_methods = body_methods,
};

/* A list or tuple body: sized like the app's (servers use len() for
 * Content-Length) and re-iterable. */
static PyTypeObject gqp_seqbody_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "greqprof._core.ClosingSequence",
    .tp_basicsize = sizeof(gqp_body),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The app's list/tuple body; close() finishes the request's "
              "profile.",
    .tp_dealloc = (destructor)body_dealloc,
    .tp_traverse = (traverseproc)body_traverse,
    .tp_clear = (inquiry)body_clear,
    .tp_iter = (getiterfunc)seq_iter,
    .tp_as_sequence = &seq_as_sequence,
    .tp_methods = body_methods,
};

static gqp_body *body_new(PyTypeObject *type, PyObject *result, gqp_mw *mw,
                          gqp_req *req)
{
    gqp_body *b = PyObject_GC_New(gqp_body, type);
    if (!b) {
        return NULL;
    }
    b->result = Py_NewRef(result);
    b->it = NULL;
    b->mw = (gqp_mw *)Py_NewRef((PyObject *)mw);
    b->req = (gqp_req *)Py_NewRef((PyObject *)req);
    PyObject_GC_Track(b);
    return b;
}

/* ---- running a profiled request ----------------------------------------- */

/* Calls the app for req with the wrappers above; the request finishes when
 * the server closes the body (or at once, if the app raised). */
static PyObject *run_profiled(gqp_mw *mw, gqp_req *req, PyObject *environ,
                              PyObject *start_response)
{
    gqp_startresp *sr = PyObject_GC_New(gqp_startresp, &gqp_startresp_type);
    if (!sr) {
        req_note_error(req, 0);
        req_finish_quiet(mw, req);   /* (begun: it must end) */
        return NULL;
    }
    sr->req = (gqp_req *)Py_NewRef((PyObject *)req);
    sr->start_response = Py_NewRef(start_response);
    PyObject_GC_Track(sr);
    PyObject *result = call2(mw->app, environ, (PyObject *)sr);
    Py_DECREF(sr);
    if (!result) {
        req_note_error(req, 0);
        req_finish_quiet(mw, req);
        return NULL;
    }
    gqp_body *b;
    if (PyList_Check(result) || PyTuple_Check(result)) {
        b = body_new(&gqp_seqbody_type, result, mw, req);
    } else {
        b = body_new(&gqp_iterbody_type, result, mw, req);
        if (b && !(b->it = PyObject_GetIter(result))) {
            /* iter() of the app's result raised: its close() still runs */
            req_note_error(req, 0);
            PyObject *value = PyErr_GetRaisedException();
            Py_CLEAR(b->it);
            PyObject *r = body_close(b, NULL);
            Py_XDECREF(r);
            PyErr_Clear();
            PyErr_SetRaisedException(value);
            Py_CLEAR(b);
        }
    }
    if (!b && !PyErr_Occurred()) {
        PyErr_NoMemory();
    }
    if (!b && req->done != Py_True) {
        /* No wrapper (out of memory): the app's close() and the end of
         * the request happen now, the error goes on. */
        req_note_error(req, 0);
        PyObject *value = PyErr_GetRaisedException();
        PyObject *close = PyObject_GetAttr(result, str_close);
        PyObject *r = close ? PyObject_CallNoArgs(close) : NULL;
        Py_XDECREF(close);
        Py_XDECREF(r);
        PyErr_Clear();
        req_finish_quiet(mw, req);
        PyErr_SetRaisedException(value);
    }
    Py_DECREF(result);
    return (PyObject *)b;
}

/* MiddlewareBase._call_profiled(req, environ, start_response) */
static PyObject *mw_call_profiled(gqp_mw *self, PyObject *const *args,
                                  Py_ssize_t nargs)
{
    if (nargs != 3 || !PyObject_TypeCheck(args[0], &gqp_req_type)) {
        PyErr_SetString(PyExc_TypeError,
                        "_call_profiled(request, environ, start_response)");
        return NULL;
    }
    return run_profiled(self, (gqp_req *)args[0], args[1], args[2]);
}

/* str(environ[key])[:max], "" when missing; NULL with an exception set. */
static PyObject *environ_str(PyObject *environ, PyObject *key, Py_ssize_t max)
{
    PyObject *v = PyDict_GetItemWithError(environ, key);
    if (!v) {
        return PyErr_Occurred() ? NULL : Py_NewRef(str_empty);
    }
    return str_cut(v, max);
}

/* A new Request for the running greenlet of st, sampled into a fresh
 * profile; NULL (and no exception) when this case is not for C: the
 * caller hands the request to Python, which also reports failures. */
static gqp_req *sampled_begin(gqp_mw *self, gqp_py_thread *st,
                              PyObject *environ)
{
    if (self->calls || self->slow_only || !self->armed_eng ||
        !self->profile_type || self->open >= self->max_open) {
        return NULL;
    }
    gqp_req *req = PyObject_GC_New(gqp_req, &gqp_req_type);
    if (!req) {
        PyErr_Clear();
        return NULL;
    }
    memset((char *)req + sizeof(PyObject), 0,
           sizeof(gqp_req) - sizeof(PyObject));
    PyObject_GC_Track(req);
    PyObject *rid = PyDict_GetItemWithError(environ, str_rid_key);
    Py_XINCREF(rid);   /* (its __bool__ may change environ) */
    if (rid && PyObject_IsTrue(rid) == 1) {
        req->request_id = str_cut(rid, GQP_NOTE_MAX_RID);
    } else {
        req->request_id = Py_NewRef(Py_None);
    }
    Py_XDECREF(rid);
    req->method = environ_str(environ, str_method_key, GQP_NOTE_MAX_METHOD);
    req->path = environ_str(environ, str_path_key, GQP_NOTE_MAX_PATH);
    req->profile = profref_make(self->profile_type, self->max_spans);
    if (!req->request_id || !req->method || !req->path || !req->profile) {
        goto fail;
    }
    /* The running greenlet, as greenlet knows it (the tracer's idea of it
     * would be stale if another tool replaced the switch hook), and still
     * this thread's armed state (str() of an environ value runs code). */
    PyObject *g = PyObject_CallNoArgs(greenlet_getcurrent);
    uint64_t key = 0;
    if (!g || st != armed_state(self) ||
        gqp_tracer_current(st->tracer, &key, NULL, NULL) != GQP_OK ||
        key != (uint64_t)(uintptr_t)g) {
        Py_XDECREF(g);
        goto fail;
    }
    Py_DECREF(g);   /* (the running greenlet is alive: req takes a ref) */
    /* What the armed state is now: allocations below may run a garbage
     * collection, whose finalizers may let another thread re-arm self. */
    PyObject *eng = Py_NewRef(self->armed_eng);
    PyObject *requests = Py_NewRef(self->requests);
    PyObject *by_addr = Py_NewRef(self->profile_requests);
    req->start_ns = PyLong_FromLongLong((long long)gqp_clock_wall_ns());
    req->blocking = PyList_New(0);
    req->generation = PyLong_FromLong(self->armed_fork_gen);
    if (!req->start_ns || !req->blocking || !req->generation) {
        goto fail_armed;
    }
    gqp_profile *p = ((gqp_profref *)req->profile)->p;
    int64_t gid = attach_greenlet(st, g, p);
    if (gid <= 0) {
        if (gid == 0) {
            attach_greenlet(st, g, NULL);
        }
        goto fail_armed;
    }
    req->gid = PyLong_FromLongLong(gid);
    req->addr = PyLong_FromVoidPtr(p);
    if (!req->gid || !req->addr ||
        PyDict_SetItem(requests, req->gid, (PyObject *)req) < 0) {
        attach_greenlet(st, g, NULL);
        goto fail_armed;
    }
    if (PyDict_SetItem(by_addr, req->addr, (PyObject *)req) < 0) {
        attach_greenlet(st, g, NULL);
        PyDict_DelItem(requests, req->gid);
        goto fail_armed;
    }
    Py_DECREF(requests);
    Py_DECREF(by_addr);
    req->greenlet = Py_NewRef(g);
    req->engine = eng;
    req->sampled_by = Py_NewRef(str_pct);
    req->status = Py_NewRef(Py_None);
    req->error = Py_NewRef(Py_None);
    req->done = Py_NewRef(Py_False);
    req->observed = Py_NewRef(Py_None);
    req->end_ns = Py_NewRef(Py_None);
    self->open++;
    profile_window(st, 1);
    count_stat(self, str_sampled);
    return req;
fail_armed:
    Py_DECREF(eng);
    Py_DECREF(requests);
    Py_DECREF(by_addr);
fail:
    PyErr_Clear();
    Py_DECREF(req);
    return NULL;
}

/* The C path's sampled request: begun here when it can be, else by
 * Python's _call_slow (told the draw said: sample). */
static PyObject *sampled_call(gqp_mw *self, gqp_py_thread *st,
                              PyObject *environ, PyObject *start_response)
{
    gqp_req *req = st ? sampled_begin(self, st, environ) : NULL;
    if (!req) {
        PyObject *args[] = {(PyObject *)self, environ, start_response,
                            str_pct};
        return PyObject_VectorcallMethod(str_call_slow, args, 4, NULL);
    }
    PyObject *r = run_profiled(self, req, environ, start_response);
    Py_DECREF(req);
    return r;
}

/* ---- finalizing: the profile becomes a RequestProfile ------------------ */

/* Set by _finalize_setup: */
static PyTypeObject *rp_type;        /* request_profile.RequestProfile */
static PyObject *rp_loader;          /* _collect.request_records */
static PyObject *str_finalize_py, *str_deliver, *str_report, *str_sink,
    *str_outputs, *str_pid, *str_delivered, *str_sink_where, *str_loader,
    *str_f_method, *str_f_path, *str_f_status, *str_f_start, *str_f_end,
    *str_f_wall, *str_f_calls, *str_f_dropped_spans, *str_f_dropped_calls,
    *str_f_blocking, *str_f_clock, *str_f_sampled_by, *str_f_request_id,
    *str_f_pid, *str_f_hostname, *str_f_error;

/* The RequestProfile of req (its response ended), from the profile of
 * tracer's thread.  Only what must be read now is read now, by
 * read_profile (_hooks.c): the profile's rows (its C memory goes once the
 * request is finalized), the stacks, the waiting time (the tracer's
 * history moves on) and the names; the public records (Span, ...) are
 * built from that when first read (_collect.request_records).  snapshot:
 * an open profile read for observers, its stacks left in place and
 * without blocking events.  calls: the function table or None.  A new
 * reference, or NULL with an exception set. */
/* names[req's greenlet] = ("METHOD path", fn_name): the request's own
 * greenlet is shown as the request, not as gevent's server function
 * (issue 16).  names is read_profile's (a new dict).  0 or -1. */
static int label_request_greenlet(PyObject *names, gqp_req *req)
{
    if (!PyDict_Check(names) || !req->gid || !PyLong_Check(req->gid) ||
        !req->method || !PyUnicode_Check(req->method) || !req->path ||
        !PyUnicode_Check(req->path)) {
        return 0;
    }
    PyObject *old = PyDict_GetItemWithError(names, req->gid);
    if (!old && PyErr_Occurred()) {
        return -1;
    }
    PyObject *fn = old && PyTuple_Check(old) && PyTuple_GET_SIZE(old) == 2
                       ? PyTuple_GET_ITEM(old, 1) : str_empty;
    PyObject *text = PyUnicode_FromFormat("%U %U", req->method, req->path);
    PyObject *pair = text ? PyTuple_Pack(2, text, fn) : NULL;
    int rc = pair ? PyDict_SetItem(names, req->gid, pair) : -1;
    Py_XDECREF(text);
    Py_XDECREF(pair);
    return rc;
}

static PyObject *build_profile(gqp_mw *mw, PyObject *tracer, gqp_req *req,
                               int snapshot, PyObject *calls)
{
    PyObject *top = PyLong_FromLong(8);
    PyObject *raw = NULL, *fields = NULL, *res = NULL;
    if (!top) {
        goto done;
    }
    PyObject *args[] = {req->addr, tracer, req->start_ns, req->end_ns, top,
                        snapshot ? Py_False : Py_True};
    raw = read_profile(NULL, args, 6);
    if (!raw) {
        goto done;
    }
    if (!PyTuple_Check(raw) || PyTuple_GET_SIZE(raw) < 13) {
        PyErr_SetString(PyExc_RuntimeError, "read_profile: bad result");
        goto done;
    }
    if (label_request_greenlet(PyTuple_GET_ITEM(raw, 11), req) < 0) {
        goto done;
    }
    long long start = PyLong_AsLongLong(req->start_ns);
    long long end = PyLong_AsLongLong(PyTuple_GET_ITEM(raw, 3));
    long long epoch0 = PyLong_AsLongLong(PyTuple_GET_ITEM(raw, 9));
    long long wall0 = PyLong_AsLongLong(PyTuple_GET_ITEM(raw, 10));
    if (PyErr_Occurred()) {
        goto done;
    }
    double shift = (double)(epoch0 - wall0);   /* ClockOrigin.to_epoch */
    PyObject *pid = PyObject_GetAttr((PyObject *)mw, str_pid);
    PyObject *loader = PyTuple_Pack(2, rp_loader, raw);
    struct { PyObject *k, *v; } kv[] = {
        {str_f_method, Py_XNewRef(req->method)},
        {str_f_path, Py_XNewRef(req->path)},
        {str_f_status, Py_XNewRef(req->status)},
        {str_f_start, PyFloat_FromDouble((shift + (double)start) * 1e-9)},
        {str_f_end, PyFloat_FromDouble((shift + (double)end) * 1e-9)},
        {str_f_wall, PyFloat_FromDouble((double)(end - start) * 1e-9)},
        {str_f_calls, Py_NewRef(calls)},
        {str_f_dropped_spans, Py_NewRef(PyTuple_GET_ITEM(raw, 7))},
        {str_f_dropped_calls, Py_NewRef(PyTuple_GET_ITEM(raw, 8))},
        {str_f_blocking, req->blocking && !snapshot
                             ? PySequence_List(req->blocking)
                             : PyList_New(0)},
        {str_f_clock, Py_XNewRef(mw->clock)},
        {str_f_sampled_by, Py_XNewRef(req->sampled_by)},
        {str_f_request_id, Py_XNewRef(req->request_id)},
        {str_f_pid, pid},
        {str_f_hostname, Py_XNewRef(mw->hostname)},
        {str_f_error, Py_XNewRef(req->error)},
        {str_loader, loader},
    };
    size_t n = sizeof kv / sizeof kv[0];
    /* The fields go into the new object's own dict.  (Installing a dict
     * made beforehand, PyObject_GenericSetDict, is not seen by attribute
     * reads on 3.13, which keeps a new object's values inline.) */
    PyObject *noargs = PyTuple_New(0);
    res = noargs ? PyBaseObject_Type.tp_new(rp_type, noargs, NULL) : NULL;
    Py_XDECREF(noargs);
    fields = res ? PyObject_GenericGetDict(res, NULL) : NULL;
    for (size_t i = 0; i < n; i++) {
        if (fields && (!kv[i].v ||
                       PyDict_SetItem(fields, kv[i].k, kv[i].v) < 0)) {
            Py_CLEAR(fields);
        }
        Py_XDECREF(kv[i].v);
    }
    if (!fields) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_RuntimeError, "a field of the profile is "
                            "missing");
        }
        Py_CLEAR(res);
        goto done;
    }
done:
    Py_XDECREF(top);
    Py_XDECREF(raw);
    Py_XDECREF(fields);
    return res;
}

/* _deliver for the common case (no text report, no profile files): the
 * sink; else Python's _deliver.  Errors are logged, never raised: 0; -1
 * for a BaseException that goes on (see internal_error). */
static int deliver(gqp_mw *mw, PyObject *profile)
{
    PyObject *report = PyObject_GetAttr((PyObject *)mw, str_report);
    PyObject *outputs = report ? PyObject_GetAttr((PyObject *)mw, str_outputs)
                               : NULL;
    int plain = outputs && outputs == Py_None && PyObject_IsTrue(report) == 0;
    Py_XDECREF(report);
    Py_XDECREF(outputs);
    PyErr_Clear();
    if (!plain) {
        PyObject *r = PyObject_CallMethodOneArg((PyObject *)mw, str_deliver,
                                                profile);
        int rc = r || internal_error(mw, str_finish_where) == 0 ? 0 : -1;
        Py_XDECREF(r);
        return rc;
    }
    PyObject *sink = PyObject_GetAttr((PyObject *)mw, str_sink);
    int rc = 0;
    if (sink && sink != Py_None) {
        PyObject *r = PyObject_CallOneArg(sink, profile);
        if (!r && internal_error(mw, str_sink_where) < 0) {
            rc = -1;
        }
        Py_XDECREF(r);
    }
    Py_XDECREF(sink);
    if (rc < 0) {
        return -1;
    }
    PyErr_Clear();
    count_stat(mw, str_delivered);
    return 0;
}

/* The armed thread state when req's _finalize can run here (in C), else
 * NULL: the common case of finish_here, with calls off. */
static gqp_py_thread *finalize_here(gqp_mw *mw, PyObject *eng, gqp_req *req)
{
    return rp_type && rp_loader && !mw->calls && eng == mw->armed_eng
           ? finish_here(mw, req) : NULL;
}

/* _finalize's end (Python's finally:): req is done with, and leaves the
 * engine's dicts.  Looked up again, since a sink ran Python.  An
 * exception set on entry stays set. */
static void finalize_forget(PyObject *eng, gqp_req *req)
{
    PyObject *value = PyErr_GetRaisedException();
    Py_XSETREF(req->greenlet, Py_NewRef(Py_None));
    PyObject *requests = PyObject_GetAttr(eng, str_requests_attr);
    PyObject *by_addr = PyObject_GetAttr(eng, str_profile_requests);
    forget_entry(requests, req->gid, (PyObject *)req);
    forget_entry(by_addr, req->addr, (PyObject *)req);
    Py_XDECREF(requests);
    Py_XDECREF(by_addr);
    PyErr_Clear();
    PyErr_SetRaisedException(value);
}

/* MiddlewareBase._finalize(engine, request): closes the request's profile,
 * builds its RequestProfile and delivers it, here for the common case
 * (this thread's armed engine, no observers, calls off), else through
 * Python's _finalize_py.  Once per request: the first call takes it on
 * (req.finalizing) before any Python runs, since a drain or a sink may
 * switch greenlets and flush() or the finisher then come for the same
 * request.  A BaseException raised in a drain or a sink (a
 * gevent.Timeout, GreenletExit) goes on once the request is released,
 * undelivered if it came before the sink. */
static PyObject *mw_finalize(gqp_mw *self, PyObject *const *args,
                             Py_ssize_t nargs)
{
    if (want_args(nargs, 2, "_finalize") < 0) {
        return NULL;
    }
    if (!PyObject_TypeCheck(args[1], &gqp_req_type)) {
        PyErr_SetString(PyExc_TypeError, "_finalize(engine, request)");
        return NULL;
    }
    gqp_req *req = (gqp_req *)args[1];
    if (!req->greenlet || req->greenlet == Py_None || req->finalizing) {
        Py_RETURN_NONE;   /* finalized (flush() before linger), or being */
    }
    req->finalizing = 1;
    PyObject *eng = args[0];
    Py_INCREF(req);
    Py_INCREF(eng);
    PyObject *stop = NULL;   /* a BaseException from the drain */
    gqp_py_thread *st = finalize_here(self, eng, req);
    if (st && PyList_GET_SIZE(reg_long) > 0) {
        /* Drained while the request is still registered, so its blocking
         * spans are named after it.  That ran Python: checked again. */
        PyObject *r = PyObject_CallMethodOneArg((PyObject *)self,
                                                str_drain_blocking, eng);
        if (!r && internal_error(self, str_finish_where) < 0) {
            stop = PyErr_GetRaisedException();
        }
        Py_XDECREF(r);
        st = finalize_here(self, eng, req);
    }
    PyObject *res = NULL;
    if (!st) {
        PyObject *fwd[] = {(PyObject *)self, eng, args[1]};
        res = PyObject_VectorcallMethod(str_finalize_py, fwd, 3, NULL);
        goto done;
    }
    PyObject *g = Py_NewRef(req->greenlet);
    gqp_profref *prof = (gqp_profref *)Py_NewRef(req->profile);
    /* No longer lingering: what g spawns from now on is not this
     * request's. */
    PyObject *k = PyLong_FromVoidPtr(g);
    PyObject *ling = k ? PyDict_GetItemWithError(self->lingering, k) : NULL;
    if (ling == (PyObject *)req && PyDict_DelItem(self->lingering, k) == 0 &&
        !is_dead(g)) {
        gqp_tracer_set_spawn_profile(st->tracer, (uint64_t)(uintptr_t)g,
                                     NULL);
    }
    Py_XDECREF(k);
    PyErr_Clear();
    if (prof->p && !gqp_profile_is_closed(prof->p)) {
        gqp_profile_close(prof->p);
    }
    profile_window(st, -1);
    if (self->open > 0) {
        self->open--;
    }
    int ok = 1;
    if (!stop) {
        PyObject *tracer = PyLong_FromVoidPtr(st->tracer);
        PyObject *profile = tracer
            ? build_profile(self, tracer, req, 0, Py_None) : NULL;
        Py_XDECREF(tracer);
        if (profile) {
            ok = deliver(self, profile) == 0;
            Py_DECREF(profile);
        } else {
            ok = internal_error(self, str_finish_where) == 0;
        }
    }
    finalize_forget(eng, req);
    Py_DECREF(prof);
    Py_DECREF(g);
    res = ok ? Py_NewRef(Py_None) : NULL;
done:
    if (stop) {
        Py_XDECREF(res);
        res = NULL;
        PyErr_SetObject((PyObject *)Py_TYPE(stop), stop);
        Py_DECREF(stop);
    }
    Py_DECREF(eng);
    Py_DECREF(req);
    return res;
}

/* _registry.finish_pending(engine, pending, now): one pass of the
 * engine's finisher over its queue of (middleware, request): requests
 * whose greenlets are all done, or whose linger ran out, are finalized;
 * the others stay queued.  Items queued meanwhile (a sink may switch) are
 * looked at in the same pass. */
static PyObject *finish_pending_py(PyObject *self, PyObject *const *args,
                                   Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 3 || !PyList_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError,
                        "finish_pending(engine, pending list, now)");
        return NULL;
    }
    PyObject *pending = args[1];
    long long now = PyLong_AsLongLong(args[2]);
    if (now == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *waiting = PyList_New(0);
    if (!waiting) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(pending); i++) {
        PyObject *item = Py_NewRef(PyList_GET_ITEM(pending, i));
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2 ||
            !PyObject_TypeCheck(PyTuple_GET_ITEM(item, 0), &gqp_mw_type) ||
            !PyObject_TypeCheck(PyTuple_GET_ITEM(item, 1), &gqp_req_type)) {
            Py_DECREF(item);
            continue;   /* (only this file queues) */
        }
        gqp_mw *mw = (gqp_mw *)PyTuple_GET_ITEM(item, 0);
        gqp_req *req = (gqp_req *)PyTuple_GET_ITEM(item, 1);
        int wait = 0;
        if (req->greenlet && req->greenlet != Py_None && !req->finalizing &&
            req->profile &&
            PyObject_TypeCheck(req->profile, &gqp_profref_type) &&
            ((gqp_profref *)req->profile)->p &&
            gqp_profile_attached(((gqp_profref *)req->profile)->p) > 0 &&
            req->end_ns && PyLong_Check(req->end_ns)) {
            long long end = PyLong_AsLongLong(req->end_ns);
            PyErr_Clear();
            wait = now < end + mw->linger_ns;
        }
        if (wait) {
            if (PyList_Append(waiting, item) < 0) {
                Py_DECREF(item);
                Py_DECREF(waiting);
                return NULL;
            }
        } else {
            PyObject *fargs[] = {args[0], (PyObject *)req};
            PyObject *r = mw_finalize(mw, fargs, 2);
            if (!r && internal_error(mw, str_finish_where) < 0) {
                /* A BaseException (the finisher killed) goes on; what
                 * this pass did not look at stays queued. */
                Py_DECREF(item);
                PyObject *value = PyErr_GetRaisedException();
                for (Py_ssize_t j = i + 1; j < PyList_GET_SIZE(pending);
                     j++) {
                    if (PyList_Append(waiting,
                                      PyList_GET_ITEM(pending, j)) < 0) {
                        break;
                    }
                }
                PyErr_Clear();
                PyList_SetSlice(pending, 0, PyList_GET_SIZE(pending),
                                waiting);
                Py_DECREF(waiting);
                PyErr_Clear();
                PyErr_SetRaisedException(value);
                return NULL;
            }
            Py_XDECREF(r);
        }
        Py_DECREF(item);
    }
    int rc = PyList_SetSlice(pending, 0, PyList_GET_SIZE(pending), waiting);
    Py_DECREF(waiting);
    if (rc < 0) {
        return NULL;
    }
    return PyBool_FromLong(PyList_GET_SIZE(pending) > 0);
}

/* MiddlewareBase._build_profile(tracer, request, snapshot, calls): the
 * Python path's way to build_profile (_build). */
static PyObject *mw_build_profile(gqp_mw *self, PyObject *const *args,
                                  Py_ssize_t nargs)
{
    if (want_args(nargs, 4, "_build_profile") < 0) {
        return NULL;
    }
    if (!PyObject_TypeCheck(args[1], &gqp_req_type) || !rp_type ||
        !rp_loader) {
        PyErr_SetString(PyExc_TypeError, "_build_profile wants a Request "
                        "(after _finalize_setup)");
        return NULL;
    }
    int snapshot = PyObject_IsTrue(args[2]);
    if (snapshot < 0) {
        return NULL;
    }
    return build_profile(self, args[0], (gqp_req *)args[1], snapshot,
                         args[3]);
}

/* _finalize_setup(RequestProfile, request_records, clock, hostname) */
static PyObject *mw_finalize_setup(gqp_mw *self, PyObject *const *args,
                                   Py_ssize_t nargs)
{
    if (nargs != 4 || !PyType_Check(args[0]) || !PyCallable_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "_finalize_setup(RequestProfile, "
                        "loader, clock, hostname)");
        return NULL;
    }
    Py_XSETREF(rp_type, (PyTypeObject *)Py_NewRef(args[0]));
    Py_XSETREF(rp_loader, Py_NewRef(args[1]));
    Py_XSETREF(self->clock, Py_NewRef(args[2]));
    Py_XSETREF(self->hostname, Py_NewRef(args[3]));
    Py_RETURN_NONE;
}

/* _registry.set_spawn_profile(tracer, greenlet, profile): greenlets that
 * greenlet spawns from now on inherit the profile at that address (0:
 * none).  Without cffi, which would release the GIL.  GQP_OK or a
 * negative GQP_E* code. */
static PyObject *set_spawn_profile_py(PyObject *self, PyObject *const *args,
                                      Py_ssize_t nargs)
{
    (void)self;
    if (want_args(nargs, 3, "set_spawn_profile") < 0) {
        return NULL;
    }
    gqp_tracer *t = (gqp_tracer *)PyLong_AsVoidPtr(args[0]);
    gqp_profile *p = (gqp_profile *)PyLong_AsVoidPtr(args[2]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    int rc = t ? gqp_tracer_set_spawn_profile(t, (uint64_t)(uintptr_t)args[1],
                                              p)
               : GQP_EINVAL;
    return PyLong_FromLong(rc);
}

/* ---- the middleware's counters of open profiles ------------------------- */

/* _open_acquire(): one more sampled profile open, if max_open allows. */
static PyObject *mw_open_acquire(gqp_mw *self, PyObject *unused)
{
    (void)unused;
    if (self->open >= self->max_open) {
        Py_RETURN_FALSE;
    }
    self->open++;
    Py_RETURN_TRUE;
}

static PyObject *mw_open_release(gqp_mw *self, PyObject *unused)
{
    (void)unused;
    if (self->open > 0) {
        self->open--;
    }
    Py_RETURN_NONE;
}

static PyObject *mw_get_open(gqp_mw *self, void *closure)
{
    (void)closure;
    return PyLong_FromLong(self->open);
}

static int mw_set_open(gqp_mw *self, PyObject *value, void *closure)
{
    (void)closure;
    long v = value ? PyLong_AsLong(value) : -1;
    if (v < 0 || v > INT_MAX) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError,
                            "_open must be from 0 to INT_MAX");
        }
        return -1;
    }
    self->open = (int)v;
    return 0;
}

static PyMethodDef profile_window_def = {
    "profile_window", (PyCFunction)(void (*)(void))profile_window_py,
    METH_FASTCALL, "profile_window(hooks, delta) (internal)."};
static PyMethodDef cpu_windows_def = {
    "cpu_windows", (PyCFunction)(void (*)(void))cpu_windows_py,
    METH_FASTCALL, "cpu_windows(profiling_ns, idle_ns) (internal)."};
static PyMethodDef set_spawn_profile_def = {
    "set_spawn_profile", (PyCFunction)(void (*)(void))set_spawn_profile_py,
    METH_FASTCALL, "set_spawn_profile(tracer, greenlet, profile) (internal)."};
static PyMethodDef finish_pending_def = {
    "finish_pending", (PyCFunction)(void (*)(void))finish_pending_py,
    METH_FASTCALL, "finish_pending(engine, pending, now) (internal)."};
static PyMethodDef new_profile_def = {
    "new_profile", (PyCFunction)(void (*)(void))new_profile_py,
    METH_FASTCALL, "new_profile(type, max_spans) (internal)."};

/* Registers this file's types and functions in _registry.  0 or -1. */
static int gqp_py_sampled_init(PyObject *reg)
{
    struct { PyObject **s; const char *v; } strs[] = {
        {&str_finish, "_finish"}, {&str_finalize, "_finalize"},
        {&str_drain_blocking, "_drain_blocking"},
        {&str_finisher_woken, "finisher_woken"},
        {&str_wake_finisher_soon, "_wake_finisher_soon"},
        {&str_sampled, "sampled"}, {&str_empty, ""}, {&str_close, "close"},
        {&str_finish_where, "finish"}, {&str_finalize_py, "_finalize_py"},
        {&str_deliver, "_deliver"}, {&str_report, "report"},
        {&str_sink, "sink"}, {&str_outputs, "_outputs"}, {&str_pid, "pid"},
        {&str_delivered, "delivered"}, {&str_sink_where, "sink"},
        {&str_loader, "_loader"}, {&str_f_method, "method"},
        {&str_f_path, "path"}, {&str_f_status, "status"},
        {&str_f_start, "start"}, {&str_f_end, "end"}, {&str_f_wall, "wall"},
        {&str_f_calls, "calls"}, {&str_f_dropped_spans, "dropped_spans"},
        {&str_f_dropped_calls, "dropped_calls"},
        {&str_f_blocking, "blocking"}, {&str_f_clock, "clock"},
        {&str_f_sampled_by, "sampled_by"}, {&str_f_request_id, "request_id"},
        {&str_f_pid, "pid"}, {&str_f_hostname, "hostname"},
        {&str_f_error, "error"},
    };
    for (size_t i = 0; i < sizeof strs / sizeof strs[0]; i++) {
        if (!*strs[i].s &&
            !(*strs[i].s = PyUnicode_InternFromString(strs[i].v))) {
            return -1;
        }
    }
    struct { PyTypeObject *t; const char *name; } types[] = {
        {&gqp_profref_type, "ProfileRef"}, {&gqp_req_type, "Request"},
        {&gqp_startresp_type, "StartResponse"},
        {&gqp_iterbody_type, "ClosingIterator"},
        {&gqp_seqbody_type, "ClosingSequence"},
    };
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        if (PyType_Ready(types[i].t) < 0 ||
            PyObject_SetAttrString(reg, types[i].name,
                                   (PyObject *)types[i].t) < 0) {
            return -1;
        }
    }
    PyMethodDef *defs[] = {&profile_window_def, &cpu_windows_def,
                           &new_profile_def, &set_spawn_profile_def,
                           &finish_pending_def};
    for (size_t i = 0; i < sizeof defs / sizeof defs[0]; i++) {
        PyObject *fn = PyCFunction_New(defs[i], NULL);
        int rc = fn ? PyObject_SetAttrString(reg, defs[i]->ml_name, fn) : -1;
        Py_XDECREF(fn);
        if (rc < 0) {
            return -1;
        }
    }
    return 0;
}
