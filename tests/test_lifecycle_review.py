"""The request lifecycle against the second review of issue 14: each test
is one of the reviewer's probes (/work/briefs/probes_lifecycle), through a
real gevent.pywsgi server over real sockets, and failed before its fix.

No test asserts a duration: waits are bounded polls, and what is checked
is where data went (which profile, which request, how many deliveries)."""
import gc
import time

import gevent
import gevent.event
import gevent.socket as gsocket
import pytest
from gevent import pywsgi

import greqprof
from greqprof import ProfilingMiddleware
from greqprof.errors import ProfilerStateError

from test_middleware import (  # noqa: F401  (serve is a fixture)
    DEADLINE, burn, connect, func_named, keepalive_gets, make_function,
    read_all, request_bytes, reset_greqprof, serve, settle, wait_for)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def gc_off():
    """No automatic collection: the test collects where it wants to."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    yield
    if was:
        gc.enable()


# ---------------------------------------------------------------------------
# current_profile() and blocking events: by the greenlet's own profile

def test_a_background_greenlet_of_request_1_does_not_write_into_request_2(
        serve):
    """p2: a greenlet spawned by request 1 (fire and forget, outliving its
    request) calls current_profile() while the same keep-alive greenlet
    serves request 2: the handle is not request 2's."""
    go = gevent.event.Event()
    handles = []

    def background():
        go.wait()
        h = greqprof.current_profile()
        handles.append(bool(h))
        h.note("written by request 1's background greenlet")
        h.set_error("req1 background failure")

    def app(environ, start_response):
        if environ["PATH_INFO"] == "/one":
            gevent.spawn(background)
        else:
            go.set()
            gevent.sleep(0.05)   # the background greenlet runs now
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    s = serve(app, pct=1.0, linger=0)
    keepalive_gets(s.port, ["/one", "/two"]).close()
    two = s.profile_for("/two")
    wait_for(lambda: handles, what="the background greenlet")
    assert handles == [False]
    assert two.notes == [] and two.error is None


def test_a_blocking_child_of_request_1_is_not_reported_under_request_2(
        serve):
    """_request_of_greenlet had the same flaw: a child of request 1 that
    blocks while its spawner serves request 2 was put into request 2's
    blocking events (and logged "during GET /two")."""
    go = gevent.event.Event()

    def blocker_of_request_one():
        go.wait()
        time.sleep(0.08)   # holds the loop (gevent is not patched here)

    def app(environ, start_response):
        if environ["PATH_INFO"] == "/one":
            gevent.spawn(blocker_of_request_one)
        else:
            go.set()
            gevent.sleep(0.05)   # the child blocks now
            burn(0.001)
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    s = serve(app, pct=1.0, linger=0, blocking_ms=30)
    keepalive_gets(s.port, ["/one", "/two"]).close()
    two = s.profile_for("/two")
    wait_for(lambda: s.mw.stats["blocking"] >= 1, what="the blocking span")
    assert not [e for e in two.blocking
                if "blocker_of_request_one" in (e.fn_name or "")], \
        two.blocking


# ---------------------------------------------------------------------------
# a late finish, or a truncation, leaves the next request's greenlet alone

class _Holder:
    pass


def _buffering(mw, keep):
    """A buffering middleware that drops /one's body without close(), in a
    reference cycle (collected only by the gc)."""
    def wsgi(environ, start_response):
        body = mw(environ, start_response)
        data = b"".join(body)
        if environ["PATH_INFO"] == "/one":
            h = _Holder()
            h.body, h.me = body, h
            keep.append(1)
        return [data]
    return wsgi


def test_a_late_finish_does_not_detach_the_next_request(serve, gc_off):
    """p13: request 1's body is collected by the gc while the same
    greenlet serves request 2: finishing request 1 then must not take the
    greenlet out of request 2's profile (what it runs after the
    collection is request 2's)."""
    after_collect = make_function("after_the_late_finish")

    def app(environ, start_response):
        if environ["PATH_INFO"] == "/two":
            gevent.sleep(0.01)
            gc.collect()          # request 1 finishes here, late
            after_collect()
        start_response("200 OK", [("Content-Length", "2")])
        return iter([b"ok"])

    keep = []
    s = serve(app, pct=1.0, linger=0, calls=True,
              wrap=lambda mw: _buffering(mw, keep))
    keepalive_gets(s.port, ["/one", "/two"]).close()
    one, two = s.profile_for("/one"), s.profile_for("/two")
    assert keep == [1] and one.error is None
    assert func_named(two, "after_the_late_finish") is not None, \
        sorted(f.name for f in two.calls)
    wait_for(lambda: s.mw._open == 0, what="every slot back")


