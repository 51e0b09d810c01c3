"""Chrome Trace Event JSON: opens in https://ui.perfetto.dev (Open trace
file) and chrome://tracing.

Layout: one process (the profile's pid); track (tid) 0 is the request, an
enclosing complete event with its waiting gaps as child events; every
greenlet has its own track named "<greenlet name> <fn_name>", each span is
a complete event ("ph": "X") with wall and CPU milliseconds in ``args``.
Spans that held the event loop are named "BLOCKING <fn>", get
``args.blocking = true`` and the "terrible" (red) colour.
Timestamps are microseconds since the profile start."""
import json

from .base import Renderer

REQUEST_TID = 0


def _ms(seconds):
    return None if seconds is None else round(seconds * 1000.0, 4)


class TraceEventRenderer(Renderer):
    name = "trace"
    extension = "trace.json"
    description = "Chrome Trace Event JSON (Perfetto, chrome://tracing)"

    def events(self, profile):
        """The profile as a dict with ``traceEvents`` (JSON-ready)."""
        v = self.view(profile)
        pid = v.pid or 1
        t0 = v.origin

        def us(t):
            return round((t - t0) * 1e6, 3)

        ev = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
               "args": {"name": "greqprof %s" % v.title}}]
        rows = v.greenlet_rows()
        # Greenlet ids are >= 1; track 0 is the request.
        tids = {g.id: g.id if g.id != REQUEST_TID else -1 for g in rows}
        if v.kind == "request":
            r = v.request
            ev.append({"ph": "M", "name": "thread_name", "pid": pid,
                       "tid": REQUEST_TID,
                       "args": {"name": "request %s" % v.title}})
            ev.append({"ph": "M", "name": "thread_sort_index", "pid": pid,
                       "tid": REQUEST_TID, "args": {"sort_index": -1}})
            ev.append({
                "ph": "X", "name": v.title or "request", "cat": "request",
                "pid": pid, "tid": REQUEST_TID, "ts": us(v.start),
                "dur": round(v.duration * 1e6, 3),
                "args": {"method": r.method, "path": r.path,
                         "status": r.status, "wall_ms": _ms(r.wall),
                         "cpu_ms": _ms(r.cpu),
                         "waiting_ms": _ms(r.waiting.seconds),
                         "request_id": r.request_id, "error": r.error,
                         "spans": len(r.spans) + r.dropped_spans,
                         "greenlets": len(r.greenlets),
                         "blocking": len(r.blocking)}})
            for a, b in v.waiting_intervals():
                ev.append({"ph": "X", "name": "waiting", "cat": "waiting",
                           "pid": pid, "tid": REQUEST_TID, "ts": us(a),
                           "dur": round((b - a) * 1e6, 3), "cname": "grey",
                           "args": {"note": "none of the request's "
                                            "greenlets ran"}})
        for i, g in enumerate(rows):
            label = ("%s %s" % (g.name, g.fn_name)).strip() or \
                "greenlet-%d" % g.id
            ev.append({"ph": "M", "name": "thread_name", "pid": pid,
                       "tid": tids[g.id], "args": {"name": label}})
            ev.append({"ph": "M", "name": "thread_sort_index", "pid": pid,
                       "tid": tids[g.id], "args": {"sort_index": i}})
        for s in v.spans:
            blocking = v.is_blocking(s)
            fn = s.fn_name or s.greenlet_name or "greenlet-%d" % s.greenlet_id
            e = {"ph": "X", "name": ("BLOCKING %s" % fn) if blocking else fn,
                 "cat": "span,blocking" if blocking else "span",
                 "pid": pid, "tid": tids[s.greenlet_id], "ts": us(s.start),
                 "dur": round(s.wall * 1e6, 3),
                 "args": {"greenlet_id": s.greenlet_id,
                          "greenlet_name": s.greenlet_name,
                          "fn_name": s.fn_name, "wall_ms": _ms(s.wall),
                          "cpu_ms": _ms(s.cpu), "finished": s.finished,
                          "blocking": blocking}}
            if s.stack:
                e["args"]["stack"] = s.stack
            if blocking:
                e["cname"] = "terrible"
            ev.append(e)
        other = {"generator": "greqprof", "title": v.title, "kind": v.kind,
                 "start_epoch": v.start, "clock": v.clock,
                 "dropped_spans": v.dropped_spans}
        return {"traceEvents": ev, "displayTimeUnit": "ms",
                "otherData": other}

    def render(self, profile):
        return json.dumps(self.events(profile), separators=(",", ":"))
