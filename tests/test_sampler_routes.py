"""The stack sampler names a sample by the request's route as mw.routes()
has it: the framework's template (Flask, Django), or set_route's name, as
soon as the app exposes it (greqprof/routes.py tells _hooks/sampler.c).

Real Flask and Django apps on real ``gevent.pywsgi`` servers, loaded by
clients in real OS threads; the CPU-busy views run after the route is
known, so every sample of their burning function is under the route's
name.  The pprof file is read back with the real ``go tool pprof``."""
import html
import http.client
import json
import re
import sys
import threading
from urllib.parse import parse_qs, urlsplit

import pytest
from gevent import pywsgi

from greqprof import ProfilingMiddleware, sampler, set_route
from conftest import need_module
from test_middleware import http as get, reset_greqprof, wait_for
from test_pprof import Raw, pprof_tool  # noqa: F401 (a fixture)
from test_sampler import burn_cpu, fresh_sampler, load, server  # noqa: F401

pytestmark = pytest.mark.timeout(120)

HZ = 200
BURN = "test_sampler.burn_cpu"


@pytest.fixture
def serve(server):
    """serve(app, **middleware options): test_sampler's server, the
    sampler at HZ unless told."""
    def start(app, **kw):
        kw.setdefault("stack_hz", HZ)
        return server(app, **kw)
    return start


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
        burn_cpu(20)
        return "item %d" % item_id

    @app.route("/pay/<int:n>")
    def pay(n):
        set_route("checkout")
        burn_cpu(20)
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
        burn_cpu(20)
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
            burn_cpu(20)
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


# ---------------------------------------------------------------------------
# the inspector's Routes page links each route's stack samples

def _links(page, kind):
    """{route or None: the href of its `kind` link} of the Routes page"""
    out = {}
    for href in re.findall(r'href="([^"]*/routes/%s[^"]*)"' % kind, page):
        href = html.unescape(href)
        q = parse_qs(urlsplit(href).query)
        out[q["route"][0] if "route" in q else None] = href
    return out


def test_routes_page_links_flame_graphs_and_pprof(serve, tmp_path,
                                                  pprof_tool, fresh_sampler):
    mw, port = serve(flask_app(), ui_path="/_greqprof")
    load([port], ["/items/%d", "/pay/%d"] * 5)
    page = get(port, "/_greqprof/routes").body.decode()
    pprofs, flames = _links(page, "pprof"), _links(page, "speedscope")
    views = _links(page, "flame")
    item = "/items/<int:item_id>"
    assert {item, "checkout", None} <= set(pprofs) & set(flames) & \
        set(views), page
    # The built-in flame graph: an SVG page, no script, the route's
    # burning function a frame of it.
    r = get(port, views[item])
    assert r.status == 200 and "script-src 'none'" in r.headers[
        "content-security-policy"]
    view = r.body.decode()
    assert "<svg" in view and "<script" not in view
    assert "<title>%s (" % BURN in view
    assert "Flame graph: /items/&lt;int:item_id&gt; (" in view
    assert "checkout" not in view.split("<svg", 1)[1]   # (its route's only)
    view = get(port, views[None]).body.decode()
    assert "<title>route checkout:" in view and \
        "<title>route /items/&lt;int:item_id&gt;:" in view
    # One route's pprof: its samples only, its function among them,
    # read back by the real pprof.
    r = get(port, pprofs[item])
    assert r.status == 200 and "attachment" in r.headers.get(
        "content-disposition", ""), r.headers
    path = tmp_path / "item.pb.gz"
    path.write_bytes(r.body)
    raw = Raw(pprof_tool(path, "-raw"))
    assert raw.samples and {lb.get("route") for _, _, lb in
                            raw.samples} == {item}
    assert any(BURN in names for _, names, _ in raw.stacks())
    # Every route's: both routes labelled.
    path.write_bytes(get(port, pprofs[None]).body)
    labels = {lb.get("route") for _, _, lb in
              Raw(pprof_tool(path, "-raw")).samples}
    assert {item, "checkout"} <= labels, labels
    # The flame graph: a speedscope document of the route's samples,
    # stacks root first (the burning function is a leaf).
    doc = json.loads(get(port, flames["checkout"]).body)
    assert doc["$schema"].startswith("https://www.speedscope.app/")
    (prof,) = doc["profiles"]
    names = [f["name"] for f in doc["shared"]["frames"]]
    assert prof["type"] == "sampled" and prof["unit"] == "nanoseconds"
    assert any(names[s[-1]] == BURN for s in prof["samples"]), doc
    n = sum(c for _, _, c in sampler.samples("checkout"))
    period = int(1e9 / HZ)
    assert sum(prof["weights"]) == prof["endValue"]
    assert 0 < sum(prof["weights"]) <= n * period   # (n: counted later)
    doc = json.loads(get(port, flames[None]).body)
    names = [f["name"] for f in doc["shared"]["frames"]]
    roots = {names[s[0]] for s in doc["profiles"][0]["samples"]}
    assert {"route " + item, "route checkout"} <= roots, roots
    # The inspector's access rules hold for them.
    assert get(port, pprofs[item], headers=[
        ("Host", "evil.example")]).status == 403


