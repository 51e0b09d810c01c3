"""Issue 22 item 7: greqprof's background greenlets (reaper, blocking
drain, finisher) never keep the event loop alive by themselves:
``gevent.wait()`` and ``hub.join()`` return once the app is idle.  And
they still do their job while the app serves.

Each case runs in a subprocess with a timeout, so that a hang fails the
test instead of blocking the suite."""
import json
import subprocess
import sys
import textwrap

import pytest

from conftest import CHILD_CWD, child_env

pytestmark = pytest.mark.timeout(120)

SCRIPT = textwrap.dedent('''
    import json, sys, time
    import gevent
    from gevent import pywsgi, socket
    from greqprof import ProfilingMiddleware

    CASE, WAIT = sys.argv[1], sys.argv[2]
    profiles = []
    options = dict(pct=1.0, linger=0.3, blocking_ms=None, watchdog=False,
                   sink=profiles.append, report=False)
    if CASE == "unsampled-blocking":
        options.update(pct=0.0, blocking_ms=50)
    elif CASE in ("sampled-blocking", "thread"):
        options.update(blocking_ms=50)
    elif CASE == "max-lifetime":
        options.update(max_lifetime=0.2, blocking_ms=50)
    elif CASE == "lingering":
        options.update(linger=1.0)
    mw = ProfilingMiddleware(lambda e, s: app(e, s), **options)

    def child():
        gevent.sleep(0.2)

    def app(environ, start_response):
        path = environ["PATH_INFO"]
        if path == "/block":
            time.sleep(0.08)     # not patched: holds the loop
        if path == "/child":
            gevent.spawn(child)  # outlives the response, joins the profile
        start_response("200 OK", [("Content-Type", "text/plain")])
        if path == "/stream":
            def body():          # open longer than max_lifetime
                for _ in range(8):
                    gevent.sleep(0.1)
                    yield b"x"
            return body()
        return [b"ok"]

    def serve_then_wait():
        server = pywsgi.WSGIServer(("127.0.0.1", 0), mw, log=None)
        server.start()

        def get(path):
            s = socket.create_connection(("127.0.0.1", server.server_port))
            s.sendall(("GET %s HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n"
                       % path).encode())
            while s.recv(65536):
                pass
            s.close()

        paths = ["/a", "/block", "/b"]
        if CASE == "max-lifetime":
            paths.append("/stream")
        if CASE == "lingering":
            paths = ["/child"]
        for p in paths:
            get(p)
        server.stop()
        if WAIT == "wait":
            gevent.wait()
        else:
            gevent.get_hub().join()

    if CASE == "thread":
        # a thread with a hub of its own, after the main thread served
        import threading
        serve_then_wait()
        t = threading.Thread(target=serve_then_wait)
        t.start()
        t.join(20)
        assert not t.is_alive(), "the thread's loop did not go idle"
    else:
        serve_then_wait()
    print(json.dumps({
        "idle": True,
        "delivered": [(p.path, p.truncated, len(p.greenlets))
                      for p in profiles]}))
    sys.stdout.flush()
''')

CASES = ["sampled", "unsampled-blocking", "sampled-blocking",
         "max-lifetime", "lingering", "thread"]


def _run(tmp_path, case, wait):
    script = tmp_path / "idle.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in child_env().items()
           if not k.startswith("GREQPROF_")}
    try:
        r = subprocess.run([sys.executable, str(script), case, wait],
                           capture_output=True, timeout=30, cwd=CHILD_CWD,
                           env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("%s did not return once the app was idle (%s)"
                    % ("gevent.wait()" if wait == "wait" else "hub.join()",
                       case))
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout.decode().strip().splitlines()[-1])


@pytest.mark.parametrize("wait", ["wait", "join"])
@pytest.mark.parametrize("case", CASES)
def test_the_loop_goes_idle_after_serving(tmp_path, case, wait):
    out = _run(tmp_path, case, wait)
    assert out["idle"]
    delivered = {p[0]: p for p in out["delivered"]}
    if case == "unsampled-blocking":
        assert delivered == {}
    elif case == "thread":
        # each thread's three requests, once
        assert sorted(p[0] for p in out["delivered"]) == \
            ["/a", "/a", "/b", "/b", "/block", "/block"]
    elif case == "lingering":
        # the finisher waited for the child, then delivered (before the
        # loop went idle: nothing is left for the exit flush)
        assert len(out["delivered"]) == 1
        assert delivered["/child"][2] == 2, delivered
    else:
        assert sorted(delivered) == sorted(
            ["/a", "/block", "/b"] + (["/stream"]
                                      if case == "max-lifetime" else []))
        assert len(out["delivered"]) == len(delivered)
    if case == "max-lifetime":
        # the reaper still closed the stream's profile at max_lifetime
        assert delivered["/stream"][1] is True
        assert not any(p[1] for p in out["delivered"] if p[0] != "/stream")
