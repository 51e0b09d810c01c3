"""Plain-text rendering of RequestProfile and BlockingEvent.

Everything that came from a request (path, method, names) goes through
``safe()`` so a crafted request cannot forge log lines.

The report is rendered once per sampled request when reports are logged,
so its common case is kept cheap: a profile still in its deferred form
(_sampled.c's build_profile) is rendered straight from the packed rows C
read out, without building a Span object per span (``_raw_parts``); any
other profile from its records (``_record_parts``).  Both feed the same
formatting, so the text is the same either way."""
import heapq
import os
import re
import time

from . import _lowlevel, _registry
from ._collect import (GREENLET_ROW, SPAN_ROW, WAIT_SITE_ROW, _clean_names,
                       _clean_stacks, request_names, request_records)
from ._text import clean, clean_lines

MAX_FIELD = 1024
#: spans the default report shows (the longest ones, in start order)
DEFAULT_SPANS = 10
#: greenlet lines the default report shows (by CPU, then wall time)
DEFAULT_GREENLETS = 20
#: wait sites the report shows
DEFAULT_WAITS = 5


def safe(text, limit=MAX_FIELD):
    """Untrusted text as one printable line: capped to ``limit`` characters,
    then cleaned (greqprof/_text.py: controls, line breaks, bidi and format
    characters, lone surrogates escaped).  Text greqprof recorded is clean
    already; this also covers profiles built by hand."""
    if text is None:
        return "-"
    if not isinstance(text, str):
        text = clean(text)
    if len(text) > limit:
        text = text[:limit] + "...[%d more]" % (len(text) - limit)
    return clean(text)


def _clean_safe(text, limit=MAX_FIELD):
    """safe() of text cleaned first, as the records' names and stacks are
    when a deferred profile is built (_collect): what the C renderer calls
    for a name that is not plain printable ASCII, so its report is the
    records' report."""
    return safe(clean(text), limit)


def _indent_clean_stack(stack):
    return _indent_stack(clean_lines(stack))


def _utc(ts):
    # (time.gmtime + strftime costs a third of datetime's formatting)
    try:
        us = int(round(ts * 1e6))
        secs, us = divmod(us, 1000000)
        return "%s.%06d UTC" % (time.strftime("%Y-%m-%d %H:%M:%S",
                                              time.gmtime(secs)), us)
    except (OverflowError, OSError, ValueError, TypeError):
        return "-"   # (a hand-made profile's impossible time)


def _ms(seconds):
    return "-" if seconds is None else "%.1f ms" % (seconds * 1000.0)


def _indent_stack(stack):
    # Stack text lines are already "  File ..." lines; keep them but make
    # sure nothing in them can start a line of its own that looks forged.
    return "\n".join(safe(line, 400) for line in stack.rstrip("\n").split("\n"))


#: names gevent and greenlet give a greenlet nobody named
_GENERIC = ("Greenlet", "greenlet", "")


def label(name, fn_name):
    """What a greenlet is called in reports: its name, or for a greenlet
    nobody named (gevent's "Greenlet", "Greenlet-3", greqprof's
    "greenlet-3") its function."""
    if fn_name and (name in _GENERIC or name.startswith(("Greenlet-",
                                                         "greenlet-"))):
        return fn_name
    return name


def _who(gid, name, fn_name):
    """"greenlet 3 name (function)", without repeating what is known."""
    text = "greenlet %d" % gid
    lab = label(name or "", fn_name or "")
    if lab and lab != "greenlet-%d" % gid:
        text += " " + safe(lab, 200)
    if fn_name and fn_name != lab:
        text += " (%s)" % safe(fn_name, 300)
    return text


def render_span(s):
    """One ``Span(...)`` record (a Span, on one line; its stack, when it
    has one, on the indented lines below)."""
    return _span_line(s.greenlet_id, s.greenlet_name, s.fn_name, s.start,
                      s.end, s.wall, s.cpu, s.finished, s.stack)


_SPAN = ("Span(greenlet_id=%d, greenlet_name=%s, start_time=%.1f, "
         "end_time=%.1f, duration=%.1f ms, cpu=%s, finished=%s, "
         "fn_name=%s, stack_trace=%s)")


