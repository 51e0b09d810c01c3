"""The common view every renderer works on, and the Renderer base class.

A renderer never looks at a RequestProfile or a Profiler directly: it calls
:func:`as_view`, which turns either into a :class:`ProfileView` (spans,
function statistics, greenlets, plus the request's own data when there is
one)."""
import os
from dataclasses import dataclass, field
from typing import List, Optional

from ..errors import GreqprofError
from ..request_profile import RequestProfile, Waiting
from ..stats import FuncStat, GreenletStat, Span

#: ``RequestProfile.sampled_by`` of a whole-process profile saved as JSON
PROCESS = "profiler"


class RenderError(GreqprofError, ValueError):
    """The profile cannot be rendered in the requested format (for example
    pstats of a profile recorded without function statistics)."""


@dataclass
class ProfileView:
    """What renderers draw.  Times are seconds; ``start``/``end`` seconds
    since the epoch.

    ``kind`` is ``"request"`` (a RequestProfile) or ``"process"`` (the
    whole-process Profiler); ``request`` is the RequestProfile itself for
    request views (None for a live Profiler)."""
    kind: str
    title: str
    start: float
    end: float
    spans: List[Span]
    greenlets: List[GreenletStat]
    calls: Optional[List[FuncStat]]
    clock: str = "cpu"
    request: Optional[RequestProfile] = None
    pid: int = 0
    dropped_spans: int = 0
    dropped_calls: int = 0
    blocking: list = field(default_factory=list)

    @property
    def duration(self):
        return max(self.end - self.start, 0.0)

    @property
    def origin(self):
        """Time zero of timelines: the start, or the first span when it
        began a little earlier (a span starts when its greenlet was switched
        in, which can precede the moment the request was registered)."""
        times = [self.start] + [s.start for s in self.spans] + \
            [b.start for b in self.blocking]
        return min(times)

    @property
    def horizon(self):
        """Time of the last thing on the timeline (end or last span end)."""
        return max([self.end] + [s.end for s in self.spans] +
                   [b.end for b in self.blocking])

    def is_blocking(self, span):
        """True for a span that held the event loop past the threshold
        (``long`` spans and the spans of the profile's blocking events)."""
        if span.long:
            return True
        for b in self.blocking:
            if b.greenlet_id == span.greenlet_id:
                overlap = min(b.end, span.end) - max(b.start, span.start)
                if overlap > 0.5 * min(b.wall, span.wall) or \
                        abs(b.start - span.start) < 0.001:
                    return True
        return False

    def greenlet_rows(self):
        """One GreenletStat per greenlet seen in spans or totals, in order
        of first appearance (greenlets without a total get a stub)."""
        known = {g.id: g for g in self.greenlets}
        order = []
        seen = set()
        for s in sorted(self.spans, key=lambda s: s.start):
            if s.greenlet_id not in seen:
                seen.add(s.greenlet_id)
                order.append(known.get(s.greenlet_id) or GreenletStat(
                    id=s.greenlet_id, name=s.greenlet_name,
                    fn_name=s.fn_name, cpu=None, wall=0.0, switches=0))
        for g in self.greenlets:
            if g.id not in seen:
                seen.add(g.id)
                order.append(g)
        return order

    def waiting_intervals(self):
        """(start, end) epoch intervals of a request during which none of
        its greenlets ran (the complement of its spans); [] for processes."""
        if self.kind != "request":
            return []
        out = []
        t = self.start
        for s in sorted(self.spans, key=lambda s: s.start):
            if s.start > t:
                out.append((t, min(s.start, self.end)))
            t = max(t, s.end)
            if t >= self.end:
                break
        if t < self.end:
            out.append((t, self.end))
        return [(a, b) for a, b in out if b > a]


