"""Text that is not clean UTF-8, end to end (issue 15, item 2).

Lone surrogates (what ``os.fsdecode`` makes of undecodable bytes), C0/C1
controls and bidi/format characters reach greqprof from a path, a request
id, a greenlet name, a function and file name, an exception message, and a
bytes status.  Each goes through a real gevent.pywsgi server; then every
output must work and show the text escaped: the text report through a
strict UTF-8 logging handler, the JSON log line, the inspector's list and
profile pages and downloads, every ``profile_dir`` file, and
``python -m greqprof view`` of the saved JSON in every format.

Environ strings, the status and error texts are recorded by the C request
lifecycle (_sampled.c / _fastpath.c), with the same rule.
"""
import json
import logging
import marshal
import os
import subprocess
import sys
import time
import types

import gevent
import pytest

import greqprof
from conftest import CHILD_CWD, child_env
from greqprof import RequestProfile

from test_middleware import http, wait_for, serve  # noqa: F401

pytestmark = pytest.mark.timeout(120)

UI = "/_greqprof"
BAD = "\udcff\u202e\u2066\x1b[31m\u200b\ufeff"   # what each hostile text holds
GREENLET_NAME = "worker" + BAD
FN_NAME = "handler" + BAD
FILE_NAME = "/srv/app" + BAD + ".py"
ERROR = "boom " + BAD + "\nForged: yes"
RID = "rid" + BAD


def _strange_function():
    def template():
        # (0.1 s of CPU: the watchdog thread must get a CPU and the GIL
        # while it lasts to take the stack, which a loaded machine may
        # delay past 20 ms: a CI run once saw no stack at all)
        t = time.thread_time() + 0.1
        while time.thread_time() < t:   # holds the loop: a blocking span
            pass
        return 1
    names = {"co_name": FN_NAME, "co_filename": FILE_NAME}
    if hasattr(template.__code__, "co_qualname"):   # (3.11+)
        names["co_qualname"] = FN_NAME
    code = template.__code__.replace(**names)
    return types.FunctionType(code, {"time": time}, FN_NAME)


STRANGE = _strange_function()


def app(environ, start_response):
    path = environ["PATH_INFO"]
    g = gevent.Greenlet(STRANGE)
    g.name = GREENLET_NAME
    g.start()
    g.join()
    if path.startswith("/raise"):
        raise ValueError(ERROR)
    if path.startswith("/bytes"):
        start_response(b"200 OK", [("Content-Type", "text/plain")])
    else:
        start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


def outer(mw):
    """What sits between the server and greqprof: in-process code (a
    harness, another middleware) that puts a lone surrogate and bidi
    characters in the environ, and turns a bytes status back into the str
    the server needs."""
    def wrapper(environ, start_response):
        if environ["PATH_INFO"].startswith(("/raise", "/bytes", "/env")):
            environ["PATH_INFO"] += BAD
            environ["HTTP_X_REQUEST_ID"] = RID

        def sr(status, headers, exc_info=None):
            if isinstance(status, bytes):
                status = status.decode("latin-1")
            return start_response(status, headers, exc_info)
        return mw(environ, sr)
    return wrapper


