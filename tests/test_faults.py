"""Fault injection and security checks of ProfilingMiddleware, each through
a real gevent.pywsgi server (in this process) and a gevent socket client.

Every fault scenario checks two things:

* the app's behaviour is unchanged: the same scenario is run against the
  bare app and against the app wrapped in the middleware, and the client
  sees the same status and body, and the app sees the same exception;
* greqprof's state is consistent afterwards: a follow-up request is
  profiled correctly (exactly one profile, holding only its own greenlet),
  ``mw._open`` is back to 0 and no stray profile was delivered.

docs/reliability.md lists every scenario with its outcome.
"""
import itertools
import json
import logging
import re
import time

import gevent
import pytest
from gevent import pywsgi, socket
from greenlet import getcurrent

from greqprof import ConfigError, ProfilingMiddleware, _lowlevel, engine

pytestmark = pytest.mark.timeout(60)

_names = itertools.count()
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")


# ---------------------------------------------------------------------------
# helpers

def current_gid():
    """greqprof's id of the running greenlet (None without an engine)."""
    eng = getattr(engine._local, "engine", None)
    return eng.tracer.greenlet_id(getcurrent()) if eng is not None else None


class ListHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)

    def messages(self, level=None):
        return [r.getMessage() for r in self.records
                if level is None or r.levelno == level]


class RaisingHandler(logging.Handler):
    """A handler whose emit raises (instead of calling handleError), so the
    exception reaches the code that logged."""

    def emit(self, record):
        raise RuntimeError("log handler failed on purpose")


class Response:
    def __init__(self, status=None, headers=None, body=b"", error=None):
        self.status = status
        self.headers = headers or {}
        self.body = body
        self.error = error

    @property
    def code(self):
        return int(self.status.split()[0]) if self.status else None

    def __repr__(self):
        return "<Response %r %r %r error=%r>" % (
            self.status, self.headers, self.body[:60], self.error)


def _read_exact(f, n):
    data = f.read(n)
    if len(data) != n:
        raise EOFError("connection closed in the body")
    return data


def read_response(f):
    """Reads one HTTP/1.1 response from a socket file (Content-Length,
    chunked, or until close)."""
    line = f.readline()
    if not line:
        return Response(error="closed before a response")
    status = line.decode("latin-1").rstrip("\r\n").split(" ", 1)[1]
    headers = {}
    while True:
        line = f.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        k, v = line.decode("latin-1").split(":", 1)
        headers[k.strip().lower()] = v.strip()
    body = b""
    try:
        if "content-length" in headers:
            body = _read_exact(f, int(headers["content-length"]))
        elif headers.get("transfer-encoding") == "chunked":
            while True:
                size = int(f.readline().split(b";")[0], 16)
                if size == 0:
                    f.readline()
                    break
                body += _read_exact(f, size)
                f.readline()
        else:
            body = f.read()
    except (EOFError, OSError, ValueError) as e:
        return Response(status, headers, body, error="truncated: %s" % e)
    return Response(status, headers, body)


def send_request(sock, path, headers=(), close=True):
    req = "GET %s HTTP/1.1\r\nHost: test\r\n" % path
    for k, v in headers:
        req += "%s: %s\r\n" % (k, v)
    if close:
        req += "Connection: close\r\n"
    sock.sendall(req.encode("latin-1") + b"\r\n")


def get(port, path, rid=None, headers=(), timeout=10):
    """One request on its own connection."""
    hdrs = list(headers)
    if rid is not None:
        hdrs.append(("X-Request-ID", rid))
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        send_request(sock, path, hdrs)
        f = sock.makefile("rb")
        try:
            return read_response(f)
        finally:
            f.close()
    except OSError as e:
        return Response(error="socket error: %s" % e)
    finally:
        sock.close()


def wait_for(cond, timeout=5.0, step=0.01):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        gevent.sleep(step)
    return cond()


