"""greqprof/routes.py: route naming (set_route, Flask and Django route
templates through real apps on gevent.pywsgi, the route= callable, the
path with its ids replaced), the bounded route table and its wall-time
quantile estimates.

The real-server tests wrap the app in the middleware (pct=0) and read the
names back from ``mw.routes()``; test_route_aggregates.py tests the
counting itself."""
import math
from array import array
import random
import sys
import threading
import types
import uuid

import gevent
import pytest

from greqprof import routes
from greqprof.routes import (MAX_ROUTE, OTHER, ROUTE_KEY,
                             DjangoRouteMiddleware, RouteNamer, RouteTable,
                             WallHistogram, framework_route, path_route,
                             set_route, take_route)
from greqprof import ProfilingMiddleware
from test_middleware import http, http_raw, plain_server  # noqa: F401
from conftest import need_module

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------------------
# the path, ids replaced

@pytest.mark.parametrize("path, route", [
    ("/items/123/detail", "/items/{id}/detail"),
    ("/items/123", "/items/{id}"),
    ("/items/123/", "/items/{id}/"),
    ("/u/%s/x" % uuid.UUID(int=7), "/u/{id}/x"),
    ("/u/%s" % str(uuid.uuid4()).upper(), "/u/{id}"),
    ("/blob/0123456789abcdef", "/blob/{id}"),            # 16 hex
    ("/blob/0123456789ABCDEF0123", "/blob/{id}"),
    ("/blob/deadbeef", "/blob/deadbeef"),                # short hex: a word
    ("/blob/0123456789abcdeg", "/blob/0123456789abcdeg"),
    ("/blob/" + "a" * 40, "/blob/" + "a" * 40),       # no digit: a word
    ("/blob/" + "a" * 39 + "0", "/blob/{id}"),
    ("/v2/users", "/v2/users"),
    ("/123abc", "/123abc"),
    ("/a/1/b/22/c/333", "/a/{id}/b/{id}/c/{id}"),
    ("", "/"),
    ("/", "/"),
    ("//x//1", "//x//{id}"),
])
def test_id_like_segments_become_id(path, route):
    assert path_route(path) == route
    assert path_route(path.encode("latin-1")) == route


def test_paths_are_clean_text():
    # (WSGI text: the UTF-8 bytes of /café decoded as latin-1)
    assert path_route("/caf\u00c3\u00a9/7") == "/caf\u00e9/{id}"
    assert path_route(b"/caf\xc3\xa9/7") == "/caf\u00e9/{id}"
    # not UTF-8: the latin-1 characters, escaped where not printable
    assert path_route("/\xff\xfe/\x85/1") == "/\xff\xfe/\\x85/{id}"
    assert path_route("/a\x1b[31m/\u202e") == "/a\\x1b[31m/\\u202e"
    assert path_route("/x\udcff") == "/x\\udcff"
    with pytest.raises(TypeError, match="a path is a str or bytes, got int"):
        path_route(3)


def test_huge_paths_are_cut():
    for path in ("/" + "z" * 1000000, "/1" * 500000, "/\x00" * 300000):
        name = path_route(path)
        assert len(name) == MAX_ROUTE and name.endswith("...")
        assert name.isprintable()
    assert path_route("/" + "z" * (MAX_ROUTE - 1)) == "/" + "z" * (
        MAX_ROUTE - 1)


@pytest.mark.parametrize("head", ["/", "/x"])
def test_a_long_utf8_path_cut_inside_a_character_stays_utf8(head):
    """The path is cut (as latin-1 WSGI text) before it is decoded: a cut
    inside a two-byte character must not turn the whole name into
    latin-1 mojibake."""
    path = (head + "\u00e9" * 600).encode("utf-8")
    for form in (path, path.decode("latin-1")):
        name = path_route(form)
        assert name.startswith(head + "\u00e9" * 50), name[:20]
        assert "\u00c3" not in name and name.endswith("...")


# ---------------------------------------------------------------------------
# set_route and the namer's order

def test_set_route_names_the_calling_greenlets_request():
    assert set_route("x") is True
    assert take_route() == "x"
    assert take_route() is None   # (taken: nothing left behind)


def test_set_route_refuses_what_is_not_a_name():
    with pytest.raises(TypeError, match="must be a str, got int"):
        set_route(3)
    with pytest.raises(TypeError, match="got bytes"):
        set_route(b"/x")
    with pytest.raises(ValueError, match="must not be empty"):
        set_route("")


