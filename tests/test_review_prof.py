"""Issue 22, items 4, 5, 9 and 10: configuration per middleware, which
thread may touch which tracer, a Profiler across fork, and hooks installed
by other tools after greqprof's.  Real gevent.pywsgi servers over real
sockets, real OS threads, gevent's real monitor thread, a real cProfile.

Times are never asserted as durations: what is checked is which clock a
function was timed with (a function that only waits 0.2 s in gevent.sleep
has at least 0.2 s of wall time and next to no CPU time)."""
import json
import subprocess
import sys
import textwrap
import threading

import gevent
import pytest
from gevent import pywsgi

import greqprof
from conftest import CHILD_CWD, child_env
from test_middleware import (  # noqa: F401  (serve is a fixture)
    DEADLINE, func_named, http, make_function, reset_greqprof, serve,
    wait_for)

pytestmark = pytest.mark.timeout(90)

#: seconds a "waiting" function sleeps in gevent.sleep (wall, no CPU)
WAIT = 0.2


def run_script(code, timeout=60, env=None):
    """Runs code in a fresh interpreter; the JSON object on its last
    stdout line starting with '{'."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=timeout,
                          env=child_env(**(env or {})), cwd=CHILD_CWD)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, (
        "exit %d\nstdout:\n%s\nstderr:\n%s"
        % (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:]))
    return json.loads(lines[-1])


# ---------------------------------------------------------------------------
# item 4: two middlewares in one thread, each with its own clock

@pytest.mark.parametrize("first", ["cpu", "wall"])
def test_two_middlewares_in_one_thread_each_use_their_own_clock(serve,
                                                                first):
    """Two middlewares served by one thread (one engine, one tracer): the
    function that only waits is timed with each middleware's own clock,
    whichever middleware served the thread's first request.  Before, both
    used the first one's clock: clock="cpu" reported the whole wait."""
    def app(environ, start_response):
        waits_and_sleeps()
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    def waits_and_sleeps():
        gevent.sleep(WAIT)

    served = {c: serve(app, pct=1.0, linger=0, calls=True, clock=c)
              for c in ("cpu", "wall")}
    order = [first] + [c for c in ("cpu", "wall") if c != first]
    for c in order:
        assert served[c].get("/" + c).status == 200
    for c in order:
        p = served[c].profile_for("/" + c)
        assert p.clock == c
        f = [x for x in p.calls if x.name == "waits_and_sleeps"]
        assert len(f) == 1, p.calls
        if c == "wall":
            assert f[0].ttot >= WAIT * 0.95, (c, f[0].ttot)
        else:
            assert f[0].ttot < WAIT / 2, (c, f[0].ttot)


def test_a_profiler_beside_a_middleware_keeps_its_own_clock(serve):
    """A Profiler(clock="wall") started in a thread whose engine a
    clock="cpu" middleware made records the thread through that engine's
    tracer, yet times calls with its own clock (and the request's profile
    keeps the middleware's)."""
    def app(environ, start_response):
        waits_and_sleeps()
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    def waits_and_sleeps():
        gevent.sleep(WAIT)

    s = serve(app, pct=1.0, linger=0, calls=True, clock="cpu")
    assert s.get("/warm").status == 200
    prof = greqprof.Profiler(clock="wall").start()
    try:
        assert s.get("/x").status == 200
    finally:
        prof.stop()
    mine = [f for f in prof.func_stats() if f.name == "waits_and_sleeps"]
    assert len(mine) == 1 and mine[0].ttot >= WAIT * 0.95, mine
    req = [f for f in s.profile_for("/x").calls
           if f.name == "waits_and_sleeps"]
    assert len(req) == 1 and req[0].ttot < WAIT / 2, req
