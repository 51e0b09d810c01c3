"""The C path of sampled requests (greqprof/_sampled.c): once a thread's
engine is armed, a sampled request begins, runs and finishes with no
greqprof frame under the app, and its profile says what the Python path's
said.  Served through a real gevent.pywsgi server, as in test_middleware.py;
the first request of each server takes the Python path (it arms the C
one), so every test warms up first."""
import logging
import weakref

import gevent
import pytest

from greqprof import _registry
from test_fastpath import greqprof_frames
from test_middleware import LOGGER, ok, wait_for
from test_middleware import serve  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(60)


def _child():
    gevent.sleep(0)
    return 7


def spawning_app(frames):
    def app(environ, start_response):
        frames.append(greqprof_frames())
        child = gevent.spawn(_child)
        assert child.get() == 7
        start_response("201 Created", [("Content-Type", "text/plain")])
        return [environ["PATH_INFO"].encode("latin-1")]
    return app


@pytest.mark.parametrize("linger", [0.0, 0.3])
@pytest.mark.parametrize("blocking_ms", [100, None])
def test_sampled_requests_run_with_no_greqprof_frame(serve, linger,
                                                     blocking_ms):
    frames = []
    s = serve(spawning_app(frames), pct=1.0, linger=linger,
              blocking_ms=blocking_ms)
    for i in range(4):
        r = s.get("/r%d" % i, headers=[("X-Request-ID", "id-%d" % i)])
        assert r.status == 201 and r.body == b"/r%d" % i
    s.wait_profiles(4)
    assert frames[1:] == [[]] * 3, frames
    by_path = {p.path: p for p in s.profiles}
    assert sorted(by_path) == ["/r0", "/r1", "/r2", "/r3"]
    for i in range(4):
        p = by_path["/r%d" % i]
        assert (p.method, p.status, p.request_id, p.error) == \
            ("GET", "201 Created", "id-%d" % i, None)
        assert p.sampled_by == "pct"
        # the request's greenlet and the child it spawned and joined
        assert len({sp.greenlet_id for sp in p.spans}) == 2, p.spans
        assert p.wall > 0 and p.start < p.end
    assert s.mw.stats["sampled"] == 4 and s.mw.stats["requests"] == 4
    wait_for(lambda: s.mw._open == 0, what="no open profile")


def test_an_app_exception_is_recorded_and_raised(serve):
    frames = []

    def app(environ, start_response):
        frames.append(greqprof_frames())
        if environ["PATH_INFO"] == "/boom":
            raise ValueError("boom")
        return ok()(environ, start_response)

    s = serve(app, pct=1.0)
    assert s.get("/warm-up").status == 200
    assert s.get("/boom").status == 500
    p = s.profile_for("/boom")
    assert frames[1] == []
    assert p.error == "ValueError: boom" and p.status is None
    wait_for(lambda: s.mw._open == 0, what="no open profile")


class Body:
    """A streaming body that fails after `good` chunks (or at iter())."""

    def __init__(self, good, fail_iter=False):
        self.good = good
        self.fail_iter = fail_iter
        self.closed = 0

    def __iter__(self):
        if self.fail_iter:
            raise OSError("no body")
        return self._gen()

    def _gen(self):
        for i in range(self.good):
            yield b"chunk%d\n" % i
        raise KeyError("lost")

    def close(self):
        self.closed += 1


@pytest.mark.parametrize("fail_iter", [False, True])
def test_a_failing_body_is_closed_once_and_recorded(serve, fail_iter):
    bodies = []

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        if environ["PATH_INFO"] == "/warm-up":
            return [b"ok"]
        bodies.append(Body(2, fail_iter))
        return bodies[-1]

    s = serve(app, pct=1.0)
    assert s.get("/warm-up").status == 200
    try:
        s.get("/stream")
    except Exception:
        pass  # the server drops the connection mid-body
    p = s.profile_for("/stream")
    assert bodies[0].closed == 1
    expected = "OSError: no body" if fail_iter else "KeyError: 'lost'"
    assert p.error == expected
    wait_for(lambda: s.mw._open == 0, what="no open profile")


def test_start_response_with_exc_info_is_passed_through(serve):
    seen = []

    def app(environ, start_response):
        try:
            raise RuntimeError("late")
        except RuntimeError:
            import sys
            start_response("200 OK", [("Content-Type", "text/plain")])
            w = start_response("503 Busy", [("Content-Type", "text/plain")],
                               sys.exc_info())
            seen.append(w is not None)
        return [b"busy"]

    s = serve(app, pct=1.0)
    for path in ("/a", "/b"):
        r = s.get(path)
        assert r.status == 503 and r.body == b"busy"
    assert s.profile_for("/b").status == "503 Busy"
    assert seen == [True, True]


