"""greqprof's own work (its logging, delivery, rendering) stays out of the
function tables of the requests it profiles, while the app's functions
stay in."""
import logging
import os
import time

import pytest

from greqprof import ProfilingMiddleware

from test_middleware import serve, settle, wait_for  # noqa: F401

pytestmark = pytest.mark.timeout(60)

GREQPROF_DIR = os.path.dirname(os.path.abspath(
    __import__("greqprof").__file__)) + os.sep
LOGGING_DIR = os.path.dirname(logging.__file__) + os.sep


def app_work():
    """The app's own function, which must stay in the table."""
    end = time.thread_time() + 0.002
    while time.thread_time() < end:
        pass


def own_functions(profile):
    """Rows of the function table that are logging's or greqprof's."""
    return sorted("%s (%s)" % (f.qualname, f.filename) for f in profile.calls
                  if f.filename.startswith((LOGGING_DIR, GREQPROF_DIR)))


class _Carrier:
    """Flask's idiom: app.wsgi_app = ProfilingMiddleware(app.wsgi_app)."""

    def __init__(self, wsgi_app):
        self.wsgi_app = wsgi_app

    def __call__(self, environ, start_response):
        return self.wsgi_app(environ, start_response)


class _Formatting(logging.Handler):
    """A handler that formats what it gets, as real ones do."""

    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(self.format(record))


@pytest.fixture
def handler():
    h = _Formatting()
    log = logging.getLogger("greqprof")
    log.addHandler(h)
    old = log.level
    log.setLevel(logging.INFO)
    yield h
    log.removeHandler(h)
    log.setLevel(old)


def _app(environ, start_response):
    app_work()
    if environ["PATH_INFO"].startswith("/block"):
        time.sleep(0.15)   # (not monkey-patched: holds the loop)
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


def test_nested_middleware_warning_is_not_in_the_profile(serve, handler):
    """The inner middleware's "wrapped in another one" WARNING, logged
    during the first request, is not in the outer profile's table."""
    inner = ProfilingMiddleware(_app, pct=1.0, report=False)
    s = serve(_Carrier(inner), pct=1.0, calls=True, report=False,
              linger=0)
    assert s.get("/nested").status == 200
    p = s.profile_for("/nested")
    assert any("wrapped in another" in line for line in handler.lines)
    assert any(f.name == "app_work" for f in p.calls), \
        [f.qualname for f in p.calls]
    assert own_functions(p) == []


def test_blocking_warning_is_not_in_the_profile(serve, handler):
    """A blocking WARNING logged at the end of the request that held the
    loop (calls=True) is not in its profile's table."""
    s = serve(_app, pct=1.0, calls=True, report=False, linger=0,
              blocking_ms=100)
    assert s.get("/block").status == 200
    p = s.profile_for("/block")
    wait_for(lambda: any("Blocking span" in line for line in handler.lines),
             what="the blocking WARNING")
    assert p.blocking
    assert any(f.name == "app_work" for f in p.calls)
    assert own_functions(p) == []


def test_text_report_is_not_in_the_next_profile(serve, handler):
    """Reports logged (report=True) for one request are not in the table
    of a request served after it on the same connection greenlet."""
    s = serve(_app, pct=1.0, calls=True, linger=0)
    for i in range(3):
        assert s.get("/r%d" % i).status == 200
    for i in range(3):
        p = s.profile_for("/r%d" % i)
        assert any(f.name == "app_work" for f in p.calls)
        assert own_functions(p) == []
    wait_for(lambda: sum(">>> Begin RequestProfile" in line
                         for line in handler.lines) >= 3, what="3 reports")


def test_own_work_is_per_greenlet(serve):
    """A log handler that yields in the middle of greqprof's WARNING,
    logged in a request's greenlet: the request that runs meanwhile still
    has its calls recorded, and what the handler does once it runs again
    (formatting) is still left out of the first request's profile (the own
    work is its greenlet's, not the thread's)."""
    import gevent
    import gevent.event
    in_emit = gevent.event.Event()
    done = gevent.event.Event()

    class Yielding(logging.Handler):
        def emit(self, record):
            if "wrapped in another" in record.getMessage():
                in_emit.set()
                done.wait(5)             # switches out in own work
                self.format(record)      # and goes on with it

    def app(environ, start_response):
        if environ["PATH_INFO"] == "/second":
            app_work()          # runs while /first's WARNING is logged
            done.set()
        else:
            app_work()
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    h = Yielding()
    log = logging.getLogger("greqprof.inner")
    log.addHandler(h)
    try:
        inner = ProfilingMiddleware(app, pct=1.0, report=False,
                                    logger="greqprof.inner")
        s = serve(_Carrier(inner), pct=1.0, calls=True, report=False,
                  linger=0)
        first = gevent.spawn(s.get, "/first")   # (logs the WARNING)
        assert in_emit.wait(5)
        assert s.get("/second").status == 200
        assert first.get(timeout=10).status == 200
        assert in_emit.is_set() and done.is_set()
        for path in ("/first", "/second"):
            p = s.profile_for(path)
            assert any(f.name == "app_work" for f in p.calls), path
            assert own_functions(p) == [], path
    finally:
        log.removeHandler(h)
