"""What rendering and logging one sampled request's report costs.

In-process, no load generator: a real request (12 greenlets, ~40 spans,
waiting on the hub) is served once by gevent.pywsgi through
ProfilingMiddleware(pct=1.0); its RequestProfile, as the finisher hands it
over (deferred: only the packed rows C read out), is then delivered again
and again, each time to a fresh copy, through the middleware's own output
path (``_deliver``: render + ``logger.info``) to a FileHandler with a
standard Formatter, the way production logs it.  Every configuration is
timed in the same rounds, one call at a time, alternating, and reported
as the median over all calls, next to a bare ``logger.info("x")`` to the
same handler.

    python bench/report_cost.py                 # ~20 s
    python bench/report_cost.py --markdown      # table for README/bench
    python bench/report_cost.py --quick         # smoke run (test suite)
    python bench/report_cost.py --instructions  # callgrind counts, ~3 min

--instructions counts instructions per call with valgrind's callgrind
instead of timing (immune to what else the machine runs): each row runs
twice in a fresh interpreter, N and 5N calls, and the difference of the
totals over 4N is its count per call (PYTHONHASHSEED=0 in both, so that
their start-ups are the same).

Rows (a row whose code this checkout does not have is skipped, so the
same script measures an older checkout too):

* bare ``logger.info("x")`` — the logging floor;
* bare ``logger.info(text)`` of the report's text (made once) — the floor
  for a message of the report's size;
* text report logged (``_deliver``, the default: report=True) — the
  number issue 16 limits to 15 us;
* text report, rendered only (``profile.report()``);
* text report logged, rendered in Python (``report._render_py``: the
  rows, without the C renderer);
* text report logged, records built first (what any reader of
  ``profile.spans`` pays, then the report);
* JSON line logged (``json_logs=True``, bounded to 64 KiB).

Both clocks are printed: wall (perf_counter) and the thread's CPU time
(thread_time, which other processes on a busy machine do not inflate).
"""
import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time

import gevent
from gevent import pywsgi, socket

from greqprof import ProfilingMiddleware
from greqprof.request_profile import RequestProfile


def _child():
    gevent.sleep(0.001)
    gevent.sleep(0)


def app(environ, start_response):
    kids = [gevent.spawn(_child) for _ in range(11)]
    for _ in range(3):
        gevent.sleep(0)
    gevent.joinall(kids)
    start_response("200 OK", [("Content-Type", "application/json")])
    return [b'{"ok": true}']


def sampled_profile():
    """One real request's RequestProfile, as the finisher delivers it."""
    got = []
    mw = ProfilingMiddleware(app, pct=1.0, report=False, sink=got.append,
                             linger=0.2, blocking_ms=None)
    server = pywsgi.WSGIServer(("127.0.0.1", 0), mw, log=None)
    server.start()
    try:
        s = socket.create_connection(("127.0.0.1", server.server_port))
        s.sendall(b"GET /api/items?page=2 HTTP/1.1\r\nHost: bench\r\n"
                  b"X-Request-Id: 6f1c2b1e-bench\r\nConnection: close\r\n\r\n")
        while s.recv(65536):
            pass
        s.close()
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            gevent.sleep(0.01)
    finally:
        server.stop()
    if not got:
        raise SystemExit("no profile was delivered")
    return mw, got[0]


def fresh(p):
    """A copy of p in the state it was delivered in (deferred or not)."""
    q = RequestProfile.__new__(RequestProfile)
    q.__dict__.update(p.__dict__)
    return q


