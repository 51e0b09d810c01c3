"""Property-based test of the request lifecycle (issue 14): random
sequences of app behaviour (raising at each point, bodies never closed,
killed greenlets, long streams, nested middlewares, concurrent requests,
the trigger header) through a real gevent.pywsgi server, checking after
each sequence that

* every sampled request is delivered exactly once (and nothing else is),
* the open-profile slots are back to zero,
* no greenlet of one request appears in another request's profile,
* a profile's CPU time is never above its wall time,
* only a stream longer than max_lifetime is delivered truncated.

Bounded: hypothesis' settings keep the run well under a minute."""
import time

import gevent
import pytest
from gevent import pywsgi

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from greqprof import ProfilingMiddleware  # noqa: E402
from test_middleware import (http, reset_greqprof, wait_for,  # noqa: E402
                             current_gid)

pytestmark = pytest.mark.timeout(300)

SECRET = "s3cr3t-Tr1gger-value"
BEHAVIOURS = ("ok", "raise_call", "raise_iter", "raise_close", "no_close",
              "kill_child", "stream", "long_stream", "spawn", "nested")


class AppError(Exception):
    pass


def make_app(gids):
    """The app: what it does is named by the path (/<behaviour>/<n>);
    every greenlet of a request records its tracer id under the request's
    X-Request-ID."""
    def note():
        return current_gid()

    def child(rid, seconds):
        gids.setdefault(rid, set()).add(note())
        gevent.sleep(seconds)

    def app(environ, start_response):
        rid = environ.get("HTTP_X_REQUEST_ID")
        gids.setdefault(rid, set()).add(note())
        what = environ["PATH_INFO"].split("/")[1]
        if what == "raise_call":
            raise AppError("at call")
        if what == "kill_child":
            g = gevent.spawn(child, rid, 5)
            gevent.sleep(0)
            g.kill()
        if what == "spawn":
            gevent.spawn(child, rid, 0)
            gevent.spawn(child, rid, 0.02).join()
        start_response("200 OK", [("Content-Type", "text/plain")])
        if what == "raise_iter":
            def gen():
                yield b"a"
                raise AppError("while iterating")
            return gen()
        if what == "raise_close":
            class Body:
                def __iter__(self):
                    return iter([b"ok"])

                def close(self):
                    raise AppError("at close")
            return Body()
        if what in ("stream", "long_stream"):
            pause = 0.01 if what == "stream" else 0.2

            def gen():
                for _ in range(4):
                    gevent.sleep(pause)
                    yield b"chunk"
            return gen()
        return [b"ok"]
    return app


class Router:
    """Outside the middleware: bodies of /no_close are dropped without
    close() (a buffering middleware)."""

    def __init__(self, mw):
        self.mw = mw

    def __call__(self, environ, start_response):
        body = self.mw(environ, start_response)
        if environ["PATH_INFO"].startswith("/no_close"):
            data = b"".join(body)
            del body
            return [data]
        return body


class Nested:
    """Inside the middleware: /nested goes through a second, inner
    ProfilingMiddleware (wrapped twice), which must defer."""

    def __init__(self, app, inner):
        self.app = app
        self.inner = inner

    def __call__(self, environ, start_response):
        if environ["PATH_INFO"].startswith("/nested"):
            return self.inner(environ, start_response)
        return self.app(environ, start_response)


request = st.tuples(st.sampled_from(BEHAVIOURS), st.booleans())
scenario = st.lists(st.lists(request, min_size=1, max_size=4),
                    min_size=1, max_size=4)


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(scenario=scenario, pct=st.sampled_from([1.0, 0.5]),
       linger=st.sampled_from([0, 0.05]), calls=st.booleans())
def test_lifecycle_invariants(scenario, pct, linger, calls):
    gids = {}
    profiles = []
    inner_profiles = []
    app = make_app(gids)
    inner = ProfilingMiddleware(app, pct=1.0, sink=inner_profiles.append,
                                report=False, blocking_ms=None)
    mw = ProfilingMiddleware(
        Nested(app, inner), pct=pct, seed=7, sink=profiles.append,
        report=False, linger=linger, calls=calls, max_open=3,
        max_lifetime=0.6, blocking_ms=None,
        trigger_header="X-Greqprof-Trigger", trigger_secret=SECRET)
    server = pywsgi.WSGIServer(("127.0.0.1", 0), Router(mw), log=None)
    server.start()
    sent = []
    try:
        n = 0
        for group in scenario:
            jobs = []
            for what, trigger in group:
                n += 1
                rid = "r%d" % n
                headers = [("X-Request-ID", rid)]
                if trigger:
                    headers.append(("X-Greqprof-Trigger", SECRET))
                sent.append(rid)
                jobs.append(gevent.spawn(http, server.server_port,
                                         "/%s/%d" % (what, n),
                                         headers=headers))
            gevent.joinall(jobs, timeout=10, raise_error=True)
        # every slot comes back (linger, max_lifetime, collected bodies)
        wait_for(lambda: mw._open == 0, timeout=5, what="slots back")
        wait_for(lambda: len(profiles) == mw.stats["sampled"], timeout=5,
                 what="every sampled request delivered")
        gevent.sleep(0.1)
        rids = [p.request_id for p in profiles]
        # delivered exactly once, and only requests that were sent
        assert len(rids) == len(set(rids)), rids
        assert set(rids) <= set(sent)
        assert len(profiles) == mw.stats["sampled"]
        assert mw.stats["requests"] == len(sent)
        assert inner_profiles == []
        for p in profiles:
            # no greenlet of another request in this one's profile
            mine = gids.get(p.request_id, set())
            others = set().union(*[g for r, g in gids.items()
                                   if r != p.request_id] or [set()])
            spans = {s.greenlet_id for s in p.spans}
            assert not (spans & others - mine), (p.request_id, spans,
                                                  mine)
            assert p.cpu is None or p.cpu <= p.wall + 2e-4, p
            # only a stream longer than max_lifetime is cut short (a body
            # dropped without close() ends its request at once)
            assert not p.truncated or p.path.startswith("/long_stream"), p
        assert mw._open == 0
    finally:
        server.stop(timeout=1)
        reset_greqprof([mw, inner])
