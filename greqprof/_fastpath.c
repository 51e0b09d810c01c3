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
 * engine is not set up yet) goes to the Python method `_call_slow`, told
 * when the draw here already said: sample.
 *
 * Notes: for each live greenlet that began a request on the C path (or
 * Python's unsampled path), that request's method, path and request id, so
 * that a blocking span can be named after its request.  A table of
 * GQP_NOTES slots indexed by greenlet id; a greenlet's note is replaced by
 * its next request and dropped when it dies.  Only the requests in flight
 * (and keep-alive connections' last ones) are held: holding thousands of
 * finished requests' strings instead measurably slowed every request (the
 * allocator hands out cold memory).  A long span takes its note when it
 * ends (on_long_span), from its greenlet or the nearest of its spawners,
 * found through live objects: nothing is kept per greenlet for that. */

#define GQP_NOTES 1024           /* a power of two */
#define GQP_TRIGGER_SLOTS 8      /* profiles of trigger requests, besides
                                    max_open (middleware.TRIGGER_SLOTS) */
#define GQP_NOTE_MAX_METHOD 32
#define GQP_NOTE_MAX_PATH 2048
#define GQP_NOTE_MAX_RID 200
#define GQP_NOTE_MAX_DEPTH 16    /* spawners walked up from a greenlet */

typedef struct gqp_note {
    uint64_t gid;
    PyObject *method, *path, *rid;   /* str or NULL */
    PyObject *route;   /* named by the app so far (_hooks/sampler.c) */
    int clean;                       /* cleaned already (note_find) */
    const void *serving;             /* the environ its middleware's app
                                        runs with now (identity only) */
    const void *mw;                  /* the middleware that serves it
                                        (identity only, never read) */
} gqp_note;

static void note_clear(gqp_note *n)
{
    n->gid = 0;
    n->serving = NULL;
    n->mw = NULL;
    Py_CLEAR(n->method);
    Py_CLEAR(n->path);
    Py_CLEAR(n->rid);
    Py_CLEAR(n->route);
}

/* ---- clean text (greqprof/_text.py, docs: the clean-text contract) ----
 * Text from the app, the environ or the interpreter is recorded printable:
 * _hooks.c's clean_text (printable ASCII as it is, no Python call;
 * anything else through greqprof._text.clean). */

/* clean_text for a reference it takes over: steals s (NULL passes on),
 * returns a new reference to an exact str, or NULL with an exception
 * set. */
static PyObject *clean_text_take(PyObject *s)
{
    if (!s) {
        return NULL;
    }
    PyObject *r = clean_text(s);
    Py_DECREF(s);
    if (r && !PyUnicode_CheckExact(r)) {
        Py_SETREF(r, PyUnicode_Check(r) ? PyUnicode_FromObject(r) : NULL);
        if (!r && !PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "clean() did not return a str");
        }
    }
    return r;
}

/* str(v)[:max] (bytes: as latin-1), cleaned: a new reference, or NULL
 * with an exception set.
 * v is held meanwhile (its __str__ may remove it from where it was
 * borrowed). */
static PyObject *str_cut(PyObject *v, Py_ssize_t max)
{
    if (PyBytes_Check(v)) {
        /* (bytes are latin-1 text, WSGI's rule, not their repr) */
        Py_ssize_t n = PyBytes_GET_SIZE(v);
        return clean_text_take(PyUnicode_DecodeLatin1(
            PyBytes_AS_STRING(v), n < max ? n : max, NULL));
    }
    Py_INCREF(v);
    PyObject *s = PyUnicode_CheckExact(v) ? Py_NewRef(v) : PyObject_Str(v);
    Py_DECREF(v);
    if (s && PyUnicode_GET_LENGTH(s) > max) {
        Py_SETREF(s, PyUnicode_Substring(s, 0, max));
    }
    return clean_text_take(s);
}

/* v if it is a str (cut to max characters, cleaned), else NULL; a new
 * reference (notes keep str only: str() of anything else could run
 * code). */
static PyObject *note_str(PyObject *v, Py_ssize_t max)
{
    if (!v || !PyUnicode_CheckExact(v)) {
        return NULL;
    }
    PyObject *cut = str_cut(v, max);
    err_clear();
    return cut;
}

/* v if it is an exact str, cut to max characters, uncleaned (note_find
 * cleans what it reads: most notes are never read); a new reference, or
 * NULL. */
static PyObject *note_raw(PyObject *v, Py_ssize_t max)
{
    if (!v || !PyUnicode_CheckExact(v)) {
        return NULL;
    }
    if (PyUnicode_GET_LENGTH(v) <= max) {
        return Py_NewRef(v);
    }
    PyObject *cut = PyUnicode_Substring(v, 0, max);
    err_clear();
    return cut;
}

/* Notes the request greenlet gid begins now (GIL held).  Out of memory:
 * nothing noted, the request just goes unnamed in a blocking report.
 * The arguments are the caller's references. */
static void note_set(gqp_py_thread *st, uint64_t gid, PyObject *method,
                     PyObject *path, PyObject *rid, const void *mw)
{
    if (!gid) {
        return;
    }
    if (!st->notes && !(st->notes = calloc(GQP_NOTES, sizeof *st->notes))) {
        return;
    }
    gqp_note *n = &st->notes[gid & (GQP_NOTES - 1)];
    /* (a new request: the route the app named for the last one goes) */
    PyObject *old[4] = {n->method, n->path, n->rid, n->route};
    if (n->gid != gid) {
        n->serving = NULL;
    }
    n->gid = gid;
    n->mw = mw;
    n->route = NULL;
    n->method = note_raw(method, GQP_NOTE_MAX_METHOD);
    n->path = note_raw(path, GQP_NOTE_MAX_PATH);
    n->rid = note_raw(rid, GQP_NOTE_MAX_RID);
    n->clean = 0;
    /* (last: freeing a str runs no code, but keep the slot whole first) */
    Py_XDECREF(old[0]);
    Py_XDECREF(old[1]);
    Py_XDECREF(old[2]);
    Py_XDECREF(old[3]);
}

/* Greenlet gid died: its note goes (GIL held). */
static void note_forget(gqp_py_thread *st, uint64_t gid)
{
    if (st->notes) {
        gqp_note *n = &st->notes[gid & (GQP_NOTES - 1)];
        if (n->gid == gid) {
            note_clear(n);
        }
    }
}

