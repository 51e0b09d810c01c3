"""The stack sampler (``stack_hz``, greqprof/sampler.py, _hooks/sampler.c)
and ``mw.write_pprof``.

A plain WSGI app on real ``gevent.pywsgi`` servers, loaded concurrently by
clients in real OS threads (plain blocking sockets: they are not sampled):
a route burning CPU in a named function, one waiting in gevent.sleep, one
whose work runs in a child greenlet.  The assertions are on where samples
went (routes, functions), never on how long anything took; sample counts
are only compared with each other, with wide margins.  The pprof file is
read back with the real ``go tool pprof``."""
import http.client
import sys
import threading
import time
import types

import gevent
import greenlet
import pytest
from gevent import pywsgi

from greqprof import ConfigError, ProfilingMiddleware, engine, sampler
from test_middleware import reset_greqprof, wait_for
from test_pprof import Raw, pprof_tool  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(120)

HZ = 200


def burn_cpu(ms):
    """Burns at least ms milliseconds of this thread's CPU (by the clock,
    not a count of iterations: sample counts must not depend on how fast
    the machine is)."""
    x, end = 0, time.thread_time() + ms / 1000.0
    while time.thread_time() < end:
        for i in range(500):
            x += i * i % 7
    return x


def _without_lines(fn):
    """fn with a code object that has no line numbers (as code made at
    run time may): its frames' line is -1."""
    co = fn.__code__
    if sys.version_info >= (3, 11):
        # One "no location" entry (code 15) per code unit.
        table = bytes([0x80 | 15 << 3]) * (len(co.co_code) // 2)
    else:
        # (3.10: byte-offset delta 254, line delta -128 meaning none)
        table = bytes([254, 0x80]) * (len(co.co_code) // 254 + 1)
    names = {"co_name": "burn_no_lines"}
    if sys.version_info >= (3, 11):
        names["co_qualname"] = "burn_no_lines"
    return types.FunctionType(co.replace(co_linetable=table, **names),
                              globals())


burn_no_lines = _without_lines(burn_cpu)


def child_burn(n):
    return burn_cpu(n)


def switched_to_burn():
    return burn_cpu(20)


def outer_switcher():
    """Switches straight to a new raw greenlet, from this frame of
    another greenlet."""
    greenlet.greenlet(switched_to_burn).switch()


def deep(n, work):
    """A recursion whose depth varies: a distinct stack per n."""
    if n <= 0:
        return burn_cpu(work)
    return deep(n - 1, work)


def app(environ, start_response):
    path = environ["PATH_INFO"]
    if path.startswith("/cpu/"):
        burn_cpu(20)
    elif path.startswith("/nolines/"):
        burn_no_lines(20)
    elif path.startswith("/child/"):
        gevent.spawn(child_burn, 20).join()
    elif path.startswith("/cross/"):
        outer_switcher()
    elif path.startswith("/deep/"):
        deep(int(path.rsplit("/", 1)[1]) % 30, 12)
    else:
        gevent.sleep(0.03)
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


@pytest.fixture
def fresh_sampler():
    sampler.stop()
    sampler.reset()
    yield
    sampler.stop()
    sampler.reset()


def get(port, target):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        c.request("GET", target)
        r = c.getresponse()
        r.read()
        return r.status
    finally:
        c.close()


def load(ports, targets, clients=4):
    """Each client (a real thread) requests every target in turn, on each
    of ports; the calling thread's hub serves meanwhile."""
    done, errors = [], []

    def client(k):
        try:
            for t in targets:
                for port in ports:
                    assert get(port, t % k if "%" in t else t) == 200
        except BaseException as e:   # (reported by the test)
            errors.append(e)
        finally:
            done.append(k)
    threads = [threading.Thread(target=client, args=(k,), daemon=True)
               for k in range(clients)]
    for t in threads:
        t.start()
    wait_for(lambda: len(done) == clients, 60, "the clients")
    assert not errors, errors


def by_route():
    """{route: {leaf function: samples}}"""
    out = {}
    for route, frames, n in sampler.samples():
        leaf = frames[0][0] if frames else "<other>"
        d = out.setdefault(route, {})
        d[leaf] = d.get(leaf, 0) + n
    return out


@pytest.fixture
def server():
    servers, mws = [], []

    def start(wsgi_app=app, **kw):
        kw.setdefault("pct", 0.0)
        mw = ProfilingMiddleware(wsgi_app, report=False, **kw)
        mws.append(mw)
        s = pywsgi.WSGIServer(("127.0.0.1", 0), mw, log=None)
        s.start()
        servers.append(s)
        return mw, s.server_port
    yield start
    for s in servers:
        s.stop(timeout=2)
    reset_greqprof(mws)


def test_samples_go_to_the_running_requests_route(server, fresh_sampler):
    mw, port = server(stack_hz=HZ)
    targets = ["/cpu/%d", "/wait/%d", "/child/%d"] * 6
    load([port], targets)
    routes = by_route()
    cpu = routes.get("/cpu/{id}", {})
    n_cpu = sum(cpu.values())
    # The CPU route's burning function has a large share of its samples.
    # (Not a majority on a busy machine: a tick takes the GIL, so it tends
    # to run while the serving thread has released it in a socket call.)
    assert n_cpu >= 20, routes
    assert cpu.get("test_sampler.burn_cpu", 0) > n_cpu / 4, cpu
    # The waiting route ran little: few samples next to the CPU route.
    assert sum(routes.get("/wait/{id}", {}).values()) < n_cpu / 4, routes
    # A child greenlet's samples are its request's.
    child = routes.get("/child/{id}", {})
    assert child.get("test_sampler.burn_cpu", 0) > sum(child.values()) / 4
    for route, frames, n in sampler.samples():
        names = [f[0] for f in frames]
        if "test_sampler.child_burn" in names:
            assert route == "/child/{id}", (route, names)
        if "test_sampler.burn_cpu" in names:
            assert route in ("/cpu/{id}", "/child/{id}"), (route, names)
        # The hub is never sampled (its run loop is in no greenlet's
        # stack but its own), nor are greqprof's own frames kept.
        assert not any("Hub.run" in x or x.startswith("greqprof.")
                       for x in names), names
    st = sampler.stats()
    assert st["idle"] > 0 and st["threads"] == 1 and st["truncated"] == 0


def test_sampled_requests_go_to_their_route(server, fresh_sampler):
    # Profiled requests carry no note: their greenlets (a child's too)
    # are found through their profile.
    mw, port = server(stack_hz=HZ, pct=1.0, linger=0)
    load([port], ["/cpu/%d", "/child/%d"] * 4)
    routes = by_route()
    for route in ("/cpu/{id}", "/child/{id}"):
        got = routes.get(route, {})
        assert got.get("test_sampler.burn_cpu", 0) > sum(got.values()) / 4, \
            routes
    assert "test_sampler.burn_cpu" not in routes.get("<no request>", {})


def test_write_pprof_is_read_by_go_pprof(server, fresh_sampler, tmp_path,
                                         pprof_tool):
    mw, port = server(stack_hz=HZ)
    load([port], ["/cpu/%d", "/wait/%d"] * 6)
    path = tmp_path / "stacks.pb.gz"
    sampler.stop()   # (the test's own greenlet would go on being sampled)
    n = mw.write_pprof(path)
    assert n == sum(c for _, _, c in sampler.samples()) and n > 0
    raw = Raw(pprof_tool(path, "-raw"))
    assert raw.types == [("samples", "count"), ("cpu", "nanoseconds")]
    assert raw.period_type == ("cpu", "nanoseconds")
    period = raw.period
    assert period == int(1e9 / HZ)
    assert sum(v[0] for v, _, _ in raw.samples) == n
    for values, _, labels in raw.samples:
        assert values[1] == values[0] * period
        assert labels.get("route") in ("/cpu/{id}", "/wait/{id}",
                                       "<no request>"), labels
    top = pprof_tool(path, "-top", "-tagfocus", "route=/cpu/{id}")
    assert "test_sampler.burn_cpu" in top
    traces = pprof_tool(path, "-traces", "-tagfocus", "route=/cpu/{id}")
    assert "route:  /cpu/{id}" in traces and "test_sampler.burn_cpu" in traces
    assert "/wait/{id}" not in traces


def test_frames_without_line_numbers_are_written(server, fresh_sampler,
                                                tmp_path, pprof_tool):
    # A frame of code without a line table says line -1; pprof, the flame
    # graph and speedscope get line 0 (unknown), not an error.
    mw, port = server(stack_hz=HZ)
    load([port], ["/nolines/%d"] * 6)
    sampler.stop()
    lines = [line for _, frames, _ in sampler.samples()
             for name, _, line in frames if name.endswith("burn_no_lines")]
    assert lines and set(lines) == {0}, lines
    path = tmp_path / "stacks.pb.gz"
    assert mw.write_pprof(path) > 0
    assert "burn_no_lines" in pprof_tool(path, "-top")


def test_a_greenlets_stack_ends_at_its_first_frame(server, fresh_sampler):
    # A greenlet's sampled stack is its own: not the frames of the
    # greenlet that first switched to it.
    mw, port = server(stack_hz=HZ)
    load([port], ["/cross/%d"] * 6)
    sampler.stop()
    stacks = [[name for name, _, _ in frames]
              for _, frames, _ in sampler.samples()
              if any(f[0].endswith("switched_to_burn") for f in frames)]
    assert stacks, sampler.samples()
    for names in stacks:
        assert names[-1] == "test_sampler.switched_to_burn", names
        assert "test_sampler.outer_switcher" not in names, names


# Two OS threads, each its own hub, serve one middleware while the sampler
# ticks at its highest rate and garbage with finalizers makes collections
# frequent (run alone: a crash kills the process).
COLLECTION_STRESS = """
import gc, sys, threading, time
import gevent
from gevent import pywsgi, socket
import greqprof
from greqprof import ProfilingMiddleware, engine, sampler
assert greqprof.__file__ == sys.argv[2], (greqprof.__file__, sys.argv[2])
gc.set_threshold(30, 5, 5)

class Finalized:
    def __del__(self):
        sum(range(30))   # (Python: hands the GIL over, every 1 us)

def leaf():
    f = Finalized()
    f.me = f
    gevent.sleep(0)

def app(environ, start_response):
    jobs = [gevent.spawn(leaf) for _ in range(3)]
    leaf()
    gevent.joinall(jobs)
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]

mw = ProfilingMiddleware(app, pct=float(sys.argv[3]), report=False,
                         stack_hz=1000, sink=lambda p: None, linger=0)
failures = []

def serve(index, stop):
    try:
        server = pywsgi.WSGIServer(("127.0.0.1", 0), mw, log=None)
        server.start()
        def client():
            while not stop.is_set():
                # (connect, not create_connection: no address lookup)
                s = socket.socket()
                s.settimeout(30)
                s.connect(("127.0.0.1", server.server_port))
                s.sendall(b"GET /t%d/x HTTP/1.1\\r\\nHost: x\\r\\n"
                          b"Connection: close\\r\\n\\r\\n" % index)
                while s.recv(65536):
                    pass
                s.close()
        gevent.joinall([gevent.spawn(client) for _ in range(3)],
                       raise_error=True)
        server.stop()
    except BaseException as e:
        failures.append(repr(e))
    finally:
        engine.shutdown()

sys.setswitchinterval(1e-6)
deadline = time.monotonic() + float(sys.argv[1])
while time.monotonic() < deadline:
    stop = threading.Event()
    threads = [threading.Thread(target=serve, args=(i, stop))
               for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    stop.set()
    for t in threads:
        t.join(60)
assert failures == [], failures
print(sampler.stats()["samples"])
"""


@pytest.mark.parametrize("pct", [0.0, 1.0])
def test_collections_during_a_tick_do_not_crash(pct):
    # The frame objects a tick's stack walk makes used to start garbage
    # collections in the sampler's thread, whose finalizers ran Python and
    # handed the GIL to the sampled thread mid-walk: a segfault here within
    # 1-6 s before (3.11, both pct), none since.
    import subprocess
    from conftest import CHILD_CWD, child_env
    import greqprof
    proc = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", COLLECTION_STRESS,
         "8", greqprof.__file__, str(pct)],
        capture_output=True, text=True, timeout=100, env=child_env(),
        cwd=CHILD_CWD)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert int(proc.stdout.split()[-1]) > 0, proc.stdout