def test_a_bad_start_response_call_is_a_type_error(serve):
    errors = []

    def app(environ, start_response):
        try:
            start_response("200 OK")
        except TypeError as e:
            errors.append(str(e))
        return ok()(environ, start_response)

    s = serve(app, pct=1.0)
    for path in ("/a", "/b"):
        assert s.get(path).status == 200
    assert len(errors) == 2 and "start_response" in errors[1]


def test_a_list_body_keeps_its_length(serve):
    s = serve(ok(b"twelve bytes"), pct=1.0)
    for path in ("/a", "/b"):
        r = s.get(path)
        assert r.body == b"twelve bytes"
        assert r.headers.get("content-length") == "12"


def test_max_open_applies_on_the_c_path(serve, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)

    def app(environ, start_response):
        if environ["PATH_INFO"] == "/keep":
            gevent.spawn(gevent.sleep, 0.5)  # keeps its profile open
        return ok()(environ, start_response)

    s = serve(app, pct=1.0, max_open=1, linger=2.0)
    assert s.get("/keep").status == 200
    assert s.mw._open == 1
    assert s.get("/other").status == 200
    assert s.mw.stats["skipped_full"] == 1
    s.profile_for("/keep")
    wait_for(lambda: s.mw._open == 0, what="no open profile")
    assert [p.path for p in s.profiles] == ["/keep"]


def test_the_request_object():
    req = _registry.Request()
    assert req.greenlet is None and req.profile is None
    req.path = "/x"
    req.blocking = []
    assert req.path == "/x" and req.blocking == []
    assert weakref.ref(req)() is req
    with pytest.raises(AttributeError):
        req.no_such_field = 1


def test_internal_entry_points_check_their_arguments():
    from greqprof import ProfilingMiddleware
    from greqprof._lowlevel import RequestRawProfile
    mw = ProfilingMiddleware(ok(), pct=1.0, blocking_ms=None)
    with pytest.raises(TypeError):
        mw._call_profiled("not a request", {}, None)
    with pytest.raises(ValueError):
        _registry.new_profile(RequestRawProfile, 0)
    with pytest.raises(TypeError):
        _registry.new_profile(dict, 10)
    with pytest.raises(ValueError):
        mw._open = -1
    with pytest.raises(ValueError):
        mw._open = 2 ** 40   # (was cut to an int)
    mw._open = 0
    rp = RequestRawProfile.for_request(5)
    assert rp.addr and not rp.closed and rp.attached == 0
    assert rp.spans() == [] and rp.funcs() == []
    rp.close()
    assert rp.closed


class _Observer:
    """Any observer sends every request through the Python path."""

    def on_profile(self, req, profile):
        pass


def test_a_profile_finalized_in_c_says_what_pythons_says(serve):
    """Two servers with the same app: one finalizes in C, the other (with
    an observer) in Python; their profiles carry the same fields."""
    frames = []
    fast = serve(spawning_app(frames), pct=1.0, report=False)
    slow = serve(spawning_app([]), pct=1.0, report=False,
                 observers=[_Observer()])
    for s in (fast, slow):
        for path in ("/a", "/b"):
            assert s.get(path, headers=[("X-Request-ID", "r" + path)]) \
                .status == 201
    a, b = fast.profile_for("/b"), slow.profile_for("/b")
    da, db = a.to_dict(), b.to_dict()
    assert sorted(da) == sorted(db)
    for key in ("method", "path", "status", "request_id", "sampled_by",
                "clock", "pid", "hostname", "error", "dropped_spans",
                "dropped_calls", "calls", "blocking"):
        assert da[key] == db[key], key
    assert len(da["spans"]) == len(db["spans"]) and da["spans"]
    assert a.start <= a.end and abs(a.wall - (a.end - a.start)) < 1e-6
    assert [g["name"] for g in da["greenlets"]] and \
        len(da["greenlets"]) == len(db["greenlets"])
    assert fast.mw.stats["delivered"] == 2


