/* _hooks/sampler.c -- the stack sampler (stack_hz): a Python thread of its
 * own runs sampler_run, which sleeps without the GIL, reads (still
 * without it) which greenlet each watched thread's switch hook last
 * switched to, and unless all of them are in their hubs, holding the GIL,
 * looks at each watched serving thread once per tick: the greenlet running
 * there (the tracer's current one), its request's route, and its Python
 * stack, counted per (route, stack) in the dicts greqprof/sampler.py made.
 * Nothing runs in the serving thread per sample; the sampler's tick is C
 * except the naming of a path or route name not seen before (bounded
 * caches).  The app's route name (set_route, the Flask and Django hooks)
 * reaches the sampler through sampler_name, which leaves it on the
 * request's note (or its Request, when sampled) as soon as it is known.
 * The loop also runs the watchdog's check when it ticks at least as
 * often as the watchdog looks (sampler_host).
 * A part of _hooks.c (one translation unit, see there). */
#include "hooks.h"
#include <errno.h>
#include <time.h>

#define GQP_SMP_THREADS 64       /* serving threads watched at once */
#define GQP_SMP_DEPTH 64         /* frames kept per stack (leaf first) */
#define GQP_SMP_ROUTE_CACHE 4096 /* path -> route entries before a reset */

typedef struct {
    PyObject *ref;        /* the thread's hookref (st NULL once freed) */
    PyObject *by_addr;    /* its engine's profile_requests */
    uint64_t ts_id;       /* PyThreadState_GetID of the serving thread */
} gqp_smp_watch;

static gqp_smp_watch smp_watched[GQP_SMP_THREADS];
static int smp_n;
/* smp_watched[i]'s thread's beacon (hooks.h), and smp_n, for the loop to
 * read without the GIL: a tick at which every watched thread runs its hub
 * takes no GIL (about half of them on a busy server, whose hub holds the
 * GIL while it runs; taking it cost the serving thread a forced switch). */
static gqp_smp_beacon smp_beacons[GQP_SMP_THREADS];
static uint64_t smp_tick_key[GQP_SMP_THREADS];   /* what ran at the tick */
static atomic_int smp_watching;
static atomic_uint_fast64_t smp_gen;   /* bumped by stop/reset: a loop
                                        * ends */
/* Set by sampler_setup (greqprof/sampler.py's table): */
typedef struct {
    PyObject *counts;     /* (route, stack id) -> samples */
    PyObject *ids;        /* stack hash -> stack id */
    PyObject *stacks;     /* list: stack id -> frame ids (bytes) */
    PyObject *frames;     /* list: frame id -> (code, line) */
    PyObject *frame_ids;  /* (code address, line) -> frame id */
} smp_table;
/* (a tick holds the one it counts into: a reset meanwhile, while Python
 * runs, does not mix two tables' ids) */
static smp_table smp_tab;

static smp_table smp_table_hold(void)
{
    smp_table t = smp_tab;
    Py_XINCREF(t.counts);
    Py_XINCREF(t.ids);
    Py_XINCREF(t.stacks);
    Py_XINCREF(t.frames);
    Py_XINCREF(t.frame_ids);
    return t;
}

static void smp_table_drop(smp_table *t)
{
    Py_XDECREF(t->counts);
    Py_XDECREF(t->ids);
    Py_XDECREF(t->stacks);
    Py_XDECREF(t->frames);
    Py_XDECREF(t->frame_ids);
}

static PyObject *smp_routes;      /* path -> route (a cache) */
static PyObject *smp_route_fn;    /* path -> route, Python */
static PyObject *smp_names;       /* name the app gave -> cleaned (a cache) */
static PyObject *smp_name_fn;     /* name -> cleaned, Python */
static PyObject *smp_no_request, *smp_other, *smp_path_str, *smp_route_str,
    *smp_final_str, *smp_greenlet_str;
static Py_ssize_t smp_max_stacks, smp_max_keys, smp_max_frames;
static unsigned long long smp_ticks, smp_samples, smp_idle, smp_skipped,
    smp_truncated, smp_idle_nogil, smp_moved;
/* A check the loop runs every smp_host_period ns besides its ticks (the
 * watchdog's, when the sampler ticks at least as often as it looks: one
 * thread taking the GIL instead of two; see greqprof/engine.py). */