def test_a_failed_write_pprof_leaves_no_file_behind(server, fresh_sampler,
                                                     tmp_path):
    mw, port = server(stack_hz=HZ)
    load([port], ["/cpu/%d"] * 2, clients=1)
    target = tmp_path / "a directory"
    target.mkdir()
    with pytest.raises(IsADirectoryError):
        mw.write_pprof(target)
    with pytest.raises(FileNotFoundError):
        mw.write_pprof(tmp_path / "missing" / "x.pb.gz")
    assert [p.name for p in tmp_path.iterdir()] == ["a directory"]
    assert list(target.iterdir()) == []
    # An existing file is replaced whole or not at all.
    ok = tmp_path / "ok.pb.gz"
    assert mw.write_pprof(ok) > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a directory",
                                                           "ok.pb.gz"]


def test_stack_hz_off_writes_nothing(server, fresh_sampler, tmp_path):
    mw, port = server(stack_hz=0)
    load([port], ["/cpu/%d"] * 2, clients=1)
    assert sampler.samples() == [] and sampler.stats()["threads"] == 0
    with pytest.raises(ConfigError, match="stack_hz"):
        mw.write_pprof(tmp_path / "x.pb.gz")


def test_distinct_stacks_are_capped(server, fresh_sampler, monkeypatch):
    monkeypatch.setattr(sampler, "MAX_STACKS", 5)
    sampler.reset()
    mw, port = server(stack_hz=HZ)
    load([port], ["/deep/%d" % i for i in range(30)])
    t = sampler._table
    assert len(t.stacks) <= 5 + 2   # (stack 0 is <other>)
    assert sampler.stats()["truncated"] > 0
    # (the samples that were not kept are the deep ones)
    assert any(frames == () and route == "/deep/{id}"
               for route, frames, _ in sampler.samples())