static void notes_free(gqp_py_thread *st)
{
    if (st->notes) {
        for (size_t i = 0; i < GQP_NOTES; i++) {
            note_clear(&st->notes[i]);
        }
        free(st->notes);
        st->notes = NULL;
    }
}

/* ---- the function a greenlet runs ---------------------------------------
 * A blocking span that ends with its greenlet (a child that blocked, then
 * returned) is reported after gevent dropped the Greenlet's _run, so its
 * function could no longer be named.  The function (not a bound method:
 * that would keep its object alive) of every new greenlet of a
 * middleware's thread is kept here until the greenlet dies: GQP_RUNS
 * slots by greenlet address, a collision replaces the older entry. */

#define GQP_RUNS 1024            /* a power of two */

typedef struct gqp_run {
    gqp_py_thread *st;
    uint64_t key;
    PyObject *fn;                /* a Python function, or NULL */
} gqp_run;

static gqp_run gqp_runs[GQP_RUNS];

static gqp_run *run_slot(uint64_t key)
{
    return &gqp_runs[(key >> 4 ^ key >> 14) & (GQP_RUNS - 1)];
}

static void run_remember(gqp_py_thread *st, PyObject *g, uint64_t key)
{
    PyObject **dictptr = _PyObject_GetDictPtr(g);
    if (!dictptr || !*dictptr || !PyDict_Check(*dictptr)) {
        return;
    }
    PyObject *run = PyDict_GetItemWithError(*dictptr, run_str);
    err_clear();
    PyObject *fn = run && PyMethod_Check(run) ? PyMethod_GET_FUNCTION(run)
                                              : run;
    if (!fn || !PyFunction_Check(fn)) {
        return;
    }
    gqp_run *r = run_slot(key);
    PyObject *old = r->fn;
    r->st = st;
    r->key = key;
    r->fn = Py_NewRef(fn);
    Py_XDECREF(old);   /* (last: a deallocation may run code) */
}

static void run_forget(gqp_py_thread *st, uint64_t key)
{
    gqp_run *r = run_slot(key);
    if (r->fn && r->st == st && r->key == key) {
        PyObject *old = r->fn;
        r->fn = NULL;
        r->st = NULL;
        r->key = 0;
        Py_DECREF(old);
    }
}

/* (name, fn_name) for a dead greenlet whose names lack the function,
 * with the function kept from its start; a new reference, or NULL. */
static PyObject *run_names(gqp_py_thread *st, uint64_t key, PyObject *names)
{
    gqp_run *r = run_slot(key);
    if (!r->fn || r->st != st || r->key != key) {
        return NULL;
    }
    PyObject *name = NULL;
    if (names && PyTuple_Check(names) && PyTuple_GET_SIZE(names) == 2) {
        PyObject *fn = PyTuple_GET_ITEM(names, 1);
        if (fn && PyUnicode_Check(fn) && PyUnicode_GET_LENGTH(fn) > 0) {
            return NULL;   /* (named already) */
        }
        /* (held: naming the function runs code, which may drop names) */
        name = Py_NewRef(PyTuple_GET_ITEM(names, 0));
    }
    PyObject *fn = Py_NewRef(r->fn);
    PyObject *fn_name = run_name(fn);
    Py_DECREF(fn);
    if (!fn_name) {
        Py_XDECREF(name);
        err_clear();
        return NULL;
    }
    PyObject *res = PyTuple_Pack(2, name ? name : Py_None, fn_name);
    Py_XDECREF(name);
    Py_DECREF(fn_name);
    err_clear();
    return res;
}

/* ("Greenlet", fn_name) of the live greenlet of st's thread whose tracer
 * id is id, by the function kept for it; a new reference, or NULL.  A scan
 * of the slots: made only for a greenlet a profile names that was never
 * named (read_profile's waiting top). */
static PyObject *run_names_of_id(gqp_py_thread *st, uint64_t id)
{
    for (size_t i = 0; i < GQP_RUNS; i++) {
        gqp_run *r = &gqp_runs[i];
        uint64_t rid = 0;
        if (r->fn && r->st == st &&
            gqp_tracer_greenlet_id(st->tracer, r->key, &rid) == GQP_OK &&
            rid == id) {
            PyObject *fn_name = run_name(r->fn);
            PyObject *res = fn_name ? Py_BuildValue("(sN)", "Greenlet",
                                                    fn_name) : NULL;
            err_clear();
            return res;
        }
    }
    return NULL;
}

static PyObject *or_none(PyObject *v)
{
    return v ? v : Py_None;   /* borrowed */
}

/* (gid, its spawner's id, that one's spawner's id, ...): gevent's
 * spawning_greenlet weak references, followed while the spawners live and
 * are known to the tracer.  A new reference, or NULL (GIL held). */
static PyObject *spawner_chain(gqp_py_thread *st, PyObject *g, uint64_t gid)
{
    PyObject *ids[GQP_NOTE_MAX_DEPTH];
    Py_ssize_t n = 0;
    PyObject *cur = Py_NewRef(g);
    while (gid && n < GQP_NOTE_MAX_DEPTH) {
        if (!(ids[n] = PyLong_FromUnsignedLongLong(gid))) {
            break;
        }
        n++;
        PyObject *ref = PyObject_GetAttr(cur, spawning_str);
        err_clear();
        PyObject *parent = NULL;
        if (ref && PyWeakref_Check(ref) &&
            PyWeakref_GetRef(ref, &parent) < 0) {
            err_clear();
        }
        Py_XDECREF(ref);
        gid = 0;
        if (parent && parent != Py_None && st->tracer) {
            gqp_tracer_greenlet_id(st->tracer, (uint64_t)(uintptr_t)parent,
                                   &gid);
        }
        Py_SETREF(cur, parent ? parent : Py_NewRef(Py_None));
    }
    Py_DECREF(cur);
    PyObject *chain = PyTuple_New(n);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (chain) {
            PyTuple_SET_ITEM(chain, i, ids[i]);
        } else {
            Py_DECREF(ids[i]);
        }
    }
    return chain;
}

/* Cleans the text of greenlet gid's note in place, once (GIL held).
 * Cleaning may run Python (greqprof._text.clean), which may replace the
 * note (or free the table) meanwhile: the cleaned text goes in only if the
 * note is still the same. */
