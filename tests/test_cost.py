"""What a sample costs the requests beside it (issue 20).

With ``calls=True`` the per-call hook is a thread's (PyEval_SetProfile):
it used to stay on for every greenlet of the thread while a calls-profile
was open, so each concurrent unsampled request paid the per-call tracing
of CPython.  Now the switch hook turns it on only while a greenlet of a
calls-profile runs.  ``sys.getprofile()`` shows, from inside a request,
whether the hook is on for it.  Real gevent.pywsgi servers, real sockets.
"""
import sys

import gevent
import gevent.event
import pytest

from test_middleware import SECRET, func_named, http, serve  # noqa: F401

pytestmark = pytest.mark.timeout(60)

# (3.12+ keeps the hook thread-wide: there PyEval_SetProfile turns PEP 669
# events on and off for the whole interpreter, and every code object is
# instrumented again after each change, far more than it would save.)
needs_toggle = pytest.mark.skipif(
    sys.version_info >= (3, 12),
    reason="3.12+: the call hook stays thread-wide (docs/accuracy.md)")

HEADER = "X-Greqprof-Test"


def _inner_work():
    return sum(range(10))


def _child_work():
    return _inner_work() + 1


@needs_toggle
def test_call_hook_off_for_unsampled_requests_while_a_sample_is_open(serve):
    entered = gevent.event.Event()
    release = gevent.event.Event()
    seen = {}

    def app(environ, start_response):
        path = environ["PATH_INFO"]
        if path == "/sampled":
            entered.set()
            release.wait(10)
            child = gevent.spawn(_child_work)
            seen["sampled"] = sys.getprofile()
            child.join()
        else:
            _inner_work()
            seen[path] = sys.getprofile()
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    s = serve(app, pct=0.0, calls=True, trigger_header=HEADER,
              trigger_secret=SECRET)
    sampled = gevent.spawn(http, s.port, "/sampled",
                           headers=[(HEADER, SECRET)])
    assert entered.wait(10)
    # the sample is open (and its greenlet switched out): neighbours run
    assert http(s.port, "/other").status == 200
    # a second sample while the first holds the call hook wanted: its own
    # frames from its first call on (the hook follows its attach)
    assert http(s.port, "/second", headers=[(HEADER, SECRET)]).status == 200
    release.set()
    assert sampled.get(timeout=10).status == 200
    assert http(s.port, "/after").status == 200
    assert seen["/other"] is None, "the call hook ran for an unsampled " \
                                   "request while a sample was open"
    assert seen["/after"] is None
    assert seen["sampled"] is not None
    p = s.profile_for("/sampled")
    # the child spawned by the sampled request inherited its profile and
    # was traced with it
    assert func_named(p, "_child_work").ncall == 1
    assert func_named(p, "_inner_work").ncall == 1
    second = s.profile_for("/second")
    assert func_named(second, "app").ncall == 1
    assert func_named(second, "_inner_work").ncall == 1
    assert seen["/second"] is not None