class Served:
    """A pywsgi server on a free loopback port serving `app`, bare or
    wrapped in a ProfilingMiddleware whose sink, logger and app-side
    bookkeeping the test can read."""

    def __init__(self, app, wrap=True, **mw_kwargs):
        self.profiles = []
        self.log = logging.getLogger("greqprof.test_faults.%d"
                                     % next(_names))
        self.log.propagate = False
        self.log.setLevel(logging.DEBUG)
        self.handler = ListHandler()
        self.log.addHandler(self.handler)
        self.mw = None
        if wrap:
            mw_kwargs.setdefault("pct", 1.0)
            mw_kwargs.setdefault("sink", self.profiles.append)
            mw_kwargs.setdefault("report", True)
            mw_kwargs.setdefault("watchdog", False)
            mw_kwargs.setdefault("linger", 0.05)
            self.mw = ProfilingMiddleware(app, logger=self.log, **mw_kwargs)
        self.server = pywsgi.WSGIServer(("127.0.0.1", 0), self.mw or app,
                                        log=None, error_log=None)
        self.server.start()
        self.port = self.server.server_port

    def stop(self):
        self.server.stop(timeout=1)

    def settle(self, n=None, timeout=5.0):
        """Waits until every sampled request's profile was delivered (and
        at least n profiles, when given)."""
        if self.mw is None:
            return
        assert wait_for(lambda: self.mw._open == 0 and (
            n is None or len(self.profiles) >= n), timeout), (
            "open=%d delivered=%d" % (self.mw._open, len(self.profiles)))

    def profile(self, rid):
        found = [p for p in self.profiles if p.request_id == rid]
        assert len(found) == 1, "%d profiles for %s: %r" % (
            len(found), rid, [p.request_id for p in self.profiles])
        return found[0]


@pytest.fixture
def serve():
    """Factory of Served servers; stops them and removes greqprof's hooks
    from this thread at teardown (before conftest's hook check)."""
    made = []

    def factory(app, wrap=True, **kw):
        s = Served(app, wrap=wrap, **kw)
        made.append(s)
        return s

    yield factory
    for s in made:
        s.stop()
    _lowlevel.inject_alloc_failures(count=0)
    engine.shutdown()


# The app used by every scenario: /ok is the follow-up request.
GIDS = {}       # request id -> greqprof ids of the greenlets that served it
EVENTS = []     # what the app saw (exceptions, cleanup)


def ok_app(environ, start_response):
    rid = environ.get("HTTP_X_REQUEST_ID")
    GIDS.setdefault(rid, set()).add(current_gid())
    gevent.sleep(0)
    gevent.sleep(0.001)
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok\n"]


def check_follow_up(srv, rid="follow-up", before=None):
    """A follow-up request is profiled correctly: 200, exactly one new
    profile, holding only the greenlet that served it; nothing stray."""
    before = len(srv.profiles) if before is None else before
    r = get(srv.port, "/ok", rid)
    assert r.code == 200 and r.body == b"ok\n", r
    srv.settle(before + 1)
    gevent.sleep(0.05)
    new = srv.profiles[before:]
    assert [p.request_id for p in new] == [rid], (
        "stray or missing profiles: %r" % [p.request_id for p in new])
    p = new[0]
    assert p.status == "200 OK" and p.error is None and p.path == "/ok"
    assert p.spans, "the follow-up request has no spans"
    mine = GIDS[rid]
    assert {s.greenlet_id for s in p.spans} <= mine, (
        "foreign greenlets in the follow-up profile: %r vs %r"
        % ({s.greenlet_id for s in p.spans}, mine))
    assert {g.id for g in p.greenlets} <= mine
    assert srv.mw._open == 0
    return p


def run_both(app, scenario, **mw_kwargs):
    """Runs `scenario(served)` against the bare and the wrapped app; returns
    (bare outcome, wrapped outcome, wrapped Served)."""
    outcomes = []
    served = None
    for wrap in (False, True):
        EVENTS.clear()
        s = Served(app, wrap=wrap, **mw_kwargs)
        try:
            out = scenario(s)
            gevent.sleep(0.05)
            outcomes.append((out, list(EVENTS)))
        finally:
            if not wrap:
                s.stop()
        served = s
    return outcomes[0], outcomes[1], served


@pytest.fixture
def both():
    made = []

    def runner(app, scenario, **kw):
        bare, wrapped, s = run_both(app, scenario, **kw)
        made.append(s)
        return bare, wrapped, s

    yield runner
    for s in made:
        s.stop()
    engine.shutdown()


def outcome(r):
    return (r.status, r.body, r.error is not None)


# ---------------------------------------------------------------------------
# the app fails