def printable(value, where="profile"):
    """Every string in a to_dict() tree is printable (stacks line by
    line)."""
    if isinstance(value, str):
        for line in value.split("\n"):
            assert line.isprintable(), (where, line)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            printable(v, "%s.%s" % (where, k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            printable(v, "%s[%d]" % (where, i))
    else:
        assert value is None or isinstance(value, (int, float, bool)), \
            (where, value)


@pytest.fixture
def utf8_log(tmp_path):
    """A strict UTF-8 file handler on a logger of its own."""
    name = "greqprof.hostile.%d" % id(tmp_path)
    log = logging.getLogger(name)
    log.propagate = False
    log.setLevel(logging.INFO)
    path = tmp_path / "log.txt"
    h = logging.FileHandler(str(path), encoding="utf-8", errors="strict")
    log.addHandler(h)
    errors = []
    h.handleError = lambda record: errors.append(sys.exc_info()[1])
    yield name, path, errors
    log.removeHandler(h)
    h.close()


def run(serve, utf8_log, tmp_path, targets, **kw):
    name, logpath, errors = utf8_log
    out = tmp_path / "profiles"
    kw.setdefault("ui_path", UI)
    kw.setdefault("calls", True)
    if not kw["calls"]:
        kw["formats"] = ["json", "text", "html", "trace", "speedscope"]
    kw.setdefault("formats", ["json", "text", "html", "trace", "speedscope",
                              "pstats", "callgrind"])
    s = serve(app, wrap=outer, pct=1.0, blocking_ms=5,
              logger=name, profile_dir=str(out), **kw)
    for t in targets:
        http(s.port, t)
    s.wait_profiles(len(targets))
    wait_for(lambda: len(list(out.glob("*.json"))) >= len(targets),
             what="profile files")
    assert s.mw.stats["errors"] == 0
    assert errors == []
    return s, out, logpath.read_text("utf-8")


TARGETS = ["/p%80%0a%e2%80%ae", "/env"]


def test_text_report_json_files_inspector_and_view(serve, utf8_log, tmp_path):
    s, out, log = run(serve, utf8_log, tmp_path, TARGETS)
    # -- the records: all printable, the hostile parts escaped
    for p in s.profiles:
        printable(p.to_dict())
    by_path = {p.path.split("\\")[0]: p for p in s.profiles}
    assert by_path["/p"].path == "/p\\x80\\x0a\u00e2\\x80\u00ae"
    gnames = {g.name for p in s.profiles for g in p.greenlets}
    assert "worker\\udcff\\u202e\\u2066\\x1b[31m\\u200b\\ufeff" in gnames
    fnames = {f.qualname for p in s.profiles for f in p.calls}
    assert "handler\\udcff\\u202e\\u2066\\x1b[31m\\u200b\\ufeff" in fnames
    files = {f.filename for p in s.profiles for f in p.calls}
    assert "/srv/app\\udcff\\u202e\\u2066\\x1b[31m\\u200b\\ufeff.py" in files
    # the blocking event's stack names the function and file, escaped
    stacks = [b.stack or b.sampled_stack or "" for p in s.profiles
              for b in p.blocking]
    assert any("handler\\udcff" in st for st in stacks), stacks
    # -- the text report reached the strict UTF-8 log
    assert log.count(">>> Begin RequestProfile") == len(TARGETS)
    assert "\\udcff" in log and "\u202e" not in log
    # -- the inspector: list, each page, each download
    ids = []
    r = http(s.port, UI + "/")
    assert r.status == 200, r
    for line in r.body.decode("utf-8").split('data-id="')[1:]:
        ids.append(int(line.split('"', 1)[0]))
    assert len(ids) == len(TARGETS)
    for i in ids:
        assert http(s.port, "%s/p/%d" % (UI, i)).status == 200
        assert http(s.port, "%s/p/%d.json" % (UI, i)).status == 200
        for fmt in ("trace", "speedscope", "pstats", "callgrind", "html",
                    "text"):
            assert http(s.port, "%s/p/%d/%s" % (UI, i, fmt)).status == 200
    # -- profile_dir: every file written, every one readable
    for f in out.iterdir():
        assert f.stat().st_size > 0, f
        if f.name.endswith(".pstats"):
            marshal.loads(f.read_bytes())
        elif f.name.endswith((".json",)):
            printable(json.loads(f.read_text("utf-8")))
        elif not f.name.endswith(".pstats"):
            f.read_text("utf-8")
    # -- view, every format, on greqprof's own JSON
    for f in out.glob("*.json"):
        if f.name.endswith((".trace.json", ".speedscope.json")):
            continue
        printable(RequestProfile.load(str(f)).to_dict())
        for fmt in ("text", "html", "trace", "speedscope", "json",
                    "pstats", "callgrind"):
            dest = tmp_path / ("view." + fmt)
            r = subprocess.run([sys.executable, "-m", "greqprof", "view",
                                str(f), "-f", fmt, "-o", str(dest)],
                               capture_output=True, timeout=60,
                               cwd=CHILD_CWD, env=child_env())
            assert r.returncode == 0, (fmt, r.stderr.decode())
        r = subprocess.run([sys.executable, "-m", "greqprof", "view",
                            str(f)], capture_output=True, timeout=60,
                           cwd=CHILD_CWD, env=child_env())
        assert r.returncode == 0, r.stderr.decode()
        r.stdout.decode("utf-8")


def test_exception_message_is_escaped(serve, utf8_log, tmp_path):
    s, _, log = run(serve, utf8_log, tmp_path, ["/raise"])
    p = s.profiles[0]
    assert p.error is not None
    assert "\\udcff\\u202e" in p.error and "\nForged" not in p.error
    assert "\nForged" not in log


def test_environ_strings_are_escaped_on_the_c_path(serve, utf8_log,
                                                   tmp_path):
    # (no inspector: the C path (_sampled.c) records the request)
    # (the first request sets the thread's engine up, in Python)
    s, _, log = run(serve, utf8_log, tmp_path, ["/warm", "/env"],
                    ui_path=None, calls=False)
    p = [p for p in s.profiles if p.path.startswith("/env")][0]
    assert p.path == "/env" + "\\udcff\\u202e\\u2066\\x1b[31m\\u200b\\ufeff"
    assert p.request_id == "rid\\udcff\\u202e\\u2066\\x1b[31m\\u200b\\ufeff"


def test_bytes_status_json_log_and_inspector(serve, utf8_log, tmp_path):
    s, out, log = run(serve, utf8_log, tmp_path, ["/bytes"],
                      json_logs=True)
    p = s.profiles[0]
    assert p.status == "200 OK"
    lines = [json.loads(x) for x in log.splitlines() if x.startswith("{")]
    assert [x["status"] for x in lines
            if x.get("schema", "").startswith("greqprof.request")] == \
        ["200 OK"]
    assert http(s.port, UI + "/").status == 200


def test_hand_made_profile_renders_clean_everywhere(tmp_path):
    """A RequestProfile built in code (not captured, so not cleaned) with
    bidi, surrogate and control characters and an impossible time still
    renders as printable text in every format."""
    from dataclasses import replace
    from greqprof.renderers import RENDERERS
    from test_renderers import synthetic_profile
    p = replace(synthetic_profile(), path="/x" + BAD, error=ERROR,
                method="GET\u202e", start=1e20)
    text = p.report()
    for line in text.split("\n"):
        assert line.isprintable(), line
    assert "\\u202e" in text and "Start time: -" in text
    for name, r in RENDERERS.items():
        out = r.render(p)
        if isinstance(out, str):
            out.encode("utf-8")


def test_profiler_records_are_clean(make_profiler):
    """The whole-process Profiler's records (function, file and greenlet
    names, stacks of long spans) go through the same rule."""
    prof = make_profiler(clock="wall", stack_threshold=0.005)
    with prof:
        g = gevent.Greenlet(STRANGE)
        g.name = GREENLET_NAME
        g.start()
        g.join()
    funcs = {f.qualname: f for f in prof.func_stats()}
    f = funcs["handler\\udcff\\u202e\\u2066\\x1b[31m\\u200b\\ufeff"]
    assert f.filename == \
        "/srv/app\\udcff\\u202e\\u2066\\x1b[31m\\u200b\\ufeff.py"
    names = {s.greenlet_name for s in prof.spans()}
    names |= {g.name for g in prof.greenlet_stats()}
    assert "worker\\udcff\\u202e\\u2066\\x1b[31m\\u200b\\ufeff" in names
    for s in prof.spans():
        printable(s.to_dict(), "span")
    for g in prof.greenlet_stats():
        printable(g.to_dict(), "greenlet")
    for fs in prof.func_stats():
        printable(fs.to_dict(), "func")
    from greqprof.renderers import RENDERERS
    for r in RENDERERS.values():
        out = r.render(prof)
        if isinstance(out, str):
            out.encode("utf-8")


def test_bytes_environ_values_are_latin1_text():
    """A caller that is not PEP 3333 (bytes in the environ): method, path
    and request id are read as latin-1, as a bytes status is, not
    recorded as their repr."""
    got = []

    def app(environ, start_response):
        start_response("200 OK", [])
        return [b"x"]
    mw = greqprof.ProfilingMiddleware(app, pct=1.0, linger=0, report=False,
                                      sink=got.append)

    def call():
        body = mw({"REQUEST_METHOD": b"GET", "PATH_INFO": b"/caf\xe9\x85",
                   "HTTP_X_REQUEST_ID": b"id1"}, lambda *a: None)
        assert list(body) == [b"x"]
        body.close()
    gevent.spawn(call).join()
    assert len(got) == 1
    p = got[0]
    assert (p.method, p.path, p.request_id) == ("GET", "/caf\u00e9\\x85",
                                                "id1")