def test_a_failing_sink_is_logged_once_on_the_c_path(serve, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    calls = []

    def sink(profile):
        calls.append(profile.path)
        raise RuntimeError("sink down")

    s = serve(ok(), pct=1.0, report=False, sink=sink, linger=0)
    for i in range(3):
        assert s.get("/r%d" % i).status == 200
    wait_for(lambda: len(calls) == 3, what="three sink calls")
    errors = [r.getMessage() for r in caplog.records
              if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "sink down" in errors[0], errors
    assert s.mw.stats["errors"] == 3 and s.mw.stats["delivered"] == 3
    wait_for(lambda: s.mw._open == 0, what="no open profile")


def test_finalize_checks_its_arguments():
    from greqprof import ProfilingMiddleware
    mw = ProfilingMiddleware(ok(), pct=1.0, blocking_ms=None)
    with pytest.raises(TypeError):
        mw._finalize(None)
    with pytest.raises(TypeError):
        mw._finalize_setup(None, None, "cpu", "host")
    with pytest.raises(TypeError):
        _registry.finish_pending(None, (), 0)
    # foreign items are left out, an empty queue says: nothing waits
    pending = [("not", "a request")]
    assert _registry.finish_pending(None, pending, 0) == 0
    assert pending == []


def test_a_replaced_switch_hook_sends_sampled_requests_to_python(serve):
    """Another tool replaces greenlet's trace function after greqprof's
    hooks are in: the tracer's idea of the running greenlet goes stale, so
    the C path must not trust it (it attaches greenlet.getcurrent()).
    (Once the Python path took such requests; since the single lifecycle
    they begin in C like any other, with no greqprof frame.)"""
    import greenlet
    frames = []
    s = serve(spawning_app(frames), pct=1.0, linger=0)
    assert s.get("/warm-up").status == 201
    assert s.get("/c-path").status == 201
    assert frames[1] == []
    ours = greenlet.gettrace()
    try:
        greenlet.settrace(None)
        for i in range(3):
            assert s.get("/after%d" % i).status == 201
    finally:
        greenlet.settrace(ours)
    s.wait_profiles(5)
    assert {p.path for p in s.profiles} >= {"/after0", "/after1", "/after2"}
    # a request served in another connection greenlet than the tracer last
    # saw: begun in C all the same, each delivered once
    assert frames[2:] == [[], [], []], frames
    assert sorted(p.path for p in s.profiles if p.path.startswith(
        "/after")) == ["/after0", "/after1", "/after2"]
    wait_for(lambda: s.mw._open == 0, what="no open profile")


def test_linger_can_be_changed_at_run_time(serve):
    """The C path's finisher follows mw.linger: set to 0, a profile whose
    child is still running is delivered at once, not after 5 s (the
    child's end; the linger it was made with is 10 s)."""
    kids = []

    def app(environ, start_response):
        kids.append(gevent.spawn(gevent.sleep, 5.0))  # a child still running
        return ok()(environ, start_response)

    s = serve(app, pct=1.0, linger=10.0)
    try:
        assert s.get("/warm-up").status == 200
        s.mw.linger = 0
        assert s.mw.linger == 0.0
        assert s.get("/now").status == 200
        # (1.5 s: a busy machine's slack, far below the 5 s a stale linger
        # would take)
        s.profile_for("/now", timeout=1.5)
        with pytest.raises(Exception, match="linger"):
            s.mw.linger = -1
        assert s.mw.linger == 0.0
    finally:
        gevent.killall(kids)


# ---------------------------------------------------------------------------
# Found in review (the reviewer's probes, kept as regression tests)

def test_a_request_is_finalized_once_when_flush_meets_the_finisher(serve):
    """flush() finalizes a lingering request and its sink waits on I/O;
    meanwhile the request's child ends and the finisher looks at the same
    request: it must not be delivered a second time (nor the open count
    released twice)."""
    paths = []
    first = [True]

    def sink(p):
        paths.append(p.path)
        if p.path == "/r" and first[0]:
            first[0] = False
            gevent.sleep(0.6)   # a sink doing I/O

    def kid():
        gevent.sleep(0.2)

    def app(environ, start_response):
        if environ["PATH_INFO"] == "/r":
            gevent.spawn(kid)   # keeps /r lingering
            gevent.sleep(0)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    s = serve(app, pct=1.0, linger=5.0, sink=sink, report=False,
              blocking_ms=None)
    assert s.get("/warm").status == 200
    wait_for(lambda: "/warm" in paths, what="the warm-up profile")
    assert s.get("/r").status == 200
    gevent.sleep(0.05)
    assert s.mw.flush() == 1
    gevent.sleep(0.4)   # the child ended, the finisher passed
    assert s.mw.flush() == 0   # taken already: not counted again
    wait_for(lambda: paths.count("/r") == 1, what="the /r profile")
    gevent.sleep(0.3)
    assert paths == ["/warm", "/r"]
    assert s.mw.stats["delivered"] == 2
    assert s.mw._open == 0


def test_a_blocking_span_of_the_next_request_is_not_the_lingering_ones(
        serve, caplog):
    """Keep-alive: /first (sampled) lingers for its child while /second
    (not sampled), on the same connection greenlet, blocks the loop: the
    WARNING names /second, and /first's profile does not get the event."""
    from test_middleware import (SECRET, _blocking_warnings,
                                 _two_pipelined, current_gid, http_raw)
    caplog.set_level(logging.INFO, logger=LOGGER)
    gid = []

    def kid():
        gevent.sleep(0.6)

    def app(environ, start_response):
        path = environ["PATH_INFO"]
        if path == "/first":
            gevent.spawn(kid)   # /first lingers
            gevent.sleep(0)
        if path == "/second":
            gid.append(current_gid())
            import time
            time.sleep(0.15)   # blocks the loop
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [path.encode()]

    s = serve(app, pct=0.0, trigger_header="X-Trigger",
              trigger_secret=SECRET, blocking_ms=100, linger=2.0)
    assert s.get("/warm").status == 200
    raw = http_raw(s.port, _two_pipelined(
        b"/first", b"/second", b"X-Trigger: " + SECRET.encode() + b"\r\n"))
    assert raw.count(b"HTTP/1.1 200 OK") == 2
    first = s.profile_for("/first", timeout=5)
    w = wait_for(lambda: _blocking_warnings(caplog, "greenlet %d " % gid[0]),
                 what="the blocking WARNING")
    assert "during GET /second" in w[0], w[0]
    assert not first.blocking


@pytest.mark.parametrize("calls", [False, True])
def test_a_timeout_in_the_sink_reaches_the_caller(calls):
    """linger=0: the profile is delivered inside body.close().  A
    gevent.Timeout (a BaseException, not an error of greqprof's) that
    fires while the sink waits goes on to the caller, and the request's
    bookkeeping is released all the same."""
    import time

    from greqprof import ProfilingMiddleware
    from test_middleware import reset_greqprof

    def sink(p):
        if p.path == "/r":
            gevent.sleep(1.0)

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return iter([b"ok"])

    mw = ProfilingMiddleware(app, pct=1.0, linger=0, sink=sink,
                             report=False, blocking_ms=None, calls=calls)
    out = []

    def one(path):
        env = {"REQUEST_METHOD": "GET", "PATH_INFO": path}
        body = mw(env, lambda s, h, e=None: None)
        list(body)
        t0 = time.monotonic()
        try:
            with gevent.Timeout(0.1):
                body.close()
            out.append("returned")
        except gevent.Timeout:
            out.append("Timeout")
        assert time.monotonic() - t0 < 0.9

    try:
        gevent.spawn(one, "/warm").join()   # arms the C path
        gevent.spawn(one, "/r").join()
        assert out == ["returned", "Timeout"]
        assert mw.stats["errors"] == 0
        assert mw._open == 0
        from greqprof.engine import current_engine
        eng = current_engine()
        assert eng.requests == {} and eng.profile_requests == {}
    finally:
        reset_greqprof([mw])


def test_a_killed_finisher_is_replaced(serve):
    """The finisher greenlet killed (GreenletExit, a BaseException) while
    a sink waits: the next request that needs it starts a new one."""
    paths = []

    def sink(p):
        paths.append(p.path)
        if p.path == "/slow":
            gevent.sleep(5)

    s = serve(ok(), pct=1.0, linger=1.0, sink=sink, report=False,
              blocking_ms=None)
    assert s.get("/warm").status == 200
    wait_for(lambda: "/warm" in paths, what="the warm-up profile")
    from greqprof.engine import current_engine
    eng = current_engine()
    assert s.get("/slow").status == 200
    wait_for(lambda: "/slow" in paths, what="the sink to start")
    old = eng.finisher
    old.kill()
    assert s.get("/after").status == 200
    wait_for(lambda: "/after" in paths, what="a new finisher")
    assert eng.finisher is not old


def test_a_list_subclass_body_is_closed(serve):
    """WSGI: the server's close() reaches the app's iterable, also when it
    is a list (here a subclass) with a close() of its own."""
    closed = []

    class Body(list):
        def close(self):
            closed.append(True)

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return Body([b"a", b"b"])

    s = serve(app, pct=1.0, report=False, blocking_ms=None)
    assert s.get("/warm").status == 200
    assert s.get("/list").body == b"ab"
    wait_for(lambda: len(closed) == 2, what="both bodies closed")
    s.profile_for("/list")
