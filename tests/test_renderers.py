"""The renderers, each checked by opening its output in its own reader:
pstats.Stats, callgrind_annotate, JSON structure checks for the Chrome
Trace Event and speedscope formats, RequestProfile.load for JSON, and the
HTML page's embedded data.

Profiles come from three places: a hand-made RequestProfile with exact
numbers (recursion, a cycle, a C function, hostile names), real requests
through ProfilingMiddleware on a gevent.pywsgi server in this process, and
the whole-process Profiler."""
import html as htmlmod
import io
import json
import marshal
import os
import pstats
import re
import shutil
import subprocess
import time
from dataclasses import replace

import gevent
import pytest
from gevent import pywsgi

from greqprof import (BlockingEvent, ChildStat, FuncStat, GreenletStat,
                      ProfilingMiddleware, RequestProfile, Span, WaitedOn,
                      Waiting, _registry, engine)
from greqprof.renderers import (RENDERERS, RenderError, as_view,
                                get_renderer, register, render,
                                to_request_profile)
from greqprof.renderers.base import Renderer
from greqprof.renderers.files import ProfileWriter, sanitize_path
from greqprof.renderers.html import fill, script_json
from greqprof.renderers.pstats_renderer import stats_dict
from greqprof.renderers.speedscope import call_tree_samples
from test_middleware import connect

pytestmark = pytest.mark.timeout(60)

CALLGRIND_ANNOTATE = shutil.which("callgrind_annotate") or (
    "/usr/bin/callgrind_annotate"
    if os.path.exists("/usr/bin/callgrind_annotate") else None)
HOSTILE = '</script><script>window.__gq_pwned=1</script><!-- "\'&\u2028'
T0 = 1700000000.0


# ---------------------------------------------------------------------------
# a hand-made profile with exact numbers

def _f(name, line, ncall, ttot, tsub, children=(), nact=None, file="app.py",
       module="app"):
    return FuncStat(name=name, qualname=name, module=module, filename=file,
                    lineno=line, ncall=ncall,
                    nactualcall=ncall if nact is None else nact, ttot=ttot,
                    tsub=tsub, children=tuple(children))


def _c(target, ncall, ttot, tsub, nact=None):
    return ChildStat(name=target.name, qualname=target.qualname,
                     module=target.module, lineno=target.lineno,
                     ncall=ncall,
                     nactualcall=ncall if nact is None else nact,
                     ttot=ttot, tsub=tsub, filename=target.filename)


def synthetic_calls():
    """handler -> work (x2) -> leaf (x4); handler -> sleep (C function);
    handler -> rec, rec -> rec (recursion); handler -> a -> b -> a (cycle).
    Seconds, consistent: ttot = tsub + callees; exclusive times sum to the
    root's 20 ms."""
    leaf = _f("leaf", 30, 4, 0.004, 0.004)
    work = _f("work", 20, 2, 0.010, 0.006, [_c(leaf, 4, 0.004, 0.004)])
    sleep = _f("sleep", 0, 1, 0.002, 0.002, file="~", module="time")
    rec = _f("rec", 40, 3, 0.003, 0.003, nact=1)
    rec = replace(rec, children=(_c(rec, 2, 0.002, 0.002, nact=0),))
    a = _f("a", 50, 2, 0.003, 0.0015, nact=1)
    b = _f("b", 60, 1, 0.002, 0.0015, [_c(a, 1, 0.0005, 0.0005, nact=0)])
    a = replace(a, children=(_c(b, 1, 0.002, 0.0015),))
    handler = _f("handler", 10, 1, 0.020, 0.002, [
        _c(work, 2, 0.010, 0.006), _c(sleep, 1, 0.002, 0.002),
        _c(rec, 1, 0.003, 0.003), _c(a, 1, 0.003, 0.0015)])
    return [handler, work, leaf, a, rec, b, sleep]


