"""GREQPROF_* environment configuration (greqprof/config.py) as seen through
ProfilingMiddleware, and the JSON-lines output it can turn on.

Each variable is given through the ``environ=`` argument and, for the
behaviour that matters in production, through the real ``os.environ``
(monkeypatched).  The JSON lines are checked against docs/schema.md, which
must document every key.
"""
import json
import logging
import os
import re
import socket
import sys
import time
import types

import gevent
import greenlet
import pytest
from gevent import pywsgi

from greqprof import ConfigError, ProfilingMiddleware
from greqprof import config as gconfig
from greqprof.request_profile import SCHEMA

from test_middleware import (LOGGER, http, messages, reset_greqprof,  # noqa
                             serve, wait_for)

pytestmark = pytest.mark.timeout(60)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def app(environ, start_response):
    if environ["PATH_INFO"] == "/block":
        blocking_handler()
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok\n"]


def blocking_handler():
    time.sleep(0.08)  # gevent is not monkey-patched: holds the loop


@pytest.fixture(autouse=True)
def clean_environ(monkeypatch):
    """No GREQPROF_* variable from the caller's environment leaks in."""
    for var in list(os.environ):
        if var.startswith("GREQPROF_"):
            monkeypatch.delenv(var)


def mw_from(env, **kw):
    return ProfilingMiddleware(app, environ=env, **kw)


def blocking_ms(mw):
    return mw.config.blocking_ns / 1e6 or None


def formats(mw):
    w = mw._outputs.writer if mw._outputs else None
    return [r.name for r in w.renderers] if w else None


def profile_dir(mw):
    w = mw._outputs.writer if mw._outputs else None
    return w.directory if w else None


def otel(mw):
    return any(type(o).__name__ == "OtelObserver" for o in mw.observers)


def otel_spans(mw):
    return [o.child_spans for o in mw.observers
            if type(o).__name__ == "OtelObserver"]


def trigger_header(mw):
    return mw._trigger_key


#: variable -> (what the middleware ended up with, built-in default)
READ = {
    "GREQPROF_PCT": (lambda mw: mw.config.pct, 0.05),
    "GREQPROF_CALLS": (lambda mw: mw.config.calls, False),
    "GREQPROF_CLOCK": (lambda mw: mw.config.clock, "cpu"),
    "GREQPROF_BLOCKING_MS": (blocking_ms, 100.0),
    "GREQPROF_JSON_LOGS": (lambda mw: mw.json_logs, False),
    "GREQPROF_MAX_SPANS": (lambda mw: mw.config.max_spans, 1000),
    "GREQPROF_LINGER": (lambda mw: mw.linger, 1.0),
    "GREQPROF_LOGGER": (lambda mw: mw.log.name, "greqprof"),
    "GREQPROF_PROFILE_DIR": (profile_dir, None),
    "GREQPROF_FORMATS": (formats, None),
    "GREQPROF_TRIGGER_HEADER": (trigger_header, None),
    "GREQPROF_TRIGGER_SECRET": (lambda mw: mw._trigger_secret, None),
    "GREQPROF_OTEL": (otel, False),
    "GREQPROF_OTEL_SPANS": (otel_spans, []),
    "GREQPROF_ENABLED": (lambda mw: mw.enabled, True),
    "GREQPROF_BLOCKING_INTERVAL": (
        lambda mw: mw._blocking_sites.interval, 10.0),
    "GREQPROF_JSON_MAX_BYTES": (lambda mw: mw.json_max_bytes, 65536),
    "GREQPROF_STACK_HZ": (lambda mw: mw._stack_hz, 100.0),
    "GREQPROF_MAX_ROUTES": (lambda mw: mw._routes.max_routes, 500),
    "GREQPROF_SUMMARY_S": (lambda mw: mw.summary_s, 60.0),
    "GREQPROF_METRICS_PATH": (lambda mw: mw.metrics_path, None),
}

SECRET = "s3cret-value-42"