def test_a_body_collected_inside_greqprofs_own_sections(serve, gc_off):
    """The collector runs wherever an allocation (3.12+: the eval loop)
    lets it, greqprof's own code included: a request whose body it
    collects is finished there, but what runs Python (the delivery of its
    profile, observers) waits for the finisher.  Before, with linger=0,
    the delivery ran inside the collection, here while the inspector held
    its lock: the thread hung on it (and a pass over a table raised
    'changed size during iteration')."""
    def app(environ, start_response):
        start_response("200 OK", [("Content-Length", "2")])
        return iter([b"ok"])

    keep = []
    s = serve(app, pct=1.0, linger=0, ui_path="/_greqprof",
              wrap=lambda mw: _buffering(mw, keep))
    keepalive_gets(s.port, ["/one", "/two"]).close()
    s.profile_for("/two")
    assert keep == [1] and not [p for p in s.profiles if p.path == "/one"]
    ui = s.mw.inspector
    with ui._lock:
        gc.collect()         # request 1's body: collected, finished here
        assert not [p for p in s.profiles if p.path == "/one"]
    one = s.profile_for("/one")           # delivered by the finisher
    assert one.error is None
    assert [p for _, p in ui.profiles() if p.path == "/one"] == [one]
    wait_for(lambda: s.mw._open == 0, what="every slot back")


def test_a_truncation_does_not_detach_the_next_request(serve, gc_off):
    """truncate the same: request 1's body is dropped (never collected
    here) and the greenlet goes on to request 2; max_lifetime closes
    request 1's profile while request 2 runs (the reaper's truncate,
    called here at a known point): request 2 keeps its greenlet."""
    from greqprof import _lowlevel, engine
    after_truncation = make_function("after_the_truncation")

    def app(environ, start_response):
        if environ["PATH_INFO"] == "/two":
            eng = greqprof.engine.current_engine()
            one = [r for r in list(eng.profile_requests.values())
                   if r.path == "/one"]
            assert len(one) == 1 and not one[0].done
            engine.truncate(s.mw, eng, one[0], _lowlevel.wall_ns())
            after_truncation()
        start_response("200 OK", [("Content-Length", "2")])
        return iter([b"ok"])

    keep = []
    s = serve(app, pct=1.0, linger=0, calls=True,
              wrap=lambda mw: _buffering(mw, keep))
    keepalive_gets(s.port, ["/one", "/two"]).close()
    one, two = s.profile_for("/one"), s.profile_for("/two")
    assert one.truncated is True and two.truncated is False
    assert func_named(two, "after_the_truncation") is not None, \
        sorted(f.name for f in two.calls)


# ---------------------------------------------------------------------------
# re-entry and wrapping

def test_the_same_middleware_reentered_with_its_environ_profiles_once(serve):
    """p1: the app forwards the request internally to the root app (the
    middleware itself) with the same environ: one profile, of the outer
    call, with the whole request in it."""
    outer_work = make_function("outer_work_after_the_forward")
    served = {}

    def app(environ, start_response):
        if environ["PATH_INFO"] == "/outer":
            environ["PATH_INFO"] = "/inner"
            body = b"".join(served["mw"](environ, start_response))
            outer_work()
            return [body]
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    s = serve(app, pct=1.0, linger=0, calls=True)
    served["mw"] = s.mw
    assert s.get("/outer").status == 200
    p = s.profile_for("/outer")
    settle(0.2)
    assert [q.path for q in s.profiles] == ["/outer"]
    assert func_named(p, "outer_work_after_the_forward") is not None
    assert s.mw.stats["requests"] == 1 and s.mw.stats["sampled"] == 1
    assert s.mw._open == 0


def test_wrapped_twice_with_a_dict_subclass_environ_profiles_once(serve):
    """p4: gevent's documented WSGIServer.environ_class =
    WSGISecureEnviron (a dict subclass): the outer middleware marks it and
    the inner one defers, as with a plain dict."""
    def app(environ, start_response):
        burn(0.002)
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    outer_profiles = []
    s = serve(app, pct=1.0, linger=0,
              wrap=lambda inner: ProfilingMiddleware(
                  inner, pct=1.0, linger=0, report=False,
                  sink=outer_profiles.append))
    s.server.environ_class = pywsgi.WSGISecureEnviron
    assert s.get("/x").status == 200
    wait_for(lambda: outer_profiles, what="the outer profile")
    settle(0.2)
    assert len(outer_profiles) == 1 and s.profiles == []
    assert s.mw.stats["sampled"] == 0


