"""pprof (``profile.proto``, gzipped): ``go tool pprof``, Grafana
Pyroscope, Google Cloud Profiler and every other reader of pprof files.

A profile with function statistics (``calls=True``) becomes a call graph
of self time.  Sample types ``calls/count`` and ``<clock>/nanoseconds``
(``cpu`` or ``wall``, the profile's clock).  Each function gives one sample
per recorded caller, stack [function, caller], holding the calls that
caller made exactly and a share of the function's self time (``tsub``)
proportional to the inclusive time of those calls; the calls and time no
recorded caller accounts for go to a one-frame sample [function].  So in
``go tool pprof -top`` the flat column of every function is its self time
and its calls, exactly (to the nanosecond), the total is the sum of self
times, and the graph's edges are the recorded caller -> callee edges; the
cum column counts a function's self time plus the shares of its direct
callees only (pprof cannot rebuild deeper paths from per-edge totals).

A profile without them (``calls=False``) becomes where the request's
greenlets ran and waited.  Sample types ``count/count``, ``cpu/nanoseconds``
and ``wall/nanoseconds``: one sample per greenlet, stack [greenlet name,
``<running>``], with its spans, their CPU time and their wall time, and
one sample per wait site, stack [the site's frames leaf first...,
``<waiting>``], with its waits and the time waited (cpu 0).  ``wall``
therefore adds the time greenlets ran and the time they waited, greenlet
by greenlet (like a wall-clock profiler; concurrent greenlets make it
exceed the request's own wall time).

Labels: ``kind`` (``running``/``waiting``) and ``greenlet_id`` on span
samples; ``method`` and ``path`` on every sample of a request."""
import math

from ..pprof import ProfileBuilder
from .base import Renderer, func_key
from .offcpu import parse_stack_entry

RUNNING = "<running>"
WAITING = "<waiting>"
_I64_MAX = 2 ** 63 - 1


def _ns(seconds):
    """Seconds as nanoseconds, clamped to 0..int64 (hand-made or loaded
    profiles may hold negative or huge times; pprof values are int64)."""
    if seconds is None or not math.isfinite(seconds) or seconds <= 0:
        return 0
    ns = seconds * 1e9
    return _I64_MAX if ns >= 9.2e18 else int(round(ns))


def _cap(n):
    return min(max(n, 0), _I64_MAX)


def _split(total, weights):
    """``total`` split in proportion to ``weights`` (ints >= 0) into ints
    that add up to ``total`` exactly (largest remainders; integer
    arithmetic, so exact at any size)."""
    wsum = sum(weights)
    if total <= 0 or wsum <= 0:
        return [0] * len(weights)
    parts = [total * w // wsum for w in weights]
    left = total - sum(parts)   # (0 <= left < len(weights))
    order = sorted(range(len(weights)),
                   key=lambda i: -(total * weights[i] % wsum))
    for i in order[:left]:
        parts[i] += 1
    return parts


class PprofRenderer(Renderer):
    name = "pprof"
    extension = "pb.gz"
    binary = True
    description = ("pprof profile.proto, gzipped (go tool pprof, "
                   "Pyroscope): function statistics, or spans and waits")

    def render(self, profile):
        v = self.view(profile)
        if v.calls:
            b = _builder(v, [("calls", "count"), (v.clock, "nanoseconds")],
                         v.clock)
            _calls(v, b, _labels(v))
        else:
            b = _builder(v, [("count", "count"), ("cpu", "nanoseconds"),
                             ("wall", "nanoseconds")], "wall")
            _spans(v, b, _labels(v))
        return b.to_bytes()


def _labels(v):
    if v.kind == "request" and v.request is not None:
        return {"method": v.request.method or "",
                "path": v.request.path or ""}
    return {}


def _builder(v, types, default):
    return ProfileBuilder(
        types, default_type=default,
        period_type=(default, "nanoseconds"),
        period=1, time_nanos=_ns(v.start),
        duration_nanos=_ns(v.duration),
        comments=["greqprof %s profile: %s" % (v.kind, v.title)])


def _calls(v, b, labels):
    locs = {}

    def loc(f):
        key = func_key(f)
        lid = locs.get(key)
        if lid is None:
            name = f.full_name
            filename = "" if f.filename == "~" else f.filename
            line = _cap(f.lineno or 0)
            lid = locs[key] = b.location(
                b.function(name or "?", filename, line), line)
        return lid

    known = {func_key(f): f for f in v.calls}
    incoming = {}
    for f in v.calls:
        for c in f.children:
            if func_key(c) in known:
                incoming.setdefault(func_key(c), []).append((f, c))
    for f in v.calls:
        edges = incoming.get(func_key(f), [])
        weights = [_ns(c.ttot) for _, c in edges]
        # (what no recorded caller accounts for: calls from outside
        # the profile, a greenlet's first frame)
        rest = max(_ns(f.ttot) - sum(weights), 0)
        if sum(weights) + rest <= 0:   # (no times: split by calls)
            weights = [_cap(c.ncall) for _, c in edges]
            rest = 0 if sum(weights) else 1
        times = _split(_ns(f.tsub), weights + [rest])
        me = loc(f)
        calls_left = _cap(f.ncall)
        for (caller, c), t in zip(edges, times):
            n = min(_cap(c.ncall), calls_left)
            calls_left -= n
            b.sample([me, loc(caller)], [n, t], labels=labels)
        if calls_left or times[-1] or not edges:
            b.sample([me], [calls_left, times[-1]], labels=labels)


def _spans(v, b, labels):
    running = b.location(b.function(RUNNING))
    per = {}
    for s in v.spans:
        row = per.get(s.greenlet_id)
        if row is None:
            row = per[s.greenlet_id] = [s.greenlet_name, 0, 0, 0]
        row[1] += 1
        row[2] += _ns(s.cpu)
        row[3] += _ns(s.wall)
    for gid, (name, n, cpu, wall) in per.items():
        g = b.location(b.function(name or "greenlet"))
        b.sample([g, running], [n, _cap(cpu), _cap(wall)],
                 labels=dict(labels, kind="running"),
                 num_labels={"greenlet_id": _cap(gid)})
    waits = v.request.waits if v.request is not None else []
    if not waits:
        return
    waiting = b.location(b.function(WAITING))
    for w in waits:
        stack = list(w.stack) or ["%s:%d in %s" % (w.filename, w.lineno,
                                                   w.fn_name)]
        path = []
        for entry in reversed(stack):
            fn, file, line = parse_stack_entry(entry)
            path.append(b.location(b.function(fn or "?", file, 0),
                                   _cap(line)))
        b.sample(path + [waiting], [_cap(w.count), 0, _ns(w.seconds)],
                 labels=dict(labels, kind="waiting"))
