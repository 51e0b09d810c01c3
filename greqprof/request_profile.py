"""RequestProfile: the data of one profiled request (no rendering here).

Everything is plain data with a stable ``to_dict()`` form and ``from_dict``
/ ``load`` to read a saved profile back, so renderers can work on profiles
produced elsewhere.
"""
import json
from dataclasses import asdict, dataclass, field
from typing import List, Optional, Tuple

from .stats import ChildStat, FuncStat, GreenletStat, Span

SCHEMA = "greqprof.request_profile/1"


def _flat(record):
    """asdict() of a record whose fields are plain values (Span,
    GreenletStat): its instance dict, which holds the fields in order
    (asdict deep-copies field by field: ~10x slower)."""
    d = getattr(record, "__dict__", None)
    return dict(d) if d is not None else asdict(record)


def _func(f):
    """FuncStat.to_dict(), without asdict's recursion."""
    d = getattr(f, "__dict__", None)
    if d is None:
        return f.to_dict()
    d = dict(d)
    d["children"] = tuple(_flat(c) for c in f.children)
    d["tavg"] = f.tavg
    return d


def _size(text, kw):
    return (len(text) if kw.get("ensure_ascii", True)
            else len(text.encode("utf-8", "surrogatepass")))


def _fit(d, max_bytes, kw):
    """json.dumps(d) cut to at most max_bytes (see RequestProfile.to_json):
    callees per function to the 5 largest, then the spans (the longest,
    kept in start order) and the functions (by inclusive time) halved in
    turn, then the blocking events' stacks and the greenlets."""
    cut = {"spans": 0, "calls": 0, "children": 0}
    d = dict(d)
    d["cut"] = cut

    def text():
        return json.dumps(d, **kw)

    calls = d.get("calls")
    if calls:
        calls = [dict(f) for f in calls]
        for f in calls:
            kids = f.get("children") or []
            if len(kids) > 5:
                cut["children"] += len(kids) - 5
                f["children"] = kids[:5]
        d["calls"] = calls
    spans = d["spans"]
    out = text()
    while _size(out, kw) > max_bytes and (spans or d.get("calls")):
        calls = d.get("calls") or []
        if len(calls) * 2 > len(spans) or not spans:
            keep = len(calls) // 2
            cut["calls"] += len(calls) - keep
            d["calls"] = calls[:keep]
        else:
            keep = len(spans) // 2
            order = sorted(range(len(spans)),
                           key=lambda i: -spans[i]["wall"])[:keep]
            cut["spans"] += len(spans) - keep
            spans = d["spans"] = [spans[i] for i in sorted(order)]
        out = text()
    if _size(out, kw) > max_bytes:
        for key in ("blocking", "greenlets", "waits"):
            if d.get(key):
                cut[key] = len(d[key])
                d[key] = []
        d["longest_span"] = d["longest_span"] and dict(
            d["longest_span"], stack=None)
        out = text()
    if _size(out, kw) > max_bytes:
        # (only the header is left: cap its free text, the request's)
        for key in ("path", "error", "request_id", "status", "method"):
            if isinstance(d.get(key), str) and len(d[key]) > 256:
                d[key] = d[key][:256] + "...[cut]"
        d["waiting"] = dict(d["waiting"], top=[])
        out = text()
    return out


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
class BlockingEvent:
    """A span that held the event loop for at least the blocking threshold.

    ``stack`` is where the greenlet switched out (None when it finished);
    ``sampled_stack`` is what a watchdog saw running while the loop was
    held, when it caught it."""
    greenlet_id: int
    greenlet_name: str
    fn_name: str
    start: float
    end: float
    wall: float
    cpu: Optional[float]
    stack: Optional[str] = None
    sampled_stack: Optional[str] = None
    method: Optional[str] = None
    path: Optional[str] = None
    request_id: Optional[str] = None
    pid: int = 0
    hostname: str = ""

    def to_dict(self):
        # "schema" first: line-oriented filters (docs/production.md's jq,
        # grep) tell blocking events from profiles by the line's start.
        d = {"schema": "greqprof.blocking/1"}
        d.update(asdict(self))
        return d


