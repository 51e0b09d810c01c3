"""Probe: _fastpath.c internal_error() calls mw._internal_error(where, exc)
(Python: logs through the app's logging handlers, which may switch
greenlets) and then PyErr_Clear()s whatever that call raised -- a
gevent.Timeout or GreenletExit delivered while the handler waited
included.  Shown with a raising rng (mw_call's "begin" path); every
internal_error() call of _sampled.c (sink, finish) goes the same way."""
import logging

import gevent
import pytest

from test_middleware import serve  # noqa: F401
from test_middleware import ok, LOGGER

pytestmark = pytest.mark.timeout(60)


class SlowHandler(logging.Handler):
    """A handler doing network I/O (gevent-patched): it may wait."""
    def emit(self, record):
        gevent.sleep(0.2)


def test_timeout_in_internal_error_logging_is_swallowed(serve):
    seen = []

    def app(environ, start_response):
        seen.append("app ran")
        return ok()(environ, start_response)

    broken = []

    def bad_rng():
        if broken:
            raise ValueError("rng broke")
        return 0.9   # not sampled

    s = serve(app, pct=0.5, rng=bad_rng)
    mw = s.mw

    def outer(environ, start_response):
        # the app's own deadline around the whole request
        try:
            with gevent.Timeout(0.05):
                return mw(environ, start_response)
        except gevent.Timeout:
            seen.append("timeout reached the caller")
            start_response("504 Gateway Timeout", [])
            return [b"timeout"]

    assert s.get("/warm-up").status == 200   # arms the C path
    assert s.get("/warm-up2").status == 200
    broken.append(1)
    seen.clear()
    s.server.application = outer
    h = SlowHandler()
    log = logging.getLogger(LOGGER)
    log.addHandler(h)
    try:
        r = s.get("/x")
    finally:
        log.removeHandler(h)
    print("status", r.status, "seen", seen, "errors", mw.stats.get("errors"))
    assert "timeout reached the caller" in seen
