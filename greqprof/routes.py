"""Route names for requests, and per-route aggregates with a bounded table.

A request's route is, first to last (the first that gives a name wins):

1. ``set_route(name)``, called by the app while it serves the request;
2. the framework's route template: Flask's matched ``url_rule`` (through
   :func:`install_flask_hook`), Django's ``resolver_match.route`` (through
   :class:`DjangoRouteMiddleware`), or anything that put a template under
   ``environ[ROUTE_KEY]``;
3. the ``route=`` callable, ``environ -> str`` (None: no opinion);
4. the request path with id-like segments (integers, UUIDs, hex of 16
   characters or more) replaced by ``{id}``: ``/items/123/detail`` ->
   ``/items/{id}/detail``.

Names are clean text (greqprof/_text.py) of at most ``MAX_ROUTE``
characters.  :class:`RouteTable` keeps at most ``max_routes`` of them;
requests of any further route are counted under ``OTHER``.

Nothing here runs per greenlet switch or per function call.  The
middleware counts every request in C (greqprof/_routes.c: requests,
errors, status classes, the wall histogram below) and calls the namer
here only for what C does not name itself; :class:`RouteAggregates` joins
those counts with what sampled requests and blocking events add."""
import bisect
import codecs
import collections
import itertools
import math
import re
import sys
import threading
import time
import zlib
from array import array

from greenlet import getcurrent

from ._lowlevel import RealLock as _RealLock, RealRLock as _RealRLock
from ._text import clean

__all__ = ["set_route", "path_route", "framework_route", "RouteNamer",
           "RouteTable", "RouteStats", "WallHistogram", "DjangoRouteMiddleware",
           "install_flask_hook", "RouteAggregates", "take_route",
           "ROUTE_KEY", "OTHER", "ID", "MAX_ROUTE",
           "MAX_ROUTES"]

#: environ key under which a framework hook leaves the route template
ROUTE_KEY = "greqprof.route"
#: the route that counts the requests of routes past ``max_routes``
OTHER = "<other>"
#: what replaces an id-like path segment
ID = "{id}"
#: longest route name (characters, after cleaning); longer ones are cut
#: and end in "..."
MAX_ROUTE = 200
#: default ``max_routes``
MAX_ROUTES = 500
#: characters of a path looked at (a longer path is cut first: the name
#: is cut to MAX_ROUTE anyway)
_MAX_PATH = 4 * MAX_ROUTE

# (long hex needs a digit: "/facadefacadefacade" is a word)
_ID_SEGMENT = re.compile(
    r"[0-9]+|(?=[a-fA-F]*[0-9])[0-9a-fA-F]{16,}|"
    r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-"
    r"[0-9a-fA-F]{12}")


def _name(text):
    """Clean text of at most MAX_ROUTE characters."""
    text = clean(text)
    if len(text) > MAX_ROUTE:
        text = text[:MAX_ROUTE - 3] + "..."
    return text


def route_name(name):
    """``name`` as mw.routes() shows it (clean, cut); ``OTHER`` for
    an empty one."""
    return _name(name) or OTHER


#: set by greqprof.sampler: sampler_name(name) tells the stack sampler the
#: route of the request the calling greenlet serves (C; True if found)
_sampler_name = None


def _tell_sampler(name, hook=False):
    fn = _sampler_name
    if hook and _named and getcurrent() in _named:
        return   # (set_route's name wins over a template)
    if fn is not None:
        try:
            fn(name)
        except Exception:
            pass


# ---------------------------------------------------------------------------
# set_route: a name per greenlet, taken by the request it serves

#: greenlet -> the name set_route gave its request; the middleware takes
#: it (in C) when the request ends, so nothing is paid per request while
#: nobody calls set_route
_named = {}
#: bound of _named: names set where no request ever takes them (outside
#: any middleware) are dropped past it
_MAX_NAMED = 10000


def set_route(name):
    """Names the route of the request the calling greenlet (or thread)
    serves: it wins over every other way of naming it.  The middleware
    takes the name when the request ends.  Call it from the greenlet that
    serves the request (the one that called the app): a name set from a
    greenlet the request spawned does not name it.  Returns True.
    TypeError/ValueError for a name that is not a non-empty str."""
    if not isinstance(name, str):
        raise TypeError("set_route: the route name must be a str, got %s"
                        % type(name).__name__)
    if not name:
        raise ValueError("set_route: the route name must not be empty")
    if len(_named) >= _MAX_NAMED:
        _forget_names()
    name = _named[getcurrent()] = _name(name)
    _tell_sampler(name)
    return True


