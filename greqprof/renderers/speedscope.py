"""speedscope JSON (https://www.speedscope.app, file format
https://www.speedscope.app/file-format-schema.json).

greqprof keeps aggregate call statistics, not a timeline of calls, so:

* the first profile ("functions", type ``sampled``) is the caller->callee
  tree rebuilt from the call edges: each call path is one sample whose
  weight is the exclusive time spent at the end of that path, apportioned
  from the inclusive times of the edges (depth-bounded, cycle-safe, and
  bounded in size; what a bound cuts off stays with the last frame so the
  totals are kept).  Flame graph and "left heavy" views show where time
  went; the time order inside it is not real.
* then one ``evented`` profile per greenlet: each span opens and closes a
  frame named after the greenlet's function (spans that held the event
  loop get a separate "[BLOCKING]" frame), on the profile's real time axis.
"""
import json

from .base import Renderer, func_key

SCHEMA_URL = "https://www.speedscope.app/file-format-schema.json"
MAX_DEPTH = 64
MAX_SAMPLES = 20000
MIN_US = 0.01  # paths carrying less than this many microseconds are merged


class _Frames:
    def __init__(self):
        self.frames = []
        self.index = {}

    def get(self, key, name, file=None, line=None):
        i = self.index.get(key)
        if i is None:
            i = self.index[key] = len(self.frames)
            fr = {"name": name}
            if file:
                fr["file"] = file
            if line:
                fr["line"] = line
            self.frames.append(fr)
        return i


def call_tree_samples(calls, frame_of, max_depth=MAX_DEPTH,
                      max_samples=MAX_SAMPLES):
    """(samples, weights_us) of the call tree rebuilt from FuncStat edges.

    Roots are the functions nobody calls (or, when every function is called,
    e.g. everything is in a cycle, the one with the largest inclusive time).
    A node reached with ``flow`` seconds of its function's inclusive time
    passes ``flow * edge.ttot / func.ttot`` to each callee not already on
    its path and keeps the rest as the path's exclusive weight."""
    funcs = {func_key(f): f for f in calls}
    called = set()
    for f in calls:
        for c in f.children:
            k = func_key(c)
            if k != func_key(f) and k in funcs:
                called.add(k)
    roots = [f for f in calls if func_key(f) not in called]
    if not roots and calls:
        roots = [max(calls, key=lambda f: f.ttot)]
    samples, weights = [], []

    # Iterative DFS: (function, flow seconds, path of frame indexes, keys).
    stack = [(f, f.ttot, (), frozenset()) for f in reversed(roots)]
    while stack:
        f, flow, path, on_path = stack.pop()
        key = func_key(f)
        path = path + (frame_of(f),)
        on_path = on_path | {key}
        kids = []
        # (a function under MIN_US passes nothing on: flow / f.ttot for a
        # ttot like 5e-324 from a hand-made file overflowed to inf, and
        # the weights became NaN)
        if len(path) < max_depth and f.ttot * 1e6 >= MIN_US and \
                len(samples) + len(stack) < max_samples:
            scale = flow / f.ttot
            for c in f.children:
                ck = func_key(c)
                callee = funcs.get(ck)
                if callee is None or ck in on_path:
                    continue  # unknown callee, or recursion: stays here
                share = c.ttot * scale
                if share * 1e6 >= MIN_US:
                    kids.append((callee, share))
            given = sum(s for _, s in kids)
            if given > flow:  # rounding / recursion: never exceed the flow
                kids = [(c, s * flow / given) for c, s in kids]
                given = flow
        else:
            given = 0.0
        own = flow - given
        if own * 1e6 >= MIN_US or not kids:
            samples.append(list(path))
            weights.append(round(max(own, 0.0) * 1e6, 3))
        for callee, share in reversed(kids):
            stack.append((callee, share, path, on_path))
    return samples, weights


class SpeedscopeRenderer(Renderer):
    name = "speedscope"
    extension = "speedscope.json"
    description = "speedscope JSON (call tree + one timeline per greenlet)"

    def document(self, profile):
        v = self.view(profile)
        frames = _Frames()
        profiles = []

        if v.calls:
            def frame_of(f):
                name = ("%s.%s" % (f.module, f.qualname) if f.module
                        else f.qualname)
                return frames.get(("fn",) + func_key(f), name,
                                  f.filename if f.filename != "~" else None,
                                  f.lineno or None)
            samples, weights = call_tree_samples(v.calls, frame_of)
            total = round(sum(weights), 3)
            profiles.append({
                "type": "sampled",
                "name": "functions (%s clock, rebuilt from call edges)"
                        % v.clock,
                "unit": "microseconds", "startValue": 0, "endValue": total,
                "samples": samples, "weights": weights})

        t0 = v.origin
        end = round((v.horizon - t0) * 1e6, 3)

        def at(t):
            return min(max(round((t - t0) * 1e6, 3), 0.0), end)

        by_gid = {}
        for s in v.spans:
            by_gid.setdefault(s.greenlet_id, []).append(s)
        for g in v.greenlet_rows():
            spans = sorted(by_gid.get(g.id, ()), key=lambda s: s.start)
            if not spans:
                continue
            fn = g.fn_name or g.name or "greenlet-%d" % g.id
            events = []
            last = 0.0
            for s in spans:
                blocking = v.is_blocking(s)
                fr = frames.get(("span", fn, blocking),
                                fn + (" [BLOCKING]" if blocking else ""))
                a = max(at(s.start), last)
                b = max(at(s.end), a)
                events.append({"type": "O", "frame": fr, "at": a})
                events.append({"type": "C", "frame": fr, "at": b})
                last = b
            profiles.append({
                "type": "evented",
                "name": ("greenlet %d %s %s" % (g.id, g.name, g.fn_name))
                        .strip(),
                "unit": "microseconds", "startValue": 0, "endValue": end,
                "events": events})
        if not profiles:
            profiles.append({"type": "evented", "name": "no data",
                             "unit": "microseconds", "startValue": 0,
                             "endValue": 0, "events": []})
        return {
            "$schema": SCHEMA_URL,
            "shared": {"frames": frames.frames},
            "profiles": profiles,
            "name": "greqprof %s" % v.title,
            "activeProfileIndex": 0,
            "exporter": "greqprof",
        }

    def render(self, profile):
        return json.dumps(self.document(profile), separators=(",", ":"))