def _span_line(gid, name, fn, start, end, wall, cpu, finished, stack,
               _cache=None):
    key = (name, fn)
    shown = _cache.get(key) if _cache is not None else None
    if shown is None:
        shown = (safe(label(name or "", fn or ""), 200), safe(fn, 300))
        if _cache is not None:
            _cache[key] = shown
    return _SPAN % (gid, shown[0], start * 1000.0, end * 1000.0,
                    wall * 1000.0,
                    "-" if cpu is None else "%.1f ms" % (cpu * 1000.0),
                    finished, shown[1],
                    "None" if not stack else
                    "\n" + _indent_stack(stack))


_CALL_ROW = "  %9d %9d %8.1f ms %8.1f ms %8.1f ms  %s (%s:%d)"


def render_calls(calls, limit=25):
    lines = ["Functions (by inclusive time, top %d of %d):"
             % (min(limit, len(calls)), len(calls)),
             "  %9s %9s %11s %11s %11s  %s"
             % ("ncalls", "primitive", "inclusive", "exclusive", "per call",
                "function")]
    for f in calls[:limit]:
        qual, filename = f.qualname, f.filename
        # (names from greqprof's records are clean already: safe() only
        # for the rest, the profiles built by hand)
        if not (type(qual) is str and len(qual) <= 200 and
                qual.isprintable()):
            qual = safe(qual, 200)
        if not (type(filename) is str and len(filename) <= 300 and
                filename.isprintable()):
            filename = safe(filename, 300)
        ncall, ttot, tsub = f.ncall, f.ttot, f.tsub
        tavg = ttot / ncall if ncall and ttot is not None else 0.0
        if ttot is not None and tsub is not None:
            # (one format per row: "%8.1f ms" is "%11s" of _ms's text)
            lines.append(_CALL_ROW % (
                ncall, f.nactualcall, ttot * 1000.0, tsub * 1000.0,
                tavg * 1000.0, qual, filename, f.lineno))
            continue
        lines.append("  %9d %9d %11s %11s %11s  %s (%s:%d)" % (
            ncall, f.nactualcall, _ms(ttot), _ms(tsub), _ms(tavg),
            qual, filename, f.lineno))
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# the report

class _Parts:
    """What the report shows, from either source: spans as
    (greenlet_id, name, fn, start, end, wall, cpu, finished, stack) in start
    order (only those shown, plus the total), greenlets as (id, name, fn,
    cpu, wall, switches)."""
    __slots__ = ("spans", "n_spans", "greenlets", "n_greenlets", "cpu",
                 "longest_cpu", "wait_s", "wait_top", "wait_complete")


def _pick(n, items, key):
    """The n largest of items by key, in their original order (all when n
    is None or covers them)."""
    if n is None or len(items) <= n:
        return items
    keep = set(map(id, heapq.nlargest(n, items, key=key)))
    return [x for x in items if id(x) in keep]


def _record_parts(p, n_spans, n_greenlets):
    parts = _Parts()
    spans = sorted(p.spans, key=lambda s: s.start)
    parts.n_spans = len(spans)
    parts.spans = [(s.greenlet_id, s.greenlet_name, s.fn_name, s.start,
                    s.end, s.wall, s.cpu, s.finished, s.stack)
                   for s in _pick(n_spans, spans, lambda s: s.wall)]
    cpus = [s.cpu for s in spans if s.cpu is not None]
    lc = p.longest_cpu_span
    parts.longest_cpu = max(cpus) if cpus else (lc.cpu if lc else None)
    gs = [(g.id, g.name, g.fn_name, g.cpu, g.wall, g.switches)
          for g in p.greenlets]
    parts.n_greenlets = len(gs)
    parts.greenlets = _pick(n_greenlets, gs,
                            lambda g: (g[3] or 0.0, g[4]))
    parts.cpu = p.cpu
    w = p.waiting
    parts.wait_s, parts.wait_complete = w.seconds, w.complete
    parts.wait_top = [(t.greenlet_id, t.name, t.fn_name, t.seconds)
                      for t in w.top]
    return parts


