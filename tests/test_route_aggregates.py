"""Issue 21 items 1, 2, 5, 6: the middleware counts every request by its
route (sampled or not, in C: greqprof/_routes.c), adds the sampled
requests' CPU and waiting and the blocking events, and logs a periodic
summary; real gevent.pywsgi servers over real sockets (gunicorn:
test_gunicorn.py)."""
import json
import logging
import random
import time

import gevent
import gevent.event
import pytest

import greqprof
from greqprof import ProfilingMiddleware, _registry, routes
from greqprof.routes import OTHER, RouteAggregates
from test_middleware import (http, parse_response, connect, read_all,  # noqa
                             serve, wait_for)
from conftest import need_module

pytestmark = pytest.mark.timeout(60)


def by_route(mw):
    return {r["route"]: r for r in mw.routes()}


def counts(mw):
    return {r["route"]: r["requests"] for r in mw.routes()}


#: a route name that is cleaned and cut (a control character, too long)
DIRTY = "r\x01" + "x" * 300


def app_of_paths(environ, start_response):
    p = environ["PATH_INFO"]
    if p.startswith("/raise"):
        raise RuntimeError("boom")
    if p.startswith("/gen"):
        start_response("201 Created", [("Content-Type", "text/plain")])

        def body():
            gevent.sleep(0.02)
            yield b"a"
            yield b"b"
        return body()
    if p.startswith("/bodyfail"):
        start_response("200 OK", [("Content-Type", "text/plain")])

        def failing():
            yield b"a"
            raise ValueError("in the body")
        return failing()
    if p.startswith("/latefail"):
        start_response("200 OK", [])
        raise RuntimeError("after start_response")
    if p.startswith("/firstfail"):
        start_response("200 OK", [])

        def first():
            yield b""   # (nothing sent yet)
            raise ValueError("before the first chunk")
        return first()
    if p.startswith("/unavail"):
        start_response("503 Service Unavailable", [])
        return [b"x"]
    if p.startswith("/named"):
        greqprof.set_route("by-app")
        gevent.spawn(greqprof.set_route, "by-child").join()
    if p.startswith("/sleep"):
        gevent.sleep(0.03)
    if p.startswith("/dirty"):
        greqprof.set_route(DIRTY)
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


@pytest.mark.parametrize("pct", [0.0, 1.0])
def test_every_request_is_counted_by_its_route(serve, pct):
    """Sampled or not: requests, errors (5xx or an exception, in the app or
    in its body), status classes, wall quantiles; a generator body is
    counted when the server closes it."""
    s = serve(app_of_paths, pct=pct, report=False, linger=0)
    plan = [("/items/1", 200), ("/items/22", 200), ("/gen/3", 201),
            ("/unavail", 503), ("/raise/9", 500), ("/named/1", 200),
            ("/sleep", 200), ("/latefail", 500), ("/firstfail", 500)]
    for target, status in plan:
        assert s.get(target).status == status, target
    s.get("/bodyfail")   # (the server cuts the chunked response)
    wait_for(lambda: sum(counts(s.mw).values()) == len(plan) + 1,
             what="every request counted")
    r = by_route(s.mw)
    assert counts(s.mw) == {"/items/{id}": 2, "/gen/{id}": 1, "/unavail": 1,
                            "/raise/{id}": 1, "by-app": 1, "/sleep": 1,
                            "/bodyfail": 1, "/latefail": 1, "/firstfail": 1}
    assert r["/items/{id}"]["errors"] == 0
    assert r["/items/{id}"]["status"]["2xx"] == 2
    assert r["/gen/{id}"]["status"]["2xx"] == 1
    assert r["/unavail"]["errors"] == 1 and r["/unavail"]["status"]["5xx"] == 1
    assert r["/raise/{id}"]["errors"] == 1
    assert r["/raise/{id}"]["status"]["5xx"] == 1
    assert r["/bodyfail"]["errors"] == 1
    # the status the server sent: 500 when the app failed before its
    # first chunk, whatever it started; the app's own once one was sent
    for path in ("/latefail", "/firstfail"):
        assert r[path]["errors"] == 1
        assert r[path]["status"]["5xx"] == 1 and r[path]["status"]["2xx"] \
            == 0, (path, r[path]["status"])
    assert r["/bodyfail"]["status"]["2xx"] == 1
    # (lower bounds only: the app slept that long)
    assert r["/gen/{id}"]["wall_p50"] >= 0.02 * 0.95
    assert r["/sleep"]["wall_p99"] >= 0.03 * 0.95
    for rec in r.values():
        assert rec["wall_p50"] <= rec["wall_p95"] <= rec["wall_p99"] <= \
            rec["wall_max"]
    if pct:
        assert r["/items/{id}"]["sampled"] == 2
        assert r["/items/{id}"]["cpu"] > 0
        assert r["/sleep"]["waiting"] >= 0.03 * 0.9
        top = r["/sleep"]["wait_sites"][0]
        assert "app_of_paths" in top["site"] and "test_route_aggregates" \
            in top["site"] and top["per_request"] >= 0.03 * 0.9
        assert r["/gen/{id}"]["sampled"] == 1
    else:
        assert all(rec["sampled"] == 0 and rec["cpu"] is None
                   for rec in r.values())


