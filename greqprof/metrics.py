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

from .errors import ConfigError

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
        self.registry = pc.CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = pc.Counter(
            "greqprof_requests", "Requests by route and status class",
            ["route", "status"], registry=r)
        self.duration = pc.Histogram(
            "greqprof_request_duration_seconds",
            "Wall time of requests by route", ["route"], buckets=BUCKETS,
            registry=r)
        self.cpu = pc.Summary(
            "greqprof_request_cpu_seconds",
            "CPU time of the sampled requests by route (count: sampled "
            "requests)", ["route"], registry=r)
        self.blocking = pc.Counter(
            "greqprof_blocking", "Blocking events by route", ["route"],
            registry=r)
        self.blocked = pc.Counter(
            "greqprof_blocked_seconds",
            "Seconds the event loop was held, all blocking events",
            registry=r)
        self._seen = {}          # route -> its record at the last sync
        self._blocked_seen = 0.0

    def sync(self):
        """Adds what the aggregates counted since the last call."""
        with self._lock:
            for rec, hist in self._agg.records_and_histograms():
                self._sync_route(rec, hist)
            d = self._agg.blocked - self._blocked_seen
            if d > 0:
                self.blocked.inc(d)
                self._blocked_seen = self._agg.blocked

    def _sync_route(self, rec, hist):
        route = rec["route"]
        old = self._seen.get(route)
        if old is not None and old[0] == rec["requests"] and \
                old[1] == rec["sampled"] and old[2] == rec["blocking"]:
            return
        o_status, o_hist, o_total, o_cpu, o_cpu_n = (
            (old[3], old[4], old[5], old[6], old[7]) if old else
            ({}, [0] * len(BUCKETS), 0.0, 0.0, 0))
        for cls in _CLASSES:
            n = rec["status"][cls] - o_status.get(cls, 0)
            if n > 0:
                self.requests.labels(route, cls).inc(n)
        per = [0] * len(BUCKETS)
        for i, c in enumerate(hist):
            if c:
                per[self._map[i]] += c
        child = self.duration.labels(route)
        for j, n in enumerate(per):
            if n > o_hist[j]:
                child._buckets[j].inc(n - o_hist[j])
        total = (rec["wall_mean"] or 0.0) * rec["requests"]
        if total > o_total:
            child._sum.inc(total - o_total)
        cpu_n = rec["cpu_n"]
        cpu_sum = rec["cpu_sum"]
        if cpu_n > o_cpu_n:
            c = self.cpu.labels(route)
            c._count.inc(cpu_n - o_cpu_n)
            c._sum.inc(max(cpu_sum - o_cpu, 0.0))
        ob = old[2] if old else 0
        if rec["blocking"] > ob:
            self.blocking.labels(route).inc(rec["blocking"] - ob)
        self._seen[route] = (rec["requests"], rec["sampled"],
                             rec["blocking"], dict(rec["status"]), per,
                             total, cpu_sum, cpu_n)

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