def failing_app(environ, start_response):
    path = environ["PATH_INFO"]
    if path == "/ok":
        return ok_app(environ, start_response)
    gevent.sleep(0)
    if path == "/before":
        raise RuntimeError("failed before start_response")
    start_response("200 OK", [("Content-Type", "text/plain")])
    if path == "/after":
        raise RuntimeError("failed after start_response")

    def body():
        yield b"first chunk\n"
        gevent.sleep(0.001)
        yield b"second chunk\n"
        raise ValueError("the body failed mid-stream")
    return body()


@pytest.mark.parametrize("path,error", [
    ("/before", "RuntimeError: failed before start_response"),
    ("/after", "RuntimeError: failed after start_response"),
    ("/midstream", "ValueError: the body failed mid-stream"),
])
def test_app_raises(both, path, error):
    bare, wrapped, srv = both(
        failing_app, lambda s: outcome(get(s.port, path, rid="fail")))
    assert wrapped == bare
    if path != "/midstream":
        assert bare[0][0].startswith("500")
    srv.settle(1)
    p = srv.profile("fail")
    assert p.error == error
    assert p.status == (None if path == "/before" else "200 OK")
    assert srv.mw.stats["errors"] == 0
    check_follow_up(srv)


# ---------------------------------------------------------------------------
# the client goes away mid-body

def streaming_app(environ, start_response):
    if environ["PATH_INFO"] == "/ok":
        return ok_app(environ, start_response)
    start_response("200 OK", [("Content-Type", "application/octet-stream")])

    def body():
        try:
            for _ in range(400):
                yield b"x" * 65536
                gevent.sleep(0.001)
            EVENTS.append("body completed")
        except BaseException as e:
            EVENTS.append("body raised %s" % type(e).__name__)
            raise
        finally:
            EVENTS.append("body closed")
    return body()


def disconnect_mid_body(s):
    sock = socket.create_connection(("127.0.0.1", s.port), timeout=5)
    send_request(sock, "/big", [("X-Request-ID", "gone")], close=False)
    got = sock.recv(4096)
    sock.close()
    wait_for(lambda: "body closed" in EVENTS, 5)
    return got.split(b"\r\n", 1)[0]


def test_client_disconnects_mid_body(both):
    bare, wrapped, srv = both(streaming_app, disconnect_mid_body)
    assert wrapped == bare
    assert bare[0] == b"HTTP/1.1 200 OK"
    assert "body completed" not in bare[1]
    srv.settle(1)
    p = srv.profile("gone")
    assert p.status == "200 OK"
    check_follow_up(srv)


# ---------------------------------------------------------------------------
# the request greenlet is killed

HANDLERS = {}


def sleeping_app(environ, start_response):
    if environ["PATH_INFO"] == "/ok":
        return ok_app(environ, start_response)
    HANDLERS["victim"] = getcurrent()
    try:
        gevent.sleep(30)
    except BaseException as e:
        EVENTS.append("app raised %s" % type(e).__name__)
        raise
    start_response("200 OK", [])
    return [b"slept\n"]


def kill_request(s):
    HANDLERS.clear()
    client = gevent.spawn(get, s.port, "/sleep", "killed")
    assert wait_for(lambda: "victim" in HANDLERS, 5)
    gevent.sleep(0.01)
    # From another greenlet, while the request is switched out in sleep.
    gevent.kill(HANDLERS["victim"])
    return outcome(client.get(timeout=10))


def test_request_greenlet_killed(both):
    bare, wrapped, srv = both(sleeping_app, kill_request)
    assert wrapped == bare
    assert "app raised GreenletExit" in bare[1]
    srv.settle(1)
    p = srv.profile("killed")
    assert p.error.startswith("GreenletExit")
    assert p.status is None
    check_follow_up(srv)


# ---------------------------------------------------------------------------
# a greenlet spawned by the request outlives it and keeps switching

CHILD = {}


def outliving_child():
    CHILD["gid"] = current_gid()
    CHILD["switches"] = 0
    start = time.monotonic()
    end = start + 1.2
    while time.monotonic() < end:
        gevent.sleep(0.002)
        CHILD["switches"] += 1
        # It spawns a grandchild after the profile closed (0.4 s in, and
        # not before the test saw the profile delivered; by time, not by
        # switches, which a busy machine makes few): that one joins
        # nothing either.
        if "late" not in CHILD and CHILD.get("profiled") and \
                time.monotonic() - start >= 0.4:
            CHILD["late"] = gevent.spawn(late_grandchild)
    CHILD["done"] = True


