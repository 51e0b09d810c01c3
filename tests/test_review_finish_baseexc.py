"""Probe A: a BaseException (GreenletExit / gevent.Timeout) raised while
Python's _finish drains blocking spans (a logging handler that waits) leaves
the sampled request un-queued: never finalized, _open never released,
entries left in engine.requests / profile_requests."""
import logging
import time

import gevent
import greenlet
import pytest

from test_middleware import serve, wait_for, burn, LOGGER  # noqa: F401
from greqprof import engine


class Obs:
    def on_begin(self, req):
        pass


class KillingHandler(logging.Handler):
    """Stands for a handler doing I/O while the greenlet is killed
    (server.stop) or an outer gevent.Timeout fires."""
    def __init__(self, exc):
        super().__init__(logging.WARNING)
        self.exc = exc
        self.n = 0

    def emit(self, record):
        # (only /block's: on a loaded machine the first request can hold
        # the loop past blocking_ms too, and its profile is waited for)
        if record.levelno == logging.WARNING and self.n == 0 and \
                "during GET /block" in record.getMessage():
            self.n += 1
            raise self.exc


@pytest.mark.parametrize("observers", [True, False])
@pytest.mark.parametrize("exc", [greenlet.GreenletExit(),
                                 gevent.Timeout(0.01)])
def test_finish_base_exception_leaks_request(serve, exc, observers):
    def app(environ, start_response):
        if environ["PATH_INFO"] == "/block":
            burn(0.06)         # a blocking span of 60 ms
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    h = KillingHandler(exc)
    log = logging.getLogger(LOGGER)
    log.addHandler(h)
    try:
        s = serve(app, pct=1.0, blocking_ms=20, observers=[Obs()] if observers else (),
                  linger=0.1, report=False,
                  blocking_interval=0)   # (burn()'s site: logged each time)
        assert s.get("/warm").status == 200
        s.wait_profiles(1)
        assert s.mw._open == 0
        try:
            s.get("/block")
        except Exception:
            pass
        gevent.sleep(1.0)   # > linger: the finisher had every chance
        eng = engine.current_engine()
        print("handler fired", h.n, "profiles", [p.path for p in s.profiles],
              "_open", s.mw._open, "requests", dict(eng.requests),
              "profile_requests", dict(eng.profile_requests),
              "pending", eng.pending, "lingering", eng.lingering)
        assert h.n == 1
        # expected: /block delivered (or at least released)
        assert s.mw._open == 0, "open count leaked"
        assert not eng.profile_requests, "profile_requests leaked"
    finally:
        log.removeHandler(h)
        s.mw._open = 0


class KillingObs:
    """An observer whose on_begin waits on I/O (an exporter) while the
    greenlet is killed."""
    def on_begin(self, req):
        if req.path == "/killed":
            raise greenlet.GreenletExit()


def test_begin_base_exception_leaks_request(serve):
    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    s = serve(app, pct=1.0, blocking_ms=20, observers=[KillingObs()],
              linger=0.1, report=False)
    assert s.get("/warm").status == 200
    s.wait_profiles(1)
    try:
        s.get("/killed")
    except Exception:
        pass
    gevent.sleep(1.0)
    eng = engine.current_engine()
    print("profiles", [p.path for p in s.profiles], "_open", s.mw._open,
          "requests", len(eng.requests), "profile_requests",
          len(eng.profile_requests))
    try:
        assert s.mw._open == 0, "open count leaked"
    finally:
        s.mw._open = 0
