"""The finisher while a sampled request's greenlets are still running:
it looks again after 5 ms, doubling up to 50 ms, instead of every 5 ms
for the whole linger (each look is a loop wake-up its neighbours pay
for).  Real pywsgi server; the counts asserted are upper bounds, which a
busy machine only lowers."""
import gevent
import pytest

from greqprof import engine, loops
from test_middleware import serve  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(60)

CHILD = {}


def child():
    for _ in range(12):   # ~0.6 s alive, switching now and then
        gevent.sleep(0.05)
    CHILD["done"] = True


def app(environ, start_response):
    gevent.spawn(child)
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"spawned\n"]


def test_a_lingering_profile_is_looked_at_a_few_times_not_every_5_ms(serve):
    CHILD.clear()
    srv = serve(app, pct=1.0, linger=2.0)
    assert srv.get("/warm").status == 200
    srv.wait_profiles(1)
    eng = engine.current_engine()
    before = eng.finisher_polls
    assert srv.get("/spawn").status == 200
    p = srv.profile_for("/spawn", timeout=10)
    polls = eng.finisher_polls - before
    # It waited for the child (done within the linger) ...
    assert CHILD.get("done")
    kids = [g for g in p.greenlets if g.fn_name.endswith("child")]
    assert len(kids) == 1 and kids[0].finished, p.greenlets
    # ... looking again at most every 50 ms after the first few: ~0.6 s
    # is about 15 looks (every 5 ms it was ~120).
    assert polls <= 0.6 / loops.FINISH_POLL_MAX_S + 12, polls
    assert loops.FINISH_POLL_S < loops.FINISH_POLL_MAX_S <= 0.05