@dataclass
class RequestProfile:
    """Where one request's time went.

    Times are seconds; ``start``/``end`` seconds since the epoch.  ``cpu``
    is the CPU time of the request's own greenlets (the one that ran the
    request and every greenlet it spawned, transitively); ``waiting`` the
    time it was open while other greenlets ran."""
    method: str
    path: str
    status: Optional[str]
    start: float
    end: float
    wall: float
    cpu: Optional[float]
    spans: List[Span]
    longest_span: Optional[Span]
    waiting: Waiting
    calls: Optional[List[FuncStat]]
    dropped_spans: int = 0
    dropped_calls: int = 0
    greenlets: List[GreenletStat] = field(default_factory=list)
    blocking: List[BlockingEvent] = field(default_factory=list)
    clock: str = "cpu"
    sampled_by: str = "pct"
    request_id: Optional[str] = None
    pid: int = 0
    hostname: str = ""
    error: Optional[str] = None

    # A sampled request's profile is made deferred (_sampled.c's
    # build_profile): its instance dict holds the fields above except
    # DEFERRED, plus "_loader": (loader, arg); loader(arg) builds the
    # DEFERRED fields on first access.  A sink that keeps or drops profiles
    # without reading their spans does not pay for building them.

    #: fields a deferred profile builds on first access
    DEFERRED = ("cpu", "spans", "longest_span", "waiting", "greenlets")

    def __getattr__(self, name):
        # Only reached for an attribute the instance does not have yet.
        loader = self.__dict__.get("_loader")
        if loader is None and name in self.__dict__:
            return self.__dict__[name]   # (another thread just built it)
        if loader is None or name.startswith("__"):
            raise AttributeError("%r object has no attribute %r"
                                 % (type(self).__name__, name))
        # The loader goes only once its fields are in: a second thread
        # reading meanwhile builds them too (the same data), instead of
        # finding neither; a loader that raised stays for the next read.
        self.__dict__.update(loader[0](loader[1]))
        self.__dict__.pop("_loader", None)
        return getattr(self, name)

    def __getstate__(self):
        self.spans  # noqa: B018  (builds deferred fields before pickling)
        return self.__dict__

    @property
    def longest_cpu_span(self):
        spans = [s for s in self.spans if s.cpu is not None]
        return max(spans, key=lambda s: s.cpu) if spans else self.longest_span

    @property
    def blocked(self):
        return bool(self.blocking)

    # -- serialisation ---------------------------------------------------
    def to_dict(self):
        """JSON-ready dict with stable keys (see docs/schema.md)."""
        return {
            "schema": SCHEMA,
            "method": self.method,
            "path": self.path,
            "status": self.status,
            "start": self.start,
            "end": self.end,
            "wall": self.wall,
            "cpu": self.cpu,
            "clock": self.clock,
            "sampled_by": self.sampled_by,
            "request_id": self.request_id,
            "pid": self.pid,
            "hostname": self.hostname,
            "error": self.error,
            "dropped_spans": self.dropped_spans,
            "dropped_calls": self.dropped_calls,
            "spans": [_flat(s) for s in self.spans],
            "longest_span": (_flat(self.longest_span)
                             if self.longest_span else None),
            "waiting": {
                "seconds": self.waiting.seconds,
                "complete": self.waiting.complete,
                "top": [asdict(w) for w in self.waiting.top],
            },
            "greenlets": [_flat(g) for g in self.greenlets],
            "blocking": [b.to_dict() for b in self.blocking],
            "calls": ([_func(f) for f in self.calls]
                      if self.calls is not None else None),
        }

    def to_json(self, max_bytes=None, **kw):
        """The profile as one JSON text (``json.dumps`` keywords in kw).

        max_bytes: when given and the JSON would be longer, the function
        table (each function's callees first) and the spans are cut to
        their largest entries until it fits, and ``"cut"`` counts what was
        left out, e.g. ``{"spans": 120, "calls": 3400, "children": 900}``
        (see docs/schema.md).  Log lines use it (``json_max_bytes``);
        sinks, files and the inspector get everything."""
        d = self.to_dict()
        text = json.dumps(d, **kw)
        if max_bytes is None or _size(text, kw) <= max_bytes:
            return text
        return _fit(d, max_bytes, kw)

    @classmethod
    def from_dict(cls, d):
        """Rebuilds a profile from ``to_dict()`` output."""
        if not isinstance(d, dict):
            raise ValueError("a RequestProfile dict is expected, got %s"
                             % type(d).__name__)
        schema = d.get("schema")
        if schema != SCHEMA:
            raise ValueError("unsupported profile schema %r (expected %r)"
                             % (schema, SCHEMA))

        def span(x):
            return Span(**x) if x is not None else None

        def func(x):
            x = dict(x)
            x.pop("tavg", None)
            x["children"] = tuple(ChildStat(**c) for c in x.get("children", ()))
            return FuncStat(**x)

        def blocking(x):
            x = dict(x)
            x.pop("schema", None)
            return BlockingEvent(**x)

        w = d.get("waiting") or {}
        try:
            return cls(
                method=d["method"], path=d["path"], status=d.get("status"),
                start=d["start"], end=d["end"], wall=d["wall"],
                cpu=d.get("cpu"),
                spans=[span(s) for s in d.get("spans", [])],
                longest_span=span(d.get("longest_span")),
                waiting=Waiting(seconds=w.get("seconds", 0.0),
                                complete=w.get("complete", True),
                                top=tuple(WaitedOn(**t)
                                          for t in w.get("top", []))),
                calls=([func(f) for f in d["calls"]]
                       if d.get("calls") is not None else None),
                dropped_spans=d.get("dropped_spans", 0),
                dropped_calls=d.get("dropped_calls", 0),
                greenlets=[GreenletStat(**g) for g in d.get("greenlets", [])],
                blocking=[blocking(b) for b in d.get("blocking", [])],
                clock=d.get("clock", "cpu"),
                sampled_by=d.get("sampled_by", "pct"),
                request_id=d.get("request_id"),
                pid=d.get("pid", 0), hostname=d.get("hostname", ""),
                error=d.get("error"))
        except (KeyError, TypeError) as e:
            raise ValueError("malformed RequestProfile dict: %s" % e) from e

    def save(self, path):
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f)

    @classmethod
    def load(cls, path):
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def report(self, **kw):
        """The text report (``>>> Begin RequestProfile`` ...)."""
        from .report import render_text
        return render_text(self, **kw)
