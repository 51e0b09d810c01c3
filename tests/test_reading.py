"""What a reader of greqprof's text sees first (issue 23, item 2): a
blocking WARNING's first line names where the app was, the report's
waiting lines say what each one sums, and greenlets are named after their
function.  Through real gevent.pywsgi servers."""
import inspect
import logging
import re
import time

import gevent
import pytest

from test_middleware import LOGGER, messages, serve, wait_for  # noqa: F401

pytestmark = pytest.mark.timeout(60)


def block_route():
    time.sleep(0.3)   # not monkey-patched: holds the event loop


BLOCK_LINE = inspect.getsourcelines(block_route)[1] + 1


def blocking_app(environ, start_response):
    if environ["PATH_INFO"] == "/block":
        block_route()
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


def _warnings(caplog):
    return [m for m in messages(caplog, logging.WARNING)
            if m.startswith("Blocking span")]


@pytest.mark.parametrize("pct", [1.0, 0.0])
def test_blocking_warning_names_the_app_code_first(serve, caplog, pct):
    """The first line: the route function and its file:line, then the
    time, the request and the greenlet; the stacks follow as before."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    s = serve(blocking_app, pct=pct, blocking_ms=100, report=False)
    assert s.get("/block").status == 200
    wait_for(lambda: _warnings(caplog), what="the blocking WARNING")
    text = _warnings(caplog)[0]
    first = text.split("\n")[0]
    m = re.match(r"Blocking span: block_route \((.*):(\d+)\) held the event "
                 r"loop for (\d+\.\d) ms \(CPU .*\) during GET /block, "
                 r"greenlet \d+ \(gevent\.baseserver\."
                 r"_handle_and_close_when_done\)$", first)
    assert m, first
    assert m.group(1) == __file__ and int(m.group(2)) == BLOCK_LINE
    assert float(m.group(3)) >= 290
    # the rest as before: the watchdog's stack ends at the same line
    assert "\nRunning while the loop was held:\n" in text
    assert text.split("Where it switched out:")[0].rstrip().endswith(
        "line %d, in block_route" % BLOCK_LINE)


def test_site_leaves_out_the_server():
    """A stack whose innermost frames are the server's (gunicorn's worker
    here) names the app frame under them."""
    from greqprof import BlockingEvent
    from greqprof.report import blocking_site
    stack = ('  File "/srv/venv/gunicorn/workers/ggevent.py", line 1, in run\n'
             '  File "/srv/app.py", line 10, in view\n'
             '  File "/srv/venv/gunicorn/workers/base_async.py", line 2, '
             'in handle\n')
    ev = BlockingEvent(greenlet_id=3, greenlet_name="Greenlet",
                       fn_name="w.f", start=0.0, end=0.2, wall=0.2, cpu=0.2,
                       stack=stack)
    assert blocking_site(ev) == "view (/srv/app.py:10)"


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