#: (variable, raw value, other variables it needs, value read back)
VALID = [
    ("GREQPROF_PCT", "0", {}, 0.0),
    ("GREQPROF_PCT", "1", {}, 1.0),
    ("GREQPROF_PCT", " 0.25 ", {}, 0.25),
    ("GREQPROF_PCT", "1e-2", {}, 0.01),
    ("GREQPROF_CALLS", "1", {}, True),
    ("GREQPROF_CALLS", "TRUE", {}, True),
    ("GREQPROF_CALLS", "yes", {}, True),
    ("GREQPROF_CALLS", "on", {}, True),
    ("GREQPROF_CALLS", "0", {}, False),
    ("GREQPROF_CALLS", "False", {}, False),
    ("GREQPROF_CALLS", "no", {}, False),
    ("GREQPROF_CALLS", " off ", {}, False),
    ("GREQPROF_CLOCK", "cpu", {}, "cpu"),
    ("GREQPROF_CLOCK", "WALL", {}, "wall"),
    ("GREQPROF_BLOCKING_MS", "250", {}, 250.0),
    ("GREQPROF_BLOCKING_MS", "0.5", {}, 0.5),
    ("GREQPROF_BLOCKING_MS", "0", {}, None),
    ("GREQPROF_BLOCKING_MS", "off", {}, None),
    ("GREQPROF_BLOCKING_MS", "None", {}, None),
    ("GREQPROF_BLOCKING_MS", "", {}, None),
    ("GREQPROF_JSON_LOGS", "1", {}, True),
    ("GREQPROF_JSON_LOGS", "off", {}, False),
    ("GREQPROF_MAX_SPANS", "1", {}, 1),
    ("GREQPROF_MAX_SPANS", " 5000 ", {}, 5000),
    ("GREQPROF_LINGER", "0", {}, 0.0),
    ("GREQPROF_LINGER", "2.5", {}, 2.5),
    ("GREQPROF_LINGER", "60", {}, 60.0),
    ("GREQPROF_LOGGER", "myapp.profiles", {}, "myapp.profiles"),
    ("GREQPROF_PROFILE_DIR", "{tmp}", {}, "{tmp}"),
    ("GREQPROF_FORMATS", "json", {"GREQPROF_PROFILE_DIR": "{tmp}"},
     ["json"]),
    ("GREQPROF_FORMATS", "json, trace ,speedscope",
     {"GREQPROF_PROFILE_DIR": "{tmp}"}, ["json", "trace", "speedscope"]),
    ("GREQPROF_FORMATS", "pstats,callgrind",
     {"GREQPROF_PROFILE_DIR": "{tmp}", "GREQPROF_CALLS": "1"},
     ["pstats", "callgrind"]),
    ("GREQPROF_TRIGGER_HEADER", "X-Profile-Me",
     {"GREQPROF_TRIGGER_SECRET": SECRET}, "HTTP_X_PROFILE_ME"),
    ("GREQPROF_TRIGGER_SECRET", SECRET,
     {"GREQPROF_TRIGGER_HEADER": "X-Profile-Me"}, SECRET.encode()),
    ("GREQPROF_OTEL", "0", {}, False),
    ("GREQPROF_OTEL_SPANS", "1", {}, []),  # without GREQPROF_OTEL: nothing
    ("GREQPROF_ENABLED", "0", {}, False),
    ("GREQPROF_ENABLED", "yes", {}, True),
    ("GREQPROF_BLOCKING_INTERVAL", "0", {}, 0.0),
    ("GREQPROF_BLOCKING_INTERVAL", " 2.5 ", {}, 2.5),
    ("GREQPROF_JSON_MAX_BYTES", "16000", {}, 16000),
    ("GREQPROF_STACK_HZ", "100", {}, 100.0),
    ("GREQPROF_STACK_HZ", "off", {}, 0),
    ("GREQPROF_MAX_ROUTES", "20", {}, 20),
    ("GREQPROF_SUMMARY_S", "300", {}, 300.0),
    ("GREQPROF_SUMMARY_S", "off", {}, None),
    ("GREQPROF_SUMMARY_S", "0", {}, None),
    ("GREQPROF_METRICS_PATH", "/_greqprof/metrics", {},
     "/_greqprof/metrics"),
]

HAVE_OTEL = True
try:
    import opentelemetry.trace  # noqa: F401
except ImportError:
    HAVE_OTEL = False
if HAVE_OTEL:
    VALID += [("GREQPROF_OTEL", "1", {}, True),
              ("GREQPROF_OTEL_SPANS", "1", {"GREQPROF_OTEL": "1"}, [True]),
              ("GREQPROF_OTEL_SPANS", "0", {"GREQPROF_OTEL": "1"}, [False])]


def _fill(value, tmp):
    if isinstance(value, str):
        return value.replace("{tmp}", str(tmp))
    if isinstance(value, dict):
        return {k: _fill(v, tmp) for k, v in value.items()}
    return value


def test_table_covers_every_variable():
    assert set(READ) == set(gconfig.VARIABLES)
    assert {v for v, _, _, _ in VALID} == set(gconfig.VARIABLES)
    assert {v for v, _ in INVALID} == set(gconfig.VARIABLES)


def test_defaults_without_environment():
    mw = mw_from({})
    for var, (read, default) in READ.items():
        assert read(mw) == default, var


@pytest.mark.parametrize("var,raw,others,want", VALID,
                         ids=["%s=%r" % (v, r) for v, r, _, _ in VALID])