static PyObject *smp_host_fn;
static long long smp_host_period;
static atomic_uint_fast64_t smp_host_ver;   /* bumped by sampler_host:
                                              * check at once */
static atomic_int smp_host_on;               /* smp_host_fn is set */

static void smp_drop(int i)
{
    gqp_smp_watch w = smp_watched[i];
    gqp_py_thread *st = ((gqp_hookref *)w.ref)->st;
    if (st) {
        st->beacon = NULL;
    }
    smp_watched[i] = smp_watched[--smp_n];
    /* (the last entry moves to i, with its beacon: its thread's hooks run
     * with the GIL held, as this does, so none writes meanwhile) */
    atomic_store(&smp_beacons[i].key, atomic_load(&smp_beacons[smp_n].key));
    atomic_store(&smp_beacons[i].hub_key,
                 atomic_load(&smp_beacons[smp_n].hub_key));
    smp_tick_key[i] = smp_tick_key[smp_n];
    gqp_py_thread *moved = i < smp_n
        ? ((gqp_hookref *)smp_watched[i].ref)->st : NULL;
    if (moved) {
        moved->beacon = &smp_beacons[i];
    }
    atomic_store(&smp_beacons[smp_n].key, 0);
    atomic_store(&smp_watching, smp_n);
    Py_XDECREF(w.ref);
    Py_XDECREF(w.by_addr);
}

static PyThreadState *smp_tstate(uint64_t id)
{
    PyInterpreterState *in = PyInterpreterState_Get();
    for (PyThreadState *ts = PyInterpreterState_ThreadHead(in); ts;
         ts = PyThreadState_Next(ts)) {
        if (PyThreadState_GetID(ts) == id) {
            return ts;
        }
    }
    return NULL;
}

/* value's entry in cache, made by fn(value) once (a bounded cache; a new
 * reference); smp_other when fn fails. */
static PyObject *smp_cached(PyObject *cache, PyObject *fn, PyObject *value)
{
    PyObject *v = PyDict_GetItemWithError(cache, value);
    if (v) {
        return Py_NewRef(v);
    }
    v = PyObject_CallOneArg(fn, value);
    if (!v || !PyUnicode_Check(v)) {
        Py_XDECREF(v);
        PyErr_Clear();
        return Py_NewRef(smp_other);
    }
    if (PyDict_GET_SIZE(cache) >= GQP_SMP_ROUTE_CACHE) {
        PyDict_Clear(cache);
    }
    PyDict_SetItem(cache, value, v);
    PyErr_Clear();
    return v;
}

/* What names the route of the running greenlet g (key/gid/p from the
 * tracer): *name, the one the app gave its request (set_route, a
 * framework hook: see smp_name_py) as soon as it did, else *path, its
 * request's path; its sampled request's, else the noted request of it or
 * its spawners.  New references or NULL.  Runs no Python (C attributes,
 * dicts keyed by ints): nothing else runs meanwhile, so the borrowed g
 * stays alive. */
static void smp_route_source(gqp_py_thread *st, PyObject *by_addr,
                             PyObject *g, uint64_t gid, gqp_profile *p,
                             PyObject **name, PyObject **path)
{
    *name = *path = NULL;
    if (p && by_addr) {
        PyObject *k = PyLong_FromVoidPtr(p);
        PyObject *req = k ? PyDict_GetItemWithError(by_addr, k) : NULL;
        Py_XDECREF(k);
        if (req) {
            Py_INCREF(req);
            *name = PyObject_GetAttr(req, smp_route_str);
            if (!*name || !PyUnicode_Check(*name)) {
                /* (once its response ended: the route it was counted
                 * under, for what its greenlets still run) */
                Py_XSETREF(*name, PyObject_GetAttr(req, smp_final_str));
            }
            if (!*name || !PyUnicode_Check(*name)) {
                Py_CLEAR(*name);
                PyErr_Clear();
                *path = PyObject_GetAttr(req, smp_path_str);
            }
            Py_DECREF(req);
        }
        PyErr_Clear();
    }
    if (!*name && !*path) {
        PyObject *chain = spawner_chain(st, g, gid);
        if (chain) {
            note_route_find(st, chain, name, path);
        }
        Py_XDECREF(chain);
        PyErr_Clear();
    }
}