def _raw_parts(raw, n_spans, n_greenlets):
    """_Parts straight from read_profile's tuple (see
    _collect.request_records, whose records these lines must match)."""
    (span_rows, greenlet_rows, _longest, _end, wait_ns, top, complete,
     _ds, _dc, epoch0, wall0, names, stacks) = raw[:13]
    names = request_names(_clean_names(names))
    stacks = _clean_stacks(stacks)
    parts = _Parts()
    rows = list(SPAN_ROW.iter_unpack(span_rows))
    rows.sort(key=lambda r: r[1])   # (_collect sorts spans by start too)
    parts.n_spans = len(rows)
    if rows:
        cpu_max = max(r[3] for r in rows)
        parts.longest_cpu = cpu_max * 1e-9 if cpu_max >= 0 else None
    else:
        parts.longest_cpu = None
    shift = epoch0 - wall0
    st = stacks or {}
    out = []
    nf = ("", "")
    for gid, start, end, cpu, flags, tag in _pick(
            n_spans, rows, lambda r: r[2] - r[1]):
        name, fn = names.get(gid) or ("greenlet-%d" % gid, "")
        out.append((gid, name, fn, (start + shift) * 1e-9,
                    (end + shift) * 1e-9, (end - start) * 1e-9,
                    None if cpu < 0 else cpu * 1e-9, bool(flags & 1),
                    st.get(tag) if tag else None))
    parts.spans = out
    gs = []
    total_cpu = 0
    any_cpu = False
    for gid, wall, cpu, sw, _f, _l, _fin in GREENLET_ROW.iter_unpack(
            greenlet_rows):
        name, fn = names.get(gid) or nf
        if not name and not fn:
            name = "greenlet-%d" % gid
        if cpu >= 0:
            total_cpu += cpu
            any_cpu = True
        gs.append((gid, name, fn, None if cpu < 0 else cpu * 1e-9,
                   wall * 1e-9, sw))
    gs.sort()
    parts.n_greenlets = len(gs)
    parts.greenlets = _pick(n_greenlets, gs, lambda g: (g[3] or 0.0, g[4]))
    parts.cpu = total_cpu * 1e-9 if any_cpu else None
    parts.wait_s, parts.wait_complete = wait_ns * 1e-9, complete
    wt = []
    for gid, ns, n in top:
        name, fn = n or ("greenlet-%d" % gid, "")
        if fn and fn.startswith("greqprof."):
            continue  # (as request_records: greqprof's own greenlets)
        wt.append((gid, clean(name) or "", clean(fn) or "", ns * 1e-9))
    parts.wait_top = wt
    return parts


def _parts(p, n_spans, n_greenlets):
    loader = p.__dict__.get("_loader")
    if loader is not None:
        if loader[0] is request_records:
            try:
                return _raw_parts(loader[1], n_spans, n_greenlets)
            except (TypeError, ValueError):
                pass   # (a layout this version does not know: records)
    return _record_parts(p, n_spans, n_greenlets)


def _waits(p):
    """(p.waits, p.dropped_waits), without building a deferred profile's
    other fields (its spans: what the C renderer avoids) to read them."""
    d = p.__dict__
    if "waits" in d:
        return d["waits"] or (), d.get("dropped_waits") or 0
    loader = d.get("_loader")
    if loader is not None:
        if "waits" not in type(p).DEFERRED:
            return (), 0
        if loader[0] is _records_loader:
            waits = _raw_waits(loader[1])
            if waits is not None:
                return waits
    return getattr(p, "waits", None) or (), \
        getattr(p, "dropped_waits", 0) or 0


def _wait_rows(w):
    """read_profile's item 13 (_hooks.c's read_waits: records, stats,
    dropped, events, events dropped) as the rows the Python renderer
    reads: ((fn, filename, line, stack, ns, count, greenlets), ...) in
    table order, and dropped.  (_render.c reads item 13 as it is.)"""
    records, stats, dropped = w[0], w[1], w[2]
    rows = []
    for rec, (_key, ns, count, gl, _tag, _r) in zip(
            records, WAIT_SITE_ROW.iter_unpack(stats)):
        # (a record the registry dropped: the site's time without a name)
        _code, fn, filename, line, stack = rec or (None, "?", "", 0, ())
        rows.append((fn, filename, line, stack, ns, count, gl))
    return tuple(rows), dropped


class _Wait:
    """A wait site read from the rows (the fields render_waits reads)."""
    __slots__ = ("fn_name", "filename", "lineno", "stack", "seconds",
                 "count", "greenlets")

    def __init__(self, fn_name, filename, lineno, stack, seconds, count,
                 greenlets):
        self.fn_name, self.filename, self.lineno = fn_name, filename, lineno
        self.stack, self.seconds, self.count = stack, seconds, count
        self.greenlets = greenlets