def test_valid_value(var, raw, others, want, tmp_path, monkeypatch):
    env = dict(_fill(others, tmp_path), **{var: _fill(raw, tmp_path)})
    mw = mw_from(env)
    read, _ = READ[var]
    assert read(mw) == _fill(want, tmp_path)
    # the same through the real os.environ
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert read(ProfilingMiddleware(app)) == _fill(want, tmp_path)


#: (variable, invalid raw value); each must fail at construction with a
#: ConfigError whose message names the variable.
INVALID = [
    ("GREQPROF_PCT", ""), ("GREQPROF_PCT", "abc"), ("GREQPROF_PCT", "5%"),
    ("GREQPROF_PCT", "1.5"), ("GREQPROF_PCT", "-0.1"),
    ("GREQPROF_PCT", "nan"), ("GREQPROF_PCT", "inf"),
    ("GREQPROF_CALLS", ""), ("GREQPROF_CALLS", "2"),
    ("GREQPROF_CALLS", "maybe"),
    ("GREQPROF_CLOCK", "gpu"), ("GREQPROF_CLOCK", ""),
    ("GREQPROF_BLOCKING_MS", "-5"), ("GREQPROF_BLOCKING_MS", "abc"),
    ("GREQPROF_BLOCKING_MS", "nan"), ("GREQPROF_BLOCKING_MS", "100ms"),
    ("GREQPROF_JSON_LOGS", "2"), ("GREQPROF_JSON_LOGS", "json"),
    ("GREQPROF_MAX_SPANS", "0"), ("GREQPROF_MAX_SPANS", "-1"),
    ("GREQPROF_MAX_SPANS", "1.5"), ("GREQPROF_MAX_SPANS", "1e3"),
    ("GREQPROF_MAX_SPANS", "many"),
    ("GREQPROF_LINGER", "-1"), ("GREQPROF_LINGER", "61"),
    ("GREQPROF_LINGER", "nan"), ("GREQPROF_LINGER", "1s"),
    ("GREQPROF_LOGGER", ""), ("GREQPROF_LOGGER", "   "),
    ("GREQPROF_PROFILE_DIR", ""),
    ("GREQPROF_FORMATS", ""), ("GREQPROF_FORMATS", " , "),
    ("GREQPROF_TRIGGER_HEADER", ""), ("GREQPROF_TRIGGER_SECRET", " "),
    ("GREQPROF_OTEL", "sometimes"), ("GREQPROF_OTEL_SPANS", "2"),
    ("GREQPROF_ENABLED", "disabled"), ("GREQPROF_ENABLED", ""),
    ("GREQPROF_BLOCKING_INTERVAL", "-1"), ("GREQPROF_BLOCKING_INTERVAL", "x"),
    ("GREQPROF_BLOCKING_INTERVAL", "nan"),
    ("GREQPROF_JSON_MAX_BYTES", "100"), ("GREQPROF_JSON_MAX_BYTES", "64k"),
    ("GREQPROF_STACK_HZ", "-1"), ("GREQPROF_STACK_HZ", "1001"),
    ("GREQPROF_STACK_HZ", "fast"),
    ("GREQPROF_MAX_ROUTES", "0"), ("GREQPROF_MAX_ROUTES", "1e9"),
    ("GREQPROF_SUMMARY_S", "0.01"), ("GREQPROF_SUMMARY_S", "1m"),
    ("GREQPROF_METRICS_PATH", "metrics"),
    ("GREQPROF_METRICS_PATH", "/a/../metrics"),
]

@pytest.mark.parametrize("var,raw", INVALID,
                         ids=["%s=%r" % vr for vr in INVALID])
def test_invalid_value_fails_at_construction(var, raw, monkeypatch):
    with pytest.raises(ConfigError) as e:
        mw_from({var: raw})
    assert var in str(e.value)
    # through os.environ too
    monkeypatch.setenv(var, raw)
    with pytest.raises(ConfigError) as e:
        ProfilingMiddleware(app)
    assert var in str(e.value)


@pytest.mark.parametrize("raw", ["inf", "1e400"])
def test_blocking_ms_infinite(raw):
    with pytest.raises(ConfigError) as e:
        mw_from({"GREQPROF_BLOCKING_MS": raw})
    assert "GREQPROF_BLOCKING_MS" in str(e.value)


