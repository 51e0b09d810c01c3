"""``python -m greqprof`` (serve / view), run as real subprocesses."""
import json
import marshal
import os
import pstats
import re
import subprocess
import sys
import textwrap
import time

import pytest
import requests

from conftest import CHILD_CWD, child_env
from greqprof import RequestProfile

from test_renderers import HOSTILE, synthetic_profile

pytestmark = pytest.mark.timeout(60)

APP = textwrap.dedent('''
    import time
    import gevent

    def work(n):
        end = time.thread_time() + n
        while time.thread_time() < end:
            pass

    def app(environ, start_response):
        gevent.spawn(work, 0.002).join()
        work(0.002)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"hello"]

    not_callable = 42
''')

# The same app wrapped in its module, as README's Usage shows (Flask's
# `app.wsgi_app = ProfilingMiddleware(app.wsgi_app)`)
WRAPPED = textwrap.dedent('''
    from greqprof import ProfilingMiddleware
    from cli_test_app import app

    class Carrier:
        def __init__(self, inner, **options):
            self.wsgi_app = ProfilingMiddleware(inner, report=False,
                                                linger=0, **options)

        def __call__(self, environ, start_response):
            return self.wsgi_app(environ, start_response)

    wrapped = Carrier(app, pct=1.0)
    own_ui = Carrier(app, pct=1.0, ui_path="/debug/prof")
    sampled = Carrier(app, pct=0.05)
''')


def cli(*args, cwd=CHILD_CWD, timeout=30):
    # python -m puts the working directory first on sys.path: not the
    # source root, whose greqprof/ would shadow the installed package.
    return subprocess.run([sys.executable, "-m", "greqprof"] + list(args),
                          capture_output=True, timeout=timeout, cwd=cwd,
                          env=child_env())


def fails(r, *needles):
    """Exit status 2 and a message naming the problem."""
    err = r.stderr.decode()
    assert r.returncode == 2, (r.returncode, err)
    for n in needles:
        assert n in err, (n, err)
    assert "Traceback" not in err, err


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "profile.json"
    synthetic_profile().save(str(path))
    return path


# ---------------------------------------------------------------------------
# view

def test_view_default_is_text(saved):
    r = cli("view", str(saved))
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode()
    assert out.startswith(">>> Begin RequestProfile")
    assert "Path: /items/42" in out


@pytest.mark.parametrize("fmt", ["html", "trace", "speedscope", "json",
                                 "callgrind"])
def test_view_text_formats_to_stdout(saved, fmt):
    r = cli("view", str(saved), "--format", fmt)
    assert r.returncode == 0, r.stderr
    if fmt in ("trace", "speedscope", "json"):
        json.loads(r.stdout)
    if fmt == "json":
        back = RequestProfile.from_dict(json.loads(r.stdout))
        assert back.to_dict() == synthetic_profile().to_dict()
    if fmt == "html":
        assert r.stdout.startswith(b"<!DOCTYPE html>")
    if fmt == "callgrind":
        assert b"events: us" in r.stdout


def test_view_to_file(saved, tmp_path):
    out_path = tmp_path / "out.html"
    r = cli("view", str(saved), "-f", "html", "-o", str(out_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout == b"" and b"wrote" in r.stderr
    assert out_path.read_text().startswith("<!DOCTYPE html>")


def test_view_pstats_needs_output(saved, tmp_path):
    fails(cli("view", str(saved), "--format", "pstats"),
          "binary", "-o FILE")
    out = tmp_path / "p.pstats"
    r = cli("view", str(saved), "--format", "pstats", "-o", str(out))
    assert r.returncode == 0, r.stderr
    st = pstats.Stats(str(out))
    assert ("app.py", 10, "handler") in st.stats
    assert marshal.loads(out.read_bytes()) == st.stats


def test_view_errors(tmp_path, saved):
    fails(cli("view", str(tmp_path / "missing.json")),
          "no such file", "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    fails(cli("view", str(bad)), "not valid JSON", "bad.json")
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    fails(cli("view", str(binary)), "not a JSON profile")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"schema": "something/9"}))
    fails(cli("view", str(other)), "not a greqprof profile",
          "unsupported profile schema")
    lst = tmp_path / "list.json"
    lst.write_text("[1, 2]")
    fails(cli("view", str(lst)), "not a greqprof profile")
    fails(cli("view", str(tmp_path)), "is a directory")
    fails(cli("view", str(saved), "--format", "svg"),
          "invalid choice: 'svg'")
    nocalls = tmp_path / "nocalls.json"
    synthetic_profile(calls=False).save(str(nocalls))
    fails(cli("view", str(nocalls), "-f", "callgrind"),
          "needs function statistics", "calls=True")
    fails(cli("view", str(saved), "-o",
              str(tmp_path / "no" / "such" / "dir" / "x")), "cannot write")
    fails(cli(), "COMMAND")


