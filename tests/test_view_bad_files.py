"""``python -m greqprof view`` and ``RequestProfile.from_dict`` on bad files
(issue 15, item 5): every one ends in one line on stderr and exit status 2,
never a traceback; text that is merely odd (surrogate escapes, bidi and
control characters) loads cleaned and renders."""
import json
import subprocess
import sys

import pytest

from greqprof import RequestProfile
from greqprof.renderers import RENDERERS, RenderError
from greqprof.request_profile import MAX_FILE_BYTES

from conftest import CHILD_CWD, child_env
from test_renderers import synthetic_profile

pytestmark = pytest.mark.timeout(120)


def good():
    return json.loads(synthetic_profile().to_json())


def with_field(path, value):
    """The good profile with the field at ``path`` (keys and list indexes)
    replaced by ``value`` (or removed when value is ...)."""
    d = good()
    obj = d
    for k in path[:-1]:
        obj = obj[k]
    if value is ...:
        del obj[path[-1]]
    else:
        obj[path[-1]] = value
    return d


#: (label, document): each a file view must refuse with exit status 2
BAD_DOCS = [
    ("list", []), ("null", None), ("string", "profile"),
    ("no schema", with_field(["schema"], ...)),
    ("other schema", with_field(["schema"], "speedscope")),
    ("method int", with_field(["method"], 5)),
    ("path list", with_field(["path"], ["/"])),
    ("path missing", with_field(["path"], ...)),
    # (a duration; negative ones also sent the renderers' blocking marks
    # down their slow path)
    ("span wall negative", with_field(["spans", 0, "wall"], -1e-9)),
    ("blocking wall negative", with_field(["blocking", 0, "wall"], -1.0)),
    ("start null", with_field(["start"], None)),
    ("end string", with_field(["end"], "1700000000")),
    ("wall bool", with_field(["wall"], True)),
    ("start negative", with_field(["start"], -5)),
    ("start year 10000", with_field(["start"], 3e11)),
    ("start huge int", with_field(["start"], 10 ** 400)),
    ("cpu string", with_field(["cpu"], "fast")),
    ("pid float", with_field(["pid"], 1.5)),
    ("pid negative", with_field(["pid"], -1)),
    ("pid 2**64", with_field(["pid"], 2 ** 64)),
    ("dropped_spans str", with_field(["dropped_spans"], "3")),
    ("spans dict", with_field(["spans"], {})),
    ("span int", with_field(["spans", 0], 1)),
    ("span start null", with_field(["spans", 0, "start"], None)),
    ("span id str", with_field(["spans", 0, "greenlet_id"], "1")),
    ("span finished int", with_field(["spans", 0, "finished"], 1)),
    ("span stack int", with_field(["spans", 2, "stack"], 12)),
    ("span missing end", with_field(["spans", 0, "end"], ...)),
    ("longest_span list", with_field(["longest_span"], [])),
    ("waiting list", with_field(["waiting"], [1])),
    ("waiting top str", with_field(["waiting", "top"], "x")),
    ("waiting top item", with_field(["waiting", "top", 0], [9])),
    ("waiting complete str", with_field(["waiting", "complete"], "yes")),
    ("greenlets item", with_field(["greenlets", 0], "g")),
    ("greenlet switches", with_field(["greenlets", 0, "switches"], 1.0)),
    ("blocking item", with_field(["blocking", 0], 3)),
    ("blocking stack dict", with_field(["blocking", 0, "stack"], {})),
    ("calls dict", with_field(["calls"], {"a": 1})),
    ("call lineno str", with_field(["calls", 0, "lineno"], "12")),
    ("call children", with_field(["calls", 0, "children"], 7)),
    ("child ttot", with_field(["calls", 0, "children", 0, "ttot"], [])),
    ("text too long", with_field(["path"], "x" * 1000001)),
]