/* The route named by smp_route_source's name or path (steals both): a
 * new reference.  Naming one not seen before runs Python. */
static PyObject *smp_route_named(PyObject *name, PyObject *path)
{
    PyObject *route;
    if (name && PyUnicode_Check(name)) {
        route = smp_cached(smp_names, smp_name_fn, name);   /* cleaned */
    } else if (path && PyUnicode_Check(path)) {
        route = smp_cached(smp_routes, smp_route_fn, path);
    } else {
        route = Py_NewRef(smp_no_request);
    }
    Py_XDECREF(name);
    Py_XDECREF(path);
    return route;
}

/* sampler_name(name): the app named the route of the request the calling
 * greenlet serves (set_route, the Flask and Django hooks): its samples
 * from now on count under it.  True when that request was found (the
 * greenlet is a request's own on a watched or noted thread). */
static PyObject *smp_name_py(PyObject *self, PyObject *name)
{
    (void)self;
    gqp_py_thread *st = gqp__tls;
    uint64_t key = 0, gid = 0;
    gqp_profile *p = NULL;
    if (!PyUnicode_CheckExact(name) || !st || !st_live(st) ||
        gqp_tracer_current(st->tracer, &key, &gid, &p) != GQP_OK || !gid) {
        Py_RETURN_FALSE;
    }
    if (!p) {
        return PyBool_FromLong(note_name(st, gid, name));
    }
    /* A sampled request: its Request object, found through the engine
     * the sampler watches on this thread. */
    PyObject *by_addr = NULL;
    for (int i = 0; i < smp_n && !by_addr; i++) {
        if (((gqp_hookref *)smp_watched[i].ref)->st == st) {
            by_addr = smp_watched[i].by_addr;
        }
    }
    PyObject *k = by_addr ? PyLong_FromVoidPtr(p) : NULL;
    PyObject *req = k ? PyDict_GetItemWithError(by_addr, k) : NULL;
    Py_XDECREF(k);
    int done = 0;
    if (req) {
        Py_INCREF(req);
        PyObject *rg = PyObject_GetAttr(req, smp_greenlet_str);
        /* (its own greenlet only: a child names only itself) */
        if (rg && (uint64_t)(uintptr_t)rg == key) {
            done = PyObject_SetAttr(req, smp_route_str, name) == 0;
        }
        Py_XDECREF(rg);
        Py_DECREF(req);
    }
    PyErr_Clear();
    return PyBool_FromLong(done);
}

/* The id of frame (code, line), interned in t->frames; -1 when the
 * table of frames is full.  The entry holds the code object: its address
 * stays its own while the entry exists. */
static long smp_frame_id(smp_table *t, PyObject *code, int line)
{
    /* (only for a stack not seen before: two ints are cheap enough) */
    PyObject *key = Py_BuildValue("(Ki)",
                                  (unsigned long long)(uintptr_t)code, line);
    if (!key) {
        PyErr_Clear();
        return -1;
    }
    long id = -1;
    PyObject *v = PyDict_GetItemWithError(t->frame_ids, key);
    if (v) {
        id = PyLong_AsLong(v);
    } else if (!PyErr_Occurred() &&
               PyList_GET_SIZE(t->frames) < smp_max_frames) {
        PyObject *fl = Py_BuildValue("(Oi)", code, line);
        PyObject *idv = PyLong_FromSsize_t(PyList_GET_SIZE(t->frames));
        if (fl && idv && PyList_Append(t->frames, fl) == 0 &&
            PyDict_SetItem(t->frame_ids, key, idv) == 0) {
            id = PyLong_AsLong(idv);
        }
        Py_XDECREF(fl);
        Py_XDECREF(idv);
    }
    PyErr_Clear();
    Py_DECREF(key);
    return id;
}

/* 1 when stack entry s (packed uint32 frame ids, leaf first) is the
 * stack codes/lines. */