def test_view_hostile_path_text_is_escaped(tmp_path):
    path = tmp_path / "h.json"
    synthetic_profile(path="/x\nForged: yes" + HOSTILE).save(str(path))
    r = cli("view", str(path))
    assert r.returncode == 0
    assert b"\nForged: yes" not in r.stdout


def cli_fds(args, stdout=None, stderr=subprocess.PIPE, close=()):
    """``python -m greqprof ARGS`` with its standard output (or error)
    redirected to ``stdout`` / ``stderr``, or closed (fds in ``close``)."""
    def closing():
        for fd in close:
            os.close(fd)
    return subprocess.run([sys.executable, "-m", "greqprof"] + list(args),
                          stdout=stdout, stderr=stderr, timeout=30,
                          cwd=CHILD_CWD, env=child_env(),
                          preexec_fn=closing if close else None)


def one_line(r, *needles):
    fails(r, *needles)
    assert r.stderr.decode().count("\n") == 1, r.stderr


@pytest.mark.parametrize("fmt", ["text", "html"])
def test_view_to_a_full_disk_is_one_line(saved, fmt):
    # /dev/full: every write fails with ENOSPC (a full disk); the html
    # output is larger than the stdout buffer, the text one smaller.
    with open("/dev/full", "wb") as full:
        r = cli_fds(["view", str(saved), "-f", fmt], stdout=full)
    one_line(r, "cannot write to standard output",
             "No space left on device")


def test_view_to_a_closed_stdout_is_one_line(saved):
    # `view ... >&-`: Python sets sys.stdout to None.
    r = cli_fds(["view", str(saved)], close=[1])
    one_line(r, "standard output is closed")


def test_view_to_a_file_with_stderr_full_or_closed(saved, tmp_path):
    # The "wrote FILE" note cannot be printed: the file is still written
    # and the exit status is 0, without a traceback anywhere.
    for i, kw in enumerate([{"close": [2], "stderr": None}]):
        out = tmp_path / ("o%d.txt" % i)
        r = cli_fds(["view", str(saved), "-o", str(out)],
                    stdout=subprocess.PIPE, **kw)
        assert r.returncode == 0 and r.stdout == b""
        assert out.read_text().startswith(">>> Begin RequestProfile")
    out = tmp_path / "full.txt"
    with open("/dev/full", "wb") as full:
        r = cli_fds(["view", str(saved), "-o", str(out)],
                    stdout=subprocess.PIPE, stderr=full)
    assert r.returncode == 0 and r.stdout == b""
    assert out.read_text().startswith(">>> Begin RequestProfile")


# ---------------------------------------------------------------------------
# serve

class Server:
    def __init__(self, proc, url):
        self.proc = proc
        self.url = url


def start_serve(tmp_path, *args, app="cli_test_app:app"):
    (tmp_path / "cli_test_app.py").write_text(APP)
    (tmp_path / "cli_wrapped_app.py").write_text(WRAPPED)
    with open(str(tmp_path / "stderr.txt"), "wb") as err:  # never a full pipe
        proc = subprocess.Popen(
            [sys.executable, "-m", "greqprof", "serve", app,
             "--port", "0"] + list(args),
            cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=err)
    line = proc.stdout.readline().decode()
    m = re.search(r"serving %s on (http://\S+)" % re.escape(app), line)
    if not m:
        proc.kill()
        proc.wait()
        raise AssertionError("no serving line: %r %r" % (
            line, (tmp_path / "stderr.txt").read_text()[:2000]))
    srv = Server(proc, m.group(1))
    srv.cwd = tmp_path
    return srv