def _request_view(p):
    if p.sampled_by == PROCESS:
        kind, title = "process", p.path or "whole process"
    else:
        kind = "request"
        title = "%s %s" % (p.method, p.path) if p.method else p.path
    return ProfileView(
        kind=kind, title=title, start=p.start, end=p.end,
        spans=list(p.spans), greenlets=list(p.greenlets), calls=p.calls,
        clock=p.clock, request=p, pid=p.pid, dropped_spans=p.dropped_spans,
        dropped_calls=p.dropped_calls, blocking=list(p.blocking))


def _profiler_view(prof):
    spans = prof.spans()
    calls = prof.func_stats() if getattr(prof, "calls", True) else None
    greenlets = prof.greenlet_stats()
    if spans:
        start = min(s.start for s in spans)
        end = max(s.end for s in spans)
    else:
        start = end = 0.0
    return ProfileView(
        kind="process", title="whole process", start=start, end=end,
        spans=spans, greenlets=greenlets, calls=calls,
        clock=getattr(prof, "clock", "cpu"), pid=os.getpid(),
        dropped_spans=getattr(prof, "dropped_spans", 0),
        dropped_calls=getattr(prof, "dropped_calls", 0))


def as_view(obj):
    """The :class:`ProfileView` of a RequestProfile, a whole-process
    Profiler (anything with ``spans()``, ``func_stats()`` and
    ``greenlet_stats()``), a ``to_dict()`` dict or a ProfileView."""
    if isinstance(obj, ProfileView):
        return obj
    if isinstance(obj, RequestProfile):
        return _request_view(obj)
    if isinstance(obj, dict):
        return _request_view(RequestProfile.from_dict(obj))
    if all(callable(getattr(obj, m, None))
           for m in ("spans", "func_stats", "greenlet_stats")):
        return _profiler_view(obj)
    raise TypeError("cannot render %r: a RequestProfile, a Profiler or a "
                    "profile dict is expected" % (type(obj).__name__,))


def to_request_profile(obj):
    """A RequestProfile holding the view's data (whole-process profiles get
    ``sampled_by="profiler"`` so they load back as process views)."""
    if isinstance(obj, RequestProfile):
        return obj
    v = as_view(obj)
    if v.request is not None:
        return v.request
    cpus = [g.cpu for g in v.greenlets if g.cpu is not None]
    longest = max(v.spans, key=lambda s: s.wall) if v.spans else None
    return RequestProfile(
        method="", path=v.title, status=None, start=v.start, end=v.end,
        wall=v.duration, cpu=sum(cpus) if cpus else None, spans=v.spans,
        longest_span=longest, waiting=Waiting(seconds=0.0), calls=v.calls,
        dropped_spans=v.dropped_spans, dropped_calls=v.dropped_calls,
        greenlets=v.greenlets, clock=v.clock, sampled_by=PROCESS, pid=v.pid)


class Renderer:
    """One output format.

    ``name`` is the registry key, ``extension`` the file suffix (without
    the dot), ``binary`` True when :meth:`render` returns bytes, and
    ``needs_calls`` True when the format is made of function statistics
    (rendering a profile without them raises :class:`RenderError`)."""
    name = ""
    extension = ""
    binary = False
    needs_calls = False
    description = ""

    def render(self, profile):
        """The rendered profile: ``str`` (``bytes`` when ``binary``)."""
        raise NotImplementedError

    def filename(self, base):
        """File name for a profile whose base name (no suffix) is ``base``."""
        return "%s.%s" % (base, self.extension)

    def view(self, profile):
        v = as_view(profile)
        if self.needs_calls and v.calls is None:
            raise RenderError(
                "%s needs function statistics, and this profile has none "
                "(record it with calls=True, or `serve --calls`)" % self.name)
        if self.needs_calls and not v.calls:
            raise RenderError("%s needs function statistics, and none were "
                              "recorded in this profile" % self.name)
        return v

    def __repr__(self):
        return "<%s renderer>" % self.name


def func_key(f):
    """Identity of a FuncStat or ChildStat: (filename, lineno, qualname)."""
    return (f.filename, f.lineno, f.qualname)