static int smp_same_stack(smp_table *t, PyObject *s, PyObject **codes,
                          int *lines, int n)
{
    if (!PyBytes_Check(s) || PyBytes_GET_SIZE(s) != (Py_ssize_t)n * 4) {
        return 0;
    }
    const char *ids = PyBytes_AS_STRING(s);
    for (int i = 0; i < n; i++) {
        uint32_t fid;
        memcpy(&fid, ids + 4 * i, 4);
        if (fid >= (uint32_t)PyList_GET_SIZE(t->frames)) {
            return 0;
        }
        PyObject *fl = PyList_GET_ITEM(t->frames, fid);
        if (PyTuple_GET_ITEM(fl, 0) != codes[i] ||
            PyLong_AsLong(PyTuple_GET_ITEM(fl, 1)) != lines[i]) {
            return 0;
        }
    }
    return 1;
}

/* The id of the stack of frames codes/lines (leaf first), 0 when the
 * tables are full.  A stack is kept as its frames' ids (4 bytes each),
 * found by a hash of its code objects and lines and checked frame by
 * frame. */
static long smp_stack_id(smp_table *t, PyObject **codes, int *lines,
                         int n)
{
    uint64_t h = 1469598103934665603ULL;
    for (int i = 0; i < n; i++) {
        h = (h ^ (uint64_t)(uintptr_t)codes[i]) * 1099511628211ULL;
        h = (h ^ (uint64_t)(uint32_t)lines[i]) * 1099511628211ULL;
    }
    PyObject *key = PyLong_FromUnsignedLongLong(h);
    if (!key) {
        PyErr_Clear();
        return 0;
    }
    long id = 0;
    PyObject *v = PyDict_GetItemWithError(t->ids, key);
    if (v) {
        id = PyLong_AsLong(v);
        if (id <= 0 || id >= PyList_GET_SIZE(t->stacks) ||
            !smp_same_stack(t, PyList_GET_ITEM(t->stacks, id), codes, lines,
                            n)) {
            id = 0;   /* (a 64-bit hash collision: counted as <other>) */
        }
    } else if (!PyErr_Occurred() &&
               PyList_GET_SIZE(t->stacks) <= smp_max_stacks) {
        uint32_t fids[GQP_SMP_DEPTH];
        int ok = 1;
        for (int i = 0; i < n && ok; i++) {
            long f = smp_frame_id(t, codes[i], lines[i]);
            ok = f >= 0;
            fids[i] = (uint32_t)f;
        }
        PyObject *s = ok ? PyBytes_FromStringAndSize((const char *)fids,
                                                     (Py_ssize_t)n * 4)
                         : NULL;
        PyObject *idv = s ? PyLong_FromSsize_t(PyList_GET_SIZE(t->stacks))
                          : NULL;
        if (idv && PyList_Append(t->stacks, s) == 0 &&
            PyDict_SetItem(t->ids, key, idv) == 0) {
            id = PyLong_AsLong(idv);
        }
        Py_XDECREF(idv);
        Py_XDECREF(s);
    }
    PyErr_Clear();
    Py_DECREF(key);
    return id;
}

static void smp_count(smp_table *t, PyObject *route, long id)
{
    PyObject *key = Py_BuildValue("(Ol)", route, id);
    PyObject *old = key ? PyDict_GetItemWithError(t->counts, key) : NULL;
    if (!old && key && !PyErr_Occurred() &&
        PyDict_GET_SIZE(t->counts) >= smp_max_keys) {
        Py_DECREF(key);
        key = Py_BuildValue("(Ol)", smp_other, 0L);
        old = key ? PyDict_GetItemWithError(t->counts, key) : NULL;
        smp_truncated++;
    }
    long long n = old ? PyLong_AsLongLong(old) : 0;
    PyObject *v = key ? PyLong_FromLongLong(n + 1) : NULL;
    if (v) {
        PyDict_SetItem(t->counts, key, v);
    }
    Py_XDECREF(v);
    Py_XDECREF(key);
    PyErr_Clear();
}

/* Line numbers by (code, instruction): computing one scans the code's
 * line table, which was most of a tick's cost.  Direct-mapped; an entry
 * holds its code object, so its address is not reused meanwhile. */
#define GQP_SMP_LINES 4096       /* a power of two */
#if PY_VERSION_HEX < 0x030B0000
#define PyFrame_GetLasti(f) ((f)->f_lasti)   /* (3.10: public field) */
#endif
static struct {
    PyCodeObject *code;
    int lasti, line, own;
} smp_lines[GQP_SMP_LINES];

