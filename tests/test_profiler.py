"""Tests of the whole-process greqprof.Profiler (Python API over the C hooks).

Expected times are expressed in spin units (see conftest.py): they are
ratios of CPU time burnt by the test itself, not absolute speeds.
"""
import collections
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time

import gevent
import gevent.event
import gevent.monkey
import greenlet
import pytest

import greqprof
from greqprof import (ChildStat, ConfigError, FuncStat, GreenletStat,
                      GreqprofError, ProfilerStateError, Span)

from conftest import (CHILD_CWD, assert_units, child, child_env,
                      child_names, func_stat, overshoot_units, qualified,
                      spin, units)

# (cpu_clock: conftest.pytest_pyfunc_call)
pytestmark = [pytest.mark.timeout(60), pytest.mark.cpu_clock]



def greenlet_stat_of(p, fn):
    """GreenletStats of the greenlets whose run function is `fn`."""
    return [g for g in p.greenlet_stats() if g.fn_name == qualified(fn)]


def spans_of(p, fn):
    return [s for s in p.spans() if s.fn_name == qualified(fn)]


def assert_sane(p):
    """Invariants every profile must satisfy."""
    for f in p.func_stats():
        assert f.ncall >= f.nactualcall >= 1 or (
            f.ncall >= 1 and f.nactualcall >= 0), f
        assert f.ttot >= 0 and f.tsub >= 0, f
        for c in f.children:
            assert c.ncall >= 1 and c.ttot >= 0 and c.tsub >= 0, (f, c)
    for s in p.spans():
        assert s.end >= s.start and s.wall >= 0, s
        assert s.cpu is None or s.cpu >= 0, s
    per_id = collections.Counter(sp.greenlet_id for sp in p.spans())
    for g in p.greenlet_stats():
        assert g.wall >= 0 and (g.cpu is None or g.cpu >= 0), g
        assert g.switches >= 0, g
        if p.dropped_spans == 0:
            # switches counts the spans that began with a switch; only the
            # span running at start() did not
            assert per_id[g.id] in (g.switches, g.switches + 1), (
                g, per_id[g.id])


# ---------------------------------------------------------------------------
# the seed scenario

def a():
    gevent.sleep(0)
    b()
    spin(1)


def b():
    spin(5)
    gevent.sleep(0)
    c()


def c():
    spin(7)


def test_seed_scenario(no_gc, make_profiler):
    p = make_profiler(clock="cpu")
    p.start()
    g = gevent.spawn(a)
    gevent.sleep(0)
    spin(2)
    gevent.sleep(0)
    spin(3)
    gevent.sleep(0)
    g.join()
    p.stop()
    assert g.successful()

    stats = p.func_stats()
    assert all(isinstance(f, FuncStat) for f in stats)
    assert [f.ttot for f in stats] == sorted((f.ttot for f in stats),
                                             reverse=True)
    fspin = func_stat(stats, spin)
    assert fspin is not None
    assert (fspin.ncall, fspin.nactualcall) == (5, 5)
    assert_units(fspin.ttot, 18, what="spin ttot")

    fa, fb, fc = (func_stat(stats, fn) for fn in (a, b, c))
    for f, expected in ((fa, 13), (fb, 12), (fc, 7)):
        assert f is not None
        assert (f.ncall, f.nactualcall) == (1, 1), f
        assert_units(f.ttot, expected, what=f.name + " ttot")
        # Everything is in spin or in callees: time spent in other
        # greenlets (cpu clock) must not be charged here.
        assert units(f.tsub) < 0.5, (f.name, units(f.tsub))

    assert child_names(fa) == {"spin", "b", "sleep"}
    assert child_names(fb) == {"spin", "c", "sleep"}
    assert child_names(fc) == {"spin"}
    assert all(isinstance(ch, ChildStat) for ch in fa.children)
    assert_units(child(fa, "b").ttot, 12, what="a->b")
    assert_units(child(fa, "spin").ttot, 1, what="a->spin")
    assert_units(child(fb, "spin").ttot, 5, what="b->spin")
    assert_units(child(fb, "c").ttot, 7, what="b->c")
    assert_units(child(fc, "spin").ttot, 7, what="c->spin")
    assert child(fa, "sleep").module == "gevent.hub"
    assert units(child(fa, "sleep").ttot) < 0.5
    assert child(fa, "spin").ncall == 1
    assert child(fa, "spin").lineno == spin.__code__.co_firstlineno
    assert child(fa, "spin").filename == spin.__code__.co_filename
    # a's children are sorted by inclusive time
    assert [ch.name for ch in fa.children][:2] == ["b", "spin"]

    # FuncStat fields
    assert fa.name == "a"
    assert fa.qualname == "a"
    assert fa.module == a.__module__
    assert fa.full_name == "%s.a" % a.__module__
    assert fa.filename == a.__code__.co_filename == os.path.abspath(__file__)
    assert fa.lineno == a.__code__.co_firstlineno
    assert fa.tavg == pytest.approx(fa.ttot / fa.ncall)
    assert fspin.tavg == pytest.approx(fspin.ttot / 5)
    assert_units(fspin.tavg, 18 / 5, what="spin tavg")
    d = fa.to_dict()
    assert d["tavg"] == fa.tavg and d["name"] == "a"
    assert_sane(p)


