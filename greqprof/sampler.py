"""The stack sampler (``stack_hz``): per-route CPU profiles of every request.

A real OS thread (never a greenlet, even under monkey-patching) wakes
``stack_hz`` times a second and, in C (``_hooks/sampler.c``), looks at each
serving thread a ProfilingMiddleware with ``stack_hz`` runs in: the greenlet
running there, its request (a child greenlet's is its spawner's), and its
Python stack.  A sample counts under the route mw.routes() gives its
request as soon as the app names it (set_route, the Flask and Django
hooks), under its path's name before.  Samples of the hub (waiting for
I/O, running callbacks) are left out.  Samples are counted per (route,
stack) in this process-wide table, bounded: at most MAX_STACKS distinct
stacks and MAX_KEYS (route, stack) pairs; the rest are counted under
``<other>``.
``write_pprof`` writes them as a gzipped pprof profile, ``speedscope`` and
``flame`` give them for a flame graph, all or one route's (docs/fleet.md)."""
import array
import os
import threading
import time
import weakref

from . import _lowlevel, _registry
from ._core import lib
from .pprof import ProfileBuilder
from ._text import clean
from . import routes as _routes

#: distinct stacks kept; samples of further stacks count as <other>
MAX_STACKS = 10000
#: distinct frames (code object, line) kept; a stack with another one
#: counts as <other>
MAX_FRAMES = 20000
#: distinct (route, stack) pairs kept; further samples count as
#: (<other>, <other>)
MAX_KEYS = 20000
#: route of samples of greenlets outside any request
NO_REQUEST = "<no request>"
OTHER = _routes.OTHER

if lib.gqp_py_sampler_init() != 0:   # pragma: no cover
    raise ImportError("greqprof: the stack sampler could not be set up")

_lock = threading.Lock()
_state = {"hz": 0, "pid": None}
#: the engines whose threads are sampled (their middleware checks it
#: before calling watch)
watched = weakref.WeakSet()


def route_of(path):
    """The route a sample of a request for ``path`` counts under until the
    app names its route (set_route, the Flask and Django hooks: then
    that name, as mw.routes() has it)."""
    return _routes.path_route(path)


# set_route and the framework hooks tell the sampler (in C) the route of
# the request the calling greenlet serves.
_routes._sampler_name = _registry.sampler_name


class _Table:
    """The counts the C sampler fills (read under the GIL: a dict copy is
    atomic)."""

    def __init__(self):
        self.counts = {}          # (route, stack id) -> samples
        self.ids = {}             # stack hash -> stack id
        # stack id -> its frame ids, 4 bytes each, leaf first; 0: <other>
        self.stacks = [b""]
        self.frames = []          # frame id -> (code, line)
        self.frame_ids = {}       # (code address, line) -> frame id
        self.routes = {}          # path -> route (cache)
        self.names = {}           # name the app gave -> cleaned (cache)
        # (the rate may rise: samples are weighed by the period they were
        # taken at) key -> ns of its samples before the last change, and
        # key -> its samples then
        self.ns_before = {}
        self.counted = {}
        self.start_ns = time.time_ns()
        _registry.sampler_setup(self.counts, self.ids, self.stacks,
                                self.frames, self.frame_ids, self.routes,
                                route_of, self.names, _routes.route_name,
                                NO_REQUEST, OTHER, MAX_STACKS, MAX_FRAMES,
                                MAX_KEYS)


_table = _Table()


#: the longest period the loop takes (a stack_hz as low as config allows
#: samples about twice a month)
MAX_PERIOD_NS = 10 ** 15


def period_of(hz):
    """The sampling period (ns) of hz samples per second (hz > 0)."""
    p = 1e9 / hz
    return MAX_PERIOD_NS if p >= MAX_PERIOD_NS else max(1, int(p))


def watch(eng, hz):
    """Samples the calling thread (eng's, the engine of a middleware with
    stack_hz=hz) from now on; starts the sampler thread (again after a
    fork) or raises its rate to hz."""
    pid = os.getpid()
    with _lock:
        if _state["pid"] != pid:   # (a fork's child starts afresh)
            _state.update(hz=0, pid=pid)
        if eng not in watched:
            watched.add(eng)   # (tried once, even if it fails)
            _registry.sampler_watch(eng.tracer.hooks_addr,
                                    eng.profile_requests)
        started = hz > _state["hz"]
        if started:
            if _state["hz"]:
                _rate_changes(period_of(_state["hz"]))
            _state["hz"] = hz
            period = period_of(hz)
            # (the loop runs while this generation is the last one asked
            # for: of two started back to back, the later one's rate wins)
            gen = _registry.sampler_stop()
            start, _ = _real_start()
            start(_run, (period, gen))
            _registry.sampler_tick[:] = [pid, period]
    if started:
        _watchdog_replace()