def _forget_names():
    """Bounds _named: the names of greenlets that ended (no request takes
    them), then, if that is not enough, the oldest quarter; the names of
    requests in flight, the newest, stay."""
    # (over a copy: a body the collector frees in the loop takes its
    # request's name out of _named)
    for g in [g for g in list(_named) if getattr(g, "dead", False)]:
        _named.pop(g, None)
    if len(_named) >= _MAX_NAMED:
        for g in list(_named)[:_MAX_NAMED // 4]:
            _named.pop(g, None)


def take_route(greenlet=None):
    """The name set_route gave the request of ``greenlet`` (default: the
    calling one), removed; None when there is none."""
    return _named.pop(getcurrent() if greenlet is None else greenlet, None)


# ---------------------------------------------------------------------------
# naming a request

def _wsgi_text(value, cut=False):
    """WSGI path text (latin-1 decoded bytes) as the UTF-8 it most likely
    was; kept as it is when it is not UTF-8 (cleaned later).  ``cut``: the
    text was cut short, a character's first bytes at its end are dropped."""
    if isinstance(value, (bytes, bytearray)):
        raw = bytes(value)
    else:
        try:
            raw = value.encode("latin-1")
        except UnicodeEncodeError:
            return value   # (not WSGI text: already decoded)
    try:
        # (not final: a path cut at _MAX_PATH may end inside a character)
        text, used = codecs.utf_8_decode(raw, "strict", False)
    except UnicodeDecodeError:
        return raw.decode("latin-1")
    if used == len(raw) or cut:
        return text
    return text + raw[used:].decode("latin-1")


def path_route(path):
    """``path`` with its id-like segments replaced by ``{id}``: integers,
    UUIDs and hex strings of 16 characters or more with a digit among them
    (a str in WSGI's latin-1
    form or bytes; decoded as UTF-8 when it is UTF-8)."""
    if path is None:
        path = ""
    if not isinstance(path, (str, bytes, bytearray)):
        raise TypeError("path_route: a path is a str or bytes, got %s"
                        % type(path).__name__)
    path = _wsgi_text(path[:_MAX_PATH], len(path) > _MAX_PATH)
    parts = path.split("/")
    for i, part in enumerate(parts):
        if part and _ID_SEGMENT.fullmatch(part):
            parts[i] = ID
    return _name("/".join(parts) or "/")


def framework_route(environ):
    """The route template the framework matched, when a hook left it in
    ``environ[ROUTE_KEY]`` (Flask through :func:`install_flask_hook`,
    Django through :class:`DjangoRouteMiddleware`) or werkzeug's request
    object is still in the environ with Flask's ``url_rule``; else None.
    Prefixed with ``SCRIPT_NAME`` (where the app is mounted)."""
    template = environ.get(ROUTE_KEY)
    if not template:
        req = environ.get("werkzeug.request")
        rule = getattr(getattr(req, "url_rule", None), "rule", None)
        if not rule:
            return None
        template = rule
    if not isinstance(template, str):
        return None
    root = environ.get("SCRIPT_NAME") or ""
    if isinstance(root, str) and root:
        template = _wsgi_text(root).rstrip("/") + "/" + template.lstrip("/")
    return _name(template)


class RouteNamer:
    """``namer(environ, slot=None)`` -> the route name of a request
    (``slot``: a name set_route gave it, which wins; see
    the module's docstring for the order).  ``route`` is the ``route=``
    option: a callable ``environ -> str`` or None; when it raises or
    returns something other than a str or None, the path is used and
    ``errors`` counts it (``last_error`` says what happened)."""

    def __init__(self, route=None):
        if route is not None and not callable(route):
            raise TypeError("route must be a callable environ -> str, "
                            "got %s" % type(route).__name__)
        self.route = route
        self.errors = 0
        self.last_error = None

    def __call__(self, environ, slot=None):
        if slot is not None:
            return slot
        name = framework_route(environ)
        if name:
            return name
        if self.route is not None:
            try:
                name = self.route(environ)
                if isinstance(name, str) and name:
                    return _name(name)
                if name is not None and name != "":
                    raise TypeError("route returned %s, not a str"
                                    % type(name).__name__)
            except Exception as e:
                self.errors += 1
                self.last_error = _error_text(e)
            except BaseException as e:
                # (an interrupt or a greenlet's kill: the caller counts
                # the request by its path, then lets it go on)
                self.last_error = _error_text(e)
                raise
        return self.path_name(environ)

    @staticmethod
    def path_name(environ):
        """The request's path with ids as ``{id}``."""
        return path_route((environ.get("SCRIPT_NAME") or "") +
                          (environ.get("PATH_INFO") or ""))


def _error_text(e):
    return clean("%s: %s" % (type(e).__name__, e), 300)


# ---------------------------------------------------------------------------
# framework hooks

def _flask_request_started(sender, **extra):
    try:
        from flask import request
        rule = request.url_rule
        if rule is not None:
            environ = request.environ
            environ[ROUTE_KEY] = rule.rule
            _tell_sampler(rule.rule if not environ.get("SCRIPT_NAME")
                          else framework_route(environ), hook=True)
    except Exception:
        pass   # (a route name is never worth breaking the request)


_flask_lock = threading.Lock()
_flask_hooked = False


def install_flask_hook():
    """Connects to Flask's ``request_started`` signal (once per process),
    which leaves each request's matched ``url_rule`` in the environ (Flask
    clears its request from the environ before the response is sent, so
    the template cannot be read afterwards).  Returns False when Flask is
    not imported (it is never imported from here) or has no signals."""
    global _flask_hooked
    flask = sys.modules.get("flask")
    if flask is None:
        return False
    with _flask_lock:
        if not _flask_hooked:
            try:
                flask.request_started.connect(_flask_request_started,
                                              weak=False)
            except Exception:   # (an old Flask without blinker)
                return False
            _flask_hooked = True
    return True


class DjangoRouteMiddleware:
    """Django middleware that leaves the matched route template
    (``request.resolver_match.route``, e.g. ``items/<int:pk>/``) in the
    WSGI environ.  Add ``"greqprof.routes.DjangoRouteMiddleware"`` to
    ``MIDDLEWARE``."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)

    def process_view(self, request, view_func, view_args, view_kwargs):
        try:
            route = request.resolver_match.route
            if route:
                environ = request.environ
                route = environ[ROUTE_KEY] = "/" + route.lstrip("^")
                # (the sampler cleans a name once; a mounted app's is
                # prefixed here)
                _tell_sampler(route if not environ.get("SCRIPT_NAME")
                              else framework_route(environ), hook=True)
        except Exception:
            pass
        return None


# ---------------------------------------------------------------------------
# aggregates

class WallHistogram:
    """Counts of durations in fixed log-spaced buckets: 8 per doubling from
    ``LOW`` (1 microsecond) to ``LOW * 2**(BUCKETS/8)`` (17,180 s),
    one bucket below and one above.  A quantile estimate is the geometric
    middle of the bucket that holds the quantile's sample, clamped to the
    smallest and largest durations seen: within a factor 2**(1/16) (4.4 %)
    of the exact nearest-rank quantile, or within LOW of it below LOW;
    above the top bucket (4.8 hours) the estimate is the largest
    duration seen."""
    LOW = 1e-6
    PER_DOUBLING = 8
    BUCKETS = 8 * 34
    _RATIO = 2 ** (1 / PER_DOUBLING)
    _LOG_RATIO = math.log(_RATIO)
    __slots__ = ("counts", "n", "total", "min", "max")

    def __init__(self):
        self.counts = array("Q", bytes(8 * (self.BUCKETS + 2)))
        self.n = 0
        self.total = 0.0
        self.min = math.inf
        self.max = 0.0

    def add(self, seconds):
        if seconds < self.LOW:
            i = 0
        else:
            i = int(math.log(seconds / self.LOW) / self._LOG_RATIO) + 1
            if i > self.BUCKETS + 1:
                i = self.BUCKETS + 1
        self.counts[i] += 1
        self.n += 1
        self.total += seconds
        if seconds < self.min:
            self.min = seconds
        if seconds > self.max:
            self.max = seconds

    def quantile(self, q):
        """Estimated nearest-rank ``q`` quantile (0 < q <= 1) in seconds;
        None when empty."""
        return self.quantiles((q,))[0]

    def quantiles(self, qs):
        """:meth:`quantile` of each of ``qs``, the running counts summed
        once (a summary over hundreds of routes holds the GIL for it)."""
        for q in qs:
            if not 0 < q <= 1:
                raise ValueError("a quantile is in (0, 1], got %r" % (q,))
        if not self.n:
            return [None] * len(qs)
        # (running counts over the buckets that hold any, found in C:
        # durations cluster, so a handful of the 274)
        lo, hi = _nonzero_range(self.counts)
        cum = list(itertools.accumulate(self.counts[lo:hi]))
        out = []
        for q in qs:
            rank = max(math.ceil(q * self.n - 1e-9), 1)
            # (the first bucket whose running count reaches the rank;
            # none, when the counts fall short of n: the last one)
            k = bisect.bisect_left(cum, rank)
            out.append(self._estimate(
                lo + k if k < len(cum) else self.BUCKETS + 1))
        return out

    def _estimate(self, i):
        """The duration bucket i stands for, within the extremes seen."""
        if i == 0:
            est = self.LOW / 2
        elif i == self.BUCKETS + 1:
            est = self.max
        else:
            est = self.LOW * self._RATIO ** (i - 0.5)
        return min(max(est, self.min), self.max)


def _nonzero_range(counts):
    """(lo, hi): counts[lo:hi] holds every nonzero count of ``counts``
    (an array of "Q"), found in C steps; (0, 0) when all are zero."""
    if sys.byteorder != "little":
        counts = array("Q", counts)
        counts.byteswap()
    bits = int.from_bytes(counts.tobytes(), "little")
    if not bits:
        return 0, 0
    return ((bits & -bits).bit_length() - 1) // 64, \
        (bits.bit_length() + 63) // 64


def _seconds(what, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value < 0:
        raise ValueError("%s must be a finite number of seconds >= 0, got "
                         "%r" % (what, value))
    return float(value)


class RouteStats:
    """Aggregates of one route since the table started.  ``cpu_sum`` and
    ``waiting_sum`` are over the ``sampled`` requests only."""
    __slots__ = ("route", "requests", "errors", "wall", "sampled",
                 "cpu_sum", "cpu_n", "waiting_sum", "waiting_n", "blocking",
                 "blocked", "status")

    def __init__(self, route):
        self.route = route
        self.requests = 0
        self.errors = 0
        self.wall = WallHistogram()
        self.sampled = 0
        self.cpu_sum = 0.0
        self.cpu_n = 0
        self.waiting_sum = 0.0
        self.waiting_n = 0
        self.blocking = 0
        self.blocked = 0.0

    def add_sample(self, cpu, waiting, blocking, blocked):
        """What one sampled request of the route measured (cpu, waiting:
        seconds or None where unknown)."""
        self.sampled += 1
        if cpu is not None:
            self.cpu_sum += cpu
            self.cpu_n += 1
        if waiting is not None:
            self.waiting_sum += waiting
            self.waiting_n += 1
        self.blocking += blocking
        self.blocked += blocked

    def to_record(self):
        """A plain dict (see :meth:`RouteTable.to_records`)."""
        w = self.wall
        cpu = self.cpu_sum / self.cpu_n if self.cpu_n else None
        p50, p95, p99 = w.quantiles((0.5, 0.95, 0.99))
        return {
            "route": self.route,
            "requests": self.requests,
            "errors": self.errors,
            "sampled": self.sampled,
            "wall_mean": w.total / w.n if w.n else None,
            "wall_max": w.max if w.n else None,
            "wall_p50": p50,
            "wall_p95": p95,
            "wall_p99": p99,
            "cpu": cpu,
            "cpu_total": cpu * self.requests if cpu is not None else None,
            "waiting": (self.waiting_sum / self.waiting_n
                        if self.waiting_n else None),
            "blocking": self.blocking,
            "blocked": self.blocked,
        }


class RouteTable:
    """Per-route aggregates of every request, bounded: at most
    ``max_routes`` routes (default 500), then one more, ``OTHER``, which
    counts the requests of every route that did not fit.  Thread-safe."""

    def __init__(self, max_routes=MAX_ROUTES):
        if isinstance(max_routes, bool) or not isinstance(max_routes, int) \
                or max_routes < 1:
            raise ValueError("max_routes must be an int >= 1, got %r"
                             % (max_routes,))
        self.max_routes = max_routes
        self._routes = {}
        self._lock = threading.Lock()
        #: requests counted under OTHER because the table was full
        self.overflowed = 0

    def record(self, route, wall, error=False, sampled=False, cpu=None,
               waiting=None, blocking=0, blocked=0.0):
        """Counts one request of ``route`` that took ``wall`` seconds;
        ``error`` for a 5xx status or an exception.  ``sampled`` requests
        (profiled ones) may bring their ``cpu`` and ``waiting`` seconds;
        ``blocking`` is the number of blocking events the request had and
        ``blocked`` their seconds.  ValueError/TypeError for bad values."""
        if not isinstance(route, str) or not route:
            raise TypeError("route must be a non-empty str, got %r"
                            % (route,))
        wall = _seconds("wall", wall)
        if cpu is not None:
            cpu = _seconds("cpu", cpu)
        if waiting is not None:
            waiting = _seconds("waiting", waiting)
        if (cpu is not None or waiting is not None) and not sampled:
            raise ValueError("cpu and waiting come from sampled requests: "
                             "pass sampled=True with them")
        if isinstance(blocking, bool) or not isinstance(blocking, int) or \
                blocking < 0:
            raise ValueError("blocking must be an int >= 0, got %r"
                             % (blocking,))
        blocked = _seconds("blocked", blocked)
        with self._lock:
            st = self._routes.get(route)
            if st is None:
                if len(self._routes) >= self.max_routes and \
                        route != OTHER:
                    self.overflowed += 1
                    route = OTHER
                    st = self._routes.get(OTHER)
                if st is None:
                    st = self._routes[route] = RouteStats(route)
            st.requests += 1
            if error:
                st.errors += 1
            st.wall.add(wall)
            if sampled:
                st.add_sample(cpu, waiting, blocking, blocked)
            else:
                st.blocking += blocking
                st.blocked += blocked

    def __len__(self):
        return len(self._routes)

    def to_records(self):
        """One plain dict per route, most requests first: ``route``,
        ``requests``, ``errors``, ``sampled`` (counts); ``wall_mean``,
        ``wall_max`` and the estimates ``wall_p50``, ``wall_p95``,
        ``wall_p99`` (seconds, see :class:`WallHistogram`); ``cpu`` and
        ``waiting``, estimated seconds per request from the sampled
        requests (None until one was sampled), ``cpu_total`` = ``cpu`` x
        ``requests``; ``blocking`` (events) and ``blocked`` (seconds)."""
        with self._lock:
            records = [st.to_record() for st in self._routes.values()]
        records.sort(key=lambda r: (-r["requests"], r["route"]))
        return records


#: wait sites kept per route (the smallest give way), and shown
MAX_WAIT_SITES = 50
TOP_WAIT_SITES = 5
#: routes(window="recent"): the last RECENT_S seconds, from snapshots of
#: the aggregates taken every RECENT_STEP_S (the window is RECENT_S to
#: RECENT_S + RECENT_STEP_S long; shorter while the process is younger)
RECENT_S = 300
RECENT_STEP_S = 60


class RouteAggregates:
    """A middleware's per-route aggregates since it started: ``counts``
    (a ``RouteCounts`` in C: every request's status, error and wall time,
    at most ``max_routes`` routes plus ``OTHER``) joined with what the
    sampled requests and blocking events add, kept here per route under
    the same bound."""

    def __init__(self, counts_type, max_routes=MAX_ROUTES, route=None):
        if isinstance(max_routes, bool) or not isinstance(max_routes, int) \
                or max_routes < 1:
            raise ValueError("max_routes must be an int >= 1, got %r"
                             % (max_routes,))
        self.max_routes = max_routes
        self.namer = RouteNamer(route)
        self.counts = counts_type(max_routes, self._name_environ, _named,
                                  getcurrent, route is None)
        self._extra = {}   # route -> RouteStats (sampled part, blocking)
        self._changed = set()   # routes of _extra changed since take_changed
        self._waits = {}   # route -> {wait site: seconds}, sampled
        # (reentrant: a body collected inside a section may deliver its
        # profile, which adds to the table, from inside it)
        self._lock = _RealRLock()
        #: blocking events and their seconds, all requests and none
        self.blocking = 0
        self.blocked = 0.0
        # (monotonic time, {route: RouteStats}) every RECENT_STEP_S, the
        # oldest first: the start of the recent window
        self._snaps = collections.deque(
            maxlen=RECENT_S // RECENT_STEP_S + 1)
        self._snap_next = None
        # tick()'s view of the C table: raw route -> requests (what C
        # skips), raw route -> (name, _Snap of its row), name -> raw routes
        self._tick_known = {}
        self._tick_rows = {}
        self._tick_raws = {}
        # (OS-thread locks even under gevent.monkey: nothing under them
        # yields, and a patched lock held in one thread's drain loop hung
        # another thread's reader)
        self._tick_lock = _RealLock()

    def after_fork(self):
        """(the forked child; middleware.py calls it) Locks anew: one
        another thread held at the fork stays held in the child; and the
        tick's view of the C table anew (a thread forking in the middle of
        another's tick leaves it half written: the next tick reads every
        row)."""
        self._lock = _RealRLock()
        self._tick_lock = _RealLock()
        self._tick_known = {}
        self._tick_rows = {}
        self._tick_raws = {}

    def _name_environ(self, environ, interrupted=False):
        # (called from C; never raises: a failing route= is counted;
        # interrupted: the route= callable raised a BaseException that is
        # not an Exception, which C passes on once the request is counted
        # under its path)
        try:
            if interrupted:
                self.namer.errors += 1
                return self.namer.path_name(environ)
            return self.namer(environ)
        except Exception:
            self.namer.errors += 1
            return OTHER

    def _stats(self, route):
        st = self._extra.get(route)
        if st is None:
            # (a route the request table counts under OTHER, its table
            # full, is OTHER here too)
            if len(self._extra) >= self.max_routes or \
                    not self.counts.admits(route):
                route = OTHER
                st = self._extra.get(OTHER)
            if st is None:
                st = self._extra[route] = RouteStats(route)
        self._changed.add(st.route)
        return st

    def take_changed(self):
        """{route: (cpu_sum, cpu_n, blocking)} of the routes whose
        sampled part or blocking changed since the last call (for
        greqprof/metrics.py: a large table's idle routes cost nothing)."""
        with self._lock:
            # (swapped first: a body collected in the loop below may
            # deliver a sample, which adds to the new set, not this one)
            changed, self._changed = self._changed, set()
            out = {}
            for route in changed:
                st = self._extra[route]
                out[route] = (st.cpu_sum, st.cpu_n, st.blocking)
        return out

    def add_sampled(self, route, cpu, waiting, blocking=0, blocked=0.0,
                    waits=()):
        """A sampled request of ``route`` (its raw name) was delivered;
        ``waits``: its (site, seconds) pairs."""
        self.add_named_sample(_name(route) or OTHER, cpu, waiting, blocking,
                              blocked, waits)

    def add_named_sample(self, route, cpu, waiting, blocking=0, blocked=0.0,
                         waits=()):
        """:meth:`add_sampled` for a ``route`` already named (clean and
        cut, as :func:`route_name` gives it)."""
        with self._lock:
            st = self._stats(route)
            if waits:
                sites = self._waits.setdefault(st.route, {})
                for site, seconds in waits:
                    if site not in sites and len(sites) >= MAX_WAIT_SITES:
                        low = min(sites, key=sites.get)
                        if sites[low] >= seconds:
                            continue
                        del sites[low]   # (the smallest makes room)
                    sites[site] = sites.get(site, 0.0) + seconds
            st.add_sample(cpu, waiting, blocking, blocked)

    def add_blocking(self, route, seconds):
        """A blocking event of an unsampled request of ``route`` (None:
        of no request)."""
        with self._lock:
            self.blocking += 1
            self.blocked += seconds
            if route is not None:
                st = self._stats(_name(route) or OTHER)
                st.blocking += 1
                st.blocked += seconds

    def count_blocking(self, seconds):
        """A sampled request's blocking event: counted in the totals now,
        by its route when its profile is delivered."""
        with self._lock:
            self.blocking += 1
            self.blocked += seconds

    def _merged(self):
        merged = {}
        for route, req, err, classes, hist, total, lo, hi in \
                self.counts.snapshot():
            name = _name(route) or OTHER
            st = merged.get(name)
            if st is None:
                st = merged[name] = RouteStats(name)
                st.status = [0] * 6
            st.requests += req
            st.errors += err
            st.status = [a + b for a, b in zip(st.status, classes)]
            w = st.wall
            if not w.n:
                w.counts = array("Q", hist)
            else:   # (two raw names cut to one: rare)
                for i, c in enumerate(array("Q", hist)):
                    if c:
                        w.counts[i] += c
            w.n += req
            w.total += total
            if req:
                w.min = min(w.min, lo)
                w.max = max(w.max, hi)
        with self._lock:
            extra = list(self._extra.values())
        for ex in extra:
            st = merged.get(ex.route)
            if st is None:   # (blocking outside any counted request)
                st = merged[ex.route] = RouteStats(ex.route)
                st.status = [0] * 6
            for k in ("sampled", "cpu_sum", "cpu_n", "waiting_sum",
                      "waiting_n", "blocking", "blocked"):
                setattr(st, k, getattr(st, k) + getattr(ex, k))
        return merged

    def _record(self, st):
        rec = st.to_record()
        rec["status"] = dict(zip(("1xx", "2xx", "3xx", "4xx", "5xx",
                                  "other"), st.status))
        with self._lock:
            sites = dict(self._waits.get(st.route, ()))
        top = sorted(sites.items(), key=lambda kv: -kv[1])[:TOP_WAIT_SITES]
        rec["wait_sites"] = [
            {"site": site, "seconds": sec,
             "per_request": sec / st.sampled if st.sampled else None}
            for site, sec in top]
        return rec

    def summary_records(self):
        """Since start, per route, what the summary line reads (route,
        requests, errors, sampled, cpu, cpu_total, wall_p99): without the
        other quantiles, status classes and wait sites to_records builds
        (it runs in the serving process once a summary period)."""
        out = []
        for st in self._merged().values():
            cpu = st.cpu_sum / st.cpu_n if st.cpu_n else None
            out.append({
                "route": st.route, "requests": st.requests,
                "errors": st.errors, "sampled": st.sampled, "cpu": cpu,
                "cpu_total": cpu * st.requests if cpu is not None else None,
                "wall_p99": st.wall.quantiles((0.99,))[0]})
        out.sort(key=lambda r: (-r["requests"], r["route"]))   # (ties)
        return out

    def to_records(self, window=None, now=None):
        """One plain dict per route (RouteTable.to_records' keys, plus
        ``status``: requests per status class, "1xx".."5xx", "other", and
        ``wait_sites``: the top sites where the sampled requests waited,
        ``site``, ``seconds`` summed, ``per_request`` per sampled
        request), most requests first.  ``window``: None (or "start")
        since the start; "recent": the last RECENT_S seconds or a little
        more (see :meth:`recent`)."""
        if window is None or window == "start":
            stats = self._merged().values()
        elif window == "recent":
            stats = self.recent(now)[1]
        else:
            raise ValueError("window must be None, 'start' or 'recent', "
                             "got %r" % (window,))
        records = [self._record(st) for st in stats]
        records.sort(key=lambda r: (-r["requests"], r["route"]))
        return records

    def tick(self, now=None):
        """Takes a snapshot for the recent window when RECENT_STEP_S has
        passed (the drain loop calls it once a second)."""
        now = time.monotonic() if now is None else now
        if self._snap_next is not None and now < self._snap_next:
            return
        with self._tick_lock:   # (the drain loop, and recent() anywhere)
            if self._snap_next is None or now >= self._snap_next:
                self._snap_next = now + RECENT_STEP_S
                self._tick(now)

    def _tick(self, now):
        # Only the rows that counted requests since the last tick come
        # back from C (a table of thousands of idle routes used to cost
        # tens of ms of the GIL a minute); the others keep their _Snap.
        # Each raw route's latest row is kept as a _Snap (compressed, and
        # for a name of one raw route the very object the name's snapshot
        # shares); nothing is kept until the snapshot is taken whole.
        rows, raws = self._tick_rows, self._tick_raws
        fresh = {}   # raw -> (name, _Snap of its row alone)
        for row in self.counts.snapshot(self._tick_known):
            raw = row[0]
            old = rows.get(raw)
            fresh[raw] = (old[0] if old is not None else
                          _name(raw) or OTHER,
                          _Snap(*row[1:6], _Snap.NO_EXTRA))
        new_raws = {}
        for raw, (name, _) in fresh.items():
            if raw not in rows:
                new_raws.setdefault(name, []).append(raw)
        changed = {name for name, _ in fresh.values()}
        with self._lock:
            # (over a copy, which allocates nothing per route: a body
            # collected in the loop may deliver a new route's first sample)
            extra = {k: tuple(getattr(st, f) for f in _Snap.EXTRA)
                     for k, st in self._extra.copy().items()}
        last = self._snaps[-1][1] if self._snaps else {}
        snap = {}
        for name in raws.keys() | new_raws.keys() | extra.keys():
            ex = extra.get(name, _Snap.NO_EXTRA)
            old = last.get(name)
            if old is not None and name not in changed:
                # (idle: shared with the last one, or only its sampled
                # part changed)
                snap[name] = old if old.extra == ex else old.with_extra(ex)
                continue
            parts = [fresh[raw][1] if raw in fresh else rows[raw][1]
                     for raw in raws.get(name, []) + new_raws.get(name, [])]
            snap[name] = _Snap.merged(parts, ex)
        self._snaps.append((now, snap))
        for raw, (name, rs) in fresh.items():
            rows[raw] = (name, rs)
            self._tick_known[raw] = rs.requests
        for name, new in new_raws.items():
            raws.setdefault(name, []).extend(new)

    def recent(self, now=None):
        """(seconds covered, [RouteStats of the requests counted since
        the oldest snapshot no older than RECENT_S + RECENT_STEP_S]);
        since the start while there is none.  Wall quantiles and maxima
        come from the histogram's buckets (within its 4.4 %, or the
        maxima since start when lower); ``wait_sites`` stay since start."""
        now = time.monotonic() if now is None else now
        self.tick(now)
        older = [sn for sn in list(self._snaps) if sn[0] < now]
        inside = [sn for sn in older
                  if now - sn[0] <= RECENT_S + RECENT_STEP_S]
        cur = self._merged()
        if not older:
            return None, list(cur.values())
        # (no snapshot inside the window, when nothing ticked for a long
        # time: the newest one before it, a longer window, said so)
        t0, old = inside[0] if inside else older[-1]
        out = []
        for name, st in cur.items():
            o = old.get(name)
            if o is not None and o.requests == st.requests and \
                    o.extra == tuple(getattr(st, f) for f in _Snap.EXTRA):
                continue   # (idle in the window: its buckets not compared)
            d = _stats_since(st, o)
            if d.requests or d.sampled or d.blocking:
                out.append(d)
        return now - t0, out


class _Snap:
    """A route's aggregates at a snapshot (the recent window's start):
    counts, the wall histogram zlib-compressed (mostly zeros: about a
    tenth of its 2.2 KB), and the sampled part (EXTRA)."""
    EXTRA = ("sampled", "cpu_sum", "cpu_n", "waiting_sum", "waiting_n",
             "blocking", "blocked")
    NO_EXTRA = (0, 0.0, 0, 0.0, 0, 0, 0.0)
    __slots__ = ("requests", "errors", "status", "hist", "total", "extra")

    def __init__(self, requests, errors, status, hist, total, extra):
        self.requests, self.errors, self.status = requests, errors, status
        self.hist = zlib.compress(hist, 1) if hist else None
        self.total, self.extra = total, extra

    @classmethod
    def merged(cls, parts, extra):
        """The _Snap of a name from the _Snaps of its raw routes' rows
        (several when raw names clean to one, which is rare)."""
        if not parts:
            return cls(0, 0, (0,) * 6, None, 0.0, extra)
        if len(parts) == 1:
            return parts[0].with_extra(extra)
        hist = parts[0].counts()
        for p in parts[1:]:
            for i, c in enumerate(p.counts()):
                hist[i] += c
        return cls(sum(p.requests for p in parts),
                   sum(p.errors for p in parts),
                   tuple(sum(col) for col in zip(*(p.status for p in parts))),
                   hist.tobytes(), sum(p.total for p in parts), extra)

    def with_extra(self, extra):
        """This snapshot's counts with another sampled part."""
        if extra == self.extra:
            return self
        new = _Snap.__new__(_Snap)
        new.requests, new.errors, new.status = \
            self.requests, self.errors, self.status
        new.hist, new.total, new.extra = self.hist, self.total, extra
        return new

    def counts(self):
        return array("Q", zlib.decompress(self.hist)) if self.hist else \
            array("Q", bytes(8 * (WallHistogram.BUCKETS + 2)))


def _stats_since(cur, old):
    """The RouteStats of what ``cur`` counted since ``old`` (a _Snap;
    None: all)."""
    if old is None:
        return cur
    d = RouteStats(cur.route)
    d.status = [a - b for a, b in zip(cur.status, old.status)]
    d.requests = cur.requests - old.requests
    d.errors = cur.errors - old.errors
    for k, v in zip(_Snap.EXTRA, old.extra):
        setattr(d, k, getattr(cur, k) - v)
    w, cw = d.wall, cur.wall
    w.counts = array("Q", [a - b if a > b else 0
                           for a, b in zip(cw.counts, old.counts())])
    lo, hi = _nonzero_range(w.counts)
    lo = None if lo == hi else lo
    hi -= 1
    w.n = d.requests
    w.total = max(cw.total - old.total, 0.0)
    if lo is not None:
        # (the extremes of the window are not kept: the buckets' edges,
        # within the extremes since start)
        r = WallHistogram._RATIO
        w.min = max(cw.min, WallHistogram.LOW * r ** (lo - 1) if lo else 0.0)
        w.max = cw.max if hi > WallHistogram.BUCKETS else \
            min(cw.max, WallHistogram.LOW * r ** hi)
    return d


#: routes named in each list of the summary line
SUMMARY_TOP = 5


def summary_line(records, ran, period, pid=0, as_json=False):
    """The periodic summary of ``records`` (summary_records(), or
    to_records()): ``ran``
    requests in the last ``period`` seconds, the top routes by total CPU
    (estimated from the sampled requests) and by p99 wall time, both since
    start.  Text, or one JSON object (``schema`` "greqprof.routes/1")."""
    by_cpu = sorted((r for r in records if r["cpu_total"] is not None),
                    key=lambda r: -r["cpu_total"])[:SUMMARY_TOP]
    by_p99 = sorted((r for r in records if r["wall_p99"] is not None),
                    key=lambda r: -r["wall_p99"])[:SUMMARY_TOP]
    if as_json:
        import json
        return json.dumps({
            "schema": "greqprof.routes/1", "pid": pid, "period_s": period,
            "requests_in_period": ran,
            "requests": sum(r["requests"] for r in records),
            "routes": len(records),
            "top_cpu": [{k: r[k] for k in ("route", "cpu_total", "cpu",
                                           "sampled", "requests")}
                        for r in by_cpu],
            "top_p99": [{k: r[k] for k in ("route", "wall_p99", "requests",
                                           "errors")} for r in by_p99]},
            ensure_ascii=False, allow_nan=False)
    cpu = ", ".join("%s %.3f s (%.2f ms x %d, %d sampled)" % (
        r["route"], r["cpu_total"], r["cpu"] * 1e3, r["requests"],
        r["sampled"]) for r in by_cpu) or "none sampled yet"
    p99 = ", ".join("%s %.1f ms (%d requests)" % (
        r["route"], r["wall_p99"] * 1e3, r["requests"]) for r in by_p99)
    return ("greqprof routes [pid %d]: %d requests in the last %g s, %d "
            "since start over %d routes; top total CPU since start "
            "(estimated): %s; top p99: %s" % (
                pid, ran, period, sum(r["requests"] for r in records),
                len(records), cpu, p99))
