"""Instructions per request of a real gevent.pywsgi server under concurrent
keep-alive load, counted by valgrind's callgrind: what a configuration adds,
and in which C functions, without the machine's noise.

    python bench/server_instructions.py [CONFIG ...] [--connections 16]
        [--requests 1600] [--warmup 480] [--top 25] [--markdown] [--app api]

Each configuration (a key of bench/_load_server.py, or gqp{JSON}; default:
bare gqp-0pct gqp-5pct gqp-100pct) is served by its own
bench/_load_server.py process under callgrind.  The script warms it up,
zeroes the counters (callgrind_control -z), sends --requests GET /hello
requests (GET /api with --app api) over --connections keep-alive
connections from as many client threads, and dumps the counters (callgrind_control -d).  Unlike
request_instructions.py (in-process, one request at a time), this sees
what concurrency changes: the span history a sampled request's waiting
time is computed from grows with the number of connections.  Kernel time
(system calls) is not counted.  --top lists the functions whose own
instructions per request grew most against the first configuration.
Each thread is counted apart: "main thread" leaves out the background
threads (gevent's monitor, greqprof's watchdog), which wake up per
wall-clock interval and so count ~50x their real cost per request under
callgrind, varying with the machine's load.
"""
import argparse
import collections
import glob
import http.client
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import _benchutil as bu  # noqa: E402

#: --cache-sim: the simulated misses reported (callgrind's event names)
CACHE_EVENTS = ("I1mr", "D1mr", "D1mw", "DLmr", "DLmw")

#: --app: the route put under load (bench/load_overhead.py's APP_PATHS)
APP_PATHS = {"hello": "/hello?name=bench", "api": "/api?page=2"}
URL = APP_PATHS["hello"]