def _serve_in_thread(mw, ready, stop, shutdown=True):
    """A pywsgi server with its own hub in a new real thread."""
    def run():
        s = pywsgi.WSGIServer(("127.0.0.1", 0), mw, log=None)
        s.start()
        ready.append(s.server_port)
        while not stop.is_set():
            gevent.sleep(0.01)
        s.stop(timeout=2)
        if shutdown:
            engine.shutdown()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_one_middleware_in_two_threads(fresh_sampler):
    mw = ProfilingMiddleware(app, pct=0.0, report=False, stack_hz=HZ)
    ports, stop = [], threading.Event()
    threads = [_serve_in_thread(mw, ports, stop) for _ in range(2)]
    deadline = time.monotonic() + 10
    while len(ports) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        load(ports, ["/cpu/%d"] * 8 + ["/wait/%d"] * 4, clients=2)
        assert sampler.stats()["threads"] == 2
        routes = by_route()
        # (Not more: a thread waiting for the GIL the other holds is
        # sampled where it waits, often a socket call.)
        assert routes["/cpu/{id}"].get("test_sampler.burn_cpu", 0) >= 5
    finally:
        stop.set()
        for t in threads:
            t.join(10)


def test_the_serving_thread_ends(fresh_sampler):
    mw = ProfilingMiddleware(app, pct=0.0, report=False, stack_hz=HZ)
    ports, stop = [], threading.Event()
    # (the thread ends with its hooks still installed: no shutdown)
    t = _serve_in_thread(mw, ports, stop, shutdown=False)
    wait_for(lambda: ports, 10, "the server")
    load(ports, ["/cpu/%d"] * 3, clients=2)
    assert sampler.stats()["threads"] == 1
    stop.set()
    t.join(10)
    assert not t.is_alive()
    # The sampler lets the thread go and goes on ticking; new threads
    # (whose idents may be the old one's) are not mistaken for it.
    wait_for(lambda: sampler.stats()["threads"] == 0, 10, "the thread gone")
    ticks = sampler.stats()["ticks"]
    before = sum(n for _, _, n in sampler.samples())
    for _ in range(5):
        th = threading.Thread(target=burn_cpu, args=(25,))
        th.start()
        th.join()
    wait_for(lambda: sampler.stats()["ticks"] > ticks + 5, 10, "ticks")
    assert sum(n for _, _, n in sampler.samples()) == before
    # And a new server thread is sampled again.
    ports2, stop2 = [], threading.Event()
    t2 = _serve_in_thread(mw, ports2, stop2)
    try:
        wait_for(lambda: ports2, 10, "the server")
        load(ports2, ["/cpu/%d"] * 3, clients=2)
        assert sampler.stats()["threads"] == 1
        assert sum(n for _, _, n in sampler.samples()) > before
    finally:
        stop2.set()
        t2.join(10)