# ---------------------------------------------------------------------------
# the reaper, start_response, trigger slots, flush

def test_the_reaper_survives_a_sink_raising_a_timeout(serve):
    """p7: a sink lets its own gevent.Timeout out while the reaper
    delivers a truncated stream: the reaper goes on, and truncates the
    next stream past max_lifetime (its slot comes back)."""
    delivered = []
    calls = [0]

    def sink(p):
        calls[0] += 1
        if calls[0] == 1:                 # the collector is slow once
            with gevent.Timeout(0.02):
                gevent.sleep(5)
        delivered.append(p)

    def app(environ, start_response):
        start_response("200 OK", [])

        def gen():
            for _ in range(100):          # a 10 s stream
                gevent.sleep(0.1)
                yield b"x"
        return gen()

    s = serve(app, pct=1.0, linger=0, sink=sink, max_lifetime=0.2,
              max_open=1)

    def stream(path):
        sock = connect(s.port)
        sock.sendall(request_bytes(path))
        try:
            while sock.recv(65536):
                pass
        except OSError:
            pass

    first = gevent.spawn(stream, "/first")
    wait_for(lambda: calls[0] >= 1, what="the first truncation")
    second = gevent.spawn(stream, "/second")
    wait_for(lambda: [p for p in delivered if p.path == "/second"],
             what="the second stream truncated")
    assert [p.truncated for p in delivered] == [True]
    gevent.killall([first, second])


def test_start_response_keywords_on_a_sampled_request(serve):
    """p10: start_response(status, headers=...) and all-keyword calls, as
    gevent's own start_response takes them, work on sampled requests."""
    def app(environ, start_response):
        if environ["PATH_INFO"] == "/headers":
            start_response("201 Created",
                           headers=[("Content-Length", "2")])
        else:
            start_response(status="202 Accepted",
                           headers=[("Content-Length", "2")], exc_info=None)
        return [b"ok"]

    s = serve(app, pct=1.0, linger=0)
    assert s.get("/headers").status == 201
    assert s.get("/all").status == 202
    assert s.profile_for("/headers").status == "201 Created"
    assert s.profile_for("/all").status == "202 Accepted"


def test_trigger_requests_take_ordinary_slots_past_their_reserve(serve):
    """p9: ten concurrent trigger requests with max_open's 64 slots free:
    every one is profiled (the reserve of 8 is in addition to max_open,
    not a cap)."""
    inside = []
    release = gevent.event.Event()

    def app(environ, start_response):
        inside.append(1)
        release.wait(DEADLINE)
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    secret = "s3cret-s3cret"
    s = serve(app, pct=0.0, linger=0, max_open=64,
              trigger_header="X-Profile", trigger_secret=secret)
    jobs = [gevent.spawn(s.get, "/t%d" % i,
                         headers=[("X-Profile", secret)]) for i in range(10)]
    wait_for(lambda: len(inside) == 10, what="ten requests in")
    assert s.mw._open == 10
    release.set()
    gevent.joinall(jobs, timeout=DEADLINE)
    s.wait_profiles(10)
    assert s.mw.stats["skipped_full"] == 0
    wait_for(lambda: s.mw._open == 0, what="every slot back")


def test_flush_timeout_bounds_a_delivery_that_waits(serve):
    """p3 (a sink that waits on gevent): flush(timeout) interrupts the
    delivery under way when the time is up, and the request is released
    undelivered.  (A sink blocking the whole thread cannot be interrupted:
    docs/production.md.)"""
    entered, finished = [], []

    def sink(p):
        entered.append(p.path)
        gevent.sleep(5)          # a collector that does not answer
        finished.append(p.path)

    def app(environ, start_response):
        gevent.spawn(gevent.sleep, 20)   # a child: the profile lingers
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    s = serve(app, pct=1.0, linger=30, sink=sink)
    assert s.get("/a").status == 200
    wait_for(lambda: s.mw._open == 1, what="the request lingering")
    n = s.mw.flush(timeout=0.3)
    assert entered == ["/a"] and finished == []
    assert n == 0
    assert s.mw._open == 0


# ---------------------------------------------------------------------------
# the Profiler in a thread that serves the middleware

def test_a_second_profiler_in_a_middleware_thread_is_refused(serve):
    """p12: as without a middleware, a second Profiler in the thread is
    refused, and the first one goes on recording."""
    s = serve(lambda e, sr: (sr("200 OK", []), [b"ok"])[1], pct=0.0)
    assert s.get("/warm").status == 200
    outside = make_function("outside_work_after_the_refusal")
    a = greqprof.Profiler().start()
    try:
        with pytest.raises(ProfilerStateError, match="already running"):
            greqprof.Profiler().start()
        outside()
    finally:
        a.stop()
    assert {f.name: f.ncall for f in a.func_stats()}.get(
        "outside_work_after_the_refusal") == 1


