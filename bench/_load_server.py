"""The server that bench/load_overhead.py puts under HTTP load.

It serves examples/wsgi_app.py's ``app`` plus one cheap route meant for
throughput measurements:

  /hello    parses the query string, spawns one greenlet (a small
            aggregation, as a cache/DB fan-out would be) and, while it is
            pending, renders ``--rows`` rows with a few small helper
            functions, joins the child and returns a JSON body
            (~1.5 KB).  Deterministic work (no time-based spin), so a
            profiler's per-call and per-switch costs show up in full:
            about 150 µs of CPU per request here, plus pywsgi's own
            request handling.

  /api      issue 16's light app: spawns one child greenlet, sleeps 1 ms
            (gevent.sleep: the request waits, as on a database), joins
            the child and returns a small JSON body.

and, outside any profiling middleware:

  /__stats  JSON counters (requests the app handled, the middleware's
            ``stats``) so the driver can check that sampling really
            happened and that nothing failed.

Run as a script (gevent.pywsgi)::

    python bench/_load_server.py --config gqp-5pct --port 0

prints ``PORT <n>`` on stdout once it listens.  Under gunicorn use the
factory::

    gunicorn -k gevent -w 1 --chdir bench '_load_server:build("gqp-5pct")'

Configurations (see CONFIGS): bare, bare-imported and bare-imported-core
(the bare app in a process that imported greqprof, or only its C core),
passthrough, settrace-noop, gqp-0pct,
gqp-disabled (GREQPROF_ENABLED=0), gqp-0pct-noblocking (no switch hook),
gqp-0pct-noroutes (pct=0 without the per-route counting), gqp-5pct,
gqp-100pct (report=False), gqp-0pct-stack100 and gqp-5pct-stack100 (the
stack sampler at 100 Hz, the default), gqp-0pct-nostack (stack_hz=0),
gqp-5pct-logged, gqp-100pct-logged, gqp-5pct-calls-logged,
gqp-100pct-calls-logged (each report
logged at INFO to a file handler), bare-logged (no profiler, one access
line logged per request the same way), gqp-100pct-calls, gevent-monitor
(gevent's monitor thread, no profiler), werkzeug, yappi.  Not a public
module: used by bench/load_overhead.py only.
"""
import argparse
import json
import os
import sys
from urllib.parse import parse_qs

import gevent

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import wsgi_app  # noqa: E402  examples/wsgi_app.py

#: rows rendered by /hello (its cost scales with it)
DEFAULT_ROWS = 24

COUNTERS = {"hello": 0}


# -- the /hello handler -------------------------------------------------------

def _aggregate(n):
    """The child greenlet's share: a small aggregation."""
    total = 0
    for i in range(n):
        total += i * i % 7
    return total


def _escape(s):
    return (s.replace("&", "&amp;").replace("<", "&lt;")
            .replace(">", "&gt;"))


def _price(i):
    return round(9.99 + i * 0.37, 2)


def _row(i, name):
    return {"id": i, "name": _escape("%s-%d" % (name, i)),
            "price": _price(i), "tags": [t for t in ("a", "b", "c")
                                         if (i + len(t)) % 2],
            "ok": i % 3 != 0}


def make_hello(rows):
    def hello(environ, start_response):
        COUNTERS["hello"] += 1
        qs = parse_qs(environ.get("QUERY_STRING", ""))
        name = qs.get("name", ["world"])[0]
        child = gevent.spawn(_aggregate, 200)
        items = [_row(i, name) for i in range(rows)]
        total = child.get()
        body = json.dumps({"hello": name, "items": items,
                           "aggregate": total}).encode("utf-8")
        start_response("200 OK", [("Content-Type", "application/json"),
                                  ("Content-Length", str(len(body)))])
        return [body]
    return hello


def _api_child(n):
    return sum(i % 7 for i in range(n))


def api(environ, start_response):
    """/api: one child greenlet, a 1 ms sleep, a JSON body."""
    COUNTERS["api"] = COUNTERS.get("api", 0) + 1
    child = gevent.spawn(_api_child, 50)
    gevent.sleep(0.001)
    body = json.dumps({"ok": True, "total": child.get(),
                       "path": environ.get("PATH_INFO")}).encode("utf-8")
    start_response("200 OK", [("Content-Type", "application/json"),
                              ("Content-Length", str(len(body)))])
    return [body]


