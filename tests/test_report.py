"""RequestProfile serialisation (to_dict / from_dict / save / load) and the
text report, on profiles produced by real requests to a
gevent.pywsgi.WSGIServer wrapped in ProfilingMiddleware.

The server/client helpers and the ``serve`` fixture come from
test_middleware.py (pytest puts this directory on sys.path).
"""
import json
import logging
import re
import time

import gevent
import pytest

from greqprof import (BlockingEvent, ChildStat, FuncStat, GreenletStat,
                      RequestProfile, Span, Waiting, WaitedOn)
from greqprof.request_profile import SCHEMA

from test_middleware import (LOGGER, current_gid, echo_path, func_named,
                             serve)  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(60)


def helper_in_request(n):
    return sum(range(n))


def child_work():
    gevent.sleep(0)
    helper_in_request(10)


def rich_app(environ, start_response):
    path = environ["PATH_INFO"]
    if path == "/error":
        raise RuntimeError("report me\nsecond line")
    if path == "/many":
        for _ in range(12):
            gevent.sleep(0)
    if path == "/rich":
        gevent.spawn(child_work)              # not joined
        gevent.spawn(child_work).join()
        for i in range(3):
            helper_in_request(100)
        time.sleep(0.12)                      # a blocking span
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


@pytest.fixture
def profiles(serve, caplog):
    """Profiles of /rich, /error and /many (and the log records)."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    s = serve(rich_app, pct=1.0, calls=True, blocking_ms=100, linger=1.0)
    s.get("/rich", headers=[("X-Request-Id", "rid-7")])
    s.get("/error")
    s.get("/many")
    s.wait_profiles(3)
    return {p.path: p for p in s.profiles}


def _round_trip(p):
    return RequestProfile.from_dict(json.loads(json.dumps(p.to_dict())))


def test_rich_profile_has_everything(profiles):
    p = profiles["/rich"]
    assert p.request_id == "rid-7"
    assert p.status == "200 OK" and p.error is None
    assert len(p.greenlets) == 3
    assert len(p.blocking) == 1 and p.blocked
    assert p.calls and func_named(p, "helper_in_request").ncall == 5
    assert p.waiting.top
    assert p.longest_span is not None and p.longest_span.long


@pytest.mark.parametrize("path", [
    "/rich", "/many",
    # (its error message held a newline: cleaned at capture)
    "/error"])
def test_to_dict_from_dict_round_trip(profiles, path):
    p = profiles[path]
    d = p.to_dict()
    assert d["schema"] == SCHEMA
    back = _round_trip(p)
    assert back == p
    assert back.to_dict() == d
    assert back.report() == p.report()
    # the records have their public types back
    assert all(isinstance(s, Span) for s in back.spans)
    assert all(isinstance(g, GreenletStat) for g in back.greenlets)
    assert isinstance(back.waiting, Waiting)
    assert all(isinstance(w, WaitedOn) for w in back.waiting.top)
    assert all(isinstance(b, BlockingEvent) for b in back.blocking)
    assert all(isinstance(f, FuncStat) for f in back.calls)
    assert all(isinstance(c, ChildStat)
               for f in back.calls for c in f.children)


def test_save_and_load(profiles, tmp_path):
    p = profiles["/rich"]
    f = tmp_path / "profile.json"
    p.save(str(f))
    assert RequestProfile.load(str(f)) == p
    json.loads(f.read_text(encoding="utf-8"))


def test_to_dict_details(profiles):
    d = profiles["/rich"].to_dict()
    assert d["blocking"][0]["schema"] == "greqprof.blocking/1"
    assert d["blocking"][0]["path"] == "/rich"
    f = [c for c in d["calls"] if c["name"] == "helper_in_request"][0]
    assert f["tavg"] == pytest.approx(f["ttot"] / f["ncall"])
    assert d["longest_span"] in d["spans"]
    assert d["waiting"]["complete"] is True


@pytest.mark.parametrize("bad,word", [
    ([], "dict"),
    ({"schema": "greqprof.request_profile/999"}, "schema"),
    ({"schema": SCHEMA}, "malformed"),
])
def test_from_dict_rejects(bad, word):
    with pytest.raises(ValueError, match=word):
        RequestProfile.from_dict(bad)


def test_from_dict_rejects_unknown_span_field(profiles):
    d = profiles["/many"].to_dict()
    d["spans"][0]["bogus"] = 1
    with pytest.raises(ValueError, match="malformed"):
        RequestProfile.from_dict(d)


# ---------------------------------------------------------------------------
# the text report

def _field(text, name):
    m = re.search(r"^  %s: (.*)$" % re.escape(name), text, re.M)
    assert m, "no %r line in report" % name
    return m.group(1)


def test_report_format(profiles):
    p = profiles["/rich"]
    text = p.report()
    lines = text.split("\n")
    assert lines[0] == ">>> Begin RequestProfile"
    assert lines[-1] == "<<< End RequestProfile"
    assert lines[1] == "  Path: /rich"
    assert _field(text, "Method") == "GET"
    assert _field(text, "Status") == "200 OK"
    assert _field(text, "Request id") == "rid-7"
    assert _field(text, "Pid") == str(p.pid)
    assert _field(text, "Elapsed wall time") == "%.1f ms" % (p.wall * 1e3)
    assert _field(text, "Elapsed CPU time") == "%.1f ms" % (p.cpu * 1e3)
    assert _field(text, "Number of spans") == str(len(p.spans))
    assert _field(text, "Greenlets") == str(len(p.greenlets))
    assert _field(text, "Start time").endswith(" UTC")
    assert "Spans dropped" not in text and "  Error:" not in text
    # one record per span shown (all of them: fewer than 10), in order
    assert text.count("Span(") == len(p.spans) <= 10
    ids = [int(x) for x in re.findall(r"^Span\(greenlet_id=(\d+), ", text,
                                      re.M)]
    assert ids == [s.greenlet_id for s in p.spans]
    fns = re.findall(r" fn_name=(.*?), stack_trace=", text)
    assert fns == [s.fn_name for s in p.spans]
    assert text.count(" stack_trace=") == len(p.spans)
    assert len([sp for sp in p.spans if sp.long]) == 1
    assert re.search(r"^Waiting: \d+\.\d ms with none of the request's "
                     r"greenlets running(, while these ran:)?$", text, re.M)
    assert re.search(r"^Blocking span: .* held the event loop for \d+\.\d ms "
                     r"\(CPU .*\), greenlet \d+ ", text, re.M)
    assert "Functions (by inclusive time, top" in text
    assert re.search(r"^\s+5\s+5\s.*helper_in_request \(.*test_report\.py:"
                     r"\d+\)$", text, re.M)


def test_long_span_and_blocking_event_both_have_the_stack(profiles):
    """A long span gets the stack where its greenlet switched out; the
    blocking event made of the same span shows it too."""
    p = profiles["/rich"]
    long = [sp for sp in p.spans if sp.long]
    assert len(long) == 1
    assert p.blocking[0].stack
    assert long[0].stack
    assert long[0].stack == p.blocking[0].stack
    assert p.longest_span.stack == long[0].stack
    text = p.report()
    assert " stack_trace=\n  File " in text
    assert _round_trip(p).spans == p.spans


def test_report_is_what_was_logged(profiles, caplog):
    # the profiles were made (and logged) while setting up the fixture
    infos = [r.getMessage() for r in caplog.get_records("setup")
             if r.name == LOGGER and r.levelno == logging.INFO]
    assert len(infos) == 3
    for p in profiles.values():
        assert p.report() in infos


def test_report_error_and_escaping(profiles):
    p = profiles["/error"]
    # (recorded as clean text at capture: greqprof/_text.py)
    assert p.error == "RuntimeError: report me\\x0asecond line"
    text = p.report()
    assert "  Error: RuntimeError: report me\\x0asecond line" in text
    assert "\nsecond line" not in text
    assert _field(text, "Status") == "-"


def test_report_span_limit_and_dropped(serve):
    s = serve(rich_app, pct=1.0, max_spans=4)
    s.get("/many")
    p = s.profile_for("/many")
    assert len(p.spans) == 4 and p.dropped_spans > 0
    text = p.report()
    assert _field(text, "Number of spans") == str(4 + p.dropped_spans)
    assert _field(text, "Spans dropped (max_spans reached)") == \
        str(p.dropped_spans)
    short = p.report(max_spans=1)
    assert short.count("Span(") == 1
    assert "... 3 more spans not shown" in short
    assert _round_trip(p).report() == text


def test_report_long_path_is_capped(serve):
    s = serve(echo_path, pct=1.0)
    path = "/" + "x" * 3000
    assert s.get(path).status == 200
    p = s.profile_for(path[:2048])
    assert p.path == path[:2048]
    line = _field(p.report(), "Path")
    assert line == path[:1024] + "...[1024 more]"


def test_calls_none_without_calls(serve):
    s = serve(echo_path, pct=1.0, calls=False)
    s.get("/nocalls")
    p = s.profile_for("/nocalls")
    assert p.calls is None
    assert "Functions (" not in p.report()
    assert p.to_dict()["calls"] is None
    assert _round_trip(p) == p


def test_greenlet_ids_in_report_match_the_request(serve):
    gid = []

    def app(environ, start_response):
        gid.append(current_gid())
        return echo_path(environ, start_response)

    s = serve(app, pct=1.0)
    s.get("/gid")
    text = s.profile_for("/gid").report()
    assert set(re.findall(r"greenlet_id=(\d+),", text)) == {str(gid[0])}


def test_waiting_lines_name_only_what_is_known():
    """A waited-on greenlet that was never named (outside sampled requests
    greenlets are not named, to keep that path cheap) is shown by its id
    alone, not as "greenlet 7 greenlet-7 ()"."""
    p = RequestProfile(
        method="GET", path="/w", status="200 OK", start=0.0, end=0.01,
        wall=0.01, cpu=None, spans=[], longest_span=None, calls=None,
        waiting=Waiting(seconds=0.004, top=(
            WaitedOn(greenlet_id=7, name="greenlet-7", fn_name="",
                     seconds=0.003),
            WaitedOn(greenlet_id=2, name="Hub", fn_name="gevent.hub.Hub.run",
                     seconds=0.001))))
    lines = p.report().splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith("Waiting:"))
    assert lines[i + 1].split() == ["3.0", "ms", "greenlet", "7"]
    assert lines[i + 2].split() == ["1.0", "ms", "greenlet", "2", "Hub",
                                    "(gevent.hub.Hub.run)"]


# ---------------------------------------------------------------------------
# issue 16: a report people read (item 2) and greenlet names (item 7)

def _child_sleeps(n):
    for _ in range(n):
        gevent.sleep(0)


def sixty_spans_app(environ, start_response):
    """The request's greenlet and three children: about 60 spans."""
    kids = [gevent.spawn(_child_sleeps, 11) for _ in range(3)]
    named = gevent.spawn(_child_sleeps, 2)
    named.name = "poller"
    for i in range(20):
        if i == 7:
            helper_in_request(20000)          # one clearly longer span
        gevent.sleep(0)
    gevent.joinall(kids + [named])
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


