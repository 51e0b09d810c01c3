"""Probe D: a BaseException in a logging handler during _drain_blocking
drops every other record drained in the same pass (they were already taken
out of _registry.long_spans): never logged, never counted, not in the
request's profile, even after the exception went on."""
import logging

import gevent
import greenlet

from test_middleware import serve, wait_for, burn, LOGGER  # noqa: F401
from greqprof import _registry


class OnceKilled(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.seen = []

    def emit(self, record):
        # (burn()'s spans only: on a loaded machine other code, /warm
        # among it, can hold the loop past blocking_ms too)
        if record.levelno != logging.WARNING or \
                "burn (" not in record.getMessage():
            return
        self.seen.append(record.getMessage().split("\n")[0])
        if len(self.seen) == 1:
            raise greenlet.GreenletExit()   # killed while writing


def test_drain_drops_the_rest(serve):
    def other():
        burn(0.05)            # a blocking span outside any request

    def app(environ, start_response):
        if environ["PATH_INFO"] == "/b":
            g = gevent.spawn(other)
            gevent.sleep(0)   # other blocks: record 1
            burn(0.05)        # then the request: record 2
            gevent.sleep(0)
            g.join()
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    h = OnceKilled()
    log = logging.getLogger(LOGGER)
    log.addHandler(h)
    try:
        # (blocking_interval=0: both spans are burn()'s, one site)
        s = serve(app, pct=1.0, blocking_ms=20, linger=0.1, report=False,
                  blocking_interval=0)
        assert s.get("/warm").status == 200
        s.wait_profiles(1)
        try:
            s.get("/b")
        except Exception:
            pass
        gevent.sleep(1.5)   # the drain loop runs once a second
        p = [p for p in s.profiles if p.path == "/b"]
        print("warnings logged:", h.seen)
        print("stats", s.mw.stats, "profile blocking",
              [b.wall for b in p[0].blocking] if p else None,
              "left in long_spans", len(_registry.long_spans))
        assert len(h.seen) >= 2, "the other blocking span was dropped"
    finally:
        log.removeHandler(h)
