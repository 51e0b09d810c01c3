"""Instructions per greenlet switch and per Python call, counted by
valgrind's callgrind: unlike timings, the counts do not depend on what
else the machine is doing, so they compare configurations exactly.

    python bench/instructions.py [--markdown] [--quick]

Each configuration runs twice with different sizes in a fresh interpreter
under callgrind; the difference of the two totals divided by the
difference in events removes start-up and import costs.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

SWITCH_CHILD = r'''
import sys, greenlet, operator
mode, n = sys.argv[1], int(sys.argv[2])
main = greenlet.getcurrent()
def ping():
    while True:
        main.switch()
g = greenlet.greenlet(ping)
p = None
if mode == "c-noop":
    greenlet.settrace(operator.is_)
elif mode == "py-noop":
    greenlet.settrace(lambda event, args: None)
elif mode == "gevent-monitor":
    # the switch tracer of gevent's monitor thread (without the thread,
    # which only reads what the tracer wrote)
    from gevent._tracer import GreenletTracer
    tracer = GreenletTracer()
elif mode == "mw-hooks":
    # ProfilingMiddleware's hooks as after its first request, with no
    # sampled request open: what every unsampled request's switches pay
    from greqprof.engine import engine_for_thread
    from greqprof.middleware import ProfilingMiddleware
    engine_for_thread(ProfilingMiddleware(lambda e, s: [], pct=0.0).config)
elif mode != "bare":
    import greqprof
    kw = {"greqprof-wall": dict(clock="wall", calls=False),
          "greqprof-cpu": dict(clock="cpu", calls=False),
          "greqprof-exact": dict(clock="cpu", calls=False, cpu="exact")}[mode]
    p = greqprof.Profiler(**kw)
    p.start()
for _ in range(n):
    g.switch()
if p is not None:
    p.stop()
'''

CALL_CHILD = r'''
import sys
mode, n = sys.argv[1], int(sys.argv[2])
def fib(k):
    return k if k < 2 else fib(k - 1) + fib(k - 2)
if mode == "cProfile":
    import cProfile
    p = cProfile.Profile(); p.enable(); fib(n); p.disable()
elif mode == "bare":
    fib(n)
else:
    import greqprof
    p = greqprof.Profiler(clock=mode.split("-")[1]); p.start(); fib(n)
    p.stop()
'''


def fib_calls(n):
    a, b = 0, 1
    for _ in range(n + 1):
        a, b = b, a + b
    return 2 * a - 1  # calls made by fib(n) = 2 * F(n+1) - 1


def count(script, mode, n, env):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "cg.out")
        src = os.path.join(d, "child.py")
        with open(src, "w") as f:
            f.write(script)
        proc = subprocess.run(
            ["valgrind", "--tool=callgrind", "--callgrind-out-file=" + out,
             sys.executable, src, mode, str(n)],
            capture_output=True, text=True, env=env)
        m = re.search(r"Collected : (\d+)", proc.stderr) or \
            re.search(r"refs:\s+([\d,]+)", proc.stderr)
        if proc.returncode != 0 or not m:
            raise RuntimeError("callgrind failed for %s: %s"
                               % (mode, proc.stderr[-1000:]))
        return int(m.group(1).replace(",", ""))


def per_event(script, mode, small, big, events_small, events_big, env):
    a = count(script, mode, small, env)
    b = count(script, mode, big, env)
    return (b - a) / float(events_big - events_small)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="small sizes (checks the script works)")
    ap.add_argument("--switch-only", action="store_true",
                    help="only the switch rows")
    args = ap.parse_args()
    if not shutil.which("valgrind"):
        print("skipped: valgrind not installed (apt-get install valgrind)")
        return 0
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE))
    s_small, s_big = (200, 600) if args.quick else (10000, 30000)
    f_small, f_big = (8, 11) if args.quick else (15, 18)
    rows = []
    for mode in ("bare", "c-noop", "py-noop", "gevent-monitor", "mw-hooks",
                 "greqprof-wall", "greqprof-cpu", "greqprof-exact"):
        v = per_event(SWITCH_CHILD, mode, s_small, s_big, 2 * s_small,
                      2 * s_big, env)
        rows.append(("switch", mode, v))
    for mode in () if args.switch_only else ("bare", "cProfile",
                                             "greqprof-cpu", "greqprof-wall"):
        v = per_event(CALL_CHILD, mode, f_small, f_big, fib_calls(f_small),
                      fib_calls(f_big), env)
        rows.append(("call", mode, v))
    base = {kind: v for kind, mode, v in rows if mode == "bare"}
    base.setdefault("call", 0.0)
    ref = {kind: v for kind, mode, v in rows
           if mode in ("c-noop", "cProfile")}
    if args.markdown:
        print("| event | configuration | instructions per event | added "
              "to bare | vs reference |")
        print("|---|---|---:|---:|---:|")
    for kind, mode, v in rows:
        added = v - base[kind]
        rel = ("%.2f x" % ((v - base[kind]) / (ref[kind] - base[kind]))
               if mode not in ("bare",) and ref[kind] != base[kind] else "")
        if args.markdown:
            print("| %s | %s | %.0f | %+.0f | %s |" % (kind, mode, v, added,
                                                     rel))
        else:
            print("%-7s %-16s %8.0f instr  %+8.0f  %s" % (kind, mode, v,
                                                          added, rel))
    if args.markdown:
        print("\nreference: the C no-op `greenlet.settrace(operator.is_)` for "
              "switches, cProfile for calls; `python bench/instructions.py "
              "--markdown`%s" % (" (--quick)" if args.quick else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