# ---------------------------------------------------------------------------
# recursion

def r(n):
    spin(1)
    gevent.sleep(0)
    gevent.sleep(0)
    if n > 1:
        r(n - 1)


def s(n):
    spin(1)
    gevent.sleep(0)
    gevent.sleep(0)
    if n > 1:
        s(n - 1)


def test_recursive_functions_across_greenlets(no_gc, make_profiler):
    p = make_profiler(clock="cpu")
    with p:
        gevent.joinall([gevent.spawn(r, 10), gevent.spawn(s, 2)],
                       raise_error=True)
    stats = p.func_stats()
    fr, fs = func_stat(stats, r), func_stat(stats, s)
    assert (fr.ncall, fr.nactualcall) == (10, 1)
    assert_units(fr.ttot, 10, what="r ttot")
    assert_units(fr.tavg, 1, what="r tavg")
    assert units(fr.tsub) < 1
    assert (fs.ncall, fs.nactualcall) == (2, 1)
    assert_units(fs.ttot, 2, what="s ttot")
    assert_units(fs.tavg, 1, what="s tavg")
    assert child(fr, "r").ncall == 9
    assert child(fs, "s").ncall == 1
    assert child(fr, "spin").ncall == 10
    assert func_stat(stats, spin).ncall == 12
    assert_units(func_stat(stats, spin).ttot, 12, what="spin ttot")
    assert_sane(p)


# ---------------------------------------------------------------------------
# clocks

def blocker():
    time.sleep(0.2)  # not monkey-patched: blocks the whole thread


def blocking_greenlet():
    gevent.sleep(0)
    blocker()
    gevent.sleep(0)


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_clock_with_thread_blocking_sleep(make_profiler, clock):
    assert not gevent.monkey.is_module_patched("time")
    p = make_profiler(clock=clock)
    with p:
        g = gevent.spawn(blocking_greenlet)
        g.join()
    f = func_stat(p.func_stats(), blocker)
    assert f is not None and f.ncall == 1
    if clock == "wall":
        assert 0.19 <= f.ttot < 1.0, f.ttot
        assert 0.19 <= f.tsub < 1.0, f.tsub
    else:
        assert f.ttot < 0.05, f.ttot
    # The span that blocked: long on the wall clock, ~no CPU either way.
    spans = spans_of(p, blocking_greenlet)
    longest = max(spans, key=lambda sp: sp.wall)
    assert 0.19 <= longest.wall < 1.0, longest
    assert longest.cpu is not None and longest.cpu < 0.05, longest
    [gs] = greenlet_stat_of(p, blocking_greenlet)
    assert gs.wall >= 0.19 and gs.cpu < 0.05, gs


def waiter():
    gevent.sleep(0)


def waiting_greenlet():
    waiter()


def hog():
    spin(5)


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_clock_latency_view(no_gc, make_profiler, clock):
    """wall charges the time a greenlet waited while others ran; cpu not."""
    p = make_profiler(clock=clock)
    with p:
        gevent.joinall([gevent.spawn(waiting_greenlet), gevent.spawn(hog)],
                       raise_error=True)
    stats = p.func_stats()
    fw = func_stat(stats, waiter)
    fh = func_stat(stats, hog)
    assert fw is not None and fw.ncall == 1
    if clock == "wall":
        # waiter was suspended for the whole of hog (wall >= cpu: the
        # machine may be loaded, so no upper bound)
        assert units(fh.ttot) >= 5 * 0.95
        assert fw.ttot >= 0.95 * fh.ttot, (units(fw.ttot), units(fh.ttot))
        assert child(fw, "sleep").ttot >= 0.95 * fh.ttot
    else:
        assert units(fw.ttot) < 0.5, units(fw.ttot)
        assert_units(fh.ttot, 5, what="hog")


# ---------------------------------------------------------------------------
# exceptions

class Boom(Exception):
    pass


def thrower(depth):
    gevent.sleep(0)
    if depth == 0:
        raise Boom("deep")
    thrower(depth - 1)


def after_exc():
    spin(1)


def catcher():
    for _ in range(5):
        try:
            thrower(3)
        except Boom:
            pass
    after_exc()


def dies():
    thrower(2)


def raw_thrower(depth):
    if depth == 0:
        raise Boom("raw")
    raw_thrower(depth - 1)


def raw_dies():
    greenlet.getcurrent().parent.switch()
    raw_thrower(2)


def later():
    spin(1)


