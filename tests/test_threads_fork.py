"""greqprof under several OS threads and across os.fork().

* Several OS threads, each with its own gevent hub and pywsgi server under
  load at once, all behind one ProfilingMiddleware: no crash and no
  cross-talk (each profile holds only greenlets of its own request, which
  ran in its own thread).
* gevent monkey-patched threads (threads are greenlets), in a subprocess
  that patches first.
* os.fork() with a Profiler running, and with the middleware holding open
  and lingering profiles, in subprocesses (the pytest process never forks).

Expected-to-fail tests document bugs (see docs/reliability.md).
"""
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import gevent
import pytest
from gevent import pywsgi, socket
from greenlet import getcurrent

from conftest import CHILD_CWD, child_env
from greqprof import ProfilingMiddleware, engine

pytestmark = pytest.mark.timeout(60)



def run_script(code, timeout=45, args=()):
    """Runs `code` in a fresh interpreter; returns the JSON object it
    prints on its last stdout line."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)]
                          + list(args),
                          capture_output=True, text=True, timeout=timeout,
                          env=child_env(), cwd=CHILD_CWD)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, (
        "exit %d\nstdout:\n%s\nstderr:\n%s"
        % (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:]))
    return json.loads(lines[-1])


# ---------------------------------------------------------------------------
# several OS threads, each with its own hub and server

def _current_gid():
    eng = getattr(engine._local, "engine", None)
    return eng.tracer.greenlet_id(getcurrent()) if eng is not None else None


def _http_get(port, path, rid):
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    try:
        sock.sendall(("GET %s HTTP/1.1\r\nHost: t\r\nX-Request-ID: %s\r\n"
                      "Connection: close\r\n\r\n" % (path, rid)).encode())
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data.split(b"\r\n", 1)[0]
    finally:
        sock.close()


def test_threads_each_with_hub_and_server():
    NTHREADS, CLIENTS, PER_CLIENT = 3, 4, 25
    lock = threading.Lock()
    seen = {}          # rid -> (thread ident, {greenlet ids})
    profiles = []
    failures = []

    def child(rid, n):
        with lock:
            seen[rid][1].add(_current_gid())
        total = 0
        for i in range(n):
            total += i * i
            gevent.sleep(0)
        return total

    def app(environ, start_response):
        rid = environ["HTTP_X_REQUEST_ID"]
        with lock:
            seen[rid] = (threading.get_ident(), {_current_gid()})
        kids = [gevent.spawn(child, rid, 3) for _ in range(2)]
        gevent.joinall(kids)
        if environ["PATH_INFO"] == "/block":
            time.sleep(0.06)   # a real blocking span in this thread's hub
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"%d\n" % sum(k.value for k in kids)]

    def sink(p):
        with lock:
            profiles.append((threading.get_ident(), p))

    mw = ProfilingMiddleware(app, pct=1.0, calls=True, report=False,
                             sink=sink, linger=0.05, blocking_ms=50,
                             watchdog=True)
    barrier = threading.Barrier(NTHREADS)

    def serve(index):
        try:
            server = pywsgi.WSGIServer(("127.0.0.1", 0), mw, log=None)
            server.start()
            barrier.wait(timeout=10)

            def client(c):
                for k in range(PER_CLIENT):
                    path = "/block" if (c, k) == (0, 5) else "/"
                    rid = "t%d-c%d-%d" % (index, c, k)
                    status = _http_get(server.server_port, path, rid)
                    if status != b"HTTP/1.1 200 OK":
                        failures.append((rid, status))
            gevent.joinall([gevent.spawn(client, c)
                            for c in range(CLIENTS)], raise_error=True)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and any(
                    e.thread_ident == threading.get_ident()
                    and e.lingering for e in list(engine._engines.values())):
                gevent.sleep(0.01)
            gevent.sleep(0.2)
            server.stop()
        except BaseException as e:  # reported by the main thread
            failures.append(("thread %d" % index, repr(e)))
        finally:
            engine.shutdown()

    threads = [threading.Thread(target=serve, args=(i,))
               for i in range(NTHREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=50)
    assert not any(t.is_alive() for t in threads)
    assert failures == []
    total = NTHREADS * CLIENTS * PER_CLIENT
    assert len(seen) == total
    rids = [p.request_id for _, p in profiles]
    assert len(rids) == total and set(rids) == set(seen), (
        "lost or doubled profiles: %d for %d requests" % (len(rids), total))
    assert mw._open == 0
    for tid, p in profiles:
        owner, gids = seen[p.request_id]
        # Delivered in the thread that served it, holding only the
        # greenlets of that request (ids are process-unique).
        assert tid == owner, p.request_id
        span_gids = {s.greenlet_id for s in p.spans}
        assert span_gids <= gids, (p.request_id, span_gids, gids)
        assert {g.id for g in p.greenlets} <= gids
        assert len(gids) == 3 and len(span_gids) == 3, (p.request_id, gids)
        assert p.status == "200 OK" and p.error is None
        assert p.calls, p.request_id
        names = {f.name for f in p.calls}
        assert "child" in names and "app" in names
    assert mw.stats["errors"] == 0
    assert mw.stats["requests"] == mw.stats["sampled"] == total
    assert mw.stats["delivered"] == total
    # Blocking events that reached a profile are that request's own.  (Not
    # only /block's: on a loaded machine a "/" request's span can pass
    # 50 ms too, while this thread waits for the GIL or the CPU.)
    for _, p in profiles:
        for b in p.blocking:
            assert b.request_id == p.request_id and b.path == p.path
    assert mw.stats["blocking"] >= NTHREADS


class _OtherThread:
    """A second OS thread with its own hub and pywsgi server, both serving
    the same middleware; request() makes it serve one request to itself
    while the calling thread waits (the GIL handed over at a chosen
    point).  Its request arms the middleware's C path for that thread."""

    def __init__(self, mw):
        self.mw, self.failures = mw, []
        self.ready, self.go, self.done = (threading.Event(), threading.Event(),
                                          threading.Event())
        self.served, self.stop = 0, False
        self.thread = threading.Thread(target=self._run)
        self.thread.start()
        assert self.ready.wait(20), self.failures

    def _run(self):
        try:
            server = pywsgi.WSGIServer(("127.0.0.1", 0), self.mw, log=None)
            server.start()
            self.ready.set()
            while not self.stop:
                if self.go.is_set():
                    self.go.clear()
                    status = _http_get(server.server_port, "/other",
                                       "other-%d" % self.served)
                    if status != b"HTTP/1.1 200 OK":
                        self.failures.append(status)
                    self.served += 1
                    self.done.set()
                gevent.sleep(0.002)
            server.stop()
        except BaseException as e:  # reported by the test
            self.failures.append(repr(e))
            self.ready.set()
            self.done.set()
        finally:
            engine.shutdown()

    def request(self):
        """Blocks this OS thread (its hub too) until the other thread has
        served one request."""
        self.done.clear()
        self.go.set()
        assert self.done.wait(20), "the other thread served nothing"

    def close(self):
        self.stop = True
        self.thread.join(20)
        assert not self.thread.is_alive()
        assert self.failures == []


