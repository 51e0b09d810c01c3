"""Probe C: with blocking_ms=None, an unsampled request does not end the
lingering of its greenlet's previous sampled request: greenlets spawned by
the unsampled request (same keep-alive connection) are put in the previous
request's profile."""
import gevent

from test_middleware import (keepalive_gets, serve, wait_for,  # noqa
                             burn)

KIDS = {}


def _app(environ, start_response):
    path = environ["PATH_INFO"]
    if path == "/first":
        gevent.spawn(gevent.sleep, 0.5)   # keeps it lingering
        gevent.sleep(0)
    if path == "/second":
        def kid():
            burn(0.03)
        g = gevent.spawn(kid)
        KIDS["second"] = g
        g.join()
    start_response("200 OK", [("Content-Type", "text/plain"),
                              ("Content-Length", "2")])
    return [b"ok"]


import pytest


@pytest.mark.parametrize("blocking_ms", [None, 200])
def test_unsampled_child_goes_to_previous_profile(serve, blocking_ms):
    seq = [0.0, 0.0, 0.9]   # /warm, /first sampled; /second not

    def rng():
        return seq.pop(0) if seq else 0.9

    s = serve(_app, pct=0.5, rng=rng, linger=2.0, report=False,
              blocking_ms=blocking_ms)
    sock = keepalive_gets(s.port, ("/warm", "/first", "/second"))
    p = s.profile_for("/first", timeout=5)
    sock.close()
    names = [(g.id, g.fn_name, g.cpu) for g in p.greenlets]
    print("blocking_ms", blocking_ms, "/first greenlets:", names)
    assert not any("kid" in (fn or "") for _, fn, _ in names), \
        "/second's child was attributed to /first"