@pytest.mark.parametrize("bad", [-1, 1001, "100", True, float("nan"),
                                 float("inf"), [100]])
def test_bad_stack_hz_raises(bad):
    with pytest.raises(ConfigError, match="stack_hz"):
        ProfilingMiddleware(app, stack_hz=bad)


@pytest.mark.parametrize("raw", ["abc", "-5", "2000", "1e9", "nan"])
def test_bad_stack_hz_variable_raises(raw):
    with pytest.raises(ConfigError, match="GREQPROF_STACK_HZ"):
        ProfilingMiddleware(app, environ={"GREQPROF_STACK_HZ": raw})


def test_stack_hz_from_the_environment():
    on = ProfilingMiddleware(app, environ={"GREQPROF_STACK_HZ": "50"})
    assert on._stack_hz == 50.0
    for raw in ("0", "off"):
        off = ProfilingMiddleware(app, environ={"GREQPROF_STACK_HZ": raw})
        assert off._stack_hz == 0
    # Given in code, the argument wins.
    mw = ProfilingMiddleware(app, stack_hz=10,
                             environ={"GREQPROF_STACK_HZ": "50"})
    assert mw._stack_hz == 10.0


FORK_SCRIPT = r'''
import http.client, json, os, sys, threading, time
import gevent
from gevent import pywsgi
from greqprof import ProfilingMiddleware, sampler

def burn_cpu(n):
    x = 0
    for i in range(n):
        x += i * i % 7
    return x

def app(environ, start_response):
    burn_cpu(150000)
    start_response("200 OK", [])
    return [b"ok"]

def serve_and_load(prefix):
    s = pywsgi.WSGIServer(("127.0.0.1", 0), mw, log=None)
    s.start()
    done = []
    def client():
        for i in range(6):
            c = http.client.HTTPConnection("127.0.0.1", s.server_port)
            c.request("GET", "%s/%d" % (prefix, i))
            c.getresponse().read()
            c.close()
        done.append(1)
    for _ in range(2):
        threading.Thread(target=client, daemon=True).start()
    while len(done) < 2:
        gevent.sleep(0.01)
    s.stop()

def routes():
    return sorted({r for r, f, n in sampler.samples()
                   if any(x[0].endswith("burn_cpu") for x in f)})

mw = ProfilingMiddleware(app, pct=0.0, report=False, stack_hz=200)
serve_and_load("/parent")
r, w = os.pipe()
pid = gevent.fork()
if pid == 0:
    # The parent's samples and threads are not the child's; its own
    # requests are sampled by a sampler thread of its own.
    out = {"at_fork": routes(), "threads": sampler.stats()["threads"]}
    serve_and_load("/child")
    out["after"] = routes()
    os.write(w, json.dumps(out).encode())
    os._exit(0)
os.close(w)
_, status = os.waitpid(pid, 0)
child = json.loads(os.read(r, 65536).decode())
print(json.dumps({"parent": routes(), "child": child, "status": status}))
'''