def _two_thread_middleware():
    profiles, lock = [], threading.Lock()

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok\n"]

    def sink(p):
        with lock:
            profiles.append(p.request_id)

    mw = ProfilingMiddleware(app, pct=1.0, linger=0, report=False, sink=sink,
                             blocking_ms=None)
    return mw, profiles


def _serve_one(mw, path, rid):
    """A pywsgi server of mw in the calling thread serves one request."""
    server = pywsgi.WSGIServer(("127.0.0.1", 0), mw, log=None)
    server.start()
    try:
        assert _http_get(server.server_port, path, rid) == b"HTTP/1.1 200 OK"
    finally:
        server.stop()


def _in_thread(fn):
    """fn() in a new OS thread (its own hub), its exception re-raised."""
    out = []

    def run():
        try:
            fn()
        except BaseException as e:
            out.append(e)
        finally:
            engine.shutdown()
    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert not t.is_alive()
    if out:
        raise out[0]


def test_request_begun_while_another_thread_arms_the_middleware():
    """Thread A sets itself up for the middleware (Python's _join arms the
    C path for A) and, before its request begins, thread B serves a
    request, which arms the middleware for B.  A's request is still
    profiled.  (Before: it went unprofiled and nothing was logged: one
    profile in a few hundred lost when two threads shared a middleware,
    test_waits.py's two-thread stress.)"""
    mw, profiles = _two_thread_middleware()
    other = _OtherThread(mw)
    try:
        other.request()   # armed for B
        join = mw._join

        def join_then_let_b_arm(eng):
            join(eng)
            if threading.current_thread() is not other.thread:
                other.request()
        mw._join = join_then_let_b_arm

        _in_thread(lambda: _serve_one(mw, "/a", "a-0"))
    finally:
        other.close()
    assert sorted(profiles) == ["a-0", "other-0", "other-1"], mw.stats
    assert mw.stats["requests"] == mw.stats["sampled"] == 3
    assert mw.stats["errors"] == 0