#: combinations that each variable accepts alone but the middleware
#: rejects: the error should still name the variable(s) responsible
BAD_COMBINATIONS = [
    ({"GREQPROF_FORMATS": "json"}, "GREQPROF_FORMATS"),
    ({"GREQPROF_PROFILE_DIR": "{tmp}", "GREQPROF_FORMATS": "nope"},
     "GREQPROF_FORMATS"),
    ({"GREQPROF_PROFILE_DIR": "{tmp}", "GREQPROF_FORMATS": "pstats"},
     "GREQPROF_FORMATS"),
    ({"GREQPROF_PROFILE_DIR": "/proc/greqprof-cannot-be-here"},
     "GREQPROF_PROFILE_DIR"),
    ({"GREQPROF_TRIGGER_HEADER": "X-Profile-Me"}, "GREQPROF_TRIGGER_SECRET"),
    ({"GREQPROF_TRIGGER_SECRET": SECRET}, "GREQPROF_TRIGGER_HEADER"),
    ({"GREQPROF_TRIGGER_HEADER": "X-Profile-Me",
      "GREQPROF_TRIGGER_SECRET": "short"}, "GREQPROF_TRIGGER_SECRET"),
]


@pytest.mark.parametrize("env,var", BAD_COMBINATIONS,
                         ids=[",".join("%s=%s" % kv for kv in e.items())
                              for e, _ in BAD_COMBINATIONS])
def test_bad_combination_fails_at_construction(env, var, tmp_path):
    with pytest.raises(ConfigError):
        mw_from(_fill(env, tmp_path))


@pytest.mark.parametrize("env,var", BAD_COMBINATIONS,
                         ids=[",".join("%s=%s" % kv for kv in e.items())
                              for e, _ in BAD_COMBINATIONS])
def test_bad_combination_names_the_variable(env, var, tmp_path):
    with pytest.raises(ConfigError) as e:
        mw_from(_fill(env, tmp_path))
    assert var in str(e.value)


def test_secret_never_in_the_error():
    with pytest.raises(ConfigError) as e:
        mw_from({"GREQPROF_TRIGGER_HEADER": "X-P",
                 "GREQPROF_TRIGGER_SECRET": "short"})
    assert "short" not in str(e.value)
    mw = mw_from({"GREQPROF_TRIGGER_HEADER": "X-P",
                  "GREQPROF_TRIGGER_SECRET": SECRET})
    assert SECRET not in repr(mw) and SECRET not in str(mw)


# ---------------------------------------------------------------------------
# unknown variables

@pytest.mark.parametrize("var", ["GREQPROF_PCTT", "GREQPROF_SAMPLE",
                                 "GREQPROF_", "GREQPROF_pct",
                                 "GREQPROF_BLOCKING"])
def test_unknown_variable_rejected(var, monkeypatch):
    with pytest.raises(ConfigError) as e:
        mw_from({var: "1"})
    assert var in str(e.value) and "GREQPROF_PCT" in str(e.value)
    monkeypatch.setenv(var, "1")
    with pytest.raises(ConfigError) as e:
        ProfilingMiddleware(app)
    assert var in str(e.value)
    # even when every option is given in code
    with pytest.raises(ConfigError):
        ProfilingMiddleware(app, pct=1.0, calls=False, clock="cpu",
                            blocking_ms=None, json_logs=False,
                            max_spans=10, linger=0, logger="x")


def test_other_prefixes_ignored():
    for env in ({"greqprof_pct": "nonsense"}, {"XGREQPROF_PCT": "x"},
                {"GREQPROFPCT": "x"}, {"PCT": "x"},
                {"GREQPROF_SCREENSHOTS": "1"}):  # a test-suite switch
        assert mw_from(env).config.pct == 0.05


# ---------------------------------------------------------------------------
# explicit arguments win

#: option -> (explicit value, environment that says otherwise, reader)
EXPLICIT = [
    ("pct", 0.5, {"GREQPROF_PCT": "1"}, lambda mw: mw.config.pct),
    ("calls", False, {"GREQPROF_CALLS": "1"}, lambda mw: mw.config.calls),
    ("clock", "wall", {"GREQPROF_CLOCK": "cpu"}, lambda mw: mw.config.clock),
    ("blocking_ms", 20, {"GREQPROF_BLOCKING_MS": "500"}, blocking_ms),
    ("blocking_ms", None, {"GREQPROF_BLOCKING_MS": "500"}, blocking_ms),
    ("json_logs", True, {"GREQPROF_JSON_LOGS": "0"},
     lambda mw: mw.json_logs),
    ("max_spans", 7, {"GREQPROF_MAX_SPANS": "9"},
     lambda mw: mw.config.max_spans),
    ("linger", 0, {"GREQPROF_LINGER": "5"}, lambda mw: mw.linger),
    ("logger", "mine", {"GREQPROF_LOGGER": "theirs"},
     lambda mw: mw.log.name),
    ("profile_dir", None, {"GREQPROF_PROFILE_DIR": "/proc/nope"},
     profile_dir),
    ("otel", False, {"GREQPROF_OTEL": "1"}, otel),
]


@pytest.mark.parametrize("opt,value,env,read", EXPLICIT,
                         ids=["%s=%r" % (o, v) for o, v, _, _ in EXPLICIT])
