"""Probe: the watchdog reads running_since() (GIL held), then captures the
thread's stack through cffi (GIL released and re-taken), and stores that
stack under the (gid, start) read before.  Whatever the serving thread runs
in between is captured in the name of the earlier span."""
import random
import sys
import time

import gevent
import pytest

from test_middleware import serve  # noqa: F401
from test_middleware import ok

pytestmark = pytest.mark.timeout(60)


def burn_in_a(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def burn_in_b(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_sampled_stack_of_another_greenlet(serve):
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.02)   # widen the GIL hand-off (default 5 ms)
    rnd = random.Random(1)
    try:
        def app(environ, start_response):
            b = gevent.spawn(burn_in_b, 0.08)
            burn_in_a(0.05 + rnd.random() * 0.05)
            b.join()
            return ok()(environ, start_response)

        s = serve(app, pct=1.0, blocking_ms=40)
        assert s.get("/warm").status == 200
        for i in range(int(__import__("os").environ.get("N", "15"))):
            assert s.get("/r%d" % i).status == 200
        s.wait_profiles(int(__import__("os").environ.get("N", "15")) + 1)
    finally:
        sys.setswitchinterval(old)
    wrong = total = 0
    for p in s.profiles:
        for ev in p.blocking:
            if not ev.sampled_stack:
                continue
            total += 1
            # B's greenlet runs burn_in_b; the request greenlet (A) does not
            is_b = "burn_in_b" in (ev.fn_name or "")
            mine, other = ("burn_in_b", "burn_in_a") if is_b else \
                ("burn_in_a", "burn_in_b")

            # The watchdog may take the stack late in the span (it waits for
            # the GIL): the greenlet can be past burn_in_a, e.g. in join(),
            # which is still its own span.  Wrong is another greenlet's code.
            if other in ev.sampled_stack:
                wrong += 1
                print("MISATTRIBUTED: event of greenlet %d (%s), span %.0f ms;"
                      " its sampled_stack ends in: %s" % (
                          ev.greenlet_id, ev.fn_name or "request greenlet",
                          ev.wall * 1e3,
                          ev.sampled_stack.strip().splitlines()[-1]))
    print("blocking events with a sampled stack:", total, "wrong:", wrong)
    assert wrong == 0
