"""The stack sampler names a sample by the request's route as mw.routes()
has it: the framework's template (Flask, Django), or set_route's name, as
soon as the app exposes it (greqprof/routes.py tells _hooks/sampler.c).

Real Flask and Django apps on real ``gevent.pywsgi`` servers, loaded by
clients in real OS threads; the CPU-busy views run after the route is
known, so every sample of their burning function is under the route's
name.  The pprof file is read back with the real ``go tool pprof``."""
import http.client
import sys
import threading

import pytest
from gevent import pywsgi

from greqprof import ProfilingMiddleware, sampler, set_route
from conftest import need_module
from test_middleware import reset_greqprof, wait_for
from test_pprof import Raw, pprof_tool  # noqa: F401 (a fixture)
from test_sampler import burn_cpu, fresh_sampler, load  # noqa: F401

pytestmark = pytest.mark.timeout(120)

HZ = 200
BURN = "test_sampler.burn_cpu"


@pytest.fixture
def serve():
    servers, mws = [], []

    def start(app, **kw):
        kw.setdefault("pct", 0.0)
        mw = ProfilingMiddleware(app, report=False, stack_hz=HZ, **kw)
        mws.append(mw)
        s = pywsgi.WSGIServer(("127.0.0.1", 0), mw, log=None)
        s.start()
        servers.append(s)
        return mw, s.server_port
    yield start
    for s in servers:
        s.stop(timeout=2)
    reset_greqprof(mws)


def burning_routes():
    """{route: samples} of the samples whose stack burns CPU"""
    out = {}
    for route, frames, n in sampler.samples():
        if any(f[0] == BURN for f in frames):
            out[route] = out.get(route, 0) + n
    return out


def flask_app():
    flask = need_module("flask")   # (a test extra: pyproject)
    app = flask.Flask("sampler_routes_test")

    @app.route("/items/<int:item_id>")
    def item(item_id):
        burn_cpu(150000)
        return "item %d" % item_id

    @app.route("/pay/<int:n>")
    def pay(n):
        set_route("checkout")
        burn_cpu(150000)
        return "paid"
    return app


@pytest.mark.parametrize("pct", [0.0, 1.0], ids=["unsampled", "sampled"])
def test_flask_samples_are_named_by_the_rule_and_set_route(
        serve, fresh_sampler, pct):
    mw, port = serve(flask_app(), pct=pct, linger=0)
    load([port], ["/items/%d", "/pay/%d"] * 5)
    burning = burning_routes()
    # Every sample of the views' work is under the name mw.routes() has:
    # none under the path's ("/items/{id}").
    assert set(burning) == {"/items/<int:item_id>", "checkout"}, burning
    assert min(burning.values()) >= 3, burning
    names = {r["route"] for r in mw.routes()}
    assert set(burning) <= names, (burning, names)


def test_write_pprof_labels_samples_by_the_template(
        serve, fresh_sampler, tmp_path, pprof_tool):
    mw, port = serve(flask_app())
    load([port], ["/items/%d", "/pay/%d"] * 5)
    sampler.stop()   # (the test's own greenlet would go on being sampled)
    path = tmp_path / "stacks.pb.gz"
    assert mw.write_pprof(path) > 0
    raw = Raw(pprof_tool(path, "-raw"))
    burning = {}
    for values, names, labels in raw.stacks():
        if BURN in names:
            burning[labels.get("route")] = \
                burning.get(labels.get("route"), 0) + values[0]
    assert set(burning) == {"/items/<int:item_id>", "checkout"}, burning
    assert set(burning) <= {r["route"] for r in mw.routes()}
    top = pprof_tool(path, "-top", "-tagfocus", "route=^checkout$")
    assert BURN in top


def django_app():
    from test_routes import _django_app
    app = _django_app()
    from django.urls import path
    urls = sys.modules["greqprof_test_urls"]

    def burn(request, n):
        from django.http import HttpResponse
        burn_cpu(150000)
        return HttpResponse("burnt")
    if not any(getattr(p, "name", None) == "sampler-burn"
               for p in urls.urlpatterns):
        # (the resolver reads this list: in place, it sees the new route)
        urls.urlpatterns.append(path("burn/<int:n>/", burn,
                                     name="sampler-burn"))
    return app


def test_django_samples_are_named_by_the_resolved_route(serve,
                                                        fresh_sampler):
    need_module("django")
    mw, port = serve(django_app())
    load([port], ["/burn/%d/"] * 6)
    burning = burning_routes()
    assert set(burning) == {"/burn/<int:n>/"}, burning
    assert "/burn/<int:n>/" in {r["route"] for r in mw.routes()}


def test_the_route_of_a_keep_alive_connections_next_request(
        serve, fresh_sampler):
    # One greenlet serves every request of a connection: the name the
    # first request set is not the next one's, whose samples go by path.
    def app(environ, start_response):
        if environ["PATH_INFO"].startswith("/named/"):
            set_route("first")
        else:
            burn_cpu(150000)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]
    mw, port = serve(app)
    done = []

    def client(k):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            for _ in range(4):
                for target in ("/named/%d" % k, "/plain/%d" % k):
                    c.request("GET", target)
                    r = c.getresponse()
                    r.read()
                    assert r.status == 200
            done.append(k)
        finally:
            c.close()
    threads = [threading.Thread(target=client, args=(k,), daemon=True)
               for k in range(3)]
    for t in threads:
        t.start()
    wait_for(lambda: not any(t.is_alive() for t in threads), 60,
             "the clients")
    assert len(done) == 3
    burning = burning_routes()
    assert set(burning) == {"/plain/{id}"}, burning
    assert {r["route"] for r in mw.routes()} == {"first", "/plain/{id}"}


def test_sampler_name_outside_a_request_is_refused():
    from greqprof import _registry
    assert _registry.sampler_name("x") is False
    assert _registry.sampler_name(3) is False