/* f's line (f's code is co); *own: a frame of greqprof's own. */
static int smp_line(PyFrameObject *f, PyCodeObject *co, int *own)
{
    int lasti = PyFrame_GetLasti(f);
    size_t h = ((size_t)(uintptr_t)co >> 4 ^ (size_t)lasti * 2654435761u) &
               (GQP_SMP_LINES - 1);
    if (lasti >= 0 && smp_lines[h].code == co && smp_lines[h].lasti == lasti) {
        *own = smp_lines[h].own;
        return smp_lines[h].line;
    }
    PyObject *file = PyObject_GetAttr((PyObject *)co, co_filename_str);
    *own = file && own_dir && PyUnicode_Check(file) &&
        PyUnicode_Tailmatch(file, own_dir, 0, PY_SSIZE_T_MAX, -1) == 1;
    Py_XDECREF(file);
    PyErr_Clear();
    /* (code without a line table says -1; pprof's "unknown" is 0) */
    int line = PyFrame_GetLineNumber(f);
    if (line < 0)
        line = 0;
    if (lasti >= 0) {
        PyCodeObject *old = smp_lines[h].code;
        smp_lines[h].code = (PyCodeObject *)Py_NewRef(co);
        smp_lines[h].lasti = lasti;
        smp_lines[h].line = line;
        smp_lines[h].own = *own;
        Py_XDECREF(old);
    }
    return line;
}

/* One sample of watched thread i (GIL held); 0, or -1 when the entry
 * was dropped (its thread or hooks are gone). */
static int smp_sample(int i)
{
    gqp_smp_watch *w = &smp_watched[i];
    gqp_py_thread *st = ((gqp_hookref *)w->ref)->st;
    PyThreadState *ts = st ? smp_tstate(w->ts_id) : NULL;
    if (!ts) {
        smp_drop(i);
        return -1;
    }
    uint64_t key = 0, gid = 0;
    gqp_profile *p = NULL;
    /* busy: its switch hook is under way (the tracer's current greenlet
     * may not be the one running). */
    if (!st_live(st) || st->busy ||
        gqp_tracer_current(st->tracer, &key, &gid, &p) != GQP_OK || !key) {
        smp_skipped++;
        return 0;
    }
    if (ts->context_ver != st->ctx_ver) {
        if (st->beacon) {
            atomic_store(&st->beacon->key, 0);   /* (not known: see above) */
        }
        /* A switch the hook did not see (taken out by another tool, or a
         * contextvars Context.run() under way): key may be stale. */
        smp_skipped++;
        return 0;
    }
    if (smp_tick_key[i] && smp_tick_key[i] != key) {
        smp_moved++;
    }
    if (st->beacon) {
        /* (the hooks keep it from now on) */
        atomic_store(&st->beacon->hub_key, st->hub_key);
        atomic_store(&st->beacon->key, key);
    }
    if (key == st->hub_key) {
        smp_idle++;   /* the hub: waiting for I/O or running callbacks */
        return 0;
    }
    /* From here until the route's source is found no Python runs, so the
     * sampled thread stays where it is: its frames and its greenlet (key,
     * a borrowed pointer) cannot go.  Without this, the frame objects the
     * walk makes started collections here, whose finalizers ran Python,
     * which handed the GIL to the sampled thread mid-walk: a crash within
     * seconds under tests/test_sampler.py's collection stress. */
    int gc_was = PyGC_Disable();
    PyFrameObject *f = PyThreadState_GetFrame(ts);
    if (!f) {
        if (gc_was) {
            PyGC_Enable();
        }
        smp_skipped++;
        return 0;
    }
    PyObject *codes[GQP_SMP_DEPTH];
    int lines[GQP_SMP_DEPTH];
    int n = 0;
    while (f && n < GQP_SMP_DEPTH) {
        PyCodeObject *co = PyFrame_GetCode(f);
        int own = 0;
        int line = smp_line(f, co, &own);
        if (own) {
            Py_DECREF(co);   /* (greqprof's own frames: not the app's) */
        } else {
            codes[n] = (PyObject *)co;
            lines[n] = line;
            n++;
        }
        /* (a greenlet's first frame has no caller: greenlet starts each
         * one with no current frame) */
        PyFrameObject *back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
    }
    Py_XDECREF(f);
    PyObject *name, *path;
    smp_route_source(st, w->by_addr, (PyObject *)(uintptr_t)key, gid, p,
                     &name, &path);
    if (gc_was) {
        PyGC_Enable();
    }
    /* Naming a new path or name runs Python, which may end the request,
     * stop the hooks, or reset the watch list (w): nothing of the sampled
     * thread is used after it (the code objects are held). */
    PyObject *route = smp_route_named(name, path);
    smp_table t = smp_table_hold();
    long id = n ? smp_stack_id(&t, codes, lines, n) : 0;
    if (n && !id) {
        smp_truncated++;
    }
    for (int j = 0; j < n; j++) {
        Py_DECREF(codes[j]);
    }
    if (n) {
        smp_count(&t, route, id);
        smp_samples++;
    } else {
        smp_skipped++;
    }
    smp_table_drop(&t);
    Py_DECREF(route);
    return 0;
}