def _raw_waits(raw):
    """A deferred profile's (wait sites, largest first; waits not
    recorded) from its rows (read_profile's item 13: read_waits' (records,
    stats, dropped, events, events dropped), the layout
    _collect.wait_sites reads), without the per-event
    records that building every field would make; None when the rows are
    not in that layout."""
    if len(raw) <= 13:
        return (), 0
    try:
        rows, dropped = _wait_rows(raw[13])
        out = [_Wait(fn, filename, line, stack, ns * 1e-9, count, greenlets)
               for fn, filename, line, stack, ns, count, greenlets in rows]
        dropped = int(dropped)
    except (TypeError, ValueError):
        return None
    out.sort(key=lambda w: -w.seconds)   # (stable, as wait_sites)
    return out, dropped


_HEAD = """>>> Begin RequestProfile
  Path: %s
  Method: %s
  Status: %s%s
  Pid: %d
  Start time: %s
  End time: %s
  Elapsed wall time: %s
  Elapsed CPU time: %s
  Number of spans: %d
  Longest span CPU time: %s
  Greenlets: %d"""


def _c_renderer():
    """_registry.render_rows (_render.c), or None when it is missing."""
    try:
        if _lowlevel.lib.gqp_render_init() == 0:
            return _registry.render_rows
    except AttributeError:   # (a _core built before _render.c)
        pass
    return None


_render_rows = _c_renderer()


#: the loader of the deferred profiles greqprof builds (their rows are
#: rendered as C read them)
_records_loader = request_records


def render_text(p, spans=DEFAULT_SPANS, calls_limit=25,
                greenlets=DEFAULT_GREENLETS, max_spans=None):
    """The RequestProfile report in the classic gevent request profiler
    format: the header, one line per greenlet, the ``spans`` longest spans
    (None: all) in start order, waiting time, wait sites, blocking spans
    and the function table.  ``max_spans`` is the old name of ``spans``."""
    if max_spans is not None:
        spans = max_spans
    d = p.__dict__
    loader = d.get("_loader")
    if loader is not None and _render_rows is not None and \
            loader[0] is _records_loader:
        # (C reads the rows as read_profile gave them, wait sites
        # included, and writes the wait sites too; the common report has
        # no section after them: C writes the end line too, saving a copy
        # of the text)
        last = not d.get("blocking") and d.get("calls") is None
        text = _render_rows(d, loader[1], spans, greenlets, safe,
                            _indent_clean_stack, last, _clean_safe)
        if text is not None:
            return text if last else _tail(p, [text], calls_limit,
                                           waits=False)
    return _render_py(p, spans, calls_limit, greenlets)


def _tail(p, out, calls_limit, waits=True):
    """The report's sections after the waiting lines (after the wait
    sites with waits=False), then its end."""
    if waits:
        sites, dropped = _waits(p)
        out.extend(render_waits(sites, DEFAULT_WAITS, dropped))
    for b in p.blocking:
        out.append("%s, %s" % (_blocking_head(b), _greenlet_of(b)))
    if p.calls is not None:
        out.append(render_calls(p.calls, calls_limit))
    out.append("<<< End RequestProfile")
    return "\n".join(out)


def _render_py(p, spans, calls_limit, greenlets):
    """render_text in Python (any profile; the C path's reference)."""
    parts = _parts(p, spans, greenlets)
    n_total = parts.n_spans + p.dropped_spans
    out = [_HEAD % (
        safe(p.path), safe(p.method, 32), safe(p.status, 64),
        "\n  Request id: %s" % safe(p.request_id, 128)
        if p.request_id else "",
        p.pid, _utc(p.start), _utc(p.end), _ms(p.wall), _ms(parts.cpu),
        n_total, _ms(parts.longest_cpu), parts.n_greenlets)]
    if p.dropped_spans:
        out.append("  Spans dropped (max_spans reached): %d"
                   % p.dropped_spans)
    if p.error:
        out.append("  Error: %s" % safe(p.error, 300))
    if parts.greenlets:
        out.append("Greenlets (CPU, wall, switches):")
        for gid, name, fn, cpu, wall, sw in parts.greenlets:
            out.append("  %10s %10s %6d  %s" % (
                _ms(cpu), _ms(wall), sw, _who(gid, name, fn)))
        if parts.n_greenlets > len(parts.greenlets):
            out.append("  ... %d more greenlets"
                       % (parts.n_greenlets - len(parts.greenlets)))
    cache = {}
    for s in parts.spans:
        out.append(_span_line(*s, _cache=cache))
    hidden = parts.n_spans - len(parts.spans)
    if hidden > 0:
        out.append("... %d more spans not shown (the %d longest are shown, "
                   "in start order; report(spans=None) shows all)"
                   % (hidden, len(parts.spans)))
    out.append(_WAITING % (
        _ms(parts.wait_s),
        "" if parts.wait_complete else " (history incomplete)",
        _WHILE if parts.wait_top else ""))
    for gid, name, fn, seconds in parts.wait_top:
        out.append("  %10s  %s" % (_ms(seconds), _who(gid, name, fn)))
    return _tail(p, out, calls_limit)