class _ArmsOtherThread:
    """An environ value whose str() (which the middleware takes when a
    request begins) lets the other thread serve a request meanwhile."""

    def __init__(self, other, text):
        self.other, self.text = other, text

    def __str__(self):
        self.other.request()
        return self.text


def test_request_whose_environ_lets_another_thread_arm_the_middleware():
    """Thread A's request begins on A's armed C path; taking its method
    runs Python (a str() of a value that is not a str), during which
    thread B serves a request and arms the middleware for itself.  A's
    request is still profiled, as A's.  (Before: it was dropped,
    unprofiled, with nothing logged.)"""
    mw, profiles = _two_thread_middleware()
    other = _OtherThread(mw)
    statuses = []

    def start_response(status, headers, exc_info=None):
        statuses.append(status)

    def environ(rid, method):
        return {"REQUEST_METHOD": method, "PATH_INFO": "/a",
                "HTTP_X_REQUEST_ID": rid, "wsgi.input": None}

    def thread_a():
        def call(env):
            body = mw(env, start_response)
            b"".join(body)
            getattr(body, "close", lambda: None)()
        # A set up and armed; then a request begins on A's C path
        gevent.spawn(call, environ("a-0", "GET")).join()
        gevent.spawn(call, environ("a-1", _ArmsOtherThread(other, "GET"))
                     ).join()
    try:
        _in_thread(thread_a)
    finally:
        other.close()
    assert statuses == ["200 OK", "200 OK"]
    assert sorted(profiles) == ["a-0", "a-1", "other-0"], mw.stats
    assert mw.stats["requests"] == mw.stats["sampled"] == 3
    assert mw.stats["errors"] == 0


def test_request_forwarded_to_the_middleware_after_another_thread_armed_it():
    """Thread A's app forwards its request to the middleware again (the
    root app, the same environ) after thread B served a request, which
    armed the middleware for B: the forward still passes through, and A's
    request is profiled once, by the outer call."""
    served = {}
    mw, profiles = _two_thread_middleware()
    app = mw.app

    def forwarding(environ, start_response):
        if environ["PATH_INFO"] == "/outer":
            served["other"].request()   # armed for B
            environ["PATH_INFO"] = "/inner"
            return [b"".join(mw(environ, start_response))]
        return app(environ, start_response)
    mw.app = forwarding
    served["other"] = other = _OtherThread(mw)

    try:
        _in_thread(lambda: _serve_one(mw, "/outer", "a-0"))
    finally:
        other.close()
    assert sorted(profiles) == ["a-0", "other-0"], mw.stats
    assert mw.stats["requests"] == mw.stats["sampled"] == 2
    assert mw.stats["errors"] == 0


# ---------------------------------------------------------------------------
# gevent monkey-patched threads

