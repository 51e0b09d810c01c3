"""RequestProfile: the data of one profiled request (no rendering here).

Everything is plain data with a stable ``to_dict()`` form and ``from_dict``
/ ``load`` to read a saved profile back, so renderers can work on profiles
produced elsewhere.
"""
import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import List, Optional

from . import report as _report
from ._text import clean, clean_lines
from .stats import (ChildStat, FuncStat, GreenletStat, Span, WaitedOn,
                    WaitEvent, Waiting, WaitSite)

SCHEMA = "greqprof.request_profile/1"

#: a saved profile larger than this is refused (bytes): reading JSON takes
#: about ten times the file's size in memory
MAX_FILE_BYTES = 256 * 1024 * 1024
#: longest text field (characters) and longest list a profile may hold
MAX_TEXT = 1000000
MAX_ITEMS = 10000000
#: epoch times: 0 to year 5138 (what datetime and every renderer handle);
#: durations: at most that many seconds either way
MAX_EPOCH = 1e11
MAX_SECONDS = 1e11
MAX_INT = 2 ** 63 - 1


_REQUIRED = object()          # (no default: the key must be there)
_REQUIRED_DEFAULT = _REQUIRED
_MISSING = object()


def _no_constant(name):
    raise ValueError("%s is not a number JSON allows" % name)


def read_json(path):
    """The JSON document at ``path``, for ``RequestProfile.load`` and
    ``python -m greqprof view``: ValueError (one line, no traceback
    material) for a file that is too large, not UTF-8, not JSON, holds
    NaN/Infinity, or nests too deeply; OSError when it cannot be read."""
    return parse_json(read_bytes(path))