def test_set_route_is_per_greenlet():
    """Concurrent requests on one thread each get their own name; a
    greenlet a request spawns names only itself (documented)."""
    got = {}

    def request(name):
        gevent.sleep(0.01)
        assert set_route(name) is True
        gevent.sleep(0.01)
        child = gevent.spawn(set_route, "no")
        child.join()
        got[name] = take_route()
        got[name + " child"] = take_route(child)

    gevent.joinall([gevent.spawn(request, "r%d" % i) for i in range(5)],
                   raise_error=True)
    assert got == dict([("r%d" % i, "r%d" % i) for i in range(5)] +
                       [("r%d child" % i, "no") for i in range(5)])
    assert take_route() is None


def test_set_route_names_are_clean_and_bounded():
    set_route("/a\x00\u2066" + "b" * 1000)
    name = take_route()
    assert name.startswith("/a\\x00\\u2066b")
    assert len(name) == MAX_ROUTE


def env(path, **kw):
    e = {"PATH_INFO": path, "SCRIPT_NAME": "", "REQUEST_METHOD": "GET"}
    e.update(kw)
    return e


def test_the_namers_order():
    namer = RouteNamer(route=lambda environ: "from-callable")
    assert namer(env("/items/1")) == "from-callable"
    e = env("/items/1", **{ROUTE_KEY: "/items/<id>"})
    assert namer(e) == "/items/<id>"
    assert namer(e, "from-set-route") == "from-set-route"
    assert RouteNamer()(env("/items/1")) == "/items/{id}"
    # the callable's "no opinion"
    assert RouteNamer(route=lambda e: None)(env("/items/1")) == "/items/{id}"
    assert RouteNamer(route=lambda e: "")(env("/items/1")) == "/items/{id}"
    # mounted apps: SCRIPT_NAME in front, for templates and paths alike
    assert RouteNamer()(env("/items/2", SCRIPT_NAME="/api")) == \
        "/api/items/{id}"
    assert framework_route(env("/x", SCRIPT_NAME="/api/",
                               **{ROUTE_KEY: "/items/<id>"})) == \
        "/api/items/<id>"
    assert framework_route(env("/x")) is None
    assert framework_route(env("/x", **{ROUTE_KEY: 3})) is None


def test_a_broken_route_callable_falls_back_to_the_path():
    def broken(environ):
        raise KeyError("HTTP_X")
    namer = RouteNamer(route=broken)
    assert namer(env("/items/1")) == "/items/{id}"
    assert namer.errors == 1 and namer.last_error == "KeyError: 'HTTP_X'"
    namer = RouteNamer(route=lambda e: 42)
    assert namer(env("/items/1")) == "/items/{id}"
    assert namer.errors == 1 and "returned int, not a str" in \
        namer.last_error
    namer = RouteNamer(route=lambda e: "/x\x1b" + "y" * 500)
    name = namer(env("/"))
    assert name.startswith("/x\\x1by") and len(name) == MAX_ROUTE
    with pytest.raises(TypeError, match="route must be a callable"):
        RouteNamer(route="/x")


class Interrupt(BaseException):
    """Neither an Exception nor the app's: an interrupt or a kill."""


@pytest.mark.parametrize("body", ["list", "iterator"])
@pytest.mark.parametrize("pct", [0.0, 1.0])
def test_a_route_callable_interrupted_counts_the_request_and_passes_it_on(
        body, pct):
    """A route= callable that raises what is not an Exception (a
    KeyboardInterrupt, a greenlet's kill, a Timeout of its own): the
    request is counted under its path and the interrupt goes on to the
    server, as if the app had raised it; an Exception falls back
    silently."""
    def app(environ, start_response):
        start_response("200 OK", [])
        return [b"ok"] if body == "list" else iter([b"ok"])

    def route(environ):
        if environ["PATH_INFO"].startswith("/stop"):
            raise Interrupt("stop")
        raise KeyError("no route")

    mw = ProfilingMiddleware(app, pct=pct, report=False, route=route,
                             stack_hz=0, linger=0)
    def serve(path):
        # (from the call when the request ends there, else from close())
        res = mw(env(path), lambda *a: None)
        try:
            assert list(res) == [b"ok"]
        finally:
            getattr(res, "close", lambda: None)()

    with pytest.raises(Interrupt, match="stop"):
        serve("/stop/1")
    serve("/fine/2")
    got = {r["route"]: (r["requests"], r["errors"]) for r in mw.routes()}
    assert got == {"/stop/{id}": (1, 0), "/fine/{id}": (1, 0)}, got
    assert mw._routes.namer.errors == 2
    assert mw._routes.namer.last_error == "KeyError: 'no route'"
    assert mw._routes.counts.namer_errors == 0