def _span_records(text):
    return re.findall(r"^Span\(greenlet_id=(\d+), greenlet_name=(.*?), "
                      r"start_time=([\d.]+), end_time=([\d.]+), "
                      r"duration=([\d.]+) ms, ", text, re.M)


def test_report_of_60_spans_is_short_and_shows_the_longest(serve):
    s = serve(sixty_spans_app, pct=1.0)
    s.get("/sixty")
    p = s.profile_for("/sixty")
    assert len(p.spans) >= 60
    text = p.report()
    lines = text.split("\n")
    assert len(lines) < 120, "%d lines" % len(lines)
    assert lines[0] == ">>> Begin RequestProfile"
    assert lines[-1] == "<<< End RequestProfile"
    assert _field(text, "Number of spans") == str(len(p.spans))
    shown = _span_records(text)
    assert len(shown) == 10
    assert ("... %d more spans not shown" % (len(p.spans) - 10)) in text
    # the 10 longest, in start order
    starts = [float(r[2]) for r in shown]
    assert starts == sorted(starts)
    shortest_shown = min(float(r[4]) for r in shown)
    longest_hidden = sorted(sp.wall for sp in p.spans)[-11] * 1000.0
    assert shortest_shown >= round(longest_hidden, 1)
    assert max(sp.wall for sp in p.spans) * 1000.0 == pytest.approx(
        max(float(r[4]) for r in shown), abs=0.06)
    # spans=None: every span
    full = p.report(spans=None)
    assert len(_span_records(full)) == len(p.spans)
    assert "more spans not shown" not in full