#: (label, raw bytes): files that are not JSON profiles at all
BAD_BYTES = [
    ("empty", b""), ("not json", b"{profile"), ("not utf-8", b'{"a": "\xff"}'),
    ("NaN", json.dumps(good()).replace('"wall": 0.1', '"wall": NaN')
     .encode()),
    ("Infinity", json.dumps(good()).replace('"wall": 0.1',
                                            '"wall": -Infinity').encode()),
    ("deep list", b"[" * 100000 + b"]" * 100000),
    ("deep dict", b'{"a":' * 100000 + b"1" + b"}" * 100000),
    ("deep in a field", json.dumps(good()).replace(
        '"error": null', '"error": ' + "[" * 50000 + "]" * 50000).encode()),
    ("10000 digits", b'{"schema": 1' + b"0" * 10000 + b"}"),
    ("nul", b"\x00\x00"),
]


def view(path, *args):
    return subprocess.run([sys.executable, "-m", "greqprof", "view",
                           str(path)] + list(args),
                          capture_output=True, timeout=60, cwd=CHILD_CWD,
                          env=child_env())


def refused(r, *needles):
    err = r.stderr.decode("utf-8")
    assert r.returncode == 2, (r.returncode, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    assert err.count("\n") == 1, err
    for n in needles:
        assert n in err, (n, err)
    return err


@pytest.mark.parametrize("label,doc", BAD_DOCS,
                         ids=[x for x, _ in BAD_DOCS])
def test_from_dict_refuses(label, doc):
    with pytest.raises(ValueError) as e:
        RequestProfile.from_dict(doc)
    assert "\n" not in str(e.value)


def test_from_dict_names_the_field():
    with pytest.raises(ValueError, match=r"spans\[0\]\.start"):
        RequestProfile.from_dict(with_field(["spans", 0, "start"], None))
    with pytest.raises(ValueError,
                       match=r"calls\[0\]\.children\[0\]\.ttot"):
        RequestProfile.from_dict(
            with_field(["calls", 0, "children", 0, "ttot"], "x"))


def test_view_refuses_each_bad_file(tmp_path):
    """One subprocess per kind would be slow: a sample of each family."""
    sample = [BAD_DOCS[i] for i in range(0, len(BAD_DOCS), 3)]
    for label, doc in sample:
        p = tmp_path / "bad.json"
        p.write_text(json.dumps(doc))
        refused(view(p), "not a greqprof profile")
    for label, raw in BAD_BYTES:
        p = tmp_path / "bad.json"
        p.write_bytes(raw)
        refused(view(p), "bad.json")


def test_view_refuses_a_huge_file_without_reading_it(tmp_path):
    p = tmp_path / "huge.json"
    with open(p, "wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)   # (sparse: nothing to read)
    refused(view(p), "larger than")
    with pytest.raises(ValueError, match="larger than"):
        RequestProfile.load(str(p))


def test_view_refuses_other_greqprof_outputs(tmp_path):
    for fmt in ("trace", "speedscope", "html", "text", "callgrind",
                "pstats"):
        data = RENDERERS[fmt].render(synthetic_profile())
        p = tmp_path / ("out." + fmt)
        p.write_bytes(data if isinstance(data, bytes)
                      else data.encode("utf-8"))
        refused(view(p))


def test_view_names_a_json_lines_file(tmp_path):
    """json_logs output (one JSON object a line) was refused with json's
    "Extra data: line 2 column 1"."""
    line = json.dumps(good())
    p = tmp_path / "greqprof.jsonl"
    p.write_text(line + "\n" + line + "\n")
    err = refused(view(p), "greqprof.jsonl holds several JSON documents, "
                  "one per line (JSON lines, as json_logs logs them): view "
                  "takes one profile file", 'formats=["json"]')
    assert "Extra data" not in err
    # (one line of it is a profile file; a log line's prefix is not JSON)
    p.write_text(line + "\n")
    assert view(p).returncode == 0
    p.write_text("2026-12-04 04:44:47,962 INFO [greqprof] " + line + "\n")
    refused(view(p), "is not a JSON profile (not valid JSON: Extra data")


@pytest.mark.parametrize("after", ["see the INFO log\n", "}\n", "7\n",
                                   "[1]\n", "{\n"])
def test_view_json_lines_only_when_the_next_line_is_an_object(tmp_path,
                                                             after):
    """One profile then trailing junk was called "several JSON documents,
    one per line (JSON lines...)"."""
    p = tmp_path / "one.json"
    p.write_text(json.dumps(good()) + "\n" + after)
    err = refused(view(p), "one.json is not a JSON profile (not valid "
                  "JSON: Extra data: line 2 column 1 (char ")
    assert "several" not in err, err
    # (an object on the lines after, not on one line: several documents)
    p.write_text(json.dumps(good()) + "\n" + json.dumps(good(), indent=1))
    err = refused(view(p), "one.json holds several JSON documents: view "
                  "takes one profile file", "save one of them")
    assert "JSON lines" not in err, err


def test_view_reads_a_bom(tmp_path):
    """A UTF-8 BOM (some Windows editors write one) was "not valid JSON:
    Unexpected UTF-8 BOM"."""
    line = json.dumps(good())
    p = tmp_path / "bom.json"
    p.write_bytes(b"\xef\xbb\xbf" + line.encode())
    r = view(p)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(b">>> Begin RequestProfile")
    # (from a pipe too: no size to read by)
    r = subprocess.run([sys.executable, "-m", "greqprof", "view",
                        "/dev/stdin"], input=p.read_bytes(),
                       capture_output=True, timeout=60, cwd=CHILD_CWD,
                       env=child_env())
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(b">>> Begin RequestProfile")
    p.write_bytes(b"\xef\xbb\xbf" + (line + "\r\n").encode() * 2)
    refused(view(p), "bom.json holds several JSON documents, one per line "
            "(JSON lines")
    # (only at the start: one further on is not JSON)
    p.write_bytes(b" \xef\xbb\xbf" + line.encode())
    refused(view(p), "bom.json is not a JSON profile")


def test_load_refuses_bad_bytes(tmp_path):
    for label, raw in BAD_BYTES:
        p = tmp_path / "bad.json"
        p.write_bytes(raw)
        with pytest.raises(ValueError):
            RequestProfile.load(str(p))


def test_surrogates_and_bidi_in_a_file_load_cleaned(tmp_path):
    """A profile saved before text was cleaned at capture (json.dump wrote
    a lone surrogate as \\udcff) used to crash every text output."""
    d = good()
    d["path"] = "/x\udcff\u202e"
    d["spans"][0]["greenlet_name"] = "g\ud800"
    d["spans"][2]["stack"] = '  File "a\udcff.py", line 1, in f\x1b\n'
    d["calls"][0]["filename"] = "/srv/\udcffapp.py"
    d["error"] = "E: \u2066boom\u2069"
    p = tmp_path / "old.json"
    p.write_text(json.dumps(d))   # (ensure_ascii: \udcff escapes)
    prof = RequestProfile.load(str(p))
    assert prof.path == "/x\\udcff\\u202e"
    assert prof.spans[0].greenlet_name == "g\\ud800"
    assert prof.spans[2].stack == \
        '  File "a\\udcff.py", line 1, in f\\x1b\n'
    for fmt in RENDERERS:
        out = tmp_path / ("o." + fmt)
        r = view(p, "-f", fmt, "-o", str(out))
        assert r.returncode == 0, r.stderr.decode()
    r = view(p)
    assert r.returncode == 0, r.stderr.decode()
    assert "\\udcff" in r.stdout.decode("utf-8")


def test_every_renderer_renders_what_from_dict_accepts():
    """Limits of the accepted ranges render in every format."""
    d = good()
    d["start"], d["end"] = 0.0, 1e11
    d["wall"], d["cpu"] = 1e11, -1e11
    d["spans"][0]["start"] = 0.0
    d["spans"][0]["wall"] = 1e11
    d["pid"] = 2 ** 63 - 1
    d["calls"][0]["ttot"] = 0.0
    d["calls"][0]["ncall"] = 0
    d["calls"][0]["lineno"] = 2 ** 63 - 1
    p = RequestProfile.from_dict(d)
    for name, r in RENDERERS.items():
        try:
            r.render(p)
        except RenderError:
            pass


def strict_json(text):
    """json.loads refusing NaN and Infinity (which Python writes and
    reads, but no other JSON reader, speedscope's included, accepts)."""
    def refuse(name):
        raise ValueError("%s in the output" % name)
    return json.loads(text, parse_constant=refuse)


def _number_paths(obj, prefix=()):
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, list):
        items = enumerate(obj)
    else:
        if isinstance(obj, (int, float)) and not isinstance(obj, bool):
            yield prefix
        return
    for k, v in items:
        yield from _number_paths(v, prefix + (k,))


def test_every_number_at_its_limits_renders_finite():
    """Every number of a profile, one at a time, at the limits from_dict
    accepts (5e-324, +-1e11, 0, 2**63-1): every renderer renders, and the
    JSON formats hold no NaN/Infinity (before: a function whose ttot was
    5e-324 made the speedscope call tree's weights NaN)."""
    paths = list(_number_paths(good()))
    assert len(paths) > 100
    failures = []
    for path in paths:
        for value in (5e-324, -1e11, 1e11, 0, 2 ** 63 - 1):
            try:
                p = RequestProfile.from_dict(with_field(path, value))
            except ValueError:
                continue   # (out of this field's range: refused)
            for name, r in RENDERERS.items():
                try:
                    out = r.render(p)
                    if name in ("json", "trace", "speedscope"):
                        strict_json(out)
                except RenderError:
                    pass
                except Exception as e:
                    failures.append((path, value, name, repr(e)[:200]))
    assert not failures, failures[:10]


def test_a_file_too_large_for_the_memory_is_one_line(tmp_path):
    """A file under the 256 MiB cap can still need more memory than the
    process may have (here an address-space limit of what view needs to
    start plus 100 MB, and 15 million list items, 120 MB of pointers):
    one line, exit 2 (before: a MemoryError traceback, exit 1)."""
    import resource
    probe = subprocess.run(
        [sys.executable, "-c", "import greqprof.__main__, re; print(re.search("
         "r'VmPeak:\\s+(\\d+)', open('/proc/self/status').read()).group(1))"],
        capture_output=True, check=True, timeout=60, cwd=CHILD_CWD,
        env=child_env())
    limit = (int(probe.stdout) + 100 * 1024) * 1024
    path = tmp_path / "huge.json"
    with open(path, "w") as f:
        f.write('{"schema": "greqprof.request_profile/1", "notes": [')
        f.write("0," * 15000000)
        f.write("0]}")

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    r = subprocess.run([sys.executable, "-m", "greqprof", "view", str(path)],
                       capture_output=True, timeout=120, preexec_fn=cap,
                       cwd=CHILD_CWD, env=child_env())
    refused(r, "huge.json", "memory")


def _naive_is_blocking(view, span):
    # (the rule as it reads, every span against every event)
    if span.long:
        return True
    for b in view.blocking:
        if b.greenlet_id == span.greenlet_id:
            overlap = min(b.end, span.end) - max(b.start, span.start)
            if overlap > 0.5 * min(b.wall, span.wall) or \
                    abs(b.start - span.start) < 0.001:
                return True
    return False


def _timeline(rng, n_spans, n_events, odd=False):
    from greqprof import BlockingEvent, Span
    t0 = 1700000000.0
    spans, events = [], []
    for i in range(n_spans):
        a = t0 + rng.uniform(0, 2)
        w = rng.choice([0.0, 1e-5, 1e-3, 0.02, 0.3])
        if odd and rng.random() < 0.1:
            w = -w - 1.0
        spans.append(Span(rng.randint(1, 3), "g", "f", a, a + abs(w), w,
                          None, True, None, rng.random() < 0.05))
    for i in range(n_events):
        a = t0 + rng.uniform(0, 2)
        if rng.random() < 0.5:   # (on the rule's edges, floats rounding)
            s = rng.choice(spans)
            a = rng.choice([s.start, s.end]) + rng.choice(
                [0.0, 0.001, -0.001, 0.002, -0.002, 1e-9, -1e-9, 0.0009999])
        w = rng.choice([0.0, 5e-4, 0.01, 0.1, 0.5])
        if odd and rng.random() < 0.1:
            w = -w - 1.0
        events.append(BlockingEvent(rng.randint(1, 3), "g", "f", a,
                                    a + abs(w), w, None))
    return spans, events


def test_blocking_marks_are_the_rule_exactly():
    """is_blocking (indexed) marks exactly the spans the rule marks, on
    random timelines with overlapping events, zero lengths and (hand-made
    data) negative walls."""
    import random
    from greqprof.renderers.base import ProfileView
    rng = random.Random(15)
    for trial in range(60):
        spans, events = _timeline(rng, 300, rng.randint(0, 60),
                                  odd=trial % 3 == 0)
        v = ProfileView(kind="request", title="t", start=spans[0].start,
                        end=spans[0].end, spans=spans, greenlets=[],
                        calls=None, blocking=events)
        for s in spans:
            assert v.is_blocking(s) == _naive_is_blocking(v, s), (trial, s)


def test_blocking_marks_do_not_compare_every_span_with_every_event():
    """20,000 spans and 2,000 blocking events on one greenlet (a hostile
    file; a real request has up to max_spans spans and 100 events): each
    renderer compared every span with every event, 40 million
    comparisons, 20 s per format.  Counted, not timed: reads of the
    events' fields stay linear."""
    from greqprof import BlockingEvent
    from greqprof.renderers.base import ProfileView
    reads = [0]

    class Counted(BlockingEvent):
        def __getattribute__(self, name):
            reads[0] += 1
            return object.__getattribute__(self, name)

    from greqprof import Span
    t0 = 1700000000.0
    spans = [Span(1, "g", "f", t0 + i * 1e-4, t0 + i * 1e-4 + 5e-5, 5e-5,
                  None, True, None, False) for i in range(20000)]
    plain = [BlockingEvent(1, "g", "f", t0 + 0.5 * i, t0 + 0.5 * i + 0.2,
                           0.2, None) for i in range(2000)]
    events = [Counted(*(getattr(b, f) for f in BlockingEvent.__annotations__))
              for b in plain]
    v = ProfileView(kind="request", title="t", start=t0, end=t0 + 2,
                    spans=spans, greenlets=[], calls=None, blocking=events)
    marked = [s for s in spans if v.is_blocking(s)]
    assert reads[0] < 50 * (len(spans) + len(events)), reads[0]
    # (the spans under the 4 events of the first 2 s, and those starting
    # within 1 ms before one)
    v.blocking = plain[:5]   # (the others start after the last span)
    assert marked == [s for s in spans if _naive_is_blocking(v, s)]
    assert 8000 <= len(marked) < 8100


def test_ctrl_c_during_view_is_one_line(tmp_path, monkeypatch, capsys):
    """Ctrl-C while view renders: one line on stderr and status 130 (before:
    a KeyboardInterrupt traceback from inside the renderer)."""
    import greqprof.__main__ as cli
    from greqprof.renderers import get_renderer
    path = tmp_path / "p.json"
    path.write_text(json.dumps(synthetic_profile().to_dict()))
    text = get_renderer("text")

    def interrupted(profile):
        raise KeyboardInterrupt
    monkeypatch.setattr(text, "render", interrupted)
    with pytest.raises(SystemExit) as exc:
        cli.main(["view", str(path), "-f", "text"])
    assert exc.value.code == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith(" view: interrupted\n"), err
    assert "Traceback" not in err
