"""Issue 16's output items, through real gevent.pywsgi servers: visible by
default (4), blocking WARNINGs that do not flood (5), bounded JSON lines
(6), docs and help that work when pasted (8).  The report itself (2, 7) is
tested in test_report.py."""
import inspect
import json
import re
import logging
import os
import subprocess
import sys
import textwrap
import time

import gevent
import pytest

from conftest import CHILD_CWD, child_env
from greqprof import BlockingEvent, ProfilingMiddleware
from greqprof.blocking import BlockingSites, blocking_site

from test_middleware import (LOGGER, make_function, messages, serve,  # noqa
                             wait_for)

pytestmark = pytest.mark.timeout(90)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------
# item 4: visible by default (subprocesses: a clean logging state each)

SCRIPT = textwrap.dedent('''
    import logging, sys, time
    import gevent
    from gevent import pywsgi, socket
    from greqprof import ProfilingMiddleware

    MODE = sys.argv[1]
    if MODE == "user-before":
        logging.basicConfig(level=logging.INFO, format="USER %(message)s")
    if MODE == "user-warning":
        logging.basicConfig(level=logging.WARNING, format="USER %(message)s")

    def app(environ, start_response):
        if environ["PATH_INFO"] == "/block":
            time.sleep(0.15)     # not patched: holds the loop
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    mw = ProfilingMiddleware(app, pct=1.0, linger=0, blocking_ms=100)
    server = pywsgi.WSGIServer(("127.0.0.1", 0), mw, log=None)
    server.start()

    def get(path):
        s = socket.create_connection(("127.0.0.1", server.server_port))
        s.sendall(("GET %s HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n" % path).encode())
        while s.recv(65536):
            pass
        s.close()
        gevent.sleep(0.05)

    get("/first")
    if MODE == "user-after":
        logging.basicConfig(level=logging.INFO, format="USER %(message)s")
    get("/second")
    get("/block")
    server.stop()
''')


def _run(tmp_path, mode, **greqprof_env):
    script = tmp_path / "visible.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in child_env().items()
           if not k.startswith("GREQPROF_")}
    env.update(greqprof_env)
    r = subprocess.run([sys.executable, str(script), mode],
                       capture_output=True, timeout=60, cwd=CHILD_CWD,
                       env=env)
    assert r.returncode == 0, r.stderr.decode()
    return r.stderr.decode()


def test_reports_and_warnings_reach_stderr_without_logging_config(tmp_path):
    err = _run(tmp_path, "none")
    assert err.count(">>> Begin RequestProfile") == 3
    assert "  Path: /first" in err and "  Path: /second" in err
    assert "INFO [greqprof] >>> Begin RequestProfile" in err
    assert "WARNING [greqprof] Blocking span: " in err
    assert "during GET /block" in err


def test_json_logs_through_the_default_handler_are_one_object_a_line(
        tmp_path):
    """GREQPROF_JSON_LOGS=1 and no logging configured: greqprof's stderr
    handler prints the bare message, so every line is one JSON object a
    log shipper (or ``greqprof view``) reads as it is.  (Before: each line
    began with a time stamp, level and logger name.)"""
    err = _run(tmp_path, "none", GREQPROF_JSON_LOGS="1")
    lines = err.splitlines()
    objs = [json.loads(line) for line in lines]   # (each one whole)
    assert len(objs) == 4 and len(lines) == 4
    assert sum("blocking" in json.dumps(o) and "/block" in json.dumps(o)
               for o in objs) >= 1


def test_the_applications_logging_config_wins(tmp_path):
    err = _run(tmp_path, "user-before")
    assert err.count(">>> Begin RequestProfile") == 3
    assert err.count("USER >>> Begin RequestProfile") == 3
    assert "[greqprof]" not in err
    assert "USER Blocking span: " in err


def test_a_config_at_warning_level_hides_reports(tmp_path):
    err = _run(tmp_path, "user-warning")
    assert ">>> Begin RequestProfile" not in err
    assert err.count("USER Blocking span: ") == 1


def test_logging_configured_after_first_use_wins_from_then_on(tmp_path):
    err = _run(tmp_path, "user-after")
    # the first report through greqprof's handler, then only the user's
    assert err.count("INFO [greqprof] >>> Begin RequestProfile") == 1
    assert err.count("USER >>> Begin RequestProfile") == 2
    assert err.count(">>> Begin RequestProfile") == 3
    assert "  Path: /second" in err
    assert "[greqprof] Blocking" not in err