def stop(server):
    server.proc.terminate()
    try:
        server.proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()
    server.proc.stdout.close()


def test_serve_profiles_and_writes_files(tmp_path):
    out = tmp_path / "profiles"
    srv = start_serve(tmp_path, "--pct", "1.0", "--calls", "--ui",
                      "--profile-dir", str(out), "--formats", "json,pstats",
                      "--quiet")
    try:
        assert "/_greqprof/" in srv.proc.stdout.readline().decode()
        r = requests.get(srv.url + "/hello/world", timeout=10)
        assert r.status_code == 200 and r.text == "hello"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            # (hidden: a file being written, not yet under its name)
            files = sorted(f for f in os.listdir(str(out))
                           if not f.startswith(".")) if out.exists() else []
            if len(files) >= 2:
                break
            time.sleep(0.05)
        assert len(files) == 2, files
        js = [f for f in files if f.endswith(".json")][0]
        assert re.match(r"\d{8}T\d{6}\.\d{6}Z-\d+-hello_world-1\.json$", js)
        prof = RequestProfile.load(str(out / js))
        assert prof.path == "/hello/world" and prof.calls
        assert any(f.name == "work" for f in prof.calls)
        assert len({s.greenlet_id for s in prof.spans}) >= 2
        pstats.Stats(str(out / js.replace(".json", ".pstats")))
        # the inspector lists it (loopback client)
        page = requests.get(srv.url + "/_greqprof/", timeout=10)
        assert page.status_code == 200
        assert "/hello/world" in page.text
    finally:
        stop(srv)
    # the saved profile renders later
    r = cli("view", str(out / js), "-f", "html")
    assert r.returncode == 0 and b"gq-data" in r.stdout


def test_serve_without_ui_passes_the_path_to_the_app(tmp_path):
    srv = start_serve(tmp_path, "--pct", "0", "--quiet")
    try:
        r = requests.get(srv.url + "/_greqprof/", timeout=10)
        assert r.status_code == 200 and r.text == "hello"  # the app's
    finally:
        stop(srv)


@pytest.mark.parametrize("spec,needle", [
    ("no_such_module_xyz:app", "cannot import module 'no_such_module_xyz'"),
    ("cli_test_app:nope", "has no attribute 'nope'"),
    ("cli_test_app:not_callable", "is not callable"),
    (":app", "expected MODULE:APP"),
])
def test_serve_bad_app(tmp_path, spec, needle):
    (tmp_path / "cli_test_app.py").write_text(APP)
    fails(cli("serve", spec, cwd=str(tmp_path)), needle)


def test_serve_bad_option(tmp_path):
    (tmp_path / "cli_test_app.py").write_text(APP)
    fails(cli("serve", "cli_test_app:app", "--pct", "7",
              cwd=str(tmp_path)), "pct must be")
    fails(cli("serve", "cli_test_app:app", "--profile-dir", str(tmp_path),
              "--formats", "json,bmp", cwd=str(tmp_path)),
          "unknown format 'bmp'")


