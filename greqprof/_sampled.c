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

/* _registry.open_profiles(hooks): sampled profiles open in that thread,
 * as the CPU window counts them (tests). */
static PyObject *open_profiles_py(PyObject *self, PyObject *arg)
{
    (void)self;
    gqp_py_thread *st = (gqp_py_thread *)PyLong_AsVoidPtr(arg);
    if (PyErr_Occurred()) {
        return NULL;
    }
    return PyLong_FromLong(st ? st->open_profiles : 0);
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

/* Sets a RuntimeError as _lowlevel's LibraryError words it; NULL. */
static PyObject *lib_error(const char *what, int rc)
{
    PyErr_Format(PyExc_RuntimeError, "%s failed: %s (%s)", what,
                 gqp_strerror(rc), gqp_err_name(rc));
    return NULL;
}

/* A new profile for one request, as an instance of type (ProfileRef or a
 * subclass), its calls timed with `clock` (GQP_CLOCK_*); NULL with an
 * exception set. */
static PyObject *profref_make(PyTypeObject *type, size_t max_spans,
                              int clock)
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
        return lib_error("gqp_profile_new", GQP_ENOMEM);
    }
    int rc = gqp_profile_set(self->p, GQP_PROFILE_CALL_CLOCK, clock);
    if (rc != GQP_OK) {
        Py_DECREF(self);
        return lib_error("gqp_profile_set", rc);
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
    return profref_make((PyTypeObject *)args[0], (size_t)max_spans,
                        GQP_CLOCK_TRACER);
}

/* ---- Request ------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    PyObject *greenlet, *gid, *profile, *addr, *method, *path, *status,
        *start_ns, *end_ns, *request_id, *sampled_by, *error, *done,
        *blocking, *observed, *generation, *engine, *notes, *truncated,
        *owner, *route, *stack_route;
    PyObject *weakrefs;
    char finalizing;   /* set when a _finalize takes the request on */
    char counted_trigger;   /* its slot is one of the trigger reserve */
    char has_slot;          /* it holds a slot (released once) */
    char end_seen;          /* observers heard of its response's end */
    gqp_py_thread *st;      /* the hooks of the thread it began in ... */
    uint64_t st_gen;        /* ... as they were then */
    /* Lingering: the start of its greenlet's span split off when the
     * response ended (0: unknown); while that span runs, the greenlet has
     * not switched since (end_lingering). */
    int64_t ling_span;
    char seen_queued;       /* a finisher pass saw it queued */
} gqp_req;

static void routes_sampled(gqp_mw *mw, gqp_req *req, PyObject *profile);

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
    REQ_FIELD(notes, "The app's notes (current_profile().note), or None."),
    REQ_FIELD(truncated, "True when closed by max_lifetime."),
    REQ_FIELD(owner, "The middleware that profiles it."),
    REQ_FIELD(route, "Its route, once the response ended (_routes.c)."),
    REQ_FIELD(stack_route, "The route the app named while it runs, for "
              "the stack sampler (_hooks/sampler.c)."),
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
    Py_VISIT(self->notes);
    Py_VISIT(self->truncated);
    Py_VISIT(self->owner);
    Py_VISIT(self->route);
    Py_VISIT(self->stack_route);
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
    Py_CLEAR(self->notes);
    Py_CLEAR(self->truncated);
    Py_CLEAR(self->owner);
    Py_CLEAR(self->route);
    Py_CLEAR(self->stack_route);
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

#define GQP_MAX_ERROR 1000       /* characters of an error text kept */
#define GQP_MAX_STATUS 200       /* characters of a status kept */

static void open_release(gqp_mw *self, int trigger);
static int is_trigger(gqp_req *req);
static void finalize_forget(PyObject *eng, gqp_req *req);

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
    if (!msg) {
        PyErr_Clear();   /* (an unprintable message: the type alone) */
        msg = value ? PyType_GetName(Py_TYPE(value)) : NULL;
    }
    if (msg && PyUnicode_GET_LENGTH(msg) > GQP_MAX_ERROR) {
        Py_SETREF(msg, PyUnicode_Substring(msg, 0, GQP_MAX_ERROR));
    }
    msg = clean_text_take(msg);
    if (msg) {
        Py_XSETREF(req->error, msg);
    }
    PyErr_Clear();
    PyErr_SetRaisedException(value);
}

/* ---- finishing a request ------------------------------------------------ */

static PyObject *str_open_profile;
static PyObject *str_skipped_full, *str_observe_begin, *str_observe_end,
    *str_observe_profile, *str_calls_of, *str_acquire_calls,
    *str_release_calls, *str_abandoned;
static PyObject *str_finish, *str_finalize, *str_drain_blocking,
    *str_finisher_woken, *str_wake_finisher_soon, *str_sampled, *str_empty,
    *str_close, *str_status_kw, *str_wake_from_thread,
    *str_finish_where, *str_let_children_start, *str_hub, *str_loop,
    *str_callbacks, *str_callback, *str_dunder_len;

/* The hooks of the thread req began in, when that is the calling thread
 * and they are still the same (not after a fork, not uninstalled): its
 * tracer may then be used for req.  Else NULL. */
static gqp_py_thread *req_state(gqp_req *req)
{
    gqp_py_thread *st = req->st;
    if (!st || st != gqp__tls || st->gen != req->st_gen || !st->active ||
        !st->tracer || !req->greenlet || req->greenlet == Py_None) {
        return NULL;
    }
    return st;
}

static int has_profile(gqp_req *req)
{
    return req->profile && PyObject_TypeCheck(req->profile, &gqp_profref_type)
           && ((gqp_profref *)req->profile)->p;
}

/* eng.abandoned (a forked child's copy, or an engine shut down); an
 * error counts as abandoned. */
static int engine_abandoned(PyObject *eng)
{
    PyObject *v = eng ? PyObject_GetAttr(eng, str_abandoned) : NULL;
    int r = v ? PyObject_IsTrue(v) : 1;
    Py_XDECREF(v);
    PyErr_Clear();
    return r != 0;
}

/* The engine's dict or list `name`, the armed one when eng is mw's armed
 * engine (no lookup); a new reference or NULL. */
static PyObject *engine_part(gqp_mw *mw, PyObject *eng, PyObject *armed,
                             PyObject *name)
{
    if (eng == mw->armed_eng && armed) {
        return Py_NewRef(armed);
    }
    return PyObject_GetAttr(eng, name);
}

/* The slot of req comes back (once). */
static void req_release_slot(gqp_mw *mw, gqp_req *req)
{
    if (req->has_slot) {
        req->has_slot = 0;
        open_release(mw, req->counted_trigger);
    }
}

static PyObject *mw_finalize(gqp_mw *self, PyObject *const *args,
                             Py_ssize_t nargs);

/* Calls mw.<name>(req) (a Python hook of the lifecycle); 0, or -1 with a
 * BaseException set that goes on (an Exception is logged). */
static int lifecycle_hook(gqp_mw *mw, PyObject *name, gqp_req *req)
{
    PyObject *r = PyObject_CallMethodOneArg((PyObject *)mw, name,
                                            (PyObject *)req);
    if (!r) {
        return internal_error(mw, str_finish_where);
    }
    Py_DECREF(r);
    return 0;
}

/* The open profile greenlet g (of st's thread) is attached to, or NULL. */
static gqp_profile *greenlet_profile(gqp_py_thread *st, PyObject *g)
{
    gqp_profile *p = NULL;
    if (!st->tracer || gqp_tracer_greenlet_profile(
            st->tracer, (uint64_t)(uintptr_t)g, &p) != GQP_OK) {
        return NULL;
    }
    return p;
}

/* req's greenlet (of st's thread) is still in req's profile: a late
 * finish (the body collected, or closed elsewhere, while the greenlet
 * already serves its next request) must leave it where it is now.  (A
 * dead greenlet's spans are over: attaching it would make the tracer a
 * new entry for it.) */
static int req_owns_greenlet(gqp_py_thread *st, gqp_req *req)
{
    return has_profile(req) && !is_dead(req->greenlet) &&
           greenlet_profile(st, req->greenlet) ==
               ((gqp_profref *)req->profile)->p;
}

