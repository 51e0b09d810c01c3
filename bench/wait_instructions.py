"""Instructions per wait of a sampled request, counted by valgrind's
callgrind: what looking up and charging wait sites (RequestProfile.waits)
costs per switch-out.

    python bench/wait_instructions.py [--markdown] [--root DIR]

A request's app calls gevent.sleep(0) `k` times in one function (one wait
site, k waits of the request's greenlet), in-process as in
bench/request_instructions.py.  Each configuration runs in a fresh
interpreter under callgrind with 1000 and 2000 requests (after 300 warm-up
requests); the difference of the two totals divided by 1000 is the cost per
request.  The rows with k = 1 and k = 21 give the cost of 20 more waits; the
sampled rows minus the unsampled ones are what a sampled request pays.
`--root DIR` runs the greqprof of another checkout (built in place) for a
before/after comparison.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _benchutil as bu  # noqa: E402

CHILD = r'''
import json, sys
import gevent
from greqprof import ProfilingMiddleware
kw, k, n = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])

def wait_upstream():
    for _ in range(k):
        gevent.sleep(0)

def inner(environ, start_response):
    wait_upstream()
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]

app = ProfilingMiddleware(inner, report=False, sink=lambda p: None, **kw)
env = {"PATH_INFO": "/w", "QUERY_STRING": "", "REQUEST_METHOD": "GET",
       "SERVER_NAME": "x", "SERVER_PORT": "80", "wsgi.url_scheme": "http"}
def start_response(status, headers, exc_info=None):
    pass
def run(m):
    for _ in range(m):
        body = app(env, start_response)
        b"".join(body)
        getattr(body, "close", int)()
        gevent.sleep(0)
gevent.spawn(run, 300).join()
gevent.spawn(run, n).join()
gevent.sleep(0.05)
'''

CASES = [
    ("unsampled (pct=0), 1 wait", '{"pct": 0.0}', 1),
    ("unsampled (pct=0), 21 waits", '{"pct": 0.0}', 21),
    ("sampled (pct=1.0, linger=0), 1 wait", '{"pct": 1.0, "linger": 0}', 1),
    ("sampled (pct=1.0, linger=0), 21 waits", '{"pct": 1.0, "linger": 0}',
     21),
]
SIZES = (1000, 2000)


def count(root, kw, k, n, tmp):
    out = os.path.join(tmp, "cg.%d.out" % n)
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=" + out,
           sys.executable, "-c", CHILD, kw, str(k), str(n)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=root,
                       timeout=1800)
    if p.returncode != 0:
        raise RuntimeError("callgrind run failed: " + p.stderr[-1500:])
    with open(out) as f:
        m = re.search(r"^summary: (\d+)", f.read(), re.M)
    os.unlink(out)
    return int(m.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--root", default=os.path.dirname(HERE),
                    help="checkout whose greqprof runs (default: this one)")
    args = ap.parse_args()
    if shutil.which("valgrind") is None:
        print("skipped: valgrind is not installed")
        return 0
    per = {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, kw, k in CASES:
            a, b = (count(args.root, kw, k, n, tmp) for n in SIZES)
            per[label] = (b - a) / (SIZES[1] - SIZES[0])
            bu.log("%-44s %9.0f instructions/request" % (label, per[label]))
            rows.append([label, "%.0f" % per[label]])
    u1, u21, s1, s21 = (per[c[0]] for c in CASES)
    rows.append(["per extra wait, unsampled", "%.0f" % ((u21 - u1) / 20)])
    rows.append(["per extra wait, sampled", "%.0f" % ((s21 - s1) / 20)])
    rows.append(["added per wait by sampling", "%.0f"
                 % ((s21 - s1 - (u21 - u1)) / 20)])
    headers = ["configuration (app: k × gevent.sleep(0) in one function)",
               "instructions per request"]
    print((bu.md_table if args.markdown else bu.text_table)(headers, rows))
    print("\n`python bench/wait_instructions.py%s`"
          % (" --markdown" if args.markdown else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