def test_a_sampled_list_body_keeps_its_content_length(serve):
    """The wrapper of a sampled list body is sized like it: gevent still
    sends Content-Length, not chunks."""
    s = serve(app_of_paths, pct=1.0, report=False, linger=0)
    resp = s.get("/items/1")
    assert resp.status == 200
    assert resp.headers.get("content-length") == "2"
    assert "transfer-encoding" not in resp.headers
    wait_for(lambda: by_route(s.mw)["/items/{id}"]["sampled"] == 1,
             what="the sampled request counted")


def test_set_route_of_a_child_greenlet_does_not_name_the_request(serve):
    s = serve(app_of_paths, pct=0.0, report=False)
    for _ in range(3):
        s.get("/named/x")
    assert counts(s.mw) == {"by-app": 3}
    assert "by-child" not in counts(s.mw)


def test_routes_are_bounded_and_the_rest_is_other(serve):
    s = serve(app_of_paths, pct=0.0, report=False, max_routes=5)
    for i in range(30):
        s.get("/r%d" % i)
    got = counts(s.mw)
    assert len(got) == 6 and got[OTHER] == 25
    assert sum(got.values()) == 30
    assert s.mw._routes.counts.overflowed == 25


def test_routes_past_max_routes_count_everything_under_other(serve):
    """Once the table is full, a new route's sampled profile and its
    blocking event are counted where its request is, under OTHER: no
    record past max_routes + 1, none with samples but no requests."""
    def app(environ, start_response):
        if environ["PATH_INFO"].startswith("/hold"):
            _hold(0.03)
        start_response("200 OK", [])
        return [b"ok"]
    draws = iter([0.99, 0.99] + [0.0] * 100)   # /a, /b unsampled, the rest
    s = serve(app, pct=0.5, rng=lambda: next(draws), report=False,
              linger=0, blocking_ms=10, max_routes=2,
              logger="greqprof.test_routes_overflow")
    for path in ("/a", "/b", "/c", "/hold/x", "/d"):
        assert s.get(path).status == 200
    wait_for(lambda: by_route(s.mw).get(OTHER, {}).get("sampled") == 3 and
             by_route(s.mw)[OTHER]["blocking"] >= 1,
             what="the samples and the blocking event under OTHER")
    got = by_route(s.mw)
    assert sorted(got) == sorted(["/a", "/b", OTHER]), sorted(got)
    assert got[OTHER]["requests"] == 3 and got[OTHER]["cpu"] is not None
    assert got["/a"]["sampled"] == got["/b"]["sampled"] == 0
    # pct=0: an unsampled request's blocking event, the table full
    s = serve(app, pct=0.0, report=False, blocking_ms=10, max_routes=1,
              logger="greqprof.test_routes_overflow0")
    s.get("/a")
    s.get("/hold/y")
    wait_for(lambda: s.mw.stats["blocking"] >= 1, what="the blocking event")
    wait_for(lambda: by_route(s.mw).get(OTHER, {}).get("blocking", 0) >= 1,
             what="counted under OTHER")
    assert sorted(by_route(s.mw)) == sorted(["/a", OTHER])


def test_the_route_callable_and_its_failures(serve):
    def route(environ):
        if environ["PATH_INFO"] == "/bad":
            raise KeyError("x")
        return "cb:" + environ["REQUEST_METHOD"]
    s = serve(app_of_paths, pct=0.0, report=False, route=route)
    s.get("/items/1")
    s.get("/items/2", method="POST")
    s.get("/bad")
    assert counts(s.mw) == {"cb:GET": 1, "cb:POST": 1, "/bad": 1}
    assert s.mw._routes.namer.errors == 1
    with pytest.raises(greqprof.ConfigError, match="route"):
        ProfilingMiddleware(app_of_paths, route="/x")
    with pytest.raises(greqprof.ConfigError, match="max_routes"):
        ProfilingMiddleware(app_of_paths, max_routes=0)


def test_max_routes_and_summary_from_the_environment(monkeypatch):
    mw = ProfilingMiddleware(app_of_paths, environ={
        "GREQPROF_MAX_ROUTES": "7", "GREQPROF_SUMMARY_S": "off"})
    assert mw._routes.max_routes == 7 and mw.summary_s is None
    with pytest.raises(greqprof.ConfigError, match="GREQPROF_MAX_ROUTES"):
        ProfilingMiddleware(app_of_paths,
                            environ={"GREQPROF_MAX_ROUTES": "0"})


def test_nested_middlewares_count_a_request_once(serve):
    inner = ProfilingMiddleware(app_of_paths, pct=0.0, report=False)
    s = serve(inner, pct=0.0, report=False)
    s.get("/items/1")
    assert counts(s.mw) == {"/items/{id}": 1}
    assert counts(inner) == {}


