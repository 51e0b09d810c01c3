"""The watchdog does not take the hub's idle wait for blocking: the hooks
tell it the hub's id (_registry.hub_ids).  (Found in review: Engine.hub_gid
was never set, so every idle wait longer than blocking_ms had its stack
captured and stored where nothing read it.)"""
import gevent

from test_middleware import serve  # noqa: F401
from greqprof import engine


def hub_sampled(eng):
    """The hub's spans the watchdog sampled (keys: (greenlet id, start));
    on a loaded machine another greenlet of the thread, the test's client
    among them, may pass blocking_ms and be sampled rightly."""
    from greqprof import _registry
    hub = _registry.hub_ids[eng.thread_ident]   # (the hooks' id of it)
    return [k for k in eng.sampled_stacks if k[0] == hub]


def test_watchdog_samples_the_idle_hub(serve):
    def app(environ, start_response):
        start_response("200 OK", [])
        return [b"ok"]

    s = serve(app, pct=0.0, blocking_ms=20, watchdog=True)
    assert s.get("/").status == 200
    eng = engine.current_engine()
    for _ in range(10):
        gevent.sleep(0.1)          # the loop idles 100 ms at a time
    print("hub_gid", eng.hub_gid, "sampled_stacks", len(eng.sampled_stacks))
    for k, v in list(eng.sampled_stacks.items())[:1]:
        print(k, v[-300:])
    assert not hub_sampled(eng), "idle hub waits were sampled"


def test_a_new_engine_in_the_thread_does_not_keep_the_old_hub_id(serve):
    """The hub's id is the tracer's: an engine set up again in the thread
    (engine.shutdown, then a new middleware) numbers it anew.  The watchdog
    used to keep the first id it read, so a check made before the new
    tracer saw the hub kept the old one and every idle wait of the loop was
    sampled as blocking (flaky in the full suite)."""
    import threading
    from greqprof import _registry

    def app(environ, start_response):
        start_response("200 OK", [])
        return [b"ok"]

    s = serve(app, pct=0.0, blocking_ms=20, watchdog=True)
    assert s.get("/").status == 200
    me = threading.get_ident()
    assert me in _registry.hub_ids
    engine.shutdown()
    assert me not in _registry.hub_ids   # failed before: the old id stayed

    s2 = serve(app, pct=0.0, blocking_ms=20, watchdog=True)
    assert s2.get("/").status == 200
    eng = engine.current_engine()
    eng.hub_gid = -1                  # what a stale read had left
    for _ in range(10):
        gevent.sleep(0.1)             # the loop idles 100 ms at a time
    assert eng.hub_gid == _registry.hub_ids[me]
    assert not hub_sampled(eng), "idle hub waits were sampled"
