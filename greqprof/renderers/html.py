"""Self-contained HTML page: summary, timeline (one row per greenlet, spans
as bars on a shared time axis, waiting time and blocking spans marked), and
the sortable function table.

The page needs no network: CSS and JS (package data next to this module)
are inlined, and a Content-Security-Policy allows exactly those two inline
blocks (by hash) and nothing else.  The profile is embedded as JSON in a
``<script type="application/json">`` block with ``<``, ``>``, ``&`` and
U+2028/9 escaped, and the JS puts every string on the page with
``textContent``: nothing from a request can become markup."""
import base64
import datetime
import hashlib
import html
import json
import os
import re

from .._text import clean
from .base import Renderer

#: spans drawn at most (a whole-process profile can hold 100000)
MAX_SPANS = 20000
_ASSET_DIR = os.path.dirname(os.path.abspath(__file__))
_assets = {}
_SLOT = re.compile(r"@@GQ_([A-Z]+)@@")


def asset(name):
    """Text of a static file shipped next to this module (cached)."""
    text = _assets.get(name)
    if text is None:
        try:
            from importlib.resources import files
            text = files(__package__).joinpath(name).read_text("utf-8")
        except (ImportError, AttributeError, FileNotFoundError):
            with open(os.path.join(_ASSET_DIR, name), encoding="utf-8") as f:
                text = f.read()
        _assets[name] = text
    return text