# ---------------------------------------------------------------------------
# real frameworks on a real server

class RouteRecorder:
    """The app in the real middleware (pct=0); ``names`` counts the
    requests of each route it named."""

    def __init__(self, app, route=None, max_routes=500):
        self.mw = ProfilingMiddleware(app, pct=0.0, report=False,
                                      route=route, max_routes=max_routes)

    def __call__(self, environ, start_response):
        return self.mw(environ, start_response)

    @property
    def names(self):
        return {r["route"]: r["requests"] for r in self.mw.routes()}


def test_flask_routes_are_the_matched_rules(plain_server):
    flask = need_module("flask")   # (a test extra: pyproject)
    assert routes.install_flask_hook() is True
    assert routes.install_flask_hook() is True   # (connects once)
    app = flask.Flask("routes_test")

    @app.route("/items/<int:item_id>/detail")
    def detail(item_id):
        return "item %d" % item_id

    @app.route("/named/<x>")
    def named(x):
        set_route("named-by-app")
        return "ok"

    @app.route("/boom/<x>")
    def boom(x):
        raise RuntimeError("boom")

    rec = RouteRecorder(app, route=lambda e: "callable")
    port = plain_server(rec)
    for target, status in (("/items/5/detail", 200),
                           ("/items/6/detail", 200),
                           ("/named/q", 200), ("/boom/1", 500),
                           ("/nope/123", 404)):
        assert http(port, target).status == status, target
    assert rec.names == {"/items/<int:item_id>/detail": 2,
                         "named-by-app": 1, "/boom/<x>": 1, "callable": 1}
    # without the callable: the path, its id replaced
    rec = RouteRecorder(app)
    port = plain_server(rec)
    assert http(port, "/nope/123").status == 404
    assert rec.names == {"/nope/{id}": 1}
    by_route = {r["route"]: r for r in rec.mw.routes()}
    assert by_route["/nope/{id}"]["errors"] == 0


def test_flask_hook_without_flask_or_its_signals(monkeypatch):
    monkeypatch.delitem(sys.modules, "flask", raising=False)
    assert routes.install_flask_hook() is False

    class NoSignals:   # (Flask < 2.3 without blinker raises RuntimeError)
        def connect(self, *a, **kw):
            raise RuntimeError("signalling support is unavailable")
    monkeypatch.setitem(sys.modules, "flask", types.SimpleNamespace(
        request_started=NoSignals()))
    monkeypatch.setattr(routes, "_flask_hooked", False)
    assert routes.install_flask_hook() is False


def _django_app():
    django = need_module("django")   # (a test extra: pyproject)
    from django.conf import settings
    if not settings.configured:
        from django.http import HttpResponse
        from django.urls import include, path, re_path

        def item(request, pk):
            return HttpResponse("item %d" % int(pk))

        def named(request):
            set_route("named-by-app")
            return HttpResponse("ok")

        urls = types.ModuleType("greqprof_test_urls")
        inner = types.ModuleType("greqprof_test_urls_inner")
        inner.urlpatterns = [path("orders/<int:pk>/", item)]
        urls.urlpatterns = [
            path("items/<int:pk>/detail", item),
            re_path(r"^old/(?P<pk>[0-9]+)/$", item),
            path("api/", include(inner)),
            path("named", named)]
        sys.modules[urls.__name__] = urls
        sys.modules[inner.__name__] = inner
        settings.configure(
            DEBUG=False, ROOT_URLCONF=urls.__name__, ALLOWED_HOSTS=["*"],
            SECRET_KEY="x" * 50, INSTALLED_APPS=[],
            MIDDLEWARE=["greqprof.routes.DjangoRouteMiddleware"])
        django.setup()
    from django.core.wsgi import get_wsgi_application
    return get_wsgi_application()


