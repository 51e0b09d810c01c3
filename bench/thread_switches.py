"""What the background threads cost the serving thread, counted instead of
timed: a bench/_load_server.py server (pinned to CPU 1) under
``wrk -t1 -c16`` on GET /api?page=2 (pinned to CPU 0) for --seconds, then
each of its OS threads' CPU ticks and voluntary / involuntary context
switches from /proc.  The serving thread's involuntary switches are
mostly its GIL given up to another thread of the process (the stack
sampler, the watchdog) on the shared CPU.

    python bench/thread_switches.py gqp-0pct                 # this checkout
    python bench/thread_switches.py gqp-0pct --root /tmp/old # another one,
                                                            # built in place
"""
import argparse
import json
import os
import subprocess
import sys
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))


def snap(pid):
    out = {}
    for t in os.listdir("/proc/%d/task" % pid):
        with open("/proc/%d/task/%s/stat" % (pid, t)) as f:
            st = f.read().rsplit(")", 1)[1].split()
        with open("/proc/%d/task/%s/status" % (pid, t)) as f:
            d = dict(line.split(":\t", 1) for line in f.read().splitlines()
                     if ":\t" in line)
        out[t] = (int(st[11]) + int(st[12]),
                  int(d["voluntary_ctxt_switches"]),
                  int(d["nonvoluntary_ctxt_switches"]))
    return out


def wrk(port, seconds):
    r = subprocess.run(["taskset", "-c", "0", "wrk", "-t1", "-c16",
                        "-d%ds" % seconds,
                        "http://127.0.0.1:%d/api?page=2" % port],
                       capture_output=True, text=True, check=True)
    return [ln for ln in r.stdout.splitlines()
            if "Requests/sec" in ln][0].split()[-1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config", nargs="+")
    ap.add_argument("--root", default=os.path.dirname(HERE),
                    help="the checkout whose greqprof is imported")
    ap.add_argument("--seconds", type=int, default=5)
    a = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=a.root)
    for cfg in a.config:
        p = subprocess.Popen(["taskset", "-c", "1", sys.executable,
                              os.path.join(HERE, "_load_server.py"),
                              "--config", cfg, "--port", "0"],
                             stdout=subprocess.PIPE, env=env, text=True,
                             cwd=a.root)
        try:
            port = int(p.stdout.readline().split()[1])
            wrk(port, 1)   # (warm-up)
            before = snap(p.pid)
            rps = wrk(port, a.seconds)
            after = snap(p.pid)
            with urllib.request.urlopen("http://127.0.0.1:%d/__stats"
                                        % port) as r:
                smp = json.loads(r.read()).get("sampler")
        finally:
            p.terminate()
            p.wait()
        print("%s (%s): %s req/s, %d threads; per second:"
              % (cfg, a.root, rps, len(after)))
        for t in sorted(after, key=int):
            b = before.get(t, (0, 0, 0))
            d = [(x - y) / a.seconds for x, y in zip(after[t], b)]
            print("  %-8s %s cpu %.0f%%  voluntary %.0f  involuntary %.0f"
                  % (t, "(serving)" if t == str(p.pid) else "         ",
                     d[0], d[1], d[2]))
        if smp:
            print("  sampler since start: %s" % smp)


if __name__ == "__main__":
    main()
