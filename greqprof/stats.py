"""Plain data records returned by profilers (times in seconds)."""
from dataclasses import asdict, dataclass, field
from typing import Optional, Tuple


@dataclass(frozen=True)
class Span:
    """One uninterrupted run of one greenlet between two switches.

    ``start``/``end`` are seconds since the epoch; ``wall``/``cpu`` are
    seconds (``cpu`` is None when CPU time was not measured).  ``finished``
    is True when the greenlet ended at the end of the span; ``stack`` is where
    it was when it switched out (traceback-style text), or None when not
    captured (only long spans get one).
    """
    greenlet_id: int
    greenlet_name: str
    fn_name: str
    start: float
    end: float
    wall: float
    cpu: Optional[float]
    finished: bool
    stack: Optional[str] = None
    long: bool = False

    def to_dict(self):
        return asdict(self)


@dataclass(frozen=True)
class ChildStat:
    """Calls from one function to a callee (times in seconds)."""
    name: str
    qualname: str
    module: str
    lineno: int
    ncall: int
    nactualcall: int
    ttot: float
    tsub: float
    filename: str = ""

    def to_dict(self):
        return asdict(self)


@dataclass(frozen=True)
class FuncStat:
    """Greenlet-aware statistics of one function.

    ``ttot`` is inclusive time, counted once per outermost (non-recursive)
    frame; ``tsub`` exclusive time; ``ncall`` all calls and ``nactualcall``
    the non-recursive ones (cProfile's primitive calls).
    """
    name: str
    qualname: str
    module: str
    filename: str
    lineno: int
    ncall: int
    nactualcall: int
    ttot: float
    tsub: float
    children: Tuple[ChildStat, ...] = field(default=())

    @property
    def tavg(self):
        """Average inclusive seconds per call."""
        return self.ttot / self.ncall if self.ncall else 0.0

    @property
    def full_name(self):
        return "%s.%s" % (self.module, self.qualname) if self.module \
            else self.qualname

    def to_dict(self):
        d = asdict(self)
        d["tavg"] = self.tavg
        return d


@dataclass(frozen=True)
class GreenletStat:
    """Totals of one greenlet: seconds of CPU and wall time while it ran,
    and the number of times it was switched to."""
    id: int
    name: str
    fn_name: str
    cpu: Optional[float]
    wall: float
    switches: int
    finished: bool = False

    def to_dict(self):
        return asdict(self)


@dataclass(frozen=True)
class WaitedOn:
    """A greenlet that ran while the request waited (seconds)."""
    greenlet_id: int
    name: str
    fn_name: str
    seconds: float


@dataclass(frozen=True)
class Waiting:
    """Time the request was open while none of its greenlets ran.

    ``complete`` is False when the tracer's span history did not reach back
    to the request's start (``seconds`` is then a lower bound for the top
    list; the total is always exact)."""
    seconds: float
    top: Tuple[WaitedOn, ...] = ()
    complete: bool = True


@dataclass(frozen=True)
class WaitSite:
    """Code where the request's greenlets waited.

    Each time one of them switched out here (the innermost frame outside
    gevent and greenlet), the time until it ran again (seconds, summed over
    the greenlets); ``count`` such waits, by ``greenlets`` distinct
    greenlets.  ``stack`` is ``"file:line in function"`` strings, outermost
    first, ending at the site."""
    fn_name: str
    filename: str
    lineno: int
    stack: Tuple[str, ...]
    seconds: float
    count: int
    greenlets: int

    def to_dict(self):
        d = asdict(self)
        d["stack"] = list(self.stack)
        return d


@dataclass(frozen=True)
class WaitEvent:
    """One wait of a greenlet: switched out at ``start``, ran again at
    ``end`` (seconds since the epoch); ``site`` is the index of its
    WaitSite in ``RequestProfile.waits``."""
    greenlet_id: int
    start: float
    end: float
    site: int
