"""Plain-text rendering of RequestProfile and BlockingEvent.

Everything that came from a request (path, method, names) goes through
``safe()`` so a crafted request cannot forge log lines."""
import datetime
import re

from ._text import clean

MAX_FIELD = 1024
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


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


def _utc(ts):
    try:
        return datetime.datetime.fromtimestamp(
            ts, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f UTC")
    except (OverflowError, OSError, ValueError, TypeError):
        return "-"   # (a hand-made profile's impossible time)


def _ms(seconds):
    return "-" if seconds is None else "%.1f ms" % (seconds * 1000.0)


def _indent_stack(stack):
    # Stack text lines are already "  File ..." lines; keep them but make
    # sure nothing in them can start a line of its own that looks forged.
    return "\n".join(safe(line, 400) for line in stack.rstrip("\n").split("\n"))


def render_span(s):
    lines = [
        "Span(",
        "  greenlet_id=%d," % s.greenlet_id,
        "  greenlet_name=%s," % safe(s.greenlet_name, 200),
        "  start_time=%.1f," % (s.start * 1000.0),
        "  end_time=%.1f," % (s.end * 1000.0),
        "  duration=%s," % _ms(s.wall),
        "  cpu=%s," % _ms(s.cpu),
        "  finished=%s," % s.finished,
        "  fn_name=%s," % safe(s.fn_name, 300),
    ]
    if s.stack:
        lines.append("  stack_trace=" + _indent_stack(s.stack).lstrip())
    else:
        lines.append("  stack_trace=None")
    lines.append(")")
    return "\n".join(lines)


def render_calls(calls, limit=25):
    lines = ["Functions (by inclusive time, top %d of %d):"
             % (min(limit, len(calls)), len(calls)),
             "  %9s %9s %11s %11s %11s  %s"
             % ("ncalls", "primitive", "inclusive", "exclusive", "per call",
                "function")]
    for f in calls[:limit]:
        lines.append("  %9d %9d %11s %11s %11s  %s (%s:%d)" % (
            f.ncall, f.nactualcall, _ms(f.ttot), _ms(f.tsub), _ms(f.tavg),
            safe(f.qualname, 200), safe(f.filename, 300), f.lineno))
    return "\n".join(lines)


def render_text(p, max_spans=100, calls_limit=25):
    """The RequestProfile report in the classic gevent request profiler
    format, followed by waiting time and the function table."""
    longest_cpu = p.longest_cpu_span
    out = [
        ">>> Begin RequestProfile",
        "  Path: %s" % safe(p.path),
        "  Method: %s" % safe(p.method, 32),
        "  Status: %s" % safe(p.status, 64),
    ]
    if p.request_id:
        out.append("  Request id: %s" % safe(p.request_id, 128))
    out += [
        "  Pid: %d" % p.pid,
        "  Start time: %s" % _utc(p.start),
        "  End time: %s" % _utc(p.end),
        "  Elapsed wall time: %s" % _ms(p.wall),
        "  Elapsed CPU time: %s" % _ms(p.cpu),
        "  Number of spans: %d" % (len(p.spans) + p.dropped_spans),
        "  Longest span CPU time: %s"
        % _ms(longest_cpu.cpu if longest_cpu else None),
        "  Greenlets: %d" % len(p.greenlets),
    ]
    if p.dropped_spans:
        out.append("  Spans dropped (max_spans reached): %d"
                   % p.dropped_spans)
    if p.error:
        out.append("  Error: %s" % safe(p.error, 300))
    for s in p.spans[:max_spans]:
        out.append(render_span(s))
    if len(p.spans) > max_spans:
        out.append("... %d more spans not shown" % (len(p.spans) - max_spans))
    out.append("Waiting: %s while other greenlets ran%s" % (
        _ms(p.waiting.seconds),
        "" if p.waiting.complete else " (history incomplete)"))
    for w in p.waiting.top:
        who = "greenlet %d" % w.greenlet_id
        if w.name and w.name != "greenlet-%d" % w.greenlet_id:
            who += " " + safe(w.name, 200)
        if w.fn_name:
            who += " (%s)" % safe(w.fn_name, 300)
        out.append("  %10s  %s" % (_ms(w.seconds), who))
    out += render_waits(p.waits, dropped=p.dropped_waits)
    for b in p.blocking:
        out.append("Blocking span: %s (CPU %s) in greenlet %d %s (%s)" % (
            _ms(b.wall), _ms(b.cpu), b.greenlet_id,
            safe(b.greenlet_name, 200), safe(b.fn_name, 300)))
    if p.calls is not None:
        out.append(render_calls(p.calls, calls_limit))
    out.append("<<< End RequestProfile")
    return "\n".join(out)


def render_blocking(b):
    """The WARNING text for a blocking span."""
    where = ("during %s %s" % (safe(b.method, 32), safe(b.path))
             if b.path is not None else "outside any request")
    head = ("Blocking span: greenlet %d %s (%s) held the event loop for %s "
            "(CPU %s) %s" % (b.greenlet_id, safe(b.greenlet_name, 200),
                             safe(b.fn_name, 300), _ms(b.wall), _ms(b.cpu),
                             where))
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


def render_waits(waits, limit=5, dropped=0):
    """The ``Waited at:`` section's lines: the top `limit` wait sites
    (largest first), one line each: time waited, count, greenlets,
    ``fn_name (file:line)``.  No lines when the request never waited."""
    if not waits and not dropped:
        return []
    shown = waits[:limit]
    lines = ["Waited at: (top %d of %d sites)" % (len(shown), len(waits))]
    for w in shown:
        lines.append("  %10s %6d wait%s %4d greenlet%s  %s (%s:%d)" % (
            _ms(w.seconds), w.count, " " if w.count == 1 else "s",
            w.greenlets, " " if w.greenlets == 1 else "s",
            safe(w.fn_name, 200), safe(w.filename, 300), w.lineno))
    if dropped:
        lines.append("  (%d waits at further sites not recorded: the "
                     "table of sites was full)" % dropped)
    return lines
