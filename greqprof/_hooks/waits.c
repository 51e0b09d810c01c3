/* _hooks/waits.c -- wait sites: where a sampled request's greenlet
 * switched out, their records in the registry, and read_waits.
 * A part of _hooks.c (one translation unit, see there). */
#include "hooks.h"

#define GQP_PY_MAX_WAIT_SITES 20000

static uint32_t next_site_tag = 1;

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