def test_blocking_events_count_by_route(serve):
    """A request that holds the loop: its blocking event is counted by its
    route, sampled (by the route, when its profile is delivered) or not (by
    its path)."""
    def app(environ, start_response):
        deadline = time.perf_counter() + 0.03
        while time.perf_counter() < deadline:
            pass
        start_response("200 OK", [])
        return [b"ok"]
    for pct in (0.0, 1.0):
        s = serve(app, pct=pct, report=False, blocking_ms=10, linger=0,
                  logger="greqprof.test_routes_blocking")
        s.get("/hold/1")
        s.get("/hold/2")
        wait_for(lambda: by_route(s.mw).get("/hold/{id}", {}).get(
            "blocking", 0) >= 2, what="blocking counted (pct=%s)" % pct)
        rec = by_route(s.mw)["/hold/{id}"]
        # (at least: on a busy host a request's other span can pass 10 ms
        # of wall time too, an event of the same request and route)
        assert rec["blocking"] >= 2 and rec["blocked"] >= 0.02
        assert s.mw._routes.blocking >= 2


def _hold(seconds):
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


def test_unsampled_blocking_counts_under_the_route_the_app_named(serve):
    """An unsampled request's blocking event is counted when its span
    ends, before the request's route is final: it takes the name the
    framework or set_route gave the request so far (a child greenlet its
    request's), not the path's, which made a route of its own with
    blocking and no requests.  A route= callable is asked at the end:
    its requests' events stay under the path."""
    flask = need_module("flask")   # (a test extra: pyproject)
    app = flask.Flask("blocking_routes_test")

    @app.route("/items/<int:item_id>")
    def item(item_id):
        _hold(0.03)
        return "item"

    @app.route("/pay/<int:n>")
    def pay(n):
        greqprof.set_route("checkout")
        _hold(0.03)
        return "paid"

    @app.route("/kids/<int:k>")
    def kids(k):
        gevent.spawn(_hold, 0.03).join()
        return "kids"

    s = serve(app.wsgi_app, pct=0.0, report=False, blocking_ms=10,
              linger=0, logger="greqprof.test_routes_blocking")
    for target in ("/items/1", "/items/2", "/pay/3", "/kids/4"):
        assert s.get(target).status == 200
    want = {"/items/<int:item_id>": 2, "checkout": 1, "/kids/<int:k>": 1}
    wait_for(lambda: all(by_route(s.mw).get(r, {}).get("blocking", 0) >= n
                         for r, n in want.items()),
             what="blocking counted by route")
    got = by_route(s.mw)
    # (at least: on a busy host a request's own span around the hold can
    # pass 10 ms of wall time too, its CPU time a fraction of that: a
    # blocking event of the same request, under the same route)
    assert all(got[r]["blocking"] >= n for r, n in want.items()), got
    assert {r: got[r]["requests"] for r in want} == {
        "/items/<int:item_id>": 2, "checkout": 1, "/kids/<int:k>": 1}
    # (no route made of a path: every route has its requests)
    assert all(r["requests"] > 0 for r in got.values()), got

    def plain(environ, start_response):
        _hold(0.03)
        start_response("200 OK", [])
        return [b"ok"]
    s3 = serve(plain, pct=0.0, report=False, blocking_ms=10, linger=0,
               route=lambda environ: "by-callable",
               logger="greqprof.test_routes_blocking")
    assert s3.get("/plain/7").status == 200
    wait_for(lambda: by_route(s3.mw).get("/plain/{id}", {}).get(
        "blocking", 0) >= 1, what="the callable's request's blocking")
    assert by_route(s3.mw)["by-callable"]["requests"] == 1


def test_flask_routes_under_pywsgi(serve):
    """Flask's matched rule names its requests (the hook is installed when
    the middleware is made); a 404 falls back to the path."""
    flask = need_module("flask")   # (a test extra: pyproject)
    app = flask.Flask("route_aggregates")

    @app.route("/items/<int:item_id>")
    def item(item_id):
        return "item %d" % item_id

    @app.route("/fail")
    def fail():
        raise RuntimeError("x")

    app.wsgi_app = ProfilingMiddleware(app.wsgi_app, pct=0.5, seed=3,
                                       report=False, linger=0)
    mw = app.wsgi_app
    from gevent import pywsgi
    server = pywsgi.WSGIServer(("127.0.0.1", 0), app, log=None)
    server.start()
    try:
        for i in range(10):
            assert http(server.server_port, "/items/%d" % i).status == 200
        assert http(server.server_port, "/fail").status == 500
        assert http(server.server_port, "/nope/5").status == 404
        wait_for(lambda: sum(counts(mw).values()) == 12, what="12 counted")
        r = by_route(mw)
        assert counts(mw) == {"/items/<int:item_id>": 10, "/fail": 1,
                              "/nope/{id}": 1}
        assert r["/fail"]["errors"] == 1
        assert r["/nope/{id}"]["status"]["4xx"] == 1
        assert 0 < r["/items/<int:item_id>"]["sampled"] < 10
    finally:
        server.stop(timeout=2)