def test_exceptions_unwinding_through_greenlets(no_gc, make_profiler):
    hub = gevent.get_hub()
    hub.exception_stream = None  # do not print the expected tracebacks
    try:
        p = make_profiler(clock="cpu")
        with p:
            gs = [gevent.spawn(catcher), gevent.spawn(catcher),
                  gevent.spawn(dies)]
            gevent.joinall(gs)
            rg = greenlet.greenlet(raw_dies)
            rg.switch()
            with pytest.raises(Boom):
                rg.switch()
            assert rg.dead
            later()
    finally:
        del hub.exception_stream
    assert gs[0].successful() and gs[1].successful()
    assert isinstance(gs[2].exception, Boom)

    stats = p.func_stats()
    ft = func_stat(stats, thrower)
    assert ft.ncall == 2 * 5 * 4 + 3
    assert ft.nactualcall == 2 * 5 + 1
    assert units(ft.ttot) < 1
    assert child_names(ft) == {"sleep", "thrower"}
    fc = func_stat(stats, catcher)
    assert (fc.ncall, fc.nactualcall) == (2, 2)
    assert_units(fc.ttot, 2, what="catcher")
    assert child_names(fc) == {"thrower", "after_exc"}
    assert child(fc, "thrower").ncall == 10
    fa = func_stat(stats, after_exc)
    assert fa.ncall == 2
    assert_units(fa.ttot, 2, what="after_exc")
    assert func_stat(stats, dies).ncall == 1
    fraw = func_stat(stats, raw_thrower)
    assert (fraw.ncall, fraw.nactualcall) == (3, 1)
    assert func_stat(stats, raw_dies).ncall == 1
    assert child_names(func_stat(stats, raw_dies)) == {"raw_thrower"}
    fl = func_stat(stats, later)
    assert fl.ncall == 1 and child_names(fl) == {"spin"}
    assert_units(fl.ttot, 1, what="later")
    # spin was only ever called from after_exc and later
    assert func_stat(stats, spin).ncall == 3

    [gdies] = greenlet_stat_of(p, dies)
    assert gdies.finished
    assert spans_of(p, dies)[-1].finished
    assert all(g.finished for g in greenlet_stat_of(p, catcher))
    assert_sane(p)


# ---------------------------------------------------------------------------
# greenlets spawned before start()

def inner_pre():
    spin(1)


def pre_spawned(ev):
    ev.wait()
    for _ in range(3):
        inner_pre()
    gevent.sleep(0)
    inner_pre()


def test_greenlet_spawned_before_start(no_gc, make_profiler):
    ev = gevent.event.Event()
    g = gevent.spawn(pre_spawned, ev)
    gevent.sleep(0)
    assert g and not g.dead  # started, waiting on ev
    p = make_profiler()
    with p:
        ev.set()
        g.join()
    assert g.successful()
    stats = p.func_stats()
    fi = func_stat(stats, inner_pre)
    assert fi.ncall == 4
    assert_units(fi.ttot, 4, what="inner_pre")
    # Entered before profiling began: it has no recorded call to charge.
    assert func_stat(stats, pre_spawned) is None
    [gs] = greenlet_stat_of(p, pre_spawned)
    assert gs.finished and gs.switches == 2
    assert gs.name == "Greenlet"
    assert_units(gs.cpu, 4, what="greenlet cpu")
    sp = spans_of(p, pre_spawned)
    assert len(sp) == 2 and sp[-1].finished and not sp[0].finished
    assert {x.greenlet_id for x in sp} == {gs.id}
    assert_sane(p)


# ---------------------------------------------------------------------------
# thousands of short-lived greenlets (addresses reused)

def short(i):
    gevent.sleep(0)


def test_thousands_of_short_lived_greenlets(make_profiler):
    n, batch = 5000, 100
    addresses = []
    names = set()
    p = make_profiler(calls=True)
    with p:
        for start in range(0, n, batch):
            gs = []
            for i in range(start, start + batch):
                g = gevent.Greenlet(short, i)
                g.name = "short-%d" % i
                g.start()
                gs.append(g)
                names.add(g.name)
            gevent.joinall(gs, raise_error=True)
            addresses.extend(id(g) for g in gs)
            del gs, g
    assert len(addresses) == n
    # The point of the test: greenlet objects were allocated at addresses
    # used before by other (dead) greenlets.
    assert len(set(addresses)) < n, "no address reuse happened"

    stats = greenlet_stat_of(p, short)
    assert len(stats) == n
    assert len({g.id for g in stats}) == n
    assert all(g.finished for g in stats)
    assert all(g.switches == 2 for g in stats), collections.Counter(
        g.switches for g in stats)
    assert {g.name for g in stats} == names

    by_id = collections.defaultdict(list)
    for sp in spans_of(p, short):
        by_id[sp.greenlet_id].append(sp)
    assert len(by_id) == n
    id_to_name = {}
    for gid, sps in by_id.items():
        assert len({x.greenlet_name for x in sps}) == 1
        id_to_name[gid] = sps[0].greenlet_name
        assert len(sps) == 2, sps
        assert sps[-1].finished and not sps[0].finished
    # one id <-> one greenlet
    assert len(set(id_to_name.values())) == n
    assert func_stat(p.func_stats(), short).ncall == n
    assert p.dropped_spans == 0


