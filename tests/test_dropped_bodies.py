"""Response bodies dropped without close(), called as a server or a
buffering middleware would (no server needed: what is checked is when
and where the request finishes).  Freed by its last reference, a body
finishes the request there, as close() would: observers while their span
is open, a linger=0 profile delivered and its slot back at once, even
with no event loop running.  Freed by the cyclic collector (which runs in
the middle of any code), the Python part waits for the finisher
(tests/test_lifecycle_review.py); its route takes its own set_route name,
never another request's (tests/test_route_aggregates.py)."""
import gc
import weakref

import gevent
import greenlet
import pytest

from greqprof import ProfilingMiddleware, set_route

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def _fresh_engine():
    """The thread's engine keeps the options of the middleware that made
    it, and conftest removes its switch hook after each test: the next
    test in this thread starts with a new one."""
    yield
    from test_middleware import reset_greqprof
    reset_greqprof()


def env(path):
    return {"REQUEST_METHOD": "GET", "PATH_INFO": path, "SCRIPT_NAME": "",
            "wsgi.url_scheme": "http"}


def gen_app(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])

    def body():
        yield b"x"
    return body()


QUIET = dict(report=False, summary_s=None, blocking_ms=None, stack_hz=0)


@pytest.mark.parametrize("linger", [0, 1.0])
def test_observers_hear_a_dropped_body_while_the_outer_span_is_open(linger):
    """A buffering middleware between an OpenTelemetry-style wrapper and
    greqprof drops the body (del): on_response_end comes before the
    wrapper's span ends, as with close()."""
    span = {"open": False}
    seen = []

    class Observer:
        def on_begin(self, req):
            pass

        def on_response_end(self, req, snapshot, blocking):
            seen.append((req.path, span["open"]))

        def on_profile(self, req, profile):
            pass

    mw = ProfilingMiddleware(gen_app, pct=1.0, linger=linger,
                             sink=lambda p: None, observers=[Observer()],
                             **QUIET)

    def buffering(environ, start_response):
        body = mw(environ, start_response)
        data = b"".join(body)
        if environ["PATH_INFO"] == "/close":
            body.close()
        del body                    # /drop: dropped without close()
        return [data]

    def traced(environ, start_response):
        span["open"] = True
        try:
            return list(buffering(environ, start_response))
        finally:
            span["open"] = False

    for path in ("/close", "/drop"):
        gevent.spawn(traced, env(path), lambda *a: None).join()
    gevent.sleep(0.05)
    assert seen == [("/close", True), ("/drop", True)]


def test_dropped_bodies_finish_at_once_without_an_event_loop():
    """linger=0, max_open=2, the app called directly (no loop running):
    each dropped body delivers its profile and gives its slot back when
    it is freed, so sampling goes on."""
    got = []
    mw = ProfilingMiddleware(lambda e, sr: (sr("200 OK", []), iter([b"x"]))[1],
                             pct=1.0, linger=0, max_open=2, sink=got.append,
                             **QUIET)
    for i in range(6):
        body = mw(env("/x"), lambda *a: None)
        list(body)
        del body
        assert len(got) == i + 1 and mw._open == 0
    assert mw.stats["skipped_full"] == 0


def test_a_suspended_request_whose_body_it_holds_can_be_freed():
    """A greenlet suspended mid-response, never resumed, holding its own
    body (the route wrapper): once unreachable, the collector frees it
    (the wrapper keeps no reference to it)."""
    mw = ProfilingMiddleware(gen_app, pct=0.0, **QUIET)
    main = greenlet.getcurrent()

    def serve():
        body = mw(env("/a"), lambda *a: None)
        main.switch()               # never resumed
        body.close()

    g = greenlet.greenlet(serve)
    g.switch()
    ref = weakref.ref(g)
    del g
    for _ in range(3):
        gc.collect()
    assert ref() is None


