"""pprof output (greqprof/pprof.py and the ``pprof`` renderer), every file
read back with the real ``go tool pprof`` (Debian golang-go): its ``-raw``
dump parsed and compared with the profile's own numbers, ``-top`` totals,
labels through ``-raw`` and ``-traces``.

Profiles: hand-made ones with exact numbers, hostile names and numbers at
their limits, the whole-process Profiler, and real requests through a
gevent.pywsgi server writing ``formats=["pprof"]`` files."""
import gzip
import os
import re
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import replace

import gevent
import pytest

from greqprof._text import clean
from greqprof.pprof import ProfileBuilder, encode_varint
from greqprof.renderers import RENDERERS, get_renderer, render
from greqprof.renderers.pprof_renderer import RUNNING, WAITING
from greqprof.request_profile import RequestProfile, WaitSite
from test_middleware import ok, serve  # noqa: F401 (a fixture)
from test_renderers import process_profiler  # noqa: F401 (a fixture)
from test_renderers import HOSTILE, _worker, synthetic_profile
from conftest import CHILD_CWD, child_env

pytestmark = pytest.mark.timeout(120)

GO = shutil.which("go")


@pytest.fixture
def pprof_tool(tmp_path):
    """pprof(file, *args) -> stdout of `go tool pprof args file`.  Without
    go the tests skip, except on CI (CI=true), where go must be there."""
    if GO is None:
        if os.environ.get("CI") == "true":
            pytest.fail("go is not installed (Debian golang-go: "
                        ".ci/system-deps installs it)")
        pytest.skip("go is not installed (Debian golang-go)")
    env = dict(os.environ, PPROF_TMPDIR=str(tmp_path), HOME=str(tmp_path),
               GOCACHE=str(tmp_path / "gocache"), GOTOOLCHAIN="local")
    env.pop("PPROF_BINARY_PATH", None)

    def run(path, *args):
        r = subprocess.run([GO, "tool", "pprof"] + list(args) + [str(path)],
                           capture_output=True, env=env, timeout=60)
        assert r.returncode == 0, r.stderr.decode(errors="replace")
        return r.stdout.decode("utf-8")
    return run


# ---------------------------------------------------------------------------
# reading `go tool pprof -raw`

_LOC = re.compile(r"^\s*(\d+): 0x[0-9a-f]+ M=\d+ (.*) (\S*):(-?\d+) "
                  r"s=(-?\d+)(?:\(.*\))?$")
_LABEL = re.compile(r"(\S+?):\[(.*?)\]")


class Raw:
    """What `pprof -raw` printed: ``types`` [(type, unit)], ``default``,
    ``samples`` [(values, location ids leaf first, {label: value})],
    ``locations`` {id: (name, file, line)} (split at the last space: a
    name or a file may hold spaces, see ``where``), ``comments``,
    ``period_type``, ``period``."""

    def __init__(self, text):
        self.samples, self.locations, self.comments = [], {}, []
        self.types, self.default = [], None
        self.period_type = self.period = None
        section = None
        for line in text.splitlines():
            if line.startswith("Comment: "):
                self.comments.append(line[len("Comment: "):])
            elif line.startswith("PeriodType: "):
                self.period_type = tuple(line.split()[1:])
            elif line.startswith("Period: "):
                self.period = int(line.split()[1])
            elif line == "Samples:":
                section = "types"
            elif line == "Locations":
                section = "locations"
            elif line == "Mappings":
                section = None
            elif section == "types":
                for t in line.split():
                    if t.endswith("[dflt]"):
                        t = t[:-len("[dflt]")]
                        self.default = t.split("/")[0]
                    self.types.append(tuple(t.split("/")))
                section = "samples"
            elif section == "samples":
                head, sep, tail = line.partition(":")
                if sep and re.fullmatch(r"[\s\d-]+", head):
                    self.samples.append(([int(x) for x in head.split()],
                                         [int(x) for x in tail.split()], {}))
                else:
                    for k, v in _LABEL.findall(line):
                        self.samples[-1][2][k] = v
            elif section == "locations":
                m = _LOC.match(line)
                assert m, line
                self.locations[int(m.group(1))] = (
                    m.group(2), m.group(3), int(m.group(4)))

    def stacks(self):
        """[(values, (frame names leaf first), labels)]"""
        return [(v, tuple(self.locations[i][0] for i in locs), labels)
                for v, locs, labels in self.samples]

    def where(self, i):
        """("name file", line) of location i: exact whatever the spaces"""
        name, file, line = self.locations[i]
        return ("%s %s" % (name, file), line)

    def flat(self):
        """{leaf location ("name file", line): summed values}"""
        out = defaultdict(lambda: [0] * len(self.types))
        for v, locs, _ in self.samples:
            row = out[self.where(locs[0])]
            for i, x in enumerate(v):
                row[i] += x
        return dict(out)

    def totals(self):
        return [sum(v[i] for v, _, _ in self.samples)
                for i in range(len(self.types))]