def test_report_has_one_line_per_greenlet(serve):
    s = serve(sixty_spans_app, pct=1.0)
    s.get("/sixty")
    p = s.profile_for("/sixty")
    text = p.report()
    lines = text.split("\n")
    i = lines.index("Greenlets (CPU, wall, switches):")
    rows = lines[i + 1:i + 1 + len(p.greenlets)]
    assert len(p.greenlets) == 5
    for g, row in zip(p.greenlets, rows):
        cpu, _, wall, _, switches, rest = row.split(None, 5)
        assert rest.startswith("greenlet %d " % g.id), row
        assert cpu == "%.1f" % (g.cpu * 1000.0)
        assert wall == "%.1f" % (g.wall * 1000.0)
        assert int(switches) == g.switches
    assert not lines[i + 1 + len(p.greenlets)].startswith("  ")


def test_greenlets_are_named_after_the_request_and_their_function(serve):
    s = serve(sixty_spans_app, pct=1.0)
    s.get("/sixty?q=1")
    p = s.profile_for("/sixty")
    names = {g.name for g in p.greenlets}
    assert "GET /sixty" in names
    assert qualified_child in names
    assert "poller" in names
    assert not any(n.startswith("Greenlet") for n in names)
    own = [g for g in p.greenlets if g.name == "GET /sixty"][0]
    assert own.fn_name == "gevent.baseserver._handle_and_close_when_done"
    assert {sp.greenlet_name for sp in p.spans} == names
    text = p.report()
    assert re.search(r"^ .* greenlet %d GET /sixty "
                     r"\(gevent\.baseserver\._handle_and_close_when_done\)$"
                     % own.id, text, re.M)
    assert "greenlet_name=GET /sixty, " in text
    # what the inspector's timeline shows
    from greqprof.renderers.base import as_view
    rows = {g.name for g in as_view(p).greenlet_rows()}
    assert "GET /sixty" in rows and qualified_child in rows


