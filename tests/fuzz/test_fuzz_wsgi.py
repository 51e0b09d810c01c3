"""Fuzz target: the WSGI surface (issue 15, item 5).

ProfilingMiddleware is called in-process, inside a greenlet, the way a
WSGI server calls it, with generated environs (missing keys, bytes and
non-str values, lone surrogates, control and bidi characters, long
values) and generated apps (start_response called once, never, twice with
exc_info, late from inside the body; a bytes status; the write() callable;
bodies as lists, generators, generators that raise, iterables whose
close() raises; apps that raise before responding).  The property: what
the server sees — start_response calls, write() calls, body chunks, the
exception raised, close() calls on the app's iterable — is exactly what
the bare app gives it, for every configuration (unsampled C path,
sampled C path, calls=True and inspector/Python paths), and nothing else
escapes."""
import logging

import gevent
import pytest
from hypothesis import given, seed
from hypothesis import strategies as st

from greqprof import ProfilingMiddleware

from test_middleware import reset_greqprof

from _settings import SEED, fuzz_settings

pytestmark = pytest.mark.timeout(300)

ODD = st.sampled_from([
    "/", "/a", "/\udcff", "/\u202e\u2066x", "/\x00\x1b[2J\n", "\u2028",
    "/caf\u00e9", "/" + "x" * 5000, "", " ", "\ud800", "%s%n", "/\x85"])
VALUES = (ODD | st.text(max_size=30) | st.binary(max_size=20) |
          st.integers() | st.none() | st.just(["list"]))


class AppError(Exception):
    pass


class Script:
    """What a generated app does (drawn by ``scripts``)."""

    def __init__(self, raise_first, status, mode, body, raise_at,
                 close_raises, use_write, chunks):
        self.raise_first = raise_first
        self.status = status
        self.mode = mode            # once / never / twice / late
        self.body = body            # list / generator / closing
        self.raise_at = raise_at    # index of the chunk that raises, or None
        self.close_raises = close_raises
        self.use_write = use_write
        self.chunks = chunks

    def __repr__(self):
        return "Script(%r)" % (self.__dict__,)


@st.composite
def scripts(draw):
    chunks = draw(st.lists(st.binary(max_size=8), max_size=4))
    return Script(
        raise_first=draw(st.sampled_from([None, None, None, "boom",
                                          "\udcff\u202e\n"])),
        status=draw(st.sampled_from(["200 OK", "404 Not Found", b"200 OK",
                                     "500 \udcff\u202e", "299 X\n"])),
        mode=draw(st.sampled_from(["once", "once", "never", "twice",
                                   "late"])),
        body=draw(st.sampled_from(["list", "generator", "closing"])),
        raise_at=draw(st.one_of(st.none(), st.integers(0, 3))),
        close_raises=draw(st.booleans()),
        use_write=draw(st.booleans()),
        chunks=chunks)


@st.composite
def environs(draw):
    env = {"REQUEST_METHOD": "GET", "PATH_INFO": "/", "SERVER_NAME": "x",
           "SERVER_PORT": "80", "REMOTE_ADDR": "127.0.0.1",
           "HTTP_HOST": "localhost", "QUERY_STRING": "",
           "wsgi.url_scheme": "http"}
    for key in draw(st.lists(st.sampled_from(
            ["REQUEST_METHOD", "PATH_INFO", "HTTP_X_REQUEST_ID", "HTTP_HOST",
             "REMOTE_ADDR", "QUERY_STRING", "HTTP_X_PROFILE"]),
            max_size=4)):
        if draw(st.integers(0, 4)) == 0:
            env.pop(key, None)
        else:
            env[key] = draw(VALUES)
    if draw(st.integers(0, 9)) == 0:   # (keys that are not str)
        env[draw(st.integers() | st.binary(max_size=4))] = draw(VALUES)
    return env


def make_app(script, log):
    def app(environ, start_response):
        log.append(("app", environ.get("PATH_INFO", None) is not None))
        if script.raise_first is not None:
            raise AppError(script.raise_first)
        write = None
        if script.mode in ("once", "twice"):
            write = start_response(script.status, [("X-A", "1")])
        if script.mode == "twice":
            try:
                raise AppError("late error")
            except AppError:
                import sys
                write = start_response("500 Internal Server Error", [],
                                       sys.exc_info())
        if script.use_write and write is not None:
            write(b"written")

        def gen():
            if script.mode == "late":
                start_response(script.status, [])
            for i, c in enumerate(script.chunks):
                if script.raise_at == i:
                    raise AppError("in body %d" % i)
                yield c

        if script.body == "list":
            if script.mode == "late":
                start_response(script.status, [])
            return list(script.chunks)
        if script.body == "generator":
            return gen()
        return Closing(gen(), script, log)
    return app


class Closing:
    """A body with a close() (which may raise)."""

    def __init__(self, it, script, log):
        self.it, self.script, self.log = it, script, log

    def __iter__(self):
        return self.it

    def close(self):
        self.log.append(("close",))
        if self.script.close_raises:
            raise AppError("close failed")


def serve_once(wsgi, environ):
    """What a server sees of one request: the events, in order."""
    events = []

    def start_response(status, headers, exc_info=None):
        events.append(("start_response", status, list(headers),
                       exc_info is not None))

        def write(data):
            events.append(("write", data))
        return write

    def run():
        try:
            body = wsgi(dict(environ), start_response)
        except AppError as e:
            events.append(("raised", e.args))
            return
        try:
            for chunk in body:
                events.append(("chunk", chunk))
        except AppError as e:
            events.append(("raised in body", e.args))
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                try:
                    close()
                except AppError as e:
                    events.append(("close raised", e.args))

    g = gevent.spawn(run)
    g.join(timeout=10)
    assert g.dead and g.successful(), (g.exception, events)
    return events


CONFIGS = {
    "unsampled": dict(pct=0.0),
    "sampled": dict(pct=1.0),
    "calls": dict(pct=1.0, calls=True),
    "inspector": dict(pct=1.0, ui_path="/_greqprof"),
    "json_logs": dict(pct=1.0, json_logs=True, trigger_header="X-Profile",
                      trigger_secret="s3cret-value-42"),
}


@pytest.fixture(scope="module")
def middlewares():
    out = {}
    handler = logging.NullHandler()
    for name, kw in CONFIGS.items():
        log = logging.getLogger("greqprof.fuzz." + name)
        log.addHandler(handler)
        log.propagate = False
        out[name] = kw
    yield out
    reset_greqprof()


@seed(SEED)
@fuzz_settings(120)
@given(script=scripts(), environ=environs(),
       config=st.sampled_from(sorted(CONFIGS)))
def test_app_behaviour_unchanged(middlewares, script, environ, config):
    if config == "inspector" and str(environ.get("PATH_INFO", "")) \
            .startswith("/_greqprof"):
        return   # (the inspector's own pages, not the app)
    bare_log, mw_log = [], []
    bare = serve_once(make_app(script, bare_log), environ)
    sunk, failed = [], []

    def sink(profile):
        try:   # (the profile is whole and its text report works)
            profile.to_dict()
            profile.report()
            sunk.append(profile)
        except Exception as e:
            failed.append(e)

    mw = ProfilingMiddleware(make_app(script, mw_log), linger=0,
                             blocking_ms=50, environ={},
                             logger="greqprof.fuzz." + config, sink=sink,
                             **CONFIGS[config])
    wrapped = serve_once(mw, environ)
    assert wrapped == bare, (script, environ)
    assert mw_log == bare_log
    assert failed == []
    if config != "unsampled":
        gevent.sleep(0)   # (the finisher delivers)