def late_grandchild():
    CHILD["late_gid"] = current_gid()
    for _ in range(20):
        gevent.sleep(0.001)


def spawning_app(environ, start_response):
    if environ["PATH_INFO"] == "/ok":
        return ok_app(environ, start_response)
    GIDS.setdefault(environ.get("HTTP_X_REQUEST_ID"), set()).add(
        current_gid())
    CHILD["greenlet"] = gevent.spawn(outliving_child)
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"spawned\n"]


def test_spawned_greenlet_outlives_request(serve):
    CHILD.clear()
    srv = serve(spawning_app, linger=0.1)
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    f = sock.makefile("rb")
    send_request(sock, "/spawn", [("X-Request-ID", "parent")], close=False)
    r = read_response(f)
    assert r.code == 200 and r.body == b"spawned\n"
    # The profile is delivered after the linger, the child still running.
    assert wait_for(lambda: len(srv.profiles) == 1, 3)
    CHILD["profiled"] = True
    assert not CHILD.get("done")
    p = srv.profile("parent")
    assert CHILD["gid"] in {g.id for g in p.greenlets}
    child_stat = [g for g in p.greenlets if g.id == CHILD["gid"]][0]
    assert not child_stat.finished
    # While the child keeps switching: a keep-alive request on the same
    # connection (the same handler greenlet) and one on a new connection.
    send_request(sock, "/ok", [("X-Request-ID", "same-conn")], close=False)
    r2 = read_response(f)
    assert r2.code == 200 and r2.body == b"ok\n"
    r3 = get(srv.port, "/ok", "new-conn")
    assert r3.code == 200
    srv.settle(3)
    for rid in ("same-conn", "new-conn"):
        q = srv.profile(rid)
        gids = {s.greenlet_id for s in q.spans} | {g.id for g in q.greenlets}
        assert gids <= GIDS[rid], (rid, gids, GIDS[rid])
        assert CHILD["gid"] not in gids
    assert wait_for(lambda: CHILD.get("done"), 5)
    CHILD["greenlet"].join(timeout=5)
    assert "late" in CHILD, CHILD
    CHILD["late"].join(timeout=5)
    f.close()
    sock.close()
    gevent.sleep(0.2)
    # No stray profile: only the three requests, each delivered once.
    assert sorted(x.request_id for x in srv.profiles) == sorted(
        ["parent", "same-conn", "new-conn"])
    # The child's later switches were not added to the closed profile.
    assert len([s for s in srv.profile("parent").spans
                if s.greenlet_id == CHILD["late_gid"]]) == 0
    assert srv.mw._open == 0
    assert srv.mw.stats["errors"] == 0
    check_follow_up(srv)


# ---------------------------------------------------------------------------
# the sink, the logging handler

def test_sink_raises(serve):
    def sink(profile):
        raise RuntimeError("sink failed on purpose")
    srv = serve(ok_app, sink=sink, report=False)
    for i in range(3):
        r = get(srv.port, "/ok", "s%d" % i)
        assert r.code == 200 and r.body == b"ok\n"
    srv.settle()
    errors = srv.handler.messages(logging.ERROR)
    assert srv.mw.stats["errors"] == 3
    assert len(errors) == 1 and "sink failed" in errors[0], errors
    assert "RuntimeError: sink failed on purpose" in errors[0]
    # Restore a working sink: the next request is profiled normally.
    srv.mw.sink = srv.profiles.append
    check_follow_up(srv)


@pytest.mark.parametrize("json_logs", [False, True])
def test_logging_handler_raises(serve, json_logs, monkeypatch):
    monkeypatch.setattr(logging, "raiseExceptions", True)
    srv = serve(ok_app, report=True, json_logs=json_logs)
    bad = RaisingHandler()
    srv.log.addHandler(bad)
    try:
        for i in range(3):
            r = get(srv.port, "/ok", "h%d" % i)
            assert r.code == 200 and r.body == b"ok\n"
        srv.settle(3)
    finally:
        srv.log.removeHandler(bad)
    # The sink still got every profile; the failure was counted per report
    # and logged once (the error log itself reaching the raising handler
    # too is swallowed).
    assert [p.request_id for p in srv.profiles] == ["h0", "h1", "h2"]
    assert srv.mw.stats["errors"] == 3
    errors = srv.handler.messages(logging.ERROR)
    assert len(errors) == 1 and "logging failed" in errors[0], errors
    check_follow_up(srv)