def test_the_summary_line(serve, caplog):
    s = serve(app_of_paths, pct=1.0, report=False, linger=0,
              logger="greqprof.test_summary")
    for _ in range(3):
        s.get("/items/1")
    s.get("/sleep")
    wait_for(lambda: sum(counts(s.mw).values()) == 4, what="4 counted")
    with caplog.at_level(logging.INFO, logger="greqprof.test_summary"):
        s.mw._routes_tick(time.monotonic() + 1e6)
        s.mw._routes_tick(time.monotonic() + 2e6)   # (nothing ran since)
    lines = [r.getMessage() for r in caplog.records
             if r.name == "greqprof.test_summary"]
    assert len(lines) == 1, lines
    line = lines[0]
    assert "4 requests in the last 60 s" in line
    assert "top total CPU since start" in line and "/items/{id}" in line
    assert line.index("/sleep", line.index("top p99")) > 0
    # JSON
    s.mw.json_logs = True
    s.get("/items/2")
    wait_for(lambda: sum(counts(s.mw).values()) == 5, what="5 counted")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="greqprof.test_summary"):
        s.mw._routes_tick(time.monotonic() + 3e6)
    d = json.loads(caplog.records[-1].getMessage())
    assert d["schema"] == "greqprof.routes/1" and d["requests"] == 5
    assert d["requests_in_period"] == 1
    assert d["top_p99"][0]["route"] == "/sleep"
    assert {x["route"] for x in d["top_cpu"]} == {"/items/{id}", "/sleep"}


def test_summary_records_are_to_records_cut_down():
    """The summary line reads summary_records(): the same numbers as
    to_records() for its keys; counts.requests sums every route's."""
    agg = RouteAggregates(_registry.RouteCounts, max_routes=3)
    rnd = random.Random(3)
    for i in range(200):
        agg.counts.record("/r%d" % (i % 5), 500 if i % 9 == 0 else 200,
                          False, rnd.lognormvariate(-5, 1))
    agg.add_sampled("/r1", 0.003, 0.001)
    agg.add_sampled("/r1", 0.005, None)
    full = {r["route"]: r for r in agg.to_records()}
    cut = {r["route"]: r for r in agg.summary_records()}
    assert set(cut) == set(full) and routes.OTHER in cut
    for route, r in cut.items():
        assert r == {k: full[route][k] for k in r}, route
    assert set(next(iter(cut.values()))) == {
        "route", "requests", "errors", "sampled", "cpu", "cpu_total",
        "wall_p99"}
    assert cut["/r1"]["cpu"] == pytest.approx(0.004)
    assert agg.counts.requests == 200 == sum(r["requests"]
                                             for r in cut.values())


def test_summary_is_logged_by_the_drain_loop(serve, caplog):
    with caplog.at_level(logging.INFO, logger="greqprof.test_summary2"):
        s = serve(app_of_paths, pct=0.0, report=False, summary_s=0.5,
                  logger="greqprof.test_summary2")
        s.get("/items/1")
        wait_for(lambda: any("greqprof routes" in r.getMessage()
                             for r in caplog.records), what="a summary")


NO_HOOKS = dict(pct=0.0, report=False, blocking_ms=None, stack_hz=0)


def test_summary_and_metrics_without_hooks_tick_while_requests_run(serve,
                                                                   caplog):
    """No blocking detection, no stack sampler, nothing sampled: no hook,
    no engine, so no drain loop.  A request's end starts a ticker (a
    greenlet of the hub's) that ticks once a second while requests run:
    the summary is logged, from no request's greenlet, and the counts
    reach prometheus_client without a scrape.  (Before: never logged.)"""
    need_module("prometheus_client")
    import greenlet
    from greqprof import engine
    log = "greqprof.test_summary3"
    emitted_in, served_in = [], []

    class Where(logging.Handler):
        def emit(self, record):
            emitted_in.append(greenlet.getcurrent())

    def app(environ, start_response):
        served_in.append(greenlet.getcurrent())
        return app_of_paths(environ, start_response)
    logging.getLogger(log).addHandler(Where())
    with caplog.at_level(logging.INFO, logger=log):
        s = serve(app, summary_s=0.5, logger=log,
                  metrics_path="/_greqprof/metrics", **NO_HOOKS)
        s.get("/items/1")
        s.get("/items/2")
        wait_for(lambda: [r for r in caplog.records if r.name == log], 5,
                 "a summary")
        assert engine.current_engine() is None
        assert greenlet.gettrace() is None
        lines = [r.getMessage() for r in caplog.records if r.name == log]
        assert len(lines) == 1 and "greqprof routes" in lines[0], lines
        assert "2 requests" in lines[0] and "/items/{id}" in lines[0]
        got = s.mw.metrics.registry.get_sample_value(
            "greqprof_requests_total",
            {"route": "/items/{id}", "status": "2xx"})
        assert got == 2.0
        # (and it ends: idle, nothing more is logged)
        wait_for(lambda: not s.mw._tickers, 5, "the ticker's end")
        assert len([r for r in caplog.records if r.name == log]) == 1
        # A request after it ended starts another, which logs and syncs it.
        # (Before: a request within 2 s of the ended ticker's last tick was
        # never summarized nor synced while the server stayed idle.)
        s.get("/items/3")
        wait_for(lambda: len([r for r in caplog.records
                              if r.name == log]) == 2, 5, "a 2nd summary")
        assert s.mw.metrics.registry.get_sample_value(
            "greqprof_requests_total",
            {"route": "/items/{id}", "status": "2xx"}) == 3.0
    assert emitted_in and not set(emitted_in) & set(served_in)
    assert s.mw.stats["errors"] == 0