def _no_nan(obj):
    if isinstance(obj, float) and (obj != obj or abs(obj) == float("inf")):
        return None
    if isinstance(obj, dict):
        return {k: _no_nan(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_no_nan(v) for v in obj]
    return obj


def script_json(obj):
    """JSON that is safe inside a <script> element: no ``</script>``, no
    ``<!--``, no HTML entities, no JS line terminators (and no NaN, which
    JSON.parse rejects)."""
    try:
        text = json.dumps(obj, separators=(",", ":"), allow_nan=False)
    except ValueError:
        text = json.dumps(_no_nan(obj), separators=(",", ":"))
    return (text
            .replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("&", "\\u0026").replace("\u2028", "\\u2028")
            .replace("\u2029", "\\u2029"))


def csp_hash(text):
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return "'sha256-%s'" % base64.b64encode(digest).decode("ascii")


def content_security_policy(scripts=(), styles=()):
    """A policy allowing only the given inline script and style texts."""
    return ("default-src 'none'; script-src %s; style-src %s; img-src data:; "
            "base-uri 'none'; form-action 'self'" % (
                " ".join(csp_hash(s) for s in scripts) or "'none'",
                " ".join(csp_hash(s) for s in styles) or "'none'"))


def fill(template, values):
    """Replaces ``@@GQ_NAME@@`` slots in one pass (values are not
    rescanned, so a slot-like string inside a value stays as it is)."""
    return _SLOT.sub(lambda m: values[m.group(1)], template)


def _utc(ts):
    try:
        return datetime.datetime.fromtimestamp(
            ts, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f UTC")
    except (OverflowError, OSError, ValueError):
        return ""


def _finite(x):
    if x is None:
        return None
    x = float(x)
    return x if x == x and x not in (float("inf"), float("-inf")) else None


def page_data(v, max_spans=MAX_SPANS):
    """The JSON the page script draws (times in seconds since start)."""
    t0 = v.origin
    rows = v.greenlet_rows()
    row_of = {g.id: i for i, g in enumerate(rows)}
    stacks, stack_index = [], {}
    spans = []
    ordered = sorted(v.spans, key=lambda s: s.start)
    for s in ordered[:max_spans]:
        si = -1
        if s.stack:
            si = stack_index.get(s.stack)
            if si is None:
                si = stack_index[s.stack] = len(stacks)
                stacks.append(s.stack)
        spans.append({"r": row_of[s.greenlet_id], "t0": s.start - t0,
                      "t1": s.end - t0, "cpu": _finite(s.cpu),
                      "f": bool(s.finished), "b": v.is_blocking(s), "s": si})
    r = v.request
    cpus = [g.cpu for g in v.greenlets if g.cpu is not None]
    summary = {
        "method": r.method if r else "", "path": r.path if r else v.title,
        "status": r.status if r else None,
        "cpu": _finite(r.cpu if r else (sum(cpus) if cpus else None)),
        "waiting": r.waiting.seconds if r else 0.0,
        "waiting_complete": r.waiting.complete if r else True,
        "spans": len(v.spans) + v.dropped_spans,
        "dropped_spans": v.dropped_spans, "dropped_calls": v.dropped_calls,
        "blocking": (len(r.blocking) if r and v.kind == "request" else
                     sum(1 for s in v.spans if v.is_blocking(s))),
        "request_id": r.request_id if r else None, "pid": v.pid,
        "hostname": r.hostname if r else "",
        "error": r.error if r else None,
        "sampled_by": r.sampled_by if r else None,
        "start_utc": _utc(v.start) if v.start else "",
    }
    calls = None
    if v.calls is not None:
        calls = [{"name": f.name, "qualname": f.qualname, "module": f.module,
                  "file": f.filename, "line": f.lineno, "ncall": f.ncall,
                  "prim": f.nactualcall, "ttot": f.ttot, "tsub": f.tsub,
                  "children": [{"name": ("%s.%s" % (c.module, c.qualname)
                                         if c.module else c.qualname),
                                "ncall": c.ncall, "ttot": c.ttot}
                               for c in f.children]}
                 for f in v.calls]
    return {
        "version": 1, "kind": v.kind, "title": v.title, "clock": v.clock,
        "start": t0, "duration": v.horizon - t0, "summary": summary,
        "request": [v.start - t0, v.end - t0],
        "rows": [{"gid": g.id, "name": g.name, "fn": g.fn_name,
                  "cpu": _finite(g.cpu), "wall": g.wall,
                  "switches": g.switches, "finished": bool(g.finished)}
                 for g in rows],
        "spans": spans, "stacks": stacks,
        "truncated_spans": max(len(ordered) - max_spans, 0),
        "waiting": [[a - t0, b - t0] for a, b in v.waiting_intervals()],
        "waiting_top": ([{"gid": w.greenlet_id, "name": w.name,
                          "fn": w.fn_name, "seconds": w.seconds}
                         for w in r.waiting.top]
                        if r and v.kind == "request" else []),
        "blocking": ([{"gid": b.greenlet_id, "name": b.greenlet_name,
                       "fn": b.fn_name, "t0": b.start - t0, "wall": b.wall,
                       "cpu": _finite(b.cpu), "stack": b.stack,
                       "sampled_stack": b.sampled_stack}
                      for b in r.blocking] if r else []),
        "calls": calls,
        **_wait_data(v, row_of, t0),
    }


#: wait events drawn at most on the timeline
MAX_WAIT_EVENTS = 5000


def _wait_data(v, row_of, t0):
    """The request's wait sites (the table) and its waits one by one
    (drawn on the greenlets' rows: [row, t0, t1, site])."""
    r = v.request
    if r is None or v.kind != "request":
        return {"waits": [], "wait_events": [], "dropped_waits": 0,
                "dropped_wait_events": 0}
    return {
        "waits": [{"fn": w.fn_name, "file": w.filename, "line": w.lineno,
                   "stack": list(w.stack), "seconds": w.seconds,
                   "count": w.count, "greenlets": w.greenlets}
                  for w in r.waits],
        "wait_events": [[row_of[e.greenlet_id], e.start - t0, e.end - t0,
                         e.site]
                        for e in r.wait_events[:MAX_WAIT_EVENTS]
                        if e.greenlet_id in row_of
                        and 0 <= e.site < len(r.waits)],
        "dropped_waits": r.dropped_waits,
        "dropped_wait_events": r.dropped_wait_events,
    }


def nav_html(links):
    """``<nav>`` of (label, href) links; both are escaped."""
    if not links:
        return ""
    parts = []
    for label, href, *cls in links:
        if href is None:
            parts.append('<span class="gq-dl">%s</span>' % html.escape(label))
        else:
            parts.append('<a href="%s"%s>%s</a>' % (
                html.escape(href, quote=True),
                ' class="%s"' % html.escape(cls[0]) if cls else "",
                html.escape(label)))
    return '<nav class="gq-nav">%s</nav>' % "".join(parts)


class HtmlRenderer(Renderer):
    name = "html"
    extension = "html"
    description = "self-contained HTML page (timeline + function table)"

    def page(self, profile, nav=None):
        """(html, csp): the page and the policy it declares."""
        v = self.view(profile)
        css, js = asset("timeline.css"), asset("timeline.js")
        csp = content_security_policy(scripts=[js], styles=[css])
        text = fill(asset("timeline.html"), {
            "CSP": html.escape(csp, quote=True),
            "TITLE": html.escape("greqprof: %s" % clean(v.title[:200])),
            "CSS": css, "JS": js, "NAV": nav_html(nav),
            "DATA": script_json(page_data(v)),
        })
        return text, csp

    def render(self, profile):
        return self.page(profile)[0]