def test_django_routes_are_the_resolved_routes(plain_server):
    rec = RouteRecorder(_django_app())
    port = plain_server(rec)
    for target, status in (("/items/5/detail", 200), ("/api/orders/9/", 200),
                           ("/old/12/", 200), ("/named", 200),
                           ("/nope/77", 404)):
        assert http(port, target).status == status, target
    assert rec.names == dict.fromkeys([
        "/items/<int:pk>/detail", "/api/orders/<int:pk>/",
        "/old/(?P<pk>[0-9]+)/$", "named-by-app", "/nope/{id}"], 1)


def test_django_middleware_never_breaks_the_request():
    m = DjangoRouteMiddleware(lambda request: "response")
    assert m(object()) == "response"
    assert m.process_view(object(), None, (), {}) is None


def test_non_utf8_and_huge_paths_through_a_real_server(plain_server):
    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]
    rec = RouteRecorder(app)
    port = plain_server(rec)
    assert http_raw(port, b"GET /\xff\xfe/12 HTTP/1.1\r\nHost: x\r\n"
                    b"Connection: close\r\n\r\n").startswith(b"HTTP/1.1 200")
    assert http(port, "/" + "z" * 6000).status == 200
    names = sorted(rec.names, key=len)
    assert names[0] == "/\xff\xfe/{id}"
    assert len(names[1]) == MAX_ROUTE


# ---------------------------------------------------------------------------
# the table

def test_records_count_requests_errors_and_samples():
    t = RouteTable()
    t.record("/a", 0.010)
    t.record("/a", 0.030, error=True)
    t.record("/a", 0.020, sampled=True, cpu=0.004, waiting=0.012,
             blocking=1, blocked=0.15)
    t.record("/b", 0.5)
    t.record("/b", 0.5, sampled=True)   # (sampled, its cpu not measured)
    a, b = t.to_records()
    assert set(a) >= {"route", "requests", "errors", "sampled", "wall_p50",
                      "wall_p95", "wall_p99", "cpu", "waiting", "blocking"}
    assert (a["route"], a["requests"], a["errors"], a["sampled"]) == \
        ("/a", 3, 1, 1)
    assert a["cpu"] == 0.004 and a["waiting"] == 0.012
    assert a["cpu_total"] == pytest.approx(0.012)
    assert a["blocking"] == 1 and a["blocked"] == 0.15
    assert a["wall_mean"] == pytest.approx(0.02) and a["wall_max"] == 0.03
    # nearest rank of [10, 20, 30] ms: p50 is 20 ms, p95 and p99 30 ms
    assert a["wall_p50"] == pytest.approx(0.020, rel=0.045)
    assert a["wall_p95"] == a["wall_p99"] == pytest.approx(0.03, rel=0.045)
    assert (b["route"], b["requests"], b["sampled"]) == ("/b", 2, 1)
    assert b["cpu"] is None and b["waiting"] is None and \
        b["cpu_total"] is None
    assert b["wall_p50"] == b["wall_p99"] == 0.5   # (one value: exact)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(route="", wall=1), TypeError, "non-empty str"),
    (dict(route=b"/a", wall=1), TypeError, "non-empty str"),
    (dict(route="/a", wall=-1), ValueError, "wall must be"),
    (dict(route="/a", wall=float("nan")), ValueError, "wall must be"),
    (dict(route="/a", wall=float("inf")), ValueError, "wall must be"),
    (dict(route="/a", wall="1"), ValueError, "wall must be"),
    (dict(route="/a", wall=True), ValueError, "wall must be"),
    (dict(route="/a", wall=1, cpu=0.1), ValueError, "sampled=True"),
    (dict(route="/a", wall=1, sampled=True, cpu=-1), ValueError,
     "cpu must be"),
    (dict(route="/a", wall=1, sampled=True, waiting=float("nan")),
     ValueError, "waiting must be"),
    (dict(route="/a", wall=1, blocking=-1), ValueError, "blocking must be"),
    (dict(route="/a", wall=1, blocking=1.5), ValueError, "blocking must be"),
    (dict(route="/a", wall=1, blocked=-0.1), ValueError, "blocked must be"),
])
def test_bad_records_say_what_is_wrong(kwargs, error, message):
    t = RouteTable()
    with pytest.raises(error, match=message):
        t.record(**kwargs)
    assert len(t) == 0


@pytest.mark.parametrize("n", [0, -1, 1.5, True, "500", None])
def test_bad_max_routes(n):
    with pytest.raises(ValueError, match="max_routes must be an int >= 1"):
        RouteTable(n)