@pytest.mark.parametrize("args,needles", [
    (["--formats", "json"], ["error: --formats needs --profile-dir\n"]),
    (["--blocking-ms", "-5"], [
        "error: --blocking-ms must be a number from 0.001 to 3600000 "
        "milliseconds, or 0 (off), got -5.0\n"]),
    (["--pct", "7"], ["error: --pct must be a number from 0 to 1"]),
    (["--formats", "pstats", "--profile-dir", "{tmp}"], [
        "error: --formats: 'pstats' needs function statistics; enable "
        "--calls\n"]),
    (["--formats", "JSON,trace", "--profile-dir", "{tmp}"], [
        "error: --formats must be a list of 1 to 32 of: ",
        "unknown format 'JSON' (did you mean 'json'?), got 'JSON,trace'\n"]),
    (["--formats", " , ", "--profile-dir", "{tmp}"], [
        "error: --formats names no format: give some of callgrind, "]),
    # ("" was ignored, "," refused)
    (["--formats", "", "--profile-dir", "{tmp}"], [
        "error: --formats names no format: give some of callgrind, "]),
    (["--formats", ""], [
        "error: --formats names no format: give some of callgrind, "]),
])
def test_serve_errors_name_the_flags(tmp_path, args, needles):
    """ConfigErrors said "formats needs profile_dir" or "blocking_ms ...
    or None (0 or off in the environment)": flags the user never typed,
    and a value the command line cannot take."""
    (tmp_path / "cli_test_app.py").write_text(APP)
    args = [str(tmp_path / "out") if a == "{tmp}" else a for a in args]
    r = cli("serve", "cli_test_app:app", "--port", "0", "--quiet", *args,
            cwd=str(tmp_path), timeout=20)
    fails(r, *needles)
    err = r.stderr.decode()
    assert len(err.splitlines()) == 1, err
    assert "None" not in err and "blocking_ms" not in err, err
    assert "profile_dir" not in err and "calls=" not in err, err


@pytest.mark.parametrize("source,where,needle", [
    ("def app(:\n", "cli_broken_app.py, line 1", "SyntaxError"),
    ("import cli_broken_helper\napp = None\n",
     "cli_broken_helper.py, line 2", "IndentationError"),
])
def test_serve_syntax_error_is_one_line(tmp_path, source, where, needle):
    """A syntax error in the app's module (or one it imports) printed
    importlib's whole traceback."""
    (tmp_path / "cli_broken_app.py").write_text(source)
    (tmp_path / "cli_broken_helper.py").write_text("def f():\nreturn 1\n")
    r = cli("serve", "cli_broken_app:app", "--port", "0",
            cwd=str(tmp_path), timeout=20)
    fails(r, "error: cannot import module 'cli_broken_app': %s in "
          % needle, str(tmp_path / where))
    err = r.stderr.decode()
    assert len(err.splitlines()) == 1, err


@pytest.mark.parametrize("args,needle", [
    (["--formats", "pct,%sblocking_ms" % ("json," * 20),
      "--profile-dir", "{tmp}"],
     "unknown format 'pct', got 'pct,json,json,"),
    (["--profile-dir", "calls " + "x" * 4100],
     "longer than 4096 characters, got 'calls xxx"),
])
def test_serve_error_echoes_the_value_as_typed(tmp_path, args, needle):
    """A value cut to 80 characters lost its closing quote, and the flags
    were named inside it: "got '--pct,json,...", "got '--calls xxx"."""
    (tmp_path / "cli_test_app.py").write_text(APP)
    args = [str(tmp_path / "out") if a == "{tmp}" else a for a in args]
    r = cli("serve", "cli_test_app:app", "--port", "0", "--quiet", *args,
            cwd=str(tmp_path), timeout=20)
    fails(r, needle, "more]\n")
    assert "'--" not in r.stderr.decode(), r.stderr