# ---------------------------------------------------------------------------
# max_spans

def switchy_app(environ, start_response):
    if environ["PATH_INFO"] == "/ok":
        return ok_app(environ, start_response)
    for _ in range(60):
        gevent.sleep(0)
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"switched\n"]


def test_max_spans_exceeded(serve):
    srv = serve(switchy_app, max_spans=10)
    r = get(srv.port, "/switchy", "many")
    assert r.code == 200 and r.body == b"switched\n"
    srv.settle(1)
    p = srv.profile("many")
    assert len(p.spans) == 10
    assert p.dropped_spans > 0
    assert len(p.spans) + p.dropped_spans >= 61
    report = p.report()
    assert "Spans dropped (max_spans reached): %d" % p.dropped_spans in report
    assert "Number of spans: %d" % (10 + p.dropped_spans) in report
    assert p.to_dict()["dropped_spans"] == p.dropped_spans
    text = [m for m in srv.handler.messages(logging.INFO)
            if "Request id: many" in m]
    assert len(text) == 1 and "Spans dropped" in text[0]
    check_follow_up(srv)


# ---------------------------------------------------------------------------
# allocation failures in libgreqprof

@pytest.mark.parametrize("count", [1, 10, 1000])
def test_alloc_failure_during_request(serve, count):
    srv = serve(ok_app, report=False)
    check_follow_up(srv, "warm-up")
    for attempt in range(2):
        before = len(srv.profiles)
        _lowlevel.inject_alloc_failures(after=0, count=count)
        try:
            r = get(srv.port, "/ok", "oom%d" % attempt)
        finally:
            _lowlevel.inject_alloc_failures(count=0)
        assert r.code == 200 and r.body == b"ok\n", r
        srv.settle()
        gevent.sleep(0.02)
        new = [p.request_id for p in srv.profiles[before:]]
        if count > 1:
            # The profile could not be made: not profiled, nothing stray.
            assert new == []
        else:
            # The one failure may hit the hooks' bookkeeping instead (data
            # dropped silently): profiled once, or not at all.
            assert new in ([], ["oom%d" % attempt])
    errors = srv.handler.messages(logging.ERROR)
    assert srv.mw.stats["errors"] == (2 if count > 1 else
                                      2 - len(srv.profiles) + 1)
    assert len(errors) == (1 if srv.mw.stats["errors"] else 0), errors
    if errors:
        assert "open profile failed" in errors[0]
        assert "GQP_ENOMEM" in errors[0]
    assert _lowlevel.alloc_failures_left() == 0
    check_follow_up(srv)


def fanout_app(environ, start_response):
    if environ["PATH_INFO"] == "/ok":
        return ok_app(environ, start_response)

    def work(n):
        total = 0
        for i in range(n):
            total += i
            gevent.sleep(0)
        return total
    if environ["PATH_INFO"] == "/wide":
        # The request waits on more greenlets, not its own (spawned from
        # the hub), than gqp_tracer_waited's table on the stack holds:
        # finalizing it allocates in libgreqprof.
        others = []
        gevent.get_hub().loop.run_callback(
            lambda: others.extend(gevent.spawn(work, 2) for _ in range(80)))
        gevent.sleep(0)
        gevent.joinall(others)
    children = [gevent.spawn(work, 4) for _ in range(3)]
    gevent.joinall(children)
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"%d\n" % sum(c.value for c in children)]


