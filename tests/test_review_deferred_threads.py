"""Probe G: RequestProfile's deferred fields are built by the first
__getattr__, which pops "_loader" before running it.  A second thread that
reads a deferred field meanwhile (a sink that hands the profile to an
exporter thread, while the middleware's own outputs read it too) finds
neither the field nor the loader: AttributeError."""
import sys
import threading

import gevent

from test_middleware import serve  # noqa: F401


import pytest


@pytest.mark.parametrize('interval', [None, 1e-6])
def test_two_threads_read_a_deferred_profile(serve, interval):
    def app(environ, start_response):
        for _ in range(3000):
            gevent.sleep(0)          # many spans
        start_response("200 OK", [])
        return [b"ok"]

    got = []
    s = serve(app, pct=1.0, blocking_ms=None, linger=0, report=False,
              max_spans=5000)
    assert s.get("/").status == 200
    s.wait_profiles(1)
    # more fresh deferred profiles of the same request, via _build_profile
    # is not needed: rebuild the deferred state from the delivered one
    p0 = s.profiles[0]
    loader = p0.__dict__.get("_loader")
    assert loader is not None, "already built"
    errors = []
    old = sys.getswitchinterval()
    sys.setswitchinterval(interval or old)
    try:
        for attempt in range(30):
            p = type(p0).__new__(type(p0))
            d = {k: v for k, v in p0.__dict__.items()}
            p.__dict__.update(d)
            barrier = threading.Barrier(2)

            def reader():
                barrier.wait()
                try:
                    len(p.spans)
                except AttributeError as e:
                    errors.append(repr(e))

            ts = [threading.Thread(target=reader) for _ in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
    finally:
        sys.setswitchinterval(old)
    print("interval", interval, "attempts 30, AttributeErrors:", len(errors), errors[:1])
    assert not errors