@pytest.mark.parametrize("files,spec,needle", [
    # (a package whose lazy __getattr__ imports the broken module: a
    # 33-line traceback, exit 1)
    ({"cli_lazy/__init__.py": "def __getattr__(name):\n"
      "    import importlib\n"
      "    return importlib.import_module('cli_lazy.' + name)\n",
      "cli_lazy/bad.py": "def app(:\n"}, "cli_lazy:bad.app",
     "error: cannot import cli_lazy:bad.app: SyntaxError in {tmp}/"
     "cli_lazy/bad.py, line 1: invalid syntax\n"),
    ({"cli_lazy/__init__.py": "def __getattr__(name):\n"
      "    import importlib\n"
      "    return importlib.import_module('cli_lazy.' + name)\n"},
     "cli_lazy:nope.app", "error: cannot import cli_lazy:nope.app: No "
     "module named 'cli_lazy.nope'\n"),
    # (it said "SyntaxError in None, line None")
    ({"cli_hand.py": "raise SyntaxError('made by hand')\n"}, "cli_hand:app",
     "error: cannot import module 'cli_hand': SyntaxError: made by "
     "hand\n"),
    ({"cli_exec.py": "exec('def (')\n"}, "cli_exec:app",
     "error: cannot import module 'cli_exec': SyntaxError in <string>, "
     "line 1: invalid syntax\n"),
    # (a TypeError traceback from importlib)
    ({}, ".cli_rel:app", "error: expected MODULE:APP with an absolute "
     "module name (no leading dot), got '.cli_rel:app'\n"),
])
def test_serve_import_error_is_one_line(tmp_path, files, spec, needle):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    r = cli("serve", spec, "--port", "0", cwd=str(tmp_path), timeout=20)
    fails(r, needle.replace("{tmp}", str(tmp_path)))
    assert len(r.stderr.decode().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("args,needle", [
    (["--port", "-1"], "--port"),
    (["--port", "65536"], "--port"),
    (["--port", "http"], "--port"),
    # (these used to serve with blocking reports silently off)
    (["--port", "0", "--blocking-ms", "-5"], "--blocking-ms must be"),
    (["--port", "0", "--blocking-ms", "nan"], "--blocking-ms must be"),
    (["--port", "0", "--blocking-ms", "1e-9"], "--blocking-ms must be"),
])
def test_serve_bad_number_is_one_line(tmp_path, args, needle):
    # (before: an OverflowError traceback from bind() for the ports)
    (tmp_path / "cli_test_app.py").write_text(APP)
    r = cli("serve", "cli_test_app:app", "--quiet", *args,
            cwd=str(tmp_path), timeout=20)
    fails(r, needle)


# ---------------------------------------------------------------------------
# serve on an app already wrapped in ProfilingMiddleware: no dead ends

def inspector_url(srv):
    line = srv.proc.stdout.readline().decode()
    m = re.search(r"inspector at (http://\S+/)", line)
    assert m, (line, stderr_of(srv))
    return m.group(1)


def stderr_of(srv):
    return (srv.cwd / "stderr.txt").read_text()[:2000]


def wait_listed(url, path):
    """The inspector's list page once it lists path (profiles are
    delivered after the response)."""
    deadline = time.monotonic() + 10
    while True:
        page = requests.get(url, timeout=10)
        assert page.status_code == 200, (page.status_code, page.text[:300])
        if path in page.text or time.monotonic() > deadline:
            return page.text
        time.sleep(0.05)


def test_serve_ui_on_a_wrapped_app_serves_an_inspector(tmp_path):
    """--ui and --profile-dir on an app whose module wraps it: the printed
    inspector URL answers and lists the request, profiled once (used to
    print a URL the app answered itself, and drop --profile-dir)."""
    out = tmp_path / "profiles"
    srv = start_serve(tmp_path, "--ui", "--quiet", "--profile-dir", str(out),
                      app="cli_wrapped_app:wrapped")
    try:
        ui = inspector_url(srv)
        assert ui == srv.url + "/_greqprof/"
        r = requests.get(srv.url + "/hello/wrapped", timeout=10)
        assert r.status_code == 200 and r.text == "hello"
        page = wait_listed(ui, "/hello/wrapped")
        assert "/hello/wrapped" in page and "greqprof" in page
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (
                out.exists() and os.listdir(str(out))):
            time.sleep(0.05)
        assert [f for f in os.listdir(str(out)) if f.endswith(".json")]
    finally:
        stop(srv)
    err = (tmp_path / "stderr.txt").read_text()
    assert "already wrapped" in err and "--ui" in err, err
    files = [f for f in os.listdir(str(out)) if not f.startswith(".")]
    assert len(files) == 1, files   # one middleware profiled it


@pytest.mark.parametrize("args", [(), ("--ui",)])
def test_serve_shows_a_wrapped_apps_own_inspector(tmp_path, args):
    """The middleware's own ui_path is the URL printed, and it answers."""
    srv = start_serve(tmp_path, "--quiet", *args,
                      app="cli_wrapped_app:own_ui")
    try:
        ui = inspector_url(srv)
        assert ui == srv.url + "/debug/prof/"
        requests.get(srv.url + "/own", timeout=10).raise_for_status()
        assert "/own" in wait_listed(ui, "/own")
    finally:
        stop(srv)


@pytest.mark.parametrize("args,needles", [
    (["--calls"], ["--calls cannot change", "calls=True", "pct=0.05"]),
    (["--pct", "0.5", "--blocking-ms", "0"],
     ["--pct and --blocking-ms cannot", "pct=0.5, blocking_ms=None"]),
    (["--formats", "json"], ["--formats needs --profile-dir"]),
    (["--formats", ""], ["--formats needs --profile-dir"]),
    (["--blocking-ms", "-5"], ["--blocking-ms must be", "or 0 (off)"]),
])
def test_serve_refuses_what_a_wrapped_app_fixes(tmp_path, args, needles):
    """Options that would change how the module's middleware profiles stop
    the command at once, saying where to set them (--calls used to be
    silently ignored)."""
    (tmp_path / "cli_test_app.py").write_text(APP)
    (tmp_path / "cli_wrapped_app.py").write_text(WRAPPED)
    r = cli("serve", "cli_wrapped_app:sampled", "--port", "0", *args,
            cwd=str(tmp_path), timeout=20)
    fails(r, *needles)
    assert len(r.stderr.decode().strip().splitlines()) == 1, r.stderr


def test_serve_accepts_what_a_wrapped_app_already_does(tmp_path):
    srv = start_serve(tmp_path, "--quiet", "--pct", "1", "--blocking-ms",
                      "100", app="cli_wrapped_app:wrapped")
    try:
        assert requests.get(srv.url + "/", timeout=10).text == "hello"
    finally:
        stop(srv)


def test_serve_ui_on_all_interfaces_prints_a_loopback_url(tmp_path):
    """--host 0.0.0.0: the URLs printed name 127.0.0.1 (the inspector
    refuses Host: 0.0.0.0, and some browsers refuse to open it)."""
    srv = start_serve(tmp_path, "--host", "0.0.0.0", "--ui", "--quiet")
    try:
        assert srv.url.startswith("http://127.0.0.1:")
        ui = inspector_url(srv)
        requests.get(srv.url + "/x", timeout=10).raise_for_status()
        assert requests.get(ui, timeout=10).status_code == 200
    finally:
        stop(srv)


def _local_address():
    """A non-loopback address of this machine (a UDP connect sends
    nothing), or None."""
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.123", 9))
        except OSError:
            return None
        addr = s.getsockname()[0]
    return None if addr.startswith("127.") else addr


def test_serve_ui_refuses_a_host_the_inspector_would_refuse(tmp_path):
    """The inspector answers loopback clients only: --ui on a
    non-loopback address stops at once instead of printing a URL that
    answers 403."""
    addr = _local_address()
    if addr is None:
        pytest.skip("no non-loopback IPv4 address on this machine")
    (tmp_path / "cli_test_app.py").write_text(APP)
    (tmp_path / "cli_wrapped_app.py").write_text(WRAPPED)
    for app in ("cli_test_app:app", "cli_wrapped_app:wrapped"):
        r = cli("serve", app, "--host", addr, "--port", "0", "--ui",
                "--quiet", cwd=str(tmp_path), timeout=20)
        fails(r, "--ui: the inspector would refuse", "--host 127.0.0.1")


def test_example_app_prints_a_url_that_answers(tmp_path):
    """examples/wsgi_app.py --port 0 printed port 0 (read before the
    server was bound)."""
    example = os.path.join(os.path.dirname(CHILD_CWD), "examples",
                           "wsgi_app.py")
    with open(str(tmp_path / "stderr.txt"), "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, example, "--port", "0", "--host", "0.0.0.0"],
            cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=err,
            env=child_env())
    try:
        line = proc.stdout.readline().decode()
        url = re.search(r"serving on (http://\S+)", line).group(1)
        assert url.startswith("http://127.0.0.1:"), line
        r = requests.get(url + "/", timeout=10)
        assert r.status_code == 200, r.text
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()