MONKEY_MIDDLEWARE = r"""
import sys
if sys.argv[-1] == "import-first":
    import greqprof
from gevent import monkey
monkey.patch_all()
import json, threading, time
import gevent
from gevent import pywsgi, socket
from greenlet import getcurrent
from greqprof import ProfilingMiddleware, engine

real_sleep = monkey.get_original("time", "sleep")
seen = {}
profiles = []

def gid():
    # The engine that traces this OS thread (not engine._local: under
    # monkey-patching that is a greenlet-local).
    for e in list(engine._engines.values()):
        g = e.tracer.greenlet_id(getcurrent())
        if g is not None:
            return g
    return None

def worker(rid, n):
    seen[rid].add(gid())
    for _ in range(n):
        time.sleep(0.001)          # patched: yields to the hub

def app(environ, start_response):
    rid = environ["HTTP_X_REQUEST_ID"]
    seen[rid] = {gid()}
    ths = [threading.Thread(target=worker, args=(rid, 3)) for _ in range(2)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    if environ["PATH_INFO"] == "/block":
        real_sleep(0.08)           # holds the loop
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok\n"]

mw = ProfilingMiddleware(app, pct=1.0, calls=True, report=False,
                         sink=profiles.append, linger=0.05, blocking_ms=50)
server = pywsgi.WSGIServer(("127.0.0.1", 0), mw, log=None)
server.start()

def get(path, rid):
    s = socket.create_connection(("127.0.0.1", server.server_port))
    s.sendall(("GET %s HTTP/1.1\r\nHost: t\r\nX-Request-ID: %s\r\n"
               "Connection: close\r\n\r\n" % (path, rid)).encode())
    data = b""
    while True:
        c = s.recv(65536)
        if not c:
            break
        data += c
    s.close()
    return data.split(b"\r\n", 1)[0].decode()

# Clients are patched threads too.
results = []
def client(c):
    for k in range(10):
        path = "/block" if (c, k) == (0, 3) else "/"
        results.append(get(path, "c%d-%d" % (c, k)))
cts = [threading.Thread(target=client, args=(c,)) for c in range(4)]
for t in cts:
    t.start()
for t in cts:
    t.join()
deadline = time.time() + 5
while (mw._open or len(profiles) < 40) and time.time() < deadline:
    gevent.sleep(0.02)
bad = []
for p in profiles:
    gids = {s.greenlet_id for s in p.spans} | {g.id for g in p.greenlets}
    if not gids <= seen[p.request_id] or len(gids) != 3:
        bad.append([p.request_id, sorted(gids), sorted(seen[p.request_id])])
block = [p for p in profiles if p.request_id == "c0-3"]
real_threads = [t.name for t in threading.enumerate()]
print(json.dumps({
    "statuses": sorted(set(results)), "n": len(results),
    "profiles": len(profiles), "unique": len({p.request_id for p in profiles}),
    "bad": bad, "open": mw._open, "errors": mw.stats["errors"],
    "blocked": bool(block and block[0].blocking),
    "worker_calls": sum(1 for p in profiles
                        if any(f.name == "worker" for f in p.calls or ())),
    "engines": len(engine._engines),
}))
"""

_monkey_runs = {}


def monkey_run(order):
    if order not in _monkey_runs:
        _monkey_runs[order] = run_script(MONKEY_MIDDLEWARE, args=[order])
    return _monkey_runs[order]


def test_monkey_patched_threads_middleware_imported_first():
    """greqprof imported before patch_all (threading.local is real)."""
    out = monkey_run("import-first")
    assert out["statuses"] == ["HTTP/1.1 200 OK"] and out["n"] == 40
    assert out["profiles"] == 40 and out["unique"] == 40
    assert out["bad"] == []
    assert out["open"] == 0 and out["errors"] == 0
    assert out["engines"] == 1
    assert out["worker_calls"] == 40


def test_monkey_patched_threads_middleware_imported_after():
    """greqprof imported after patch_all, as under gunicorn's gevent worker
    (threading.local is then a greenlet-local): one engine all the same."""
    out = monkey_run("import-after")
    assert out["statuses"] == ["HTTP/1.1 200 OK"] and out["n"] == 40
    assert out["profiles"] == 40 and out["unique"] == 40
    assert out["errors"] == 0 and out["open"] == 0
    assert out["bad"] == []
    assert out["engines"] == 1
    assert out["worker_calls"] == 40


@pytest.mark.parametrize("order", ["import-first", "import-after"])
def test_monkey_patched_blocking_detection(order):
    """The loop held with the real time.sleep is reported in the request's
    profile under monkey-patching (the engine must use the real thread id,
    as the C hooks do)."""
    out = monkey_run(order)
    assert out["blocked"]




MONKEY_PROFILER = r"""
import sys
if sys.argv[-1] == "patch":
    from gevent import monkey
    monkey.patch_all()
import json, threading
import greqprof

def in_thread():
    return sum(range(100))

def before():
    return 1

def after():
    return 2

p = greqprof.Profiler(calls=True)
p.start()
before()
t = threading.Thread(target=in_thread)
t.start()
t.join()
after()
p.stop()
names = {f.name for f in p.func_stats()}
print(json.dumps({n: n in names for n in ("before", "in_thread", "after")}))
"""


def test_profiler_records_threads_unpatched():
    proc = subprocess.run([sys.executable, "-c", MONKEY_PROFILER, "plain"],
                          capture_output=True, text=True, timeout=30,
                          env=child_env(), cwd=CHILD_CWD)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "before": True, "in_thread": True, "after": True}, proc.stderr


def test_profiler_records_monkey_patched_threads():
    proc = subprocess.run([sys.executable, "-c", MONKEY_PROFILER, "patch"],
                          capture_output=True, text=True, timeout=30,
                          env=child_env(), cwd=CHILD_CWD)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "before": True, "in_thread": True, "after": True}, proc.stderr


