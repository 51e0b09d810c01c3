"""mw.routes(window="recent"): the requests of the last RECENT_S seconds
(or a little more), from snapshots the drain loop takes every
RECENT_STEP_S (greqprof/routes.py's RouteAggregates)."""
import pytest

from greqprof import _registry, routes
from greqprof.routes import RECENT_S, RECENT_STEP_S, RouteAggregates
from test_middleware import serve, wait_for  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(60)


def by_route(records):
    return {r["route"]: r for r in records}


def test_the_recent_window_counts_what_came_after_its_snapshot():
    agg = RouteAggregates(_registry.RouteCounts)
    c = agg.counts
    for _ in range(10):
        c.record("/a", 200, False, 0.01)
    # No snapshot yet: the window is the whole life.
    assert by_route(agg.to_records("recent", now=1000.0))["/a"][
        "requests"] == 10
    agg.tick(now=1000.0)
    for _ in range(5):
        c.record("/a", 200, False, 0.1)
    for _ in range(3):
        c.record("/b", 503, False, 0.002)
    recent = by_route(agg.to_records("recent", now=1030.0))
    assert set(recent) == {"/a", "/b"}
    a = recent["/a"]
    assert a["requests"] == 5 and a["errors"] == 0
    # Quantiles and the maximum from the window's buckets: within the
    # histogram's bound of the window's 0.1 s, not the older 0.01 s.
    assert a["wall_p50"] == pytest.approx(0.1, rel=0.045)
    assert 0.1 <= a["wall_max"] <= 0.1 * 2 ** (1 / 8)
    assert a["wall_mean"] == pytest.approx(0.1)
    b = recent["/b"]
    assert b["requests"] == 3 and b["errors"] == 3 and \
        b["status"]["5xx"] == 3
    assert b["wall_p99"] == pytest.approx(0.002, rel=0.045)
    # Since start: everything.
    assert by_route(agg.to_records())["/a"]["requests"] == 15
    assert by_route(agg.to_records("start"))["/a"]["requests"] == 15