def synthetic_profile(path="/items/42", calls=True, hostile=False):
    name = HOSTILE if hostile else "Greenlet-1"
    fn = ("app." + HOSTILE) if hostile else "app.handler"
    stack = '  File "app.py", line 12, in handler\n'
    spans = [
        Span(1, name, fn, T0, T0 + 0.004, 0.004, 0.003, False),
        Span(2, "Greenlet-2", "app.work", T0 + 0.004, T0 + 0.010, 0.006,
             0.006, False),
        Span(3, "Greenlet-3", "app.work", T0 + 0.010, T0 + 0.070, 0.060,
             0.059, True, stack=stack, long=True),
        Span(2, "Greenlet-2", "app.work", T0 + 0.080, T0 + 0.085, 0.005,
             0.004, True),
        Span(1, name, fn, T0 + 0.090, T0 + 0.100, 0.010, 0.002, True),
    ]
    greenlets = [
        GreenletStat(1, name, fn, 0.005, 0.014, 2, True),
        GreenletStat(2, "Greenlet-2", "app.work", 0.010, 0.011, 2, True),
        GreenletStat(3, "Greenlet-3", "app.work", 0.059, 0.060, 1, True),
    ]
    blocking = [BlockingEvent(
        greenlet_id=3, greenlet_name="Greenlet-3", fn_name="app.work",
        start=T0 + 0.010, end=T0 + 0.070, wall=0.060, cpu=0.059,
        stack=stack, sampled_stack='  File "app.py", line 22, in work\n',
        method="GET", path=path, pid=4242, hostname="box")]
    return RequestProfile(
        method="GET", path=path, status="200 OK", start=T0, end=T0 + 0.1,
        wall=0.1, cpu=0.074, spans=spans, longest_span=spans[2],
        waiting=Waiting(0.005, (WaitedOn(9, "Hub", "gevent.hub.Hub.run",
                                         0.005),)),
        calls=synthetic_calls() if calls else None, greenlets=greenlets,
        blocking=blocking, request_id="rid-1", pid=4242, hostname="box")


# ---------------------------------------------------------------------------
# real profiles: requests through the middleware on a real server