def test_without_stack_hz_the_routes_page_links_no_samples(serve):
    mw, port = serve(flask_app(), stack_hz=0, ui_path="/_greqprof")
    assert get(port, "/items/3").status == 200
    page = get(port, "/_greqprof/routes").body.decode()
    assert "/items/&lt;int:item_id&gt;" in page
    assert "/routes/pprof" not in page and "flame graph" not in page
    assert get(port, "/_greqprof/routes/pprof").status == 404
    assert get(port, "/_greqprof/routes/speedscope").status == 404
    assert get(port, "/_greqprof/routes/flame").status == 404


def test_pprof_and_speedscope_of_a_route_without_samples(fresh_sampler,
                                                         tmp_path,
                                                         pprof_tool):
    data, n = sampler.pprof_bytes(10 ** 7, "/nothing")
    assert n == 0
    path = tmp_path / "empty.pb.gz"
    path.write_bytes(data)
    assert Raw(pprof_tool(path, "-raw")).samples == []
    doc = sampler.speedscope(10 ** 7, "/nothing")
    assert doc["profiles"][0]["samples"] == [] and \
        doc["profiles"][0]["endValue"] == 0
    assert sampler.flame("/nothing") == ["all", "", 0, {}]
    with pytest.raises(ValueError, match="period_ns"):
        sampler.speedscope(0)
    with pytest.raises(TypeError, match="route"):
        sampler.pprof_bytes(10 ** 7, 3)


def test_naming_for_the_sampler_changes_no_aggregate(serve, fresh_sampler):
    # A sampled request whose app raises before returning a body counts
    # for requests and errors, not for CPU (docs/fleet.md): telling the
    # sampler its name early must not make it count.
    def app(environ, start_response):
        set_route("boom")
        burn_cpu(3)
        raise RuntimeError("boom")
    mw, port = serve(app, pct=1.0, linger=0)
    for i in range(3):
        assert get(port, "/x/%d" % i).status == 500
    wait_for(lambda: not mw._open, 10, "the profiles delivered")
    (rec,) = [r for r in mw.routes() if r["route"] == "boom"]
    assert rec["requests"] == 3 and rec["errors"] == 3
    assert rec["sampled"] == 0 and rec["cpu"] is None, rec


def test_what_a_sampled_request_left_running_takes_its_final_route(
        serve, fresh_sampler):
    # A route= callable names the request only at its end: the greenlet
    # it left running (a lingering child) is sampled under that name.
    import gevent

    def child():
        gevent.sleep(0.01)   # (after the response)
        burn_cpu(20)

    def app(environ, start_response):
        gevent.spawn(child)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]
    mw, port = serve(app, pct=1.0, linger=5.0,
                     route=lambda environ: "by-callable")
    load([port], ["/linger/%d"] * 3)
    wait_for(lambda: not mw._open, 20, "the lingering profiles")
    burning = burning_routes()
    assert set(burning) == {"by-callable"}, burning