@pytest.mark.parametrize("hooks", [False, True])
def test_a_thread_without_gevents_loop_ticks_itself(caplog, hooks):
    """Requests served by a plain thread (a threaded server: no gevent
    loop there) tick where they end: the summary is logged, and without
    hooks no gevent hub is made in that thread.  (Before: a hub was made
    in each such thread, whose loop never ran: no summary, two file
    descriptors a thread.  With hooks the engine makes one, which never
    runs either: the summary was not logged.)"""
    import io
    import threading
    from gevent._hub_local import get_hub_if_exists
    log = "greqprof.test_summary6"
    opts = dict(NO_HOOKS, blocking_ms=100, stack_hz=100) if hooks \
        else NO_HOOKS
    mw = ProfilingMiddleware(app_of_paths, summary_s=0.5, logger=log,
                             **opts)
    hubs = []

    def serve_some():
        for i in range(4):
            env = {"REQUEST_METHOD": "GET", "PATH_INFO": "/items/%d" % i,
                   "SERVER_NAME": "x", "SERVER_PORT": "80",
                   "wsgi.input": io.BytesIO(b""), "wsgi.url_scheme": "http"}
            b"".join(mw(env, lambda *a: None))
            time.sleep(0.6)
        hubs.append(get_hub_if_exists())
    with caplog.at_level(logging.INFO, logger=log):
        t = threading.Thread(target=serve_some)
        t.start()
        t.join()
        lines = [r.getMessage() for r in caplog.records if r.name == log]
    assert lines and "greqprof routes" in lines[0], lines
    if not hooks:
        assert hubs == [None]


def test_a_stalled_ticker_elsewhere_does_not_hold_the_summary(serve,
                                                              caplog):
    """Thread A serves a request (its ticker starts in A's loop), then
    stops its server and blocks: its ticker neither runs nor dies.  This
    thread's requests get a ticker of their own.  (Before: none, for as
    long as A lived.)"""
    import queue
    import socket
    import threading
    from gevent import pywsgi
    log = "greqprof.test_summary8"
    with caplog.at_level(logging.INFO, logger=log):
        s = serve(app_of_paths, summary_s=0.5, logger=log, **NO_HOOKS)
        ports, served, done = queue.Queue(), threading.Event(), \
            threading.Event()

        def thread_a():
            srv = pywsgi.WSGIServer(("127.0.0.1", 0), s.mw, log=None)
            srv.start()
            ports.put(srv.server_port)
            while not served.is_set():
                gevent.sleep(0.01)
            gevent.sleep(0.3)   # (its ticker starts and ticks)
            srv.stop()
            done.wait(30)       # (blocked: the loop does not run)
        a = threading.Thread(target=thread_a, daemon=True)
        a.start()
        c = socket.create_connection(("127.0.0.1", ports.get(timeout=10)))
        c.sendall(b"GET /items/0 HTTP/1.0\r\n\r\n")
        while c.recv(65536):
            pass
        c.close()
        served.set()
        try:
            wait_for(lambda: s.mw._routes.counts.requests == 1 and
                     any(g is not None for g, _ in s.mw._tickers.values()),
                     10, "thread A's ticker")
            gevent.sleep(0.5)
            for i in range(12):
                s.get("/items/%d" % i)
                if len([r for r in caplog.records if r.name == log]) > 1:
                    break
                gevent.sleep(0.5)
            wait_for(lambda: len([r for r in caplog.records
                                  if r.name == log]) > 1, 5,
                     "a summary of this thread's requests")
        finally:
            done.set()
            a.join(10)


def test_a_log_handler_that_hangs_holds_one_ticker(serve, caplog):
    """A log handler that never returns (a network sink whose peer hangs)
    holds the ticker inside the summary; requests go on, and no other
    ticker is started beside it.  (Before: one more every 3 s.)"""
    log = "greqprof.test_summary7"
    release = gevent.event.Event()
    tickers = set()

    class Hangs(logging.Handler):
        def emit(self, record):
            release.wait()
    handler = Hangs()
    logging.getLogger(log).addHandler(handler)
    try:
        with caplog.at_level(logging.INFO, logger=log):
            s = serve(app_of_paths, summary_s=0.5, logger=log, **NO_HOOKS)
            for i in range(9):
                assert s.get("/items/%d" % i).status == 200
                tickers.update(g for g, _ in s.mw._tickers.values())
                gevent.sleep(0.5)
            assert len(tickers - {None}) == 1, tickers
    finally:
        release.set()
        logging.getLogger(log).removeHandler(handler)