def test_explicit_argument_wins(opt, value, env, read, monkeypatch):
    assert read(mw_from(env, **{opt: value})) == value
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert read(ProfilingMiddleware(app, **{opt: value})) == value


def test_explicit_argument_wins_over_an_invalid_variable():
    """A variable for an option that the code sets is not read at all."""
    mw = mw_from({"GREQPROF_PCT": "lots", "GREQPROF_CLOCK": "gpu"},
                 pct=0.5, clock="wall")
    assert (mw.config.pct, mw.config.clock) == (0.5, "wall")


def test_explicit_formats_and_trigger_win(tmp_path):
    mw = mw_from({"GREQPROF_PROFILE_DIR": str(tmp_path / "env"),
                  "GREQPROF_FORMATS": "trace",
                  "GREQPROF_TRIGGER_HEADER": "X-Env",
                  "GREQPROF_TRIGGER_SECRET": "env-secret-1"},
                 profile_dir=str(tmp_path / "code"), formats=["json"],
                 trigger_header="X-Code", trigger_secret="code-secret-1")
    assert profile_dir(mw) == str(tmp_path / "code")
    assert formats(mw) == ["json"]
    assert mw._trigger_key == "HTTP_X_CODE"
    assert mw._trigger_secret == b"code-secret-1"


def test_environ_argument_replaces_os_environ(monkeypatch):
    """environ= is the whole environment: os.environ is then not read."""
    monkeypatch.setenv("GREQPROF_PCT", "1")
    monkeypatch.setenv("GREQPROF_BOGUS", "1")
    assert mw_from({}).config.pct == 0.05
    assert mw_from({"GREQPROF_PCT": "0.5"}).config.pct == 0.5


# ---------------------------------------------------------------------------
# behaviour: pass-through, read once, through real requests

@pytest.fixture
def plain():
    """Serves a WSGI callable with pywsgi; resets greqprof afterwards."""
    servers = []

    def start(wsgi):
        server = pywsgi.WSGIServer(("127.0.0.1", 0), wsgi, log=None)
        server.start()
        servers.append(server)
        return server.server_port

    yield start
    for s in servers:
        s.stop(timeout=2)
    reset_greqprof()


@pytest.mark.parametrize("how", ["environ", "os.environ"])
def test_enabled_0_is_a_pass_through(plain, monkeypatch, how):
    calls = []
    body = [b"from ", b"the app\n"]

    def counted(environ, start_response):
        calls.append(environ["PATH_INFO"])
        if environ["PATH_INFO"] == "/block":
            blocking_handler()
        start_response("200 OK", [("Content-Type", "text/plain")])
        return body

    profiles = []
    env = {"GREQPROF_ENABLED": "0", "GREQPROF_PCT": "1",
           "GREQPROF_BLOCKING_MS": "10", "GREQPROF_CALLS": "1"}
    if how == "environ":
        mw = ProfilingMiddleware(counted, environ=env, sink=profiles.append)
    else:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        mw = ProfilingMiddleware(counted, sink=profiles.append)
    assert mw.enabled is False
    # The app's own result comes back untouched, hooks are never installed.
    seen = []
    assert mw({"PATH_INFO": "/direct"},
              lambda s, h, e=None: seen.append(s)) is body
    assert sys.getprofile() is None and greenlet.gettrace() is None
    port = plain(mw)
    for path in ("/a", "/block", "/b"):
        r = http(port, path, headers=[("X-Request-ID", "r" + path)])
        assert r.status == 200 and r.body == b"from the app\n"
    gevent.sleep(0.3)
    assert calls == ["/direct", "/a", "/block", "/b"]
    assert profiles == [] and mw.stats["requests"] == 0
    assert mw.stats["blocking"] == 0 and mw.stats["sampled"] == 0
    assert sys.getprofile() is None and greenlet.gettrace() is None
    from greqprof import engine
    assert getattr(engine._local, "engine", None) is None