def test_the_window_slides_and_idle_routes_drop_out():
    agg = RouteAggregates(_registry.RouteCounts)
    c = agg.counts
    t = 5000.0
    agg.tick(now=t)
    c.record("/old", 200, False, 0.01)
    # Snapshots every RECENT_STEP_S: after RECENT_S + a step without a
    # request, /old is out of the window.
    for k in range(1, RECENT_S // RECENT_STEP_S + 2):
        agg.tick(now=t + k * RECENT_STEP_S)
    c.record("/new", 200, False, 0.01)
    now = t + (RECENT_S // RECENT_STEP_S + 1) * RECENT_STEP_S + 1
    recent = by_route(agg.to_records("recent", now=now))
    assert set(recent) == {"/new"}, recent
    assert len(agg._snaps) == RECENT_S // RECENT_STEP_S + 1   # (bounded)
    # A tick before the step is due takes no snapshot.
    n = len(agg._snaps)
    agg.tick(now=now + 1)
    assert len(agg._snaps) == n and agg._snaps[-1][0] < now


def test_without_a_drain_loop_calls_far_apart_still_window():
    """No drain loop (each call takes the snapshot that is due): two calls
    ten minutes apart count what came after the first one's snapshot,
    not since the start."""
    agg = RouteAggregates(_registry.RouteCounts)
    agg.counts.record("/before", 200, False, 0.01)
    agg.to_records("recent", now=1000.0)   # (takes a snapshot)
    agg.counts.record("/after", 200, False, 0.01)
    covered, stats = agg.recent(now=1600.0)
    assert covered == 600.0
    assert {st.route for st in stats} == {"/after"}


def test_sampled_numbers_are_windowed_too():
    agg = RouteAggregates(_registry.RouteCounts)
    agg.counts.record("/s", 200, False, 0.01)
    agg.add_sampled("/s", 0.004, 0.002, blocking=1, blocked=0.2)
    agg.tick(now=10.0)
    agg.counts.record("/s", 200, False, 0.01)
    agg.add_sampled("/s", 0.008, 0.001)
    rec = by_route(agg.to_records("recent", now=20.0))["/s"]
    assert rec["sampled"] == 1 and rec["cpu"] == pytest.approx(0.008)
    assert rec["waiting"] == pytest.approx(0.001)
    assert rec["blocking"] == 0 and rec["blocked"] == 0.0
    rec = by_route(agg.to_records())["/s"]
    assert rec["sampled"] == 2 and rec["blocking"] == 1


def test_ticks_reuse_idle_routes_and_stay_exact():
    """A tick rebuilds only the routes that changed since the last one
    (C skips the idle rows); what the window says stays what a tick from
    scratch would say: per route, two raw names cut to one, a route whose
    sampled part alone changed."""
    agg = RouteAggregates(_registry.RouteCounts, max_routes=3000)
    c = agg.counts
    long_a, long_b = "/" + "x" * 300 + "a", "/" + "x" * 300 + "b"
    for i in range(2000):
        c.record("/r%d" % i, 200, False, 0.001)
    c.record(long_a, 200, False, 0.01)
    agg.add_sampled("/r7", 0.004, 0.002)
    agg.tick(now=100.0)
    first = agg._snaps[-1][1]
    assert len(first) == 2001 and first[routes.route_name(long_a)] \
        .requests == 1
    # Since: /r1 counted, the second long name (cut to the same route)
    # appeared, /r7's sampled part changed alone.
    c.record("/r1", 500, False, 0.2)
    c.record(long_b, 200, False, 0.02)
    agg.add_sampled("/r7", 0.006, 0.001)
    agg.tick(now=100.0 + RECENT_STEP_S)
    second = agg._snaps[-1][1]
    assert second["/r2"] is first["/r2"]   # (idle: shared, not rebuilt)
    assert second["/r1"].requests == 2 and second["/r1"].errors == 1
    long_name = routes.route_name(long_a)
    assert routes.route_name(long_b) == long_name
    assert second[long_name].requests == 2
    assert second["/r7"].requests == 1 and second["/r7"].extra[0] == 2
    assert second["/r7"].hist == first["/r7"].hist
    # The window from the first snapshot: exactly what came after it.
    c.record("/r3", 200, False, 0.05)
    recent = by_route(agg.to_records("recent", now=100.0 + 30))
    assert set(recent) == {"/r1", long_name, "/r7", "/r3"}
    assert recent["/r1"]["requests"] == 1 and recent["/r1"]["errors"] == 1
    assert recent[long_name]["requests"] == 1
    assert recent[long_name]["wall_p50"] == pytest.approx(0.02, rel=0.045)
    assert recent["/r7"]["requests"] == 0 and recent["/r7"]["sampled"] == 1
    assert recent["/r3"]["requests"] == 1
    # A third tick, /r3 alone changed: the window still starts at the
    # first snapshot and says the same.
    again = by_route(agg.to_records("recent",
                                    now=100.0 + 2 * RECENT_STEP_S + 1))
    assert {k: v["requests"] for k, v in again.items()} == \
        {k: v["requests"] for k, v in recent.items()}
    assert agg._snaps[-1][1]["/r2"] is first["/r2"]


def test_a_fork_in_the_middle_of_a_tick_leaves_the_childs_next_right():
    """A tick writes its view of the C table in steps; a thread that forks
    between two leaves the child a raw route in the rows but not under its
    name.  after_fork() starts that view anew: the child's next tick reads
    every row, and the window stays exact."""
    agg = RouteAggregates(_registry.RouteCounts)
    c = agg.counts
    c.record("/a", 200, False, 0.01)
    agg.tick(now=100.0)
    c.record("/b", 200, False, 0.01)
    c.record("/b", 200, False, 0.01)
    agg.tick(now=100.0 + RECENT_STEP_S)
    del agg._tick_raws["/b"]        # (the step the fork cut off)
    agg.after_fork()
    c.record("/b", 200, False, 0.01)
    c.record("/c", 200, False, 0.01)
    agg.tick(now=100.0 + 2 * RECENT_STEP_S)
    assert agg._snaps[-1][1]["/b"].requests == 3
    assert agg._tick_raws["/b"] == ["/b"]
    # the window from the first snapshot on, once later ones slide it
    recent = by_route(agg.to_records("recent", now=100.0 + 2 *
                                     RECENT_STEP_S + 1))
    assert {k: v["requests"] for k, v in recent.items()} == \
        {"/b": 3, "/c": 1}      # (/a idle since: not in the window)


def test_a_tick_that_fails_leaves_the_next_one_right(monkeypatch):
    """A snapshot that raises half way (here: out of memory compressing
    a histogram; the drain loop counts it as an internal error) keeps
    nothing of itself: the next one still sees what ran since the last
    snapshot that was taken."""
    agg = RouteAggregates(_registry.RouteCounts)
    agg.counts.record("/a", 200, False, 0.01)
    agg.tick(now=1000.0)
    for _ in range(10):
        agg.counts.record("/a", 200, False, 0.01)

    def no_memory(*a, **k):
        raise MemoryError
    monkeypatch.setattr(routes.zlib, "compress", no_memory)
    with pytest.raises(MemoryError):
        agg.tick(now=1000.0 + RECENT_STEP_S)
    monkeypatch.undo()
    agg.tick(now=1000.0 + 2 * RECENT_STEP_S)
    assert agg._snaps[-1][1]["/a"].requests == 11
    agg.counts.record("/a", 200, False, 0.01)
    recent = by_route(agg.to_records("recent", now=1400.0))
    assert recent["/a"]["requests"] == 1


TICKING_THREADS = """
import itertools, sys, time
from gevent import monkey; monkey.patch_all()
import gevent
from greqprof import _registry, routes
real_sleep = monkey.get_original("time", "sleep")
start_thread = monkey.get_original("_thread", "start_new_thread")
agg = routes.RouteAggregates(_registry.RouteCounts, max_routes=3000)
for r in range(2000):
    agg.counts.record("/r%d" % r, 200, False, 0.001)
clock = itertools.count(1000, 61)
done = {"main": 0, "other": 0}
def other():
    while True:
        for r in range(0, 2000, 3):
            agg.counts.record("/r%d" % r, 200, False, 0.002)
        agg.tick(now=float(next(clock)))
        agg.to_records("recent", now=float(next(clock)))
        done["other"] += 1
        real_sleep(0.005)
start_thread(other, ())
gevent.spawn(lambda: [gevent.sleep(0.001) for _ in iter(int, 1)])
# (a hung lock stalls one side for good, or the whole process)
end = time.monotonic() + 4
while time.monotonic() < end:
    agg.tick(now=float(next(clock)))
    done["main"] += 1
    gevent.sleep(0.001)
print(done["main"], done["other"])
"""


def test_ticks_from_two_threads_under_monkey_patching(tmp_path):
    """The drain loop of a serving thread (a greenlet) and another OS
    thread reading the recent window both go on: the table's locks are
    OS-thread locks, never a gevent lock one thread hangs on."""
    import subprocess
    import sys
    script = tmp_path / "ticking.py"
    script.write_text(TICKING_THREADS)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    main, other = map(int, proc.stdout.split())
    assert main >= 3 and other >= 3, proc.stdout


def test_the_table_can_be_entered_from_inside_itself():
    """A body collected inside one of the table's sections (the cyclic
    collector runs where it allocates) may deliver its profile, which adds
    to the table, from inside it: the lock is reentrant, not a hang."""
    agg = RouteAggregates(_registry.RouteCounts)
    agg.counts.record("/a", 200, False, 0.01)
    with agg._lock:
        agg.add_sampled("/a", 0.003, 0.001)
        agg.add_blocking("/a", 0.2)
    rec = by_route(agg.to_records())["/a"]
    assert rec["sampled"] == 1 and rec["blocking"] == 1


def test_a_sample_delivered_during_a_pass_over_the_table():
    """The same, while a pass loops over the table: a collection there
    (a tick builds a tuple per route) delivers the first sample of a new
    route.  The pass goes on over what it started with, the new route
    counts from the next one; before, 'dictionary changed size during
    iteration' (the tick) and 'Set changed size' (take_changed)."""
    import gc
    agg = RouteAggregates(_registry.RouteCounts)
    for i in range(300):
        agg.counts.record("/r%d" % i, 200, False, 0.01)
        agg.add_sampled("/r%d" % i, 0.001, 0.0)
    added = []

    def deliver(phase, info):
        # (a body's finalizer delivering its profile, with the lock held
        # by the pass: the only time this thread can enter it while held)
        if phase == "start" and agg._lock._is_owned() and len(added) < 50:
            route = "/late%d" % len(added)
            added.append(route)
            agg.add_sampled(route, 0.002, 0.0)

    threshold = gc.get_threshold()
    gc.callbacks.append(deliver)
    gc.set_threshold(1)
    try:
        agg.tick(now=100.0)
        changed = agg.take_changed()
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(deliver)
    assert added, "no collection ran inside a pass: the test tests nothing"
    # every sample is counted once: by take_changed now or at its next call
    changed.update(agg.take_changed())
    assert set(changed) == {"/r%d" % i for i in range(300)} | set(added)
    agg.tick(now=100.0 + RECENT_STEP_S)
    rec = by_route(agg.to_records())
    assert all(rec[r]["sampled"] == 1 for r in added)
    assert len(agg._snaps) == 2


@pytest.mark.parametrize("window", ["last", 5, ""])
def test_a_bad_window_says_what_is_wrong(window):
    agg = RouteAggregates(_registry.RouteCounts)
    with pytest.raises(ValueError, match="window"):
        agg.to_records(window)


def app(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


def test_a_real_servers_recent_routes(serve):
    s = serve(app, pct=0.0, report=False)
    assert s.get("/early/1").status == 200
    # The drain loop (once a second) takes the first snapshot.
    wait_for(lambda: s.mw._routes._snaps, what="a snapshot")
    for i in range(3):
        assert s.get("/late/%d" % i).status == 200
    recent = by_route(s.mw.routes(window="recent"))
    assert recent["/late/{id}"]["requests"] == 3
    assert "/early/{id}" not in recent
    assert by_route(s.mw.routes())["/early/{id}"]["requests"] == 1
    with pytest.raises(ValueError, match="window"):
        s.mw.routes(window="yesterday")
    assert routes.RECENT_S == 300


def test_the_routes_page_shows_the_recent_window(serve):
    s = serve(app, pct=0.0, report=False, ui_path="/_greqprof")
    assert s.get("/early/1").status == 200
    wait_for(lambda: s.mw._routes._snaps, what="a snapshot")
    assert s.get("/late/1").status == 200
    page = s.get("/_greqprof/routes").body.decode()
    assert "/early/{id}" in page and "/late/{id}" in page
    assert "window=recent" in page and "since it started" in page
    page = s.get("/_greqprof/routes?window=recent&sort=p99").body.decode()
    assert "/late/{id}" in page and "/early/{id}" not in page
    assert "in about the last 5 minutes" in page
    # (sorting keeps the window)
    assert "sort=requests&amp;window=recent" in page
