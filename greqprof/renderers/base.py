"""The common view every renderer works on, and the Renderer base class.

A renderer never looks at a RequestProfile or a Profiler directly: it calls
:func:`as_view`, which turns either into a :class:`ProfileView` (spans,
function statistics, greenlets, plus the request's own data when there is
one)."""
import bisect
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
    #: is_blocking's index of ``blocking`` (built on first use)
    _blocking_index: Optional[dict] = field(default=None, init=False,
                                            repr=False, compare=False)

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
        index = self._blocking_index
        if index is None:
            index = self._blocking_index = _index_blocking(self.blocking)
        group = index.get(span.greenlet_id)
        if group is None:
            return False
        starts, events, end_max, odd = group
        if span.wall < 0:   # (hand-made data: no shortcut is exact)
            return any(_marks(b, span) for b in events + odd)
        if any(_marks(b, span) for b in odd):
            return True
        # With both walls >= 0 an event marks the span only if the two
        # overlap or start within 1 ms: look at events starting before
        # max(span.end, span.start + 1 ms), latest first, until none
        # earlier can reach past span.start (a request's events do not
        # overlap each other, so that is a handful, not all of them).
        # (2 ms: a margin over 1 ms for rounding; _marks decides exactly)
        i = bisect.bisect_left(starts, max(span.end, span.start + 0.002))
        while i > 0:
            i -= 1
            if end_max[i] <= span.start and \
                    starts[i] <= span.start - 0.002:
                break
            if _marks(events[i], span):
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


def _marks(b, span):
    """True when blocking event ``b`` marks ``span`` (same greenlet):
    they overlap by more than half the shorter one, or start within 1 ms
    of each other."""
    overlap = min(b.end, span.end) - max(b.start, span.start)
    return overlap > 0.5 * min(b.wall, span.wall) or \
        abs(b.start - span.start) < 0.001


def _index_blocking(blocking):
    """greenlet id -> (starts, events sorted by start, running maximum of
    their ends, events with a negative wall) for ProfileView.is_blocking
    (which used to compare every span with every event: 20,000 spans and
    2,000 events took 20 s per format)."""
    groups = {}
    for b in blocking:
        groups.setdefault(b.greenlet_id, []).append(b)
    index = {}
    for gid, evs in groups.items():
        good = sorted((b for b in evs if b.wall >= 0), key=lambda b: b.start)
        end_max, top = [], float("-inf")
        for b in good:
            top = max(top, b.end)
            end_max.append(top)
        index[gid] = ([b.start for b in good], good, end_max,
                      [b for b in evs if not b.wall >= 0])
    return index


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