def test_alloc_failure_at_every_point(serve):
    """One allocation fails at each successive point of a request with
    calls=True and children (and then every allocation from that point):
    the request is unaffected and the next one is profiled normally."""
    srv = serve(fanout_app, calls=True, report=False, linger=0.02,
                blocking_ms=None)
    check_follow_up(srv, "warm-up")
    points = 0
    for count in (1, 1000):
        for after in range(0, 400, 2):
            _lowlevel.inject_alloc_failures(after=after, count=count)
            try:
                r = get(srv.port, "/fanout", "f%d-%d" % (count, after))
                srv.settle(timeout=3)
            finally:
                left = _lowlevel.alloc_failures_left()
                _lowlevel.inject_alloc_failures(count=0)
            assert r.code == 200 and r.body == b"18\n", (after, count, r)
            assert srv.mw._open == 0
            points += 1
            p = check_follow_up(srv, "n%d-%d" % (count, after))
            assert p.calls, "calls missing after a failure at %d" % after
            if left == count:
                break  # the request no longer reached an allocation
    assert points > 10
    # Each failure is logged once per place.
    errors = srv.handler.messages(logging.ERROR)
    assert len(errors) == len(set(e.split(" failed")[0] for e in errors))


def test_alloc_failure_in_finalize_leaves_no_bookkeeping(serve):
    srv = serve(fanout_app, report=False, linger=0, blocking_ms=None)
    check_follow_up(srv, "warm-up")
    eng = engine._local.engine

    def finish_failed():
        return any("finish failed" in m
                   for m in srv.handler.messages(logging.ERROR))
    # Failing from the after-th allocation on: early ones fail the
    # request's tracking, late ones its finalization (which allocates in
    # libgreqprof only for wide requests).
    for after in range(0, 3000, 3):
        _lowlevel.inject_alloc_failures(after=after, count=100000)
        try:
            get(srv.port, "/wide")
        finally:
            _lowlevel.inject_alloc_failures(count=0)
        srv.settle()
        if finish_failed():
            break
    assert finish_failed()
    assert eng.requests == {}
    assert eng.profile_requests == {}


# ---------------------------------------------------------------------------
# transparency (bugs found while writing these tests, since fixed)