static void note_clean(gqp_py_thread *st, uint64_t gid)
{
    gqp_note *n = &st->notes[gid & (GQP_NOTES - 1)];
    PyObject *raw[3] = {Py_XNewRef(n->method), Py_XNewRef(n->path),
                        Py_XNewRef(n->rid)};
    PyObject *m = note_str(raw[0], GQP_NOTE_MAX_METHOD);
    PyObject *p = note_str(raw[1], GQP_NOTE_MAX_PATH);
    PyObject *r = note_str(raw[2], GQP_NOTE_MAX_RID);
    n = st->notes ? &st->notes[gid & (GQP_NOTES - 1)] : NULL;
    if (n && n->gid == gid && n->method == raw[0] && n->path == raw[1] &&
        n->rid == raw[2]) {
        PyObject *old[3] = {n->method, n->path, n->rid};
        n->method = m;
        n->path = p;
        n->rid = r;
        n->clean = 1;
        m = old[0];
        p = old[1];
        r = old[2];
    }
    Py_XDECREF(m);
    Py_XDECREF(p);
    Py_XDECREF(r);
    for (int i = 0; i < 3; i++) {
        Py_XDECREF(raw[i]);
    }
}

/* (method, path, request_id, route, middleware) of the first noted
 * request along a spawner chain (route: the name the app gave it so far,
 * sampler_name, else None; middleware: the address of the one serving
 * it, so that only it reports the span, or None), or None; a new
 * reference (GIL held). */
static PyObject *note_find(gqp_py_thread *st, PyObject *chain)
{
    for (Py_ssize_t i = 0; st->notes && i < PyTuple_GET_SIZE(chain); i++) {
        uint64_t gid = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(chain, i));
        gqp_note *n = &st->notes[gid & (GQP_NOTES - 1)];
        if (n->gid == gid && !n->clean) {
            note_clean(st, gid);
            if (!st->notes) {
                break;
            }
            n = &st->notes[gid & (GQP_NOTES - 1)];
        }
        if (n->gid == gid) {
            PyObject *mw = n->mw ? PyLong_FromVoidPtr((void *)n->mw)
                                 : Py_NewRef(Py_None);
            PyObject *r = mw ? PyTuple_Pack(5, or_none(n->method),
                                            or_none(n->path), or_none(n->rid),
                                            or_none(n->route), mw)
                             : NULL;
            Py_XDECREF(mw);
            return r;
        }
    }
    err_clear();
    Py_RETURN_NONE;
}

/* The stack sampler's view (_hooks/sampler.c): the route named so far
 * (NULL: none yet) and the path of the first noted request along chain;
 * new references or NULL (GIL held). */
static void note_route_find(gqp_py_thread *st, PyObject *chain,
                            PyObject **route, PyObject **path)
{
    *route = *path = NULL;
    for (Py_ssize_t i = 0; st->notes && i < PyTuple_GET_SIZE(chain); i++) {
        uint64_t gid = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(chain, i));
        gqp_note *n = &st->notes[gid & (GQP_NOTES - 1)];
        if (n->gid == gid) {
            *route = Py_XNewRef(n->route);
            *path = Py_XNewRef(n->path);
            break;
        }
    }
    PyErr_Clear();
}

/* The app named the route of the request greenlet gid began (its own
 * note only, not a spawner's): 1 when it has one. */
static int note_name(gqp_py_thread *st, uint64_t gid, PyObject *name)
{
    gqp_note *n = st->notes ? &st->notes[gid & (GQP_NOTES - 1)] : NULL;
    if (!gid || !n || n->gid != gid) {
        return 0;
    }
    Py_XSETREF(n->route, Py_NewRef(name));
    return 1;
}

static gqp_py_thread *hooks_arg(PyObject *addr)
{
    gqp_py_thread *st = (gqp_py_thread *)PyLong_AsVoidPtr(addr);
    if (!st && !PyErr_Occurred()) {
        PyErr_SetString(PyExc_ValueError, "no hooks at address 0");
    }
    return st;
}

/* _registry.note(hooks, greenlet_id, method, path, request_id[,
 * middleware]): notes the request that greenlet begins now (the Python
 * path's twin of the C path's note). */
static PyObject *note_py(PyObject *self, PyObject *const *args,
                         Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 6 && want_args(nargs, 5, "note") < 0) {
        return NULL;
    }
    gqp_py_thread *st = hooks_arg(args[0]);
    uint64_t gid = st ? PyLong_AsUnsignedLongLong(args[1]) : 0;
    if (PyErr_Occurred()) {
        return NULL;
    }
    note_set(st, gid, args[2], args[3], args[4],
             nargs == 6 && args[5] != Py_None ? (const void *)args[5] : NULL);
    Py_RETURN_NONE;
}

/* _registry.request_note(hooks, greenlet): what a long span of that
 * greenlet would take if it ended now: ((method, path, request_id,
 * route) or None, spawner chain). */
static PyObject *request_note_py(PyObject *self, PyObject *const *args,
                                 Py_ssize_t nargs)
{
    (void)self;
    if (want_args(nargs, 2, "request_note") < 0) {
        return NULL;
    }
    gqp_py_thread *st = hooks_arg(args[0]);
    if (!st) {
        return NULL;
    }
    uint64_t gid = 0;
    if (st->tracer) {
        gqp_tracer_greenlet_id(st->tracer, (uint64_t)(uintptr_t)args[1], &gid);
    }
    PyObject *chain = spawner_chain(st, args[1], gid);
    PyObject *note = chain ? note_find(st, chain) : NULL;
    PyObject *r = note ? PyTuple_Pack(2, note, chain) : NULL;
    Py_XDECREF(note);
    Py_XDECREF(chain);
    return r;
}

/* Middlewares alive in the process: while there is one, and no sampled
 * profile is open in the thread, a request needs no environ mark (light):
 * no other middleware can be around it, and a request forwarded to its
 * middleware again only matters when it is sampled (reentered), which
 * marks its environ. */
static Py_ssize_t mw_live;

/* _registry.live_middlewares(): MiddlewareBase objects alive (tests: the
 * light path, see light_ok, runs while there is one). */
static PyObject *live_middlewares_py(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyLong_FromSsize_t(mw_live);
}