/* The response of req is done (closed, collected, or the app raised):
 * its greenlet leaves the profile, observers hear of it, and the profile
 * is finalized now (linger 0) or queued for the engine's finisher.  Every
 * request, whatever the options, ends here.  0, or -1 with a
 * BaseException set (raised in a hook) that goes on once req is queued or
 * finalized. */
/* req, finished in a thread other than its own, goes back to its
 * engine's queue, and that thread's finisher is woken: it detaches the
 * greenlet (its tracer is that thread's) before the greenlet's next
 * request records into the profile, tells the observers, and finalizes
 * it.  -1 when it cannot (the engine abandoned: a forked child's copy,
 * or its thread gone, which released it). */
static int queue_for_owner(gqp_mw *mw, gqp_req *req, PyObject *eng)
{
    if (!eng || engine_abandoned(eng)) {
        return -1;
    }
    PyObject *pending = PyObject_GetAttr(eng, str_pending);
    PyObject *item = PyTuple_Pack(2, (PyObject *)mw, (PyObject *)req);
    int rc = pending && item && PyList_Check(pending) &&
             PyList_Append(pending, item) == 0 ? 0 : -1;
    Py_XDECREF(pending);
    Py_XDECREF(item);
    PyErr_Clear();
    if (rc == 0) {
        PyObject *r = PyObject_CallMethodOneArg((PyObject *)mw,
                                                str_wake_from_thread, eng);
        Py_XDECREF(r);
        PyErr_Clear();
    }
    return rc;
}

static int req_finish_in(gqp_mw *mw, gqp_req *req, int later);

static int req_finish(gqp_mw *mw, gqp_req *req)
{
    return req_finish_in(mw, req, 0);
}

/* later: req's body, dropped without close(), was freed by the cyclic
 * collector: what would run Python now (observers, the profile's
 * delivery, the blocking drain) goes to its thread's finisher, as for a
 * request finished from another thread.  The collector runs where an allocation (3.12+: the eval loop)
 * lets it, in the middle of any code, greqprof's own too: a pass over a
 * table, a lock held. */
static int req_finish_in(gqp_mw *mw, gqp_req *req, int later)
{
    if (req->done == Py_True) {
        if (req->truncated == Py_True && !req->end_seen && mw->observers &&
            req->st) {
            if (req->st != gqp__tls) {
                /* (its thread's finisher tells the observers) */
                queue_for_owner(mw, req, req->engine);
                return 0;
            }
            /* Closed by max_lifetime while it went on: observers still
             * hear of its response's end (their span is open until
             * then), without a snapshot. */
            req->end_seen = 1;
            return lifecycle_hook(mw, str_observe_end, req);
        }
        return 0;
    }
    PyObject *end = PyLong_FromLongLong((long long)gqp_clock_wall_ns());
    if (!end) {
        return -1;
    }
    Py_XSETREF(req->done, Py_NewRef(Py_True));
    Py_XSETREF(req->end_ns, end);
    PyObject *eng = req->engine && req->engine != Py_None
                        ? Py_NewRef(req->engine) : NULL;
    gqp_py_thread *st = req_state(req);
    int sampled = has_profile(req);
    if (later && st && eng && (sampled || mw->observers)) {
        if (req_owns_greenlet(st, req)) {
            /* (what the greenlet runs from now on is not this request's;
             * the finisher would detach it too, later) */
            attach_greenlet(st, req->greenlet, NULL);
            PyErr_Clear();
        }
        if (queue_for_owner(mw, req, eng) == 0) {
            Py_DECREF(eng);
            return 0;
        }
        /* (no finisher to take it, its engine abandoned: finished here
         * after all, its slot released) */
    }
    if (!st || !eng) {
        /* Not in the thread (or the process) it began in: a forked
         * child's copy is the parent's to report; another thread's goes
         * back to its engine, whose finisher (or reaper) finalizes it,
         * and tells the observers.  (Before: an observed request
         * without a profile was dropped here, left in its engine for
         * good, and observers never heard of its end.) */
        int rc = sampled || mw->observers ? queue_for_owner(mw, req, eng)
                                          : -1;
        if (rc < 0) {
            Py_XSETREF(req->greenlet, Py_NewRef(Py_None));
        }
        Py_XDECREF(eng);
        return 0;
    }
    gqp_profile *p = sampled ? ((gqp_profref *)req->profile)->p : NULL;
    int own = req_owns_greenlet(st, req);
    if (own) {
        /* Later spans of this greenlet (the next keep-alive request) are
         * not this request's; greenlets it spawned still are. */
        attach_greenlet(st, req->greenlet, NULL);
    }
    PyObject *stop = NULL;   /* a BaseException to pass on */
    if (mw->observers) {
        /* Observers (OpenTelemetry) see the end of the response while
         * their span is open: Python's hook, which also drains. */
        req->end_seen = 1;
        if (lifecycle_hook(mw, str_observe_end, req) < 0) {
            stop = PyErr_GetRaisedException();
        }
    }
    int rc = 0;
    if (!sampled) {
        /* (an observed request without a profile: done with) */
        finalize_forget(eng, req);
    } else if (!mw->linger) {
        PyObject *fargs[] = {eng, (PyObject *)req};
        PyObject *r = mw_finalize(mw, fargs, 2);
        rc = r ? 0 : -1;
        Py_XDECREF(r);
    } else {
        /* Wait (up to linger) for the greenlets it spawned: the engine's
         * finisher greenlet finalizes it. */
        PyObject *lingering = engine_part(mw, eng, mw->lingering,
                                          str_lingering);
        PyObject *pending = engine_part(mw, eng, mw->pending, str_pending);
        uint64_t key = (uint64_t)(uintptr_t)req->greenlet;
        if (own) {
            /* (a greenlet gone on to another request spawns for that one) */
            gqp_tracer_set_spawn_profile(st->tracer, key, p);
            /* The span its detach began, if it is the one running: while
             * it goes on, the greenlet has not switched (end_lingering). */
            int64_t since = 0;
            uint64_t rid = 0;
            req->ling_span =
                gqp_tracer_running_since(st->tracer, &since, &rid) == GQP_OK
                && req->gid && PyLong_Check(req->gid) &&
                rid == (uint64_t)gqp_long_as_ll(req->gid) ? since : 0;
        }
        PyObject *k = PyLong_FromVoidPtr(req->greenlet);
        PyObject *item = k ? PyTuple_Pack(2, (PyObject *)mw, (PyObject *)req)
                           : NULL;
        /* Queued first: a request lingering but not queued would never be
         * finalized. */
        rc = item && pending && PyList_Check(pending) &&
             PyList_Append(pending, item) == 0 ? 0 : -1;
        if (rc == 0 && own && lingering && PyDict_Check(lingering) &&
            PyDict_SetItem(lingering, k, (PyObject *)req) < 0) {
            rc = -1;   /* (queued: finalized all the same, not lingering) */
        }
        if (rc < 0 && own) {
            gqp_tracer_set_spawn_profile(st->tracer, key, NULL);
        }
        Py_XDECREF(k);
        Py_XDECREF(item);
        Py_XDECREF(lingering);
        Py_XDECREF(pending);
        if (rc == 0 && PyList_GET_SIZE(reg_long) > 0 && !mw->observers) {
            /* Blocking spans reported when the request ends, named after
             * it (it stays registered until it is finalized). */
            PyObject *r = PyObject_CallMethodOneArg((PyObject *)mw,
                                                    str_drain_blocking, eng);
            if (!r && internal_error(mw, str_finish_where) < 0 && !stop) {
                /* A BaseException (a handler that waited) goes on, once
                 * the finisher is woken: queued but never woken, the
                 * request would wait for the next one. */
                stop = PyErr_GetRaisedException();
            }
            Py_XDECREF(r);
        }
        if (rc == 0) {
            PyObject *woken = PyObject_GetAttr(eng, str_finisher_woken);
            int is_woken = woken ? PyObject_IsTrue(woken) : -1;
            Py_XDECREF(woken);
            if (is_woken == 0) {
                PyObject *r = PyObject_CallMethodOneArg(
                    (PyObject *)mw, str_wake_finisher_soon, eng);
                is_woken = r ? 1 : -1;
                Py_XDECREF(r);
                /* The wake-up is queued after the start callbacks of the
                 * children it spawned: the finisher's first look at it is
                 * after their first switch (finish_pending_py). */
                req->seen_queued = is_woken > 0;
            }
            rc = is_woken < 0 ? -1 : 0;
        }
    }
    Py_DECREF(eng);
    if (stop) {
        PyErr_SetRaisedException(stop);
        return -1;
    }
    return rc;
}