# ---------------------------------------------------------------------------
# observers and max_lifetime (the reviewer's suspicions, proven here)

class _Recorder:
    """An observer that records what it hears of."""

    def __init__(self):
        self.events = []

    def on_begin(self, req):
        self.events.append(("begin", req.path))

    def on_response_end(self, req, snapshot, blocking):
        self.events.append(("end", req.path, snapshot is None))

    def on_profile(self, req, profile):
        self.events.append(("profile", req.path, profile.truncated))


def test_a_truncated_request_still_reaches_on_response_end(serve):
    """max_lifetime closes a stream's profile (on_profile, truncated);
    when the stream ends, observers still hear of the response's end
    (their span is open until then), once, without a snapshot."""
    rec = _Recorder()
    go_on = gevent.event.Event()

    def app(environ, start_response):
        start_response("200 OK", [])

        def gen():
            yield b"a"
            go_on.wait(DEADLINE)
            yield b"b"
        return gen()

    s = serve(app, pct=1.0, linger=0, max_lifetime=0.1, observers=[rec])
    job = gevent.spawn(s.get, "/stream")
    wait_for(lambda: ("profile", "/stream", True) in rec.events,
             what="the truncated profile")
    go_on.set()
    assert job.get(timeout=DEADLINE).status == 200
    wait_for(lambda: [e for e in rec.events if e[0] == "end"],
             what="on_response_end")
    settle(0.1)
    assert rec.events == [("begin", "/stream"),
                          ("profile", "/stream", True),
                          ("end", "/stream", True)]


def _open_profiles():
    from greqprof import _registry, engine
    return _registry.open_profiles(engine.current_engine().tracer.hooks_addr)


def test_an_on_begin_outliving_max_lifetime_releases_once(serve):
    """An observer's on_begin waits past max_lifetime (the reaper closes
    the profile meanwhile), then raises its Timeout: the request's CPU
    window and slot are given back once, not twice (another request's
    open profile keeps the narrow window)."""
    inside, release = [], gevent.event.Event()

    def long_app(environ, start_response):
        inside.append(1)
        release.wait(DEADLINE)
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    raised, truncated = [], gevent.event.Event()

    class SlowBegin:
        def on_begin(self, req):
            try:
                truncated.wait(DEADLINE)   # the reaper closes it meanwhile
                raise gevent.Timeout()     # then on_begin gives up
            finally:
                raised.append(1)

    long_s = serve(long_app, pct=1.0, linger=0)
    job = gevent.spawn(long_s.get, "/long")
    wait_for(lambda: inside, what="/long open")
    assert _open_profiles() == 1
    profiles = []

    def sink(p):
        profiles.append(p)
        truncated.set()

    s = serve(lambda e, sr: (sr("200 OK", []), [b"ok"])[1], pct=1.0,
              linger=0, max_lifetime=0.1, observers=[SlowBegin()], sink=sink)

    def slow():
        sock = connect(s.port)
        sock.sendall(request_bytes("/slow"))
        try:
            read_all(sock)
        except OSError:
            pass
    other = gevent.spawn(slow)
    wait_for(lambda: raised, what="on_begin to give up")
    settle(0.1)
    assert [p.truncated for p in profiles] == [True]
    assert _open_profiles() == 1       # /long's, still open
    assert s.mw._open == 0
    release.set()
    assert job.get(timeout=DEADLINE).status == 200
    wait_for(lambda: _open_profiles() == 0, what="the window back")
    other.kill()


def test_sampled_is_not_counted_when_on_begin_stops_the_request(serve):
    """An observer's on_begin lets a BaseException out: the request never
    runs, so it is not counted in stats['sampled']."""
    class Stopping:
        def on_begin(self, req):
            raise gevent.Timeout()

    s = serve(lambda e, sr: (sr("200 OK", []), [b"ok"])[1], pct=1.0,
              linger=0, observers=[Stopping()])
    sock = connect(s.port)
    sock.sendall(request_bytes("/stopped"))
    try:
        read_all(sock)
    except OSError:
        pass
    wait_for(lambda: s.mw.stats["requests"] == 1, what="the request")
    settle(0.1)
    assert s.mw.stats["sampled"] == 0
    assert s.mw._open == 0 and s.profiles == []


# ---------------------------------------------------------------------------
# a body closed in another OS thread

