"""Prometheus metrics of the per-route aggregates (``metrics_path``),
through ``prometheus_client`` (``pip install greqprof[prometheus]``).

Nothing runs per request: once a second (the drain loop) and before each
scrape, what the aggregates counted since the last sync is added to
prometheus_client's metrics.  Under gunicorn with several workers, set
``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's multiprocess mode): each
worker's values go to its files there and a scrape answered by any worker
sums every worker's (docs/fleet.md)."""
import math
import os
import threading
from array import array

from .errors import ConfigError
from .routes import route_name

#: rows the drain loop's sync reads at most, once a second
SYNC_ROWS = 100
#: upper bounds of greqprof_request_duration_seconds (seconds)
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
           2.5, 5.0, 10.0, 30.0, 60.0, math.inf)
_CLASSES = ("1xx", "2xx", "3xx", "4xx", "5xx", "other")


def _bucket_map():
    """For each of WallHistogram's buckets, the index of the first BUCKETS
    bound at or above its upper end (a duration is counted at most one
    histogram bucket, 9 %, above its own bound)."""
    from .routes import WallHistogram as W
    out = []
    for i in range(W.BUCKETS + 2):
        top = W.LOW * W._RATIO ** i if i <= W.BUCKETS else math.inf
        out.append(next(j for j, b in enumerate(BUCKETS) if top <= b * (
            1 + 1e-12)))
    return out


#: the metrics every middleware of the process adds to, in multiprocess
#: mode
_shared = {}
_shared_lock = threading.Lock()


def _new_metrics(pc, r):
    return dict(
        registry=r,
        requests=pc.Counter(
            "greqprof_requests", "Requests by route and status class",
            ["route", "status"], registry=r),
        duration=pc.Histogram(
            "greqprof_request_duration_seconds",
            "Wall time of requests by route", ["route"], buckets=BUCKETS,
            registry=r),
        cpu=pc.Summary(
            "greqprof_request_cpu_seconds",
            "CPU time of the sampled requests by route (count: sampled "
            "requests)", ["route"], registry=r),
        blocking=pc.Counter(
            "greqprof_blocking", "Blocking events by route", ["route"],
            registry=r),
        blocked=pc.Counter(
            "greqprof_blocked_seconds",
            "Seconds the event loop was held, all blocking events",
            registry=r))


class Metrics:
    """The metrics of one middleware's aggregates, and the WSGI app that
    serves them (``gate(environ)``: the inspector's access rule)."""

    def __init__(self, aggregates, gate):
        try:
            import prometheus_client as pc
        except ImportError:
            raise ConfigError(
                "metrics_path needs prometheus_client: pip install "
                "'greqprof[prometheus]'") from None
        self._pc = pc
        self._agg = aggregates
        self._gate = gate
        self._lock = threading.Lock()
        self._map = _bucket_map()
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        if self.multiprocess:
            # (one set of metrics a process: prometheus_client keeps one
            # value per series in this process's files, and two objects of
            # one series each wrote their own count over the other's)
            with _shared_lock:
                if not _shared:
                    _shared.update(_new_metrics(pc, pc.CollectorRegistry(
                        auto_describe=True)))
                metrics = dict(_shared)
        else:
            metrics = _new_metrics(pc, pc.CollectorRegistry(
                auto_describe=True))
        self.registry = metrics["registry"]
        self.requests = metrics["requests"]
        self.duration = metrics["duration"]
        self.cpu = metrics["cpu"]
        self.blocking = metrics["blocking"]
        self.blocked = metrics["blocked"]
        # (read since the last sync, so that only what changed costs:
        # once a second, a table of thousands of mostly idle routes)
        self._known = {}         # raw route -> its requests at the last sync
        self._rows = {}          # raw route -> (classes, buckets, total)
        self._extra_seen = {}    # route -> (cpu_sum, cpu_n, blocking)
        self._blocked_seen = 0.0
        # WallHistogram buckets [a, b) -> BUCKETS index j (monotonic)
        self._ranges = []
        for i, j in enumerate(self._map):
            if self._ranges and self._ranges[-1][0] == j:
                self._ranges[-1][2] = i + 1
            else:
                self._ranges.append([j, i, i + 1])

    def sync(self, limit=None):
        """Adds what the aggregates counted since the last call: the
        request table's rows that counted requests since, and the routes
        whose samples or blocking changed.  ``limit``: at most that many
        rows (the drain loop's, once a second: a burst of new routes, each
        a few prometheus_client objects to make, is spread over seconds
        rather than holding the loop; a scrape reads them all)."""
        with self._lock:
            rows = self._agg.counts.snapshot(self._known)
            for row in rows[:limit]:
                self._sync_row(*row)
            for route, now in self._agg.take_changed().items():
                self._sync_extra(route, now)
            # (read once: another thread may add between two reads)
            blocked = self._agg.blocked
            d = blocked - self._blocked_seen
            if d > 0:
                self.blocked.inc(d)
                self._blocked_seen = blocked

    def tick(self):
        """The drain loop's sync, once a second."""
        self.sync(limit=SYNC_ROWS)

    def _sync_row(self, raw, requests, errors, classes, hist, total, lo, hi):
        # (rows are per raw name: two that clean to one label add up)
        route = route_name(raw)
        old = self._rows.get(raw)
        o_classes, o_per, o_total = old if old else (
            (0,) * len(_CLASSES), (0,) * len(BUCKETS), 0.0)
        for cls, n, o in zip(_CLASSES, classes, o_classes):
            if n > o:
                self.requests.labels(route, cls).inc(n - o)
        counts = array("Q", hist)
        per = [0] * len(BUCKETS)
        for j, a, b in self._ranges:
            per[j] += sum(counts[a:b])
        child = self.duration.labels(route)
        for j, (n, o) in enumerate(zip(per, o_per)):
            if n > o:
                child._buckets[j].inc(n - o)
        if total > o_total:
            child._sum.inc(total - o_total)
        self._rows[raw] = (tuple(classes), per, total)
        self._known[raw] = requests

    def _sync_extra(self, route, now):
        cpu_sum, cpu_n, blocking = now
        o_cpu, o_cpu_n, o_blocking = self._extra_seen.get(route, (0.0, 0, 0))
        if cpu_n > o_cpu_n:
            c = self.cpu.labels(route)
            c._count.inc(cpu_n - o_cpu_n)
            c._sum.inc(max(cpu_sum - o_cpu, 0.0))
        if blocking > o_blocking:
            self.blocking.labels(route).inc(blocking - o_blocking)
        self._extra_seen[route] = now

    def exposition(self):
        """(content type, bytes) of every worker's metrics (multiprocess
        mode) or this process's."""
        pc = self._pc
        self.sync()
        if self.multiprocess:
            from prometheus_client import multiprocess
            registry = pc.CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
        else:
            registry = self.registry
        return pc.CONTENT_TYPE_LATEST, pc.generate_latest(registry)

    def __call__(self, environ, start_response):
        headers = [("Cache-Control", "no-store"),
                   ("X-Content-Type-Options", "nosniff")]
        if not self._gate(environ):
            body = b"greqprof metrics: forbidden\n"
            start_response("403 Forbidden", headers + [
                ("Content-Type", "text/plain; charset=utf-8"),
                ("Content-Length", str(len(body)))])
            return [body]
        if environ.get("REQUEST_METHOD", "GET") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", headers + [
                ("Allow", "GET, HEAD"), ("Content-Length", "0")])
            return [b""]
        ctype, body = self.exposition()
        start_response("200 OK", headers + [
            ("Content-Type", ctype), ("Content-Length", str(len(body)))])
        return [body]
