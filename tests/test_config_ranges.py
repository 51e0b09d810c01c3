"""Every option and every GREQPROF_* variable against its documented range
(issue 15, item 4): values that used to escape validation (OverflowError,
ValueError, TypeError naming nothing, or accepted and then failing every
request) are ConfigErrors naming the option or variable; what is accepted
works."""
import logging

import pytest

from greqprof import ConfigError, ProfilingMiddleware
from greqprof import config as gconfig

from test_middleware import serve  # noqa: F401

pytestmark = pytest.mark.timeout(60)


def app(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


#: (variable, raw value): each from the issue or its family
BAD_VARIABLES = [
    ("GREQPROF_BLOCKING_MS", "1e308"),
    ("GREQPROF_BLOCKING_MS", "3600001"),
    ("GREQPROF_MAX_SPANS", str(2 ** 63)),
    ("GREQPROF_MAX_SPANS", str(2 ** 62)),
    ("GREQPROF_MAX_SPANS", "1_000"),
    ("GREQPROF_MAX_SPANS", "\uff11\uff10"),          # fullwidth digits
    ("GREQPROF_MAX_SPANS", "\u0661\u0660"),          # Arabic-Indic digits
    ("GREQPROF_PCT", "\u0660.5"),
    ("GREQPROF_PCT", "0_.5"),
    ("GREQPROF_LINGER", "1_0"),
    ("GREQPROF_LINGER", "1e10"),
    ("GREQPROF_PROFILE_DIR", "/tmp/greqprof\x00x"),
    ("GREQPROF_LOGGER", "app\x1b[2J"),
    ("GREQPROF_LOGGER", "x" * 201),
    ("GREQPROF_TRIGGER_HEADER", "X Profile"),
    ("GREQPROF_TRIGGER_HEADER", "X-Pr\u00f6file"),
    ("GREQPROF_FORMATS", "json,../../etc"),
    # accepted and then silently broken (review of issue 15):
    ("GREQPROF_BLOCKING_MS", "1e-7"),       # blocking_ns 0: off
    ("GREQPROF_BLOCKING_MS", "0.0009"),
    ("GREQPROF_BLOCKING_MS", "1e-400"),     # a float 0.0: off
    ("GREQPROF_TRIGGER_HEADER", "Content-Type"),     # never HTTP_*
    ("GREQPROF_TRIGGER_HEADER", "content-length"),
]


@pytest.mark.parametrize("var,raw", BAD_VARIABLES,
                         ids=["%s=%r" % vr for vr in BAD_VARIABLES])
def test_bad_variable_is_a_config_error_naming_it(var, raw, tmp_path):
    env = {var: raw}
    if var == "GREQPROF_FORMATS":
        env["GREQPROF_PROFILE_DIR"] = str(tmp_path)
    if var == "GREQPROF_TRIGGER_HEADER":
        env["GREQPROF_TRIGGER_SECRET"] = "s3cret-value-42"
    with pytest.raises(ConfigError) as e:
        ProfilingMiddleware(app, environ=env)
    assert var in str(e.value)
    assert str(e.value).isprintable()


#: (keyword arguments, the option the error must name)
BAD_OPTIONS = [
    ({"max_open": 2 ** 40}, "max_open"),
    ({"max_open": 1000001}, "max_open"),
    ({"linger": 1e10}, "linger"),
    ({"linger": 61}, "linger"),
    ({"linger": float("inf")}, "linger"),
    ({"logger": 123}, "logger"),
    ({"logger": ""}, "logger"),
    ({"max_spans": 2 ** 62}, "max_spans"),
    ({"max_spans": gconfig.MAX_SPANS + 1}, "max_spans"),
    ({"blocking_ms": 1e308}, "blocking_ms"),
    ({"blocking_ms": 2 ** 2000}, "blocking_ms"),
    ({"blocking_ms": float("nan")}, "blocking_ms"),
    ({"pct": float("nan")}, "pct"),
    ({"pct": 2 ** 2000}, "pct"),
    ({"calls": "yes"}, "calls"),
    ({"json_logs": "no"}, "json_logs"),
    ({"report": "no"}, "report"),
    ({"stacks": None}, "stacks"),
    ({"watchdog": 2}, "watchdog"),
    ({"clock": b"cpu"}, "clock"),
    ({"seed": object()}, "seed"),
    ({"profile_dir": "/tmp/greqprof\x00x"}, "profile_dir"),
    ({"profile_dir": 42}, "profile_dir"),
    ({"formats": 42, "profile_dir": "{tmp}"}, "formats"),
    ({"formats": ["json\n"], "profile_dir": "{tmp}"}, "formats"),
    ({"trigger_header": "X Y", "trigger_secret": "s3cret-value-42"},
     "trigger_header"),
    ({"trigger_header": "X-T", "trigger_secret": "s3cret-\udcff-value"},
     "trigger_secret"),
    ({"ui_path": "/x\x00", "pct": 0.0}, "ui_path"),
    ({"ui_path": "/_g", "ui_keep": 2 ** 40}, "ui_keep"),
    ({"ui_path": "/_g", "ui_token": "t\udcff" * 8}, "ui_token"),
    # accepted and then silently broken (review of issue 15):
    ({"blocking_ms": 1e-7}, "blocking_ms"),      # blocking_ns 0: off
    ({"blocking_ms": 5e-324}, "blocking_ms"),
    ({"blocking_ms": 0.0009}, "blocking_ms"),
    ({"trigger_header": "Content-Type", "trigger_secret": "s3cret-value-42"},
     "trigger_header"),
    ({"trigger_header": "CONTENT-LENGTH",
      "trigger_secret": "s3cret-value-42"}, "trigger_header"),
    # servers strip a header value's ends: never equal to the secret
    ({"trigger_header": "X-T", "trigger_secret": " s3cret-value-42"},
     "trigger_secret"),
    ({"trigger_header": "X-T", "trigger_secret": "s3cret-value-42\t"},
     "trigger_secret"),
    ({"ui_path": "/_g", "ui_token": "s3cret-token "}, "ui_token"),
    # PATH_INFO is decoded and browsers drop dot segments: never reached
    ({"ui_path": "/_g%41"}, "ui_path"),
    ({"ui_path": "/a/../_g"}, "ui_path"),
    ({"ui_path": "/./_g"}, "ui_path"),
    ({"ui_path": "/_g/.."}, "ui_path"),
    # an empty ui_allow lets no address in
    ({"ui_path": "/_g", "ui_allow": []}, "ui_allow"),
]


@pytest.mark.parametrize("kw,option", BAD_OPTIONS,
                         ids=["%s" % o for _, o in BAD_OPTIONS])
def test_bad_option_is_a_config_error_naming_it(kw, option, tmp_path):
    kw = {k: (str(tmp_path) if v == "{tmp}" else v) for k, v in kw.items()}
    with pytest.raises(ConfigError) as e:
        ProfilingMiddleware(app, environ={}, **kw)
    assert option in str(e.value)
    assert str(e.value).isprintable()
    assert "s3cret" not in str(e.value) and "\udcff" not in str(e.value)


def test_smallest_blocking_ms_is_on(serve):
    """The documented minimum, 0.001 ms, is a threshold of 1000 ns (below
    it, int(blocking_ms * 1e6) used to be 0: off); 0 and None are off."""
    assert ProfilingMiddleware(app, environ={}, blocking_ms=0.001) \
        .config.blocking_ns == 1000
    assert ProfilingMiddleware(app, environ={
        "GREQPROF_BLOCKING_MS": "0.001"}).config.blocking_ns == 1000
    for off in ("0", "0.0", "-0", "off", ""):
        assert ProfilingMiddleware(app, environ={
            "GREQPROF_BLOCKING_MS": off}).config.blocking_ns == 0
    assert ProfilingMiddleware(app, environ={}, blocking_ms=None) \
        .config.blocking_ns == 0


def test_linger_assignment_is_checked_too():
    mw = ProfilingMiddleware(app, environ={})
    with pytest.raises(ConfigError, match="linger"):
        mw.linger = 1e10
    assert mw.linger == 1.0


def test_every_option_has_a_documented_range():
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "production.md"),
              encoding="utf-8") as f:
        doc = f.read()
    for opt, spec in gconfig.OPTIONS.items():
        assert spec.doc, opt
        assert "`%s`" % opt in doc, "docs/production.md lacks %s" % opt
    for var in gconfig.VARIABLES:
        assert "`%s`" % var in doc, "docs/production.md lacks %s" % var