def test_a_drain_loop_elsewhere_leaves_the_ticker_on(serve, caplog):
    """A triggered request served once by another thread gives that thread
    an engine and a drain loop that never runs (its hub does not); the
    serving thread's summary goes on.  (Before the ticker checked whether
    a drain loop ticked lately, it was turned off for good.)"""
    import io
    import threading
    log = "greqprof.test_summary4"
    with caplog.at_level(logging.INFO, logger=log):
        s = serve(app_of_paths, summary_s=0.5, logger=log,
                  trigger_header="X-Profile", trigger_secret="s3cret-42",
                  **NO_HOOKS)

        def triggered():
            env = {"REQUEST_METHOD": "GET", "PATH_INFO": "/items/9",
                   "SERVER_NAME": "x", "SERVER_PORT": "80",
                   "wsgi.input": io.BytesIO(b""), "wsgi.url_scheme": "http",
                   "HTTP_X_PROFILE": "s3cret-42"}
            body = s.mw(env, lambda *a: None)
            b"".join(body)
            body.close()
        t = threading.Thread(target=triggered)
        t.start()
        t.join()
        assert s.mw.stats["sampled"] == 1
        # (that thread's request also started a ticker in its hub, which
        # never runs: past 3 s one is started here)
        for i in range(10):
            s.get("/items/%d" % i)
            if [r for r in caplog.records if r.name == log]:
                break
            gevent.sleep(0.5)
        wait_for(lambda: [r for r in caplog.records if r.name == log], 5,
                 "a summary")


def test_a_failing_summary_is_an_internal_error(serve, caplog):
    """A log filter that raises on the summary: counted and logged as
    greqprof's internal error, as from the drain loop, not lost."""
    log = "greqprof.test_summary5"

    class Boom(logging.Filter):
        def filter(self, record):
            if "greqprof routes" in record.getMessage():
                raise RuntimeError("filter bug")
            return True
    logging.getLogger(log).addFilter(Boom())
    with caplog.at_level(logging.INFO, logger=log):
        s = serve(app_of_paths, summary_s=0.5, logger=log, **NO_HOOKS)
        s.get("/items/1")
        wait_for(lambda: s.mw.stats["errors"] >= 1, 5, "an internal error")


def test_set_route_bounds_what_no_request_takes():
    routes._named.clear()
    for _ in range(3):
        assert gevent.spawn(greqprof.set_route, "x").get() is True
    assert len(routes._named) == 3
    for _ in range(routes._MAX_NAMED + 5):
        gevent.spawn(greqprof.set_route, "x").get()
    assert len(routes._named) <= routes._MAX_NAMED
    routes._named.clear()


def test_set_route_names_only_requests(serve):
    """A name set outside any request does not name the next request its
    greenlet serves; a request in flight keeps its name while names
    nobody takes (ended greenlets') are bounded."""
    routes._named.clear()
    from gevent.event import Event
    orphans_done = Event()

    def app(environ, start_response):
        if environ["PATH_INFO"] == "/slow/1":
            greqprof.set_route("slow-named")
            orphans_done.wait(10)   # (meanwhile, names nobody takes pile up)
        start_response("200 OK", [])
        return [b"ok"]
    s = serve(app, pct=0.0, report=False)
    assert greqprof.set_route("set-at-start-up") is True
    list(s.mw({"PATH_INFO": "/direct/1", "REQUEST_METHOD": "GET"},
              lambda *a: None))    # (served on this very greenlet)
    slow = gevent.spawn(s.get, "/slow/1")
    gevent.sleep(0.05)
    for _ in range(routes._MAX_NAMED + 5):
        gevent.spawn(greqprof.set_route, "orphan").join()
    orphans_done.set()
    assert slow.get().status == 200
    assert len(routes._named) <= routes._MAX_NAMED
    assert counts(s.mw) == {"/direct/{id}": 1, "slow-named": 1}
    routes._named.clear()


# ---------------------------------------------------------------------------
# Prometheus (the real server scraping gunicorn: test_prometheus.py)

def test_metrics_page_in_one_process(serve):
    need_module("prometheus_client")   # (extra: greqprof[prometheus])
    s = serve(app_of_paths, pct=1.0, report=False, linger=0,
              metrics_path="/_greqprof/metrics")
    for i in range(3):
        s.get("/items/%d" % i)
    s.get("/unavail")
    wait_for(lambda: by_route(s.mw).get("/items/{id}", {}).get("sampled")
             == 3, what="3 sampled")
    resp = s.get("/_greqprof/metrics")
    assert resp.status == 200
    text = resp.body.decode()
    assert 'greqprof_requests_total{route="/items/{id}",status="2xx"} 3.0' \
        in text
    assert 'greqprof_requests_total{route="/unavail",status="5xx"} 1.0' \
        in text
    assert 'greqprof_request_duration_seconds_count{route="/items/{id}"} ' \
        '3.0' in text
    assert 'greqprof_request_duration_seconds_bucket{le="+Inf",' \
        'route="/items/{id}"} 3.0' in text
    assert 'greqprof_request_cpu_seconds_count{route="/items/{id}"} 3.0' \
        in text
    # the page itself is not a route; a second scrape adds nothing twice
    assert s.get("/_greqprof/metrics").body.decode().count(
        'status="2xx"} 3.0') == 1
    assert "/_greqprof/metrics" not in counts(s.mw)
    # the inspector's access rules: loopback only by default
    resp = s.get("/_greqprof/metrics", headers=[("Host", "evil.example")])
    assert resp.status == 403


