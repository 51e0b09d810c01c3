"""The watchdog's checks run in the stack sampler's thread when it ticks at
least as often as the watchdog looks (one thread taking the GIL instead of
two), in a thread of their own otherwise; either way a blocking span's
stack is captured while it runs."""
import _thread
import time

import pytest

from greqprof import engine, sampler
from test_middleware import serve  # noqa: F401
from test_middleware import ok, wait_for

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def fresh_watchdog(monkeypatch):
    """No watchdog or sampler left by earlier tests; check() callers are
    recorded by thread."""
    sampler.stop()
    engine.Watchdog.instance = None
    engine.Watchdog.replace()
    callers = []
    real_check = engine.Watchdog.check

    def check(self):
        callers.append(_thread.get_ident())
        return real_check(self)
    monkeypatch.setattr(engine.Watchdog, "check", check)
    yield callers
    sampler.stop()
    engine.Watchdog.instance = None
    engine.Watchdog.replace()


def burn_hosted(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def blocking_app(environ, start_response):
    burn_hosted(0.25)
    return ok()(environ, start_response)


def captured(s, path):
    p = s.profile_for(path)
    stacks = [ev.sampled_stack or "" for ev in p.blocking]
    return any("burn_hosted" in st for st in stacks), stacks


def test_hosted_by_the_sampler(serve, fresh_watchdog, monkeypatch):
    sampler_threads = []
    real_run = sampler._run

    def run(period_ns, gen):
        sampler_threads.append(_thread.get_ident())
        return real_run(period_ns, gen)
    monkeypatch.setattr(sampler, "_run", run)
    s = serve(blocking_app, pct=1.0, blocking_ms=60, stack_hz=100)
    assert s.get("/warm").status == 200
    wd = engine.Watchdog.instance
    assert wd is not None and wd.hosted
    time.sleep(0.1)   # (its own thread, if one started first, has ended)
    del fresh_watchdog[:]
    assert s.get("/block").status == 200
    found, stacks = captured(s, "/block")
    assert found, stacks
    # every check since ran in the sampler's one thread
    assert set(fresh_watchdog) == {sampler_threads[-1]}, \
        (set(fresh_watchdog), sampler_threads)


def test_own_thread_without_the_sampler(serve, fresh_watchdog):
    s = serve(blocking_app, pct=1.0, blocking_ms=60, stack_hz=0)
    assert s.get("/warm").status == 200
    wd = engine.Watchdog.instance
    assert wd is not None and not wd.hosted
    assert s.get("/block").status == 200
    found, stacks = captured(s, "/block")
    assert found, stacks
    assert len(set(fresh_watchdog)) == 1


def test_a_threshold_below_the_tick_keeps_its_thread(serve, fresh_watchdog):
    # blocking_ms=9: the watchdog looks every 5 ms, the sampler ticks
    # every 10 ms
    s = serve(blocking_app, pct=1.0, blocking_ms=9, stack_hz=100)
    assert s.get("/warm").status == 200
    assert sampler.rate() == 100
    wd = engine.Watchdog.instance
    assert wd is not None and not wd.hosted
    del fresh_watchdog[:]
    assert s.get("/block").status == 200
    found, stacks = captured(s, "/block")
    assert found, stacks
    assert len(set(fresh_watchdog)) == 1   # (one thread of its own)


def test_stopping_the_sampler_gives_the_thread_back(serve, fresh_watchdog):
    s = serve(blocking_app, pct=1.0, blocking_ms=60, stack_hz=100)
    assert s.get("/warm").status == 200
    wd = engine.Watchdog.instance
    assert wd.hosted
    sampler.stop()
    assert not wd.hosted and engine.Watchdog.instance is wd
    del fresh_watchdog[:]
    wait_for(lambda: fresh_watchdog, 2.0, "a check from the watchdog's thread")
    assert s.get("/block").status == 200
    found, stacks = captured(s, "/block")
    assert found, stacks
    assert len(set(fresh_watchdog)) == 1


def test_a_lower_threshold_moves_the_check(serve, fresh_watchdog):
    s = serve(blocking_app, pct=1.0, blocking_ms=150, stack_hz=100)
    assert s.get("/warm").status == 200
    first = engine.Watchdog.instance
    assert first.hosted
    s2 = serve(blocking_app, pct=1.0, blocking_ms=60, stack_hz=100)
    assert s2.get("/warm").status == 200
    second = engine.Watchdog.instance
    assert second is not first and second.hosted
    assert second.blocking_ns == 60 * 10**6
    assert s2.get("/block").status == 200
    found, stacks = captured(s2, "/block")
    assert found, stacks


def test_a_lower_threshold_is_checked_at_once(serve, fresh_watchdog):
    # the first watchdog looks every 10 s: the second one's check must not
    # wait for the first one's next turn
    s = serve(blocking_app, pct=1.0, blocking_ms=30000, stack_hz=100)
    assert s.get("/warm").status == 200
    assert engine.Watchdog.instance.hosted
    s2 = serve(blocking_app, pct=1.0, blocking_ms=60, stack_hz=100)
    assert s2.get("/warm").status == 200
    assert engine.Watchdog.instance.hosted
    assert s2.get("/block").status == 200
    found, stacks = captured(s2, "/block")
    assert found, stacks


def test_two_rates_back_to_back_the_later_wins(serve, fresh_watchdog):
    import gevent
    s = serve(blocking_app, pct=0, blocking_ms=30, stack_hz=0)
    assert s.get("/warm").status == 200
    eng = engine._local.engine
    sampler.watch(eng, 10)
    sampler.watch(eng, 1000)   # (its loop may start before the first's)
    assert sampler.rate() == 1000 and engine.Watchdog.instance.hosted
    gevent.sleep(0.3)
    ticks = sampler.stats()["ticks"]
    gevent.sleep(0.5)
    # at 10 Hz, 5 ticks; at 1000 Hz (slowed by this busy process) many more
    assert sampler.stats()["ticks"] - ticks > 50


def test_a_loop_that_fails_gives_the_check_back(serve, fresh_watchdog,
                                                monkeypatch):
    def run(period_ns, gen):
        raise RuntimeError("no loop")
    monkeypatch.setattr(sampler._registry, "sampler_run", run)
    s = serve(blocking_app, pct=1.0, blocking_ms=60, stack_hz=100)
    assert s.get("/warm").status == 200
    wait_for(lambda: not engine.Watchdog.instance.hosted, 2.0,
             "the check back in a thread of its own")
    assert s.get("/block").status == 200
    found, stacks = captured(s, "/block")
    assert found, stacks


def test_the_lowest_rate_still_runs_a_loop():
    from greqprof import _registry
    assert sampler.period_of(100) == 10 ** 7
    assert sampler.period_of(1e-300) == sampler.MAX_PERIOD_NS
    assert sampler.period_of(0.001) == 10 ** 12
    # (a stale generation: returns at once, the period is not refused)
    stale = _registry.sampler_stop() - 1
    assert _registry.sampler_run(sampler.MAX_PERIOD_NS, stale) is None
    with pytest.raises(ValueError, match="period out of range"):
        _registry.sampler_run(sampler.MAX_PERIOD_NS + 1, stale)


def test_a_thread_that_failed_to_start_is_started_later(serve, fresh_watchdog,
                                                        monkeypatch):
    s = serve(blocking_app, pct=1.0, blocking_ms=60, stack_hz=100)
    assert s.get("/warm").status == 200
    wd = engine.Watchdog.instance
    assert wd.hosted
    real = engine._real_thread_functions

    def failing():
        _, sleep = real()

        def start(fn, args):
            raise RuntimeError("can't start new thread")
        return start, sleep
    monkeypatch.setattr(engine, "_real_thread_functions", failing)
    with pytest.raises(RuntimeError):
        sampler.stop()
    monkeypatch.setattr(engine, "_real_thread_functions", real)
    engine.Watchdog.replace()
    assert not wd.hosted and wd.thread_gen
    del fresh_watchdog[:]
    wait_for(lambda: fresh_watchdog, 2.0, "a check from the watchdog's thread")
    assert s.get("/block").status == 200
    found, stacks = captured(s, "/block")
    assert found, stacks


def test_a_thread_not_watched_is_checked_on_time(serve, fresh_watchdog):
    # A watched thread waits in its hub; the main thread's engine is not
    # watched (stack_hz=0): the check it needs keeps its period.
    import threading
    from greqprof import ProfilingMiddleware
    from test_sampler import _serve_in_thread, get
    s = serve(blocking_app, pct=1.0, blocking_ms=100, stack_hz=0)
    assert s.get("/warm").status == 200
    ports, stop = [], threading.Event()
    t = _serve_in_thread(ProfilingMiddleware(blocking_app, pct=0,
                                             stack_hz=100), ports, stop)
    try:
        wait_for(lambda: ports, 10, "the server")
        get(ports[0], "/warm")   # (its first request starts the sampler)
        wait_for(lambda: engine.Watchdog.instance.hosted, 5, "hosting")
        times = []
        real_check = engine.Watchdog.check

        def check(self):
            times.append(time.monotonic())
            return real_check(self)
        engine.Watchdog.check = check
        try:
            time.sleep(1.0)
        finally:
            engine.Watchdog.check = real_check
        gaps = sorted(b - a for a, b in zip(times, times[1:]))
        assert gaps and gaps[len(gaps) // 2] <= 0.045, gaps   # (33 ms)
        assert s.get("/block").status == 200
        found, stacks = captured(s, "/block")
        assert found, stacks
    finally:
        stop.set()
        t.join(10)
