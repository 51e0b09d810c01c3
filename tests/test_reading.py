"""What a reader of greqprof's text sees first (issue 23, item 2): a
blocking WARNING's first line names where the app was, the report's
waiting lines say what each one sums, and greenlets are named after their
function.  Through real gevent.pywsgi servers."""
import re
import time

import gevent
import pytest

from test_middleware import serve  # noqa: F401

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------------------
# the waiting lines

def ticker():
    """A greenlet outside any request that runs while requests wait."""
    while True:
        end = time.perf_counter() + 0.001
        while time.perf_counter() < end:
            pass
        gevent.sleep(0.002)


def nap():
    gevent.sleep(0.05)


def napping_app(environ, start_response):
    jobs = [gevent.spawn(nap) for _ in range(3)]
    gevent.joinall(jobs)
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


def test_waiting_lines_say_what_they_sum(serve):
    """Three greenlets napping 50 ms at once: the request waited ~50 ms
    with none of its greenlets running, while its greenlets were switched
    out ~200 ms in all (each one's waits, summed); each header says which.
    A greenlet of no request that ran meanwhile is named after its
    function."""
    t = gevent.spawn(ticker)
    try:
        s = serve(napping_app, pct=1.0, linger=0)
        assert s.get("/nap").status == 200
        p = s.profile_for("/nap")
    finally:
        t.kill()
    text = p.report()
    lines = text.split("\n")
    waiting = [x for x in lines if x.startswith("Waiting:")]
    assert len(waiting) == 1, text
    assert re.match(r"Waiting: \d+\.\d ms with none of the request's "
                    r"greenlets running, while these ran:$", waiting[0]), \
        waiting[0]
    waited = [x for x in lines if x.startswith("Waited at:")]
    assert len(waited) == 1, text
    assert re.match(r"Waited at: \(top \d+ of \d+ sites; time each greenlet "
                    r"of the request was switched out there, summed\)$",
                    waited[0]), waited[0]
    # the ticker, in no profile, is named after its function
    names = [w.fn_name for w in p.waiting.top]
    assert "test_reading.ticker" in names, p.waiting.top
    at = lines.index(waiting[0])
    shown = lines[at + 1:lines.index(waited[0])]
    assert any(x.endswith(" test_reading.ticker") for x in shown), shown
    assert not any(re.search(r"greenlet \d+$", x) for x in shown), shown