def test_metrics_sync_reads_only_the_routes_that_changed(serve):
    """The once-a-second sync reads the request table's rows that counted
    requests since the last one, and the routes whose samples or blocking
    changed: a large table of idle routes costs it nothing."""
    need_module("prometheus_client")
    s = serve(app_of_paths, pct=0.0, report=False, blocking_ms=None,
              metrics_path="/_greqprof/metrics", max_routes=2000)
    for i in range(300):
        s.get("/route%d" % i)
    m = s.mw.metrics
    counts_table = s.mw._routes.counts
    before = len(m._known)   # (the drain loop may have synced some)
    m.tick()   # (the drain loop's: a burst of new routes over seconds)
    assert len(m._known) == min(before + 100, 300)
    m.sync()
    assert len(m._known) == 300
    assert counts_table.snapshot(m._known) == []
    assert s.mw._routes.take_changed() == {}
    s.get("/route7")
    s.get("/route7")
    changed = counts_table.snapshot(m._known)
    assert [(r[0], r[1]) for r in changed] == [("/route7", 3)]
    m.sync()
    text = s.get("/_greqprof/metrics").body.decode()
    assert 'greqprof_requests_total{route="/route7",status="2xx"} 3.0' \
        in text
    assert 'greqprof_requests_total{route="/route8",status="2xx"} 1.0' \
        in text
    assert 'greqprof_request_duration_seconds_count{route="/route7"} ' \
        '3.0' in text