def _load(port, n, conns):
    """n requests over conns keep-alive connections, one thread each."""
    errors = []

    def client(k):
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
            for _ in range(k):
                c.request("GET", URL)
                r = c.getresponse()
                r.read()
                if r.status != 200:
                    raise RuntimeError("HTTP %d" % r.status)
            c.close()
        except Exception as e:  # reported below, the run is void
            errors.append(e)

    threads = [threading.Thread(target=client, args=(n // conns,))
               for _ in range(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("load failed: %r" % errors[0])
    return _done(n, conns)


def _done(n, conns):
    """Requests _load(n, conns) sends: n rounded down to whole rounds."""
    return (n // conns) * conns


def _sampled(port):
    """The middleware's count of sampled requests (/__stats), or None for
    a configuration without one."""
    import json
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        c.request("GET", "/__stats")
        stats = json.loads(c.getresponse().read())
    finally:
        c.close()
    return (stats.get("middleware") or {}).get("sampled")


def measure(config, requests, conns, warmup, tmp, cache_sim=False):
    """(instructions per request, of them in the main thread, callgrind
    dump path of the main thread, cache misses, requests sampled while
    counted or None) for one config.  Background threads
    (gevent's monitor, greqprof's watchdog) wake up per wall-clock
    interval, and callgrind slows the server ~50x: per request they count
    ~50x what they cost at full speed, and vary with the machine's load."""
    out = os.path.join(tmp, "cg.%s.out" % re.sub(r"\W", "_", config))
    # (one hash seed: the environ lookups that miss probe as far as the
    # keys' hashes make them, ~2k instructions per request from one seed
    # to another)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONHASHSEED="0")
    proc = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=" + out,
         "--separate-threads=yes"] +
        (["--cache-sim=yes"] if cache_sim else []) + [sys.executable, os.path.join(HERE, "_load_server.py"),
         "--config", config, "--port", "0", "--rows", "24"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL, env=env, cwd=ROOT)
    try:
        port = bu.read_port(proc, 120)
        if port is None:
            raise RuntimeError(
                "the server under valgrind did not start in 120 s (%s): "
                "`python bench/_load_server.py --config '%s'` shows why"
                % (config, config))
        _load(port, max(conns, warmup), conns)   # warm-up: caches, engine
        time.sleep(0.5)
        sampled0 = _sampled(port)
        subprocess.run(["callgrind_control", "-z", str(proc.pid)],
                       check=True, capture_output=True)
        done = _load(port, requests, conns)
        time.sleep(0.5)
        subprocess.run(["callgrind_control", "-d", str(proc.pid)],
                       check=True, capture_output=True)
        # (asked outside the counted part)
        sampled1 = _sampled(port)
        sampled = (sampled1 - sampled0 if None not in (sampled0, sampled1)
                   else None)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    # (the dump of -d, one file per thread: OUT.<part>-<thread>)
    dumps = [d for d in glob.glob(out + ".*-*")
             if re.search(r"\.\d+-\d+$", d)]
    if not dumps:
        raise RuntimeError("no callgrind dump for " + config)
    part = max(dumps, key=os.path.getmtime).rsplit("-", 1)[0]
    total = main = 0
    misses = {}
    for dump in glob.glob(part + "-*"):
        with open(dump) as f:
            text = f.read()
        counts = [int(x) for x in re.search(r"^summary: ([\d ]+)", text,
                                            re.M).group(1).split()]
        total += counts[0]
        if dump.endswith("-01"):
            main, main_dump = counts[0], dump
            names = re.search(r"^events: (.*)$", text, re.M).group(1).split()
            misses = {k: v / done for k, v in zip(names, counts)
                      if k in ("D1mr", "D1mw", "DLmr", "DLmw", "I1mr")}
    return total / done, main / done, main_dump, misses, sampled


def self_costs(dump):
    """Instructions spent in each function itself (not its callees)."""
    names, cost, fn, callee_line = {}, collections.Counter(), None, False
    with open(dump) as f:
        for line in f:
            if line.startswith(("fn=", "cfn=")):
                m = re.match(r"c?fn=\((\d+)\)(?: (.*))?", line.strip())
                if m and m.group(2):
                    names[m.group(1)] = m.group(2)
                if m and line.startswith("fn="):
                    fn = names.get(m.group(1))
            elif line.startswith("calls="):
                callee_line = True   # the next cost line is the callee's
            elif line[:1].isdigit() or line[:1] in "+-*":
                if callee_line:
                    callee_line = False
                elif fn:
                    parts = line.split()
                    if len(parts) >= 2:
                        cost[fn] += int(parts[1])
    return cost


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("configs", nargs="*",
                    default=["bare", "gqp-0pct", "gqp-5pct", "gqp-100pct"])
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--requests", type=int, default=1600)
    ap.add_argument("--warmup", type=int, default=480,
                    help="requests before the counters are zeroed")
    ap.add_argument("--top", type=int, default=0,
                    help="list the N functions that grew most against the "
                         "first configuration")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--cache-sim", action="store_true",
                    help="also simulate the caches: L1 data (D1mr/D1mw), "
                         "instruction (I1mr) and last-level (DLmr/DLmw) "
                         "misses per request of the main thread")
    ap.add_argument("--keep", metavar="DIR",
                    help="keep the callgrind dumps in DIR (for "
                         "callgrind_annotate --inclusive=yes)")
    ap.add_argument("--app", choices=sorted(APP_PATHS), default="hello",
                    help="the route put under load: hello (default) or api "
                         "(issue 16's light app: a child greenlet, a 1 ms "
                         "sleep, a JSON body)")
    args = ap.parse_args()
    global URL
    URL = APP_PATHS[args.app]
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            print("skipped: %s is not installed" % tool)
            return 0
    if args.connections < 1 or args.requests < args.connections:
        ap.error("need --requests >= --connections >= 1")
    rows, dumps, base, cache_rows = [], [], None, []
    with tempfile.TemporaryDirectory() as tmp:
        for cfg in args.configs:
            per, main_per, dump, misses, sampled = measure(
                cfg, args.requests, args.connections, args.warmup,
                args.keep or tmp, args.cache_sim)
            if misses:
                bu.log("%-24s main thread per request: %s" % (cfg, ", ".join(
                    "%s %.0f" % kv for kv in sorted(misses.items()))))
                cache_rows.append([cfg] + ["%.0f" % misses.get(k, 0)
                                           for k in CACHE_EVENTS])
            base = (per, main_per) if base is None else base
            bu.log("%-24s %10.0f instructions/request (main thread %.0f)"
                   % (cfg, per, main_per))
            # (what one sampled request adds, if the added instructions
            # were all the samples': how a low pct's samples compare with
            # pct=1.0's, whose neighbours are samples too)
            per_sample = ("%+.0f" % ((main_per - base[1]) / sampled
                                     * _done(args.requests, args.connections))
                          if sampled else "")
            rows.append([cfg, "%.0f" % per, "%+.0f" % (per - base[0]),
                         "%.0f" % main_per,
                         "%+.0f" % (main_per - base[1]),
                         "" if sampled is None else str(sampled),
                         per_sample])
            dumps.append((cfg, dump, args.requests))
        table = bu.md_table if args.markdown else bu.text_table
        print(table(["configuration", "instructions per request",
                     "added to %s" % args.configs[0], "main thread",
                     "added (main thread)", "sampled",
                     "added per sampled request (main thread)"], rows))
        if cache_rows:
            print("\ncache misses per request, main thread (callgrind's "
                  "simulated caches)")
            print(table(["configuration"] + list(CACHE_EVENTS), cache_rows))
        if args.top and len(dumps) > 1:
            first = self_costs(dumps[0][1])
            for cfg, dump, n in dumps[1:]:
                grew = self_costs(dump)
                diff = sorted(((grew[k] - first[k]) / n, k)
                              for k in set(first) | set(grew))
                print("\n%s: functions whose own instructions per request "
                      "grew most against %s (main thread)"
                      % (cfg, args.configs[0]))
                print(table(["function", "added per request"],
                            [[k[:70], "%+.0f" % d]
                             for d, k in diff[::-1][:args.top]]))
    print("\n`python bench/server_instructions.py %s%s --connections %d "
          "--requests %d%s%s`" % (
              " ".join(args.configs),
              " --app %s" % args.app if args.app != "hello" else "",
              args.connections, args.requests,
              (" --top %d" % args.top if args.top else "") +
              (" --cache-sim" if args.cache_sim else ""),
              " --markdown" if args.markdown else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