# ---------------------------------------------------------------------------
# os.fork() with a Profiler running

FORK_PROFILER = r"""
import json, os
import gevent
import greqprof

def parent_fn():
    for _ in range(3):
        gevent.sleep(0)

def child_fn():
    for _ in range(3):
        gevent.sleep(0)

p = greqprof.Profiler(calls=True)
p.start()
gevent.joinall([gevent.spawn(parent_fn) for _ in range(2)])
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    out = {}
    try:
        out["inherited_running"] = p.running
        # The inherited hooks keep working in the child.
        gevent.joinall([gevent.spawn(child_fn) for _ in range(2)])
        names = {f.name for f in p.func_stats()}
        out["inherited"] = sorted(n for n in names if n.endswith("_fn"))
        p.stop()
        q = greqprof.Profiler(calls=True)
        q.start()
        gevent.joinall([gevent.spawn(child_fn) for _ in range(2)])
        q.stop()
        names = {f.name for f in q.func_stats()}
        out["fresh"] = sorted(n for n in names if n.endswith("_fn"))
        out["fresh_child_fn_calls"] = [f.ncall for f in q.func_stats()
                                       if f.name == "child_fn"]
    except BaseException as e:
        out["exc"] = repr(e)
    os.write(w, json.dumps(out).encode())
    os._exit(0)
os.close(w)
_, status = os.waitpid(pid, 0)
child = json.loads(os.read(r, 100000).decode())
gevent.joinall([gevent.spawn(parent_fn) for _ in range(2)])
p.stop()
names = {f.name for f in p.func_stats()}
print(json.dumps({
    "child": child, "child_status": status,
    "parent": sorted(n for n in names if n.endswith("_fn")),
    "parent_fn_calls": [f.ncall for f in p.func_stats()
                        if f.name == "parent_fn"],
}))
"""


def test_fork_with_profiler_running():
    out = run_script(FORK_PROFILER)
    child = out["child"]
    assert out["child_status"] == 0 and "exc" not in child, child
    # The child keeps profiling from a clean slate: the inherited profiler
    # holds none of the parent's data; stopping it and starting a new one
    # also gives a profile of the child alone.
    assert child["inherited_running"] is True
    assert child["inherited"] == ["child_fn"]
    assert child["fresh"] == ["child_fn"]
    assert child["fresh_child_fn_calls"] == [2]
    # The parent is unaffected: nothing of the child's, all of its own.
    assert out["parent"] == ["parent_fn"]
    assert out["parent_fn_calls"] == [4]


# ---------------------------------------------------------------------------
# os.fork() with the middleware holding open and lingering profiles

FORK_MIDDLEWARE = r"""
import json, logging, os, time
import gevent
from gevent import pywsgi, socket
from greqprof import ProfilingMiddleware, engine

profiles = []
errors = []

class Errors(logging.Handler):
    def emit(self, record):
        errors.append(record.getMessage()[:300])

log = logging.getLogger("greqprof.forktest")
log.addHandler(Errors(logging.ERROR))
log.propagate = False

def lingering_child():
    for _ in range(40):
        gevent.sleep(0.01)

def app(environ, start_response):
    path = environ["PATH_INFO"]
    if path == "/linger":
        gevent.spawn(lingering_child)
    elif path == "/slow":
        gevent.sleep(0.3)
    start_response("200 OK", [("Content-Type", "text/plain"),
                              ("Content-Length", "3")])
    return [b"ok\n"]

mw = ProfilingMiddleware(app, pct=1.0, report=False, logger=log,
                         sink=profiles.append, linger=1.0, blocking_ms=None)

def get(port, path, rid):
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(("GET %s HTTP/1.1\r\nHost: t\r\nX-Request-ID: %s\r\n"
               "Connection: close\r\n\r\n" % (path, rid)).encode())
    data = b""
    while True:
        c = s.recv(65536)
        if not c:
            break
        data += c
    s.close()
    return data.split(b"\r\n", 1)[0].decode()

server = pywsgi.WSGIServer(("127.0.0.1", 0), mw, log=None)
server.start()
port = server.server_port
assert get(port, "/", "warm") == "HTTP/1.1 200 OK"
assert get(port, "/linger", "A") == "HTTP/1.1 200 OK"   # lingering
slow = gevent.spawn(get, port, "/slow", "B")             # open
gevent.sleep(0.05)
before = {"open": mw._open, "delivered": [p.request_id for p in profiles]}
r, w = os.pipe()
pid = gevent.fork()
if pid == 0:
    os.close(r)
    out = {"open_at_fork": mw._open, "engines_at_fork": len(engine._engines)}
    # The test's own client for B is the parent's business: the child's
    # copy must not read the parent's response off the shared socket.
    slow.kill(block=False)
    try:
        mine = pywsgi.WSGIServer(("127.0.0.1", 0), mw, log=None)
        mine.start()
        # Let everything inherited run (the open request, the linger).
        gevent.sleep(1.5)
        out["status"] = get(mine.server_port, "/", "C")
        gevent.sleep(0.3)
        out["delivered"] = [[p.request_id, p.pid == os.getpid()]
                            for p in profiles]
        out["open_end"] = mw._open
        out["errors"] = errors
    except BaseException as e:
        out["exc"] = repr(e)
    os.write(w, json.dumps(out).encode())
    os._exit(0)
os.close(w)
b_status = slow.get(timeout=10)
deadline = time.time() + 5
while (mw._open or len(profiles) < 3) and time.time() < deadline:
    gevent.sleep(0.02)
_, status = os.waitpid(pid, 0)
child = json.loads(os.read(r, 100000).decode())
d_status = get(port, "/", "D")
gevent.sleep(0.1)
print(json.dumps({
    "before": before, "child": child, "child_status": status,
    "b_status": b_status, "d_status": d_status,
    "parent_delivered": [p.request_id for p in profiles],
    "parent_pids": sorted({p.pid for p in profiles}) == [os.getpid()],
    "parent_open": mw._open, "parent_errors": errors,
}))
"""


