"""The request lifecycle (issue 14): every sampled request is delivered
once, every slot comes back, nothing is lost at exit, files are atomic.

Real gevent.pywsgi servers over real sockets (helpers from
test_middleware); subprocesses where the process itself must exit or hit a
resource limit."""
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code, timeout=60, env=None, **kw):
    """Runs code in a fresh interpreter of this venv; the CompletedProcess."""
    full_env = dict(os.environ)
    full_env.pop("GREQPROF_ENABLED", None)
    full_env["PYTHONPATH"] = ROOT
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=ROOT, **kw)


# ---------------------------------------------------------------------------
# 6. atomic profile files

def test_failed_write_leaves_no_file_under_a_final_name(tmp_path):
    """A write that fails half-way (here: the file size limit, EFBIG) leaves
    nothing under a final name, and no temporary file either; a profile that
    fits is written whole."""
    r = run_python("""
        import os, resource, signal, sys, time
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        from greqprof.renderers.files import ProfileWriter
        from greqprof.request_profile import RequestProfile, Waiting
        d = sys.argv[1] if len(sys.argv) > 1 else %r

        def profile(path, error):
            now = time.time()
            return RequestProfile(
                method="GET", path=path, status="200 OK", start=now,
                end=now + 0.1, wall=0.1, cpu=0.05, spans=[],
                longest_span=None, waiting=Waiting(seconds=0.0),
                calls=None, error=error)

        w = ProfileWriter(d, ["json", "text"], calls=False)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
        small = w.write(profile("/small", "x"))
        try:
            w.write(profile("/big", "y" * 100000))
        except OSError as e:
            print("failed", e.errno)
        print("small", len(small))
    """ % str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "failed 27" in r.stdout, r.stdout   # EFBIG
    assert "small 2" in r.stdout
    names = sorted(os.listdir(str(tmp_path)))
    assert len(names) == 2, names
    assert all("-small-" in n for n in names), names
    for n in names:   # the small ones are complete
        assert os.path.getsize(os.path.join(str(tmp_path), n)) > 100


# ---------------------------------------------------------------------------
# 5. nothing lost at exit

#: an app whose requests spawn a greenlet that outlives them, so their
#: profiles linger (up to GREQPROF_LINGER) after the response
LINGERING_APP = '''
import gevent

def _child():
    gevent.sleep(30)

def app(environ, start_response):
    gevent.spawn(_child)
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"hello"]
'''


def test_profiles_lingering_at_interpreter_exit_are_delivered():
    """The process ends (falls off the end of its script) while 6 profiles
    linger waiting for their children: all 6 are delivered at exit."""
    r = run_python('''
        import sys
        import gevent
        from gevent import pywsgi, socket
        from greqprof import ProfilingMiddleware
        ns = {}
        exec(%r, ns)
        def sink(p):
            sys.stdout.write("delivered %%s\\n" %% p.path)
            sys.stdout.flush()
        mw = ProfilingMiddleware(ns["app"], pct=1.0, linger=5, sink=sink,
                                 report=False)
        server = pywsgi.WSGIServer(("127.0.0.1", 0), mw, log=None)
        server.start()
        for i in range(6):
            s = socket.create_connection(("127.0.0.1", server.server_port))
            s.sendall(b"GET /r%%d HTTP/1.1\\r\\nHost: x\\r\\n"
                      b"Connection: close\\r\\n\\r\\n" %% i)
            while s.recv(4096):
                pass
            s.close()
        gevent.sleep(0.2)
        print("requests done", mw._open, flush=True)
    ''' % LINGERING_APP)
    assert r.returncode == 0, r.stderr
    assert "requests done 6" in r.stdout, r.stdout   # still lingering
    delivered = [l for l in r.stdout.splitlines() if l.startswith("delivered")]
    assert sorted(delivered) == ["delivered /r%d" % i for i in range(6)]


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_serve_delivers_lingering_profiles_on_signal(tmp_path, signame):
    """python -m greqprof serve, stopped by SIGTERM or SIGINT while 5
    profiles linger: all 5 are written to the profile directory."""
    import re
    import signal
    import urllib.request
    (tmp_path / "lingering_app.py").write_text(LINGERING_APP)
    out = tmp_path / "profiles"
    env = dict(os.environ, GREQPROF_LINGER="30", PYTHONPATH=ROOT)
    with open(str(tmp_path / "stderr.txt"), "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "greqprof", "serve", "lingering_app:app",
             "--port", "0", "--quiet", "--profile-dir", str(out)],
            cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=err, env=env)
    try:
        line = proc.stdout.readline().decode()
        url = re.search(r"on (http://\S+)", line).group(1)
        for i in range(5):
            with urllib.request.urlopen(url + "/r%d" % i, timeout=10) as r:
                assert r.read() == b"hello"
        assert not os.path.exists(str(out)) or not [
            f for f in os.listdir(str(out)) if not f.startswith(".")]
        proc.send_signal(getattr(signal, signame))
        assert proc.wait(timeout=30) == 0, (
            tmp_path / "stderr.txt").read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    names = sorted(f for f in os.listdir(str(out)) if not f.startswith("."))
    assert len(names) == 5, names
    assert sorted(re.search(r"-(r\d)-", n).group(1) for n in names) == [
        "r%d" % i for i in range(5)]


# ---------------------------------------------------------------------------
# 9. an API for the app: greqprof.current_profile()

from test_middleware import serve, http, wait_for, settle  # noqa: E402,F401


def _noting_app(seen):
    import gevent
    import greqprof

    def child():
        greqprof.current_profile().note("from a child greenlet")

    def app(environ, start_response):
        h = greqprof.current_profile()
        seen.append(bool(h))
        h.note("first note")
        h.note("bidi \u202e and\nnewline")
        try:
            raise KeyError("handled by the framework")
        except KeyError as e:
            h.set_error(e)
        gevent.spawn(child).join()
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]
    return app


def test_current_profile_notes_and_error_reach_the_profile(serve):
    seen = []
    s = serve(_noting_app(seen), pct=1.0)
    assert s.get("/noted").status == 200
    p = s.profile_for("/noted")
    assert seen == [True]
    assert p.error == "KeyError: 'handled by the framework'"
    assert p.notes == ["first note", "bidi \\u202e and\\x0anewline",
                       "from a child greenlet"]
    assert p.truncated is False
    d = p.to_dict()
    assert d["notes"] == p.notes and d["truncated"] is False
    assert type(p).from_dict(d).notes == p.notes


def test_current_profile_is_a_quiet_no_op_when_not_sampled(serve):
    import greqprof
    seen = []
    s = serve(_noting_app(seen), pct=0.0, blocking_ms=50)
    assert s.get("/not-sampled").status == 200
    settle(0.2)
    assert seen == [False] and s.profiles == []
    # outside any request too
    assert not greqprof.current_profile()
    greqprof.current_profile().note("x")
    greqprof.current_profile().set_error(ValueError("y"))