def test_a_body_closed_in_another_thread_detaches_its_greenlet(serve):
    """Request 1's body is closed by another OS thread (a server handing
    bodies to a worker thread): the request is finished by its own thread,
    its greenlet detached, so what the greenlet runs for its next
    (unsampled) request is not in request 1's profile."""
    import threading
    next_work = make_function("next_request_work")

    def app(environ, start_response):
        if environ["PATH_INFO"] == "/two":
            gevent.sleep(0.05)   # (the loop runs its queued callbacks)
            next_work()
        start_response("200 OK", [("Content-Length", "2")])
        return iter([b"ok"])

    draws = iter([0.0, 0.99])          # /one sampled, /two not

    def closing_elsewhere(mw):
        def wsgi(environ, start_response):
            body = mw(environ, start_response)
            data = b"".join(body)
            close = getattr(body, "close", None)
            if close is not None:
                t = threading.Thread(target=close)
                t.start()
                t.join()
            return [data]
        return wsgi

    s = serve(app, pct=0.5, rng=lambda: next(draws), linger=0.2,
              calls=True, wrap=closing_elsewhere)
    keepalive_gets(s.port, ["/one", "/two"]).close()
    one = s.profile_for("/one")
    assert func_named(one, "next_request_work") is None, \
        sorted(f.name for f in one.calls)
    wait_for(lambda: s.mw._open == 0, what="the slot back")


def _check_profiler_sees_the_requests(s, prof, paths, name):
    """The Profiler has each sampled request's calls and spans, and each
    request profile has its own calls exactly once, as without it."""
    assert {f.name: f.ncall for f in prof.func_stats()}.get(name) == \
        len(paths)
    prof_spans = {}
    for sp in prof.spans():
        prof_spans.setdefault(sp.greenlet_id, []).append(sp)
    for path in paths:
        p = s.profile_for(path)
        assert func_named(p, name).ncall == 1
        assert p.spans
        # every span of the request is in the Profiler's view too (the
        # two profiles' epoch origins may differ by rounding)
        for sp in p.spans:
            assert any(abs(o.start - sp.start) < 1e-5 and
                       abs(o.wall - sp.wall) < 1e-9
                       for o in prof_spans.get(sp.greenlet_id, ())), \
                (path, sp)
    assert s.mw.stats["errors"] == 0


def test_a_profiler_in_a_middleware_thread_sees_sampled_requests(serve):
    """p11: issue 14 asks that a Profiler started in a thread serving the
    middleware get the whole thread's data while per-request profiles go
    on; at pct=1.0 it saw none of the app's work (a strict xfail before
    gqp_tracer_set_session)."""
    app_work = make_function("app_work_of_a_sampled_request")

    def app(environ, start_response):
        app_work()
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    s = serve(app, pct=1.0, linger=0, calls=True)
    assert s.get("/warm").status == 200
    prof = greqprof.Profiler().start()
    try:
        for i in range(3):
            assert s.get("/x%d" % i).status == 200
        # (the client has the response before the server closes the
        # request: its last span runs after; stop once it is done)
        s.wait_profiles(4)
    finally:
        prof.stop()
    _check_profiler_sees_the_requests(
        s, prof, ["/x0", "/x1", "/x2"], "app_work_of_a_sampled_request")
    # after stop() the requests go on being profiled, the Profiler is done
    assert s.get("/after").status == 200
    assert func_named(s.profile_for("/after"),
                      "app_work_of_a_sampled_request").ncall == 1
    assert {f.name: f.ncall for f in prof.func_stats()}.get(
        "app_work_of_a_sampled_request") == 3


def test_a_middleware_in_a_profiler_thread_gives_it_sampled_requests(serve):
    """The reverse: a Profiler runs first, then the middleware serves its
    first requests in that thread (its engine takes the hooks over and
    the Profiler's session joins it): the Profiler gets the sampled
    requests' work too, and the work outside them."""
    app_work = make_function("app_work_under_a_running_profiler")
    outside = make_function("outside_work_under_a_running_profiler")

    def app(environ, start_response):
        app_work()
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    prof = greqprof.Profiler().start()
    try:
        s = serve(app, pct=1.0, linger=0, calls=True)
        for i in range(3):
            assert s.get("/y%d" % i).status == 200
        gevent.spawn(outside).join()
        s.wait_profiles(3)  # (each request's last span runs after its reply)
    finally:
        prof.stop()
    _check_profiler_sees_the_requests(
        s, prof, ["/y0", "/y1", "/y2"], "app_work_under_a_running_profiler")
    assert {f.name: f.ncall for f in prof.func_stats()}.get(
        "outside_work_under_a_running_profiler") == 1