@pytest.fixture(scope="module")
def fork_middleware():
    return run_script(FORK_MIDDLEWARE)


def test_fork_middleware_parent_unaffected(fork_middleware):
    out = fork_middleware
    assert out["child_status"] == 0 and "exc" not in out["child"], out
    assert out["before"] == {"open": 2, "delivered": ["warm"]}
    assert out["b_status"] == out["d_status"] == "HTTP/1.1 200 OK"
    # Each request of the parent delivered exactly once, in the parent.
    assert sorted(out["parent_delivered"]) == ["A", "B", "D", "warm"]
    assert out["parent_pids"] and out["parent_open"] == 0
    assert out["parent_errors"] == []


def test_fork_middleware_child_starts_with_no_open_profiles(fork_middleware):
    child = fork_middleware["child"]
    assert child["open_at_fork"] == 0 and child["engines_at_fork"] == 0
    assert child["open_end"] == 0


def test_fork_middleware_child_profiles_its_requests(fork_middleware):
    child = fork_middleware["child"]
    assert child["status"] == "HTTP/1.1 200 OK"
    assert ["C", True] in child["delivered"]
    assert child["errors"] == []


def test_fork_middleware_child_does_not_report_parent_requests(
        fork_middleware):
    child = fork_middleware["child"]
    parent_rids = {"warm", "A", "B", "D"}
    assert [d for d in child["delivered"] if d[0] in parent_rids] == [
        ["warm", False]]   # only the copy made before the fork


FORK_HELD_ROUTE_LOCK = """
import json, os, signal, threading
from greqprof import ProfilingMiddleware

def app(environ, start_response):
    start_response("200 OK", [])
    return [b"ok"]

mw = ProfilingMiddleware(app, pct=0.0, report=False)
inside, leave = threading.Event(), threading.Event()

def holder():   # (another OS thread inside the table's lock at the fork)
    with mw._routes._lock:
        inside.set()
        leave.wait(30)
t = threading.Thread(target=holder)
t.start()
inside.wait(30)
pid = os.fork()
if pid == 0:
    signal.alarm(10)   # (a lock held for good would hang the child)
    n = len(mw.routes()) + len(mw.routes(window="recent"))
    mw._routes.add_blocking("/x", 0.2)
    os._exit(0 if n == 0 and mw.routes()[0]["blocking"] == 1 else 3)
_, status = os.waitpid(pid, 0)
leave.set()
t.join()
print(json.dumps({"child_status": status}))
"""


def test_fork_while_another_thread_holds_the_route_table_lock():
    """The route table's locks are OS-thread locks; a fork while another
    thread holds one gives the child fresh ones, not one held for good."""
    out = run_script(FORK_HELD_ROUTE_LOCK)
    assert out["child_status"] == 0, out