def test_a_mounted_flask_apps_samples_carry_the_mount(fresh_sampler):
    # Under SCRIPT_NAME the route mw.routes() shows starts with it: so
    # does the samples' name.
    mw = ProfilingMiddleware(flask_app(), pct=0.0, report=False,
                             stack_hz=HZ)

    def mounted(environ, start_response):
        environ["SCRIPT_NAME"] = "/shop"
        return mw(environ, start_response)
    srv = pywsgi.WSGIServer(("127.0.0.1", 0), mounted, log=None)
    srv.start()
    try:
        load([srv.server_port], ["/items/%d"] * 5)
    finally:
        srv.stop(timeout=2)
        reset_greqprof([mw])
    burning = burning_routes()
    assert set(burning) == {"/shop/items/<int:item_id>"}, burning
    assert set(burning) <= {r["route"] for r in mw.routes()}


@pytest.mark.parametrize("pct", [0.0, 1.0], ids=["unsampled", "sampled"])
def test_a_mounted_plain_apps_samples_and_blocking_carry_the_mount(
        fresh_sampler, pct):
    """Without a framework's template, a request under SCRIPT_NAME is
    counted by routes() under SCRIPT_NAME + PATH_INFO: its stack samples
    and its blocking events are too, from its start.  (Before: samples
    under "/items/{id}", a route routes() never had, and blocking events
    counted under it.)"""
    import time

    def plain(environ, start_response):
        if environ["PATH_INFO"].startswith("/hold/"):
            time.sleep(0.06)   # (holds the loop: a blocking event)
        else:
            burn_cpu(20)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]
    mw = ProfilingMiddleware(plain, pct=pct, report=False, stack_hz=HZ,
                             blocking_ms=20, linger=0)

    def mounted(environ, start_response):
        environ["SCRIPT_NAME"] = "/shop"
        return mw(environ, start_response)
    srv = pywsgi.WSGIServer(("127.0.0.1", 0), mounted, log=None)
    srv.start()
    try:
        load([srv.server_port], ["/items/%d"] * 5 + ["/hold/%d"], clients=2)
        wait_for(lambda: {r["route"]: r["blocking"] for r in mw.routes()}
                 .get("/shop/hold/{id}", 0) >= 2, 10, "2 blocking events")
    finally:
        srv.stop(timeout=2)
        reset_greqprof([mw])
    burning = burning_routes()
    assert set(burning) == {"/shop/items/{id}"}, burning
    records = {r["route"]: r for r in mw.routes()}
    assert set(records) == {"/shop/items/{id}", "/shop/hold/{id}"}, records
    assert records["/shop/hold/{id}"]["blocking"] == 2


def test_a_second_middleware_raises_the_rate_and_weights_stay_true(
        server, fresh_sampler, tmp_path, pprof_tool):
    """Two middlewares with different stack_hz served by one thread: the
    higher rate applies once the second one serves, and the pprof's
    cpu/nanoseconds weighs each sample by the period it was taken at.
    (Before: the thread stayed at the first rate, and every sample was
    weighed by the current period.)"""
    def burner(environ, start_response):
        burn_cpu(20)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]
    mw1, port1 = server(burner, stack_hz=50)
    load([port1], ["/a/%d"] * 5, clients=2)
    assert sampler.rate() == 50
    mw2, port2 = server(burner, stack_hz=400)
    load([port2], ["/b/%d"] * 5, clients=2)
    assert sampler.rate() == 400
    sampler.stop()
    path = tmp_path / "stacks.pb.gz"
    n = mw2.write_pprof(path)
    raw = Raw(pprof_tool(path, "-raw"))
    count = sum(values[0] for values, _names, _labels in raw.stacks())
    cpu = sum(values[1] for values, _names, _labels in raw.stacks())
    assert count == n > 0
    fast, slow = int(1e9 / 400), int(1e9 / 50)
    # /a/'s samples were all taken at 50 Hz (20 ms each), /b/'s at 400 Hz
    # (2.5 ms each, but for a tick at most when the rate changed)
    a = [v for v, _n, lab in raw.stacks() if lab.get("route") == "/a/{id}"]
    b = [v for v, _n, lab in raw.stacks() if lab.get("route") == "/b/{id}"]
    assert a and b
    assert all(v[1] == v[0] * slow for v in a), a
    assert sum(v[1] for v in b) <= sum(v[0] for v in b) * fast + slow
    assert fast * count < cpu <= slow * count