def read_bytes(path):
    """The bytes at ``path``, at most MAX_FILE_BYTES + 1 (read_json's
    read; a pipe too): ValueError for a file known to be larger."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_FILE_BYTES:
            raise ValueError("larger than %d MiB" % (MAX_FILE_BYTES >> 20))
        if size:
            # (what the file holds, not the cap: read(cap) reserves 256 MiB)
            data = f.read(size + 1)
        else:   # (a pipe or a /proc file: no size, read up to the cap)
            chunks, n = [], 0
            while n <= MAX_FILE_BYTES:
                chunk = f.read(1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
                n += len(chunk)
            data = b"".join(chunks)
    return data


def parse_json(data):
    """read_json's checks on bytes already read."""
    if len(data) > MAX_FILE_BYTES:
        raise ValueError("larger than %d MiB" % (MAX_FILE_BYTES >> 20))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    except ValueError as e:   # (JSONDecodeError, too many digits, NaN)
        raise ValueError("not valid JSON: %s" % clean(str(e), 200)) \
            from None


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
    the notes to what is left beside the rest (a quarter of the line at
    least), callees per function to the 5 largest, then the spans (the
    longest, kept in start order) and the functions (by inclusive time)
    halved in turn, then the blocking events' stacks and the greenlets,
    then every text (_fit_texts)."""
    cut = {"spans": 0, "calls": 0, "children": 0}
    d = dict(d)
    d["cut"] = cut

    def text():
        return json.dumps(d, **kw)

    notes = d.get("notes")
    if notes:
        d["notes"] = []
        room = max(max_bytes - _size(text(), kw), max_bytes // 4)
        d["notes"] = _fit_notes(notes, room, kw, cut)
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
    while _size(out, kw) > max_bytes and (spans or d.get("calls") or
                                          d.get("wait_events")):
        calls = d.get("calls") or []
        events = d.get("wait_events") or []
        if events and len(events) >= len(spans) and \
                len(events) >= 2 * len(calls):
            # (the timeline's waits: the longest kept, in order)
            keep = len(events) // 2
            order = sorted(range(len(events)), key=lambda i: -(
                events[i].get("end", 0) - events[i].get("start", 0)))[:keep]
            cut["wait_events"] = cut.get("wait_events", 0) + \
                len(events) - keep
            d["wait_events"] = [events[i] for i in sorted(order)]
        elif len(calls) * 2 > len(spans) or not spans:
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
        d["waiting"] = dict(d["waiting"], top=[])
        out = text()
    if _size(out, kw) > max_bytes and d.get("notes"):
        cut["notes"] = cut.get("notes", 0) + len(d["notes"])
        d["notes"] = []
        out = text()
    if _size(out, kw) > max_bytes:
        # (only the header is left, with text as long as the app made it)
        out = _fit_texts(d, max_bytes, kw, cut)
    if _size(out, kw) > max_bytes and d.get("longest_span"):
        cut["longest_span"] = 1   # (the last thing to go but the header)
        d["longest_span"] = None
        out = _fit_texts(d, max_bytes, kw, cut)
    return out


def _fit_notes(notes, room, kw, cut):
    """The first notes whose JSON fits in room bytes, the one that crosses
    it shortened (marked like clean's cuts); cut["notes"] counts the notes
    left out."""
    kept = []
    used = 2   # ("[]")
    for note in notes:
        size = _size(json.dumps(note, **kw), kw) + 2   # (", ")
        if used + size > room:
            left = room - used - 2
            if left >= 64 and isinstance(note, str):
                # the longest start of it that fits
                lo, hi = 0, len(note)
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if _size(json.dumps(_cap(note, mid), **kw), kw) <= left:
                        lo = mid
                    else:
                        hi = mid - 1
                kept.append(_cap(note, lo))
            break
        kept.append(note)
        used += size
    if kept != notes:
        cut["notes"] = len(notes) - len(kept)
    return kept


def _cap(text, limit, tail=False):
    """text cut to limit characters, marked as clean() marks its cuts
    (``...[N more]``); tail: the end is kept (a stack's innermost frames),
    the mark first."""
    if len(text) <= limit:
        return text
    more = len(text) - limit
    if tail:
        return "...[%d more]%s" % (more, text[more:])
    return "%s...[%d more]" % (text[:limit], more)


#: texts whose end is kept when they are cut (stacks: the innermost frames)
_TAIL_KEYS = frozenset(("stack", "sampled_stack"))
#: the texts a JSON line is identified by: never cut
_KEEP_KEYS = frozenset(("schema",))


def _cap_texts(obj, limit, n, key=None):
    """obj (JSON-ready) with every text longer than limit characters cut
    (n[0] counts them)."""
    if isinstance(obj, str):
        if len(obj) <= limit or key in _KEEP_KEYS:
            return obj
        n[0] += 1
        return _cap(obj, limit, key in _TAIL_KEYS)
    if isinstance(obj, dict):
        return {k: _cap_texts(v, limit, n, k) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_cap_texts(v, limit, n, key) for v in obj]
    return obj


def _fit_texts(d, max_bytes, kw, cut=None):
    """json.dumps(d) with its longest texts cut, shorter and shorter, until
    it fits in max_bytes (or every text is down to its mark).  ``cut``
    (d's counts of what was left out, else a new one) gains "texts": how
    many texts were cut; it goes under "cut" in the line."""
    cut = dict(cut or {})
    d = {k: v for k, v in d.items() if k != "cut"}
    out = json.dumps(d, **kw)
    for limit in (4096, 1024, 256, 64, 16, 0):
        if _size(out, kw) <= max_bytes:
            break
        n = [0]
        capped = _cap_texts(d, limit, n)
        capped["cut"] = dict(cut, texts=n[0])
        out = json.dumps(capped, **kw)
    return out


def fit_json(d, max_bytes=None, **kw):
    """json.dumps(d, **kw) at most max_bytes long (None: no limit): a
    longer one has its longest texts cut (each marked ``...[N more]``;
    stacks keep their innermost frames) and a "cut" key with "texts", how
    many.  For log lines that are not profiles (blocking events and
    summaries)."""
    out = json.dumps(d, **kw)
    if max_bytes is None or _size(out, kw) <= max_bytes:
        return out
    return _fit_texts(d, max_bytes, kw)


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

    def to_json(self, max_bytes=None, **kw):
        """The event as one JSON text (``json.dumps`` keywords in kw); with
        max_bytes, its longest texts are cut to fit (see fit_json)."""
        return fit_json(self.to_dict(), max_bytes, **kw)


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
    #: where the greenlets waited, largest first (see WaitSite)
    waits: List[WaitSite] = field(default_factory=list)
    #: waits not recorded: the profile's table of sites was full
    dropped_waits: int = 0
    #: the first waits one by one (1024 at most), in the order they ended
    wait_events: List[WaitEvent] = field(default_factory=list)
    #: waits not kept one by one: wait_events was full (the sites still
    #: count them)
    dropped_wait_events: int = 0
    #: what the app attached with ``greqprof.current_profile().note()``
    notes: List[str] = field(default_factory=list)
    #: True when the profile was closed by ``max_lifetime`` before the
    #: request ended (what came after is not in it)
    truncated: bool = False

    # A sampled request's profile is made deferred (_sampled.c's
    # build_profile): its instance dict holds the fields above except
    # DEFERRED, plus "_loader": (loader, arg); loader(arg) builds the
    # DEFERRED fields on first access.  A sink that keeps or drops profiles
    # without reading their spans does not pay for building them.

    #: fields a deferred profile builds on first access
    DEFERRED = ("cpu", "spans", "longest_span", "waiting", "greenlets",
                "waits", "dropped_waits", "wait_events",
                "dropped_wait_events")

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
            "notes": list(self.notes),
            "truncated": bool(self.truncated),
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
            "waits": [w.to_dict() for w in self.waits],
            "dropped_waits": self.dropped_waits,
            "wait_events": [asdict(e) for e in self.wait_events],
            "dropped_wait_events": self.dropped_wait_events,
            "calls": ([_func(f) for f in self.calls]
                      if self.calls is not None else None),
        }

    def to_json(self, max_bytes=None, **kw):
        """The profile as one JSON text (``json.dumps`` keywords in kw).

        max_bytes: when given and the JSON would be longer, the notes, the
        function table (each function's callees first) and the spans are
        cut to their largest entries until it fits, then the texts (marked
        ``...[N more]``), and ``"cut"`` counts what was left out, e.g.
        ``{"spans": 120, "calls": 3400, "children": 900}`` (see
        docs/schema.md).  1024 bytes always fit the header that is left
        last; a smaller max_bytes gets that header, longer.  Log lines use
        it (``json_max_bytes``); sinks, files and the inspector get
        everything."""
        d = self.to_dict()
        text = json.dumps(d, **kw)
        if max_bytes is None or _size(text, kw) <= max_bytes:
            return text
        return _fit(d, max_bytes, kw)

    # (from_dict, save, load below)

    @classmethod
    def from_dict(cls, d):
        """Rebuilds a profile from ``to_dict()`` output.

        Every field is checked (types, finite numbers, sizes: see
        ``_Reader``); anything else raises ValueError naming the field.
        Text is cleaned like text greqprof records (greqprof/_text.py), so
        a profile saved before that rule, or edited by hand, renders as
        escaped text.  Unknown keys are ignored at the top level and refused
        in records (spans, calls, ...)."""
        if not isinstance(d, dict):
            raise ValueError("a RequestProfile dict is expected, got %s"
                             % type(d).__name__)
        schema = d.get("schema")
        if schema != SCHEMA:
            raise ValueError("unsupported profile schema %s (expected %r)"
                             % (clean(repr(schema), 80), SCHEMA))
        try:
            return cls._from_dict(d)
        except ValueError as e:
            raise ValueError("malformed RequestProfile dict: %s" % e) \
                from None

    @classmethod
    def _from_dict(cls, d):
        r = _Reader()
        span = r.span
        w = r.dict(d, "waiting", "waiting", optional=True) or {}
        calls = r.list(d, "calls", "calls", optional=True)
        return cls(
            method=r.text(d, "method", "method"),
            path=r.text(d, "path", "path"),
            status=r.text(d, "status", "status", optional=True),
            start=r.time(d, "start", "start"),
            end=r.time(d, "end", "end"),
            wall=r.seconds(d, "wall", "wall"),
            cpu=r.seconds(d, "cpu", "cpu", optional=True),
            spans=[span(x, "spans[%d]" % i) for i, x in
                   enumerate(r.list(d, "spans", "spans", default=[]))],
            longest_span=(span(d["longest_span"], "longest_span")
                          if d.get("longest_span") is not None else None),
            waiting=Waiting(
                seconds=r.seconds(w, "seconds", "waiting.seconds",
                                  default=0.0),
                complete=r.bool(w, "complete", "waiting.complete",
                                default=True),
                top=tuple(r.waited(x, "waiting.top[%d]" % i) for i, x in
                          enumerate(r.list(w, "top", "waiting.top",
                                           default=[])))),
            calls=([r.func(x, "calls[%d]" % i) for i, x in enumerate(calls)]
                   if calls is not None else None),
            dropped_spans=r.count(d, "dropped_spans", "dropped_spans",
                                  default=0),
            dropped_calls=r.count(d, "dropped_calls", "dropped_calls",
                                  default=0),
            greenlets=[r.greenlet(x, "greenlets[%d]" % i) for i, x in
                       enumerate(r.list(d, "greenlets", "greenlets",
                                        default=[]))],
            blocking=[r.blocking(x, "blocking[%d]" % i) for i, x in
                      enumerate(r.list(d, "blocking", "blocking",
                                       default=[]))],
            clock=r.text(d, "clock", "clock", default="cpu"),
            sampled_by=r.text(d, "sampled_by", "sampled_by", default="pct"),
            request_id=r.text(d, "request_id", "request_id", optional=True),
            pid=r.count(d, "pid", "pid", default=0),
            hostname=r.text(d, "hostname", "hostname", default=""),
            error=r.text(d, "error", "error", optional=True),
            waits=[r.wait_site(x, "waits[%d]" % i) for i, x in
                   enumerate(r.list(d, "waits", "waits", default=[]))],
            dropped_waits=r.count(d, "dropped_waits", "dropped_waits",
                                  default=0),
            wait_events=[r.wait_event(x, "wait_events[%d]" % i) for i, x in
                         enumerate(r.list(d, "wait_events", "wait_events",
                                          default=[]))],
            dropped_wait_events=r.count(d, "dropped_wait_events",
                                        "dropped_wait_events", default=0),
            notes=[r.text({"n": x}, "n", "notes[%d]" % i) for i, x in
                   enumerate(r.list(d, "notes", "notes", default=[]))],
            truncated=r.bool(d, "truncated", "truncated", default=False))

    def save(self, path):
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f)

    @classmethod
    def load(cls, path):
        """The profile saved at ``path`` (ValueError for a file that is not
        one: not UTF-8, not JSON, too large, too deeply nested, a field of
        the wrong type...; OSError when it cannot be read)."""
        return cls.from_dict(read_json(path))

    def report(self, **kw):
        """The text report (``>>> Begin RequestProfile`` ...)."""
        # (the module, not the function: render_text stays replaceable)
        return _report.render_text(self, **kw)


class _Reader:
    """Typed access to the fields of a profile dict; every failure is a
    ValueError naming the field (``where``)."""

    @staticmethod
    def _get(d, key, where, optional, default):
        if key not in d:
            if optional or default is not _REQUIRED:
                return _MISSING
            raise ValueError("%s is missing" % where)
        v = d[key]
        if v is None:
            if optional:
                return None
            raise ValueError("%s is null" % where)
        return v

    def text(self, d, key, where, optional=False, default=_REQUIRED_DEFAULT,
             lines=False):
        v = self._get(d, key, where, optional, default)
        if v is _MISSING:
            return None if default is _REQUIRED else default
        if v is None:
            return None
        if not isinstance(v, str):
            raise ValueError("%s: text expected, got %s"
                             % (where, type(v).__name__))
        if len(v) > MAX_TEXT:
            raise ValueError("%s: longer than %d characters"
                             % (where, MAX_TEXT))
        return clean_lines(v) if lines else clean(v)

    def _number(self, d, key, where, optional, default, lo, hi):
        v = self._get(d, key, where, optional, default)
        if v is _MISSING:
            return None if default is _REQUIRED else default
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError("%s: a number expected, got %s"
                             % (where, type(v).__name__))
        try:
            x = float(v)
        except OverflowError:
            x = math.inf
        if not (lo <= x <= hi):
            raise ValueError("%s: %s is out of range (%g to %g)"
                             % (where, clean(repr(v), 40), lo, hi))
        return x

    def time(self, d, key, where, optional=False, default=_REQUIRED_DEFAULT):
        return self._number(d, key, where, optional, default, 0.0, MAX_EPOCH)

    def seconds(self, d, key, where, optional=False,
                default=_REQUIRED_DEFAULT):
        return self._number(d, key, where, optional, default, -MAX_SECONDS,
                            MAX_SECONDS)

    def duration(self, d, key, where, optional=False,
                 default=_REQUIRED_DEFAULT):
        """Seconds from 0: the wall time of a span or blocking event (a
        negative one would also defeat the renderers' index of blocking
        events, see ProfileView.is_blocking)."""
        return self._number(d, key, where, optional, default, 0.0,
                            MAX_SECONDS)

    def count(self, d, key, where, optional=False,
              default=_REQUIRED_DEFAULT):
        v = self._get(d, key, where, optional, default)
        if v is _MISSING:
            return None if default is _REQUIRED else default
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or \
                not 0 <= v <= MAX_INT:
            raise ValueError("%s: an integer from 0 to 2**63-1 expected, "
                             "got %s" % (where, clean(repr(v), 40)))
        return v

    def bool(self, d, key, where, optional=False, default=_REQUIRED_DEFAULT):
        v = self._get(d, key, where, optional, default)
        if v is _MISSING:
            return None if default is _REQUIRED else default
        if not isinstance(v, bool):
            raise ValueError("%s: true or false expected, got %s"
                             % (where, clean(repr(v), 40)))
        return v

    def list(self, d, key, where, optional=False, default=_REQUIRED_DEFAULT):
        v = self._get(d, key, where, optional, default)
        if v is _MISSING:
            return None if default is _REQUIRED else default
        if v is None:
            return None
        if not isinstance(v, (list, tuple)):
            raise ValueError("%s: a list expected, got %s"
                             % (where, type(v).__name__))
        if len(v) > MAX_ITEMS:
            raise ValueError("%s: more than %d items" % (where, MAX_ITEMS))
        return v

    def dict(self, d, key, where, optional=False, default=_REQUIRED_DEFAULT):
        v = self._get(d, key, where, optional, default)
        if v is _MISSING or v is None:
            return None
        return self.obj(v, where)

    @staticmethod
    def obj(x, where, fields=None):
        if not isinstance(x, dict):
            raise ValueError("%s: an object expected, got %s"
                             % (where, type(x).__name__))
        if fields is not None:
            for k in x:
                if k not in fields:
                    raise ValueError("%s: unknown field %s"
                                     % (where, clean(repr(k), 60)))
        return x

    def span(self, x, where):
        x = self.obj(x, where, _SPAN_FIELDS)
        w = where + "."
        return Span(
            self.count(x, "greenlet_id", w + "greenlet_id"),
            self.text(x, "greenlet_name", w + "greenlet_name"),
            self.text(x, "fn_name", w + "fn_name"),
            self.time(x, "start", w + "start"),
            self.time(x, "end", w + "end"),
            self.duration(x, "wall", w + "wall"),
            self.seconds(x, "cpu", w + "cpu", optional=True),
            self.bool(x, "finished", w + "finished"),
            self.text(x, "stack", w + "stack", optional=True, lines=True),
            self.bool(x, "long", w + "long", default=False))

    def waited(self, x, where):
        x = self.obj(x, where, _WAITED_FIELDS)
        w = where + "."
        return WaitedOn(
            greenlet_id=self.count(x, "greenlet_id", w + "greenlet_id"),
            name=self.text(x, "name", w + "name"),
            fn_name=self.text(x, "fn_name", w + "fn_name"),
            seconds=self.seconds(x, "seconds", w + "seconds"))

    def wait_site(self, x, where):
        x = self.obj(x, where, _WAIT_SITE_FIELDS)
        w = where + "."
        stack = self.list(x, "stack", w + "stack", default=[])
        return WaitSite(
            fn_name=self.text(x, "fn_name", w + "fn_name"),
            filename=self.text(x, "filename", w + "filename"),
            lineno=self.count(x, "lineno", w + "lineno"),
            stack=tuple(self.text({"s": f}, "s", "%sstack[%d]" % (w, n))
                        for n, f in enumerate(stack)),
            seconds=self.seconds(x, "seconds", w + "seconds"),
            count=self.count(x, "count", w + "count"),
            greenlets=self.count(x, "greenlets", w + "greenlets"))

    def wait_event(self, x, where):
        x = self.obj(x, where, _WAIT_EVENT_FIELDS)
        w = where + "."
        return WaitEvent(
            greenlet_id=self.count(x, "greenlet_id", w + "greenlet_id"),
            start=self.time(x, "start", w + "start"),
            end=self.time(x, "end", w + "end"),
            site=self.count(x, "site", w + "site"))

    def greenlet(self, x, where):
        x = self.obj(x, where, _GREENLET_FIELDS)
        w = where + "."
        return GreenletStat(
            id=self.count(x, "id", w + "id"),
            name=self.text(x, "name", w + "name"),
            fn_name=self.text(x, "fn_name", w + "fn_name"),
            cpu=self.seconds(x, "cpu", w + "cpu", optional=True),
            wall=self.seconds(x, "wall", w + "wall"),
            switches=self.count(x, "switches", w + "switches"),
            finished=self.bool(x, "finished", w + "finished",
                               default=False))

    def blocking(self, x, where):
        x = self.obj(x, where, _BLOCKING_FIELDS)
        w = where + "."
        return BlockingEvent(
            greenlet_id=self.count(x, "greenlet_id", w + "greenlet_id"),
            greenlet_name=self.text(x, "greenlet_name", w + "greenlet_name"),
            fn_name=self.text(x, "fn_name", w + "fn_name"),
            start=self.time(x, "start", w + "start"),
            end=self.time(x, "end", w + "end"),
            wall=self.duration(x, "wall", w + "wall"),
            cpu=self.seconds(x, "cpu", w + "cpu", optional=True),
            stack=self.text(x, "stack", w + "stack", optional=True,
                            lines=True),
            sampled_stack=self.text(x, "sampled_stack", w + "sampled_stack",
                                    optional=True, lines=True),
            method=self.text(x, "method", w + "method", optional=True),
            path=self.text(x, "path", w + "path", optional=True),
            request_id=self.text(x, "request_id", w + "request_id",
                                 optional=True),
            pid=self.count(x, "pid", w + "pid", default=0),
            hostname=self.text(x, "hostname", w + "hostname", default=""))

    def _stat_fields(self, x, w):
        return dict(
            name=self.text(x, "name", w + "name"),
            qualname=self.text(x, "qualname", w + "qualname"),
            module=self.text(x, "module", w + "module"),
            filename=self.text(x, "filename", w + "filename", default=""),
            lineno=self.count(x, "lineno", w + "lineno"),
            ncall=self.count(x, "ncall", w + "ncall"),
            nactualcall=self.count(x, "nactualcall", w + "nactualcall"),
            ttot=self.seconds(x, "ttot", w + "ttot"),
            tsub=self.seconds(x, "tsub", w + "tsub"))

    def func(self, x, where):
        x = self.obj(x, where, _FUNC_FIELDS)
        w = where + "."
        kids = self.list(x, "children", w + "children", default=[])
        return FuncStat(children=tuple(
            ChildStat(**self._stat_fields(self.obj(c, "%schildren[%d]"
                                                   % (w, i), _CHILD_FIELDS),
                                          "%schildren[%d]." % (w, i)))
            for i, c in enumerate(kids)), **self._stat_fields(x, w))


def _fields(cls, *extra):
    return frozenset(cls.__dataclass_fields__) | frozenset(extra)


# (keys to_dict writes for each record: anything else is refused)
_SPAN_FIELDS = _fields(Span)
_WAITED_FIELDS = _fields(WaitedOn)
_WAIT_SITE_FIELDS = _fields(WaitSite)
_WAIT_EVENT_FIELDS = _fields(WaitEvent)
_GREENLET_FIELDS = _fields(GreenletStat)
_BLOCKING_FIELDS = _fields(BlockingEvent, "schema")
_FUNC_FIELDS = _fields(FuncStat, "tavg")
_CHILD_FIELDS = _fields(ChildStat)