def top_total(text):
    """N of `pprof -top`'s 'Showing nodes accounting for ..., of N total'"""
    m = re.search(r"of (\d+)(?:ns)? total", text)
    assert m, text
    return int(m.group(1))


def key(f):
    """A FuncStat's key in Raw.flat()"""
    return ("%s %s" % (f.full_name, "" if f.filename == "~" else f.filename),
            f.lineno)


def ns(seconds):
    return int(round(seconds * 1e9)) if seconds and seconds > 0 else 0


def write(tmp_path, name, data):
    p = tmp_path / name
    p.write_bytes(data)
    return p


# ---------------------------------------------------------------------------
# the encoder

def test_varints_are_protobufs():
    for n, want in ((0, b"\x00"), (1, b"\x01"), (127, b"\x7f"),
                    (128, b"\x80\x01"), (300, b"\xac\x02"),
                    (2 ** 63 - 1, b"\xff" * 8 + b"\x7f"),
                    (-1, b"\xff" * 9 + b"\x01")):
        out = bytearray()
        encode_varint(n, out)
        assert bytes(out) == want, n


def test_a_built_profile_reads_back_exactly(tmp_path, pprof_tool):
    b = ProfileBuilder([("calls", "count"), ("cpu", "nanoseconds")],
                       default_type="cpu", period_type=("cpu", "nanoseconds"),
                       period=10, time_nanos=1700000000 * 10 ** 9,
                       duration_nanos=5 * 10 ** 6, comments=["hello"])
    index = b.function("app.index", "app/views.py", 10)
    db = b.function("app.db", "app/db.py", 3)
    # (a function name pprof's demangler would garble if it were also
    # the system name)
    mod = b.function("<module>", "app/main.py", 1)
    assert b.function("app.index", "app/views.py", 10) == index
    li, ld, lm = b.location(index, 12), b.location(db, 4), b.location(mod, 1)
    assert b.location(index, 12) == li
    b.sample([ld, li, lm], [2, 1500000], labels={"route": "/items/{id}"})
    b.sample([li, lm], [1, 500000], labels={"route": "/"},
             num_labels={"n": (5, "requests")})
    b.sample([lm], [0, -7])   # (int64: negative values are allowed)
    raw = Raw(pprof_tool(write(tmp_path, "p.pb.gz", b.to_bytes()), "-raw"))
    assert raw.types == [("calls", "count"), ("cpu", "nanoseconds")]
    assert raw.default == "cpu"
    assert raw.period_type == ("cpu", "nanoseconds") and raw.period == 10
    assert raw.comments == ["hello"]
    assert raw.stacks() == [
        ([2, 1500000], ("app.db", "app.index", "<module>"),
         {"route": "/items/{id}"}),
        ([1, 500000], ("app.index", "<module>"),
         {"route": "/", "n": "5 requests"}),
        ([0, -7], ("<module>",), {})]
    assert sorted(raw.locations.values()) == [
        ("<module>", "app/main.py", 1), ("app.db", "app/db.py", 4),
        ("app.index", "app/views.py", 12)]
    top = pprof_tool(tmp_path / "p.pb.gz", "-top", "-unit=ns")
    assert top_total(top) == 1500000 + 500000 + 7   # (of absolute values)
    assert raw.totals() == [3, 1500000 + 500000 - 7]
    assert "Duration: 5ms" in top
    # uncompressed: what to_bytes gzips (mtime 0: reproducible)
    assert gzip.decompress(b.to_bytes()) == b.serialize()
    assert b.to_bytes() == b.to_bytes()


