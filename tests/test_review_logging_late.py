"""Issue 22 item 3: logging configured after the middleware's first request
wins from then on, exactly as if it had been configured before it.

Each case runs a real gevent.pywsgi server in a subprocess (a clean logging
state each): a first request, then the application's logging configuration
(or, for the reference run, the same configuration before that request),
then a mark, then two sampled requests, one of which holds the loop (a
blocking WARNING).  What is printed after the mark must be the same in
both runs: same handler, same levels, same records."""
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import CHILD_CWD, child_env

pytestmark = pytest.mark.timeout(120)

SCRIPT = textwrap.dedent('''
    import logging, sys, time
    import gevent
    from gevent import pywsgi, socket
    from greqprof import ProfilingMiddleware

    CONFIG, WHEN = sys.argv[1], sys.argv[2]

    def user_handler():
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("USER %(levelname)s %(message)s"))
        return h

    def configure():
        own = logging.getLogger("greqprof")
        root = logging.getLogger()
        if CONFIG == "logger":          # its own handler and level INFO
            own.addHandler(user_handler())
            own.setLevel(logging.INFO)
        elif CONFIG == "logger-handler":  # a handler, the level left alone
            own.addHandler(user_handler())
        elif CONFIG == "root":          # on the root logger instead
            root.addHandler(user_handler())
            root.setLevel(logging.INFO)
        elif CONFIG == "root-handler":  # root handler, root stays WARNING
            root.addHandler(user_handler())
        elif CONFIG == "level":         # a level only
            own.setLevel(logging.INFO)
        elif CONFIG == "level-warning":
            own.setLevel(logging.WARNING)
        elif CONFIG == "level-debug":
            own.setLevel(logging.DEBUG)
        elif CONFIG == "basicconfig":
            logging.basicConfig(level=logging.INFO,
                                format="USER %(levelname)s %(message)s")
        else:
            raise SystemExit("unknown config " + CONFIG)

    def app(environ, start_response):
        if environ["PATH_INFO"] == "/block":
            time.sleep(0.15)     # not patched: holds the loop
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    if WHEN == "before":
        configure()
    mw = ProfilingMiddleware(app, pct=1.0, linger=0, blocking_ms=100,
                             watchdog=False)
    server = pywsgi.WSGIServer(("127.0.0.1", 0), mw, log=None)
    server.start()

    def get(path):
        s = socket.create_connection(("127.0.0.1", server.server_port))
        s.sendall(("GET %s HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n" % path).encode())
        while s.recv(65536):
            pass
        s.close()
        deadline = time.monotonic() + 10
        while mw.stats["delivered"] < n_delivered[0] + 1 and \\
                time.monotonic() < deadline:
            gevent.sleep(0.01)
        n_delivered[0] = mw.stats["delivered"]

    n_delivered = [0]
    get("/first")
    if WHEN == "after":
        configure()
    sys.stderr.write("MARK\\n")
    get("/second")
    get("/block")
    get("/third")
    server.stop()
''')

#: "USER LEVEL message" (the application's handler) or greqprof's default
#: handler's "date time LEVEL [greqprof] message"
_LINE = re.compile(r"^(?:USER (\w+) |\S+ \S+ (\w+) \[greqprof\] )(.*)$")


def _run(tmp_path, config, when):
    script = tmp_path / "late.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in child_env().items()
           if not k.startswith("GREQPROF_")}
    r = subprocess.run([sys.executable, str(script), config, when],
                       capture_output=True, timeout=60, cwd=CHILD_CWD,
                       env=env)
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert "MARK\n" in err, err
    return err


def _printed_after_mark(err):
    """(who printed it, level, what) of each record after the mark, and the
    paths of the reports among them."""
    out, paths = [], []
    for line in err.split("MARK\n", 1)[1].splitlines():
        m = _LINE.match(line)
        if m:
            who = "user" if line.startswith("USER ") else "greqprof"
            level = m.group(1) or m.group(2)
            what = m.group(3)
            if what.startswith("Blocking span:"):
                if "GET /block" not in what:
                    continue   # (a slow machine: not the one meant)
                what = "blocking"
            elif what.startswith(">>> Begin RequestProfile"):
                what = "report"
            out.append((who, level, what))
        elif line.startswith("  Path: "):
            paths.append(line[len("  Path: "):])
    return out, paths


#: config -> (who prints, the reports' paths) once it is in force
EXPECTED = {
    "logger": ("user", ["/second", "/block", "/third"]),
    "logger-handler": ("user", []),     # the logger is WARNING by default
    "root": ("user", ["/second", "/block", "/third"]),
    "root-handler": ("user", []),
    "level": ("greqprof", ["/second", "/block", "/third"]),
    "level-warning": ("greqprof", []),
    "level-debug": ("greqprof", ["/second", "/block", "/third"]),
    "basicconfig": ("user", ["/second", "/block", "/third"]),
}


@pytest.mark.parametrize("config", sorted(EXPECTED))
def test_a_later_configuration_wins_as_if_made_before(tmp_path, config):
    err_before = _run(tmp_path, config, "before")
    before, before_paths = _printed_after_mark(err_before)
    err_after = _run(tmp_path, config, "after")
    after, after_paths = _printed_after_mark(err_after)
    who, paths = EXPECTED[config]
    # (what a failure shows: the records, and the lines they came from
    # without the reports' bodies)
    seen = "%r\nprinted after the mark:\n%s" % (before, _heads(err_before))
    # the reference run: what this configuration means
    assert before_paths == paths, seen
    reports = [r for r in before if r[2] == "report"]
    assert reports == [(who, "INFO", "report")] * len(paths), seen
    assert [r for r in before if r[2] == "blocking"] == \
        [(who, "WARNING", "blocking")], seen
    # configured after the first request: the very same from then on
    assert after == before, "%r\nprinted after the mark:\n%s" % (
        after, _heads(err_after))
    assert after_paths == before_paths


def _heads(err):
    """The lines after the mark that are not inside a report's body."""
    return "\n".join(line for line in err.split("MARK\n", 1)[1].splitlines()
                     if not line.startswith("  "))[-4000:]


def test_the_first_report_goes_through_greqprofs_handler(tmp_path):
    """Before the application configures anything, greqprof's own handler
    prints (and the default level lets reports through)."""
    err = _run(tmp_path, "logger", "after")
    head = err.split("MARK\n", 1)[0]
    assert head.count("INFO [greqprof] >>> Begin RequestProfile") == 1
    assert "  Path: /first" in head