static PyMethodDef live_middlewares_def = {
    "live_middlewares", (PyCFunction)live_middlewares_py, METH_NOARGS,
    "live_middlewares() (internal)."};
static PyMethodDef note_def = {
    "note", (PyCFunction)(void (*)(void))note_py, METH_FASTCALL,
    "note(hooks, greenlet_id, method, path, request_id) (internal)."};
static PyMethodDef request_note_def = {
    "request_note", (PyCFunction)(void (*)(void))request_note_py,
    METH_FASTCALL, "request_note(hooks, greenlet) (internal)."};

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
    int deferred;            /* found inside another greqprof middleware */
    int observers;           /* observers are told of every request */
    /* Sampled requests (_sampled.c): */
    int calls;               /* calls=True: Python begins them */
    int linger;              /* linger > 0: the finisher finalizes */
    long long linger_ns;
    int max_open, open;      /* sampled profiles open at once: cap, count */
    int trigger_open;        /* those of trigger requests (own reserve) */
    size_t max_spans;
    int call_clock;          /* its profiles' GQP_PROFILE_CALL_CLOCK: the
                                engine's tracer is shared by every
                                middleware of the thread */
    PyTypeObject *profile_type;   /* _lowlevel.RequestRawProfile */
    PyObject *clock, *hostname;   /* fields of every RequestProfile */
    /* Armed for one thread's engine (set by Python's _arm): */
    gqp_py_thread *armed_st;
    uint64_t armed_gen;
    long armed_fork_gen;     /* engine.fork_generation() then */
    PyObject *armed_eng;     /* the engine; its containers: */
    PyObject *lingering, *requests, *profile_requests, *pending;
    PyObject *routes;        /* RouteCounts (_routes.c), or NULL */
    long long n_requests;    /* requests counted in C, not yet folded
                                into stats['requests'] (stats_fold) */
} gqp_mw;

/* _sampled.c */
static PyObject *sampled_call(gqp_mw *self, gqp_py_thread *st,
                              PyObject *environ, PyObject *start_response);
static PyObject *mw_call_profiled(gqp_mw *self, PyObject *const *args,
                                  Py_ssize_t nargs);
static PyObject *mw_begin_request(gqp_mw *self, PyObject *const *args,
                                  Py_ssize_t nargs);
static PyObject *mw_end_lingering(gqp_mw *self, PyObject *const *args,
                                  Py_ssize_t nargs);
static uint64_t note_unsampled(gqp_mw *self, gqp_py_thread *st,
                               PyObject *environ);
static PyObject *serve_noted(gqp_mw *self, gqp_py_thread *st,
                             PyObject *environ, PyObject *start_response);
static PyObject *mw_open_acquire(gqp_mw *self, PyObject *const *args,
                                 Py_ssize_t nargs);
static PyObject *mw_open_release(gqp_mw *self, PyObject *const *args,
                                 Py_ssize_t nargs);
static PyObject *mw_get_open(gqp_mw *self, void *closure);
static int mw_set_open(gqp_mw *self, PyObject *value, void *closure);
static PyObject *mw_finalize(gqp_mw *self, PyObject *const *args,
                             Py_ssize_t nargs);
static PyObject *mw_finalize_setup(gqp_mw *self, PyObject *const *args,
                                   Py_ssize_t nargs);
static PyObject *mw_build_profile(gqp_mw *self, PyObject *const *args,
                                  Py_ssize_t nargs);
static PyObject *mw_reentered(gqp_mw *self, PyObject *unused);
static int reentered(gqp_mw *self);
static int gqp_py_sampled_init(PyObject *reg);
static PyObject *mw_serve(gqp_mw *self, PyObject *environ,
                          PyObject *start_response);
/* _routes.c */
static PyObject *routes_call(gqp_mw *mw, PyObject *environ,
                             PyObject *start_response);
static PyObject *mw_routes_setup(gqp_mw *self, PyObject *arg);
static void routes_slow(PyObject *start_response);
static PyObject *rt_mounted_route(PyObject *routes, PyObject *environ);
static int gqp_py_routes_init(PyObject *reg);

static PyObject *str_call_slow, *str_pct, *str_requests, *str_mark_key,
    *str_defer,
    *str_internal_error, *str_begin, *str_method_key, *str_path_key,
    *str_rid_key, *str_lingering, *str_requests_attr, *str_profile_requests,
    *str_pending, *str_reentered_here;

static int mw_traverse(gqp_mw *self, visitproc visit, void *arg)
{
    Py_VISIT(self->app);
    Py_VISIT(self->stats);
    Py_VISIT(self->rng);
    Py_VISIT(self->profile_type);
    Py_VISIT(self->clock);
    Py_VISIT(self->hostname);
    Py_VISIT(self->armed_eng);
    Py_VISIT(self->lingering);
    Py_VISIT(self->requests);
    Py_VISIT(self->profile_requests);
    Py_VISIT(self->pending);
    Py_VISIT(self->routes);
    return 0;
}

static void mw_unarm(gqp_mw *self)
{
    self->armed_st = NULL;
    Py_CLEAR(self->armed_eng);
    Py_CLEAR(self->lingering);
    Py_CLEAR(self->requests);
    Py_CLEAR(self->profile_requests);
    Py_CLEAR(self->pending);
}

static int mw_clear(gqp_mw *self)
{
    Py_CLEAR(self->app);
    Py_CLEAR(self->stats);
    Py_CLEAR(self->rng);
    Py_CLEAR(self->trigger_key);
    Py_CLEAR(self->profile_type);
    Py_CLEAR(self->clock);
    Py_CLEAR(self->hostname);
    Py_CLEAR(self->routes);
    mw_unarm(self);
    return 0;
}

static PyObject *mw_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    PyObject *self = PyType_GenericNew(type, args, kw);
    if (self) {
        mw_live++;
    }
    return self;
}

static int light_ok(gqp_mw *self)
{
    return mw_live == 1 && self->blocking && gqp__tls &&
           gqp__tls->open_profiles == 0;
}

/* Light: whether the running greenlet's unsampled request is being served
 * with environ now (the app forwards it to its middleware again): counted
 * by its route once, as the environ mark made it. */