def test_fork_child_samples_its_own_requests():
    from test_threads_fork import run_script
    out = run_script(FORK_SCRIPT)
    assert out["status"] == 0
    assert out["parent"] == ["/parent/{id}"]
    assert out["child"] == {"at_fork": [], "threads": 0,
                            "after": ["/child/{id}"]}


def test_a_failing_sampler_never_breaks_requests(server, fresh_sampler,
                                                 monkeypatch):
    from greqprof import _registry

    def broken(*args):
        raise RuntimeError("no sampler today")
    monkeypatch.setattr(_registry, "sampler_watch", broken)
    mw, port = server(stack_hz=HZ)
    load([port], ["/wait/%d"] * 3, clients=1)
    # Counted once per engine, and the thread's requests still take the
    # C path (the sampler is tried once).
    assert mw.stats["errors"] == 1
    assert mw.stats["requests"] == 3
    assert sampler.samples() == []


def test_a_hook_taken_out_without_chaining_stops_attribution(
        server, fresh_sampler):
    # Another tool replaces greenlet's trace function without calling
    # greqprof's: the tracer's current greenlet then stays whatever ran
    # last, and may be freed.  The sampler must stop trusting it (skip)
    # rather than attribute new work to it, or read a dead greenlet.
    import greenlet
    mw, port = server(stack_hz=HZ)
    load([port], ["/cpu/%d"] * 4)
    ours = greenlet.gettrace()
    assert ours is not None
    greenlet.settrace(None)
    try:
        before = sampler.stats()
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            # greenlets that run and die unseen by greqprof's hook
            gevent.spawn(burn_cpu, 3).join()
        after = sampler.stats()
    finally:
        greenlet.settrace(ours)
    assert after["ticks"] > before["ticks"] + 5, (before, after)
    assert after["samples"] == before["samples"], (before, after)
    assert after["skipped"] > before["skipped"], (before, after)