_FRAME = re.compile(r'^\s*File "(.*)", line (\d+), in (.*)$')
#: frames that are not the app's: greqprof's, gevent's (its servers too),
#: greenlet's and gunicorn's
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_NOT_APP = tuple(os.sep + d + os.sep for d in ("gevent", "greenlet",
                                                 "gunicorn"))


def blocking_site(ev):
    """Where the app was while a blocking span held the loop: "function
    (file:line)" of the innermost frame outside greqprof, gevent, greenlet
    and the server of the watchdog's stack, else of the switch-out stack;
    else the greenlet's function.  Also the key of the WARNINGs' rate
    limit (blocking.BlockingSites)."""
    for stack in (ev.sampled_stack, ev.stack):
        if not stack:
            continue
        for line in reversed(stack.rstrip("\n").split("\n")):
            m = _FRAME.match(line)
            if m is None:
                continue
            filename = m.group(1)
            if filename.startswith(_OWN_DIR) or \
                    any(d in filename for d in _NOT_APP):
                continue
            return "%s (%s:%s)" % (m.group(3), filename, m.group(2))
    return ev.fn_name or ev.greenlet_name or "greenlet %d" % ev.greenlet_id


def _greenlet_of(b):
    """"greenlet 3 name (function)" of a blocking event, without a name
    that repeats its request (the request's own greenlet) or function."""
    text = "greenlet %d" % b.greenlet_id
    lab = label(b.greenlet_name or "", b.fn_name or "")
    request = ("%s %s" % (b.method, b.path) if b.path is not None
               else None)
    if lab and lab not in (request, b.fn_name,
                           "greenlet-%d" % b.greenlet_id):
        text += " " + safe(lab, 200)
    if b.fn_name:
        text += " (%s)" % safe(b.fn_name, 300)
    return text


def _blocking_head(b):
    """Where the app was, how long the loop was held, on CPU how much."""
    return "Blocking span: %s held the event loop for %s (CPU %s)" % (
        safe(blocking_site(b), 600), _ms(b.wall), _ms(b.cpu))


def render_blocking(b):
    """The WARNING text for a blocking span: its first line names where
    the app was, then the request and the greenlet; the stacks below."""
    where = ("during %s %s" % (safe(b.method, 32), safe(b.path))
             if b.path is not None else "outside any request")
    head = "%s %s, %s" % (_blocking_head(b), where, _greenlet_of(b))
    if b.request_id:
        head += " [request id %s]" % safe(b.request_id, 128)
    parts = [head]
    if b.sampled_stack:
        parts.append("Running while the loop was held:\n"
                     + _indent_stack(b.sampled_stack))
    if b.stack:
        parts.append("Where it switched out:\n" + _indent_stack(b.stack))
    if not b.sampled_stack and not b.stack:
        parts.append("(no stack captured: the greenlet finished)")
    return "\n".join(parts)


#: the report's "Waiting:" line (_render.c writes the same): time the
#: request as a whole waited, unlike "Waited at:", which sums each of its
#: greenlets' waits (greenlets waiting at once each count)
_WAITING = "Waiting: %s with none of the request's greenlets running%s%s"
_WHILE = ", while these ran:"


def render_waits(waits, limit=5, dropped=0):
    """The ``Waited at:`` section's lines: the top `limit` wait sites
    (largest first), one line each: time waited, count, greenlets,
    ``fn_name (file:line)``.  No lines when the request never waited."""
    if not waits and not dropped:
        return []
    shown = waits[:limit]
    lines = ["Waited at: (top %d of %d sites; time each greenlet of the "
             "request was switched out there, summed)"
             % (len(shown), len(waits))]
    for w in shown:
        lines.append("  %10s %6d wait%s %4d greenlet%s  %s (%s:%d)" % (
            _ms(w.seconds), w.count, " " if w.count == 1 else "s",
            w.greenlets, " " if w.greenlets == 1 else "s",
            safe(w.fn_name, 200), safe(w.filename, 300), w.lineno))
    if dropped:
        lines.append("  (%d waits at further sites not recorded: the "
                     "table of sites was full)" % dropped)
    return lines