static void smp_tick(void)
{
    if (!smp_tab.counts) {
        return;
    }
    for (int i = 0; i < smp_n;) {
        if (smp_sample(i) == 0) {
            i++;
        }
    }
}

/* sampler_watch(hooks_address, profile_requests): watch the calling
 * thread (whose hooks those are). */
static PyObject *smp_watch_py(PyObject *self, PyObject *const *args,
                              Py_ssize_t nargs)
{
    (void)self;
    if (want_args(nargs, 2, "sampler_watch") < 0) {
        return NULL;
    }
    gqp_py_thread *st = (gqp_py_thread *)PyLong_AsVoidPtr(args[0]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (!st || st != gqp__tls || !st->active || !PyDict_Check(args[1])) {
        PyErr_SetString(PyExc_ValueError,
                        "sampler_watch: not the calling thread's hooks");
        return NULL;
    }
    uint64_t id = PyThreadState_GetID(PyThreadState_Get());
    for (int i = 0; i < smp_n; i++) {
        if (((gqp_hookref *)smp_watched[i].ref)->st == st) {
            Py_RETURN_TRUE;
        }
    }
    if (smp_n >= GQP_SMP_THREADS) {
        Py_RETURN_FALSE;
    }
    smp_watched[smp_n].ref = Py_NewRef(st->ref);
    smp_watched[smp_n].by_addr = Py_NewRef(args[1]);
    smp_watched[smp_n].ts_id = id;
    atomic_store(&smp_beacons[smp_n].key, 0);
    atomic_store(&smp_beacons[smp_n].hub_key, 0);
    st->beacon = &smp_beacons[smp_n];
    smp_n++;
    atomic_store(&smp_watching, smp_n);
    Py_RETURN_TRUE;
}

/* sampler_setup(counts, ids, stacks, frames, frame_ids, routes, route_fn,
 *               names, name_fn, no_request, other, max_stacks,
 *               max_frames, max_keys) */
static PyObject *smp_setup_py(PyObject *self, PyObject *const *args,
                              Py_ssize_t nargs)
{
    (void)self;
    if (want_args(nargs, 14, "sampler_setup") < 0) {
        return NULL;
    }
    Py_ssize_t ms = PyLong_AsSsize_t(args[11]);
    Py_ssize_t mf = PyLong_AsSsize_t(args[12]);
    Py_ssize_t mk = PyLong_AsSsize_t(args[13]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (!PyDict_CheckExact(args[0]) || !PyDict_CheckExact(args[1]) ||
        !PyList_CheckExact(args[2]) || !PyList_CheckExact(args[3]) ||
        !PyDict_CheckExact(args[4]) || !PyDict_CheckExact(args[5]) ||
        !PyCallable_Check(args[6]) || !PyDict_CheckExact(args[7]) ||
        !PyCallable_Check(args[8]) || !PyUnicode_Check(args[9]) ||
        !PyUnicode_Check(args[10]) || ms < 1 || mk < 1 || mf < 1 ||
        mf > UINT32_MAX) {
        PyErr_SetString(PyExc_TypeError, "sampler_setup: bad arguments");
        return NULL;
    }
    PyObject **slots[] = {&smp_tab.counts, &smp_tab.ids, &smp_tab.stacks,
                          &smp_tab.frames, &smp_tab.frame_ids, &smp_routes,
                          &smp_route_fn,
                          &smp_names, &smp_name_fn, &smp_no_request,
                          &smp_other};
    for (int i = 0; i < 11; i++) {
        Py_XSETREF(*slots[i], Py_NewRef(args[i]));
    }
    smp_max_stacks = ms;
    smp_max_frames = mf;
    smp_max_keys = mk;
    smp_ticks = smp_samples = smp_idle = smp_skipped = smp_truncated = 0;
    smp_idle_nogil = smp_moved = 0;
    Py_RETURN_NONE;
}

/* sampler_run(period_ns, gen): the sampler thread's loop, while gen (from
 * sampler_stop) is the last generation asked for; the GIL is released
 * while it sleeps. */
static PyObject *smp_run_py(PyObject *self, PyObject *const *args,
                            Py_ssize_t nargs)
{
    (void)self;
    if (want_args(nargs, 2, "sampler_run") < 0) {
        return NULL;
    }
    long long period = PyLong_AsLongLong(args[0]);
    unsigned long long gen = PyLong_AsUnsignedLongLong(args[1]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (period < 100000 || period > 1000000000000000LL) {
        PyErr_SetString(PyExc_ValueError,
                        "sampler_run: period out of range");
        return NULL;
    }
    long long host_next = 0;
    uint64_t host_ver = smp_host_ver;
    struct timespec next;
    clock_gettime(CLOCK_MONOTONIC, &next);
    PyThreadState *save = PyEval_SaveThread();
    while (gen == atomic_load(&smp_gen)) {
        next.tv_nsec += period % 1000000000LL;
        next.tv_sec += period / 1000000000LL + next.tv_nsec / 1000000000L;
        next.tv_nsec %= 1000000000L;
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &next, NULL)
               == EINTR) {
        }
        if (gen != atomic_load(&smp_gen)) {
            break;
        }
        smp_ticks++;
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        long long now_ns = now.tv_sec * 1000000000LL + now.tv_nsec;
        /* Each watched thread running its hub (as its hooks last said):
         * counted idle without the GIL. */
        int n = atomic_load(&smp_watching), in_hub = 0;
        for (int i = 0; i < n; i++) {
            uint64_t k = atomic_load_explicit(&smp_beacons[i].key,
                                              memory_order_relaxed);
            smp_tick_key[i] = k;
            in_hub += k && k == atomic_load_explicit(&smp_beacons[i].hub_key,
                                                     memory_order_relaxed);
        }
        if (host_ver != atomic_load(&smp_host_ver)) {
            host_ver = atomic_load(&smp_host_ver);   /* (a new check or
                                                      * period) */
            host_next = 0;
        }
        /* The watchdog's check has nothing to find while every thread
         * with hooks is watched here and in its hub (a hub is never
         * blocking); threads not watched here need it on time. */
        int host_due = atomic_load(&smp_host_on) && now_ns >= host_next;
        int all_watched = atomic_load(&gqp_active_threads) <= n;
        int gil = in_hub < n || (host_due && !all_watched);
        if (!gil) {
            smp_idle += (unsigned long long)n;
            smp_idle_nogil += (unsigned long long)n;
        } else {
            PyEval_RestoreThread(save);
            if (gen == atomic_load(&smp_gen)) {
                smp_tick();
            }
            if (smp_host_fn && now_ns >= host_next &&
                gen == atomic_load(&smp_gen)) {
                /* (the first tick at most smp_host_period after this) */
                host_next = now_ns + smp_host_period - period;
                PyObject *fn = Py_NewRef(smp_host_fn);   /* (may change) */
                PyObject *r = PyObject_CallNoArgs(fn);
                Py_XDECREF(r);
                Py_DECREF(fn);
                PyErr_Clear();
            }
            save = PyEval_SaveThread();
            clock_gettime(CLOCK_MONOTONIC, &now);
        }
        /* Late (the GIL came after a whole period): start again from now
         * rather than sampling in a burst. */
        long long late = (now.tv_sec - next.tv_sec) * 1000000000LL +
                         (now.tv_nsec - next.tv_nsec);
        if (late > period) {
            next = now;
        }
    }
    PyEval_RestoreThread(save);
    Py_RETURN_NONE;
}

/* sampler_stop(): the running loop ends after its sleep; returns the
 * new generation (for the next sampler_run). */
static PyObject *smp_stop_py(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyLong_FromUnsignedLongLong(++smp_gen);
}

/* sampler_reset(): no thread watched (after a fork, in the child). */
static PyObject *smp_reset_py(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    smp_gen++;
    while (smp_n > 0) {
        smp_drop(smp_n - 1);
    }
    atomic_store(&smp_host_on, 0);
    Py_CLEAR(smp_host_fn);
    Py_RETURN_NONE;
}

/* sampler_host(fn, period_ns): the loop calls fn() (GIL held, errors
 * ignored) at most every period_ns, on its ticks; sampler_host(None, 0)
 * stops it. */
static PyObject *smp_host_py(PyObject *self, PyObject *const *args,
                             Py_ssize_t nargs)
{
    (void)self;
    if (want_args(nargs, 2, "sampler_host") < 0) {
        return NULL;
    }
    long long period = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (args[0] == Py_None) {
        atomic_store(&smp_host_on, 0);
        Py_CLEAR(smp_host_fn);
        Py_RETURN_NONE;
    }
    if (!PyCallable_Check(args[0]) || period < 0) {
        PyErr_SetString(PyExc_TypeError,
                        "sampler_host: a callable and a period >= 0");
        return NULL;
    }
    Py_XSETREF(smp_host_fn, Py_NewRef(args[0]));
    smp_host_period = period;
    smp_host_ver++;
    atomic_store(&smp_host_on, 1);
    Py_RETURN_NONE;
}

/* sampler_stats(): counters since sampler_setup. */
static PyObject *smp_stats_py(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return Py_BuildValue("{sKsKsKsKsKsKsKsi}", "ticks", smp_ticks,
                         "samples", smp_samples, "idle", smp_idle,
                         "skipped", smp_skipped, "truncated", smp_truncated,
                         "idle_unlocked", smp_idle_nogil, "moved", smp_moved,
                         "threads", smp_n);
}

static PyMethodDef smp_defs[] = {
    {"sampler_watch", (PyCFunction)(void (*)(void))smp_watch_py,
     METH_FASTCALL, "Samples the calling thread's stacks (internal)."},
    {"sampler_name", (PyCFunction)smp_name_py, METH_O,
     "Names the route of the calling greenlet's request (internal)."},
    {"sampler_setup", (PyCFunction)(void (*)(void))smp_setup_py,
     METH_FASTCALL, "Sets where samples are counted (internal)."},
    {"sampler_run", (PyCFunction)(void (*)(void))smp_run_py, METH_FASTCALL,
     "The sampler thread's loop (internal)."},
    {"sampler_stop", (PyCFunction)smp_stop_py, METH_NOARGS,
     "Ends the sampler's loop (internal)."},
    {"sampler_reset", (PyCFunction)smp_reset_py, METH_NOARGS,
     "Forgets the watched threads (internal)."},
    {"sampler_host", (PyCFunction)(void (*)(void))smp_host_py,
     METH_FASTCALL, "Runs a check on the sampler's ticks (internal)."},
    {"sampler_stats", (PyCFunction)smp_stats_py, METH_NOARGS,
     "The sampler's counters (internal)."},
    {NULL, NULL, 0, NULL},
};

/* Puts the sampler's functions into greqprof._registry: 0, or -1. */
static int gqp_py_sampler_init(void)
{
    if (gqp_py_init() != 0) {
        return -1;
    }
    PyGILState_STATE gs = PyGILState_Ensure();
    int rc = 0;
    PyObject *reg = PyImport_ImportModule("greqprof._registry");
    if (!smp_path_str) {
        smp_path_str = PyUnicode_InternFromString("path");
        smp_route_str = PyUnicode_InternFromString("stack_route");
        smp_final_str = PyUnicode_InternFromString("route");
        smp_greenlet_str = PyUnicode_InternFromString("greenlet");
    }
    int strs = smp_path_str && smp_route_str && smp_final_str &&
               smp_greenlet_str;
    for (PyMethodDef *d = smp_defs; reg && strs && d->ml_name; d++) {
        PyObject *fn = PyCFunction_New(d, NULL);
        if (!fn || PyObject_SetAttrString(reg, d->ml_name, fn) < 0) {
            rc = -1;
        }
        Py_XDECREF(fn);
    }
    if (!reg || !strs) {
        rc = -1;
    }
    Py_XDECREF(reg);
    PyErr_Clear();
    PyGILState_Release(gs);
    return rc;
}