def list_body_app(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok\n"]


def http10_keepalive(s):
    sock = socket.create_connection(("127.0.0.1", s.port), timeout=5)
    sock.sendall(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    f = sock.makefile("rb")
    line = f.readline()
    headers = {}
    while True:
        h = f.readline()
        if h in (b"\r\n", b""):
            break
        k, v = h.decode().split(":", 1)
        headers[k.strip().lower()] = v.strip()
    f.close()
    sock.close()
    return line, headers.get("content-length"), headers.get("connection")


def test_response_framing_unchanged(both):
    bare, wrapped, srv = both(list_body_app, http10_keepalive)
    assert bare[0] == (b"HTTP/1.1 200 OK\r\n", "3", "keep-alive")
    assert wrapped == bare


class ListBody(list):
    """A framework's response list (a list subclass)."""


class SizedBody:
    """Re-iterable and sized, not a list: pywsgi sums its chunks."""

    def __init__(self, parts):
        self.parts = parts

    def __iter__(self):
        return iter(self.parts)

    def __len__(self):
        return len(self.parts)


@pytest.mark.parametrize("pct", [0.0, 1.0])
@pytest.mark.parametrize("kind", [ListBody, SizedBody, tuple])
def test_sized_bodies_keep_their_content_length(both, kind, pct):
    """Any body with __len__, not only an exact list: the server sizes it
    (Content-Length) bare, so it must wrapped too, sampled or not; on an
    HTTP/1.0 keep-alive connection an unsized body goes out unframed."""
    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return kind([b"ok", b"\n"])
    bare, wrapped, srv = both(app, http10_keepalive, pct=pct)
    assert bare[0] == (b"HTTP/1.1 200 OK\r\n", "3", "keep-alive")
    assert wrapped == bare
    srv.settle()
    assert srv.mw._open == 0
    assert len(srv.profiles) == (1 if pct else 0)


def test_idle_server_reports_no_blocking(serve):
    # (150 ms: a light request may take 30+ ms on a busy machine; the idle
    # waits stay well above it, so a hub wait counted as held would show)
    srv = serve(ok_app, pct=0.0, blocking_ms=150, report=True)
    for i in range(3):
        assert get(srv.port, "/ok").code == 200
        gevent.sleep(0.5)   # the server is idle: the hub waits in epoll
    gevent.sleep(1.2)       # the drain loop reports outside requests
    warnings = srv.handler.messages(logging.WARNING)
    assert srv.mw.stats["blocking"] == 0, warnings[:1]


def short_block_app(environ, start_response):
    if environ["PATH_INFO"] == "/block":
        time.sleep(0.03)   # not patched: holds the loop
    for _ in range(3):
        gevent.sleep(0)
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"x"]


def test_blocking_events_reach_their_profile_under_concurrency(serve):
    srv = serve(short_block_app, report=False, blocking_ms=20, linger=0)

    def client(c):
        for k in range(20):
            get(srv.port, "/block" if k % 5 == 0 else "/", "%d-%d" % (c, k))
    gevent.joinall([gevent.spawn(client, c) for c in range(5)])
    srv.settle(100)
    blocked = [p for p in srv.profiles if p.path == "/block"]
    assert len(blocked) == 20
    assert srv.mw.stats["blocking"] >= 20
    assert [p.request_id for p in blocked if not p.blocking] == []


# ---------------------------------------------------------------------------
# security: the trigger

SECRET = "Tr1gger-s3cret-value"


def test_trigger_off_by_default(serve):
    srv = serve(ok_app, pct=0.0, report=True)
    for value in ("1", "yes", SECRET, "x" * 64):
        for header in ("X-Greqprof", "X-Greqprof-Trigger", "X-Profile"):
            r = get(srv.port, "/ok", headers=[(header, value)])
            assert r.code == 200
    srv.settle()
    gevent.sleep(0.05)
    assert srv.profiles == []
    assert srv.mw.stats["sampled"] == 0
    assert srv.mw.stats["requests"] == 12


def test_trigger_secret(serve):
    srv = serve(ok_app, pct=0.0, report=True, json_logs=False,
                trigger_header="X-Greqprof", trigger_secret=SECRET)
    wrong = [
        "x" * len(SECRET),                 # equal length
        SECRET[:-1] + "X",                 # equal length, last char
        "T" + SECRET[1:].upper(),          # equal length
        SECRET[:-1],                       # a prefix
        SECRET + "x",                      # longer
        "",                                # empty
        SECRET.lower(),
        SECRET[1:],                        # a suffix
        "é" * len(SECRET),                 # non-ASCII (latin-1)
        "x" * 4096,
    ]
    for i, value in enumerate(wrong):
        r = get(srv.port, "/ok", "wrong%d" % i,
                headers=[("X-Greqprof", value)])
        assert r.code == 200
    srv.settle()
    gevent.sleep(0.05)
    assert srv.profiles == [], [p.request_id for p in srv.profiles]
    r = get(srv.port, "/ok", "right", headers=[("X-Greqprof", SECRET)])
    assert r.code == 200
    srv.settle(1)
    p = srv.profile("right")
    assert p.sampled_by == "trigger"
    assert srv.mw.stats["sampled"] == 1 and srv.mw.stats["errors"] == 0
    # The secret is never shown: logs, repr, the profile.
    for rec in srv.handler.records:
        assert SECRET not in rec.getMessage()
        assert SECRET not in repr(rec.args)
    assert SECRET not in repr(srv.mw) and SECRET not in str(srv.mw)
    assert SECRET not in p.to_json() and SECRET not in p.report()
    # The trigger still works under json_logs, and the secret stays out.
    srv.mw.json_logs = True
    get(srv.port, "/ok", "right-json", headers=[("X-Greqprof", SECRET)])
    srv.settle(2)
    assert all(SECRET not in r.getMessage() for r in srv.handler.records)


def test_trigger_config_validation():
    def app(environ, start_response):
        return []
    with pytest.raises(ConfigError):
        ProfilingMiddleware(app, trigger_header="X-Greqprof")
    with pytest.raises(ConfigError):
        ProfilingMiddleware(app, trigger_secret=SECRET)
    with pytest.raises(ConfigError) as e:
        ProfilingMiddleware(app, trigger_header="X-Greqprof",
                            trigger_secret="short")
    assert "short" not in str(e.value)


# ---------------------------------------------------------------------------
# security: request-derived strings in reports

HOSTILE_PATH = ("/a%0d%0a>>>%20Begin%20RequestProfile%0d%0a%20%20Path:%20"
                "/forged%1b[31m%7f%c2%85%e2%80%a8end")
HOSTILE_RID = "rid\x1b[2J\x7f\x01forged"


def blocking_app(environ, start_response):
    if environ["PATH_INFO"] == "/ok":
        return ok_app(environ, start_response)
    time.sleep(0.08)   # not patched: holds the loop
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"blocked\n"]