/* req_finish for the body wrappers and the app-raised path: an error in
 * greqprof never reaches the app (Python's _finish logs its own).  A
 * BaseException raised meanwhile (a gevent.Timeout that fired in a sink)
 * goes on: -1 with it set, unless an exception was already on its way,
 * which then wins. */
static int req_finish_quiet_in(gqp_mw *mw, gqp_req *req, int later)
{
    PyObject *value = PyErr_GetRaisedException();
    if (req_finish_in(mw, req, later) < 0 &&
        internal_error(mw, str_finish_where) < 0) {
        if (!value) {
            return -1;
        }
        PyErr_Clear();
    }
    PyErr_SetRaisedException(value);
    return 0;
}

static int req_finish_quiet(gqp_mw *mw, gqp_req *req)
{
    return req_finish_quiet_in(mw, req, 0);
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
 * calls the server's with the same arguments, positional or keywords
 * (status=, headers= or PEP 3333's response_headers=, exc_info=): the
 * server checks them as it would without greqprof. */
static PyObject *startresp_call(gqp_startresp *self, PyObject *args,
                                PyObject *kwargs)
{
    PyObject *st = PyTuple_GET_SIZE(args) > 0 ? PyTuple_GET_ITEM(args, 0)
                   : kwargs && PyDict_Check(kwargs)
                       ? PyDict_GetItemWithError(kwargs, str_status_kw)
                       : NULL;
    PyErr_Clear();
    /* (held: cleaning the status may run Python) */
    Py_XINCREF(st);
    Py_INCREF(args);
    Py_XINCREF(kwargs);
    if (st && self->req) {
        /* The status as clean text: a bytes status is latin-1 (WSGI). */
        PyObject *text = PyBytes_Check(st)
            ? PyUnicode_DecodeLatin1(PyBytes_AS_STRING(st),
                                     PyBytes_GET_SIZE(st), NULL)
            : str_cut(st, GQP_MAX_STATUS);
        if (text && PyUnicode_GET_LENGTH(text) > GQP_MAX_STATUS) {
            Py_SETREF(text, PyUnicode_Substring(text, 0, GQP_MAX_STATUS));
        }
        text = clean_text_take(text);
        if (text && self->req) {
            Py_XSETREF(self->req->status, text);
        } else {
            Py_XDECREF(text);
            PyErr_Clear();   /* (never the app's error) */
        }
    }
    Py_XDECREF(st);
    PyObject *r = PyObject_Call(self->start_response, args, kwargs);
    Py_DECREF(args);
    Py_XDECREF(kwargs);
    return r;
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
    char freed;         /* finalized by its dealloc (its last reference
                           dropped), not by the cyclic collector */
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

/* Set while the cyclic collector runs (gc_phase, in gc.callbacks): a body
 * freed by its last reference then may be freed by the collector's
 * clearing of a cycle that held it, in the middle of any code too. */
static int gc_running;

/* _registry.gc_phase(phase, info): gc.callbacks' callback (collections
 * are rare: a request's garbage goes by reference counts). */
static PyObject *gc_phase_py(PyObject *self, PyObject *const *args,
                             Py_ssize_t nargs)
{
    (void)self;
    if (nargs >= 1 && PyUnicode_Check(args[0])) {
        gc_running = PyUnicode_CompareWithASCIIString(args[0], "start") == 0;
    }
    Py_RETURN_NONE;
}

static PyMethodDef gc_phase_def = {
    "gc_phase", (PyCFunction)(void (*)(void))gc_phase_py, METH_FASTCALL,
    "gc_phase(phase, info) (internal: gc.callbacks)."};

/* The body is collected: a server (or a buffering middleware) that drops
 * it without close() still ends the request, so its open-profile slot
 * comes back. */
static void body_finalize(gqp_body *self)
{
    if (!self->mw || !self->req || self->req->done == Py_True) {
        return;
    }
    PyObject *exc = PyErr_GetRaisedException();
    /* Its last reference dropped (by the server, a buffering middleware)
     * it finishes here, as a close() would; the cyclic collector, which
     * runs in the middle of any code, leaves the Python part for later,
     * also when what it freed held the body's last reference. */
    if (req_finish_quiet_in(self->mw, self->req,
                            !self->freed || gc_running) < 0) {
        PyErr_Clear();   /* (nobody to pass a BaseException on to) */
    }
    PyErr_SetRaisedException(exc);
}

static void body_dealloc(gqp_body *self)
{
    self->freed = 1;
    if (PyObject_CallFinalizerFromDealloc((PyObject *)self) < 0) {
        return;   /* resurrected by the finalizer */
    }
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
    .tp_finalize = (destructor)body_finalize,
};

/* A sized body (a list, a tuple, anything with __len__): sized like the
 * app's (servers use len() for Content-Length) and re-iterable. */
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
    .tp_finalize = (destructor)body_finalize,
};

/* 1 when a server would take `result` for a sized body: pywsgi asks
 * hasattr(result, "__len__") (and sums the lengths of its chunks, so it
 * iterates it twice), other servers len().  Such a body must go back
 * sized, or it loses its Content-Length.  (An error from the lookup, a
 * __getattr__ that raises, answers 0.) */
static int body_is_sized(PyObject *result)
{
    PyTypeObject *tp = Py_TYPE(result);
    if ((tp->tp_as_sequence && tp->tp_as_sequence->sq_length) ||
        (tp->tp_as_mapping && tp->tp_as_mapping->mp_length)) {
        return 1;
    }
    if (tp->tp_getattro == PyObject_GenericGetAttr) {
        return 0;   /* (a generator, an iterator: no AttributeError made) */
    }
    PyObject *v = PyObject_GetAttr(result, str_dunder_len);
    if (v) {
        Py_DECREF(v);
        return 1;
    }
    PyErr_Clear();
    return 0;
}

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
    b->freed = 0;
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
    PyObject *result = call_app(mw, environ, (PyObject *)sr);
    Py_DECREF(sr);
    if (!result) {
        req_note_error(req, 0);
        req_finish_quiet(mw, req);
        return NULL;
    }
    gqp_body *b;
    if (body_is_sized(result)) {
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

/* environ[key] as a new reference, NULL when missing (any mapping; an
 * exact dict without a Python call). */
static PyObject *environ_get(PyObject *environ, PyObject *key)
{
    PyObject *v;
    if (PyDict_Check(environ)) {
        v = PyDict_GetItemWithError(environ, key);
        Py_XINCREF(v);
    } else {
        v = PyObject_GetItem(environ, key);
    }
    PyErr_Clear();
    return v;
}

/* str(environ[key])[:max], cleaned, "" when missing; NULL with an
 * exception set.  (The value is held while its __str__ runs.) */
static PyObject *environ_str(PyObject *environ, PyObject *key, Py_ssize_t max)
{
    PyObject *v = environ_get(environ, key);
    if (!v) {
        return Py_NewRef(str_empty);
    }
    PyObject *r = str_cut(v, max);
    Py_DECREF(v);
    return r;
}

/* One more profile slot for a request sampled by `trigger` or not:
 * SLOT_OPEN (one of max_open), SLOT_RESERVE (a trigger request's own
 * reserve, taken first), or 0 (none free).  A trigger request falls back
 * to an ordinary slot when its reserve is full: the reserve is in
 * addition to max_open, never a cap on trigger requests. */
#define SLOT_OPEN 1
#define SLOT_RESERVE 2
static int slot_acquire(gqp_mw *self, int trigger)
{
    if (trigger && self->trigger_open < GQP_TRIGGER_SLOTS) {
        self->trigger_open++;
        return SLOT_RESERVE;
    }
    if (self->open >= self->max_open) {
        return 0;
    }
    self->open++;
    return SLOT_OPEN;
}

/* Undoes open_request's registration of req (a hook raised): its profile
 * closed and dropped, its slot back.  The exception set stays set. */
static void request_unregister(gqp_mw *self, gqp_py_thread *st,
                               gqp_req *req, int calls_acquired)
{
    PyObject *exc = PyErr_GetRaisedException();
    if (has_profile(req) && !req->finalizing) {
        /* (finalized meanwhile, by max_lifetime while an observer's
         * on_begin waited: the window and the call hook are given back
         * already) */
        if (st == gqp__tls && st->active && st->tracer) {
            attach_greenlet(st, req->greenlet, NULL);
            profile_window(st, -1);
        }
        gqp_profile *p = ((gqp_profref *)req->profile)->p;
        if (!gqp_profile_is_closed(p)) {
            gqp_profile_close(p);
        }
        if (calls_acquired) {
            PyObject *r = PyObject_CallMethodNoArgs(req->engine,
                                                    str_release_calls);
            Py_XDECREF(r);
        }
    }
    req_release_slot(self, req);
    Py_XSETREF(req->done, Py_NewRef(Py_True));
    if (req->engine) {
        finalize_forget(req->engine, req);
    }
    PyErr_SetRaisedException(exc);
}

/* Begins a request for the running greenlet of st (this thread's armed
 * hooks): sampled_by is "pct", "trigger" or None (seen by observers
 * only).  A sampled request takes a slot (max_open, or the trigger
 * reserve; else it is counted in skipped_full and goes unsampled), a new
 * profile, the narrowed CPU window, its greenlet attached; with calls,
 * the call hook (the engine's acquire_calls); observers hear of it
 * (_observe_begin).  Every profiled or observed request begins here.
 * Returns the new request; NULL and no exception when it is not
 * followed (the app then runs unprofiled); NULL with an exception (a
 * BaseException from an observer) to pass on. */
static gqp_req *open_request(gqp_mw *self, gqp_py_thread *st,
                             PyObject *environ, PyObject *sampled_by)
{
    int sampled = sampled_by != Py_None;
    int trigger = sampled && sampled_by != str_pct &&
                  PyUnicode_Check(sampled_by) &&
                  PyUnicode_CompareWithASCIIString(sampled_by, "trigger") == 0;
    if (!self->profile_type || st != armed_state(self)) {   /* (armed_eng too) */
        return NULL;
    }
    /* This thread's engine, taken now, while self is armed for it: the
     * code below may run Python (an environ value's str(), a garbage
     * collection's finalizers), during which another thread serving the
     * same middleware may arm it for itself.  The request is this
     * thread's whatever self is armed for by then.  (Before: it was
     * dropped, unprofiled and unlogged, when that happened.) */
    PyObject *eng = Py_NewRef(self->armed_eng);
    PyObject *requests = Py_NewRef(self->requests);
    PyObject *by_addr = Py_NewRef(self->profile_requests);
    long fork_gen = self->armed_fork_gen;
    uint64_t st_gen = st->gen;
    int slot = 0;
    if (sampled) {
        slot = slot_acquire(self, trigger);
        if (!slot) {
            count_stat(self, str_skipped_full);
            sampled = 0;
            sampled_by = Py_None;
        }
    }
    if (!sampled && !self->observers) {
        goto not_followed;
    }
    gqp_req *req = PyObject_GC_New(gqp_req, &gqp_req_type);
    if (!req) {
        PyErr_Clear();
        if (slot) {
            open_release(self, slot == SLOT_RESERVE);
        }
        goto not_followed;
    }
    memset((char *)req + sizeof(PyObject), 0,
           sizeof(gqp_req) - sizeof(PyObject));
    PyObject_GC_Track(req);
    req->has_slot = slot != 0;
    req->counted_trigger = slot == SLOT_RESERVE;
    PyObject *rid = environ_get(environ, str_rid_key);
    if (rid && PyObject_IsTrue(rid) == 1) {
        req->request_id = str_cut(rid, GQP_NOTE_MAX_RID);
    } else {
        req->request_id = Py_NewRef(Py_None);
    }
    Py_XDECREF(rid);
    PyErr_Clear();
    req->method = environ_str(environ, str_method_key, GQP_NOTE_MAX_METHOD);
    req->path = environ_str(environ, str_path_key, GQP_NOTE_MAX_PATH);
    /* (mounted: named by SCRIPT_NAME + PATH_INFO, as routes() counts it,
     * until the app names it) */
    req->stack_route = rt_mounted_route(self->routes, environ);
    req->profile = sampled ? profref_make(self->profile_type, self->max_spans,
                                          self->call_clock)
                           : Py_NewRef(Py_None);
    if (!req->request_id || !req->method || !req->path || !req->profile) {
        goto fail;
    }
    /* The running greenlet, as greenlet knows it (the tracer's idea of it
     * would be stale if another tool replaced the switch hook: the attach
     * below then names this one), and this thread's hooks still running
     * (str() of an environ value runs code, which may stop them). */
    PyObject *g = PyObject_CallNoArgs(greenlet_getcurrent);
    if (!g || st != gqp__tls || !st->active || !st->tracer ||
        st->gen != st_gen) {
        Py_XDECREF(g);
        goto fail;
    }
    uint64_t key = (uint64_t)(uintptr_t)g;
    Py_DECREF(g);   /* (the running greenlet is alive: req takes a ref) */
    req->start_ns = PyLong_FromLongLong((long long)gqp_clock_wall_ns());
    req->blocking = PyList_New(0);
    req->generation = PyLong_FromLong(fork_gen);
    req->observed = self->observers ? PyList_New(0) : Py_NewRef(Py_None);
    if (!req->start_ns || !req->blocking || !req->generation ||
        !req->observed) {
        goto fail;
    }
    int64_t gid;
    gqp_profile *p = NULL;
    if (sampled) {
        p = ((gqp_profref *)req->profile)->p;
        /* The CPU window narrows before the attach, whose reading of the
         * CPU clock opens the profile's first span: that reading is then
         * fresh (at most one narrow window old), not an estimate made
         * while the thread may have been off CPU for up to the idle
         * window. */
        profile_window(st, 1);
        gid = attach_greenlet(st, g, p);
        if (gid <= 0) {
            if (gid == 0) {
                attach_greenlet(st, g, NULL);
            }
            lib_error("gqp_tracer_attach", gid < 0 ? (int)gid : GQP_ENOMEM);
            goto fail_window;
        }
    } else {
        uint64_t id = 0;
        gqp_tracer_greenlet_id(st->tracer, key, &id);
        gid = (int64_t)(id & INT64_MAX);
    }
    req->gid = gid > 0 ? PyLong_FromLongLong(gid) : Py_NewRef(Py_None);
    req->addr = p ? PyLong_FromVoidPtr(p) : Py_NewRef(Py_None);
    if (!req->gid || !req->addr ||
        (gid > 0 && PyDict_SetItem(requests, req->gid,
                                   (PyObject *)req) < 0)) {
        if (p) {
            attach_greenlet(st, g, NULL);
        }
        goto fail_window;
    }
    if (p && PyDict_SetItem(by_addr, req->addr, (PyObject *)req) < 0) {
        attach_greenlet(st, g, NULL);
        PyDict_DelItem(requests, req->gid);
        goto fail_window;
    }
    Py_DECREF(requests);
    Py_DECREF(by_addr);
    req->greenlet = Py_NewRef(g);
    req->engine = eng;
    req->owner = Py_NewRef((PyObject *)self);
    req->sampled_by = Py_NewRef(sampled_by);
    req->status = Py_NewRef(Py_None);
    req->error = Py_NewRef(Py_None);
    req->done = Py_NewRef(Py_False);
    req->end_ns = Py_NewRef(Py_None);
    req->st = st;
    req->st_gen = st->gen;
    int calls_acquired = 0;
    if (p && self->calls) {
        /* The call hook is on while a sampled request wants calls. */
        PyObject *r = PyObject_CallMethodNoArgs(eng, str_acquire_calls);
        if (!r) {
            internal_error(self, str_begin);
            request_unregister(self, st, req, 0);
            PyErr_Clear();
            Py_DECREF(req);
            return NULL;
        }
        Py_DECREF(r);
        calls_acquired = 1;
    }
    if (self->observers) {
        PyObject *r = PyObject_CallMethodOneArg((PyObject *)self,
                                                str_observe_begin,
                                                (PyObject *)req);
        if (!r) {
            /* (a GreenletExit or Timeout in an observer that waited: the
             * request never runs, and releases what it took) */
            request_unregister(self, st, req, calls_acquired);
            Py_DECREF(req);
            return NULL;
        }
        Py_DECREF(r);
    }
    if (p) {
        /* (counted once it runs: not when an observer stopped it) */
        count_stat(self, str_sampled);
    }
    return req;
fail_window:
    if (p) {
        profile_window(st, -1);
    }
fail:
    /* (logged once and counted, like every internal error; the request
     * runs unprofiled) */
    if (PyErr_Occurred() && internal_error(self, str_open_profile) < 0) {
        PyErr_Clear();
    }
    req_release_slot(self, req);
    Py_DECREF(req);
not_followed:
    Py_DECREF(eng);
    Py_DECREF(requests);
    Py_DECREF(by_addr);
    return NULL;
}

/* The C path's sampled request (the draw said: sample): begun here when
 * the thread is armed, else by Python's _call_slow (which sets the
 * thread up). */
static PyObject *sampled_call(gqp_mw *self, gqp_py_thread *st,
                              PyObject *environ, PyObject *start_response)
{
    if (!st) {
        PyObject *args[] = {(PyObject *)self, environ, start_response,
                            str_pct};
        return PyObject_VectorcallMethod(str_call_slow, args, 4, NULL);
    }
    gqp_req *req = open_request(self, st, environ, str_pct);
    if (!req) {
        if (PyErr_Occurred()) {
            return NULL;
        }
        /* Not sampled after all (max_open reached) */
        if (self->blocking && (st = armed_state(self))) {
            note_unsampled(self, st, environ);
        }
        return call_app(self, environ, start_response);
    }
    PyObject *r = run_profiled(self, req, environ, start_response);
    Py_DECREF(req);
    return r;
}

/* Whether self already has a request open (its response not done) on the
 * running greenlet: called only for an environ that self marked already
 * (an internal forward to the root app with the same environ), which then
 * passes through instead of being profiled twice.  When self is armed for
 * another thread (one serving the same middleware ran meanwhile), Python
 * looks in this thread's engine: rare, and before anything begins.
 * (Before: the forward was then profiled again, a second profile.) */
static int reentered(gqp_mw *self)
{
    gqp_py_thread *st = armed_state(self);
    uint64_t id = 0;
    if (!st || !self->requests) {
        PyObject *r = PyObject_CallMethodNoArgs((PyObject *)self,
                                                str_reentered_here);
        int yes = r ? PyObject_IsTrue(r) : 0;
        Py_XDECREF(r);
        PyErr_Clear();
        return yes > 0;
    }
    if (gqp_tracer_current(st->tracer, NULL, &id, NULL) != GQP_OK) {
        return 0;
    }
    PyObject *k = PyLong_FromUnsignedLongLong(id);
    PyObject *r = k ? PyDict_GetItemWithError(self->requests, k) : NULL;
    Py_XDECREF(k);
    PyErr_Clear();
    return r && PyObject_TypeCheck(r, &gqp_req_type) &&
           ((gqp_req *)r)->owner == (PyObject *)self &&
           ((gqp_req *)r)->done != Py_True;
}

/* MiddlewareBase._reentered(): reentered() for Python's _call_slow. */
static PyObject *mw_reentered(gqp_mw *self, PyObject *unused)
{
    (void)unused;
    return PyBool_FromLong(reentered(self));
}

/* _registry.greenlet_profile(tracer, greenlet): the address of the open
 * profile greenlet is attached to, 0 when none (or unseen). */
static PyObject *greenlet_profile_py(PyObject *self, PyObject *const *args,
                                     Py_ssize_t nargs)
{
    (void)self;
    if (want_args(nargs, 2, "greenlet_profile") < 0) {
        return NULL;
    }
    gqp_tracer *t = (gqp_tracer *)PyLong_AsVoidPtr(args[0]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    gqp_profile *p = NULL;
    if (t && gqp_tracer_greenlet_profile(t, (uint64_t)(uintptr_t)args[1],
                                         &p) != GQP_OK) {
        p = NULL;
    }
    return PyLong_FromVoidPtr(p);
}

/* MiddlewareBase._begin_request(environ, sampled_by, hooks_address,
 * engine, fork_generation): Python's policy decided (the trigger header,
 * a draw, observers): the request begins in open_request, on this
 * thread's hooks.  self is armed for them here (as _arm does), with no
 * Python run in between: a middleware shared by several threads may have
 * been armed by another one since Python's _join.  (Before: the request
 * then went unprofiled, with nothing logged.)  The Request, or None when
 * it is not followed. */
static PyObject *mw_begin_request(gqp_mw *self, PyObject *const *args,
                                  Py_ssize_t nargs)
{
    if (want_args(nargs, 5, "_begin_request") < 0) {
        return NULL;
    }
    gqp_py_thread *st = NULL;
    for (int i = 0; i < 2 && !st; i++) {
        /* (twice at most: armed() runs Python only the first time, when
         * the greenlet yields before its next request, end_lingering) */
        PyObject *ok = mw_arm(self, args + 2, 3);
        if (!ok) {
            return NULL;
        }
        Py_DECREF(ok);
        st = armed(self);
        if (!st && PyErr_Occurred()) {
            return NULL;
        }
    }
    gqp_req *req = st ? open_request(self, st, args[0], args[1]) : NULL;
    if (!req) {
        if (PyErr_Occurred()) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    return (PyObject *)req;
}

/* ---- a greenlet's next request ------------------------------------------ */

/* The running greenlet (key) begins a request while its previous sampled
 * one (in lingering) still waits for its children: from now on what it
 * spawns is the new request's, and so are its blocking spans.  The
 * children it spawned for the previous one are that one's, but a child
 * joins a profile when it first runs: when the greenlet went straight on
 * (HTTP pipelining: no switch since that response ended), their start
 * callbacks may still be queued in the hub's loop (the next request was
 * read at once: pipelined, or sent by a fast client while the response
 * was closed).  The greenlet then yields once (mw._let_children_start:
 * what a request read from the socket does anyway) so that they start,
 * and join the previous profile, first: only when one of them does wait
 * (child_waits_to_start), which a request that joined its children, the
 * common case, never has.
 * 0, or -1 with a BaseException delivered to the greenlet while it
 * yielded (GreenletExit, a Timeout: the caller passes it on); Python may
 * have run: the caller looks its armed state up again. */
/* Whether a greenlet that g spawned waits in the loop of eng's hub for
 * its first switch: gevent starts a greenlet from a loop callback bound
 * to its switch, so a callback bound to a greenlet this tracer has never
 * seen run, whose spawning_greenlet is g.  Nothing but C runs here (the
 * callbacks of every gevent loop, libev or libuv, C or cffi, are an
 * iterable _callbacks).  1 when it cannot tell. */
static int child_waits_to_start(gqp_py_thread *st, PyObject *eng,
                                PyObject *g)
{
    PyObject *hub = PyObject_GetAttr(eng, str_hub);
    PyObject *loop = hub && hub != Py_None ? PyObject_GetAttr(hub, str_loop)
                                           : NULL;
    PyObject *cbs = loop ? PyObject_GetAttr(loop, str_callbacks) : NULL;
    PyObject *it = cbs && greenlet_type &&
                   (PyList_Check(cbs) || PyObject_TypeCheck(cbs, &PyTuple_Type)
                    || strcmp(Py_TYPE(cbs)->tp_name, "collections.deque") == 0
                    || strcmp(Py_TYPE(cbs)->tp_name,
                              "gevent.libev.corecext.CallbackFIFO") == 0)
                   ? PyObject_GetIter(cbs) : NULL;
    Py_XDECREF(loop);
    Py_XDECREF(hub);
    if (!it) {
        Py_ssize_t n = cbs ? PyObject_Length(cbs) : -1;
        Py_XDECREF(cbs);
        PyErr_Clear();
        return n != 0;
    }
    Py_DECREF(cbs);
    int found = 0;
    PyObject *cb;
    while (!found && (cb = PyIter_Next(it))) {
        PyObject *fn = PyObject_GetAttr(cb, str_callback);
        PyObject *target = fn && PyCFunction_Check(fn)
                               ? PyCFunction_GET_SELF(fn)
                               : fn && PyMethod_Check(fn) ? PyMethod_GET_SELF(fn)
                                                          : NULL;
        uint64_t id = 0;
        if (target && target != g && PyObject_TypeCheck(target, greenlet_type)
            && gqp_tracer_greenlet_id(st->tracer,
                                      (uint64_t)(uintptr_t)target,
                                      &id) != GQP_OK) {
            PyObject *ref = PyObject_GetAttr(target, spawning_str);
            PyObject *spawner = NULL;
            if (ref && PyWeakref_Check(ref) &&
                PyWeakref_GetRef(ref, &spawner) > 0) {
                found = spawner == g;
            }
            Py_XDECREF(spawner);
            Py_XDECREF(ref);
        }
        Py_XDECREF(fn);
        Py_DECREF(cb);
        PyErr_Clear();
    }
    Py_DECREF(it);
    PyErr_Clear();
    return found;
}

static int end_lingering(gqp_mw *mw, gqp_py_thread *st, PyObject *eng,
                         PyObject *lingering, PyObject *requests,
                         uint64_t key)
{
    PyObject *k = PyLong_FromUnsignedLongLong(key);
    PyObject *prev = k ? PyDict_GetItemWithError(lingering, k) : NULL;
    if (prev && PyObject_TypeCheck(prev, &gqp_req_type)) {
        gqp_req *r = (gqp_req *)prev;
        int64_t since = 0;
        uint64_t id = 0;
        if (r->ling_span && r->gid && PyLong_Check(r->gid) &&
            gqp_tracer_running_since(st->tracer, &since, &id) == GQP_OK &&
            since == r->ling_span &&
            id == (uint64_t)gqp_long_as_ll(r->gid) &&
            child_waits_to_start(st, eng, r->greenlet)) {
            r->ling_span = 0;   /* (once) */
            PyObject *res = PyObject_CallMethodNoArgs((PyObject *)mw,
                                                      str_let_children_start);
            if (!res && internal_error(mw, str_begin) < 0) {
                /* (a GreenletExit or Timeout delivered while it yielded:
                 * the greenlet's, which goes on) */
                Py_DECREF(k);
                return -1;
            }
            Py_XDECREF(res);
            if (!st_live(st)) {
                Py_DECREF(k);
                return 0;   /* (the hooks stopped meanwhile) */
            }
            /* (finalized meanwhile, if its children were quick) */
            prev = PyDict_GetItemWithError(lingering, k);
        }
    }
    if (!prev) {
        Py_XDECREF(k);
        return PyErr_Occurred() ? -1 : 0;
    }
    Py_INCREF(prev);
    int rc = PyDict_DelItem(lingering, k);
    if (rc == 0) {
        gqp_tracer_set_spawn_profile(st->tracer, key, NULL);
        forget_request_of(requests, prev);
    } else {
        PyErr_Clear();   /* (out of memory: it lingers on) */
        rc = 0;
    }
    Py_DECREF(prev);
    Py_DECREF(k);
    return rc;
}

/* MiddlewareBase._end_lingering(hooks_address, engine, greenlet): Python's
 * policy begins a request on the running greenlet (end_lingering). */
static PyObject *mw_end_lingering(gqp_mw *self, PyObject *const *args,
                                  Py_ssize_t nargs)
{
    if (want_args(nargs, 3, "_end_lingering") < 0) {
        return NULL;
    }
    gqp_py_thread *st = (gqp_py_thread *)PyLong_AsVoidPtr(args[0]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (!st || st != gqp__tls || !st->active || !st->tracer) {
        Py_RETURN_NONE;   /* (not this thread's hooks) */
    }
    PyObject *lingering = PyObject_GetAttr(args[1], str_lingering);
    PyObject *requests = lingering ? PyObject_GetAttr(args[1],
                                                      str_requests_attr)
                                   : NULL;
    int rc = -1;
    if (requests && PyDict_Check(lingering) && PyDict_Check(requests)) {
        rc = end_lingering(self, st, args[1], lingering, requests,
                           (uint64_t)(uintptr_t)args[2]);
    } else if (requests) {
        PyErr_SetString(PyExc_TypeError,
                        "_end_lingering: the engine's containers are not "
                        "dicts");
    }
    Py_XDECREF(lingering);
    Py_XDECREF(requests);
    if (rc < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
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
    *str_f_pid, *str_f_hostname, *str_f_error, *str_f_notes,
    *str_f_truncated;


/* The RequestProfile of req (its response ended), from the profile of
 * tracer's thread.  Only what must be read now is read now, by
 * read_profile (_hooks.c): the profile's rows (its C memory goes once the
 * request is finalized), the stacks, the waiting time (the tracer's
 * history moves on) and the names; the public records (Span, ...) are
 * built from that when first read (_collect.request_records).  snapshot:
 * an open profile read for observers, its stacks left in place and
 * without blocking events.  calls: the function table or None.  A new
 * reference, or NULL with an exception set. */
/* "METHOD path" (what PyUnicode_FromFormat("%U %U") makes, without
 * parsing a format: this runs once per sampled request).  A new
 * reference, or NULL with an exception set. */
static PyObject *method_path_text(PyObject *method, PyObject *path)
{
#if PY_VERSION_HEX < 0x030C0000
    if (PyUnicode_READY(method) < 0 || PyUnicode_READY(path) < 0) {
        return NULL;
    }
#endif
    Py_ssize_t m = PyUnicode_GET_LENGTH(method);
    Py_ssize_t n = PyUnicode_GET_LENGTH(path);
    if (m > PY_SSIZE_T_MAX - 1 - n) {
        return PyErr_NoMemory();
    }
    Py_UCS4 maxc = PyUnicode_MAX_CHAR_VALUE(method);
    if (PyUnicode_MAX_CHAR_VALUE(path) > maxc) {
        maxc = PyUnicode_MAX_CHAR_VALUE(path);
    }
    PyObject *text = PyUnicode_New(m + 1 + n, maxc);
    if (!text) {
        return NULL;
    }
    int kind = PyUnicode_KIND(text);
    void *data = PyUnicode_DATA(text);
    /* (a part of the same width is copied as it is) */
    if (PyUnicode_KIND(method) == kind) {
        memcpy(data, PyUnicode_DATA(method), (size_t)m * (size_t)kind);
    } else if (PyUnicode_CopyCharacters(text, 0, method, 0, m) < 0) {
        Py_DECREF(text);
        return NULL;
    }
    PyUnicode_WRITE(kind, data, m, ' ');
    if (PyUnicode_KIND(path) == kind) {
        memcpy((char *)data + (size_t)(m + 1) * (size_t)kind,
               PyUnicode_DATA(path), (size_t)n * (size_t)kind);
    } else if (PyUnicode_CopyCharacters(text, m + 1, path, 0, n) < 0) {
        Py_DECREF(text);
        return NULL;
    }
    return text;
}

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
    PyObject *text = method_path_text(req->method, req->path);
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
    long long start = gqp_long_as_ll(req->start_ns);
    long long end = gqp_long_as_ll(PyTuple_GET_ITEM(raw, 3));
    long long epoch0 = gqp_long_as_ll(PyTuple_GET_ITEM(raw, 9));
    long long wall0 = gqp_long_as_ll(PyTuple_GET_ITEM(raw, 10));
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
        {str_f_notes, req->notes && PyList_Check(req->notes)
                          ? PyList_GetSlice(req->notes, 0,
                                            PyList_GET_SIZE(req->notes))
                          : PyList_New(0)},
        {str_f_truncated, Py_NewRef(req->truncated == Py_True ? Py_True
                                                              : Py_False)},
        {str_loader, loader},
    };
    size_t n = sizeof kv / sizeof kv[0];
    /* The fields are set on the new object as attributes.  (A dict made
     * beforehand and installed with PyObject_GenericSetDict is not seen
     * by attribute reads on 3.13, which keeps a new object's values
     * inline; setting them one by one also fills those inline values
     * without making a dict, on 3.11+.) */
    PyObject *noargs = PyTuple_New(0);
    res = noargs ? PyBaseObject_Type.tp_new(rp_type, noargs, NULL) : NULL;
    Py_XDECREF(noargs);
    int ok = res != NULL;
    for (size_t i = 0; i < n; i++) {
        if (ok && (!kv[i].v ||
                   PyObject_GenericSetAttr(res, kv[i].k, kv[i].v) < 0)) {
            ok = 0;
        }
        Py_XDECREF(kv[i].v);
    }
    if (!ok) {
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
 * builds its RequestProfile and delivers it; every profile ends here
 * (from the end of the response, the finisher, flush(), max_lifetime).
 * Python is called for what is the user's: function statistics (calls),
 * observers, and delivery other than a plain sink.  Once per request: the
 * first call takes it on (req.finalizing) before any Python runs, since a
 * drain or a sink may switch greenlets and flush() or the finisher then
 * come for the same request.  A BaseException raised in a drain or a sink
 * (a gevent.Timeout, GreenletExit) goes on once the request is released,
 * undelivered if it came before the sink.  A request of another thread
 * is left for its own (its tracer cannot be read here). */
/* req finished in another thread (or by the collector) and came back
 * to its own, where it is now: its greenlet leaves the profile (the other
 * thread could not use this thread's tracer) and observers hear of the
 * response's end, once, before anything is delivered.  The finisher's
 * pass does this first; a flush() or a thread's end that comes before it
 * finalizes the request itself (finalize: 1; not for a request that
 * max_lifetime truncates, whose observers hear of its end when it really
 * ends).  0, or -1 with a BaseException set. */
static int settle_foreign_finish(gqp_mw *mw, gqp_req *req, int finalize)
{
    if (req->done != Py_True ||
        (finalize && req->truncated == Py_True)) {
        return 0;
    }
    gqp_py_thread *rst = req_state(req);
    if (rst && req_owns_greenlet(rst, req)) {
        attach_greenlet(rst, req->greenlet, NULL);
        PyErr_Clear();
    }
    if (mw->observers && !req->end_seen && req->st == gqp__tls) {
        req->end_seen = 1;
        return lifecycle_hook(mw, str_observe_end, req);
    }
    return 0;
}

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
    PyObject *eng = req->engine && req->engine != Py_None ? req->engine
                                                          : args[0];
    gqp_py_thread *st = req_state(req);
    if (!st || !has_profile(req) || !rp_type || !rp_loader) {
        if (st || engine_abandoned(eng)) {
            /* (a forked child's copy of the parent's request, or no
             * profile: nothing to deliver here; an observed request
             * finished elsewhere still ends for its observers) */
            req->finalizing = 1;
            Py_INCREF(req);
            PyObject *stop = NULL;
            if (st && settle_foreign_finish(self, req, 1) < 0) {
                stop = PyErr_GetRaisedException();
            }
            req_release_slot(self, req);
            finalize_forget(eng, req);
            Py_DECREF(req);
            if (stop) {
                PyErr_SetRaisedException(stop);
                return NULL;
            }
        }
        Py_RETURN_NONE;
    }
    req->finalizing = 1;
    Py_INCREF(req);
    Py_INCREF(eng);
    PyObject *stop = NULL;   /* a BaseException from the drain */
    if (settle_foreign_finish(self, req, 1) < 0) {
        stop = PyErr_GetRaisedException();
    }
    if (PyList_GET_SIZE(reg_long) > 0) {
        /* Drained while the request is still registered, so its blocking
         * spans are named after it. */
        PyObject *r = PyObject_CallMethodOneArg((PyObject *)self,
                                                str_drain_blocking, eng);
        if (!r && internal_error(self, str_finish_where) < 0) {
            PyObject *e = PyErr_GetRaisedException();
            if (stop) {
                Py_DECREF(e);   /* (the first goes on) */
            } else {
                stop = e;
            }
        }
        Py_XDECREF(r);
    }
    PyObject *res = NULL;
    PyObject *g = Py_NewRef(req->greenlet);
    gqp_profref *prof = (gqp_profref *)Py_NewRef(req->profile);
    /* No longer lingering: what g spawns from now on is not this
     * request's.  (The drain ran Python: the hooks are looked at again.) */
    st = req_state(req);
    PyObject *lingering = engine_part(self, eng, self->lingering,
                                      str_lingering);
    PyObject *k = PyLong_FromVoidPtr(g);
    PyObject *ling = k && lingering && PyDict_Check(lingering)
                         ? PyDict_GetItemWithError(lingering, k) : NULL;
    if (ling == (PyObject *)req && PyDict_DelItem(lingering, k) == 0 &&
        st && !is_dead(g)) {
        gqp_tracer_set_spawn_profile(st->tracer, (uint64_t)(uintptr_t)g,
                                     NULL);
    }
    Py_XDECREF(k);
    Py_XDECREF(lingering);
    PyErr_Clear();
    if (prof->p && !gqp_profile_is_closed(prof->p)) {
        gqp_profile_close(prof->p);
    }
    if (st) {
        profile_window(st, -1);
    }
    req_release_slot(self, req);
    int ok = 1;
    PyObject *calls = NULL;
    if (self->calls) {
        /* The function table (Python: filtered of greqprof's own
         * frames), then the call hook off unless another request wants
         * it. */
        calls = PyObject_CallMethodOneArg((PyObject *)self, str_calls_of,
                                          (PyObject *)req);
        if (!calls) {
            ok = internal_error(self, str_finish_where) == 0;
        }
        PyObject *r = PyObject_CallMethodNoArgs(eng, str_release_calls);
        if (!r) {
            ok = internal_error(self, str_finish_where) == 0 && ok;
        }
        Py_XDECREF(r);
    }
    if (!stop && ok && st) {
        PyObject *tracer = PyLong_FromVoidPtr(st->tracer);
        PyObject *profile = tracer
            ? build_profile(self, tracer, req, 0, calls ? calls : Py_None)
            : NULL;
        Py_XDECREF(tracer);
        if (profile) {
            ok = deliver(self, profile) == 0;
            if (ok && self->routes) {
                routes_sampled(self, req, profile);
            }
            if (ok && self->observers) {
                PyObject *r = PyObject_CallMethodObjArgs(
                    (PyObject *)self, str_observe_profile, (PyObject *)req,
                    profile, NULL);
                ok = r || internal_error(self, str_finish_where) == 0;
                Py_XDECREF(r);
            }
            Py_DECREF(profile);
        } else {
            ok = internal_error(self, str_finish_where) == 0;
        }
    }
    Py_XDECREF(calls);
    finalize_forget(eng, req);
    Py_DECREF(prof);
    Py_DECREF(g);
    res = ok ? Py_NewRef(Py_None) : NULL;
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

/* finish_pending's pass stopped by a BaseException (set), which goes on:
 * the queue keeps what waits and what the pass did not finish (from
 * index `from` on). */
static PyObject *pass_stopped(PyObject *pending, PyObject *waiting,
                              Py_ssize_t from)
{
    PyObject *value = PyErr_GetRaisedException();
    for (Py_ssize_t j = from; j < PyList_GET_SIZE(pending); j++) {
        if (PyList_Append(waiting, PyList_GET_ITEM(pending, j)) < 0) {
            break;
        }
    }
    PyErr_Clear();
    PyList_SetSlice(pending, 0, PyList_GET_SIZE(pending), waiting);
    Py_DECREF(waiting);
    PyErr_Clear();
    PyErr_SetRaisedException(value);
    return NULL;
}

/* _registry.finish_pending(engine, pending, now): one pass of the
 * engine's finisher over its queue of (middleware, request): requests
 * whose greenlets are all done, or whose linger ran out, are finalized;
 * the others stay queued.  Items queued meanwhile (a sink may switch) are
 * looked at in the same pass.  1 when a request waits for greenlets
 * still running (the finisher comes back soon), 2 when requests wait only
 * for a first look (it comes back once the loop has run its callbacks),
 * else 0. */
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
    long long now = gqp_long_as_ll(args[2]);
    if (now == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *waiting = PyList_New(0);
    if (!waiting) {
        return NULL;
    }
    int children = 0;   /* a request waits for greenlets still running */
    int first_only = 0;   /* a request waits only for its first look */
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
        if (settle_foreign_finish(mw, req, 0) < 0) {
            Py_DECREF(item);   /* (it stays queued: finalized later) */
            return pass_stopped(pending, waiting, i);
        }
        int wait = 0;
        /* A request the finisher sees queued for the first time waits one
         * pass, unless it woke the finisher itself: the children it
         * spawned at its end may not have made their first switch (and
         * joined its profile) yet.  Their start callbacks were queued
         * before this pass ran, and the loop runs them before the
         * finisher's next pass (after its sleep).  A wake-up a request
         * queues comes after them, but a finisher awake already, or woken
         * by an earlier request, may run first.  (Before: such a request
         * was finalized with its children counted nowhere: a pipelined
         * request ending its connection.) */
        int first_look = !req->seen_queued;
        req->seen_queued = 1;
        int profiled = has_profile(req);
        int attached = profiled && gqp_profile_attached(
                                       ((gqp_profref *)req->profile)->p) > 0;
        if (req->greenlet && req->greenlet != Py_None && !req->finalizing &&
            profiled && (first_look || attached) &&
            req->end_ns && PyLong_Check(req->end_ns)) {
            long long end = gqp_long_as_ll(req->end_ns);
            PyErr_Clear();
            wait = now < end + mw->linger_ns;
            children |= wait && attached;
            first_only |= wait && !attached;
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
                return pass_stopped(pending, waiting, i + 1);
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
    return PyLong_FromLong(children ? 1 : first_only ? 2 : 0);
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
    int wall = PyUnicode_Check(args[2]) &&
               PyUnicode_CompareWithASCIIString(args[2], "wall") == 0;
    Py_XSETREF(self->clock, Py_NewRef(args[2]));
    Py_XSETREF(self->hostname, Py_NewRef(args[3]));
    /* (each middleware's own clock, whichever made the thread's tracer) */
    self->call_clock = wall ? GQP_CLOCK_WALL : GQP_CLOCK_CPU;
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

/* _open_acquire(trigger=False): one more sampled profile open, if
 * max_open allows; a trigger-header request takes one of its own reserve
 * of GQP_TRIGGER_SLOTS instead, so ordinary sampling holding every slot
 * (long streams) never refuses it. */
static PyObject *mw_open_acquire(gqp_mw *self, PyObject *const *args,
                                 Py_ssize_t nargs)
{
    int trigger = nargs > 0 ? PyObject_IsTrue(args[0]) : 0;
    if (trigger < 0) {
        return NULL;
    }
    if (trigger) {
        if (self->trigger_open >= GQP_TRIGGER_SLOTS) {
            Py_RETURN_FALSE;
        }
        self->trigger_open++;
        Py_RETURN_TRUE;
    }
    if (self->open >= self->max_open) {
        Py_RETURN_FALSE;
    }
    self->open++;
    Py_RETURN_TRUE;
}

/* The slot of req (sampled by the trigger header or not) comes back. */
static void open_release(gqp_mw *self, int trigger)
{
    if (trigger && self->trigger_open > 0) {
        self->trigger_open--;
    } else if (!trigger && self->open > 0) {
        self->open--;
    }
}

static int is_trigger(gqp_req *req)
{
    return req->sampled_by && req->sampled_by != str_pct &&
           PyUnicode_Check(req->sampled_by) &&
           PyUnicode_CompareWithASCIIString(req->sampled_by, "trigger") == 0;
}

/* _open_release(trigger=False) */
static PyObject *mw_open_release(gqp_mw *self, PyObject *const *args,
                                 Py_ssize_t nargs)
{
    int trigger = nargs > 0 ? PyObject_IsTrue(args[0]) : 0;
    if (trigger < 0) {
        return NULL;
    }
    open_release(self, trigger);
    Py_RETURN_NONE;
}

static PyObject *mw_get_open(gqp_mw *self, void *closure)
{
    (void)closure;
    return PyLong_FromLong(self->open + self->trigger_open);
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
    self->trigger_open = 0;
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
static PyMethodDef open_profiles_def = {
    "open_profiles", (PyCFunction)open_profiles_py, METH_O,
    "open_profiles(hooks) (internal)."};
static PyMethodDef greenlet_profile_def = {
    "greenlet_profile", (PyCFunction)(void (*)(void))greenlet_profile_py,
    METH_FASTCALL, "greenlet_profile(tracer, greenlet) (internal)."};
static PyMethodDef new_profile_def = {
    "new_profile", (PyCFunction)(void (*)(void))new_profile_py,
    METH_FASTCALL, "new_profile(type, max_spans) (internal)."};

/* _registry.unset_profiles(tracer): the tracer's default and session
 * profiles set to none, the GIL held all along: from a thread other than
 * the tracer's, this is ordered with its hooks (which hold the GIL), where
 * a cffi call would release it.  GQP_OK or a negative GQP_E* code. */
static PyObject *unset_profiles_py(PyObject *self, PyObject *arg)
{
    (void)self;
    gqp_tracer *t = (gqp_tracer *)PyLong_AsVoidPtr(arg);
    if (PyErr_Occurred()) {
        return NULL;
    }
    int rc = t ? gqp_tracer_set_session(t, NULL) : GQP_EINVAL;
    if (rc == GQP_OK) {
        rc = gqp_tracer_set_default(t, NULL);
    }
    return PyLong_FromLong(rc);
}

static PyMethodDef unset_profiles_def = {
    "unset_profiles", (PyCFunction)unset_profiles_py, METH_O,
    "unset_profiles(tracer) (internal)."};

/* Registers this file's types and functions in _registry.  0 or -1. */
static int gqp_py_sampled_init(PyObject *reg)
{
    struct { PyObject **s; const char *v; } strs[] = {
        {&str_finish, "_finish"}, {&str_finalize, "_finalize"},
        {&str_drain_blocking, "_drain_blocking"},
        {&str_finisher_woken, "finisher_woken"},
        {&str_wake_finisher_soon, "_wake_finisher_soon"},
        {&str_sampled, "sampled"}, {&str_empty, ""}, {&str_close, "close"},
        {&str_dunder_len, "__len__"},
        {&str_status_kw, "status"},
        {&str_wake_from_thread, "_wake_finisher_from_thread"},
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
        {&str_f_error, "error"}, {&str_f_notes, "notes"},
        {&str_f_truncated, "truncated"},
        {&str_skipped_full, "skipped_full"},
        {&str_observe_begin, "_observe_begin"},
        {&str_observe_end, "_observe_end"},
        {&str_observe_profile, "_observe_profile"},
        {&str_calls_of, "_calls_of"},
        {&str_acquire_calls, "acquire_calls"},
        {&str_release_calls, "release_calls"},
        {&str_abandoned, "abandoned"}, {&str_open_profile, "open profile"},
        {&str_let_children_start, "_let_children_start"},
        {&str_hub, "hub"}, {&str_loop, "loop"}, {&str_callbacks, "_callbacks"},
        {&str_callback, "callback"},
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
                           &finish_pending_def, &greenlet_profile_def,
                           &open_profiles_def, &unset_profiles_def,
                           &gc_phase_def};
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