static int serving_here(PyObject *environ)
{
    gqp_py_thread *st = gqp__tls;
    uint64_t gid = 0;
    if (!st->notes || !st->active || !st->tracer ||
        gqp_tracer_current(st->tracer, NULL, &gid, NULL) != GQP_OK) {
        return 0;
    }
    gqp_note *n = &st->notes[gid & (GQP_NOTES - 1)];
    return n->gid == gid && n->serving == environ;
}

/* Marks environ as self's (its outer middleware's): what a nested
 * middleware, or self again, finds (mw_serve). */
static void mark(gqp_mw *self, PyObject *environ)
{
    if (PyDict_SetItem(environ, str_mark_key, (PyObject *)self) < 0) {
        err_clear();
    }
}

static void mw_dealloc(gqp_mw *self)
{
    mw_live--;
    PyObject_GC_UnTrack(self);
    mw_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *call2(PyObject *fn, PyObject *a, PyObject *b)
{
    PyObject *args[] = {a, b};
    return PyObject_Vectorcall(fn, args, 2, NULL);
}

/* The app, called with a reference held: the app may replace
 * middleware.app (the last reference) while it runs. */
static PyObject *call_app(gqp_mw *self, PyObject *environ,
                          PyObject *start_response)
{
    PyObject *app = self->app;
    if (!app) {
        PyErr_SetString(PyExc_RuntimeError, "ProfilingMiddleware has no app");
        return NULL;
    }
    Py_INCREF(app);
    PyObject *r = call2(app, environ, start_response);
    Py_DECREF(app);
    return r;
}

static PyObject *call_method2(PyObject *self, PyObject *name, PyObject *a,
                              PyObject *b)
{
    PyObject *args[] = {self, a, b};
    return PyObject_VectorcallMethod(name, args, 3, NULL);
}

/* The request goes to Python's _call_slow (which may serve it with the
 * inspector: not counted by its route, routes_slow). */
static PyObject *call_slow(gqp_mw *self, PyObject *environ,
                           PyObject *start_response)
{
    routes_slow(start_response);
    return call_method2((PyObject *)self, str_call_slow, environ,
                        start_response);
}

/* stats[key] += 1 (the dict Python code also updates). */
static void count_stat(gqp_mw *self, PyObject *key)
{
    if (!self->stats || !PyDict_CheckExact(self->stats)) {
        return;
    }
    PyObject *old = PyDict_GetItemWithError(self->stats, key);
    long long n = old && PyLong_CheckExact(old) ? gqp_long_as_ll(old) : -1;
    PyObject *next = n >= 0 ? PyLong_FromLongLong(n + 1) : NULL;
    if (next) {
        PyDict_SetItem(self->stats, key, next);
        Py_DECREF(next);
    }
    err_clear();
}

/* stats['requests'] += the requests the C path counted since the last
 * fold: the C path only bumps a counter (storing a new int in the dict
 * every request cost ~500 instructions); reading stats folds it in. */
static void stats_fold(gqp_mw *self)
{
    long long k = self->n_requests;
    if (!k || !self->stats || !PyDict_CheckExact(self->stats)) {
        return;
    }
    self->n_requests = 0;
    PyObject *old = PyDict_GetItemWithError(self->stats, str_requests);
    long long n = old && PyLong_CheckExact(old) ? gqp_long_as_ll(old) : -1;
    PyObject *next = n >= 0 ? PyLong_FromLongLong(n + k) : NULL;
    if (next) {
        PyDict_SetItem(self->stats, str_requests, next);
        Py_DECREF(next);
    }
    err_clear();
}

/* The armed thread state, if this thread's engine is ready for the fast
 * path (hooks active); armed() also prepares the running greenlet, which
 * begins a new request: if its
 * previous one is a sampled request still lingering (waiting for its
 * children), what it spawns from now on is no longer that request's
 * (Python's _stop_lingering).  On a keep-alive connection that is the
 * common case at a high pct: the finisher finalizes in batches. */
static gqp_py_thread *armed_state(gqp_mw *self)
{
    gqp_py_thread *st = gqp__tls;
    if (!st || st != self->armed_st || st->gen != self->armed_gen ||
        !st->active || !st->tracer || !self->armed_eng) {
        return NULL;
    }
    return st;
}

/* Ends the lingering of the running greenlet's previous request as it
 * begins another (defined in _sampled.c, with the Request type). */
static int end_lingering(gqp_mw *mw, gqp_py_thread *st, PyObject *eng,
                         PyObject *lingering, PyObject *requests,
                         uint64_t key);

/* This thread's state when self is armed for it, after ending the running
 * greenlet's previous lingering request; NULL when not armed, or NULL with
 * a BaseException set that the greenlet got while it yielded there. */
static gqp_py_thread *armed(gqp_mw *self)
{
    gqp_py_thread *st = armed_state(self);
    if (!st) {
        return NULL;
    }
    if (PyDict_GET_SIZE(self->lingering) != 0) {
        /* Keyed by id(greenlet), which is the tracer's key. */
        uint64_t key = 0;
        if (gqp_tracer_current(st->tracer, &key, NULL, NULL) != GQP_OK) {
            return NULL;
        }
        PyObject *eng = Py_NewRef(self->armed_eng);
        PyObject *lingering = Py_NewRef(self->lingering);
        PyObject *requests = Py_NewRef(self->requests);
        int rc = end_lingering(self, st, eng, lingering, requests, key);
        Py_DECREF(eng);
        Py_DECREF(lingering);
        Py_DECREF(requests);
        if (rc < 0) {
            return NULL;   /* (the greenlet's BaseException, set) */
        }
        /* (it may have run Python, during which another thread may have
         * armed self for itself) */
        return armed_state(self);
    }
    return st;
}

/* An error of greqprof's (the exception set) goes to
 * _internal_error(where, exc), which logs it once and counts it: greqprof
 * never breaks the app.  Returns 0, the exception cleared.  A
 * BaseException that is not an Exception (gevent.Timeout, GreenletExit,
 * SystemExit, KeyboardInterrupt: raised into a sink or a logging handler
 * that waited) is not greqprof's error but the caller's: it stays set,
 * and -1 is returned, for the caller to pass on. */
static int internal_error(gqp_mw *mw, PyObject *where)
{
    if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_Exception)) {
        return -1;
    }
    PyObject *value = PyErr_GetRaisedException();
    PyObject *r = value ? call_method2((PyObject *)mw, str_internal_error,
                                       where, value) : NULL;
    Py_XDECREF(r);
    Py_XDECREF(value);
    if (!r && PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_Exception)) {
        return -1;   /* (raised while logging: a handler that waited) */
    }
    err_clear();
    return 0;
}