def test_a_collection_elsewhere_leaves_the_next_requests_name_alone():
    """A keep-alive greenlet serves /a (its body dropped in a cycle), then
    /b, which calls set_route and waits; a collection in another greenlet
    frees /a's body: /a does not take /b's name (the greenlet is alive,
    so the name may be its next request's, as it is here)."""
    def app(environ, start_response):
        set_route(environ["PATH_INFO"] + "/named")
        return gen_app(environ, start_response)

    mw = ProfilingMiddleware(app, pct=0.0, **QUIET)
    main = greenlet.getcurrent()

    def connection():
        body = mw(env("/a"), lambda *a: None)
        list(body)
        cycle = [body]
        cycle.append(cycle)          # dropped without close(), in a cycle
        del body, cycle
        body = mw(env("/b"), lambda *a: None)
        main.switch()                # /b waits for I/O
        list(body)
        body.close()

    was = gc.isenabled()
    gc.disable()
    try:
        g = greenlet.greenlet(connection)
        g.switch()
        gc.collect()                 # in another greenlet: /a is freed
        g.switch()
    finally:
        if was:
            gc.enable()
    counts = {r["route"]: r["requests"] for r in mw.routes()}
    # (/a's own name was dropped when /b began on the same greenlet)
    assert counts == {"/a": 1, "/b/named": 1}


def test_a_body_freed_by_a_young_cycle_waits_for_the_finisher():
    """A body older than the cycle that held it: a young collection clears
    the cycle and the body goes by its last reference, but inside the
    collection, so it waits for the finisher as a collected one does: with
    the inspector's lock held where the collection ran, nothing hangs, and
    the profile is delivered outside the collection."""
    in_gc = []
    got = []

    def app(environ, start_response):
        start_response("200 OK", [])
        return iter([b"x"])

    mw = ProfilingMiddleware(app, pct=1.0, linger=0, ui_path="/_greqprof",
                             sink=lambda p: got.append((p.path, bool(in_gc))),
                             **QUIET)
    was = gc.isenabled()
    gc.disable()
    try:
        body = mw(env("/young"), lambda *a: None)
        list(body)
        gc.collect()                 # the body: now in the oldest generation
        cycle = [body]
        cycle.append(cycle)          # dropped without close(), in a young cycle
        del body, cycle
        with mw.inspector._lock:     # (not reentrant: a delivery here hangs)
            in_gc.append(1)
            gc.collect(0)
            in_gc.clear()
        assert got == []
        gevent.sleep(0.05)           # the finisher
    finally:
        if was:
            gc.enable()
    assert got == [("/young", False)]
    assert mw.stats["delivered"] == 1


def test_a_later_greenlet_at_the_same_address_keeps_its_name():
    """/a's greenlet ends without calling set_route and is freed; the next
    greenlet may get its address. It calls set_route for /b and runs a
    collection that frees /a's dropped body: /a is named by its path, not
    by /b's name (the wrapper's reference to its greenlet is weak, not an
    address)."""
    def app(environ, start_response):
        if environ["PATH_INFO"] == "/b":
            set_route("/b/named")
        return gen_app(environ, start_response)

    mw = ProfilingMiddleware(app, pct=0.0, **QUIET)
    addr = {}

    def request_a():
        addr["a"] = id(greenlet.getcurrent())
        body = mw(env("/a"), lambda *a: None)
        list(body)
        cycle = [body]
        cycle.append(cycle)          # dropped without close(), in a cycle

    def request_b():
        addr["b"] = id(greenlet.getcurrent())
        body = mw(env("/b"), lambda *a: None)
        gc.collect()                 # frees /a's body here
        list(body)
        body.close()

    was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(20):          # (until the address comes back)
            addr.clear()
            mw = ProfilingMiddleware(app, pct=0.0, **QUIET)
            greenlet.greenlet(request_a).switch()
            greenlet.greenlet(request_b).switch()
            if addr["a"] == addr["b"]:
                break
    finally:
        if was:
            gc.enable()
    assert addr["a"] == addr["b"], "no address reused: the case is not made"
    counts = {r["route"]: r["requests"] for r in mw.routes()}
    assert counts == {"/a": 1, "/b/named": 1}