def _watchdog_replace():
    from .engine import Watchdog
    Watchdog.replace()


def rate():
    """Samples per second now (0: the sampler is off)."""
    return _state["hz"]


def _rate_changes(old_period_ns):
    """(the rate rises) What was counted so far is worth old_period_ns a
    sample.  (Samples the old loop takes before it sees the change, at
    most one tick, count at the new period.)"""
    t = _table
    now = dict(t.counts)
    for key, n in now.items():
        d = n - t.counted.get(key, 0)
        if d:
            t.ns_before[key] = t.ns_before.get(key, 0) + d * old_period_ns
    t.counted = now


def period_ns():
    """The sampling period now (0: the sampler is off)."""
    hz = _state["hz"]
    return period_of(hz) if hz else 0


def _real_start():
    from .engine import _real_thread_functions
    return _real_thread_functions()


def _run(period_ns, gen):
    try:
        _registry.sampler_run(period_ns, gen)   # (until stopped or replaced)
    except BaseException:
        # (no loop runs: a watchdog's check it was to run needs a thread)
        try:
            if _registry.sampler_tick[1] == period_ns:
                _registry.sampler_tick[:] = [0, 0]
            _watchdog_replace()
        except BaseException:
            pass


def stop():
    """Stops the sampler thread (tests; the next watch starts it again)."""
    with _lock:
        _state.update(hz=0, pid=None)
        watched.clear()
        _registry.sampler_reset()
        _registry.sampler_tick[:] = [0, 0]
    _watchdog_replace()   # (a check it ran goes back to a thread)


def reset():
    """Forgets the samples counted so far."""
    global _table
    _table = _Table()


def stats():
    """The sampler's counters: ticks, samples, idle (the hub ran),
    idle_unlocked (of those, ticks that found the hub without taking the
    GIL), moved (samples taken after the greenlet running at the tick had
    switched out), skipped, truncated (counted under <other>), threads
    watched."""
    return _registry.sampler_stats()


def _after_fork_in_child():
    global _lock
    _lock = threading.Lock()   # (maybe held by a thread now gone)
    _registry.sampler_reset()
    _registry.sampler_tick[:] = [0, 0]
    _state.update(hz=0, pid=None)
    watched.clear()
    reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def samples(route=None):
    """[(route, ((function, file, line), ...) leaf first, count)] of the
    samples so far (a stack of ``()`` is one that was not kept); only
    those of ``route`` when given."""
    return [s[:3] for s in _samples(route)]


def _samples(route, period_ns=0):
    """samples(route), each with its nanoseconds last: its count at the
    period each sample was taken at (period_ns: the current one)."""
    if route is not None and not isinstance(route, str):
        raise TypeError("route must be a str or None, got %s"
                        % type(route).__name__)
    t = _table
    counts = dict(t.counts)
    stacks = t.stacks[:]
    frames = t.frames[:]
    before, counted = t.ns_before, t.counted
    named = {}
    out = []
    for key, n in counts.items():
        r, sid = key
        if route is not None and r != route:
            continue
        ids = array.array("I", stacks[sid] if 0 <= sid < len(stacks)
                          else b"")
        ns = before.get(key, 0) + (n - counted.get(key, 0)) * period_ns
        out.append((r, tuple(_frame(frames, i, named) for i in ids), n, ns))
    return out


def _frame(frames, fid, named):
    """(function, file, line) of frame fid"""
    f = named.get(fid)
    if f is None:
        code, line = frames[fid]
        mod = _lowlevel.module_of(code.co_filename)
        qual = getattr(code, "co_qualname", code.co_name)
        f = named[fid] = ("%s.%s" % (mod, qual) if mod else qual,
                          code.co_filename, line)
    return f


def _period(period_ns):
    if isinstance(period_ns, bool) or not isinstance(period_ns, int) or \
            period_ns <= 0:
        raise ValueError("period_ns must be an int > 0, got %r"
                         % (period_ns,))
    return period_ns