def test_read_once_at_construction(serve, monkeypatch, caplog):  # noqa: F811
    monkeypatch.setenv("GREQPROF_PCT", "1")
    monkeypatch.setenv("GREQPROF_JSON_LOGS", "1")
    monkeypatch.setenv("GREQPROF_BLOCKING_MS", "30")
    s = serve(app)          # environ=None: reads os.environ now
    # Changed afterwards, even to values that would not construct:
    monkeypatch.setenv("GREQPROF_PCT", "0")
    monkeypatch.setenv("GREQPROF_JSON_LOGS", "garbage")
    monkeypatch.setenv("GREQPROF_BLOCKING_MS", "off")
    monkeypatch.setenv("GREQPROF_UNKNOWN", "1")
    monkeypatch.setenv("GREQPROF_ENABLED", "0")
    caplog.set_level(logging.INFO, logger=LOGGER)
    for i in range(3):
        assert s.get("/p%d" % i).status == 200
    assert s.get("/block").status == 200
    s.wait_profiles(4)
    assert s.mw.config.pct == 1.0 and s.mw.json_logs
    assert s.mw.stats["sampled"] == 4 and s.mw.stats["blocking"] >= 1
    wait_for(lambda: messages(caplog, logging.WARNING), what="WARNING")
    for msg in messages(caplog):
        json.loads(msg)     # still JSON lines
    assert s.mw.stats["errors"] == 0
    # A new middleware reads the environment as it is now.
    monkeypatch.delenv("GREQPROF_UNKNOWN")
    monkeypatch.delenv("GREQPROF_JSON_LOGS")
    mw = ProfilingMiddleware(app)
    assert mw.enabled is False and mw.config.pct == 0.0


def test_trigger_from_environment(serve, monkeypatch):  # noqa: F811
    monkeypatch.setenv("GREQPROF_PCT", "0")
    monkeypatch.setenv("GREQPROF_TRIGGER_HEADER", "X-Profile-Me")
    monkeypatch.setenv("GREQPROF_TRIGGER_SECRET", SECRET)
    s = serve(app)
    assert s.get("/no").status == 200
    assert s.get("/wrong", headers=[("X-Profile-Me", SECRET + "x")]).status \
        == 200
    assert s.get("/yes", headers=[("X-Profile-Me", SECRET)]).status == 200
    p = s.profile_for("/yes")
    assert p.sampled_by == "trigger"
    gevent.sleep(0.3)
    assert [p.path for p in s.profiles] == ["/yes"]


def test_profile_dir_and_formats_from_environment(serve, monkeypatch,  # noqa
                                                  tmp_path):
    monkeypatch.setenv("GREQPROF_PCT", "1")
    monkeypatch.setenv("GREQPROF_PROFILE_DIR", str(tmp_path))
    monkeypatch.setenv("GREQPROF_FORMATS", "json,trace")
    s = serve(app)
    assert s.get("/files").status == 200
    s.wait_profiles(1)
    names = wait_for(lambda: sorted(os.listdir(tmp_path))
                     if len(os.listdir(tmp_path)) >= 2 else None,
                     what="two profile files")
    gevent.sleep(0.1)
    names = sorted(os.listdir(tmp_path))
    assert len(names) == 2
    assert all("-%d-" % os.getpid() in n for n in names)
    assert [n.endswith(".trace.json") for n in names].count(True) == 1
    [plain] = [n for n in names if not n.endswith(".trace.json")]
    with open(os.path.join(tmp_path, plain)) as f:
        assert json.load(f)["path"] == "/files"


def test_max_spans_from_environment(serve, monkeypatch):  # noqa
    monkeypatch.setenv("GREQPROF_PCT", "1")
    monkeypatch.setenv("GREQPROF_MAX_SPANS", "2")

    def many(environ, start_response):
        for _ in range(10):
            gevent.sleep(0)
        start_response("200 OK", [])
        return [b"ok"]
    s = serve(many)
    assert s.get("/many").status == 200
    [p] = s.wait_profiles(1)
    assert len(p.spans) == 2 and p.dropped_spans > 0


def test_logger_from_environment(serve, monkeypatch, caplog):  # noqa: F811
    monkeypatch.setenv("GREQPROF_PCT", "1")
    monkeypatch.setenv("GREQPROF_LOGGER", "myapp.greqprof")
    caplog.set_level(logging.INFO, logger="myapp.greqprof")
    s = serve(app)
    assert s.get("/logged").status == 200
    s.wait_profiles(1)
    recs = wait_for(lambda: [r for r in caplog.records
                             if r.name == "myapp.greqprof"],
                    what="a record on myapp.greqprof")
    assert "Path: /logged" in recs[0].getMessage()
    assert not [r for r in caplog.records if r.name == LOGGER]


# ---------------------------------------------------------------------------
# JSON lines (GREQPROF_JSON_LOGS=1) and docs/schema.md

def documented_keys():
    """docs/schema.md: {section title: set of keys}, from the first column
    of each table (`key`)."""
    out = {}
    title = None
    with open(os.path.join(ROOT, "docs", "schema.md"), encoding="utf-8") as f:
        for line in f:
            if line.startswith("## "):
                title = line[3:].strip()
                out[title] = set()
            elif title and line.startswith("| `"):
                key = re.match(r"\| `([^`]+)`", line).group(1)
                out[title].add(key)
    return {t: keys for t, keys in out.items() if keys}


def section(docs, marker):
    found = [keys for t, keys in docs.items() if marker in t]
    assert len(found) == 1, (marker, list(docs))
    return found[0]


