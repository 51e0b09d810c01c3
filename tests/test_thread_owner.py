"""Which thread owns a request, and what happens when that thread ends
(issue 22, items 1, 2, 6 and 11, and the property test across threads).

Every server here is a real gevent.pywsgi server in a real OS thread with
its own hub; clients talk to it over real sockets.
"""
import gc
import threading
import time

import gevent
import pytest
from gevent import pywsgi, socket

from greqprof import ProfilingMiddleware, Profiler, engine
from test_threads_fork import _OtherThread, _http_get, _in_thread

pytestmark = pytest.mark.timeout(60)


class _Sink:
    """Counts delivered profiles per request id (any thread)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ids = []
        self.profiles = {}

    def __call__(self, p):
        with self.lock:
            self.ids.append(p.request_id)
            self.profiles[p.request_id] = p


def _engines_alive():
    with engine._engines_lock:
        return list(engine._engines.values())


def _read_until(sock, marker):
    buf = b""
    while marker not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError("closed before %r: %r" % (marker, buf))
        buf += chunk
    return buf


def _get_keepalive(sock, path, rid):
    sock.sendall(("GET %s HTTP/1.1\r\nHost: t\r\nX-Request-ID: %s\r\n\r\n"
                  % (path, rid)).encode())
    return _read_until(sock, b"\r\n\r\nok")


# ---------------------------------------------------------------------------
# item 1: a thread that ends with requests open or queued for its finisher

def _ending_app(environ, start_response):
    path = environ["PATH_INFO"]
    start_response("200 OK", [("Content-Type", "text/plain")])
    if path == "/linger":
        gevent.spawn(gevent.sleep, 30)   # keeps the request queued
        return [b"ok"]
    if path == "/stream":
        def body():
            yield b"first\n"
            gevent.sleep(30)   # the thread ends before this
            yield b"never\n"
        return body()
    return [b"ok"]


def test_thread_ending_with_requests_open_or_queued_delivers_them():
    """A thread with its own hub serves a shared middleware and ends (no
    shutdown, no flush) while three requests wait in its finisher's queue
    for their children and one streams its response: each is delivered
    once (the open one truncated), every max_open slot comes back and the
    thread's engine is gone.  (Before: never delivered, slots lost for
    good: after max_open such requests the process sampled nothing.)"""
    sink = _Sink()
    mw = ProfilingMiddleware(_ending_app, pct=1.0, linger=30, report=False,
                             sink=sink, blocking_ms=None)
    seen = {}

    def serve():
        server = pywsgi.WSGIServer(("127.0.0.1", 0), mw, log=None)
        server.start()
        for i in range(3):
            assert _http_get(server.server_port, "/linger",
                             "linger-%d" % i) == b"HTTP/1.1 200 OK"
        sock = socket.create_connection(("127.0.0.1", server.server_port),
                                        timeout=20)
        sock.sendall(b"GET /stream HTTP/1.1\r\nHost: t\r\n"
                     b"X-Request-ID: stream\r\n\r\n")
        _read_until(sock, b"first\n")
        seen["engine"] = engine.current_engine()
        seen["open"] = mw._open
        sock.close()
        # the thread ends here, its hub with it

    t = threading.Thread(target=serve)
    t.start()
    t.join(30)
    assert not t.is_alive()
    assert seen["open"] == 4
    assert sorted(sink.ids) == ["linger-0", "linger-1", "linger-2",
                                "stream"], mw.stats
    assert sink.profiles["stream"].truncated
    assert not sink.profiles["linger-0"].truncated
    assert mw._open == 0
    assert seen["engine"] not in _engines_alive()
    assert mw.stats["errors"] == 0
    # the process samples again
    _in_thread(lambda: _http_get_ok(mw, "/", "after"))
    assert sink.ids.count("after") == 1


def _http_get_ok(mw, path, rid):
    server = pywsgi.WSGIServer(("127.0.0.1", 0), mw, log=None)
    server.start()
    try:
        assert _http_get(server.server_port, path, rid) == b"HTTP/1.1 200 OK"
    finally:
        server.stop()


def test_thread_ending_with_a_sink_that_switches():
    """The same end, with a sink that waits through gevent (the thread's
    hub may be gone by then): every profile delivered once."""
    got = []

    def sink(p):
        gevent.sleep(0.001)
        got.append((p.request_id, p.truncated))
    mw = ProfilingMiddleware(_ending_app, pct=1.0, linger=30, report=False,
                             sink=sink, blocking_ms=None)

    def serve():
        server = pywsgi.WSGIServer(("127.0.0.1", 0), mw, log=None)
        server.start()
        assert _http_get(server.server_port, "/linger",
                         "linger") == b"HTTP/1.1 200 OK"
        sock = socket.create_connection(("127.0.0.1", server.server_port),
                                        timeout=20)
        sock.sendall(b"GET /stream HTTP/1.1\r\nHost: t\r\n"
                     b"X-Request-ID: stream\r\n\r\n")
        _read_until(sock, b"first\n")
        sock.close()

    t = threading.Thread(target=serve)
    t.start()
    t.join(30)
    assert sorted(got) == [("linger", False), ("stream", True)]
    assert mw._open == 0 and mw.stats["errors"] == 0


def test_a_middleware_whose_thread_ended_is_freed():
    """The threads that served a middleware end, and the app drops it: the
    middleware, its sink and what the sink kept are freed.  (Before: the
    drain loop's greenlet, never resumed in a thread that ended, held the
    middleware, so it and every profile its sink kept stayed alive.)"""
    import weakref
    sink = _Sink()
    mw = ProfilingMiddleware(_ok_app, pct=1.0, report=False, sink=sink,
                             blocking_ms=100)
    for i in range(2):
        t = threading.Thread(target=_http_get_ok, args=(mw, "/x", "r%d" % i))
        t.start()
        t.join(30)
        assert not t.is_alive()
    assert sorted(sink.ids) == ["r0", "r1"]
    refs = [weakref.ref(mw), weakref.ref(sink)]
    del mw, sink
    for _ in range(3):
        gc.collect()
    assert [r() for r in refs] == [None, None]


def test_many_threads_ending_with_queued_requests_keep_sampling():
    """More threads than max_open end with a request queued each: the
    slots all come back."""
    sink = _Sink()
    mw = ProfilingMiddleware(_ending_app, pct=1.0, linger=30, report=False,
                             sink=sink, blocking_ms=None, max_open=4)

    def serve(i):
        server = pywsgi.WSGIServer(("127.0.0.1", 0), mw, log=None)
        server.start()
        assert _http_get(server.server_port, "/linger",
                         "t-%d" % i) == b"HTTP/1.1 200 OK"

    for i in range(10):
        t = threading.Thread(target=serve, args=(i,))
        t.start()
        t.join(30)
    assert sorted(sink.ids) == sorted("t-%d" % i for i in range(10)), \
        mw.stats
    assert mw.stats["skipped_full"] == 0 and mw._open == 0


# ---------------------------------------------------------------------------
# item 2: a body closed (or collected) in another OS thread, observers on

class _Observer:
    def __init__(self):
        self.lock = threading.Lock()
        self.begun, self.ended, self.profiled = [], [], []

    def on_begin(self, req):
        with self.lock:
            self.begun.append(req.request_id)

    def on_response_end(self, req, snapshot, blocking):
        with self.lock:
            self.ended.append(req.request_id)

    def on_profile(self, req, profile):
        with self.lock:
            self.profiled.append(req.request_id)


def _ok_app(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"o", b"k"]


@pytest.mark.parametrize("how", ["close", "collect"])
@pytest.mark.parametrize("pct", [0.0, 1.0])
def test_body_finished_in_writer_thread_with_observers(how, pct):
    """The server's greenlet hands the response body to a writer OS thread
    (gevent's threadpool), which iterates it and closes it (or drops it:
    the gc finalizes it there).  Observers hear on_response_end once per
    request, sampled profiles are delivered once, and nothing stays in the
    engine.  (Before: every such request stayed in the engine forever and
    observers never heard of its end.)"""
    sink, obs = _Sink(), _Observer()
    mw = ProfilingMiddleware(_ok_app, pct=pct, report=False, sink=sink,
                             observers=[obs], blocking_ms=None, linger=0.05)
    n = 10
    left = {}

    def writer(environ, start_response):
        body = mw(environ, start_response)

        def write():
            data = b"".join(body)
            if how == "close":
                body.close()
            return data
        data = gevent.get_hub().threadpool.apply(write)
        if how == "collect":
            # the only reference is dropped in another OS thread
            def drop(box):
                box.pop()
                gc.collect()
            box = [body]
            del body
            gevent.get_hub().threadpool.apply(drop, (box,))
        return [data]

    def serve():
        server = pywsgi.WSGIServer(("127.0.0.1", 0), writer, log=None)
        server.start()
        for i in range(n):
            assert _http_get(server.server_port, "/",
                             "w-%d" % i) == b"HTTP/1.1 200 OK"
        eng = engine.current_engine()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (
                eng.requests or eng.pending or len(obs.ended) < n):
            gevent.sleep(0.01)
        left["requests"] = dict(eng.requests)
        left["pending"] = list(eng.pending)
        server.stop()

    _in_thread(serve)
    ids = ["w-%d" % i for i in range(n)]
    assert sorted(obs.begun) == ids
    assert sorted(obs.ended) == ids
    assert left == {"requests": {}, "pending": []}
    if pct:
        assert sorted(sink.ids) == ids and sorted(obs.profiled) == ids
    else:
        assert sink.ids == []
    assert mw._open == 0 and mw.stats["errors"] == 0


# ---------------------------------------------------------------------------
# item 6: blocking_ms=None, two threads, an unsampled request's child

def test_unsampled_child_not_in_lingering_profile_with_two_threads():
    """blocking_ms=None; thread A serves a sampled request that lingers
    (a child still running), thread B then serves one (which arms the
    middleware for B), then A's same keep-alive greenlet serves an
    unsampled request whose child runs: that child is not in the
    lingering profile.  (Before: it was, once another thread had armed
    the middleware.)"""
    seq = [0.0, 0.0]   # /first (A) and B's request sampled; then not

    def rng():
        return seq.pop(0) if seq else 0.9

    kids = []

    def app(environ, start_response):
        path = environ["PATH_INFO"]
        if path == "/first":
            gevent.spawn(gevent.sleep, 0.5)   # keeps it lingering
            gevent.sleep(0)
        elif path == "/second":
            def kid():
                kids.append(1)
                gevent.sleep(0.01)
            gevent.spawn(kid).join()
        start_response("200 OK", [("Content-Type", "text/plain"),
                                  ("Content-Length", "2")])
        return [b"ok"]

    sink = _Sink()
    mw = ProfilingMiddleware(app, pct=0.5, rng=rng, linger=2.0,
                             report=False, sink=sink, blocking_ms=None)
    other = _OtherThread(mw)

    def thread_a():
        server = pywsgi.WSGIServer(("127.0.0.1", 0), mw, log=None)
        server.start()
        sock = socket.create_connection(("127.0.0.1", server.server_port),
                                        timeout=20)
        try:
            _get_keepalive(sock, "/first", "first")
            other.request()    # B arms the middleware for itself
            _get_keepalive(sock, "/second", "second")
            mw.flush()
        finally:
            sock.close()
            server.stop()

    try:
        _in_thread(thread_a)
    finally:
        other.close()
    assert kids == [1]
    assert sorted(sink.ids) == ["first", "other-0"], mw.stats
    names = [g.fn_name or "" for g in sink.profiles["first"].greenlets]
    assert not any("kid" in n for n in names), names


# ---------------------------------------------------------------------------
# item 11: a thread that reuses a dead thread's id

def test_profiler_profiles_threads_reusing_a_dead_threads_id():
    """Three threads one after the other (their ids are usually reused):
    each is profiled.  (Before: only the first; the others were taken for
    it, and the error swallowed.)"""
    def work_0():
        sum(range(1000))

    def work_1():
        sum(range(1000))

    def work_2():
        sum(range(1000))

    idents = []
    p = Profiler(calls=True)
    p.start()
    try:
        for fn in (work_0, work_1, work_2):
            t = threading.Thread(
                target=lambda fn=fn: (idents.append(threading.get_ident()),
                                      fn()))
            t.start()
            t.join()
    finally:
        p.stop()
    names = {f.name for f in p.func_stats()}
    assert {"work_0", "work_1", "work_2"} <= names, (idents, names)


def test_middleware_profiles_threads_reusing_a_dead_threads_id():
    """The same with a middleware served by three threads one after the
    other, none shut down: each thread's request is profiled."""
    sink = _Sink()
    mw = ProfilingMiddleware(_ok_app, pct=1.0, report=False, sink=sink)
    for i in range(3):
        t = threading.Thread(
            target=lambda i=i: _http_get_ok(mw, "/", "seq-%d" % i))
        t.start()
        t.join(30)
    assert sorted(sink.ids) == ["seq-0", "seq-1", "seq-2"], mw.stats
    assert mw._open == 0 and mw.stats["errors"] == 0


