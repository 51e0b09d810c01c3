"""The C-API side of the binding on every supported interpreter
(3.10-3.13): a RequestProfile built in C (_sampled.c's build_profile)
carries the request's metadata, whatever the interpreter's object layout
(3.13 keeps a new object's attributes inline, not in a dict installed
after creation)."""
import os
import socket

import pytest

from greqprof import RequestProfile
from test_middleware import serve  # noqa: F401  (the fixture)
from test_middleware import SECRET

pytestmark = pytest.mark.timeout(60)


def app(environ, start_response):
    if environ["PATH_INFO"] == "/boom":
        raise KeyError("boom")
    start_response("202 Accepted", [("Content-Type", "text/plain")])
    return [b"ok"]


def test_a_c_built_profile_reads_back_its_metadata(serve):
    s = serve(app, pct=1.0, report=False, trigger_header="X-Trigger",
              trigger_secret=SECRET)
    # the first request arms the C path; the rest are built in C
    paths = ["/warm", "/a", "/b", "/c"]
    for path in paths:
        r = s.get(path, headers=[("X-Request-ID", "rid" + path)])
        assert r.status == 202
    r = s.get("/t", headers=[("X-Request-ID", "rid/t"),
                             ("X-Trigger", SECRET)])
    assert r.status == 202
    s.get("/boom", headers=[("X-Request-ID", "rid/boom")])
    s.wait_profiles(len(paths) + 2)
    for path in paths[1:] + ["/t", "/boom"]:
        p = s.profile_for(path)
        assert isinstance(p, RequestProfile)
        assert p.method == "GET" and p.path == path
        assert p.request_id == "rid" + path
        assert p.pid == os.getpid()
        assert p.hostname == socket.gethostname()
        assert p.clock == "cpu"
        assert p.sampled_by == ("trigger" if path == "/t" else "pct")
        if path == "/boom":
            assert p.error == "KeyError: 'boom'" and p.status is None
        else:
            assert p.error is None and p.status == "202 Accepted"
        # what attribute reads give is what the instance holds
        for name, value in vars(p).items():
            if not name.startswith("_"):
                assert getattr(p, name) == value, name
        # and the deferred fields are built on first read
        assert p.spans and p.wall > 0 and p.waiting.seconds >= 0
        assert p.to_dict()["request_id"] == "rid" + path