def make_app(rows=DEFAULT_ROWS):
    """examples/wsgi_app.py's app, plus /hello and /api."""
    hello = make_hello(rows)
    inner = wsgi_app.app

    def app(environ, start_response):
        path = environ.get("PATH_INFO")
        if path == "/hello":
            return hello(environ, start_response)
        if path == "/api":
            return api(environ, start_response)
        return inner(environ, start_response)
    return app


# -- configurations ------------------------------------------------------------

class _Discard:
    """A text stream that throws everything away (werkzeug's stats)."""

    def write(self, s):
        return len(s)

    def flush(self):
        pass


def _discard_profile(profile):
    pass


def _greqprof(**kw):
    def wrap(app):
        from greqprof import ProfilingMiddleware
        return ProfilingMiddleware(app, report=False, sink=_discard_profile,
                                   **kw)
    return wrap


def _greqprof_disabled(app):
    # (GREQPROF_ENABLED=0, the kill switch: greqprof imported, its C
    # __call__ passing each request straight to the app; this process
    # serves one configuration)
    os.environ["GREQPROF_ENABLED"] = "0"
    from greqprof import ProfilingMiddleware
    return ProfilingMiddleware(app)


def _greqprof_no_routes(**kw):
    # (the per-route counting switched off: what it costs, side by side)
    def wrap(app):
        mw = _greqprof(**kw)(app)
        mw._routes_setup(None)
        return mw
    return wrap