def test_ten_thousand_routes_stay_bounded():
    t = RouteTable()   # (500 by default)
    for i in range(10000):
        t.record(path_route("/u/user%d/x" % i), 0.001)
    assert len(t) == 501
    records = t.to_records()
    other = [r for r in records if r["route"] == OTHER]
    assert other[0]["requests"] == 9500 == t.overflowed
    assert records[0] is other[0]   # (most requests first)
    assert sum(r["requests"] for r in records) == 10000
    # a route already in the table still counts as itself
    t.record("/u/user3/x", 0.002)
    assert [r for r in t.to_records()
            if r["route"] == "/u/user3/x"][0]["requests"] == 2
    small = RouteTable(2)
    for name in ("/a", "/b", "/c", OTHER, "/a"):
        small.record(name, 0.1)
    assert {r["route"]: r["requests"] for r in small.to_records()} == \
        {"/a": 2, "/b": 1, OTHER: 2}


def test_the_table_counts_every_request_of_every_thread():
    t = RouteTable(max_routes=5)
    n, per = 4, 5000

    def feed(k):
        for i in range(per):
            t.record("/r%d" % (i % 8), 0.001 * (k + 1), error=i % 2 == 0)
    threads = [threading.Thread(target=feed, args=(k,)) for k in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    records = t.to_records()
    assert sum(r["requests"] for r in records) == n * per
    assert sum(r["errors"] for r in records) == n * per // 2
    assert len(records) == 6


def _nearest_rank(values, q):
    s = sorted(values)
    return s[max(math.ceil(q * len(s) - 1e-9), 1) - 1]


def test_quantile_estimates_are_within_the_documented_bound():
    """Within 2**(1/16) of the exact nearest-rank quantile from 1 us to
    the top bucket, within 1 us below, the largest value above
    (WallHistogram's docstring)."""
    rng = random.Random(21)
    bound = 2 ** (1 / 16) * (1 + 1e-9)
    top = WallHistogram.LOW * 2 ** (WallHistogram.BUCKETS / 8)
    sets = [
        [rng.lognormvariate(-4, 1.5) for _ in range(5000)],
        [rng.uniform(0.001, 0.002) for _ in range(1000)],
        [rng.expovariate(1 / 1e-6) for _ in range(1000)],   # around 1 us
        [rng.choice((1e-8, 0.05, 3.0, 17000.0, 20000.0, 1e6))
         for _ in range(500)],
        [0.1] * 99 + [10.0],
        [1e-6 * 2 ** (k / 8) for k in range(300)],   # bucket edges
    ]
    for values in sets:
        h = WallHistogram()
        for v in values:
            h.add(v)
        for q in (0.01, 0.5, 0.9, 0.95, 0.99, 0.999, 1.0):
            exact = _nearest_rank(values, q)
            est = h.quantile(q)
            if exact >= top:
                assert est == max(values)
            elif exact >= WallHistogram.LOW:
                assert exact / bound <= est <= exact * bound, (q, exact, est)
            else:
                assert abs(est - exact) <= WallHistogram.LOW, (q, exact, est)
    assert WallHistogram().quantile(0.5) is None
    with pytest.raises(ValueError, match="quantile is in"):
        WallHistogram().quantile(0)


def _bucket_walk(h, q):
    """The quantile as a walk over every bucket: what quantiles() finds
    in C-speed steps (the first bucket whose running count reaches the
    rank; the last one when the counts fall short)."""
    if not h.n:
        return None
    rank = max(math.ceil(q * h.n - 1e-9), 1)
    seen = 0
    for i, c in enumerate(h.counts):
        seen += c
        if seen >= rank:
            break
    return h._estimate(i)


def test_quantiles_find_the_bucket_a_walk_finds():
    rng = random.Random(5)
    qs = (0.001, 0.01, 0.5, 0.95, 0.99, 1.0)
    for t in range(2000):
        h = WallHistogram()
        for _ in range(rng.randint(0, 40)):
            h.add(rng.choice([0.0, 1e-7, 10 ** rng.uniform(-6, 4.5), 1e5,
                              1e9]))
        if h.n and t % 7 == 0:   # (counts short of n: a recent window's)
            h.counts[rng.randrange(len(h.counts))] = 0
        if h.n and t % 11 == 0:
            h.counts = array("Q", bytes(len(h.counts) * 8))
        assert h.quantiles(qs) == [_bucket_walk(h, q) for q in qs], t
    with pytest.raises(ValueError, match="quantile is in"):
        WallHistogram().quantiles((0.5, 1.5))

