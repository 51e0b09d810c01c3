"""The C path of ProfilingMiddleware (greqprof/_fastpath.c): unsampled
requests run the app with no greqprof frame under it, and are noted in a
bounded ring (RequestNotes) so a blocking report can still name them.

Served through a real gevent.pywsgi server, as in test_middleware.py."""
import logging
import os
import sys
import time

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


def test_a_lingering_profile_stops_taking_its_greenlets_spawns_on_the_c_path(
        serve):
    """The next request of a greenlet whose sampled request still lingers
    runs on the C path, and what it spawns is not the lingering
    request's."""
    frames = {}
    kids = {}
    draws = iter([0.9, 0.1, 0.9, 0.9])

    def kid(path):
        from test_middleware import current_gid
        kids[path] = current_gid()
        gevent.sleep(0.5 if path == "/sampled" else 0)

    def app(environ, start_response):
        path = environ["PATH_INFO"]
        gevent.spawn(kid, path)   # keeps a sampled profile lingering
        gevent.sleep(0)
        frames[path] = greqprof_frames()
        return ok()(environ, start_response)

    from test_middleware import _two_pipelined, http_raw
    s = serve(app, pct=0.5, rng=lambda: next(draws), linger=2.0)
    assert s.get("/warm-up").status == 200
    raw = http_raw(s.port, _two_pipelined(b"/sampled", b"/next"))
    assert raw.count(b"HTTP/1.1 200 OK") == 2
    assert frames["/next"] == [], "the C path should run it"
    p = s.profile_for("/sampled", timeout=5)
    gids = {sp.greenlet_id for sp in p.spans}
    assert kids["/sampled"] in gids and kids["/next"] not in gids
    assert s.mw.stats["sampled"] == 1


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


# -- request notes --------------------------------------------------------

@pytest.fixture(autouse=True)
def _own_engine():
    from greqprof import engine
    engine.shutdown()
    yield
    engine.shutdown()


def _hooks():
    """This thread's hooks (installed now, in the calling greenlet)."""
    from greqprof import engine
    eng = engine.engine_for_thread(ProfilingMiddleware(
        ok(), pct=0.0, blocking_ms=100).config)
    return eng.tracer.hooks_addr


def _gid(g=None):
    from greqprof import engine
    return engine.current_engine().tracer.greenlet_id(g or gevent.getcurrent())


def test_a_note_is_the_greenlets_latest_request():
    out = []

    def other():
        gevent.sleep(0.01)

    def run():
        h = _hooks()
        me = gevent.getcurrent()
        note, find = _registry.note, _registry.request_note
        out.append(find(h, me)[0])
        note(h, _gid(), "GET", "/first", None)
        out.append(find(h, me)[0])
        note(h, _gid(), "PUT", "/second", "rid-7")
        out.append(find(h, me)[0])
        o = gevent.spawn(other)
        gevent.sleep(0)
        note(h, _gid(o), "POST", "/other", "rid-8")
        out.append(find(h, me)[0])
        o.join()
    gevent.spawn(run).join()
    assert out == [None, ("GET", "/first", None, None, None),
                   ("PUT", "/second", "rid-7", None, None),
                   ("PUT", "/second", "rid-7", None, None)]


def test_notes_keep_only_strings_cut_to_size():
    out = []

    def run():
        h = _hooks()
        _registry.note(h, _gid(), b"GET", 12, object())
        out.append(_registry.request_note(h, gevent.getcurrent())[0])
        _registry.note(h, _gid(), "M" * 100, "/" + "p" * 5000, "r" * 1000)
        out.append(_registry.request_note(h, gevent.getcurrent())[0])
    gevent.spawn(run).join()
    assert out[0] == (None, None, None, None, None)
    assert [len(x) for x in out[1][:3]] == [32, 2048, 200]


def test_a_spawned_greenlet_takes_its_spawners_note():
    out = []

    def grandchild():
        gevent.sleep(0.01)

    def child():
        gevent.spawn(grandchild).join()

    def run():
        h = _hooks()
        _registry.note(h, _gid(), "GET", "/parent", None)
        kid = gevent.spawn(child)
        gevent.sleep(0.001)  # both have run: the tracer knows them
        out.append(_registry.request_note(h, kid))
        out.append((_gid(), _gid(kid)))
        kid.join()
    gevent.spawn(run).join()
    (note, chain), (me, kid) = out
    assert note == ("GET", "/parent", None, None, None)
    assert chain == (kid, me)


def test_a_dead_greenlets_note_goes():
    path = "".join(["/gone-", str(id(object()))])  # a str of its own
    refs = []

    def served():
        refs.append(sys.getrefcount(path))
        _registry.note(_hooks_addr(), _gid(), "GET", path, None)
        refs.append(sys.getrefcount(path))

    def run():
        h = _hooks()
        g = gevent.spawn(served)
        g.join()
        refs.append(sys.getrefcount(path))
        refs.append(_registry.request_note(h, g))
    gevent.spawn(run).join()
    before, noted, after, found = refs
    assert noted == before + 1  # the note holds the path ...
    assert after == before      # ... until its greenlet dies
    assert found == (None, ())  # (a dead greenlet has no id any more)


def _hooks_addr():
    from greqprof import engine
    return engine.current_engine().tracer.hooks_addr


def test_note_arguments_are_checked():
    with pytest.raises(TypeError):
        _registry.note(1, 2)
    with pytest.raises(ValueError):
        _registry.request_note(0, gevent.getcurrent())


def test_a_blocking_report_keeps_its_greenlets_name_after_many_deaths(
        serve, caplog):
    # The registry forgets dead greenlets' names soon (memory held across
    # requests slows every request); the blocking record carries its own.
    caplog.set_level(logging.INFO, logger=LOGGER)

    def blocker():
        time.sleep(0.15)

    def app(environ, start_response):
        g = gevent.Greenlet(blocker)
        g.name = "named-blocker"
        g.start()
        g.join()
        gevent.joinall([gevent.spawn(int) for _ in range(600)])
        return ok()(environ, start_response)

    s = serve(app, pct=0.0, blocking_ms=100)
    assert s.get("/warm-up-and-block").status == 200
    w = wait_for(lambda: _blocking_warnings(caplog, "named-blocker"),
                 what="the blocking WARNING naming the greenlet")
    assert "blocker" in w[0] and "during GET /warm-up-and-block" in w[0]


def test_enabled_can_be_switched_at_run_time():
    seen = []

    def app(environ, start_response):
        seen.append(greqprof_frames())
        return [b"x"]
    mw = ProfilingMiddleware(app, pct=1.0, blocking_ms=None)
    assert mw.enabled is True
    mw.enabled = False
    gevent.spawn(mw, {"PATH_INFO": "/"}, None).join()
    assert seen == [[]] and mw.stats["requests"] == 0
    with pytest.raises(AttributeError):
        del mw.enabled