def _report_logger():
    """A logger whose INFO records go to a FileHandler with a standard
    Formatter, as production logging does (a file in a temporary
    directory, emptied every second so a long run does not fill the
    disk; removed at exit)."""
    import atexit
    import logging
    import shutil
    import tempfile
    d = tempfile.mkdtemp(prefix="greqprof-bench-log-")
    atexit.register(shutil.rmtree, d, True)
    log = logging.getLogger("greqprof.bench.reports")
    log.propagate = False
    log.setLevel(logging.INFO)
    handler = logging.FileHandler(os.path.join(d, "reports.log"))
    handler.setFormatter(logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log.addHandler(handler)

    def empty():
        while True:
            gevent.sleep(1.0)
            try:
                handler.acquire()
                try:
                    handler.stream.truncate(0)   # (opened in append mode)
                finally:
                    handler.release()
            except (OSError, ValueError, AttributeError):
                pass
    gevent.spawn(empty)
    return log


def _greqprof_logged(**kw):
    """greqprof with each sampled report logged at INFO to a file."""
    def wrap(app):
        from greqprof import ProfilingMiddleware
        return ProfilingMiddleware(app, report=True, logger=_report_logger(),
                                   **kw)
    return wrap


def _access_logged(app):
    """No profiler: the app logs one short access line per request at INFO
    to the same kind of file handler (the floor for any per-request log
    record: what logging alone costs, whatever the message)."""
    log = _report_logger()

    def access_logged(environ, start_response):
        log.info("%s %s", environ.get("REQUEST_METHOD"),
                 environ.get("PATH_INFO"))
        return app(environ, start_response)
    return access_logged


def _werkzeug(app):
    from werkzeug.middleware.profiler import ProfilerMiddleware
    # Stats are built, sorted and formatted for every request (its normal
    # work) but written to a sink that discards them; nothing on disk.
    return ProfilerMiddleware(app, stream=_Discard(), restrictions=(30,),
                              profile_dir=None)


def _passthrough(app):
    def passthrough(environ, start_response):
        return app(environ, start_response)
    return passthrough


def _settrace_noop(app):
    # The floor for any per-switch hook: greenlet calls a C function that
    # does nothing on every switch.
    import operator
    import greenlet
    greenlet.settrace(operator.is_)
    return app


def _gevent_monitor(app):
    # gevent's own blocking detection: a monitor thread that checks every
    # max_blocking_time whether the hub's greenlet tracer saw a switch and
    # reports the hub thread's stack when it did not.  The config is read
    # when the hub first runs (Hub.run), which is after this: the server
    # starts the hub.  /__stats says whether the thread really runs.
    import gevent
    gevent.config.monitor_thread = True
    gevent.config.max_blocking_time = 0.1
    return app


def _imported(name):
    # (the app unwrapped, in a process that imported `name`: what a module
    # costs by being there)
    def wrap(app):
        __import__(name)
        return app
    return wrap


def _monitor_running():
    """True when gevent's monitor thread runs for this thread's hub."""
    from gevent._hub_local import get_hub_if_exists
    hub = get_hub_if_exists()
    thread = getattr(hub, "periodic_monitoring_thread", None)
    return bool(thread is not None and thread.monitor_thread_ident)


def _yappi(app):
    import yappi
    yappi.set_context_backend("greenlet")
    yappi.set_clock_type("cpu")
    yappi.start(builtins=False)
    return app


#: key -> (label, wrapper)
CONFIGS = {
    "bare": ("bare app", lambda app: app),
    "c-passthrough": ("reference: the app behind a C callable "
                      "(functools.partial)", lambda app: __import__(
                          "functools").partial(app)),
    "gqp-disabled-unused": ("reference: a disabled middleware built, the "
                            "app served without it", lambda app: (
                                _greqprof_disabled(app), app)[1]),
    "bare-imported": ("bare app in a process that imported greqprof",
                      _imported("greqprof")),
    "bare-imported-core": ("bare app in a process that imported greqprof's "
                           "C core only", _imported("greqprof._core")),
    "gqp-0pct": ("greqprof pct=0 (blocking detection only)",
                 _greqprof(pct=0.0)),
    "gqp-disabled": ("greqprof enabled=False (GREQPROF_ENABLED=0): "
                     "imported, every request passed straight to the app",
                     _greqprof_disabled),
    "gqp-0pct-noblocking": ("greqprof pct=0 stack_hz=0 blocking_ms=None: the "
                            "C request path and the per-route counting, no "
                            "switch hook",
                            _greqprof(pct=0.0, stack_hz=0, blocking_ms=None)),
    "gqp-0pct-noroutes": ("greqprof pct=0, requests not counted by route",
                          _greqprof_no_routes(pct=0.0)),
    "gqp-5pct": ("greqprof pct=0.05 (spans), report=False",
                 _greqprof(pct=0.05)),
    "gqp-0pct-stack100": ("greqprof pct=0 stack_hz=100 (blocking detection "
                          "and the stack sampler, the default)",
                          _greqprof(pct=0.0, stack_hz=100)),
    "gqp-0pct-nostack": ("greqprof pct=0 stack_hz=0 (blocking detection "
                         "only)", _greqprof(pct=0.0, stack_hz=0)),
    "gqp-5pct-stack100": ("greqprof pct=0.05 stack_hz=100",
                          _greqprof(pct=0.05, stack_hz=100)),
    "gqp-100pct": ("greqprof pct=1.0 (spans), report=False",
                   _greqprof(pct=1.0)),
    "gqp-5pct-logged": ("greqprof pct=0.05, each report logged at INFO to "
                        "a file", _greqprof_logged(pct=0.05)),
    "gqp-100pct-logged": ("greqprof pct=1.0, each report logged at INFO to "
                          "a file", _greqprof_logged(pct=1.0)),
    "gqp-100pct-calls": ("greqprof pct=1.0 calls=True",
                         _greqprof(pct=1.0, calls=True)),
    "gqp-5pct-calls-logged": ("greqprof pct=0.05 calls=True, each report "
                              "logged at INFO to a file",
                              _greqprof_logged(pct=0.05, calls=True)),
    "gqp-100pct-calls-logged": ("greqprof pct=1.0 calls=True, each report "
                                "logged at INFO to a file",
                                _greqprof_logged(pct=1.0, calls=True)),
    "gevent-monitor": ("gevent's monitor thread (monitor_thread=True, "
                       "max_blocking_time=0.1)", _gevent_monitor),
    "bare-logged": ("bare app logging one access line per request at INFO "
                    "to a file", _access_logged),
    "werkzeug": ("werkzeug ProfilerMiddleware (cProfile)", _werkzeug),
    "passthrough": ("a WSGI middleware that only calls the app",
                    _passthrough),
    "settrace-noop": ("greenlet.settrace(operator.is_): a C no-op hook on "
                      "every switch", _settrace_noop),
    "yappi": ("yappi cpu, greenlet backend", _yappi),
}


def _wrapper(config):
    """CONFIGS[config]'s wrapper; ``gqp{...}`` (a JSON object of
    ProfilingMiddleware keyword arguments) for ad-hoc experiments."""
    if config.startswith("gqp{"):
        try:
            kw = json.loads(config[3:])
        except ValueError as exc:
            raise SystemExit("bad config %r: %s" % (config, exc))
        return _greqprof(**kw)
    if config not in CONFIGS:
        raise SystemExit("unknown config %r (known: %s, or gqp{JSON kwargs})"
                         % (config, ", ".join(CONFIGS)))
    return CONFIGS[config][1]


def _stats_of(wrapped):
    stats = getattr(wrapped, "stats", None)
    return dict(stats) if stats is not None else None


def build(config, rows=DEFAULT_ROWS):
    """The WSGI app of one configuration, with /__stats outside it."""
    wrapped = _wrapper(config)(make_app(rows))

    def outer(environ, start_response):
        if environ.get("PATH_INFO") == "/__stats":
            import gc
            body = json.dumps({"config": config, "pid": os.getpid(),
                               "gc": [g["collections"]
                                      for g in gc.get_stats()],
                               "app": dict(COUNTERS),
                               "monitor": _monitor_running(),
                               # (read each time: reading folds in
                               # what the C path counted)
                               "middleware": _stats_of(wrapped),
                               "sampler": _sampler_stats()}).encode()
            start_response("200 OK", [("Content-Type", "application/json"),
                                      ("Content-Length", str(len(body)))])
            return [body]
        return wrapped(environ, start_response)
    return outer


def _sampler_stats():
    mod = sys.modules.get("greqprof.sampler")
    return mod.stats() if mod is not None else None


def _server_class():
    import socket
    from gevent import pywsgi

    class NoDelayWSGIServer(pywsgi.WSGIServer):
        """pywsgi sends the headers and the body in two send() calls; on a
        keep-alive connection without TCP_NODELAY, Nagle's algorithm holds
        the body until the client's delayed ACK (40 ms on Linux), capping
        each connection at ~25 requests/s whatever the app costs.  Set it,
        as production servers and proxies do."""

        def handle(self, sock, address):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            return super().handle(sock, address)
    return NoDelayWSGIServer


def measure_app(rows, n=3000):
    """CPU microseconds per /hello request of the bare app, called
    in-process (no server, no HTTP) from a gevent greenlet."""
    import time
    app = make_app(rows)
    env = {"PATH_INFO": "/hello", "QUERY_STRING": "name=bench",
           "REQUEST_METHOD": "GET"}

    def start_response(status, headers, exc_info=None):
        pass

    def run(k):
        for _ in range(k):
            b"".join(app(env, start_response))

    gevent.spawn(run, n // 5).join()   # warm-up
    best = None
    for _ in range(3):
        t0 = time.thread_time_ns()
        gevent.spawn(run, n).join()
        us = (time.thread_time_ns() - t0) / n / 1000.0
        best = us if best is None else min(best, us)
    return best


# -- in-process microbenchmark of ProfilingMiddleware.__call__ ---------------

def _micro_noop(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


def _micro_spawn(environ, start_response):
    gevent.spawn(_aggregate, 20).get()
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


MICRO_APPS = {
    "noop": "returns a body; no greenlet",
    "spawn": "spawns one greenlet running a small Python function and "
             "joins it",
    "hello": "the /hello handler put under load (make_app)",
}

#: case -> (label, middleware kwargs, or None for no middleware)
MICRO_CASES = {
    "bare": ("no middleware", None),
    "hooks": ("no middleware, greqprof's C hooks installed (as after the "
              "first request)", None),
    "unsampled-noblock": ("pct=0, blocking_ms=None", dict(
        pct=0.0, blocking_ms=None)),
    "unsampled": ("pct=0 (unsampled path, blocking detection on)", dict(
        pct=0.0)),
    "sampled-linger0": ("pct=1.0, linger=0 (sampled path)", dict(
        pct=1.0, linger=0)),
    "sampled": ("pct=1.0 (sampled path, default linger=1.0)", dict(
        pct=1.0)),
    "sampled-calls": ("pct=1.0, calls=True", dict(pct=1.0, calls=True)),
}


def micro(case, kind, n, reps):
    """CPU ns per request of ProfilingMiddleware.__call__ around a dummy
    app, called in-process (no server, no socket).  Each request is
    followed by gevent.sleep(0), as a server's connection greenlet goes
    back to the hub between requests (so no span runs across requests);
    sampled profiles are finalized (linger included) inside the measured
    time.  Returns the per-repetition ns/request."""
    import logging
    import time
    logging.getLogger("greqprof").setLevel(logging.CRITICAL)
    inner = {"noop": _micro_noop, "spawn": _micro_spawn,
             "hello": make_app(DEFAULT_ROWS)}[kind]
    kw = MICRO_CASES[case][1]
    if kw is None:
        app = inner
        if case == "hooks":
            from greqprof.engine import engine_for_thread
            from greqprof.middleware import ProfilingMiddleware
            engine_for_thread(ProfilingMiddleware(inner).config)
    else:
        from greqprof import ProfilingMiddleware
        app = ProfilingMiddleware(inner, report=False, sink=_discard_profile,
                                  **kw)
    stats = getattr(app, "stats", None)
    env = {"PATH_INFO": "/hello", "QUERY_STRING": "name=bench",
           "REQUEST_METHOD": "GET",
           "SERVER_NAME": "127.0.0.1", "SERVER_PORT": "80",
           "wsgi.url_scheme": "http"}

    def start_response(status, headers, exc_info=None):
        pass

    def settle():
        deadline = time.monotonic() + 10
        while stats is not None and stats["delivered"] < stats["sampled"] \
                and time.monotonic() < deadline:
            gevent.sleep(0.001)

    def rep(k):
        t0 = time.thread_time_ns()
        for _ in range(k):
            result = app(dict(env), start_response)
            for _chunk in result:
                pass
            close = getattr(result, "close", None)
            if close is not None:
                close()
            gevent.sleep(0)
        settle()
        return (time.thread_time_ns() - t0) / k

    out = []

    def body():
        rep(max(n // 10, 10))    # warm-up (engine creation, caches)
        for _ in range(reps):
            out.append(rep(n))
    gevent.spawn(body).join()
    if stats is not None and (stats["errors"] or
                              (kw["pct"] > 0 and not stats["sampled"])):
        raise SystemExit("middleware misbehaved: %r" % (stats,))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="bare",
                    help="one of %s, or gqp{JSON ProfilingMiddleware kwargs}"
                    % ", ".join(CONFIGS))
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0,
                    help="0: an ephemeral port (printed as PORT <n>)")
    ap.add_argument("--rows", type=int, default=DEFAULT_ROWS)
    ap.add_argument("--measure-app", action="store_true",
                    help="print the CPU µs per /hello request of the bare "
                         "app (in-process, no server) and exit")
    ap.add_argument("--micro", metavar="CASE", choices=list(MICRO_CASES),
                    help="run one microbenchmark case (see MICRO_CASES), "
                         "print MICRO <json> and exit")
    ap.add_argument("--micro-app", default="noop", choices=list(MICRO_APPS))
    ap.add_argument("--micro-n", type=int, default=20000)
    ap.add_argument("--micro-reps", type=int, default=5)
    args = ap.parse_args()
    if args.micro:
        ns = micro(args.micro, args.micro_app, args.micro_n, args.micro_reps)
        print("MICRO " + json.dumps({"case": args.micro,
                                     "app": args.micro_app, "ns": ns}),
              flush=True)
        return
    if args.measure_app:
        print("APP_US %.1f" % measure_app(args.rows), flush=True)
        return
    app = build(args.config, args.rows)
    # log=None: no access log; errors (tracebacks) still go to stderr,
    # which the driver sends to a file it shows when something fails.
    server = _server_class()((args.host, args.port), app, log=None)
    server.start()
    print("PORT %d" % server.server_port, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
