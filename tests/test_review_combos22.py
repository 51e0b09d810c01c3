"""Issue 22 review: combinations of its fixes that the per-item tests do
not reach.

Every server is a real gevent.pywsgi server in a real OS thread with its
own hub; clients talk to it over real sockets.
"""
import gc
import threading
import weakref

import gevent
import pytest
from gevent import pywsgi, socket

from greqprof import ProfilingMiddleware, engine

pytestmark = pytest.mark.timeout(60)


def _get(port, path):
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    try:
        sock.sendall(("GET %s HTTP/1.1\r\nHost: t\r\nConnection: close"
                      "\r\n\r\n" % path).encode())
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data.split(b"\r\n", 1)[0]
    finally:
        sock.close()


def _app(environ, start_response):
    if environ["PATH_INFO"] == "/linger":
        gevent.spawn(gevent.sleep, 30)   # queued for the finisher at the end
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


@pytest.mark.parametrize("case", ["blocking", "no-blocking", "lingering",
                                  "hub-destroyed", "unsampled"])
def test_engines_of_ended_threads_are_freed(case):
    """Threads with their own hubs serve one middleware, one after the
    other, and end: the engine of each (its tracer, its requests) is freed
    once the thread is gone, not kept for the life of the process by
    greqprof's background greenlets (finisher, reaper, blocking drain),
    which stay suspended forever in the dead thread's hub.  (Before: every
    engine stayed, about 50 KB a thread, with or without the hub
    destroyed.)"""
    delivered = []
    mw = ProfilingMiddleware(
        _app, pct=0.0 if case == "unsampled" else 1.0, report=False,
        sink=lambda p: delivered.append(p.truncated), linger=30,
        blocking_ms=None if case == "no-blocking" else 50)
    path = "/linger" if case == "lingering" else "/"
    engines = []

    def serve():
        server = pywsgi.WSGIServer(("127.0.0.1", 0), mw, log=None)
        server.start()
        for _ in range(2):
            assert _get(server.server_port, path) == b"HTTP/1.1 200 OK"
        engines.append(weakref.ref(engine.current_engine()))
        server.stop()
        if case == "hub-destroyed":
            gevent.get_hub().destroy(destroy_loop=True)

    for _ in range(4):
        t = threading.Thread(target=serve)
        t.start()
        t.join(30)
        assert not t.is_alive()
    gc.collect()
    assert len(engines) == 4
    assert [r() for r in engines] == [None] * 4
    assert mw._open == 0
    assert len(delivered) == (0 if case == "unsampled" else 8)
