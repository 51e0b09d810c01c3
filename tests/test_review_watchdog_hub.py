"""The watchdog does not take the hub's idle wait for blocking: the hooks
tell it the hub's id (_registry.hub_ids).  (Found in review: Engine.hub_gid
was never set, so every idle wait longer than blocking_ms had its stack
captured and stored where nothing read it.)"""
import gevent

from test_middleware import serve  # noqa: F401
from greqprof import engine


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
    assert not eng.sampled_stacks, "idle hub waits were sampled"
