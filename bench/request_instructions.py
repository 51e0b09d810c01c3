"""Instructions per WSGI request, counted by valgrind's callgrind: the
middleware's per-request cost without the machine's noise.

    python bench/request_instructions.py [--app spawn|hello] [--markdown]

Each configuration runs twice in a fresh interpreter under callgrind, with
1000 and 3000 requests (after 300 warm-up requests); the difference of the
two totals divided by 2000 removes start-up, imports and the warm-up.  A
request is ProfilingMiddleware.__call__ (or the bare app) called in-process
from a gevent greenlet, its body read and closed, then gevent.sleep(0) as a
server's connection greenlet goes back to the hub.  Kernel time (system
calls such as the thread CPU clock) is not counted.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import _benchutil as bu  # noqa: E402

CHILD = r'''
import json, sys
sys.path.insert(0, sys.argv[4])
import gevent
import _load_server as ls
kw, app_kind, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
inner = {"spawn": ls._micro_spawn, "hello": ls.make_app(24)}[app_kind]
if kw == "bare":
    app = inner
else:
    from greqprof import ProfilingMiddleware
    app = ProfilingMiddleware(inner, report=False, sink=lambda p: None,
                              **json.loads(kw))
env = {"PATH_INFO": "/hello", "QUERY_STRING": "name=bench",
       "REQUEST_METHOD": "GET", "SERVER_NAME": "x", "SERVER_PORT": "80",
       "wsgi.url_scheme": "http"}
def start_response(status, headers, exc_info=None):
    pass
def run(k):
    for _ in range(k):
        body = app(env, start_response)
        b"".join(body)
        getattr(body, "close", int)()
        gevent.sleep(0)
gevent.spawn(run, 300).join()
gevent.spawn(run, n).join()
gevent.sleep(0.05)  # lingering profiles are finalized
'''

#: label -> ProfilingMiddleware keyword arguments ("bare": no middleware)
CASES = [
    ("no middleware", "bare"),
    ("pct=0, blocking_ms=None (no hooks)",
     '{"pct": 0.0, "blocking_ms": null}'),
    ("unsampled request (pct=0, blocking detection on)", '{"pct": 0.0}'),
    ("sampled request (pct=1.0, linger=0)",
     '{"pct": 1.0, "linger": 0}'),
    ("sampled request (pct=1.0, default linger)", '{"pct": 1.0}'),
]
SIZES = (1000, 3000)


def count(kw, app, n, tmp):
    out = os.path.join(tmp, "cg.%d.out" % n)
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=" + out,
           sys.executable, "-c", CHILD, kw, app, str(n), HERE]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                       timeout=1800)
    if p.returncode != 0:
        raise RuntimeError("callgrind run failed: " + p.stderr[-1500:])
    with open(out) as f:
        m = re.search(r"^summary: (\d+)", f.read(), re.M)
    os.unlink(out)
    if not m:
        raise RuntimeError("no callgrind summary in " + out)
    return int(m.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--app", choices=("spawn", "hello"), default="spawn",
                    help="spawn: spawns and joins one greenlet (default); "
                         "hello: the /hello handler of the load benchmark")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--kw", action="append", metavar="JSON",
                    help="measure ProfilingMiddleware(**JSON) instead of "
                         "the default cases (repeatable; 'bare': no "
                         "middleware); run this script from another "
                         "checkout to count that checkout's build")
    args = ap.parse_args()
    cases = [(kw, kw) for kw in args.kw] if args.kw else CASES
    if shutil.which("valgrind") is None:
        print("skipped: valgrind is not installed")
        return 0
    rows = []
    base = None
    with tempfile.TemporaryDirectory() as tmp:
        for label, kw in cases:
            a, b = (count(kw, args.app, n, tmp) for n in SIZES)
            per = (b - a) / (SIZES[1] - SIZES[0])
            if base is None:
                base = per
            bu.log("%-52s %9.0f instructions/request" % (label, per))
            rows.append([label, "%.0f" % per, "%+.0f" % (per - base)])
    headers = ["configuration (%s app)" % args.app, "instructions per request",
               "added to no middleware"]
    print((bu.md_table if args.markdown else bu.text_table)(headers, rows))
    print("\n`python bench/request_instructions.py --app %s%s%s`"
          % (args.app, " --markdown" if args.markdown else "",
             "".join(" --kw '%s'" % kw for kw in args.kw or ())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