def test_metrics_path_needs_prometheus_client(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(greqprof.ConfigError, match="greqprof.prometheus"):
        ProfilingMiddleware(app_of_paths, metrics_path="/_m")
    with pytest.raises(greqprof.ConfigError, match="metrics_path"):
        ProfilingMiddleware(app_of_paths, metrics_path="metrics")


# ---------------------------------------------------------------------------
# the inspector's Routes page

def test_routes_page_sorts_and_links_to_the_routes_profiles(serve):
    s = serve(app_of_paths, pct=1.0, report=False, linger=0,
              ui_path="/_greqprof")
    for i in range(3):
        s.get("/items/%d" % i)
    s.get("/sleep")
    wait_for(lambda: sum(r["sampled"] for r in s.mw.routes()) == 4,
             what="4 sampled")
    page = s.get("/_greqprof/routes?sort=p99").body.decode()
    assert page.index("/sleep") < page.index("/items/{id}")   # (p99)
    page = s.get("/_greqprof/routes?sort=requests").body.decode()
    assert page.index("/items/{id}") < page.index("/sleep")
    assert "/_greqprof/?route=%2Fitems%2F%7Bid%7D" in page
    assert "/_greqprof/routes" not in counts(s.mw)   # (not a route)
    listed = s.get("/_greqprof/?route=%2Fitems%2F%7Bid%7D").body.decode()
    assert listed.count('class="gq-profile-row') == 3
    assert "route: /items/{id}" in listed
    assert s.get("/_greqprof/routes?sort=nonsense").status == 200
    assert s.get("/_greqprof/routes",
                 headers=[("Host", "evil.example")]).status == 403


def test_sampled_numbers_come_from_the_raw_profile_unbuilt(serve):
    """The route's CPU, waiting and wait sites are read from a deferred
    profile's raw data (it stays unbuilt) and equal the built fields."""
    s = serve(app_of_paths, pct=1.0, report=False, linger=0)
    s.get("/sleep")
    (p,) = s.wait_profiles(1)
    wait_for(lambda: by_route(s.mw)["/sleep"]["sampled"] == 1,
             what="the sampled request counted")
    assert "_loader" in vars(p)   # (not built by the aggregates)
    rec = by_route(s.mw)["/sleep"]
    assert rec["cpu"] == pytest.approx(p.cpu)
    assert rec["waiting"] == pytest.approx(p.waiting.seconds)
    w = p.waits[0]
    assert rec["wait_sites"][0] == {
        "site": "%s (%s:%d)" % (w.fn_name, w.filename, w.lineno),
        "seconds": pytest.approx(w.seconds),
        "per_request": pytest.approx(w.seconds)}
    assert p.route == "/sleep"


def test_the_servers_file_wrapper_goes_back_unwrapped(serve):
    """gunicorn sends its wsgi.file_wrapper with sendfile: an unsampled
    request's is returned as it is (counted when the app returns it)."""
    class FileWrapper:
        def __init__(self, data):
            self.data = data

        def __iter__(self):
            return iter([self.data])

    seen = []

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return environ["wsgi.file_wrapper"](b"file")

    def server_side(mw):
        def outer(environ, start_response):
            environ["wsgi.file_wrapper"] = FileWrapper
            body = mw(environ, start_response)
            seen.append(type(body))
            return body
        return outer
    s = serve(app, wrap=server_side, pct=0.0, report=False)
    assert s.get("/f").body == b"file"
    assert seen == [FileWrapper]
    assert counts(s.mw) == {"/f": 1}


def test_a_scanner_costs_bounded_memory(serve):
    """Thousands of distinct paths: at most max_routes routes plus
    <other>, and a bounded path cache that keeps no long path."""
    s = serve(app_of_paths, pct=0.0, report=False, max_routes=20)
    c = s.mw._routes.counts
    for i in range(300):
        s.get("/scan-%d/%s" % (i, "x" * (300 if i % 2 else 10)))
    got = counts(s.mw)
    assert len(got) == 21 and sum(got.values()) == 300
    assert c.cached_paths == 150   # (only the short ones)


def test_the_path_cache_starts_again_when_full():
    """Paths seen once (ids) fill the path -> route cache; then it starts
    again instead of sending every new path to the Python namer for
    good."""
    mw = ProfilingMiddleware(app_of_paths, pct=0.0, report=False,
                             stack_hz=0, blocking_ms=None, summary_s=None)
    c = mw._routes.counts

    def get(path):
        body = mw({"PATH_INFO": path, "SCRIPT_NAME": "",
                   "REQUEST_METHOD": "GET"}, lambda *a: None)
        assert list(body) == [b"ok"]
    for i in range(4096):
        get("/items/%d" % i)
    assert c.cached_paths == 4096
    for i in range(10):
        get("/later/%d" % i)
    assert c.cached_paths == 10
    get("/health")
    get("/health")
    assert c.cached_paths == 11
    assert counts(mw) == {"/items/{id}": 4096, "/later/{id}": 10,
                          "/health": 2}


def test_paths_named_in_c_match_the_python_rule():
    """The C namer of a path not in the cache (short printable ASCII)
    gives what routes.path_route gives, ids and all; anything else is
    left to Python."""
    import collections
    import random
    rng = random.Random(21)
    alphabet = "0123456789abcdefABCDEFxyz-_./~%\\ \x01\x7f"
    pieces = ["123", "0", "deadbeefdeadbeef1", "deadbeefdeadbeefx",
              "abcdefabcdefabcdef", "123e4567-e89b-12d3-a456-426614174000",
              "123e4567-e89b-12d3-a456-42661417400g", "items", "", "x" * 60]
    paths = ["", "/", "//", "/" + "1/" * 150, "/" + "ab/" * 70,
             "/caf\u00e9/1"]
    for _ in range(3000):
        parts = [rng.choice(pieces) if rng.random() < 0.5 else "".join(
            rng.choice(alphabet) for _ in range(rng.randrange(0, 20)))
            for _ in range(rng.randrange(1, 6))]
        paths.append("/".join(parts))
    mw = ProfilingMiddleware(app_of_paths, pct=0.0, report=False,
                             stack_hz=0, blocking_ms=None, summary_s=None,
                             max_routes=100000)
    for path in paths:
        body = mw({"PATH_INFO": path, "SCRIPT_NAME": "",
                   "REQUEST_METHOD": "GET"}, lambda *a: None)
        list(body)
    want = collections.Counter(routes.path_route(p) for p in paths)
    assert counts(mw) == dict(want)


def test_sampled_requests_of_a_route_named_uncleanly_count_under_its_name(
        serve):
    """Each sampled request of a route whose raw name is cleaned (the name
    is cleaned once and then reused) counts under the clean name, which
    its profile carries too."""
    s = serve(app_of_paths, pct=1.0, report=False, linger=0)
    for _ in range(3):
        s.get("/dirty")
    profiles = s.wait_profiles(3)
    name = routes.route_name(DIRTY)
    assert name != DIRTY
    wait_for(lambda: by_route(s.mw).get(name, {}).get("sampled") == 3,
             what="three sampled requests counted")
    assert [p.route for p in profiles] == [name] * 3
    assert by_route(s.mw)[name]["requests"] == 3


def test_a_body_collected_in_another_request_takes_its_own_name():
    """A body dropped without close() is counted when the collector frees
    it, in whichever greenlet runs the collection: the name set_route gave
    its request is its own, not the running request's (before: request A
    was counted under B's name, and B, its name taken, under its path)."""
    import gc
    import greenlet
    from greqprof import set_route

    def app(environ, start_response):
        set_route(environ["PATH_INFO"] + "/named")
        start_response("200 OK", [("Content-Type", "text/plain")])

        def body():
            yield b"x"
        return body()

    mw = ProfilingMiddleware(app, pct=0.0, report=False, summary_s=None,
                             blocking_ms=None, stack_hz=0)

    def env(path):
        return {"REQUEST_METHOD": "GET", "PATH_INFO": path,
                "SCRIPT_NAME": "", "wsgi.url_scheme": "http"}

    def request_a():
        body = mw(env("/a"), lambda *a: None)
        list(body)
        cycle = [body]
        cycle.append(cycle)      # dropped without close(), in a cycle

    def request_b():
        body = mw(env("/b"), lambda *a: None)
        gc.collect()             # (any allocation in B's app code)
        list(body)
        body.close()

    was = gc.isenabled()
    gc.disable()
    try:
        greenlet.greenlet(request_a).switch()
        greenlet.greenlet(request_b).switch()
    finally:
        if was:
            gc.enable()
    assert counts(mw) == {"/a/named": 1, "/b/named": 1}
