"""Property test across OS threads (issue 22): N threads, each with its
own hub and gevent.pywsgi server, serve one middleware; threads start and
end during the run (some while requests are still open or queued for
their finisher), and some responses are finished in another OS thread
(the body closed, or dropped and collected, by a writer thread).

Whatever the plan: every sampled request is delivered exactly once,
observers hear of every followed request's end exactly once, every
max_open slot comes back, nothing is left in an engine, and the engines of
the threads that ended are gone.

Bounded: hypothesis' settings keep the run under ~30 s."""
import collections
import gc
import threading

import pytest

pytest.importorskip("hypothesis")

import gevent  # noqa: E402
from gevent import pywsgi, socket  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from greqprof import ProfilingMiddleware, engine  # noqa: E402

pytestmark = pytest.mark.timeout(120)

KINDS = ("plain", "child", "long_child", "writer_close", "writer_drop",
         "stream_left_open")


def _inner_app(environ, start_response):
    path = environ["PATH_INFO"]
    start_response("200 OK", [("Content-Type", "text/plain")])
    if path == "/child":
        gevent.spawn(gevent.sleep, 0.01)
    elif path == "/long_child":
        gevent.spawn(gevent.sleep, 5)   # outlives linger and the thread
    elif path == "/stream_left_open":
        def body():
            yield b"first\n"
            gevent.sleep(30)
            yield b"never\n"
        return body()
    return [b"o", b"k"]


def _writer(mw):
    """The server's app: most requests go to mw; /writer_* hand mw's body
    to a writer OS thread that iterates it and closes it, or drops the
    last reference to it there (the gc finalizes it in that thread)."""
    def app(environ, start_response):
        path = environ["PATH_INFO"]
        if not path.startswith("/writer_"):
            return mw(environ, start_response)
        environ["PATH_INFO"] = "/"
        box = [mw(environ, start_response)]
        out = []

        def write():
            out.append(b"".join(box[0]))
            if path == "/writer_close":
                box[0].close()
            box.pop()
            gc.collect()
        t = threading.Thread(target=write)
        t.start()
        t.join()   # (blocks this thread's hub meanwhile: it is a test)
        return out
    return app


class _Record:
    def __init__(self):
        self.lock = threading.Lock()
        self.delivered = collections.Counter()
        self.sampled = set()
        self.begun = collections.Counter()
        self.ended = collections.Counter()
        self.engines = []
        self.failures = []

    # sink
    def __call__(self, p):
        with self.lock:
            self.delivered[p.request_id] += 1

    # observer
    def on_begin(self, req):
        with self.lock:
            self.begun[req.request_id] += 1
            if req.profile is not None:
                self.sampled.add(req.request_id)

    def on_response_end(self, req, snapshot, blocking):
        with self.lock:
            self.ended[req.request_id] += 1


def _send(sock, path, rid):
    sock.sendall(("GET %s HTTP/1.1\r\nHost: t\r\nX-Request-ID: %s\r\n"
                  "Connection: close\r\n\r\n" % (path, rid)).encode())


def _read(sock, until=None):
    data = b""
    while until is None or until not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _serve(mw, rec, index, kinds, end):
    """One thread's life: a server, its requests (one connection each, two
    at a time), then its end: returning at once, or after stopping the
    server (which closes what is still open)."""
    try:
        server = pywsgi.WSGIServer(("127.0.0.1", 0), _writer(mw), log=None)
        server.start()
        port = server.server_port
        left_open = []

        def one(j, kind):
            sock = socket.create_connection(("127.0.0.1", port), timeout=20)
            _send(sock, "/" + kind, "t%d-%d-%s" % (index, j, kind))
            if kind == "stream_left_open":
                _read(sock, b"first\n")
                left_open.append(sock)
                return
            data = _read(sock)
            sock.close()
            if not data.startswith(b"HTTP/1.1 200 OK"):
                rec.failures.append((kind, data[:80]))

        for j in range(0, len(kinds), 2):
            gevent.joinall([gevent.spawn(one, j + k, kind)
                            for k, kind in enumerate(kinds[j:j + 2])],
                           raise_error=True)
        with rec.lock:
            rec.engines.append(engine.current_engine())
        if end == "stop":
            server.stop(timeout=0.05)
        for s in left_open:
            s.close()
        # the thread ends here (its hub with it), no flush, no shutdown
    except BaseException as e:   # reported by the test
        rec.failures.append(repr(e))


plans = st.lists(
    st.tuples(st.lists(st.sampled_from(KINDS), min_size=1, max_size=4),
              st.sampled_from(["return", "stop"])),
    min_size=2, max_size=6)


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(plan=plans, overlap=st.integers(1, 3), linger=st.sampled_from(
    [0, 0.05, 1.0]))
def test_threads_started_and_ended_deliver_everything_once(
        plan, overlap, linger):
    rec = _Record()
    mw = ProfilingMiddleware(_inner_app, pct=1.0, report=False, sink=rec,
                             observers=[rec], linger=linger, max_open=6,
                             blocking_ms=None)
    running = []
    for index, (kinds, end) in enumerate(plan):
        t = threading.Thread(target=_serve,
                             args=(mw, rec, index, kinds, end))
        t.start()
        running.append(t)
        while len(running) > overlap:   # threads end while others start
            running.pop(0).join(30)
    for t in running:
        t.join(30)
    assert not any(t.is_alive() for t in running)
    assert rec.failures == []
    # every sampled request delivered exactly once, and nothing else
    assert dict(rec.delivered) == {rid: 1 for rid in rec.sampled}, mw.stats
    # observers hear of every followed request's end once
    assert dict(rec.ended) == dict(rec.begun)
    assert all(n == 1 for n in rec.begun.values())
    # every slot back; the dead threads' engines gone, holding nothing
    assert mw._open == 0
    assert mw.stats["errors"] == 0
    alive = set(map(id, engine._engines.values()))
    for eng in rec.engines:
        assert id(eng) not in alive
        assert eng.abandoned
        assert not eng.requests and not eng.profile_requests and \
            not eng.pending and not eng.lingering
