"""Issue 15, item 1 for the request path's C (_fastpath.c, _sampled.c):
every reference borrowed from environ (or another container) is held
across anything that can run Python, and the text recorded at the C
capture points (method, path, request id, status, error) is clean.

Each class of case is provoked through a real gevent.pywsgi server: a
wrapper in front of the middleware rebuilds the environ with a key whose
hash collides with one the C path looks up and whose __eq__ removes
another value (the last reference to it), or puts in a value whose
__str__ removes itself.  Under ``make pytest-asan`` a use after free is
reported by AddressSanitizer; without it, the recorded text is checked.
"""
import gc
import sys

import gevent
import pytest

from greqprof import _registry, engine
from test_middleware import serve, wait_for, settle  # noqa: F401

pytestmark = pytest.mark.timeout(60)


def fresh(text):
    """text as a new str object (not interned, not shared): its only
    reference is where the test puts it."""
    return "".join(list(text))


class CollidingKey:
    """A key whose hash is that of `like` and whose __eq__ runs `action`
    (removing another value from the environ), then allocates strings of
    the removed value's size, which take its freed memory: a borrowed
    reference to it would then read "ZZZ..." (or crash under ASan)."""

    def __init__(self, like, action, size):
        self.h = hash(like)
        self.action = action
        self.size = size
        self.filler = []
        self.live = False   # (set once the environ is built)

    def __hash__(self):
        return self.h

    def __eq__(self, other):
        if not self.live:
            return False
        action, self.action = self.action, None
        if action is not None:
            action()
            gc.collect()
            self.filler = [fresh("Z" * self.size) for _ in range(50)]
        return False


class Rebuilding:
    """Puts `make_first(environ)` items into a new environ before the
    server's, so the C path's lookups meet them first."""

    def __init__(self, app, make_first):
        self.app = app
        self.make_first = make_first

    def __call__(self, environ, start_response):
        env = {}
        # (the values' only references are the environ's)
        env.update(self.make_first(env, environ))
        for k, v in environ.items():
            env.setdefault(k, v)
        for k in env:
            if isinstance(k, CollidingKey):
                k.live = True
        return self.app(env, start_response)


def noted_app(seen):
    def app(environ, start_response):
        eng = engine.current_engine()
        note, _ = _registry.request_note(eng.tracer.hooks_addr,
                                         gevent.getcurrent())
        seen.append(note)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]
    return app


NOTED = ("REQUEST_METHOD", "PATH_INFO", "HTTP_X_REQUEST_ID")


# (every ordered pair: the order of the C path's lookups is the compiler's)
@pytest.mark.parametrize("victim,collide", [
    (v, c) for v in NOTED for c in NOTED if v != c])
def test_unsampled_note_holds_values_across_colliding_lookups(serve, victim,
                                                              collide):
    """The C path notes an unsampled request's method, path and request
    id: a later lookup's colliding key removes an earlier value (its last
    reference) from environ; the note still has the value."""
    seen = []
    values = {"REQUEST_METHOD": "PATCH-" + "m" * 20,
              "PATH_INFO": "/p/" + "q" * 30,
              "HTTP_X_REQUEST_ID": "rid-" + "r" * 30}

    def make_first(env, server_env):
        first = {CollidingKey(collide, lambda: env.pop(victim, None),
                              len(values[victim])): 1}
        for k, v in values.items():
            first[k] = fresh(v)
        return first

    s = serve(noted_app(seen), wrap=lambda mw: Rebuilding(mw, make_first),
              pct=0.0, blocking_ms=100)
    for i in range(4):   # (the first arms the C path)
        assert s.get("/x").status == 200
    assert len(seen) == 4
    assert s.mw._is_armed()
    for note in seen[1:]:
        for key, got in zip(NOTED, note):
            if key == victim:
                # its value, or None when it was looked up after its
                # removal; never freed memory (another string's text)
                assert got in (values[key], None), note
            else:
                assert got == values[key], note