def pprof_bytes(period_ns, route=None):
    """(gzipped pprof profile of the samples so far, or of ``route``'s
    only; the number of samples in it): sample types samples/count and
    cpu/nanoseconds (count x the period each was taken at, period_ns
    now), a ``route`` label on each."""
    period_ns = _period(period_ns)
    b = ProfileBuilder([("samples", "count"), ("cpu", "nanoseconds")],
                       default_type="cpu", period_type=("cpu", "nanoseconds"),
                       period=period_ns, time_nanos=_table.start_ns,
                       duration_nanos=max(0, time.time_ns() - _table.start_ns),
                       comments=["greqprof stack samples" + (
                           "" if route is None else " of one route")])
    total = 0
    other_fn = None
    for r, frames, n, ns in _samples(route, period_ns):
        if frames:
            locs = [b.location(b.function(name, file), line)
                    for name, file, line in frames]
        else:
            if other_fn is None:
                other_fn = b.function(OTHER)
            locs = [b.location(other_fn)]
        b.sample(locs, [n, ns], labels={"route": r})
        total += n
    return b.to_bytes(), total


def write_pprof(path, period_ns, route=None):
    """Writes :func:`pprof_bytes` to ``path`` (atomically: a temporary
    file renamed).  Returns the number of samples written."""
    data, total = pprof_bytes(period_ns, route)
    path = os.fspath(path)
    # (per process and thread: two writers of one path do not share it)
    tmp = "%s.tmp%d-%d" % (path, os.getpid(), threading.get_ident())
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:   # (no temporary file left behind; path as it was)
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return total


#: speedscope's file format
SPEEDSCOPE_SCHEMA = "https://www.speedscope.app/file-format-schema.json"


def speedscope(period_ns, route=None):
    """The samples so far (or ``route``'s only) as a speedscope document
    (a dict; https://www.speedscope.app opens it as a flame graph): one
    ``sampled`` profile whose stacks are root first, weighed in
    nanoseconds (count x the period each was taken at).  Without
    ``route``, each stack's root is a frame naming its route."""
    period_ns = _period(period_ns)
    frames, index = [], {}

    def frame(key, name, file=None, line=None):
        i = index.get(key)
        if i is None:
            i = index[key] = len(frames)
            fr = {"name": name}
            if file:
                fr["file"] = file
            if line:
                fr["line"] = line
            frames.append(fr)
        return i
    stacks, weights = [], []
    for r, stack, n, ns in sorted(_samples(route, period_ns),
                                  key=lambda x: (x[0], -x[2])):
        ids = [frame(f, clean(f[0]), clean(f[1]), f[2])
               for f in reversed(stack)] or \
            [frame(OTHER, OTHER)]
        if route is None:
            ids.insert(0, frame(("route", r), "route " + r))
        stacks.append(ids)
        weights.append(ns)
    total = sum(weights)
    name = "greqprof stack samples" + ("" if route is None else
                                       " of route " + route)
    return {
        "$schema": SPEEDSCOPE_SCHEMA,
        "shared": {"frames": frames},
        "profiles": [{"type": "sampled", "name": name,
                      "unit": "nanoseconds", "startValue": 0,
                      "endValue": total, "samples": stacks,
                      "weights": weights}],
        "name": name, "activeProfileIndex": 0, "exporter": "greqprof"}


def flame(route=None, min_share=0.002):
    """The samples so far (``route``'s, or every route's under one frame
    per route) merged by function into a tree for a flame graph: nodes
    ``[name, file, samples, {key: child}]`` from the root (named "all"),
    children merged by (function, file).  Branches with less than
    ``min_share`` of the samples are left out (their samples stay in
    their parent's count), which bounds the tree to about 1/min_share
    nodes per level."""
    root = ["all", "", 0, {}]
    for r, stack, n in samples(route):
        root[2] += n
        node = root
        path = [(f[0], f[1]) for f in reversed(stack)] or [(OTHER, "")]
        if route is None:
            path.insert(0, ("route " + r, ""))
        for name, file in path:
            child = node[3].get((name, file))
            if child is None:
                child = node[3][(name, file)] = [name, file, 0, {}]
            child[2] += n
            node = child
    low = root[2] * min_share

    def prune(node):
        node[3] = {k: c for k, c in node[3].items() if c[2] >= low}
        for c in node[3].values():
            prune(c)
    prune(root)   # (recursion: at most 66 levels deep)
    return root