# ---------------------------------------------------------------------------
# item 5: at most one blocking WARNING per site per interval

# time.sleep is not monkey-patched: it holds the event loop.  The switch
# right after it is on the same line, so the watchdog's stack (taken during
# the sleep) and the switch-out stack name the same site.
def _hold_the_loop():
    time.sleep(0.11); gevent.sleep(0)  # noqa: E702


def _hold_elsewhere():
    time.sleep(0.11); gevent.sleep(0)  # noqa: E702


def flood_app(environ, start_response):
    if environ["PATH_INFO"] == "/flood":
        for _ in range(4):
            _hold_the_loop()    # four blocking spans at one site
        _hold_elsewhere()
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


def _blocking_lines(caplog):
    return [m for m in messages(caplog, logging.WARNING)
            if m.startswith("Blocking span:")]


def test_one_warning_per_site_then_a_summary(serve, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    s = serve(flood_app, pct=1.0, blocking_ms=100, blocking_interval=1.0)
    s.get("/flood")
    p = s.profile_for("/flood")
    # every event counted and attached to the profile
    assert len(p.blocking) == 5
    assert s.mw.stats["blocking"] == 5
    warned = _blocking_lines(caplog)
    assert len(warned) == 2, warned
    assert any("_hold_the_loop" in w for w in warned)
    assert any("_hold_elsewhere" in w for w in warned)
    # the request's own greenlet is named after the request (item 7)
    assert {b.greenlet_name for b in p.blocking} == {"GET /flood"}
    assert all(re.match(r"Blocking span: _hold_(the_loop|elsewhere) \(.*"
                        r"test_output\.py:\d+\) held the event loop for .* "
                        r"during GET /flood, greenlet \d+ \(gevent\."
                        r"baseserver\._handle_and_close_when_done\)$",
                        w.split("\n")[0]) for w in warned), warned
    assert s.mw.stats["blocking_not_logged"] == 3
    # after the interval, the drain loop (every second) sums up the rest
    wait_for(lambda: [m for m in messages(caplog, logging.WARNING)
                      if m.startswith("Blocking spans not logged")],
             10, "the summary line")
    summary = [m for m in messages(caplog, logging.WARNING)
               if m.startswith("Blocking spans not logged")]
    assert len(summary) == 1
    assert summary[0].startswith("Blocking spans not logged: 3 more at "
                                 "_hold_the_loop (")
    assert "test_output.py:" in summary[0]
    assert "(the longest 1" in summary[0]      # ms: at least 110
    # a new interval: the next one is logged again
    s.get("/flood")
    wait_for(lambda: len(_blocking_lines(caplog)) == 4, 10, "4 warnings")


def test_blocking_interval_0_logs_every_one(serve, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    s = serve(flood_app, pct=0.0, blocking_ms=100, blocking_interval=0)
    s.get("/flood")
    wait_for(lambda: len(_blocking_lines(caplog)) == 5, 10, "5 warnings")
    assert s.mw.stats["blocking_not_logged"] == 0


def _event(stack=None, sampled=None, fn="app.f"):
    return BlockingEvent(greenlet_id=3, greenlet_name="Greenlet",
                         fn_name=fn, start=0.0, end=0.2, wall=0.2, cpu=0.2,
                         stack=stack, sampled_stack=sampled)


def test_site_is_the_innermost_app_frame():
    gevent_dir = os.path.dirname(gevent.__file__)
    stack = ('  File "/srv/app.py", line 10, in view\n'
             '  File "/srv/db.py", line 42, in query\n'
             '  File "%s/hub.py", line 129, in sleep\n' % gevent_dir)
    assert blocking_site(_event(stack=stack)) == "query (/srv/db.py:42)"
    other = '  File "/srv/app.py", line 11, in other\n'
    assert blocking_site(_event(stack=stack, sampled=other)) == \
        "other (/srv/app.py:11)"
    assert blocking_site(_event()) == "app.f"


def test_site_table_is_bounded():
    sites = BlockingSites(10.0)
    for i in range(5 * BlockingSites.MAX):
        ev = _event(fn="app.f%d" % i)
        assert sites.admit(ev, 1.0)
        assert not sites.admit(ev, 1.5)
    assert len(sites.sites) <= BlockingSites.MAX
    summed = sites.expired(2.0)
    assert len(summed) >= 4 * BlockingSites.MAX - BlockingSites.MAX // 4
    assert all(n == 1 for _site, n, _l, _i in summed)


@pytest.mark.parametrize("bad", [-1, "10", float("nan"), True])
def test_blocking_interval_is_validated(bad):
    from greqprof.errors import ConfigError
    with pytest.raises(ConfigError, match="blocking_interval"):
        ProfilingMiddleware(flood_app, blocking_interval=bad)


# ---------------------------------------------------------------------------
# item 6: bounded JSON lines

FUNCS = [make_function("distinct_%d" % i) for i in range(3000)]


def many_calls_app(environ, start_response):
    for f in FUNCS:
        f()
    for _ in range(300):
        gevent.sleep(0)
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


def _json_infos(caplog):
    return [m for m in messages(caplog, logging.INFO) if m.startswith("{")]


@pytest.mark.parametrize("limit", [None, 20000])
def test_json_log_line_is_bounded(serve, caplog, limit):
    caplog.set_level(logging.INFO, logger=LOGGER)
    kw = {} if limit is None else {"json_max_bytes": limit}
    s = serve(many_calls_app, pct=1.0, calls=True, json_logs=True,
              max_spans=5000, **kw)
    s.get("/many")
    p = s.profile_for("/many")
    wait_for(lambda: _json_infos(caplog), 10, "the JSON line")
    line = _json_infos(caplog)[0]
    limit = limit or 65536
    assert len(line.encode("utf-8")) <= limit
    d = json.loads(line)
    assert d["schema"] == "greqprof.request_profile/1"
    full = p.to_dict()
    assert len(json.dumps(full)) > 2 * limit      # (the test means it)
    cut = d["cut"]
    assert cut["calls"] == len(full["calls"]) - len(d["calls"]) > 0
    assert cut["spans"] == len(full["spans"]) - len(d["spans"])
    # the top entries are kept
    if d["calls"]:
        assert d["calls"][0]["ttot"] == full["calls"][0]["ttot"]
    if cut["spans"]:
        kept = min(x["wall"] for x in d["spans"])
        assert kept >= sorted(x["wall"] for x in full["spans"])[
            cut["spans"] - 1]
    # the sink got everything
    assert len(p.calls) >= 3000


def test_small_json_line_is_not_cut(serve, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    s = serve(flood_app, pct=1.0, json_logs=True, blocking_ms=None)
    s.get("/small")
    p = s.profile_for("/small")
    wait_for(lambda: _json_infos(caplog), 10, "the JSON line")
    d = json.loads(_json_infos(caplog)[0])
    assert "cut" not in d
    assert d == json.loads(p.to_json())


# ---------------------------------------------------------------------------
# item 8: what users paste

def test_help_shows_real_defaults():
    import pydoc
    text = pydoc.render_doc(ProfilingMiddleware, renderer=pydoc.plaintext)
    assert "<default>" not in text
    sig = inspect.signature(ProfilingMiddleware)
    assert sig.parameters["pct"].default == 0.05
    assert sig.parameters["blocking_ms"].default == 100
    assert sig.parameters["linger"].default == 1.0
    assert sig.parameters["blocking_interval"].default == 10.0
    assert sig.parameters["json_max_bytes"].default == 65536


def test_blocking_event_json_starts_with_schema():
    line = json.dumps(_event().to_dict())
    assert line.startswith('{"schema": "greqprof.blocking/1", ')


def test_serve_a_file_path_says_use_module_app(tmp_path):
    (tmp_path / "myapp.py").write_text("app = lambda e, s: []\n")
    r = subprocess.run([sys.executable, "-m", "greqprof", "serve",
                        str(tmp_path / "myapp.py")], capture_output=True,
                       timeout=30, cwd=CHILD_CWD, env=child_env())
    assert r.returncode == 2
    assert "serve myapp:app" in r.stderr.decode()


def test_viewing_md_python_snippet_runs_as_pasted(serve, tmp_path):
    """docs/viewing.md's "From Python" block, pasted into a fresh
    interpreter next to a saved profile, runs."""
    s = serve(flood_app, pct=1.0)
    s.get("/saved")
    s.profile_for("/saved").save(str(tmp_path / "req.json"))
    with open(os.path.join(ROOT, "docs", "viewing.md"),
              encoding="utf-8") as f:
        code = re.search(r"## From Python\n\n```python\n(.*?)```", f.read(),
                         re.S).group(1)
    (tmp_path / "snippet.py").write_text(code)
    r = subprocess.run([sys.executable, "snippet.py"], capture_output=True,
                       timeout=60, cwd=str(tmp_path), env=child_env())
    assert r.returncode == 0, r.stderr.decode()
    assert (tmp_path / "req.pstats").stat().st_size > 0
    assert json.loads((tmp_path / "req.json").read_text())["path"] == \
        "/saved"


def test_waited_at_section_lists_the_top_sites():
    """The report's "Waited at" section (issue 16, item 2) from wait
    records (their producer is the waits work: records with fn_name,
    filename, lineno, stack, seconds, count, greenlets)."""
    from collections import namedtuple
    from greqprof import RequestProfile, Waiting
    from greqprof.report import render_waits
    W = namedtuple("W", "fn_name filename lineno stack seconds count "
                        "greenlets")
    waits = [W("wait_upstream", "/srv/app.py", 12, (), 0.0412, 3, 2),
             W("read_slow\nsocket", "/srv/net.py", 40, (), 0.0051, 1, 1)]
    waits += [W("f%d" % i, "/srv/x.py", i, (), 0.001, 1, 1)
              for i in range(6)]
    assert render_waits((), 5) == []
    lines = render_waits(waits, 5)
    assert lines[0] == ("Waited at: (top 5 of 8 sites; time each greenlet "
                        "of the request was switched out there, summed)")
    assert lines[1].split() == ["41.2", "ms", "3", "waits", "2",
                                "greenlets", "wait_upstream",
                                "(/srv/app.py:12)"]
    assert "read_slow\\x0asocket (/srv/net.py:40)" in lines[2]
    assert " 1 wait " in lines[2] and " 1 greenlet " in lines[2]
    assert len(lines) == 6
    more = render_waits(waits[:1], 5, dropped=7)
    assert more[-1] == ("  (7 waits at further sites not recorded: the "
                        "table of sites was full)")
    p = RequestProfile(method="GET", path="/w", status="200 OK", start=0.0,
                       end=0.05, wall=0.05, cpu=None, spans=[],
                       longest_span=None, calls=None,
                       waiting=Waiting(seconds=0.046))
    p.waits = waits
    text = p.report()
    assert "\nWaited at: (top 5 of 8 sites; " in text
    assert text.index("Waiting:") < text.index("Waited at") < \
        text.index("<<< End")


def test_an_event_whose_warning_failed_is_let_through_again():
    """A handler that raised (GreenletExit: the drain requeues the event)
    must not leave the site marked as logged."""
    sites = BlockingSites(10.0)
    ev = _event(fn="app.f")
    first = sites.admit(ev, 1.0)
    assert first
    sites.undo(first)
    again = sites.admit(ev, 1.1)
    assert again
    assert not sites.admit(ev, 1.2)       # now it was logged
    # an interval with held-back events: undo keeps their count
    later = sites.admit(ev, 20.0)
    assert later and sites.pending        # the summary of the last interval
    sites.undo(later)
    assert sites.admit(ev, 20.1)


def test_the_default_handler_is_not_added_when_logging_is_configured(
        serve, caplog):
    """caplog's handler sits on the root logger: the hierarchy has one,
    so greqprof adds none."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    s = serve(flood_app, pct=1.0)
    s.get("/x")
    s.profile_for("/x")
    wait_for(lambda: messages(caplog, logging.INFO), 10, "the report")
    from greqprof.logs import DefaultHandler
    c = logging.getLogger(LOGGER)
    while c is not None:
        assert not any(isinstance(h, DefaultHandler) for h in c.handlers)
        c = c.parent


def test_a_report_no_handler_would_print_is_not_rendered(serve,
                                                         monkeypatch):
    """isEnabledFor(INFO) is true, but the only handler takes WARNING and
    up: the report is not rendered (it would be thrown away)."""
    from greqprof import report
    rendered = []
    real = report.render_text

    def counting(*a, **kw):
        rendered.append(1)
        return real(*a, **kw)
    monkeypatch.setattr(report, "render_text", counting)
    log = logging.getLogger("greqprof.test_no_emit")
    log.propagate = False
    log.setLevel(logging.INFO)
    h = logging.StreamHandler(sys.stderr)
    h.setLevel(logging.WARNING)
    log.addHandler(h)
    try:
        s = serve(flood_app, pct=1.0, logger=log)
        s.get("/a")
        s.profile_for("/a")
        assert s.mw.stats["delivered"] == 1
        assert rendered == []
        h.setLevel(logging.INFO)
        s.get("/b")
        s.profile_for("/b")
        wait_for(lambda: rendered, 10, "the report rendered")
    finally:
        log.removeHandler(h)