def raw_body():
    greenlet.getcurrent().parent.switch()
    greenlet.getcurrent().parent.switch()


def test_raw_greenlets_collected_while_suspended(make_profiler):
    """Greenlets killed by the garbage collector (GreenletExit thrown in)
    end, and a greenlet later allocated at the same address is new."""
    n = 1000
    addresses = []
    p = make_profiler()
    with p:
        for _ in range(n):
            g = greenlet.greenlet(raw_body)
            g.switch()
            addresses.append(id(g))
            del g
            gc.collect(0)
    assert len(set(addresses)) < n
    mine = [gs for gs in p.greenlet_stats() if gs.finished]
    assert len(mine) == n
    assert len({gs.id for gs in mine}) == n
    assert all(gs.switches == 2 for gs in mine)
    assert all(gs.name == "greenlet" for gs in mine)
    assert func_stat(p.func_stats(), raw_body).ncall == n


# ---------------------------------------------------------------------------
# several OS threads, each with its own hub

def thread_work_0():
    gevent.sleep(0)
    spin(1)
    gevent.sleep(0)


def thread_work_1():
    gevent.sleep(0)
    spin(1)
    gevent.sleep(0)


def thread_work_2():
    gevent.sleep(0)
    spin(1)
    gevent.sleep(0)


THREAD_JOBS = ((thread_work_0, 2), (thread_work_1, 3), (thread_work_2, 4))


def run_hub_thread(fn, k, out):
    try:
        gs = [gevent.spawn(fn) for _ in range(k)]
        gevent.joinall(gs, raise_error=True)
        out.append((threading.get_ident(), time.thread_time()))
    finally:
        gevent.get_hub().destroy(destroy_loop=True)


