"""The C path of ProfilingMiddleware (greqprof/_fastpath.c): unsampled
requests run the app with no greqprof frame under it, and are noted in a
bounded ring (RequestNotes) so a blocking report can still name them.

Served through a real gevent.pywsgi server, as in test_middleware.py."""
import logging
import os
import sys

import gevent
import pytest

from greqprof import ProfilingMiddleware, _registry
from test_middleware import (LOGGER, _blocking_warnings, current_gid,
                             echo_path, ok, wait_for)
from test_middleware import serve  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(60)

OWN_DIR = os.path.dirname(os.path.abspath(_registry.__file__)) + os.sep


def greqprof_frames():
    """Files of greqprof's frames on the calling greenlet's stack."""
    out, f = [], sys._getframe(1)
    while f is not None:
        if f.f_code.co_filename.startswith(OWN_DIR):
            out.append(f.f_code.co_name)
        f = f.f_back
    return out


@pytest.mark.parametrize("blocking_ms", [100, None])
def test_unsampled_requests_run_with_no_greqprof_frame(serve, blocking_ms):
    frames = []

    def app(environ, start_response):
        frames.append(greqprof_frames())
        return ok()(environ, start_response)

    s = serve(app, pct=0.0, blocking_ms=blocking_ms)
    for _ in range(4):
        assert s.get("/x").status == 200
    assert len(frames) == 4
    if blocking_ms:
        # The first request of a thread sets up its engine in Python.
        assert frames[0], "the first request should take the Python path"
    assert frames[1:] == [[]] * 3, frames
    assert s.mw.stats["requests"] == 4
    assert s.mw.stats["sampled"] == 0


def test_sampled_requests_still_get_a_profile_after_the_c_path_is_armed(
        serve):
    draws = iter([0.9, 0.9, 0.1, 0.9])
    s = serve(echo_path, pct=0.5, rng=lambda: next(draws))
    for i in range(4):
        assert s.get("/r%d" % i).status == 200
    wait_for(lambda: len(s.profiles) == 1, what="one profile")
    assert [p.path for p in s.profiles] == ["/r2"]
    assert s.mw.stats["requests"] == 4 and s.mw.stats["sampled"] == 1


def test_a_raising_rng_never_breaks_the_request(serve, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)

    def rng():
        raise ValueError("broken rng")

    s = serve(echo_path, pct=0.5, rng=rng)
    for i in range(3):
        r = s.get("/r%d" % i)
        assert r.status == 200 and r.body == b"/r%d" % i
    assert s.mw.stats["errors"] == 3
    errors = [r.getMessage() for r in caplog.records
              if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "broken rng" in errors[0]
    assert s.profiles == []


def test_blocking_in_a_c_path_request_is_named(serve, caplog):
    import time
    caplog.set_level(logging.INFO, logger=LOGGER)
    gid = []

    def app(environ, start_response):
        if environ["PATH_INFO"] == "/slow":
            gid.append(current_gid())
            assert greqprof_frames() == []  # the C path ran this one
            time.sleep(0.15)
        return echo_path(environ, start_response)

    s = serve(app, pct=0.0, blocking_ms=100)
    assert s.get("/warm-up").status == 200
    assert s.get("/slow?q=1", headers=[("X-Request-ID", "abc-1")]).status \
        == 200
    w = wait_for(lambda: _blocking_warnings(caplog, "greenlet %d " % gid[0]),
                 what="the blocking WARNING")
    assert "during GET /slow" in w[0]
    assert "abc-1" in w[0]


def test_app_can_be_replaced():
    mw = ProfilingMiddleware(ok(b"one"), pct=0.0, blocking_ms=None)
    mw.app = ok(b"two")
    out = []
    gevent.spawn(lambda: out.append(mw({"PATH_INFO": "/"},
                                       lambda *a: None))).join()
    assert out == [[b"two"]]
    with pytest.raises(AttributeError):
        del mw.app


def test_not_a_wsgi_call_is_a_type_error():
    mw = ProfilingMiddleware(ok(), pct=0.0, blocking_ms=None)
    with pytest.raises(TypeError):
        mw({})
    with pytest.raises(TypeError):
        mw({}, None, extra=1)


def test_disabled_middleware_is_a_pass_through(monkeypatch):
    monkeypatch.setenv("GREQPROF_ENABLED", "0")
    calls = []

    def app(environ, start_response):
        calls.append(greqprof_frames())
        return [b"x"]
    mw = ProfilingMiddleware(app, pct=1.0)
    assert mw({"PATH_INFO": "/"}, None) == [b"x"]
    assert calls == [[]]
    assert mw.stats["requests"] == 0


# -- RequestNotes ---------------------------------------------------------

def test_notes_find_the_latest_request_begun_by_then():
    from greqprof._lowlevel import wall_ns
    notes = _registry.RequestNotes()
    assert notes.find(7, wall_ns()) is None
    notes.add(7, "GET", "/first", None)
    mid = wall_ns()
    notes.add(8, "POST", "/other", "rid-8")
    notes.add(7, "PUT", "/second", "rid-7")
    now = wall_ns()
    assert notes.find(7, now) == ("PUT", "/second", "rid-7")
    assert notes.find(7, mid) == ("GET", "/first", None)
    assert notes.find(8, now) == ("POST", "/other", "rid-8")
    assert notes.find(9, now) is None
    assert notes.find(7, mid - 10**9) is None  # nothing begun that early


def test_notes_keep_only_strings_cut_to_size():
    from greqprof._lowlevel import wall_ns
    notes = _registry.RequestNotes()
    notes.add(1, b"GET", 12, object())
    assert notes.find(1, wall_ns()) == (None, None, None)
    notes.add(2, "M" * 100, "/" + "p" * 5000, "r" * 1000)
    method, path, rid = notes.find(2, wall_ns())
    assert (len(method), len(path), len(rid)) == (32, 2048, 200)


def test_notes_are_a_bounded_ring():
    from greqprof._lowlevel import wall_ns
    notes = _registry.RequestNotes()
    notes.add(1, "GET", "/oldest", None)
    for i in range(4096):
        notes.add(2 + i, "GET", "/n", None)
    assert notes.find(1, wall_ns()) is None  # overwritten
    assert notes.find(2 + 4095, wall_ns()) == ("GET", "/n", None)
    with pytest.raises(TypeError):
        notes.add(1, "GET")
    with pytest.raises(OverflowError):
        notes.add(-1, "GET", "/", None)