class _OrderedObserver:
    """Every observer call in order, as (event, request id)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.events = []

    def _add(self, event, req):
        with self.lock:
            self.events.append((event, req.request_id))

    def on_begin(self, req):
        self._add("begin", req)

    def on_response_end(self, req, snapshot, blocking):
        # (the profile so far, as the finisher's pass gives it)
        self._add("end" if snapshot is not None and
                  snapshot.request_id == req.request_id else "end, no "
                  "snapshot", req)

    def on_profile(self, req, profile):
        self._add("profile", req)


@pytest.mark.parametrize("pct", [1.0, 0.0])
@pytest.mark.parametrize("how", ["close", "collect"])
def test_flush_tells_observers_of_a_foreign_finish_before_its_profile(how,
                                                                      pct):
    """A body closed (or collected) in another OS thread queues its request
    for its own thread's finisher, which tells observers of the response's
    end there.  A flush() that comes first (a worker exiting) finalizes
    the request itself: observers still hear on_response_end, once and
    before on_profile; an observed request without a profile is done with
    too.  (Before: flush delivered the profile first, and observers heard
    of the end only if the thread's loop ran again, which at interpreter
    exit it does not.)"""
    sink, obs = _Sink(), _OrderedObserver()
    mw = ProfilingMiddleware(_ok_app, pct=pct, report=False, sink=sink,
                             observers=[obs], blocking_ms=None, linger=5)
    flushed, at_flush = [], []

    def in_real_thread(fn):
        # (a real OS thread joined without yielding: the serving thread's
        # loop, and so its finisher, does not run meanwhile)
        t = threading.Thread(target=fn)
        t.start()
        t.join()

    def writer(environ, start_response):
        box = [mw(environ, start_response)]
        out = []

        def write():
            out.append(b"".join(box[0]))
            if how == "close":
                box[0].close()
            else:   # the only reference dropped there
                box.pop()
                gc.collect()
        in_real_thread(write)
        eng = engine.current_engine()
        assert eng.pending   # (queued, not finalized)
        flushed.append(mw.flush())
        # (before the loop runs again: all a worker's exit would see)
        at_flush.append((list(obs.events), list(eng.pending),
                         dict(eng.requests)))
        return out

    def serve():
        server = pywsgi.WSGIServer(("127.0.0.1", 0), writer, log=None)
        server.start()
        assert _http_get(server.server_port, "/", "f-1") == \
            b"HTTP/1.1 200 OK"
        gevent.sleep(0.2)   # the finisher's pass, had flush left anything
        server.stop()

    _in_thread(serve)
    if pct:
        events = [("begin", "f-1"), ("end", "f-1"), ("profile", "f-1")]
    else:   # (no profile, so no snapshot)
        events = [("begin", "f-1"), ("end, no snapshot", "f-1")]
    assert flushed == [1 if pct else 0]
    [(seen, pending, requests)] = at_flush
    assert seen == events
    # (what the finisher's next pass would drop: finalized already)
    assert [req.finalizing for _, req in pending] in ([], [True])
    assert requests == {}
    assert obs.events == events
    assert sink.ids == (["f-1"] if pct else [])
    assert mw._open == 0 and mw.stats["errors"] == 0


def test_a_thread_that_ends_reports_its_last_blocking_spans():
    """An unsampled request's blocking span is queued for the thread's
    drain loop (once a second); a thread that ends before the loop runs
    reports it as it ends, under its own request.  (Before: never logged,
    and left queued under the thread's ident, which a later thread may be
    given: it then reported them as its own.)"""
    import logging
    from greqprof import _registry
    from gevent import monkey
    real_sleep = monkey.get_original("time", "sleep")
    seen = []

    class Handler(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                seen.append(record.getMessage())

    log = logging.getLogger("greqprof.test.thread_end_blocking")
    log.addHandler(Handler())
    log.propagate = False

    def app(environ, start_response):
        if environ["PATH_INFO"] == "/blk":
            real_sleep(0.08)   # holds the thread's loop
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    mw = ProfilingMiddleware(app, pct=0.0, report=False, blocking_ms=40,
                             stack_hz=0, summary_s=None, logger=log.name)
    idents = []

    def serve():
        idents.append(threading.get_ident())
        server = pywsgi.WSGIServer(("127.0.0.1", 0), mw, log=None)
        server.start()
        assert _http_get(server.server_port, "/blk", "b-1") == \
            b"HTTP/1.1 200 OK"
        server.stop()   # (and the thread ends, well within a second)

    t = threading.Thread(target=serve)   # (no shutdown(): it just ends)
    t.start()
    t.join(30)
    assert not t.is_alive()
    held = [m for m in seen if "during GET /blk" in m and "app (" in m]
    assert len(held) == 1, seen
    assert [r for r in _registry.long_spans if r[0] == idents[0]] == []