class SelfRemoving:
    """An environ value whose __str__ removes it from the environ (the last
    reference) before returning its text."""

    def __init__(self, env, key, text):
        self.env, self.key, self.text = env, key, text

    def __str__(self):
        self.env.pop(self.key, None)
        del self.env
        gc.collect()
        return fresh(self.text)


@pytest.mark.parametrize("key,field", [
    ("REQUEST_METHOD", "method"), ("PATH_INFO", "path"),
    ("HTTP_X_REQUEST_ID", "request_id"),
])
def test_sampled_values_whose_str_removes_them(serve, key, field):
    """The C path of a sampled request takes str() of environ values: a
    __str__ that removes its own value from environ does not free it under
    the C code's feet."""
    def make_first(env, server_env):
        return {key: SelfRemoving(env, key, "text-of-" + key)}

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    s = serve(app, wrap=lambda mw: Rebuilding(mw, make_first), pct=1.0)
    for i in range(3):
        assert s.get("/y").status == 200
    s.wait_profiles(3)
    for p in s.profiles:
        assert getattr(p, field) == "text-of-" + key


@pytest.mark.parametrize("pct", [0.0, 1.0])
def test_app_replacing_itself_while_it_runs(serve, pct):
    """middleware.app replaced by the app while it runs (its last
    reference): the C path holds the app for the call."""
    calls = []

    def plain(environ, start_response):
        calls.append("plain")
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"plain"]

    holder = {}

    class Replacing:
        def __call__(self, environ, start_response):
            holder["mw"].app = plain   # drops the last reference to self
            gc.collect()
            calls.append("replacing")
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"first"]

    s = serve(Replacing(), pct=pct)
    holder["mw"] = s.mw
    assert s.get("/a").body == b"first"
    assert s.get("/b").body == b"plain"
    assert calls == ["replacing", "plain"]


# ---------------------------------------------------------------------------
# clean text at the C capture points

@pytest.mark.parametrize("calls", [False, True])
def test_status_and_error_are_recorded_as_clean_text(serve, calls):
    """A bytes status is decoded as latin-1; bidi and control characters in
    a status, a path or an error message are escaped visibly; a lone
    surrogate too."""
    def app(environ, start_response):
        path = environ["PATH_INFO"]
        if path == "/bytes":
            start_response(b"200 OK", [("Content-Type", "text/plain")])
            return [b"ok"]
        if path == "/bidi":
            start_response("200 O\u202eK\n", [("Content-Type", "text/plain")])
            return [b"ok"]
        raise ValueError("bad \udcff value\nsecond line")

    def lenient(mw):
        # (pywsgi takes a str status only, with no control characters: the
        # server is given a plain one, greqprof sees the app's)
        def outer(environ, start_response):
            def sr(status, headers, exc_info=None):
                ok = status in (b"200 OK", "200 O\u202eK\n")
                return start_response("200 OK" if ok else status, headers,
                                      exc_info)
            return mw(environ, sr)
        return outer

    s = serve(app, wrap=lenient, pct=1.0, calls=calls)
    assert s.get("/bytes").status == 200
    assert s.get("/bidi").status == 200
    assert s.get("/raise%E2%80%AE").status == 500
    s.wait_profiles(3)
    by = {p.path: p for p in s.profiles}
    assert by["/bytes"].status == "200 OK"
    assert by["/bidi"].status == "200 O\\u202eK\\x0a"
    raised = [p for p in s.profiles if p.path.startswith("/raise")][0]
    # (PATH_INFO is latin-1 decoded by the server: \xe2\x80\xae)
    assert raised.path.isprintable()
    assert raised.error == "ValueError: bad \\udcff value\\x0asecond line"
    for p in s.profiles:
        p.to_json().encode("utf-8")   # never fails on content
        p.report().encode("utf-8")


def test_start_response_with_exc_info_keyword(serve):
    def app(environ, start_response):
        try:
            raise KeyError("x")
        except KeyError:
            start_response("500 Internal Server Error",
                           [("Content-Type", "text/plain")],
                           exc_info=sys.exc_info())
        return [b"err"]

    s = serve(app, pct=1.0)
    assert s.get("/e").status == 500
    assert s.profile_for("/e").status == "500 Internal Server Error"