def _child_greenlet():
    gevent.sleep(0.01)


def json_app(environ, start_response):
    if environ["PATH_INFO"] == "/block":
        blocking_handler()
    gevent.spawn(_child_greenlet).join()
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok\n"]


def test_json_lines_parse_and_match_the_documented_schema(
        serve, monkeypatch, caplog):  # noqa: F811
    for k, v in {"GREQPROF_PCT": "1", "GREQPROF_JSON_LOGS": "1",
                 "GREQPROF_CALLS": "1", "GREQPROF_BLOCKING_MS": "50"}.items():
        monkeypatch.setenv(k, v)
    caplog.set_level(logging.INFO, logger=LOGGER)
    s = serve(json_app)
    assert s.get("/plain", headers=[("X-Request-ID", "rid-plain")]).status \
        == 200
    assert s.get("/block", headers=[("X-Request-ID", "rid-block")]).status \
        == 200
    s.wait_profiles(2)
    # other greenlets (the client's, greqprof's drain loop) may hold a busy
    # machine's loop past 50 ms too: wait for, and judge, the /block ones
    wait_for(lambda: any("rid-block" in m
                         for m in messages(caplog, logging.WARNING)),
             what="rid-block WARNING")
    gevent.sleep(0.1)
    docs = documented_keys()
    profiles, events = {}, []
    for rec in caplog.records:
        if rec.name != LOGGER:
            continue
        line = rec.getMessage()
        assert "\n" not in line
        d = json.loads(line)
        if rec.levelno == logging.INFO:
            assert d["schema"] == SCHEMA == "greqprof.request_profile/1"
            profiles[d["request_id"]] = d
        else:
            assert rec.levelno == logging.WARNING
            assert d["schema"] == "greqprof.blocking/1"
            events.append(d)
    assert set(profiles) == {"rid-plain", "rid-block"}
    mine = [e for e in events if e["request_id"] == "rid-block"]
    assert mine and all(e["path"] == "/block" for e in mine)
    # the 80 ms hold itself is among them
    assert any(e["wall"] >= 0.075 for e in mine), mine
    host = socket.gethostname()
    for d in list(profiles.values()) + events:
        assert d["pid"] == os.getpid() and d["hostname"] == host
    # every key documented, nothing documented that is not there
    for e in events:
        assert set(e) == section(docs, "greqprof.blocking/1")
    for d in profiles.values():
        assert set(d) == section(docs, "greqprof.request_profile/1")
        assert set(d["waiting"]) == section(docs, "`waiting`")
        for sp in d["spans"] + [d["longest_span"]]:
            assert set(sp) == section(docs, "`spans[]`")
        for g in d["greenlets"]:
            assert set(g) == section(docs, "`greenlets[]`")
        for w in d["waiting"]["top"]:
            assert set(w) == section(docs, "`waiting.top[]`")
        for f in d["calls"]:
            assert set(f) == section(docs, "`calls[]`")
            for c in f["children"]:
                assert set(c) == section(docs, "`calls[].children[]`")
        for b in d["blocking"]:
            assert set(b) == section(docs, "greqprof.blocking/1")
    block = profiles["rid-block"]
    assert block["blocking"] == mine
    assert len(block["greenlets"]) == 2
    assert any(f["children"] for f in block["calls"])
    assert any(d["waiting"]["top"] for d in profiles.values())


# ---------------------------------------------------------------------------
# errors a newcomer reads

@pytest.mark.parametrize("given", [["JSON"], "Trace", ["json", "nope"]])
def test_bad_format_name_is_named_with_the_known_ones(given, tmp_path):
    """formats=["JSON"] said only "must be a list of format names"."""
    for where in ({}, {"profile_dir": str(tmp_path)}):
        with pytest.raises(ConfigError) as e:
            ProfilingMiddleware(app, environ={}, formats=given, **where)
        text = str(e.value)
        bad = [x for x in (given if isinstance(given, list) else [given])
               if x != "json"][0]
        assert text.startswith("formats must be a list of 1 to 32 of: ")
        assert "unknown format %r" % bad in text, text
        assert "json, offcpu, pprof, pstats" in text and "lower case" in text
        if bad.lower() in ("json", "trace"):
            assert "did you mean %r?" % bad.lower() in text, text
    with pytest.raises(ConfigError) as e:
        mw_from({"GREQPROF_FORMATS": "JSON",
                 "GREQPROF_PROFILE_DIR": str(tmp_path)})
    assert "GREQPROF_FORMATS='JSON'" in str(e.value)
    assert "did you mean 'json'?" in str(e.value)