def assert_no_raw_control(text):
    bad = _CONTROL.findall(text)
    assert not bad, "raw control characters %r in %r" % (bad, text[:300])


def test_text_report_escapes_control_characters(serve):
    srv = serve(blocking_app, report=True, blocking_ms=50)
    r = get(srv.port, HOSTILE_PATH, HOSTILE_RID)
    assert r.code == 200
    srv.settle(1)
    p = srv.profiles[0]
    # cleaned at capture (greqprof/_text.py), escaped once
    assert "\\x0d\\x0a" in p.path and "\\x1b" in p.request_id
    assert "\r" not in p.path and "\x1b" not in p.request_id
    infos = [m for m in srv.handler.messages(logging.INFO)
             if m.startswith(">>> Begin RequestProfile")]
    assert len(infos) == 1
    report = infos[0]
    for line in report.split("\n"):
        assert_no_raw_control(line)
    # Exactly one report header: the path could not forge another one.
    assert report.count("\n>>> Begin") == 0
    path_line = [ln for ln in report.split("\n") if ln.startswith("  Path:")]
    assert len(path_line) == 1
    assert "\\x0d\\x0a>>> Begin RequestProfile" in path_line[0]
    assert "\\x1b[31m" in path_line[0] and "\\x7f" in path_line[0]
    assert "Request id: rid\\x1b[2J\\x7f\\x01forged" in report
    # The blocking WARNING names the request, escaped too.
    warnings = srv.handler.messages(logging.WARNING)
    mine = [w for w in warnings if "during GET" in w]
    assert mine, warnings
    for w in mine:
        for line in w.split("\n"):
            assert_no_raw_control(line)
        assert "\\x0d\\x0a" in w and "[request id rid\\x1b[2J" in w


def test_json_logs_one_valid_line_each(serve):
    srv = serve(blocking_app, report=True, json_logs=True, blocking_ms=50)
    r = get(srv.port, HOSTILE_PATH, HOSTILE_RID)
    assert r.code == 200
    srv.settle(1)
    check_follow_up(srv)
    msgs = [m for m in srv.handler.messages() if m.startswith("{")]
    kinds = set()
    for m in msgs:
        assert "\n" not in m and "\r" not in m
        assert_no_raw_control(m)
        d = json.loads(m)
        kinds.add(d["schema"])
        if d.get("request_id") == HOSTILE_RID:
            assert d["path"].startswith("/a\r\n>>> Begin")
    assert {"greqprof.request_profile/1", "greqprof.blocking/1"} <= kinds


def call_wsgi(mw, environ):
    """Calls the middleware directly (no server) in a greenlet."""
    out = {}

    def start_response(status, headers, exc_info=None):
        out["status"] = status

    def run():
        result = mw(environ, start_response)
        try:
            out["body"] = b"".join(result)
        finally:
            result.close()
    gevent.spawn(run).join(timeout=10)
    return out


def test_huge_path_and_request_id_are_capped(serve):
    srv = serve(blocking_app, report=True, blocking_ms=50)
    environ = {"REQUEST_METHOD": "GET" * 50, "PATH_INFO": "/" + "p" * 100000,
               "HTTP_X_REQUEST_ID": "r" * 100000, "SERVER_NAME": "test",
               "SERVER_PORT": "80", "wsgi.url_scheme": "http"}
    out = call_wsgi(srv.mw, environ)
    assert out == {"status": "200 OK", "body": b"blocked\n"}
    srv.settle(1)
    p = srv.profiles[0]
    assert len(p.path) <= 2048 and len(p.request_id) <= 200
    assert len(p.method) <= 32
    report = p.report()
    assert len(report) < 20000
    assert "more]" in report
    assert len(p.to_json()) < 20000
    for m in srv.handler.messages():
        assert len(m) < 20000, m[:200]
    # Over HTTP pywsgi refuses request lines over 8 KB itself (414); an
    # 8000-byte path is served and capped.
    r = get(srv.port, "/" + "q" * 8000, "long-http")
    assert r.code == 200
    srv.settle(2)
    q = srv.profile("long-http")
    assert len(q.path) == 2048
    line = [ln for ln in q.report().split("\n") if ln.startswith("  Path:")]
    assert len(line[0]) < 1100