def test_names_and_labels_are_clean_text(tmp_path, pprof_tool):
    b = ProfileBuilder([("samples", "count")])
    bad = "f\x1b[31m\u202e\udcff\nx"
    f = b.function(bad, b"/srv/\xffapp.py", 1)
    b.sample([b.location(f, 1)], [1], labels={"route": "/a\x00b\u2066"})
    text = pprof_tool(write(tmp_path, "c.pb.gz", b.to_bytes()), "-raw")
    raw = Raw(text)
    assert raw.stacks() == [([1], ("f\\x1b[31m\\u202e\\udcff\\x0ax",),
                             {"route": "/a\\x00b\\u2066"})]
    assert list(raw.locations.values())[0][1] == "/srv/\u00ffapp.py"


def test_a_huge_name_is_cut(tmp_path, pprof_tool):
    b = ProfileBuilder([("samples", "count")])
    f = b.function("x" * 100000)
    b.sample([b.location(f)], [1])
    raw = Raw(pprof_tool(write(tmp_path, "h.pb.gz", b.to_bytes()), "-raw"))
    name = raw.stacks()[0][1][0]
    assert name == "x" * 1000 + "...[99000 more]"


@pytest.mark.parametrize("call, message", [
    (lambda: ProfileBuilder([]), "at least one"),
    (lambda: ProfileBuilder([("cpu",)]), r"sample_types\[0\]"),
    (lambda: ProfileBuilder([("cpu", 3)]), "sample unit must be text"),
    (lambda: ProfileBuilder([("cpu", "ns")], default_type="wall"),
     "default_type 'wall'"),
    (lambda: ProfileBuilder([("cpu", "ns")], period=1.5), "period must be"),
    (lambda: ProfileBuilder([("cpu", "ns")], period_type="cpu"),
     "period_type must be"),
    (lambda: ProfileBuilder([("cpu", "ns")], duration_nanos=-1),
     "duration_nanos must be in 0"),
    (lambda: ProfileBuilder([("cpu", "ns")], time_nanos=2 ** 63),
     "time_nanos must be in"),
])
def test_bad_builder_arguments_say_what_is_wrong(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_bad_samples_say_what_is_wrong():
    b = ProfileBuilder([("calls", "count"), ("cpu", "nanoseconds")])
    f = b.function("f", "f.py", 1)
    loc = b.location(f, 1)
    for kwargs, message in (
            (dict(location_ids=[loc], values=[1]), "needs 2 values"),
            (dict(location_ids=[loc], values=[1, 2.5]),
             r"values\[1\] must be an int"),
            (dict(location_ids=[loc], values=[True, 1]),
             r"values\[0\] must be an int"),
            (dict(location_ids=[loc], values=[1, 2 ** 63]),
             r"values\[1\] must be in"),
            (dict(location_ids=[loc, 2], values=[1, 1]),
             r"location_ids\[1\] must be in 1\.\.1"),
            (dict(location_ids=[0], values=[1, 1]), "must be in 1"),
            (dict(location_ids=[loc], values=[1, 1], labels={"k": 3}),
             "label 'k' must be text"),
            (dict(location_ids=[loc], values=[1, 1],
                  num_labels={"k": "x"}), "label 'k' must be an int"),
            (dict(location_ids=[loc], values=[1, 1],
                  num_labels={"k": (1, 2, 3)}), "an int or an"),
    ):
        with pytest.raises(ValueError, match=message):
            b.sample(**kwargs)
    with pytest.raises(ValueError, match="non-empty name"):
        b.function("")
    with pytest.raises(ValueError, match="non-empty name"):
        b.function(None)
    with pytest.raises(ValueError, match="file name must be text"):
        b.function("f", 3)
    with pytest.raises(ValueError, match="start_line must be in 0"):
        b.function("f", "f.py", -1)
    with pytest.raises(ValueError, match="function_id must be in 1"):
        b.location(2)
    assert b._samples == []   # (nothing half-added)


# ---------------------------------------------------------------------------
# the renderer: function statistics

def check_calls(raw, profile):
    """The pprof file of a profile with function statistics against the
    profile's own numbers: per function flat calls and self time exactly,
    the recorded caller->callee edges, the total, the labels."""
    funcs = defaultdict(lambda: [0, 0])
    for f in profile.calls:
        funcs[key(f)][0] += f.ncall
        funcs[key(f)][1] += ns(f.tsub)
    assert raw.types == [("calls", "count"), (profile.clock, "nanoseconds")]
    assert raw.default == profile.clock
    assert raw.flat() == {k: v for k, v in funcs.items() if any(v)} or \
        not any(any(v) for v in funcs.values())
    names = {f.full_name for f in profile.calls}
    recorded = {(c.qualname, f.full_name) for f in profile.calls
                for c in f.children
                if "%s.%s" % (c.module, c.qualname) in names or
                c.qualname in names}
    for v, stack, labels in raw.stacks():
        assert len(stack) in (1, 2)
        assert labels == {"method": profile.method, "path": profile.path}
        if len(stack) == 2:
            callee = [f for f in profile.calls if f.full_name == stack[0]]
            assert (callee[0].qualname, stack[1]) in recorded, stack
    assert raw.totals() == [sum(v[0] for v in funcs.values()),
                            sum(v[1] for v in funcs.values())]


def test_function_statistics_become_a_graph_of_self_time(tmp_path,
                                                          pprof_tool):
    p = synthetic_profile()
    path = write(tmp_path, "calls.pb.gz", render(p, "pprof"))
    raw = Raw(pprof_tool(path, "-raw"))
    check_calls(raw, p)
    flat = raw.flat()
    # exact numbers of the hand-made profile (seconds -> ns)
    assert flat[("app.handler app.py", 10)] == [1, 2000000]
    assert flat[("app.a app.py", 50)] == [2, 1500000]
    assert flat[("time.sleep ", 0)] == [1, 2000000]
    stacks = {s: v for v, s, _ in raw.stacks()}
    # a's self time split between its callers by inclusive time:
    # handler->a 3 ms, b->a 0.5 ms
    assert stacks[("app.a", "app.handler")] == [1, 1285714]
    assert stacks[("app.a", "app.b")] == [1, 214286]
    # rec's 3 ms of self time: handler->rec 3 ms and rec->rec 2 ms
    assert stacks[("app.rec", "app.handler")] == [1, 1800000]
    assert stacks[("app.rec", "app.rec")] == [2, 1200000]
    assert stacks[("app.handler",)] == [1, 2000000]
    assert top_total(pprof_tool(path, "-top", "-unit=ns")) == 20000000
    assert top_total(pprof_tool(path, "-top", "-sample_index=calls")) == 14
    assert raw.comments == ["greqprof request profile: GET /items/42"]
    traces = pprof_tool(path, "-traces", "-tagfocus=path=/items/42")
    assert "app.leaf" in traces and "method:  GET" in traces


def test_hostile_profiles_render_and_load(tmp_path, pprof_tool):
    p = synthetic_profile(path="/" + HOSTILE + "\udcff\u202e", hostile=True,
                          calls=False)
    p = replace(p, method="GET\x1b", start=1e20)   # (an impossible time)
    path = write(tmp_path, "hostile.pb.gz", render(p, "pprof"))
    raw = Raw(pprof_tool(path, "-raw"))
    assert raw.samples[0][2]["method"] == "GET\\x1b"
    assert "\\udcff\\u202e" in raw.samples[0][2]["path"]
    assert (clean(HOSTILE) + " ", 0) in raw.flat()
    p2 = replace(synthetic_profile(calls=False), spans=[
        replace(s, wall=1e11, cpu=-1e11, greenlet_id=2 ** 63 - 1)
        for s in synthetic_profile().spans])
    raw = Raw(pprof_tool(write(tmp_path, "big.pb.gz", render(p2, "pprof")),
                         "-raw"))
    # (values are int64: the sums are capped, never wrapped)
    assert raw.totals() == [5, 0, 2 ** 63 - 1]


def test_the_whole_process_profiler(tmp_path, pprof_tool, process_profiler):
    path = write(tmp_path, "proc.pb.gz", render(process_profiler, "pprof"))
    raw = Raw(pprof_tool(path, "-raw"))
    assert raw.types[0] == ("calls", "count")
    flat = raw.flat()
    funcs = defaultdict(lambda: [0, 0])
    for f in process_profiler.func_stats():
        funcs[key(f)][0] += f.ncall
        funcs[key(f)][1] += ns(f.tsub)
    assert flat == {k: v for k, v in funcs.items() if any(v)}
    assert any("_worker " in k[0] for k in flat)
    assert all(labels == {} for _, _, labels in raw.stacks())


# ---------------------------------------------------------------------------
# the renderer: spans and waits

def check_spans(raw, profile):
    """A spans-only pprof file against the profile's spans and waits."""
    assert raw.types == [("count", "count"), ("cpu", "nanoseconds"),
                         ("wall", "nanoseconds")]
    assert raw.default == "wall"
    per = defaultdict(lambda: [0, 0, 0])
    names = {}
    for s in profile.spans:
        row = per[s.greenlet_id]
        row[0] += 1
        row[1] += ns(s.cpu)
        row[2] += ns(s.wall)
        names[s.greenlet_id] = s.greenlet_name
    running = {int(labels["greenlet_id"]): (v, stack)
               for v, stack, labels in raw.stacks()
               if labels.get("kind") == "running"}
    assert running == {gid: (row, (names[gid], RUNNING))
                       for gid, row in per.items()}
    waiting = [(v, stack) for v, stack, labels in raw.stacks()
               if labels.get("kind") == "waiting"]
    assert len(waiting) == len(profile.waits)
    for w, (v, stack) in zip(profile.waits, waiting):
        assert v == [w.count, 0, ns(w.seconds)]
        assert stack[0] == w.fn_name and stack[-1] == WAITING
        assert len(stack) == len(w.stack) + 1
    for _, _, labels in raw.stacks():
        assert labels["method"] == profile.method
        assert labels["path"] == profile.path


def test_spans_and_waits_without_function_statistics(tmp_path, pprof_tool):
    site = WaitSite(fn_name="fetch", filename="app/db.py", lineno=7,
                    stack=("app/views.py:3 in index",
                           "app/db.py:7 in fetch"),
                    seconds=0.25, count=3, greenlets=2)
    p = replace(synthetic_profile(calls=False), waits=[site])
    path = write(tmp_path, "spans.pb.gz", render(p, "pprof"))
    raw = Raw(pprof_tool(path, "-raw"))
    check_spans(raw, p)
    stacks = {s: v for v, s, _ in raw.stacks()}
    assert stacks[("Greenlet-3", RUNNING)] == [1, 59000000, 60000000]
    assert stacks[("fetch", "index", WAITING)] == [3, 0, 250000000]
    assert sorted(raw.locations.values())[:2] == [
        ("<running>", "", 0), ("<waiting>", "", 0)]
    assert ("fetch", "app/db.py", 7) in raw.locations.values()
    top = pprof_tool(path, "-top", "-unit=ns")
    assert top_total(top) == 14000000 + 11000000 + 60000000 + 250000000
    top = pprof_tool(path, "-top", "-unit=ns", "-sample_index=cpu")
    assert top_total(top) == 5000000 + 10000000 + 59000000


def test_an_empty_profile_is_still_a_profile(tmp_path, pprof_tool):
    p = replace(synthetic_profile(calls=False), spans=[], greenlets=[])
    raw = Raw(pprof_tool(write(tmp_path, "e.pb.gz", render(p, "pprof")),
                         "-raw"))
    assert raw.samples == [] and raw.default == "wall"
    p = replace(synthetic_profile(), calls=[])   # (calls on, none seen)
    raw = Raw(pprof_tool(write(tmp_path, "f.pb.gz", render(p, "pprof")),
                         "-raw"))
    check_spans(raw, p)


# ---------------------------------------------------------------------------
# real requests, files written by the middleware, the command line

def _app(environ, start_response):
    gevent.joinall([gevent.spawn(_worker, 2), gevent.spawn(_worker, 1)])
    gevent.sleep(0.02)
    return ok()(environ, start_response)


def _written(tmp_path, pattern, n=1):
    deadline = time.monotonic() + 10
    while len(list(tmp_path.glob(pattern))) < n and \
            time.monotonic() < deadline:
        gevent.sleep(0.02)
    found = sorted(tmp_path.glob(pattern))
    assert len(found) == n, found
    return found


@pytest.mark.parametrize("calls", [True, False])
def test_real_requests_written_as_pprof(serve, tmp_path, pprof_tool, calls):
    out = tmp_path / "profiles"
    s = serve(_app, pct=1.0, calls=calls, linger=0.3, profile_dir=str(out),
              formats=["pprof", "json"])
    for target in ("/items/42", "/items/43"):
        assert s.get(target).status == 200
    files = _written(out, "*.pb.gz", 2)
    saved = _written(out, "*.json", 2)
    assert [f.name[:-len(".pb.gz")] for f in files] == \
        [f.name[:-len(".json")] for f in saved]
    totals = []
    for target in ("/items/42", "/items/43"):
        p = s.profile_for(target)
        part = "-%s-" % target[1:].replace("/", "_")   # (sanitize_path)
        [path] = [f for f in files if part in f.name]
        raw = Raw(pprof_tool(path, "-raw"))
        if calls:
            check_calls(raw, p)
            assert any("_worker " in k[0] for k in raw.flat())
        else:
            check_spans(raw, p)
            assert len([1 for _, _, lab in raw.stacks()
                        if lab["kind"] == "running"]) >= 3   # 3 greenlets
            assert p.waits
        # the file is what the renderer makes of the profile
        assert path.read_bytes() == render(p, "pprof")
        totals.append(raw.totals()[-1])
    # pprof merges the files of requests: their samples add up
    both = pprof_tool(files[0], "-top", "-unit=ns", str(files[1]))
    assert top_total(both) == sum(totals)


def test_view_converts_a_saved_profile(tmp_path, pprof_tool):
    p = synthetic_profile()
    src = tmp_path / "p.json"
    p.save(str(src))
    dst = tmp_path / "p.pb.gz"
    r = subprocess.run([sys.executable, "-m", "greqprof", "view", str(src),
                        "--format", "pprof", "-o", str(dst)],
                       capture_output=True, timeout=60, cwd=CHILD_CWD,
                       env=child_env())
    assert r.returncode == 0, r.stderr.decode()
    assert dst.read_bytes() == render(RequestProfile.load(str(src)), "pprof")
    check_calls(Raw(pprof_tool(dst, "-raw")), RequestProfile.load(str(src)))
    r = subprocess.run([sys.executable, "-m", "greqprof", "view", str(src),
                        "--format", "pprof"], capture_output=True, timeout=60,
                       cwd=CHILD_CWD, env=child_env())
    assert r.returncode == 2 and b"binary" in r.stderr


def test_the_inspector_links_and_serves_pprof(tmp_path, pprof_tool):
    from test_inspector import UI, call, make
    mw = make()
    profiles = [synthetic_profile(),
                synthetic_profile(path="/nocalls", calls=False)]
    for p in profiles:
        mw._deliver(p)
    for pid, check in ((1, check_calls), (2, check_spans)):
        assert "/p/%d/pprof" % pid in call(mw, UI + "/p/%d" % pid).text
        r = call(mw, UI + "/p/%d/pprof" % pid)
        assert r.code == 200
        assert r.headers["Content-Type"] == "application/octet-stream"
        assert r.headers["Content-Disposition"] == \
            'attachment; filename="greqprof-%d.pb.gz"' % pid
        raw = Raw(pprof_tool(write(tmp_path, "%d.pb.gz" % pid, r.body),
                             "-raw"))
        check(raw, profiles[pid - 1])


def test_the_renderer_is_registered():
    r = get_renderer("pprof")
    assert RENDERERS["pprof"] is r and r.binary and not r.needs_calls
    assert r.filename("x") == "x.pb.gz"