def test_largest_accepted_values_work(serve, tmp_path):
    """What is accepted works: the maxima serve a sampled request (before,
    max_spans=2**62 was accepted and every sampled request then failed
    with GQP_ENOMEM)."""
    s = serve(app, pct=1.0, max_spans=gconfig.MAX_SPANS, max_open=1000000,
              linger=60, blocking_ms=3600000, logger=logging.getLogger("x"))
    s.mw.linger = 0
    s.get("/a")
    s.get("/b")
    profiles = s.wait_profiles(2)
    assert {p.path for p in profiles} == {"/a", "/b"}
    assert s.mw.stats["errors"] == 0
    env = ProfilingMiddleware(app, environ={
        "GREQPROF_MAX_SPANS": str(gconfig.MAX_SPANS),
        "GREQPROF_BLOCKING_MS": "3600000", "GREQPROF_LINGER": "60"})
    assert env.config.max_spans == gconfig.MAX_SPANS


@pytest.mark.parametrize("kw,option", [
    ({"max_spans": 2 ** 62}, "max_spans"), ({"max_spans": 2 ** 33},
                                            "max_spans"),
    ({"cpu_window": 1e308}, "cpu_window"),
    ({"cpu_window": float("nan")}, "cpu_window"),
    ({"stack_threshold": 1e308}, "stack_threshold"),
    ({"stack_threshold": float("inf")}, "stack_threshold"),
    ({"max_depth": 2 ** 40}, "max_depth"),
])
def test_profiler_options_in_range(kw, option, make_profiler):
    """Before: OverflowError or a LibraryError at start()."""
    with pytest.raises(ConfigError, match=option):
        make_profiler(**kw)


def test_profiler_largest_values_work(make_profiler):
    from greqprof import profiler as gprofiler
    prof = make_profiler(max_spans=gprofiler.MAX_SPANS,
                         cpu_window=gprofiler.MAX_CPU_WINDOW,
                         stack_threshold=gprofiler.MAX_STACK_THRESHOLD,
                         max_depth=gprofiler.MAX_DEPTH)
    with prof:
        sum(range(1000))
    assert prof.func_stats() is not None