def test_empty_formats_says_what_to_pass_instead(tmp_path):
    """The docs give formats 1 to 32 names: [] is an error saying how to
    get json files (formats=None) or none (no profile_dir)."""
    for where in ({}, {"profile_dir": str(tmp_path)}):
        with pytest.raises(ConfigError) as e:
            ProfilingMiddleware(app, environ={}, formats=[], **where)
        assert "formats must be" in str(e.value)
        assert "empty (formats=None, the default, writes json; leave " \
               "profile_dir unset to write no files), got []" \
            in str(e.value), str(e.value)
    assert formats(mw_from({}, profile_dir=str(tmp_path),
                           formats=None)) == ["json"]


def test_name_flags_names_the_command_lines_flags():
    flags = {"blocking_ms": "--blocking-ms", "formats": "--formats",
             "profile_dir": "--profile-dir", "calls": "--calls"}
    off = {"blocking_ms": "0"}

    def named(text):
        return str(gconfig.name_flags(ConfigError(text), flags, off))

    with pytest.raises(ConfigError) as e:
        gconfig.check("blocking_ms", -5)
    assert "or None (0 or off in the environment)" in str(e.value)
    assert named(str(e.value)) == (
        "--blocking-ms must be a number from 0.001 to 3600000 "
        "milliseconds, or 0 (off), got -5")
    assert named("formats needs profile_dir") == \
        "--formats needs --profile-dir"
    assert named("formats: 'pstats' needs function statistics; enable "
                 "calls=True") == ("--formats: 'pstats' needs function "
                                   "statistics; enable --calls")
    # (quoted values and other options' messages are left as they are)
    assert named("profile_dir '/tmp/formats' cannot be created: "
                 "'/tmp/formats'") == ("--profile-dir '/tmp/formats' "
                                       "cannot be created: '/tmp/formats'")
    env = ("GREQPROF_STACK_HZ='x': must be a number from 0 to 1000, "
           "or None (0 or off in the environment): not a number")
    assert named(env) == env


def test_name_flags_leaves_the_value_as_given():
    """A value _show cut at 80 characters lost its closing quote: the
    flags were named inside it ("got '--pct,json,...")."""
    flags = {"pct": "--pct", "calls": "--calls", "formats": "--formats",
             "blocking_ms": "--blocking-ms", "profile_dir": "--profile-dir"}

    def named(text):
        return str(gconfig.name_flags(ConfigError(text), flags))

    given = "pct,%sblocking_ms" % ("json," * 20)
    with pytest.raises(ConfigError) as e:
        gconfig.check("formats", given)
    text = named(str(e.value))
    assert text.startswith("--formats must be a list of 1 to 32 of: ")
    assert text.endswith(", got %s...[%d more]" % (
        repr(given)[:80], len(repr(given)) - 80)), text
    with pytest.raises(ConfigError) as e:
        gconfig.check("profile_dir", "calls " + "x" * 4100)
    text = named(str(e.value))
    assert text.startswith("--profile-dir must be a directory path")
    assert ", got 'calls xxx" in text, text
    # (after ", got ": never; a cut quoted value elsewhere is left too)
    assert named("pct must be 1, got calls") == "--pct must be 1, got calls"
    assert named("formats: 'calls pct...[9 more] needs calls=True") == \
        "--formats: 'calls pct...[9 more] needs --calls"
    assert named('formats: "it\'s calls\\...[3 more] needs calls') == \
        '--formats: "it\'s calls\\...[3 more] needs --calls'
    assert named("profile_dir 'a, got calls' needs calls") == \
        "--profile-dir 'a, got calls' needs --calls"


@pytest.mark.parametrize("given", [
    b"json", bytearray(b"json"), memoryview(b"json"), {"json": 1},
    types.MappingProxyType({"json": 1}), 5])
def test_formats_refuses_bytes_and_mappings(given, tmp_path):
    """bytes said "unknown format 106" (a list of ints); a dict was
    taken for its keys."""
    with pytest.raises(ConfigError) as e:
        ProfilingMiddleware(app, environ={}, formats=given,
                            profile_dir=str(tmp_path))
    text = str(e.value)
    assert text.startswith("formats must be a list of 1 to 32 of: ")
    assert "(lower case): type %s, not a list, got " \
        % type(given).__name__ in text, text


def test_formats_set_is_sorted(tmp_path):
    """A set is taken, in sorted order (its own order changes from run
    to run with the string hash; here it is the reverse one)."""
    class Backwards(set):
        def __iter__(self):
            return iter(sorted(set.__iter__(self), reverse=True))

    for given in (Backwards({"trace", "json", "html"}),
                  frozenset({"text", "json"})):
        assert gconfig.check("formats", given) == sorted(given)
        assert formats(mw_from({}, profile_dir=str(tmp_path),
                               formats=given)) == sorted(given)