def run_threads(jobs):
    out = []
    threads = [threading.Thread(target=run_hub_thread, args=(fn, k, out))
               for fn, k in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    assert len(out) == len(jobs), "a thread failed"
    return out


def test_threads_each_with_own_hub(no_gc, make_profiler):
    p = make_profiler(clock="cpu")
    with p:
        gevent.spawn(thread_work_0).join()  # the main thread too
        run_threads(THREAD_JOBS)
    stats = p.func_stats()
    ids_by_fn = {}
    for fn, k in THREAD_JOBS:
        extra = 1 if fn is thread_work_0 else 0
        f = func_stat(stats, fn)
        assert f is not None, fn
        assert f.ncall == k + extra, (fn, f.ncall)
        assert_units(f.ttot, k + extra, what=fn.__name__)
        gss = greenlet_stat_of(p, fn)
        assert len(gss) == k + extra
        assert all(g.finished and g.switches == 3 for g in gss), gss
        for g in gss:
            # Each thread's CPU clock is its own: reading another thread's
            # clock would be off by far more than this.
            assert 0.7 <= units(g.cpu) <= 1.6 + overshoot_units(), (
                "cpu of a %s greenlet: %.2f units (+%.2f the clock jumped)"
                % (fn.__name__, units(g.cpu), overshoot_units()))
        ids_by_fn[fn] = {g.id for g in gss}
    all_ids = [i for ids in ids_by_fn.values() for i in ids]
    assert len(all_ids) == len(set(all_ids))
    gstats = p.greenlet_stats()
    assert len({g.id for g in gstats}) == len(gstats)
    # one hub per thread that ran greenlets
    hubs = [g for g in gstats if g.name == "Hub"]
    assert len(hubs) >= len(THREAD_JOBS) + 1
    assert func_stat(stats, spin).ncall == 2 + 3 + 4 + 1
    assert_sane(p)


def test_threads_cpu_is_measured_in_their_own_thread(make_profiler):
    """The main greenlet of a profiled thread that already ended must not
    get the CPU time of the thread that called stop()."""
    spin(10)  # the stopping thread has used more CPU than the others
    p = make_profiler(clock="cpu")
    with p:
        out = run_threads(((thread_work_1, 1), (thread_work_2, 1)))
        time.sleep(0.1)
    thread_cpu = max(cpu for _ident, cpu in out)
    mains = [g for g in p.greenlet_stats() if g.fn_name == "<main>"]
    assert len(mains) == 3  # this thread's and the two threads'
    for g in mains:
        assert g.cpu <= g.wall + 0.005, g
    others = sorted(mains, key=lambda g: g.id)[1:]
    for g in others:
        assert g.cpu <= thread_cpu + 0.005, (g, thread_cpu)


# ---------------------------------------------------------------------------
# many switches, span caps

def pinger(k):
    for _ in range(k):
        gevent.sleep(0)


class SwitchCounter:
    def __init__(self):
        self.n = 0

    def __call__(self, event, args):
        self.n += 1


def test_many_switches(make_profiler):
    counter = SwitchCounter()
    greenlet.settrace(counter)
    p = make_profiler(calls=False)
    with p:
        gevent.joinall([gevent.spawn(pinger, 26000) for _ in range(2)])
    greenlet.settrace(None)
    assert counter.n >= 100000
    kept = len(p.spans())
    assert kept == 100000  # the default cap
    # every switch closed one span: kept or counted as dropped
    assert abs(kept + p.dropped_spans - counter.n) <= 2, (
        kept, p.dropped_spans, counter.n)
    assert abs(sum(g.switches for g in p.greenlet_stats()) - counter.n) <= 2


def test_max_spans_keeps_the_most_recent(make_profiler):
    counter = SwitchCounter()
    greenlet.settrace(counter)
    p = make_profiler(calls=False, max_spans=1000)
    with p:
        gevent.joinall([gevent.spawn(pinger, 2000) for _ in range(2)])
        t_mid = time.time()
        gevent.joinall([gevent.spawn(pinger, 1000) for _ in range(2)])
    greenlet.settrace(None)
    spans = p.spans()
    assert len(spans) == 1000
    assert p.dropped_spans == counter.n + 1 - 1000
    assert p.dropped_spans > 5000
    assert all(sp.start >= t_mid - 0.001 for sp in spans)
    assert [sp.start for sp in spans] == sorted(sp.start for sp in spans)
    # totals are not capped
    assert abs(sum(g.switches for g in p.greenlet_stats()) - counter.n) <= 2


def test_max_spans_zero(make_profiler):
    p = make_profiler(max_spans=0)
    with p:
        gevent.spawn(pinger, 10).join()
    assert p.spans() == []
    assert p.dropped_spans > 20
    assert greenlet_stat_of(p, pinger)[0].switches == 11


# ---------------------------------------------------------------------------
# start / stop / clear

def counted():
    return 1


def test_stop_then_start_again(make_profiler):
    p = make_profiler()
    assert not p.running
    p.start()
    assert p.running
    counted()
    counted()
    p.stop()
    assert not p.running
    assert func_stat(p.func_stats(), counted).ncall == 2
    counted()  # not profiled
    assert func_stat(p.func_stats(), counted).ncall == 2
    p.start()
    for _ in range(3):
        counted()
    gevent.spawn(counted).join()
    p.stop()
    assert func_stat(p.func_stats(), counted).ncall == 6
    assert_sane(p)

    p2 = make_profiler()
    with p2:
        counted()
    assert func_stat(p2.func_stats(), counted).ncall == 1
    assert func_stat(p.func_stats(), counted).ncall == 6


def test_clear(make_profiler):
    p = make_profiler()
    with p:
        counted()
        gevent.spawn(counted).join()
    assert p.func_stats() and p.spans() and p.greenlet_stats()
    p.clear()
    assert p.func_stats() == []
    assert p.spans() == []
    assert p.greenlet_stats() == []
    assert p.dropped_spans == 0
    # clear while running: only what follows is kept
    with p:
        counted()
        counted()
        p.clear()
        counted()
        gevent.sleep(0)
    assert func_stat(p.func_stats(), counted).ncall == 1
    assert p.spans()
    # and the profiler can run again after a clear
    with p:
        counted()
    assert func_stat(p.func_stats(), counted).ncall == 2


# ---------------------------------------------------------------------------
# chaining with previously installed hooks

def test_chains_previous_greenlet_trace(make_profiler):
    events = []

    def prev_trace(event, args):
        origin, target = args
        events.append((event, type(origin).__name__, type(target).__name__))

    greenlet.settrace(prev_trace)
    p = make_profiler()
    with p:
        gevent.joinall([gevent.spawn(pinger, 5) for _ in range(3)])
        assert greenlet.gettrace() is not prev_trace
    assert greenlet.gettrace() is prev_trace
    n_during = len(events)
    switches = sum(g.switches for g in p.greenlet_stats())
    assert n_during >= 3 * 5 * 2
    assert n_during == switches, (n_during, switches)
    assert {e[0] for e in events} <= {"switch", "throw"}
    gevent.spawn(pinger, 1).join()  # still installed after stop()
    assert len(events) > n_during
    greenlet.settrace(None)


def marker():
    return 1


def test_chains_previous_sys_setprofile(make_profiler):
    seen = []

    def prev_profile(frame, event, arg):
        if event == "call" and frame.f_code is marker.__code__:
            seen.append(event)

    sys.setprofile(prev_profile)
    try:
        p = make_profiler(calls=True)
        with p:
            for _ in range(4):
                marker()
            gevent.spawn(lambda: [marker() for _ in range(3)]).join()
        assert sys.getprofile() is prev_profile
        assert len(seen) == 7
        assert func_stat(p.func_stats(), marker).ncall == 7
        marker()
        assert len(seen) == 8
    finally:
        sys.setprofile(None)


def target_fn():
    return 1


def run_target_fn():
    for _ in range(3):
        target_fn()


def test_threads_with_previous_threading_setprofile(make_profiler):
    """A threading.setprofile() function installed before start() keeps
    being called in new threads, and greqprof still records their calls."""
    seen = []

    def prev(frame, event, arg):
        if event == "call" and frame.f_code is target_fn.__code__:
            seen.append(1)

    threading.setprofile(prev)
    try:
        p = make_profiler()
        with p:
            t = threading.Thread(target=run_target_fn)
            t.start()
            t.join()
        assert threading.getprofile() is prev
    finally:
        threading.setprofile(None)
    assert len(seen) == 3
    f = func_stat(p.func_stats(), target_fn)
    assert f is not None and f.ncall == 3


def test_previous_thread_profile_still_called_after_stop():
    """A thread that outlives stop() keeps calling the threading.setprofile
    function that was installed before greqprof's hook."""
    ready, go = threading.Event(), threading.Event()
    seen = []

    def prev(frame, event, arg):
        if event == "call" and frame.f_code is target_fn.__code__:
            seen.append(1)

    def runner():
        target_fn()
        ready.set()
        go.wait(10)
        target_fn()
        target_fn()

    threading.setprofile(prev)
    try:
        p = greqprof.Profiler()
        p.start()
        try:
            t = threading.Thread(target=runner)
            t.start()
            assert ready.wait(10)
        finally:
            p.stop()
        go.set()
        t.join(10)
    finally:
        threading.setprofile(None)
    assert func_stat(p.func_stats(), target_fn).ncall == 1
    assert len(seen) == 3


# ---------------------------------------------------------------------------
# options

def test_calls_false(make_profiler):
    p = make_profiler(calls=False)
    with p:
        assert sys.getprofile() is None
        gevent.spawn(pinger, 3).join()
        counted()
    assert p.func_stats() == []
    spans = p.spans()
    assert len(spans) >= 8
    assert all(sp.cpu is not None for sp in spans)
    [gs] = greenlet_stat_of(p, pinger)
    assert gs.switches == 4 and gs.cpu is not None


def test_wall_clock_without_calls_measures_no_cpu(make_profiler):
    p = make_profiler(clock="wall", calls=False)
    with p:
        gevent.spawn(pinger, 3).join()
    assert p.func_stats() == []
    spans = p.spans()
    assert spans
    assert all(sp.cpu is None for sp in spans)
    assert all(g.cpu is None for g in p.greenlet_stats())
    assert all(sp.wall >= 0 for sp in spans)


def uses_builtins():
    time.sleep(0.002)
    time.sleep(0.002)
    n = 0
    for x in ([1], [1, 2], [], "abc", (1,)):
        n += len(x)
    return n


def test_builtins(make_profiler):
    p = make_profiler(clock="wall", builtins=True)
    with p:
        gevent.spawn(uses_builtins).join()
    stats = p.func_stats()
    fu = func_stat(stats, uses_builtins)
    csleep = child(fu, "sleep")
    assert csleep.ncall == 2
    assert csleep.module == "time" and csleep.qualname == "sleep"
    assert csleep.ttot >= 0.004
    clen = child(fu, "len")
    assert clen.ncall == 5
    assert clen.module == "builtins" and clen.qualname == "len"
    [fsleep] = [f for f in stats if f.full_name == "time.sleep"]
    assert fsleep.name == "sleep" and fsleep.ncall >= 2
    assert fsleep.ttot >= 0.004
    flen = [f for f in stats if f.full_name == "builtins.len"]
    assert len(flen) == 1 and flen[0].ncall >= 5

    # without builtins=True no C function is recorded
    p2 = make_profiler(clock="wall")
    with p2:
        gevent.spawn(uses_builtins).join()
    assert {c.name for c in func_stat(p2.func_stats(), uses_builtins)
            .children} == set()
    assert not [f for f in p2.func_stats() if f.full_name == "time.sleep"]


# ---------------------------------------------------------------------------
# bad input and states

@pytest.mark.parametrize("kwargs, word", [
    (dict(clock="gpu"), "clock"),
    (dict(clock=None), "clock"),
    (dict(cpu="fast"), "cpu"),
    (dict(max_spans=-1), "max_spans"),
    (dict(max_spans="10"), "max_spans"),
    (dict(max_spans=1.5), "max_spans"),
    (dict(cpu_window=-0.1), "cpu_window"),
    (dict(stack_threshold=-1), "stack_threshold"),
    (dict(max_depth=0), "max_depth"),
])
def test_bad_options(kwargs, word):
    with pytest.raises(ConfigError) as ei:
        greqprof.Profiler(**kwargs)
    assert word in str(ei.value)
    assert repr(list(kwargs.values())[0]) in str(ei.value)
    assert isinstance(ei.value, ValueError)
    assert isinstance(ei.value, GreqprofError)


def test_state_errors(make_profiler):
    p = make_profiler()
    with pytest.raises(ProfilerStateError, match="not started"):
        p.stop()
    p.start()
    with pytest.raises(ProfilerStateError, match="already started"):
        p.start()
    assert p.running
    counted()  # still profiling after the failed start
    p.stop()
    with pytest.raises(ProfilerStateError, match="not started"):
        p.stop()
    assert func_stat(p.func_stats(), counted).ncall == 1
    assert isinstance(ProfilerStateError("x"), RuntimeError)


def test_never_started_profiler_is_empty():
    p = greqprof.Profiler()
    assert p.func_stats() == []
    assert p.spans() == []
    assert p.greenlet_stats() == []
    assert p.dropped_spans == 0
    assert p.dropped_calls == 0
    assert not p.running


def test_second_profiler_in_same_thread(make_profiler):
    p1 = make_profiler()
    p2 = make_profiler()
    p1.start()
    with pytest.raises(ProfilerStateError, match="already running"):
        p2.start()
    assert not p2.running
    assert p1.running
    counted()
    p1.stop()
    assert func_stat(p1.func_stats(), counted).ncall == 1
    assert p2.func_stats() == []
    # once p1 stopped, p2 may run
    with p2:
        counted()
    assert func_stat(p2.func_stats(), counted).ncall == 1


def test_stop_from_another_thread_is_refused(make_profiler):
    p = make_profiler()
    p.start()
    errors = []

    def other():
        try:
            p.stop()
        except ProfilerStateError as e:
            errors.append(e)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 1 and p.running
    p.stop()


# ---------------------------------------------------------------------------
# span and greenlet records

def long_part():
    time.sleep(0.1)  # blocking: a long span
    gevent.sleep(0)  # ... that ends here


def worker():
    gevent.sleep(0)
    long_part()
    gevent.sleep(0)


def test_span_fields(make_profiler):
    t0 = time.time()
    p = make_profiler(clock="wall", stack_threshold=0.05)
    with p:
        g = gevent.spawn(worker)
        g.join()
    t1 = time.time()
    spans = p.spans()
    assert all(isinstance(sp, Span) for sp in spans)
    mine = [sp for sp in spans if sp.fn_name == qualified(worker)]
    assert qualified(worker).endswith("test_profiler.worker")
    assert len(mine) == 4
    assert len({sp.greenlet_id for sp in mine}) == 1
    for sp in mine:
        # gevent's generated name ("Greenlet-N") is not read: it would
        # change the greenlet's repr.  Unnamed greenlets go by their class.
        assert sp.greenlet_name == "Greenlet"
        assert sp.start < sp.end
        assert sp.wall == pytest.approx(sp.end - sp.start, abs=1e-5)
        assert t0 - 0.5 <= sp.start <= sp.end <= t1 + 0.5
        assert sp.cpu is not None and 0 <= sp.cpu <= sp.wall + 0.002
    assert [sp.finished for sp in mine] == [False, False, False, True]
    for sp in spans:
        assert t0 - 0.5 <= sp.start <= sp.end <= t1 + 0.5, sp
    # the span that blocked in long_part (the others are short unless the
    # machine is so loaded that this process was descheduled for 50 ms)
    ls = max(mine, key=lambda sp: sp.wall)
    assert ls.wall >= 0.1 and not ls.finished
    assert ls.long
    assert ls.stack is not None
    assert "in long_part" in ls.stack and "in worker" in ls.stack
    assert ls.stack.index("in worker") < ls.stack.index("in long_part")
    assert os.path.abspath(__file__) in ls.stack
    for sp in mine:
        assert sp.long == (sp.wall >= 0.05), sp
        if not sp.long:
            assert sp.stack is None, sp
    assert sum(sp.stack is None for sp in mine) >= 2
    d = ls.to_dict()
    assert d["greenlet_id"] == ls.greenlet_id and d["stack"] == ls.stack

    # no stacks at all with stack_threshold=None
    p2 = make_profiler(clock="wall", stack_threshold=None)
    with p2:
        gevent.spawn(worker).join()
    assert all(sp.stack is None for sp in p2.spans())


def stat_worker():
    for _ in range(3):
        spin(1)
        gevent.sleep(0)


def test_names_do_not_change_the_app(make_profiler):
    """A name the app gave is reported; an unnamed gevent Greenlet is
    reported by its class, and profiling does not make gevent generate
    (and from then on show) its "Greenlet-N" name."""
    p = make_profiler()
    with p:
        plain = gevent.spawn(stat_worker)
        named = gevent.spawn(stat_worker)
        named.name = "fetcher"
        gevent.joinall([plain, named])
    assert "Greenlet-" not in repr(plain)
    by_id = {}
    for sp in p.spans():
        if sp.fn_name == qualified(stat_worker):
            by_id.setdefault(sp.greenlet_name, set()).add(sp.greenlet_id)
    assert set(by_id) == {"Greenlet", "fetcher"}
    assert all(len(ids) == 1 for ids in by_id.values())


def test_greenlet_stats(no_gc, make_profiler):
    p = make_profiler(clock="cpu")
    with p:
        g = gevent.spawn(stat_worker)
        g.join()
    gstats = p.greenlet_stats()
    assert all(isinstance(x, GreenletStat) for x in gstats)
    assert [x.id for x in gstats] == sorted({x.id for x in gstats})
    [gs] = greenlet_stat_of(p, stat_worker)
    assert gs.name == "Greenlet"
    assert gs.switches == 4
    assert gs.finished
    assert_units(gs.cpu, 3, what="greenlet cpu")
    assert gs.wall >= gs.cpu - 0.002
    sp = spans_of(p, stat_worker)
    assert len(sp) == gs.switches
    assert {x.greenlet_id for x in sp} == {gs.id}
    assert sum(x.wall for x in sp) == pytest.approx(gs.wall, abs=1e-6)
    assert sum(x.cpu for x in sp) == pytest.approx(gs.cpu, abs=1e-6)
    main = [x for x in gstats if x.fn_name == "<main>"]
    assert len(main) == 1 and not main[0].finished
    hub = [x for x in gstats if x.name == "Hub"]
    assert len(hub) == 1 and hub[0].fn_name == "gevent.hub.Hub.run"
    assert gs.to_dict()["id"] == gs.id


# ---------------------------------------------------------------------------
# stopping while a profiled thread keeps running

STOP_WHILE_THREAD_RUNS = textwrap.dedent("""
    import threading, gevent, greqprof
    ready = threading.Event(); go = threading.Event()
    def pinger(n):
        for _ in range(n):
            gevent.sleep(0)
    def runner():
        gevent.joinall([gevent.spawn(pinger, 100) for _ in range(2)])
        ready.set()
        go.wait()
        gevent.joinall([gevent.spawn(pinger, 2000) for _ in range(2)])
        gevent.get_hub().destroy(destroy_loop=True)
    p = greqprof.Profiler()
    p.start()
    t = threading.Thread(target=runner)
    t.start()
    ready.wait()
    p.stop()
    go.set()
    t.join()
    print("done")
""")


def test_stop_while_profiled_thread_keeps_running():
    """stop() from the main thread while another profiled thread is still
    switching greenlets: that thread's hooks must stay safe to call.
    MALLOC_PERTURB_ makes a use of freed memory visible as a crash."""
    env = child_env(MALLOC_PERTURB_="165")
    res = subprocess.run([sys.executable, "-c", STOP_WHILE_THREAD_RUNS],
                         cwd=CHILD_CWD, env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0 and "done" in res.stdout, (
        res.returncode, res.stderr[-2000:])


RESTART_IN_THREAD_AFTER_STOP = textwrap.dedent("""
    import threading, gevent, greqprof
    ready = threading.Event(); go = threading.Event(); res = {}
    def f():
        return 1
    def pinger(n):
        for _ in range(n):
            gevent.sleep(0)
    def runner():
        gevent.joinall([gevent.spawn(pinger, 50) for _ in range(2)])
        ready.set()
        go.wait()
        q = greqprof.Profiler()
        q.start()
        for _ in range(3):
            f()
        gevent.joinall([gevent.spawn(pinger, 5) for _ in range(2)])
        q.stop()
        res["f"] = [x.ncall for x in q.func_stats() if x.name == "f"]
        gevent.get_hub().destroy(destroy_loop=True)
    p = greqprof.Profiler()
    p.start()
    t = threading.Thread(target=runner)
    t.start()
    ready.wait()
    p.stop()
    go.set()
    t.join()
    print("result", res.get("f"))
""")


def test_new_profiler_in_thread_after_stop_from_main():
    """A thread profiled by a Profiler stopped in the main thread can run a
    Profiler of its own afterwards."""
    for perturb in ("", "165"):
        env = child_env()
        env.pop("MALLOC_PERTURB_", None)
        if perturb:
            env["MALLOC_PERTURB_"] = perturb
        res = subprocess.run(
            [sys.executable, "-c", RESTART_IN_THREAD_AFTER_STOP],
            cwd=CHILD_CWD,
            env=env, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, (perturb, res.returncode,
                                     res.stderr[-2000:])
        assert "result [3]" in res.stdout, (perturb, res.stdout,
                                            res.stderr[-2000:])