static PyObject *mw_call(gqp_mw *self, PyObject *args, PyObject *kwargs)
{
    if ((kwargs && (!PyDict_Check(kwargs) || PyDict_GET_SIZE(kwargs))) ||
        !PyTuple_Check(args) || PyTuple_GET_SIZE(args) != 2) {
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
    if (self->routes && self->enabled && self->app &&
        PyDict_Check(environ)) {
        /* Counted by its route, unless an outer middleware counts it. */
        if (light_ok(self)) {
            if (!serving_here(environ)) {
                return routes_call(self, environ, start_response);
            }
            return mw_serve(self, environ, start_response);
        }
        PyObject *outer = PyDict_GetItemWithError(environ, str_mark_key);
        if (!outer && !PyErr_Occurred()) {
            return routes_call(self, environ, start_response);
        }
        err_clear();
    }
    return mw_serve(self, environ, start_response);
}

static PyObject *mw_serve(gqp_mw *self, PyObject *environ,
                          PyObject *start_response)
{
    if (!self->app) {
        PyErr_SetString(PyExc_RuntimeError, "ProfilingMiddleware has no app");
        return NULL;
    }
    if (!self->enabled) {
        return call_app(self, environ, start_response);
    }
    int light = PyDict_Check(environ) && light_ok(self);
    if (PyDict_Check(environ) && !light) {
        /* Wrapped twice (Flask's app.wsgi_app plus a server hook that
         * wraps again): the outer middleware marks the request, the inner
         * one defers to it (and says so once, in Python).  Any dict is
         * marked here (gevent's WSGISecureEnviron is a subclass); other
         * mappings in _call_slow. */
        PyObject *outer = PyDict_GetItemWithError(environ, str_mark_key);
        if (outer == (PyObject *)self && reentered(self)) {
            /* The app forwards the request to this middleware again (the
             * root app, same environ): it is profiled once, by the outer
             * call. */
            return call_app(self, environ, start_response);
        }
        if (outer && outer != (PyObject *)self) {
            if (!self->deferred) {
                self->deferred = 1;
                Py_INCREF(outer);   /* (logging runs Python) */
                PyObject *r = PyObject_CallMethodOneArg(
                    (PyObject *)self, str_defer, outer);
                Py_DECREF(outer);
                Py_XDECREF(r);
                err_clear();
            }
            return call_app(self, environ, start_response);
        }
        if (!outer && (PyErr_Occurred() ||
                       PyDict_SetItem(environ, str_mark_key,
                                      (PyObject *)self) < 0)) {
            err_clear();
        }
    }
    if (self->slow_only || !PyDict_CheckExact(environ)) {
        if (light) {
            mark(self, environ);
        }
        return call_slow(self, environ, start_response);
    }
    if (self->trigger_key) {
        PyObject *v = PyDict_GetItemWithError(environ, self->trigger_key);
        if (v || PyErr_Occurred()) {
            err_clear();
            if (light) {
                mark(self, environ);
            }
            return call_slow(self, environ, start_response);
        }
    }
    gqp_py_thread *st = NULL;
    if (self->blocking && !(st = armed(self))) {
        if (PyErr_Occurred()) {
            return NULL;   /* (killed while it yielded: end_lingering) */
        }
        /* This thread's engine is not ready: Python sets it up (and arms
         * this path for it). */
        if (light) {
            mark(self, environ);
        }
        return call_slow(self, environ, start_response);
    }
    if (!self->blocking && gqp__tls && gqp__tls->open_profiles > 0 &&
        !armed_state(self)) {
        /* Armed for another thread, and this one has sampled profiles
         * open: one may be the running greenlet's previous request, still
         * lingering, which Python ends (_begin) before what the greenlet
         * spawns goes to it.  (Before: it went there, when two threads
         * shared the middleware with blocking_ms=None.) */
        if (light) {
            mark(self, environ);
        }
        return call_slow(self, environ, start_response);
    }
    int sampled = 0;
    if (self->pct >= 1.0) {
        sampled = 1;
    } else if (self->pct > 0.0) {
        PyObject *r = self->rng ? PyObject_CallNoArgs(self->rng) : NULL;
        double x = r ? PyFloat_AsDouble(r) : -1.0;
        Py_XDECREF(r);
        if (!r || (x == -1.0 && PyErr_Occurred())) {
            if (internal_error(self, str_begin) < 0) {   /* a raising rng */
                return NULL;
            }
            return call_app(self, environ, start_response);
        }
        sampled = x < self->pct;
        /* The rng ran Python (it may even have stopped this thread's
         * engine): the armed state is looked up again. */
        st = self->blocking ? armed_state(self) : NULL;
    }
    self->n_requests++;   /* (folded into stats when read) */
    if (sampled) {
        if (light) {
            mark(self, environ);
        }
        if (!st && !(st = armed(self)) && PyErr_Occurred()) {
            return NULL;
        }
        return sampled_call(self, st, environ,
                            start_response);
    }
    if (!self->blocking && self->lingering &&
        PyDict_GET_SIZE(self->lingering) > 0) {
        /* (armed() ends the greenlet's lingering request: what it spawns
         * now is not that request's) */
        if (!armed(self) && PyErr_Occurred()) {
            return NULL;
        }
    }
    if (st) {
        return serve_noted(self, st, environ, start_response);
    }
    return call_app(self, environ, start_response);
}

/* Runs the app for an unsampled request, noted (note_unsampled), its note
 * saying meanwhile that environ is being served (serving_here). */
static PyObject *serve_noted(gqp_mw *self, gqp_py_thread *st,
                             PyObject *environ, PyObject *start_response)
{
    uint64_t gid = note_unsampled(self, st, environ);
    gqp_note *n = gid && st->notes ? &st->notes[gid & (GQP_NOTES - 1)]
                                   : NULL;
    const void *prev = NULL;
    if (n && n->gid == gid) {
        prev = n->serving;
        n->serving = environ;
    }
    PyObject *r = call_app(self, environ, start_response);
    /* (the app may have stopped the engine, freeing st: looked up again;
     * greenlet ids are never reused, so a slot of gid is this request's) */
    st = n && gqp__tls == st ? st : NULL;
    if (st && st->notes) {
        n = &st->notes[gid & (GQP_NOTES - 1)];
        if (n->gid == gid && n->serving == environ) {
            n->serving = prev;
        }
    }
    return r;
}

/* Notes the unsampled request the running greenlet begins (environ: an
 * exact dict). */
static uint64_t note_unsampled(gqp_mw *self, gqp_py_thread *st,
                               PyObject *environ)
{
    uint64_t gid = 0;
    if (gqp_tracer_current(st->tracer, NULL, &gid, NULL) == GQP_OK) {
        /* Each value held: a later lookup may run Python (the __eq__
         * of a key whose hash collides), which may remove an earlier
         * one from environ. */
        PyObject *m = PyDict_GetItemWithError(environ, str_method_key);
        Py_XINCREF(m);
        PyObject *p = PyDict_GetItemWithError(environ, str_path_key);
        Py_XINCREF(p);
        PyObject *r = PyDict_GetItemWithError(environ, str_rid_key);
        Py_XINCREF(r);
        err_clear();
        note_set(st, gid, m, p, r, self);
        Py_XDECREF(m);
        Py_XDECREF(p);
        Py_XDECREF(r);
        err_clear();
        /* (a mounted app: its path route, known now, not PATH_INFO's) */
        PyObject *mounted = rt_mounted_route(self->routes, environ);
        if (mounted) {
            note_name(st, gid, mounted);
            Py_DECREF(mounted);
        }
    }
    return gid;
}

/* _lifecycle_setup(observers): whether observers hear of requests. */
static PyObject *mw_lifecycle_setup(gqp_mw *self, PyObject *arg)
{
    int on = PyObject_IsTrue(arg);
    if (on < 0) {
        return NULL;
    }
    self->observers = on;
    Py_RETURN_NONE;
}

/* _set_linger(seconds): how long finished sampled requests wait for the
 * greenlets they spawned (ProfilingMiddleware.linger's setter). */
static PyObject *mw_set_linger(gqp_mw *self, PyObject *arg)
{
    double linger = PyFloat_AsDouble(arg);
    if (linger == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    if (!(linger >= 0.0 && linger <= 1e9)) {
        PyErr_SetString(PyExc_ValueError, "linger must be >= 0 seconds");
        return NULL;
    }
    self->linger = linger > 0;
    self->linger_ns = (long long)(linger * 1e9);
    Py_RETURN_NONE;
}

/* _fast_setup(pct, rng, trigger_key, blocking, slow_only, stats, calls,
 *             linger, max_open, max_spans, profile_type) */
static PyObject *mw_fast_setup(gqp_mw *self, PyObject *const *args,
                               Py_ssize_t nargs)
{
    if (want_args(nargs, 11, "_fast_setup") < 0) {
        return NULL;
    }
    double pct = PyFloat_AsDouble(args[0]);
    if (pct == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    if (args[2] != Py_None && !PyUnicode_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "trigger_key must be a str or None");
        return NULL;
    }
    long max_open = PyLong_AsLong(args[8]);
    Py_ssize_t max_spans = PyLong_AsSsize_t(args[9]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (max_open < 1 || max_open > INT_MAX || max_spans < 1 ||
        !PyType_Check(args[10])) {
        PyErr_SetString(PyExc_ValueError, "_fast_setup: bad limits or type");
        return NULL;
    }
    self->pct = pct;
    Py_XSETREF(self->rng, args[1] == Py_None ? NULL : Py_NewRef(args[1]));
    Py_XSETREF(self->trigger_key,
               args[2] == Py_None ? NULL : Py_NewRef(args[2]));
    self->blocking = PyObject_IsTrue(args[3]);
    self->slow_only = PyObject_IsTrue(args[4]);
    Py_XSETREF(self->stats, Py_NewRef(args[5]));
    self->calls = PyObject_IsTrue(args[6]);
    PyObject *r = mw_set_linger(self, args[7]);
    if (!r) {
        return NULL;
    }
    Py_DECREF(r);
    self->max_open = (int)max_open;
    self->max_spans = (size_t)max_spans;
    Py_XSETREF(self->profile_type, (PyTypeObject *)Py_NewRef(args[10]));
    Py_RETURN_NONE;
}

/* _arm(hooks_address, engine, fork_generation): this thread's requests
 * take the C path from now on (the hooks at hooks_address must be this
 * thread's, installed by that engine). */
static PyObject *mw_arm(gqp_mw *self, PyObject *const *args,
                        Py_ssize_t nargs)
{
    if (want_args(nargs, 3, "_arm") < 0) {
        return NULL;
    }
    gqp_py_thread *st = (gqp_py_thread *)PyLong_AsVoidPtr(args[0]);
    long fork_gen = PyLong_AsLong(args[2]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (!st || st != gqp__tls || !st->active) {
        Py_RETURN_FALSE;   /* not this thread's hooks: stay slow */
    }
    if (self->armed_st == st && self->armed_gen == st->gen &&
        self->armed_eng == args[1]) {
        Py_RETURN_TRUE;    /* (already: the common case) */
    }
    PyObject *eng = args[1];
    PyObject *c[4] = {NULL, NULL, NULL, NULL};
    PyObject *names[4] = {str_lingering, str_requests_attr,
                          str_profile_requests, str_pending};
    for (int i = 0; i < 4; i++) {
        c[i] = PyObject_GetAttr(eng, names[i]);
        if (!c[i] || (i < 3 ? !PyDict_CheckExact(c[i])
                            : !PyList_CheckExact(c[i]))) {
            for (int j = 0; j <= i; j++) {
                Py_XDECREF(c[j]);
            }
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_TypeError,
                                "_arm: the engine's containers are not "
                                "dicts and a list");
            }
            return NULL;
        }
    }
    mw_unarm(self);
    self->armed_st = st;
    self->armed_gen = st->gen;
    self->armed_fork_gen = fork_gen;
    self->armed_eng = Py_NewRef(eng);
    self->lingering = c[0];
    self->requests = c[1];
    self->profile_requests = c[2];
    self->pending = c[3];
    Py_RETURN_TRUE;
}

/* _is_armed(): True when the calling thread takes the fast path. */
static PyObject *mw_is_armed(gqp_mw *self, PyObject *unused)
{
    (void)unused;
    gqp_py_thread *st = armed(self);
    if (!st && PyErr_Occurred()) {
        return NULL;
    }
    return PyBool_FromLong(st != NULL);
}

static PyObject *mw_disarm(gqp_mw *self, PyObject *unused)
{
    (void)unused;
    mw_unarm(self);
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

static PyObject *mw_get_enabled(gqp_mw *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(self->enabled);
}

static int mw_set_enabled(gqp_mw *self, PyObject *value, void *closure)
{
    (void)closure;
    int on = value ? PyObject_IsTrue(value) : -1;
    if (on < 0) {
        if (!value) {
            PyErr_SetString(PyExc_AttributeError, "enabled cannot be deleted");
        }
        return -1;
    }
    self->enabled = on;
    return 0;
}

static PyObject *mw_get_stats(gqp_mw *self, void *closure)
{
    (void)closure;
    if (!self->stats) {
        PyErr_SetString(PyExc_AttributeError, "stats");
        return NULL;
    }
    stats_fold(self);
    return Py_NewRef(self->stats);
}

static int mw_set_stats(gqp_mw *self, PyObject *value, void *closure)
{
    (void)closure;
    if (!value) {
        PyErr_SetString(PyExc_AttributeError, "stats cannot be deleted");
        return -1;
    }
    stats_fold(self);   /* (the old dict gets what it counted) */
    Py_XSETREF(self->stats, Py_NewRef(value));
    return 0;
}

static PyGetSetDef mw_getset[] = {
    {"stats", (getter)mw_get_stats, (setter)mw_set_stats,
     "Counters: requests, sampled, skipped_full, blocking, errors, "
     "delivered, blocking_not_logged.", NULL},
    {"app", (getter)mw_get_app, (setter)mw_set_app,
     "The wrapped WSGI application.", NULL},
    {"enabled", (getter)mw_get_enabled, (setter)mw_set_enabled,
     "False: a plain pass-through (GREQPROF_ENABLED=0).", NULL},
    {"_open", (getter)mw_get_open, (setter)mw_set_open,
     "Sampled profiles open now (internal).", NULL},
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
    {"_call_profiled", (PyCFunction)(void (*)(void))mw_call_profiled,
     METH_FASTCALL, "Runs the app for an open request (internal)."},
    {"_reentered", (PyCFunction)mw_reentered, METH_NOARGS,
     "True when this request re-enters the middleware (internal)."},
    {"_begin_request", (PyCFunction)(void (*)(void))mw_begin_request,
     METH_FASTCALL, "Begins a profiled or observed request (internal)."},
    {"_end_lingering", (PyCFunction)(void (*)(void))mw_end_lingering,
     METH_FASTCALL,
     "The running greenlet's previous request stops lingering (internal)."},
    {"_lifecycle_setup", (PyCFunction)mw_lifecycle_setup, METH_O,
     "Sets whether observers hear of requests (internal)."},
    {"_finalize", (PyCFunction)(void (*)(void))mw_finalize, METH_FASTCALL,
     "Closes a request's profile and delivers it (internal)."},
    {"_build_profile", (PyCFunction)(void (*)(void))mw_build_profile,
     METH_FASTCALL, "Builds the RequestProfile of a request (internal)."},
    {"_finalize_setup", (PyCFunction)(void (*)(void))mw_finalize_setup,
     METH_FASTCALL, "Sets what _finalize puts in profiles (internal)."},
    {"_set_linger", (PyCFunction)mw_set_linger, METH_O,
     "Sets the linger of sampled requests, in seconds (internal)."},
    {"_routes_setup", (PyCFunction)mw_routes_setup, METH_O,
     "Sets the RouteCounts requests are counted in (internal)."},
    {"_open_acquire", (PyCFunction)(void (*)(void))mw_open_acquire,
     METH_FASTCALL,
     "Counts one more open profile if max_open allows (internal)."},
    {"_open_release", (PyCFunction)(void (*)(void))mw_open_release,
     METH_FASTCALL,
     "Counts one open profile fewer (internal)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject gqp_mw_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "greqprof._core.MiddlewareBase",
    .tp_basicsize = sizeof(gqp_mw),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "ProfilingMiddleware's C part: the unsampled request path.",
    .tp_new = mw_new,
    .tp_dealloc = (destructor)mw_dealloc,
    .tp_traverse = (traverseproc)mw_traverse,
    .tp_clear = (inquiry)mw_clear,
    .tp_call = (ternaryfunc)mw_call,
    .tp_methods = mw_methods,
    .tp_getset = mw_getset,
};

/* Registers the type and functions in greqprof._registry (GIL held).
 * 0 or -1. */
static int gqp_py_fast_init(PyObject *reg)
{
    struct { PyObject **s; const char *v; } strs[] = {
        {&str_call_slow, "_call_slow"}, {&str_pct, "pct"},
        {&str_requests, "requests"}, {&str_internal_error, "_internal_error"},
        {&str_begin, "begin"}, {&str_method_key, "REQUEST_METHOD"},
        {&str_path_key, "PATH_INFO"}, {&str_rid_key, "HTTP_X_REQUEST_ID"},
        {&str_lingering, "lingering"}, {&str_requests_attr, "requests"},
        {&str_profile_requests, "profile_requests"}, {&str_pending, "pending"},
        {&str_mark_key, "greqprof.middleware"}, {&str_defer, "_defer"},
        {&str_reentered_here, "_reentered_here"},
    };
    for (size_t i = 0; i < sizeof strs / sizeof strs[0]; i++) {
        if (!*strs[i].s &&
            !(*strs[i].s = PyUnicode_InternFromString(strs[i].v))) {
            return -1;
        }
    }
    if (PyType_Ready(&gqp_mw_type) < 0 ||
        PyObject_SetAttrString(reg, "MiddlewareBase",
                               (PyObject *)&gqp_mw_type) < 0) {
        return -1;
    }
    if (gqp_py_sampled_init(reg) < 0 || gqp_py_routes_init(reg) < 0) {
        return -1;
    }
    PyMethodDef *defs[] = {&note_def, &request_note_def,
                           &live_middlewares_def};
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