def file_logger(path, name):
    log = logging.getLogger(name)
    log.propagate = False
    log.setLevel(logging.INFO)
    h = logging.FileHandler(path)
    h.setFormatter(logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log.addHandler(h)
    return log, h


def configs(mw, p, log):
    from greqprof import report
    out = [("bare", 'bare `logger.info("x")`', lambda q: log.info("x"))]
    # (the logging floor for this report: its text, made once, logged)
    text = fresh(p).report()
    out.append(("bare-text", "bare `logger.info(text)` of the report's "
                "text (%.1f KB, made once)" % (len(text) / 1000.0),
                lambda q: log.info(text)))
    mw.log = log
    mw.report = True
    mw.sink = None
    mw._outputs = None

    def deliver(q):
        mw._deliver(q)
    out.append(("text", "text report logged (`_deliver`, the default)",
                deliver))
    out.append(("render", "text report, rendered only (`report()`)",
                lambda q: q.report()))
    render_py = getattr(report, "_render_py", None)
    if render_py is not None:
        out.append(("text-py", "text report logged, rendered in Python "
                    "(no C renderer)",
                    lambda q: log.info(render_py(q, 10, 25, 20))))

    def built(q):
        q.spans  # noqa: B018  (builds the records)
        mw._deliver(q)
    out.append(("text-built", "text report logged, records built first",
                built))
    if "json_max_bytes" in getattr(ProfilingMiddleware.__init__,
                                   "__code__").co_varnames:
        out.append(("json", "JSON line logged (`json_logs=True`, 64 KiB "
                    "cap)", lambda q: log.info(q.to_json(max_bytes=65536))))
    else:
        out.append(("json", "JSON line logged (`json_logs=True`)",
                    lambda q: log.info(q.to_json())))
    return out


def measure(cfgs, p, rounds, per_round):
    wall = {k: [] for k, _, _ in cfgs}
    cpu = {k: [] for k, _, _ in cfgs}
    pc, tt = time.perf_counter_ns, time.thread_time_ns
    for _ in range(rounds):
        for key, _label, fn in cfgs:
            for _ in range(per_round):
                q = fresh(p)
                w0, c0 = pc(), tt()
                fn(q)
                c1, w1 = tt(), pc()
                wall[key].append((w1 - w0) / 1000.0)
                cpu[key].append((c1 - c0) / 1000.0)
    return wall, cpu


def run_only(key, n):
    """--run: n calls of one row, untimed (the child of --instructions)."""
    mw, p = sampled_profile()
    d = tempfile.mkdtemp(prefix="greqprof-report-cost-")
    path = os.path.join(d, "reports.log")
    log, handler = file_logger(path, "greqprof.bench.report_cost")
    fns = {k: f for k, _l, f in configs(mw, p, log)}
    fns["none"] = lambda q: None    # (the copy alone: subtracted)
    fn = fns.get(key)
    if fn is None:
        raise SystemExit(3)   # (a row this checkout does not have)
    fn(fresh(p))   # (first-call costs out of the difference)
    for _ in range(n):
        fn(fresh(p))
    handler.close()
    os.unlink(path)
    os.rmdir(d)


def instructions(keys, n):
    import re
    import shutil
    import subprocess
    if not shutil.which("valgrind"):
        print("skipped: valgrind not installed")
        return {}
    out = {}
    # (one hash seed for every run: a random one changes the start-up's
    # dict and set collisions, which the difference of two runs would
    # count as several thousand instructions per call)
    env = dict(os.environ, PYTHONHASHSEED="0")
    for key in keys:
        totals = []
        for calls in (n, 5 * n):
            with tempfile.TemporaryDirectory() as d:
                proc = subprocess.run(
                    ["valgrind", "--tool=callgrind",
                     "--callgrind-out-file=" + os.path.join(d, "cg.out"),
                     sys.executable, os.path.abspath(__file__), "--run", key,
                     "--n", str(calls)], capture_output=True, text=True,
                    env=env)
            m = re.search(r"Collected : (\d+)", proc.stderr)
            if proc.returncode == 3:
                break
            if proc.returncode != 0 or not m:
                raise SystemExit("callgrind failed for %s: %s"
                                 % (key, proc.stderr[-1500:]))
            totals.append(int(m.group(1)))
        if len(totals) < 2:
            continue
        out[key] = (totals[1] - totals[0]) / (4.0 * n)
        print("  %s: %.0f instructions per call" % (key, out[key]),
              file=sys.stderr, flush=True)
    none = out.pop("none", 0.0)
    return {k: v - none for k, v in out.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--instructions", action="store_true",
                    help="count instructions per call with callgrind")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--per-round", type=int, default=50)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.run:
        run_only(args.run, args.n)
        return 0
    if args.instructions:
        keys = ["bare", "bare-text", "text", "render", "text-py"]
        counts = instructions(["none"] + keys,
                              20 if args.quick else args.n)
        if counts:
            print("| configuration | instructions per call | over bare |")
            print("|---|---:|---:|")
            labels = {"bare": 'bare `logger.info("x")`',
                      "bare-text": "bare `logger.info(text)` of the "
                                   "report's text",
                      "text": "text report logged (`_deliver`, the "
                              "default)",
                      "render": "text report, rendered only (`report()`)",
                      "text-py": "text report logged, rendered in Python"}
            for key in keys:
                if key in counts:
                    print("| %s | %.0f | %s |" % (
                        labels[key], counts[key], "—" if key == "bare"
                        else "%+.0f" % (counts[key] - counts["bare"])))
        return 0
    if args.quick:
        args.rounds, args.per_round = 2, 5

    mw, p = sampled_profile()
    probe = fresh(p)
    n_spans = len(probe.spans)
    n_greenlets = len(probe.greenlets)
    d = tempfile.mkdtemp(prefix="greqprof-report-cost-")
    path = os.path.join(d, "reports.log")
    log, handler = file_logger(path, "greqprof.bench.report_cost")
    cfgs = configs(mw, p, log)
    sample = fresh(p).report()
    try:
        measure(cfgs, p, 1, max(1, args.per_round // 5))   # warm-up
        wall, cpu = measure(cfgs, p, args.rounds, args.per_round)
    finally:
        handler.close()
        log.removeHandler(handler)
    size = os.path.getsize(path)
    os.unlink(path)
    os.rmdir(d)

    med_w = {k: statistics.median(v) for k, v in wall.items()}
    med_c = {k: statistics.median(v) for k, v in cpu.items()}
    calls = args.rounds * args.per_round
    head = ("%d spans, %d greenlets, the default report %d lines / %d "
            "bytes; %d calls per row (%d rounds x %d, alternating); "
            "load average %s at the end; %s, Python %s"
            % (n_spans, n_greenlets, sample.count("\n") + 1, len(sample),
               calls, args.rounds, args.per_round,
               "%.2f" % os.getloadavg()[0] if hasattr(os, "getloadavg")
               else "?", time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               platform.python_version()))
    rows = []
    for key, label, _fn in cfgs:
        rows.append((label, med_w[key], med_w[key] - med_w["bare"],
                     med_c[key], med_c[key] - med_c["bare"]))
    if args.markdown:
        print(head + "\n")
        print("| configuration | µs per request (wall) | over bare | "
              "µs per request (thread CPU) | over bare |")
        print("|---|---:|---:|---:|---:|")
        for label, w, dw, c, dc in rows:
            print("| %s | %.1f | %s | %.1f | %s |" % (
                label, w, "—" if label.startswith("bare") else "+%.1f" % dw,
                c, "—" if label.startswith("bare") else "+%.1f" % dc))
    else:
        print(head)
        print("%-58s %10s %10s %10s %10s" % ("configuration", "wall us",
                                             "+bare", "cpu us", "+bare"))
        for label, w, dw, c, dc in rows:
            print("%-58s %10.1f %10.1f %10.1f %10.1f" % (
                label[:58], w, dw, c, dc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"head": head, "wall": wall, "cpu": cpu,
                       "median_wall": med_w, "median_cpu": med_c,
                       "log_bytes": size}, f)
    if args.quick:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