qualified_child = "%s._child_sleeps" % __name__


def test_report_from_raw_rows_equals_report_from_records(serve):
    """A deferred profile is rendered from the packed rows; once its
    records are built, from them: the same text."""
    s = serve(sixty_spans_app, pct=1.0, calls=False, blocking_ms=None)
    s.get("/sixty")
    s.get("/error")
    s.wait_profiles(2)
    for p in s.profiles:
        assert "_loader" in p.__dict__
        fast = p.report()
        fast_all = p.report(spans=None)
        assert "_loader" in p.__dict__     # (the rows, not the records)
        p.spans  # noqa: B018  (builds the records)
        assert "_loader" not in p.__dict__
        assert p.report() == fast
        assert p.report(spans=None) == fast_all
        assert _round_trip(p).report() == fast


def hostile_app(environ, start_response):
    g = gevent.spawn(_child_sleeps, 2)
    g.name = "evil\nname\u202e" + "n" * 300
    g.join()
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


def test_c_rendering_equals_python_rendering_on_hostile_text(serve):
    from greqprof import report
    assert report._render_rows is not None      # (the C path is built)
    s = serve(hostile_app, pct=1.0)
    s.get("/caf%C3%A9/%E2%80%AEx%0Ay" + "z" * 1100,
          headers=[("X-Request-Id", "r\u00e9q")])
    p = s.wait_profiles(1)[0]
    assert "_loader" in p.__dict__
    for n in (10, 1, 0, None):
        fast = p.report(spans=n)
        assert fast == report._render_py(p, n, 25, 20)   # (from the rows)
        assert "\u202e" not in fast and "\x80" not in fast
        assert "evil\\x0aname\\u202e" in fast
        assert fast.count("\n") == report._render_py(
            p, n, 25, 20).count("\n")
    assert "_loader" in p.__dict__
    fast = p.report()
    p.spans  # noqa: B018
    assert p.report() == fast


