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
