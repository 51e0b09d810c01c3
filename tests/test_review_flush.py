"""Probe B: flush() (a) misses a lingering request whose greenlet began its
next keep-alive request (it left engine.lingering but is still pending),
(b) finalizes another middleware's request as its own (wrong sink, the
owner's _open never released)."""
import gevent
from gevent import pywsgi

from test_middleware import (keepalive_gets, serve, wait_for,  # noqa
                             reset_greqprof)
from greqprof import ProfilingMiddleware, engine


def _app(environ, start_response):
    if environ["PATH_INFO"].endswith("/first"):
        gevent.spawn(gevent.sleep, 1.5)   # keeps it lingering
        gevent.sleep(0)
    start_response("200 OK", [("Content-Type", "text/plain"),
                              ("Content-Length", "2")])
    return [b"ok"]


def test_flush_misses_keepalive_pending(serve):
    seq = [0.0, 0.0, 0.9]                     # /warm sampled, /first sampled, /second not

    def rng():
        return seq.pop(0) if seq else 0.9

    s = serve(_app, pct=0.5, rng=rng, linger=5.0, report=False,
              blocking_ms=200)
    sock = keepalive_gets(s.port, ("/warm", "/first", "/second"))
    wait_for(lambda: [p for p in s.profiles if p.path == "/warm"])
    eng = engine.current_engine()
    print("lingering", eng.lingering, "pending", eng.pending)
    n = s.mw.flush()
    got = [p.path for p in s.profiles]
    print("flush() ->", n, "delivered", got, "_open", s.mw._open)
    sock.close()
    assert n == 1 and "/first" in got, \
        "flush() did not deliver /first, which was still pending"


def test_flush_uses_the_wrong_middleware():
    sink1, sink2 = [], []
    mw1 = ProfilingMiddleware(_app, pct=1.0, linger=5.0, sink=sink1.append,
                              report=False, blocking_ms=None)
    mw2 = ProfilingMiddleware(_app, pct=1.0, linger=5.0, sink=sink2.append,
                              report=False, blocking_ms=None)

    def dispatch(environ, start_response):
        if environ["PATH_INFO"].startswith("/two"):
            return mw2(environ, start_response)
        return mw1(environ, start_response)

    server = pywsgi.WSGIServer(("127.0.0.1", 0), dispatch, log=None)
    server.start()
    try:
        from test_middleware import http
        assert http(server.server_port, "/one/warm").status == 200
        assert http(server.server_port, "/two/first").status == 200
        gevent.sleep(0.1)
        assert engine.current_engine() is mw1._engine is mw2._engine
        n = mw1.flush()
        gevent.sleep(0.1)
        print("mw1.flush() ->", n, "sink1", [p.path for p in sink1],
              "sink2", [p.path for p in sink2],
              "mw1._open", mw1._open, "mw2._open", mw2._open)
        assert [p.path for p in sink2] == ["/two/first"], \
            "mw2's profile went to mw1's sink"
        assert mw2._open == 0, "mw2's open count was never released"
    finally:
        server.stop(timeout=2)
        reset_greqprof([mw1, mw2])