def _synthetic(seed, n_spans, n_greenlets):
    """A deferred RequestProfile over made-up rows: durations on the .x5
    ms boundaries where "%.1f" rounding is decided by the last bits."""
    import random
    from greqprof._collect import GREENLET_ROW, SPAN_ROW, request_records
    rnd = random.Random(seed)
    gids = [1 + i * 7 for i in range(n_greenlets)]
    t = 10 ** 12 + rnd.randrange(10 ** 9)
    spans = []
    for i in range(n_spans):
        wall = rnd.choice([rnd.randrange(1, 10 ** 7), 50000 * (2 * i + 1),
                           150000, 250000, 350000, 1050000, 0])
        cpu = rnd.choice([-1, wall, wall // 3, 50000 * (2 * i + 1)])
        spans.append(SPAN_ROW.pack(rnd.choice(gids), t, t + wall, cpu,
                                   rnd.choice([0, 1]), 0))
        t += wall + rnd.randrange(0, 300000)
    grows = [GREENLET_ROW.pack(g, rnd.randrange(10 ** 6),
                               rnd.choice([-1, 450000, rnd.randrange(10 ** 6)]),
                               rnd.randrange(50), 0, 0, 0) for g in gids]
    names = {g: rnd.choice([("Greenlet", "app.f%d" % g), ("worker-%d" % g, ""),
                            ("", ""), ("Greenlet-%d" % g, "m.g"),
                            ("greenlet-%d" % g, ""), ("caf\u00e9\n", "x.y"),
                            ("abcdefghij\x7fk", "m.h"),
                            ("abcdefghijklmnop\x01", "m.i" * 120),
                            ("Greenlet-", "m.j"), ("greenlet", "m.k")])
             for g in gids}
    top = ((2, 1250000, ("Hub", "gevent.hub.Hub.run")), (99, 50000, None),
           (5, 10, ("greqprof.x", "greqprof.engine.f")))
    raw = (b"".join(spans), b"".join(grows), None, t, 3450000, top,
           bool(seed % 2), 0, 0, 1700000000 * 10 ** 9 + 123456789, 555,
           names, {})
    if seed % 3:
        # wait sites (read_profile's item 13): ties, 1/many, a hostile name
        sites = [("f%d" % i, "/srv/m%d.py" % (i % 3), i,
                  ("a.py:1 in x",), rnd.choice([150000, 2500000, 10 ** 7]),
                  rnd.choice([1, 2, 40]), rnd.choice([1, 3]))
                 for i in range(seed)]
        sites.append(("evil\u202e" + "w" * 250, "/srv/x.py", 7, (), 150000,
                      1, 1))
        raw = raw + (_read_waits_layout(sites, seed % 2 * 5),)
    return RequestProfile(
        method="GET", path="/s/%d" % seed, status="200 OK", start=1.7e9,
        end=1.7e9 + 0.01, wall=0.01, cpu=None, spans=None, longest_span=None,
        waiting=None, calls=None, dropped_spans=seed % 3, pid=4242,
        request_id="r%d" % seed if seed % 2 else None), request_records, raw


def _read_waits_layout(rows, dropped):
    """Rows (fn, filename, line, stack, ns, count, greenlets) as
    read_profile hands them (_hooks.c's read_waits: records, stats,
    dropped, events, events dropped)."""
    from greqprof._collect import WAIT_SITE_ROW
    records = tuple((None, fn, filename, line, stack)
                    for fn, filename, line, stack, _, _, _ in rows)
    stats = b"".join(WAIT_SITE_ROW.pack(i + 1, ns, count, gl, 0, 0)
                     for i, (_, _, _, _, ns, count, gl) in enumerate(rows))
    return (records, stats, dropped, b"", 0)


@pytest.mark.parametrize("seed", range(12))
def test_c_rendering_equals_python_rendering_on_made_up_rows(seed):
    from greqprof import report
    p, loader, raw = _synthetic(seed, 5 + 13 * seed, 1 + seed * 3)
    for k in RequestProfile.DEFERRED:
        p.__dict__.pop(k, None)
    p.__dict__["_loader"] = (loader, raw)
    for n, g in ((10, 20), (None, None), (0, 0), (3, 1)):
        fast = report._render_rows(p.__dict__, raw, n, g, report.safe,
                                   report._indent_clean_stack, False,
                                   report._clean_safe)
        slow = report._render_py(p, n, 25, g)
        assert fast + "\n<<< End RequestProfile" == slow
        assert report._render_rows(p.__dict__, raw, n, g, report.safe,
                                   report._indent_clean_stack, True,
                                   report._clean_safe) == slow
    if len(raw) > 13 and raw[13][0]:
        assert "\nWaited at: (top " in slow
    text = p.report()
    p.spans  # noqa: B018
    assert p.report() == text


def test_text_files_keep_every_span(serve):
    """The log report shows the 10 longest spans; a text file (the
    "text" renderer: profile_dir, `view --format text`) shows them all."""
    from greqprof.renderers import render
    s = serve(sixty_spans_app, pct=1.0)
    s.get("/sixty")
    p = s.profile_for("/sixty")
    text = render(p, "text")
    assert len(_span_records(text)) == len(p.spans) > 10
    assert "more spans not shown" not in text


def test_wait_sites_of_a_deferred_profile_are_read_from_its_rows(
        monkeypatch):
    """Wait sites are deferred fields (read_profile's item 13): the report
    reads them from the rows, the spans are not built for it."""
    from greqprof import report
    p, loader, raw = _synthetic(3, 30, 6)
    rows = [("read_slow", "/srv/net.py", 40, (), 5000000, 1, 1),
            ("wait_upstream", "/srv/app.py", 12, (), 41200000, 3, 2)]
    raw = raw + (_read_waits_layout(rows, 0),)
    calls = []

    def counting_loader(arg):
        calls.append(1)
        return loader(arg)
    monkeypatch.setattr(report, "_records_loader", counting_loader)
    for k in RequestProfile.DEFERRED:
        p.__dict__.pop(k, None)
    p.__dict__["_loader"] = (counting_loader, raw)
    text = p.report()
    assert not calls, "the report built the deferred fields"
    i = text.index("Waited at: (top 2 of 2 sites; ")
    lines = text[i:].split("\n")
    assert lines[1].split()[:7] == ["41.2", "ms", "3", "waits", "2",
                                    "greenlets", "wait_upstream"]
    assert lines[2].split()[6] == "read_slow"
    assert lines[-1] == "<<< End RequestProfile"
    # the records say the same
    p.spans  # noqa: B018
    assert calls and p.report() == text


def test_rows_the_c_renderer_does_not_know_fall_back_to_python():
    from greqprof import report
    p, loader, raw = _synthetic(4, 20, 4)
    for k in RequestProfile.DEFERRED:
        p.__dict__.pop(k, None)
    for bad in (("not", "three"), ((("f", "x.py", "one", (), 1, 1, 1),), 0,
                                   b""), (((),), 0, b"")):
        odd = raw[:13] + (bad,)
        assert report._render_rows(p.__dict__, odd, 10, 20, report.safe,
                                   report._indent_clean_stack, True,
                                   report._clean_safe) is None
    assert report._render_rows(p.__dict__, raw[:5], 10, 20, report.safe,
                               report._indent_clean_stack) is None


def test_c_renderer_reads_read_waits_layout_as_it_is():
    """_render.c reads read_profile's item 13 as read_waits gives it
    (records, stats bytes, dropped, events, events dropped): a record the
    registry dropped (None), more stats than records (zip), ties; the text
    equals the Python renderer's, which unpacks the same rows."""
    from greqprof import report
    from greqprof._collect import WAIT_SITE_ROW
    p, loader, raw = _synthetic(2, 20, 4)
    for k in RequestProfile.DEFERRED:
        p.__dict__.pop(k, None)
    records = [(None, "slow_io", "/srv/a.py", 7, ()), None,
               (None, "tie", "/srv/b.py", -3, ()),
               (None, "tie2", "/srv/\u202eb.py", 9, ()),
               (None, None, "/srv/c.py", 1, ())]
    rows = [(1, 9000000, 4, 2), (2, 12000000, 1, 1), (3, 3000000, 2, 1),
            (4, 3000000, 1, 3), (5, 1000, 1, 1), (6, 99000000, 5, 5)]
    stats = b"".join(WAIT_SITE_ROW.pack(k, ns, c, g, 0, 0)
                     for k, ns, c, g in rows)   # (6 stats, 5 records)
    raw = raw[:13] + ((records, stats, 2, b"", 0),)
    p.__dict__["_loader"] = (loader, raw)
    fast = report._render_rows(p.__dict__, raw, 10, 20, report.safe,
                               report._indent_clean_stack, True,
                               report._clean_safe)
    assert fast == report._render_py(p, 10, 25, 20)
    i = fast.index("Waited at: (top 5 of 5 sites; ")
    lines = fast[i:].split("\n")
    assert lines[1].split()[6:] == ["?", "(:0)"]      # (dropped record)
    assert lines[2].split()[6:] == ["slow_io", "(/srv/a.py:7)"]
    assert lines[-2] == ("  (2 waits at further sites not recorded: the "
                         "table of sites was full)")
    assert "\u202e" not in fast
    # layouts it does not know: None (the caller renders in Python)
    for bad in ((records, stats[:-1], 0, b"", 0),
                (records, stats, -1, b"", 0),
                ([(None, "f", "x.py", "one", ())], stats, 0, b"", 0),
                ([("short",)], stats, 0, b"", 0),
                (records, list(rows), 0, b"", 0),
                (records, stats, 0, b"")):
        assert report._render_rows(p.__dict__, raw[:13] + (bad,), 10, 20,
                                   report.safe, report._indent_clean_stack,
                                   True, report._clean_safe) is None


@pytest.mark.parametrize("wall", [float("inf"), 1e20, -1e20, -0.0004,
                                  0.00005, 2.5e-4, 1e10])
def test_c_renderer_prints_odd_times_as_python_does(wall):
    """A hand-set wall time far outside a request's (printf's path in C),
    negative, or on a rounding boundary: the C text is Python's."""
    from greqprof import report
    p, loader, raw = _synthetic(5, 12, 3)
    for k in RequestProfile.DEFERRED:
        p.__dict__.pop(k, None)
    p.__dict__["_loader"] = (loader, raw)
    p.__dict__["wall"] = wall
    text = p.report()
    assert "  Elapsed wall time: %s\n" % report._ms(wall) in text
    assert text == report._render_py(p, 10, 25, 20)


def test_calls_table_rows_read_as_each_time_formatted_alone():
    """render_calls writes a row in one format: each time reads as
    "%.1f ms" right-aligned in 11 columns, as it did formatted alone, and
    a hand-built record without times still renders ("-")."""
    from greqprof.report import render_calls
    from greqprof.stats import FuncStat

    def row(ttot, tsub, ncall=3):
        return FuncStat(name="f", qualname="mod.f", module="mod",
                        filename="/app/mod.py", lineno=7, ncall=ncall,
                        nactualcall=1, ttot=ttot, tsub=tsub)

    def alone(x):
        return "%11s" % ("-" if x is None else "%.1f ms" % (x * 1000.0))

    for ttot, tsub, ncall in [(0.0, 0.0, 3), (0.00005, 0.00004999, 1),
                              (99.99995, 1e-9, 7), (123456.7, 2.5, 0),
                              (None, 0.001, 2), (0.2, None, 2)]:
        avg = ttot / ncall if ncall and ttot is not None else 0.0
        want = "  %9d %9d %s %s %s  mod.f (/app/mod.py:7)" % (
            ncall, 1, alone(ttot), alone(tsub), alone(avg))
        assert render_calls([row(ttot, tsub, ncall)]).split("\n")[2] == want
