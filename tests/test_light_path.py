"""The unsampled request's light path (_fastpath.c light_ok): while one
middleware lives and no sampled profile is open in the thread, the C path
leaves the environ unmarked and counts stats['requests'] in C, folded in
when stats is read; what the mark did (a request counted by its route
once, a nested middleware deferring) still holds.  Real gevent.pywsgi
servers, as in test_middleware.py."""
import gc
import logging
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

import pytest

from conftest import CHILD_CWD, child_env
from greqprof import ProfilingMiddleware, _registry
from greqprof.middleware import MARK_KEY
from test_middleware import LOGGER, _blocking_warnings, ok, wait_for
from test_middleware import serve  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(120)

_CHILD = "GQP_TEST_LIGHT_CHILD"


@pytest.fixture(scope="module")
def child_outcomes():
    """The light path runs only while one middleware lives: when earlier
    tests of this process left some alive, this file runs once in a fresh
    interpreter instead, and each test here checks its outcome there
    (None: run here)."""
    gc.collect()
    if os.environ.get(_CHILD) or _registry.live_middlewares() == 0:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "light.xml")
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             "--junitxml", report, os.path.abspath(__file__)],
            cwd=CHILD_CWD, env=child_env(**{_CHILD: "1"}),
            capture_output=True, text=True, timeout=110)
        assert os.path.exists(report), run.stdout + run.stderr
        outcomes = {}
        for case in ET.parse(report).iter("testcase"):
            bad = case.find("failure")
            if bad is None:
                bad = case.find("error")
            if bad is None:
                bad = case.find("skipped")
            outcomes[case.get("name")] = None if bad is None else \
                (bad.get("message") or "") + (bad.text or "")
        return outcomes


@pytest.fixture
def alone(request, child_outcomes):
    """True: run the test here (no other middleware alive); False: it ran
    in the fresh interpreter, and passed there."""
    if child_outcomes is None:
        gc.collect()
        assert _registry.live_middlewares() == 0, \
            "a middleware of an earlier test is still alive"
        return True
    name = request.node.name
    assert name in child_outcomes, sorted(child_outcomes)
    assert child_outcomes[name] is None, child_outcomes[name]
    return False


def _route_total(mw):
    return sum(r["requests"] for r in mw.routes())


def test_one_middleware_leaves_unsampled_environs_unmarked(serve, alone):
    if not alone:
        return
    marked = []

    def app(environ, start_response):
        marked.append(MARK_KEY in environ)
        return ok()(environ, start_response)

    s = serve(app, pct=0.0, blocking_ms=100)
    for _ in range(5):
        assert s.get("/x").status == 200
    assert _registry.live_middlewares() == 1
    # (the first request sets the thread's engine up in Python: marked)
    assert marked[1:] == [False] * 4, marked
    assert _route_total(s.mw) == 5


def test_stats_requests_counted_in_c_read_right(serve, alone):
    if not alone:
        return
    s = serve(ok(), pct=0.0, blocking_ms=100)
    stats = s.mw.stats
    for i in range(1, 6):
        assert s.get("/x").status == 200
        assert s.mw.stats["requests"] == i
    # (the same dict, updated when read through the middleware)
    assert s.mw.stats is stats and stats["requests"] == 5
    s.mw.stats["requests"] += 10   # (Python adds to it as before)
    assert s.get("/x").status == 200
    assert s.mw.stats["requests"] == 16
    # a new dict replaces it; what was counted before stays in the old one
    s.mw.stats = dict(stats, requests=0)
    assert stats["requests"] == 16
    assert s.get("/x").status == 200
    assert s.mw.stats["requests"] == 1 and stats["requests"] == 16


def test_sampled_requests_are_still_marked_on_the_light_path(serve, alone):
    if not alone:
        return
    marked = []

    def app(environ, start_response):
        marked.append(environ.get(MARK_KEY))
        return ok()(environ, start_response)

    draws = iter([0.9, 0.9, 0.1, 0.9])
    s = serve(app, pct=0.5, rng=lambda: next(draws), blocking_ms=100)
    for _ in range(4):
        assert s.get("/x").status == 200
    assert marked[1] is None and marked[3] is None, marked
    assert marked[2] is s.mw, marked   # (sampled: a forward finds it)
    assert s.mw.stats["requests"] == 4
    s.wait_profiles(1)


def test_an_unsampled_forward_to_its_middleware_counts_its_route_once(
        serve, alone):
    """The app forwards its request to the middleware again with the same
    environ (as the environ mark told before): counted by its route once,
    and both calls noted as before."""
    if not alone:
        return

    def app(environ, start_response):
        if environ["PATH_INFO"] == "/outer":
            environ["PATH_INFO"] = "/inner"
            return served["mw"](environ, start_response)
        return ok()(environ, start_response)

    served = {}
    s = serve(app, pct=0.0, blocking_ms=100)
    served["mw"] = s.mw
    assert s.get("/warm").status == 200
    for _ in range(3):
        assert s.get("/outer").status == 200
    assert _route_total(s.mw) == 4, s.mw.routes()
    # (a forward counts the request twice, as it did with the mark)
    assert s.mw.stats["requests"] == 7


def test_a_nested_middleware_still_defers_to_the_outer_one(serve, caplog,
                                                          alone):
    if not alone:
        return
    caplog.set_level(logging.WARNING, logger=LOGGER)
    inner = ProfilingMiddleware(ok(), pct=0.0, blocking_ms=100,
                                report=False)
    s = serve(inner, pct=0.0, blocking_ms=100)
    for _ in range(3):
        assert s.get("/x").status == 200
    assert _registry.live_middlewares() == 2
    assert s.mw.stats["requests"] == 3 and inner.stats["requests"] == 0
    assert _route_total(s.mw) == 3 and _route_total(inner) == 0
    wait_for(lambda: _blocking_warnings(caplog, "wrapped in another"),
             what="the inner middleware's warning")


def test_a_blocking_warning_names_a_light_request(serve, caplog, alone):
    """The note is kept uncleaned and cleaned when a report reads it."""
    if not alone:
        return
    caplog.set_level(logging.INFO, logger=LOGGER)

    def app(environ, start_response):
        if environ["PATH_INFO"].startswith("/block"):
            time.sleep(0.25)   # (not monkey-patched: holds the loop)
        return ok()(environ, start_response)

    s = serve(app, pct=0.0, blocking_ms=100)
    assert s.get("/warm").status == 200
    assert s.get("/block%E9\x01me").status == 200
    wait_for(lambda: _blocking_warnings(caplog, "GET /block"),
             what="the blocking warning naming the request")
    (msg,) = _blocking_warnings(caplog, "GET /block")
    assert "\x01" not in msg and "/block\xe9\\x01me" in msg, msg