def _hold_gil(seconds):
    """Keeps the GIL for about seconds in C (a builtin sum over a range
    checks nothing between items), whatever else wants it."""
    n = 10 ** 6
    t = time.perf_counter()
    sum(range(n))
    per = max(time.perf_counter() - t, 1e-6) / n
    sum(range(int(seconds / per)))


@pytest.mark.parametrize("watchdog", [False, True])
def test_a_tick_while_every_thread_waits_takes_no_gil(fresh_sampler,
                                                      watchdog):
    # The serving thread waits in its hub: the sampler's loop counts its
    # ticks idle from what the thread's hooks last said, without the GIL,
    # so it goes on ticking while this thread keeps the GIL in C.  The
    # watchdog's check it carries is not needed either: the one thread
    # with greqprof's hooks is watched, and in its hub.
    engine.Watchdog.instance = None   # (one an earlier test left)
    engine.Watchdog.replace()
    mw = ProfilingMiddleware(app, pct=0.0, report=False, stack_hz=HZ,
                             watchdog=watchdog)
    ports, stop = [], threading.Event()
    t = _serve_in_thread(mw, ports, stop)
    try:
        wait_for(lambda: ports, 10, "the server")
        load(ports, ["/cpu/%d"] * 2, clients=1)
        assert sampler.stats()["threads"] == 1
        time.sleep(0.3)   # (a tick under the GIL has seen its hub)
        before = sampler.stats()
        t0 = time.monotonic()
        _hold_gil(0.5)
        held = time.monotonic() - t0
        after = sampler.stats()
        assert held >= 0.2, held
        ticks = after["ticks"] - before["ticks"]
        assert ticks >= held * HZ * 0.3, (ticks, held, before, after)
        assert after["idle"] - before["idle"] >= ticks - 2
        assert after["samples"] == before["samples"]
        assert (engine.Watchdog.instance is not None) == watchdog
    finally:
        stop.set()
        t.join(10)


def test_reset_zeroes_every_counter(fresh_sampler):
    mw = ProfilingMiddleware(app, pct=0.0, report=False, stack_hz=HZ)
    ports, stop = [], threading.Event()
    t = _serve_in_thread(mw, ports, stop)
    try:
        wait_for(lambda: ports, 10, "the server")
        load(ports, ["/cpu/%d"] * 2, clients=1)
        wait_for(lambda: sampler.stats()["idle_unlocked"] > 5, 10,
                 "idle ticks")
        sampler.reset()
        st = sampler.stats()
        assert st["idle_unlocked"] <= st["idle"] <= 3, st
        assert st["moved"] <= st["samples"] + st["idle"], st
    finally:
        stop.set()
        t.join(10)