def _burn(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _fib(n):
    return n if n < 2 else _fib(n - 1) + _fib(n - 2)


def _worker(n):
    for _ in range(n):
        _burn(0.002)
        gevent.sleep(0)
    return _fib(12)


def _app(environ, start_response):
    path = environ["PATH_INFO"]
    if path == "/block":
        time.sleep(0.06)  # gevent is not monkey-patched: holds the loop
    else:
        gevent.joinall([gevent.spawn(_worker, 2), gevent.spawn(_worker, 1)])
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


def _get(port, target):
    s = connect(port, 10)
    try:
        s.sendall(b"GET " + target.encode("latin-1") +
                  b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return data
            data += chunk
    finally:
        s.close()


@pytest.fixture(scope="module")
def real_profiles():
    """{path: RequestProfile} of real requests (calls=True, 30 ms blocking
    threshold).  The thread's hooks are removed before the tests run."""
    got = []
    mw = ProfilingMiddleware(_app, pct=1.0, calls=True, blocking_ms=30,
                             sink=got.append, report=False, linger=0.05,
                             watchdog=False)
    server = pywsgi.WSGIServer(("127.0.0.1", 0), mw, log=None)
    server.start()
    try:
        for target in ("/", "/block"):
            assert _get(server.server_port, target).startswith(
                b"HTTP/1.1 200")
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            gevent.sleep(0.01)
    finally:
        server.stop(timeout=2)
        deadline = time.monotonic() + 5
        while mw._open and time.monotonic() < deadline:
            gevent.sleep(0.01)
        eng = getattr(engine._local, "engine", None)
        if eng is not None:
            eng.abandon()
        engine.shutdown()
        gevent.sleep(0)
        del _registry.long_spans[:]  # no leftovers for later tests
    assert len(got) == 2, got
    return {p.path: p for p in got}


@pytest.fixture
def process_profiler(make_profiler):
    """A stopped whole-process Profiler that saw a few greenlets."""
    prof = make_profiler(clock="cpu", stack_threshold=0.001)
    prof.start()
    gevent.joinall([gevent.spawn(_worker, 2), gevent.spawn(_worker, 1)])
    prof.stop()
    del _registry.long_spans[:]  # its long spans are not blocking reports
    return prof


def all_profiles(real):
    return [("synthetic", synthetic_profile()),
            ("hostile", synthetic_profile(path="/" + HOSTILE, hostile=True)),
            ("real /", real["/"]), ("real /block", real["/block"])]


# ---------------------------------------------------------------------------
# the registry and the common view

def test_registry_has_every_format_once():
    assert sorted(RENDERERS) == ["callgrind", "html", "json", "offcpu",
                                 "pprof", "pstats", "speedscope", "text",
                                 "trace"]
    for name, r in RENDERERS.items():
        assert isinstance(r, Renderer) and r.name == name
        assert r.extension and not r.extension.startswith(".")
        assert get_renderer(name) is r
    with pytest.raises(ValueError, match="unknown format 'svg'.*callgrind"):
        get_renderer("svg")


def test_register_a_new_renderer():
    class Count(Renderer):
        name = "count-test"
        extension = "txt"

        def render(self, profile):
            return str(len(self.view(profile).spans))
    try:
        register(Count())
        assert render(synthetic_profile(), "count-test") == "5"
    finally:
        RENDERERS.pop("count-test", None)
    with pytest.raises(TypeError):
        register(object())


def test_view_of_request_profiler_and_dict(process_profiler):
    p = synthetic_profile()
    v = as_view(p)
    assert v.kind == "request" and v.title == "GET /items/42"
    assert [g.id for g in v.greenlet_rows()] == [1, 2, 3]
    assert [v.is_blocking(s) for s in v.spans] == [False, False, True,
                                                   False, False]
    assert v.waiting_intervals() == [(T0 + 0.070, T0 + 0.080),
                                     (T0 + 0.085, T0 + 0.090)]
    assert as_view(p.to_dict()).spans == v.spans
    pv = as_view(process_profiler)
    assert pv.kind == "process" and pv.spans and pv.calls
    assert pv.waiting_intervals() == []
    with pytest.raises(TypeError, match="RequestProfile, a Profiler"):
        as_view(42)


def test_calls_needed_for_pstats_and_callgrind():
    p = synthetic_profile(calls=False)
    for name in ("pstats", "callgrind"):
        with pytest.raises(RenderError, match="calls=True"):
            render(p, name)
    for name in ("html", "text", "trace", "speedscope", "json"):
        assert render(p, name)


# ---------------------------------------------------------------------------
# pstats

def load_pstats(tmp_path, data, name="p.pstats"):
    path = tmp_path / name
    path.write_bytes(data)
    out = io.StringIO()
    st = pstats.Stats(str(path), stream=out)
    return st, out


def test_pstats_exact_numbers(tmp_path):
    data = render(synthetic_profile(), "pstats")
    assert isinstance(data, bytes)
    st, out = load_pstats(tmp_path, data)
    s = st.stats
    handler = ("app.py", 10, "handler")
    work = ("app.py", 20, "work")
    leaf = ("app.py", 30, "leaf")
    sleep = ("~", 0, "<built-in method time.sleep>")
    assert s[handler][:4] == (1, 1, 0.002, 0.020)
    assert s[work][:4] == (2, 2, 0.006, 0.010)
    assert s[leaf][4] == {work: (4, 4, 0.004, 0.004)}
    assert s[work][4] == {handler: (2, 2, 0.006, 0.010)}
    assert s[sleep][4] == {handler: (1, 1, 0.002, 0.002)}
    assert s[handler][4] == {}
    rec = ("app.py", 40, "rec")
    assert s[rec][:2] == (1, 3)               # 3 calls, 1 primitive
    assert s[rec][4][rec] == (2, 0, 0.002, 0.002)
    assert st.total_calls == 1 + 2 + 4 + 1 + 3 + 2 + 1
    assert abs(st.total_tt - 0.020) < 1e-9
    st.sort_stats("cumulative").print_stats()
    st.print_callers()
    st.print_callees()
    text = out.getvalue()
    assert "app.py:10(handler)" in text
    assert "{built-in method time.sleep}" in text or \
        "<built-in method time.sleep>" in text
    assert "3/1" in text  # recursive calls shown like cProfile


def test_pstats_like_cprofile_dump(tmp_path):
    """Same shape as a file written by cProfile itself."""
    import cProfile
    pr = cProfile.Profile()
    pr.enable()
    _fib(5)
    pr.disable()
    pr.dump_stats(str(tmp_path / "c.pstats"))
    theirs = marshal.loads((tmp_path / "c.pstats").read_bytes())
    ours = marshal.loads(render(synthetic_profile(), "pstats"))
    for stats in (theirs, ours):
        for key, (cc, nc, tt, ct, callers) in stats.items():
            assert isinstance(key, tuple) and len(key) == 3
            assert isinstance(key[0], str) and isinstance(key[1], int)
            assert all(isinstance(x, (int, float)) for x in (cc, nc, tt, ct))
            for ck, cv in callers.items():
                assert ck in stats and len(cv) == 4


def test_pstats_real_and_process(tmp_path, real_profiles, process_profiler):
    for i, prof in enumerate([real_profiles["/"], process_profiler]):
        st, out = load_pstats(tmp_path, render(prof, "pstats"),
                              "p%d.pstats" % i)
        names = {k[2] for k in st.stats}
        assert "_worker" in names and "_burn" in names and "_fib" in names
        fib = [v for k, v in st.stats.items() if k[2] == "_fib"][0]
        assert fib[1] > fib[0]  # recursive: more calls than primitive
        worker = [k for k in st.stats if k[2] == "_worker"][0]
        burn = [v for k, v in st.stats.items() if k[2] == "_burn"][0]
        assert worker in burn[4]
        st.sort_stats("tottime").print_stats(5)
        st.print_callers(5)


def test_stats_dict_skips_callees_without_entry():
    handler = synthetic_calls()[0]
    stats = stats_dict([handler])  # callees not in the table
    assert list(stats) == [("app.py", 10, "handler")]


# ---------------------------------------------------------------------------
# callgrind

def annotate(tmp_path, text, *args):
    if CALLGRIND_ANNOTATE is None:
        pytest.skip("callgrind_annotate not installed (Debian: apt-get "
                    "install valgrind)")
    path = tmp_path / "callgrind.out.test"
    path.write_text(text)
    r = subprocess.run([CALLGRIND_ANNOTATE, "--threshold=100"] + list(args)
                       + [str(path)],
                       capture_output=True, text=True, timeout=30,
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "WARNING" not in r.stderr, r.stderr
    return r.stdout


def _cost_of(output, name):
    for line in output.splitlines():
        m = re.match(r"\s*([\d,]+)\s+(?:\([^)]*\)\s+)?(\S+)$", line)
        if m and m.group(2).endswith(":" + name):
            return int(m.group(1).replace(",", ""))
    raise AssertionError("%s not in:\n%s" % (name, output))


def test_callgrind_format_lines():
    text = render(synthetic_profile(), "callgrind")
    lines = text.splitlines()
    assert lines[0] == "# callgrind format"
    assert "events: us" in lines
    assert "positions: line" in lines
    assert "fn=(1) app.handler" in lines
    # handler -> work: 2 calls, inclusive 10000 us from handler's line
    i = lines.index("cfn=(2) app.work")
    assert lines[i + 1] == "calls=2 20" and lines[i + 2] == "10 10000"
    assert "summary: 20000" in lines and "totals: 20000" in lines
    assert get_renderer("callgrind").filename("x") == "callgrind.out.x"


def test_callgrind_annotate_reads_it(tmp_path):
    out = annotate(tmp_path, render(synthetic_profile(), "callgrind"))
    assert "20,000" in out and "PROGRAM TOTALS" in out
    assert _cost_of(out, "app.handler") == 2000       # exclusive
    assert _cost_of(out, "app.leaf") == 4000
    inc = annotate(tmp_path, render(synthetic_profile(), "callgrind"),
                   "--inclusive=yes")
    assert _cost_of(inc, "app.work") == 10000         # inclusive
    tree = annotate(tmp_path, render(synthetic_profile(), "callgrind"),
                    "--tree=calling")
    assert "app.leaf" in tree and "(4x)" in tree


def test_callgrind_hostile_names_stay_on_one_line(tmp_path):
    p = synthetic_profile()
    evil = _f("x\nfn=(1) forged", 70, 1, 0.001, 0.001,
              file="a\nfl=b.py")
    p.calls = p.calls + [evil]
    text = render(p, "callgrind")
    assert "\nfn=(1) forged" not in text and "\nfl=b.py" not in text
    out = annotate(tmp_path, text)
    assert "forged" in out


def test_callgrind_real_and_process(tmp_path, real_profiles,
                                    process_profiler):
    for prof in (real_profiles["/"], process_profiler):
        out = annotate(tmp_path, render(prof, "callgrind"),
                       "--inclusive=yes")
        assert "_worker" in out and "_burn" in out


# ---------------------------------------------------------------------------
# Chrome Trace Event JSON

def check_trace(doc, profile):
    """Structure checks shared by every trace: returns the span events."""
    evs = doc["traceEvents"]
    v = as_view(profile)
    names = {(e["tid"]): e["args"]["name"] for e in evs
             if e["ph"] == "M" and e["name"] == "thread_name"}
    spans = [e for e in evs if e.get("cat", "").startswith("span")]
    assert len(spans) == len(v.spans)
    rows = v.greenlet_rows()
    for g in rows:
        assert names[g.id] == ("%s %s" % (g.name, g.fn_name)).strip()
    for e, s in zip(sorted(spans, key=lambda e: e["ts"]),
                    sorted(v.spans, key=lambda s: s.start)):
        assert e["ph"] == "X" and e["tid"] == s.greenlet_id
        # epoch-second floats resolve ~0.25 us
        assert e["dur"] == pytest.approx(s.wall * 1e6, abs=0.01)
        assert e["ts"] == pytest.approx((s.start - v.origin) * 1e6, abs=0.01)
        assert e["ts"] >= 0
        assert e["args"]["cpu_ms"] == (None if s.cpu is None else
                                       pytest.approx(s.cpu * 1e3, abs=1e-3))
        assert e["args"]["blocking"] == v.is_blocking(s)
        if v.is_blocking(s):
            assert e["name"].startswith("BLOCKING ")
            assert e["cname"] == "terrible"
    for e in evs:
        assert e["ph"] in ("M", "X")
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
    return spans


def test_trace_event_synthetic():
    p = synthetic_profile()
    doc = json.loads(render(p, "trace"))
    spans = check_trace(doc, p)
    assert sum(1 for e in spans if e["args"]["blocking"]) == 1
    req = [e for e in doc["traceEvents"] if e.get("cat") == "request"]
    assert len(req) == 1 and req[0]["tid"] == 0
    r = req[0]
    assert r["ts"] == 0 and r["dur"] == pytest.approx(100000, abs=1)
    for e in spans:  # the request encloses every span
        assert r["ts"] <= e["ts"] and e["ts"] + e["dur"] <= \
            r["ts"] + r["dur"] + 0.01
    waits = [e for e in doc["traceEvents"] if e.get("cat") == "waiting"]
    assert [(w["ts"], w["dur"]) for w in waits] == [
        (pytest.approx(70000, abs=1), pytest.approx(10000, abs=1)),
        (pytest.approx(85000, abs=1), pytest.approx(5000, abs=1))]
    tnames = {e["args"]["name"] for e in doc["traceEvents"]
              if e["name"] == "thread_name"}
    assert "request GET /items/42" in tnames
    assert "Greenlet-3 app.work" in tnames
    assert doc["displayTimeUnit"] == "ms"


def test_trace_event_real_and_process(real_profiles, process_profiler):
    blk = real_profiles["/block"]
    doc = json.loads(render(blk, "trace"))
    spans = check_trace(doc, blk)
    assert any(e["args"]["blocking"] for e in spans)
    assert blk.blocking
    for prof in (real_profiles["/"], process_profiler):
        doc = json.loads(render(prof, "trace"))
        check_trace(doc, prof)


# ---------------------------------------------------------------------------
# speedscope

def check_speedscope(doc):
    """The shape of https://www.speedscope.app/file-format-schema.json."""
    assert doc["$schema"] == \
        "https://www.speedscope.app/file-format-schema.json"
    frames = doc["shared"]["frames"]
    assert isinstance(frames, list)
    for fr in frames:
        assert isinstance(fr["name"], str)
        assert set(fr) <= {"name", "file", "line", "col"}
    assert doc["profiles"]
    assert 0 <= doc.get("activeProfileIndex", 0) < len(doc["profiles"])
    for prof in doc["profiles"]:
        assert prof["unit"] == "microseconds"
        assert isinstance(prof["name"], str)
        assert prof["startValue"] <= prof["endValue"]
        if prof["type"] == "sampled":
            assert len(prof["samples"]) == len(prof["weights"])
            for stack in prof["samples"]:
                assert stack and all(0 <= i < len(frames) for i in stack)
                assert len(set(stack)) == len(stack)  # no cycle in a path
            assert all(w >= 0 for w in prof["weights"])
        else:
            assert prof["type"] == "evented"
            open_, last = [], prof["startValue"]
            for e in prof["events"]:
                assert e["type"] in ("O", "C")
                assert 0 <= e["frame"] < len(frames)
                assert e["at"] >= last and e["at"] <= prof["endValue"]
                last = e["at"]
                if e["type"] == "O":
                    open_.append(e["frame"])
                else:
                    assert open_ and open_.pop() == e["frame"]
            assert not open_
    return frames


def test_speedscope_synthetic():
    p = synthetic_profile()
    doc = json.loads(render(p, "speedscope"))
    frames = check_speedscope(doc)
    sampled, *evented = doc["profiles"]
    assert sampled["type"] == "sampled"
    # the tree keeps the root's inclusive time (20 ms)
    assert sum(sampled["weights"]) == pytest.approx(20000, abs=0.1)
    by_path = {tuple(frames[i]["name"] for i in s): w
               for s, w in zip(sampled["samples"], sampled["weights"])}
    assert by_path[("app.handler",)] == pytest.approx(2000)
    assert by_path[("app.handler", "app.work", "app.leaf")] == \
        pytest.approx(4000)
    assert by_path[("app.handler", "time.sleep")] == pytest.approx(2000)
    assert by_path[("app.handler", "app.a")] == pytest.approx(1000)
    assert by_path[("app.handler", "app.a", "app.b")] == pytest.approx(2000)
    assert by_path[("app.handler", "app.rec")] == pytest.approx(3000)
    assert [e["name"] for e in evented] == [
        "greenlet 1 Greenlet-1 app.handler", "greenlet 2 Greenlet-2 app.work",
        "greenlet 3 Greenlet-3 app.work"]
    assert len(evented[0]["events"]) == 4
    blocking = [frames[e["frame"]]["name"] for e in evented[2]["events"]]
    assert blocking == ["app.work [BLOCKING]"] * 2


def test_speedscope_tree_is_bounded_and_cycle_safe():
    # a chain of 200 functions, each calling the next and the first
    chain = [_f("f%d" % i, i + 1, 1, 1.0, 0.0) for i in range(200)]
    fixed = []
    for i, f in enumerate(chain):
        kids = [_c(chain[0], 1, 0.5, 0.0)]
        if i + 1 < len(chain):
            kids.append(_c(chain[i + 1], 1, 0.5, 0.0))
        fixed.append(f.__class__(**{**f.__dict__, "children": tuple(kids)}))
    samples, weights = call_tree_samples(fixed, lambda f: f.lineno,
                                         max_depth=16)
    assert max(len(s) for s in samples) <= 16
    assert sum(weights) == pytest.approx(1e6, rel=1e-6)  # f0 is the root
    # a diamond lattice: 2^30 paths, capped by the sample bound
    lattice = []
    prev = None
    for i in range(60, 0, -1):
        kids = () if prev is None else (_c(prev[0], 1, 0.4, 0.0),
                                         _c(prev[1], 1, 0.4, 0.0))
        pair = (_f("l%d" % i, i * 2, 1, 1.0, 0.2, kids),
                _f("r%d" % i, i * 2 + 1, 1, 1.0, 0.2, kids))
        lattice.extend(pair)
        prev = pair
    t = time.monotonic()
    samples, weights = call_tree_samples(lattice, lambda f: f.lineno,
                                         max_samples=5000)
    assert time.monotonic() - t < 5
    assert len(samples) <= 5000 + 2 * 64
    # two roots; slivers under 0.01 us are dropped
    assert sum(weights) == pytest.approx(2e6, rel=1e-4)


def test_speedscope_real_and_process(real_profiles, process_profiler):
    for prof in (real_profiles["/"], real_profiles["/block"],
                 process_profiler, synthetic_profile(calls=False)):
        doc = json.loads(render(prof, "speedscope"))
        check_speedscope(doc)
        types = [p["type"] for p in doc["profiles"]]
        v = as_view(prof)
        assert types.count("evented") == len(
            {s.greenlet_id for s in v.spans})
        assert ("sampled" in types) == bool(v.calls)


# ---------------------------------------------------------------------------
# JSON round trip, text

def test_json_round_trip(tmp_path, real_profiles):
    for label, p in all_profiles(real_profiles):
        text = render(p, "json")
        path = tmp_path / "p.json"
        path.write_text(text)
        back = RequestProfile.load(str(path))
        if label == "hostile":
            # (made by hand with a raw U+2028: loading cleans text like
            # capture does, greqprof/_text.py)
            p = RequestProfile.from_dict(p.to_dict())
            assert "\\u2028" in back.path
        assert back.to_dict() == p.to_dict(), label
        for name in RENDERERS:  # a saved profile renders later
            a, b = render(back, name), render(p, name)
            if name == "pstats":  # marshal output depends on sharing
                a, b = marshal.loads(a), marshal.loads(b)
            assert a == b, (label, name)


def test_json_of_process_profiler_loads_back(process_profiler):
    d = json.loads(render(process_profiler, "json"))
    back = RequestProfile.from_dict(d)
    assert back.sampled_by == "profiler"
    v = as_view(back)
    assert v.kind == "process"
    assert len(v.spans) == len(process_profiler.spans())
    assert {f.name for f in v.calls} >= {"_worker", "_burn", "_fib"}
    assert to_request_profile(back) is back


def test_text_wraps_report(real_profiles, process_profiler):
    text = render(synthetic_profile(), "text")
    assert text.startswith(">>> Begin RequestProfile")
    assert "Path: /items/42" in text and "<<< End RequestProfile" in text
    hostile = render(synthetic_profile(path="/a\nForged: 1"), "text")
    assert "\nForged: 1" not in hostile
    assert "_worker" in render(process_profiler, "text")


# ---------------------------------------------------------------------------
# HTML (the browser tests are in test_inspector.py)

def embedded_data(page):
    m = re.search(r'<script id="gq-data" type="application/json">(.*?)'
                  r'</script>', page, re.S)
    assert m, "no embedded data"
    return json.loads(m.group(1))


def test_html_is_self_contained_and_escaped(real_profiles):
    for label, p in all_profiles(real_profiles):
        page = render(p, "html")
        # no network: no external scripts, styles, images or fonts
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
        assert "@import" not in page and "url(" not in page
        # exactly the two inline blocks allowed by the CSP hashes, and the
        # data block; nothing from the request closes or opens a tag
        assert page.count("<script") == 2 and page.count("</script>") == 2
        assert page.count("<style>") == 1
        csp = htmlmod.unescape(re.search(
            r'http-equiv="Content-Security-Policy" content="([^"]+)"',
            page).group(1))
        assert "default-src 'none'" in csp and "sha256-" in csp
        d = embedded_data(page)
        v = as_view(p)
        assert len(d["rows"]) == len(v.greenlet_rows())
        assert len(d["spans"]) == len(v.spans)
        assert d["summary"]["path"] == p.path
        assert sum(s["b"] for s in d["spans"]) == \
            sum(v.is_blocking(s) for s in v.spans)
    hostile = render(synthetic_profile(path="/" + HOSTILE, hostile=True),
                     "html")
    assert "<script>window" not in hostile
    assert "<!--" not in hostile
    data = re.search(r'id="gq-data" type="application/json">(.*?)</script>',
                     hostile, re.S).group(1)
    assert "\u2028" not in data and "<" not in data
    title = re.search(r"<title>(.*?)</title>", hostile).group(1)
    # (the title is cleaned text: the raw U+2028 shows escaped)
    assert htmlmod.unescape(title) == "greqprof: GET /" + \
        HOSTILE.replace("\u2028", "\\u2028")


def test_html_of_process_profiler(process_profiler):
    d = embedded_data(render(process_profiler, "html"))
    assert d["kind"] == "process"
    assert len(d["spans"]) == len(process_profiler.spans())
    assert d["calls"] and d["waiting"] == []


def test_script_json_and_fill():
    s = script_json({"a": "</script><!--&\u2028"})
    assert "<" not in s and ">" not in s and "&" not in s
    assert json.loads(s) == {"a": "</script><!--&\u2028"}
    assert json.loads(script_json({"x": [float("nan"), float("inf"), 1.5]})) \
        == {"x": [None, None, 1.5]}
    assert fill("x@@GQ_A@@y@@GQ_B@@", {"A": "@@GQ_B@@", "B": "2"}) == \
        "x@@GQ_B@@y2"


# ---------------------------------------------------------------------------
# writing files (the middleware's profile_dir)

def test_profile_writer_names_and_contents(tmp_path):
    from greqprof import ConfigError
    w = ProfileWriter(str(tmp_path / "out"),
                      ["json", "pstats", "callgrind", "trace"])
    p = synthetic_profile(path="/a/../b c/<x>")
    first = w.write(p)
    second = w.write(p)
    assert len(first) == len(second) == 4 and not set(first) & set(second)
    for path in first + second:
        name = os.path.basename(path)
        assert re.match(r"^(callgrind\.out\.)?\d{8}T\d{6}\.\d{6}Z-4242-"
                        r"a_.._b_c_x-\d+(\.|$)", name), name
    js = [x for x in first if x.endswith(".json")
          and not x.endswith(".trace.json")][0]
    assert RequestProfile.load(js).to_dict() == p.to_dict()
    pst = [x for x in first if x.endswith(".pstats")][0]
    assert pstats.Stats(pst).total_calls == 14
    assert oct(os.stat(js).st_mode & 0o777) == "0o600"
    with pytest.raises(ConfigError, match="unknown format 'bmp'"):
        ProfileWriter(str(tmp_path), ["bmp"])
    with pytest.raises(ConfigError, match="needs function statistics"):
        ProfileWriter(str(tmp_path), ["pstats"], calls=False)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="profile_dir"):
        ProfileWriter(str(tmp_path / "file"), ["json"])


@pytest.mark.parametrize("path,expected", [
    ("/", "root"), ("", "root"), ("/api/v1/items", "api_v1_items"),
    ("/../../etc/passwd", "etc_passwd"), ("/" + "x" * 300, "x" * 60),
    ("/caf\u00e9/\x00", "caf"), ("/.hidden", "hidden")])
def test_sanitize_path(path, expected):
    assert sanitize_path(path) == expected


def _superscript_wait_profile():
    """A profile from_dict accepts whose wait stack entry ends in a
    non-ASCII digit ('x:\u00b2 in y': a function name with ':' in it)."""
    from greqprof.request_profile import SCHEMA
    return RequestProfile.from_dict({
        "schema": SCHEMA, "method": "GET", "path": "/", "start": 1.7e9,
        "end": 1.7e9 + 0.1, "wall": 0.1,
        "waits": [{"fn_name": "y", "filename": "app.py", "lineno": 3,
                   "stack": ["app.py:3 in x:\u00b2 in y",
                             "app.py:\u0663 in z"],
                   "seconds": 0.05, "count": 1, "greenlets": 1}]})


def test_offcpu_takes_only_ascii_digits_as_a_line():
    """(Before: '\u00b2'.isdigit() is true and int() raised ValueError.)"""
    from greqprof.renderers.offcpu import parse_stack_entry
    assert parse_stack_entry("app.py:3 in x:\u00b2 in y") == (
        "y", "app.py:3 in x:\u00b2", 0)
    assert parse_stack_entry("app.py:\u0663 in z") == ("z", "app.py:\u0663", 0)
    assert parse_stack_entry("a:b.py:12 in f") == ("f", "a:b.py", 12)
    doc = json.loads(render(_superscript_wait_profile(), "offcpu"))
    assert doc["profiles"][0]["weights"] == [50000.0]


def test_profile_writer_writes_the_formats_that_render(tmp_path,
                                                        monkeypatch):
    """One format whose renderer fails: the others are still written (each
    atomically: no temporary file is left), then the failure is raised
    naming the format.  (Before: every format was rendered before any was
    written, so one failing renderer lost all the files.)"""
    from greqprof.renderers.files import FormatError
    from greqprof.renderers.text import TextRenderer

    def broken(self, profile):
        raise ValueError("boom")
    monkeypatch.setattr(TextRenderer, "render", broken)
    w = ProfileWriter(str(tmp_path), ["json", "text", "offcpu"], calls=False)
    p = synthetic_profile(path="/w")
    with pytest.raises(FormatError, match=r"format text not written "
                       r"\(ValueError: boom\)") as info:
        w.write(p)
    names = sorted(os.listdir(tmp_path))
    assert len(names) == 2 and sorted(info.value.paths) == sorted(
        str(tmp_path / n) for n in names)
    assert any(n.endswith(".offcpu.speedscope.json") for n in names)
    js = [n for n in names if n.endswith("-1.json")]
    assert RequestProfile.load(str(tmp_path / js[0])).to_dict() == p.to_dict()
    assert [n for n, _ in info.value.errors] == ["text"]
