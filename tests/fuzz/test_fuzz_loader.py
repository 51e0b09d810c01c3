"""Fuzz target: the profile loader and every renderer (issue 15, item 5).

What ``python -m greqprof view`` does, in-process: bytes -> parse_json ->
RequestProfile.from_dict -> every renderer (every format ``view`` writes).
The property: the loader either refuses with a one-line ValueError, or
every renderer renders the profile (RenderError only for a format that
needs function statistics the profile lacks), text outputs are clean
(printable line by line, UTF-8 encodable), the JSON formats parse
(strictly: no NaN or Infinity), pstats unmarshals, and the json output
loads back to the same profile.

Inputs: valid profiles (real ones from the synthetic builder, then
mutated: any field replaced by any JSON value, removed, or given odd
text), arbitrary JSON documents, and raw bytes.  The committed corpus
(tests/fuzz/corpus/*) is replayed in full every run.
"""
import gzip
import json
import marshal
import os
import pickle  # noqa: F401  (pstats output is marshal, not pickle)

import pytest
from hypothesis import example, given, seed
from hypothesis import strategies as st

from greqprof import RequestProfile
from greqprof.renderers import RENDERERS, RenderError
from greqprof.request_profile import parse_json

from test_renderers import synthetic_profile

from _settings import CORPUS_DIR, SEED, fuzz_settings

pytestmark = pytest.mark.timeout(300)

BASE = [json.loads(synthetic_profile().to_json()),
        json.loads(synthetic_profile(calls=False).to_json()),
        json.loads(synthetic_profile(hostile=True).to_json())]

ODD_TEXT = st.sampled_from([
    "\udcff", "\ud800x", "\u202e", "\u2066\u2069", "\u200b", "\ufeff",
    "\x00", "\x1b[2J", "\n\r", "\u2028", "\x85", "</script>", "", " ",
    "%s", "{}", "\\", "\U0010ffff", "a" * 3000])
JSON_SCALARS = (st.none() | st.booleans() |
                st.integers(min_value=-2 ** 70, max_value=2 ** 70) |
                st.floats(allow_nan=True, allow_infinity=True) |
                st.text(max_size=20) | ODD_TEXT)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda kids: st.lists(kids, max_size=4) |
    st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=12)


def _paths(obj, prefix=()):
    """Every (key or index) path inside a JSON document."""
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.extend(_paths(v, prefix + (k,)))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.extend(_paths(v, prefix + (i,)))
    return out


@st.composite
def mutated_profiles(draw):
    doc = json.loads(json.dumps(draw(st.sampled_from(BASE))))
    paths = _paths(doc)
    for _ in range(draw(st.integers(1, 4))):
        path = draw(st.sampled_from(paths))
        parent = doc
        try:
            for k in path[:-1]:
                parent = parent[k]
            key = path[-1]
            parent[key]   # (an earlier mutation may have moved it)
        except (KeyError, IndexError, TypeError):
            continue
        how = draw(st.integers(0, 5))
        old = parent[key]
        if how == 0 and isinstance(parent, dict):
            del parent[key]
        elif how == 5:
            parent[key] = draw(JSON_VALUES)
        elif isinstance(old, bool):   # (type-preserving, mostly valid)
            parent[key] = not old
        elif isinstance(old, str):
            parent[key] = draw(st.sampled_from(["", old])) + draw(ODD_TEXT)
        elif isinstance(old, int):
            parent[key] = draw(st.sampled_from(
                [0, 1, 7, 2 ** 63 - 1, 2 ** 63, -1]))
        elif isinstance(old, float):
            parent[key] = draw(st.sampled_from(
                [0.0, 1e-9, 0.5, 1700000000.5, 1e11, -1e11, 3e11,
                 float("nan"), float("inf")]))
        elif isinstance(old, list):
            parent[key] = draw(st.sampled_from(
                [[], old * 3, old[::-1], old[:1]]))
        else:
            parent[key] = draw(JSON_VALUES)
    return doc


def _encode(doc):
    """JSON bytes as a file holds them (NaN and lone surrogates too)."""
    return json.dumps(doc).encode("utf-8")


def check_text(out, fmt):
    for line in out.split("\n"):
        line = line.rstrip("\r")
        # (html/JS/CSS assets hold tabs; data never adds a raw control)
        assert line.replace("\t", "").isprintable() or fmt == "html", \
            (fmt, line[:200])
    out.encode("utf-8")


def _no_constant(name):
    # (Python reads NaN/Infinity back; speedscope and Perfetto do not)
    raise AssertionError("%s in a JSON output" % name)


def render_all(profile):
    for name, r in RENDERERS.items():
        try:
            out = r.render(profile)
        except RenderError:
            assert r.needs_calls and not profile.calls, name
            continue
        if r.binary:
            if name == "pprof":
                assert gzip.decompress(out), name
            else:
                marshal.loads(out)
            continue
        assert isinstance(out, str), name
        check_text(out, name)
        if name in ("json", "trace", "speedscope"):
            json.loads(out, parse_constant=_no_constant)
        if name == "json":
            back = RequestProfile.from_dict(json.loads(out))
            assert back.to_dict() == profile.to_dict()


def load_and_render(data):
    try:
        doc = parse_json(data)
        profile = RequestProfile.from_dict(doc)
    except ValueError as e:
        assert "\n" not in str(e) and str(e).isprintable(), str(e)
        return None
    for s in [profile.method, profile.path, profile.status or "",
              profile.error or "", profile.request_id or ""]:
        assert s.isprintable(), s
    render_all(profile)
    return profile


@seed(SEED)
@fuzz_settings(150)
@given(mutated_profiles())
@example(BASE[0])
def test_mutated_profiles(doc):
    load_and_render(_encode(doc))


@seed(SEED)
@fuzz_settings(100)
@given(st.dictionaries(st.sampled_from(list(BASE[0])), JSON_VALUES,
                       max_size=12).map(
                           lambda d: dict(d, schema=BASE[0]["schema"])))
def test_arbitrary_documents(doc):
    load_and_render(_encode(doc))


@seed(SEED)
@fuzz_settings(100)
@given(st.binary(max_size=300) |
       st.text(max_size=200).map(lambda t: t.encode("utf-8",
                                                    "surrogatepass")))
@example(b"[" * 100000)
@example(b'{"schema": "greqprof.request_profile/1", "start": NaN}')
def test_arbitrary_bytes(data):
    load_and_render(data)


def _corpus():
    if not os.path.isdir(CORPUS_DIR):
        return []
    return sorted(os.listdir(CORPUS_DIR))


@pytest.mark.parametrize("name", _corpus())
def test_corpus(name):
    with open(os.path.join(CORPUS_DIR, name), "rb") as f:
        load_and_render(f.read())
