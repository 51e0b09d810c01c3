"""Throughput overhead of request profiling under real HTTP load.

For each configuration a fresh server process (bench/_load_server.py:
examples/wsgi_app.py's app plus a cheap /hello route, on gevent.pywsgi,
127.0.0.1, ephemeral port, no access log) is started, warmed up, loaded
with ``wrk -t1 -c16 -d<duration>s`` and stopped.

By default each configuration runs side by side with a fresh bare-app
server, both pinned to the same CPU and each loaded by its own wrk: the
kernel shares that CPU evenly between the two, so the ratio of their
requests/s is the ratio of their costs per request, measured in the same
seconds.  The result of a configuration is the median of that ratio over
the rounds; the bare row is two bare apps side by side (the noise floor).
On this shared machine, runs of one bare server one after the other vary
by up to +-20 %, two side by side by about 2 %.  --sequential runs every
server alone instead and compares medians (the method of earlier tables).

    python bench/load_overhead.py                 # 5 rounds x 5 s, ~4 min
    python bench/load_overhead.py --markdown      # table for bench/README.md
    python bench/load_overhead.py --gunicorn      # + gunicorn rows, ~5 min
    python bench/load_overhead.py --micro         # + in-process ns/request
    python bench/load_overhead.py --quick         # smoke run (test suite)
    python bench/load_overhead.py --ab A B        # B against A, side by side
    python bench/load_overhead.py --app api --only gqp-5pct-logged,\
        gqp-100pct-logged,gqp-5pct,gqp-100pct --markdown
                                                  # issue 16's table: GET /api
                                                  # (child, 1 ms sleep, JSON),
                                                  # reports logged to a file

--ab compares two configurations with the same side-by-side method, each
``[CHECKOUT:]CONFIG``: a _load_server config key (or ``gqp{JSON}``),
optionally served from another checkout of greqprof (a git worktree, built
in place), e.g. ``--ab /tmp/old:gqp-5pct gqp-5pct`` measures a change.

Progress goes to stderr, results to stdout.  A configuration whose package
(werkzeug, yappi, gunicorn) or tool (wrk) is missing is reported as skipped
and the script still exits 0 (1 only with --strict and a missed target).
"""
import json
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import _benchutil as bu  # noqa: E402

SERVER = os.path.join(HERE, "_load_server.py")
URL_PATH = "/hello?name=bench"
#: --app -> the route wrk loads (URL_PATH is set from it in main)
APP_PATHS = {"hello": "/hello?name=bench", "api": "/api?page=2"}

#: greqprof rows that sample no request (pct=0): any sample is an error
NO_SAMPLING = {"gqp-0pct", "gqp-0pct-nostack", "gqp-0pct-noroutes",
               "gqp-0pct-noblocking", "gqp-disabled"}
#: greqprof targets: minimum median req/s ratio to the bare app
TARGETS = {"gqp-5pct": 0.99, "gqp-100pct": 0.97,
           "gunicorn:gqp-5pct": 0.99,
           # issue 16: with each sampled report logged; issue 20: pct=0 at
           # gevent's monitor cost, calls=True paid for by its own requests,
           # pct=1.0 (a development setting) not worse than it was
           "gqp-0pct": 0.985, "gqp-5pct-logged": 0.97,
           "gqp-5pct-calls-logged": 0.85, "gqp-100pct-logged": 0.75}


class Cfg:
    def __init__(self, key, label, server="pywsgi", needs=None, base="bare",
                 root=None):
        self.key = key            # unique id (JSON, --only)
        self.root = root          # checkout it is served from (None: this)
        self.label = label
        self.server = server      # "pywsgi" or "gunicorn"
        self.app_config = key.split(":", 1)[-1]   # _load_server CONFIGS key
        self.needs = needs        # importable module required, or None
        self.base = base          # key of the bare row it is compared with


CONFIGS = [
    Cfg("bare", "bare app"),
    Cfg("passthrough", "reference: a WSGI middleware that only calls the "
        "app"),
    Cfg("settrace-noop", "reference: greenlet.settrace with a C no-op "
        "callback"),
    Cfg("gevent-monitor", "reference: gevent's monitor thread "
        "(monitor_thread=True, max_blocking_time=0.1), no profiler"),
    Cfg("gqp-disabled", "reference: greqprof's kill switch "
        "(GREQPROF_ENABLED=0): imported, its C __call__ passing each "
        "request to the app"),
    Cfg("gqp-0pct-noblocking", "greqprof pct=0, stack_hz=0, "
        "blocking_ms=None: the C request path and the per-route counting, "
        "no switch hook"),
    Cfg("gqp-0pct", "greqprof pct=0: blocking detection only (the path "
        "of unsampled requests)"),
    Cfg("gqp-0pct-nostack", "greqprof pct=0, stack_hz=0: without the "
        "stack sampler (its cost: gqp-0pct against this)"),
    Cfg("gqp-0pct-noroutes", "greqprof pct=0, requests not counted by "
        "route (the per-route counting's cost: gqp-0pct against this)"),
    Cfg("gqp-5pct", "greqprof pct=0.05, spans only, report=False"),
    Cfg("gqp-100pct", "greqprof pct=1.0, spans only, report=False"),
    Cfg("gqp-5pct-logged", "greqprof pct=0.05, each report logged at INFO "
        "to a file"),
    Cfg("gqp-100pct-logged", "greqprof pct=1.0, each report logged at "
        "INFO to a file"),
    Cfg("bare-logged", "reference: no profiler, one access line per "
        "request logged at INFO to a file (logging's own floor)"),
    Cfg("gqp-5pct-calls-logged", "greqprof pct=0.05, calls=True, each "
        "report logged at INFO to a file"),
    Cfg("gqp-100pct-calls", "greqprof pct=1.0, calls=True"),
    Cfg("werkzeug", "werkzeug ProfilerMiddleware (cProfile)",
        needs="werkzeug"),
    Cfg("yappi", "yappi cpu, greenlet backend", needs="yappi"),
]
GUNICORN_CONFIGS = [
    Cfg("gunicorn:bare", "gunicorn -k gevent: bare app", server="gunicorn",
        needs="gunicorn", base="gunicorn:bare"),
    Cfg("gunicorn:gqp-5pct", "gunicorn -k gevent: greqprof pct=0.05",
        server="gunicorn", needs="gunicorn", base="gunicorn:bare"),
]


class Skip(Exception):
    pass


# ---------------------------------------------------------------------------
# servers

def _free_port():
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
    finally:
        s.close()


def _http_get(port, path, timeout=2.0):
    with urllib.request.urlopen("http://127.0.0.1:%d%s" % (port, path),
                                timeout=timeout) as r:
        return r.status, r.read()


def _pin(cpu):
    """preexec_fn pinning the child to one CPU (None: no pinning)."""
    if cpu is None:
        return None

    def pin():
        try:
            os.sched_setaffinity(0, {cpu})
        except (AttributeError, OSError):
            pass
    return pin


class Server:
    """One server process of one configuration."""

    def __init__(self, cfg, rows, cpu=None):
        self.cfg = cfg
        self.rows = rows
        self.cpu = cpu
        self.proc = None
        self.port = None
        self.conf = None
        self.errfile = tempfile.TemporaryFile(mode="w+")

    def _stderr_lines(self):
        try:
            self.errfile.seek(0)
            return self.errfile.read().splitlines()
        except (OSError, ValueError):
            return []

    def _stderr_tail(self, n=15):
        return "\n".join(self._stderr_lines()[-n:])

    def start(self, timeout=20.0):
        # Each row is exactly what its label says: no GREQPROF_* (or OTEL_*)
        # setting from the caller's environment leaks into the middleware.
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("GREQPROF_", "OTEL_"))}
        env["PYTHONUNBUFFERED"] = "1"
        if self.cfg.server == "pywsgi":
            root = self.cfg.root or ROOT
            if self.cfg.root:
                env["PYTHONPATH"] = os.pathsep.join(
                    [root] + [x for x in [env.get("PYTHONPATH")] if x])
            cmd = [sys.executable, os.path.join(root, "bench",
                                                "_load_server.py"),
                   "--config", self.cfg.app_config,
                   "--port", "0", "--rows", str(self.rows)]
            self.proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=self.errfile,
                stdin=subprocess.DEVNULL, env=env, cwd=root,
                preexec_fn=_pin(self.cpu))
            self.port = self._read_port(timeout)
        else:
            self.port = _free_port()
            # As docs/production.md says: greqprof imported in the master,
            # from the configuration file, before the gevent worker
            # monkey-patches (else its per-thread state lands in greenlet
            # locals).  Nothing else is configured there.
            self.conf = tempfile.NamedTemporaryFile(
                "w", suffix=".py", prefix="gunicorn_conf_", delete=False)
            self.conf.write("import greqprof  # noqa: F401\n")
            self.conf.close()
            cmd = [sys.executable, "-m", "gunicorn", "-c", self.conf.name,
                   "-k", "gevent",
                   "-w", "1", "-b", "127.0.0.1:%d" % self.port,
                   "--chdir", HERE, "--log-level", "warning",
                   "--graceful-timeout", "3",
                   "_load_server:build(%r, %d)" % (self.cfg.app_config,
                                                   self.rows)]
            self.proc = subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=self.errfile,
                stdin=subprocess.DEVNULL, env=env, cwd=ROOT,
                preexec_fn=_pin(self.cpu))
        self._wait_ready(timeout)

    def _read_port(self, timeout):
        port = bu.read_port(self.proc, timeout)
        if port is not None:
            return port
        self.stop()
        raise Skip("server did not start (exit %s): %s"
                   % (self.proc.returncode, self._stderr_tail()))

    def _wait_ready(self, timeout):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                status, _ = _http_get(self.port, URL_PATH, timeout=1.0)
                if status == 200:
                    return
                last = "HTTP %s" % status
            except Exception as exc:
                last = "%s: %s" % (type(exc).__name__, exc)
            time.sleep(0.05)
        self.stop()
        raise Skip("server not answering on port %s (%s; exit %s): %s"
                   % (self.port, last, self.proc.returncode,
                      self._stderr_tail()))

    def stats(self):
        try:
            _, body = _http_get(self.port, "/__stats")
            return json.loads(body)
        except Exception as exc:
            return {"error": "%s: %s" % (type(exc).__name__, exc)}

    def stop(self):
        p = self.proc
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)   # gunicorn: graceful, stops its worker
        try:
            p.wait(timeout=8)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    def close(self):
        self.stop()
        if self.conf is not None:
            try:
                os.unlink(self.conf.name)
            except OSError:
                pass
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        self.errfile.close()


def _system_cpu_ns():
    """(busy, steal) ns summed over all CPUs, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    tick = 1e9 / os.sysconf("SC_CLK_TCK")
    busy = v[0] + v[1] + v[2] + v[5] + v[6]   # user nice system irq softirq
    steal = v[7] if len(v) > 7 else 0
    return busy * tick, steal * tick


def _children_cpu_ns():
    import resource
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (ru.ru_utime + ru.ru_stime) * 1e9


def _proc_cpu_ns(pid):
    """CPU time (ns) of all threads of pid, from schedstat (stat fallback)."""
    total = 0
    try:
        tasks = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return None
    for tid in tasks:
        try:
            with open("/proc/%d/task/%s/schedstat" % (pid, tid)) as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            try:
                with open("/proc/%d/task/%s/stat" % (pid, tid)) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                tick = os.sysconf("SC_CLK_TCK")
                total += (int(fields[11]) + int(fields[12])) * 10**9 // tick
            except (OSError, ValueError, IndexError):
                pass
    return total


# ---------------------------------------------------------------------------
# wrk

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def _ms(text):
    m = re.match(r"([\d.]+)(us|ms|s|m)$", text)
    return float(m.group(1)) * _UNITS[m.group(2)] if m else None


def parse_wrk(out):
    r = {}
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if not m:
        raise Skip("could not parse wrk output:\n" + out[-800:])
    r["rps"] = float(m.group(1))
    m = re.search(r"(\d+) requests in ([\d.]+)(\w+),", out)
    if m:
        r["requests"] = int(m.group(1))
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), "
                  r"timeout (\d+)", out)
    r["socket_errors"] = sum(int(x) for x in m.groups()) if m else 0
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    r["non_2xx"] = int(m.group(1)) if m else 0
    for pct in ("50", "99"):
        m = re.search(r"^\s+%s%%\s+(\S+)" % pct, out, re.M)
        r["p%s_ms" % pct] = _ms(m.group(1)) if m else None
    return r


def wrk_cmd(port, duration, threads, connections, latency=True):
    cmd = ["wrk", "-t%d" % threads, "-c%d" % connections,
           "-d%ds" % duration]
    if latency:
        cmd.append("--latency")
    cmd.append("http://127.0.0.1:%d%s" % (port, URL_PATH))
    return cmd


def run_wrk(port, duration, threads, connections, cpu=None):
    cmd = wrk_cmd(port, duration, threads, connections)
    try:
        out = subprocess.run(cmd, capture_output=True, text=True,
                             timeout=duration + 30, preexec_fn=_pin(cpu))
    except subprocess.TimeoutExpired:
        raise Skip("wrk timed out")
    if out.returncode != 0:
        raise Skip("wrk failed (%d): %s" % (out.returncode,
                                            out.stderr.strip()[-400:]))
    return parse_wrk(out.stdout)


def wrk_version():
    try:
        out = subprocess.run(["wrk", "--version"], capture_output=True,
                             text=True, timeout=5)
        return (out.stdout + out.stderr).splitlines()[0].strip()
    except Exception:
        return None


# ---------------------------------------------------------------------------
# one measurement

def measure(cfg, args):
    srv = Server(cfg, args.rows, cpu=args.server_cpu)
    try:
        srv.start()
        if args.warmup > 0:
            run_wrk(srv.port, args.warmup, args.threads, args.connections,
                    cpu=args.wrk_cpu)
        else:   # a few requests so the first-request setup is not timed
            for _ in range(20):
                _http_get(srv.port, URL_PATH)
        before = srv.stats()
        pid = before.get("pid", srv.proc.pid)
        cpu0 = _proc_cpu_ns(pid)
        sys0, kids0 = _system_cpu_ns(), _children_cpu_ns()
        t0 = time.monotonic()
        res = run_wrk(srv.port, args.duration, args.threads, args.connections,
                      cpu=args.wrk_cpu)
        wall = time.monotonic() - t0
        cpu1 = _proc_cpu_ns(pid)
        sys1, kids1 = _system_cpu_ns(), _children_cpu_ns()
        after = srv.stats()
        if srv.proc.poll() is not None:
            raise Skip("server died during the run: " + srv._stderr_tail())
    finally:
        srv.stop()
        lines = srv._stderr_lines()
        srv.close()
    if cpu0 is not None and cpu1 is not None and res.get("requests"):
        res["server_cpu_us_per_req"] = (cpu1 - cpu0) / 1e3 / res["requests"]
        res["server_cpu_util"] = (cpu1 - cpu0) / 1e9 / wall
        res["wrk_cpu_util"] = (kids1 - kids0) / 1e9 / wall
        if sys0 is not None and sys1 is not None:
            # CPU the rest of the machine used meanwhile (other processes,
            # and kernel time charged to nobody), in CPUs; steal: CPU the
            # hypervisor gave to other guests
            res["other_cpu"] = ((sys1[0] - sys0[0]) - (cpu1 - cpu0)
                                - (kids1 - kids0)) / 1e9 / wall
            res["steal_cpu"] = (sys1[1] - sys0[1]) / 1e9 / wall
    _add_server_report(res, before, after, lines)
    return res


def _add_server_report(res, before, after, lines):
    """What the server said about the timed run: the middleware's and the
    app's counters (/__stats before and after), and its stderr."""
    mw0, mw1 = before.get("middleware"), after.get("middleware")
    if mw0 and mw1:
        res["middleware"] = {k: mw1[k] - mw0.get(k, 0) for k in mw1}
    if "monitor" in after:
        res["monitor"] = after["monitor"]
    if before.get("app") and after.get("app"):
        res["app_requests"] = after["app"]["hello"] - before["app"]["hello"]
    tail = "\n".join(lines[-40:])
    if "Traceback" in tail:
        res["server_traceback"] = tail
    gq = [ln for ln in lines if ln.startswith("greqprof:")]
    if gq:
        res["server_greqprof_errors"] = gq[:5]
    res["server_stderr_lines"] = len(lines)


def measure_pair(cfg, base, args):
    """cfg and its bare app, run at the same time: both servers on the same
    CPU, each under its own wrk (both wrk on the other CPU).  The kernel
    splits the server CPU evenly between the two, so the ratio of their
    requests/s is the ratio of their per-request costs, and whatever the
    rest of the machine does in that window hits both alike (sequential
    runs of the same bare app differ by up to +-20 % here; two bare apps
    side by side by about 2 %)."""
    srvs = [Server(cfg, args.rows, cpu=args.server_cpu),
            Server(base, args.rows, cpu=args.server_cpu)]
    try:
        for s in srvs:
            s.start()
        for s in srvs:
            if args.warmup > 0:
                run_wrk(s.port, args.warmup, args.threads, args.connections,
                        cpu=args.wrk_cpu)
            else:
                for _ in range(20):
                    _http_get(s.port, URL_PATH)
        before = [s.stats() for s in srvs]
        pids = [b.get("pid", s.proc.pid) for b, s in zip(before, srvs)]
        cpu0 = [_proc_cpu_ns(pid) for pid in pids]
        sys0, kids0 = _system_cpu_ns(), _children_cpu_ns()
        t0 = time.monotonic()
        procs = [subprocess.Popen(
            wrk_cmd(s.port, args.duration, args.threads, args.connections),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=_pin(args.wrk_cpu)) for s in srvs]
        outs = []
        for pr in procs:
            try:
                out, err = pr.communicate(timeout=args.duration + 30)
            except subprocess.TimeoutExpired:
                pr.kill()
                raise Skip("wrk timed out")
            if pr.returncode != 0:
                raise Skip("wrk failed (%d): %s" % (pr.returncode,
                                                    err.strip()[-400:]))
            outs.append(parse_wrk(out))
        wall = time.monotonic() - t0
        cpu1 = [_proc_cpu_ns(pid) for pid in pids]
        sys1, kids1 = _system_cpu_ns(), _children_cpu_ns()
        after = [s.stats() for s in srvs]
        for s in srvs:
            if s.proc.poll() is not None:
                raise Skip("server died during the run: " + s._stderr_tail())
    finally:
        lines = []
        for s in srvs:
            s.stop()
            lines.append(s._stderr_lines())
            s.close()
    res, bres = outs
    for r, c0, c1 in ((res, cpu0[0], cpu1[0]), (bres, cpu0[1], cpu1[1])):
        if c0 is not None and c1 is not None and r.get("requests"):
            r["server_cpu_us_per_req"] = (c1 - c0) / 1e3 / r["requests"]
            r["server_cpu_util"] = (c1 - c0) / 1e9 / wall
    res["base_rps"] = bres["rps"]
    res["pair_ratio"] = res["rps"] / bres["rps"] if bres["rps"] else None
    if "server_cpu_us_per_req" in bres:
        res["base_cpu_us_per_req"] = bres["server_cpu_us_per_req"]
    res["wrk_cpu_util"] = (kids1 - kids0) / 1e9 / wall
    if sys0 is not None and sys1 is not None and None not in cpu0 + cpu1:
        res["other_cpu"] = ((sys1[0] - sys0[0]) - sum(cpu1) + sum(cpu0)
                            - (kids1 - kids0)) / 1e9 / wall
        res["steal_cpu"] = (sys1[1] - sys0[1]) / 1e9 / wall
    _add_server_report(res, before[0], after[0], lines[0])
    return res


# ---------------------------------------------------------------------------
# reporting

def median(xs):
    return statistics.median(xs) if xs else None


def summarize(results, configs):
    """Adds medians, ratios and verdicts to results[key]."""
    for cfg in configs:
        r = results[cfg.key]
        runs = r["runs"]
        if r["status"] != "ok" or not runs:
            continue
        rps = [x["rps"] for x in runs]
        r["median_rps"] = median(rps)
        r["min_rps"], r["max_rps"] = min(rps), max(rps)
        r["p50_ms"] = median([x["p50_ms"] for x in runs
                              if x.get("p50_ms") is not None])
        r["p99_ms"] = median([x["p99_ms"] for x in runs
                              if x.get("p99_ms") is not None])
        cpu = [x["server_cpu_us_per_req"] for x in runs
               if "server_cpu_us_per_req" in x]
        r["server_cpu_us_per_req"] = median(cpu)
        util = [x["server_cpu_util"] for x in runs if "server_cpu_util" in x]
        r["server_cpu_util"] = median(util)
        for k in ("wrk_cpu_util", "other_cpu", "steal_cpu"):
            r[k] = median([x[k] for x in runs if k in x])
        mws = [x["middleware"] for x in runs if "middleware" in x]
        if mws:
            r["middleware"] = {k: sum(m.get(k, 0) for m in mws)
                               for k in mws[0]}
        r["errors"] = sum(x.get("socket_errors", 0) + x.get("non_2xx", 0)
                          for x in runs)
        r["tracebacks"] = sum(1 for x in runs if "server_traceback" in x)
    for cfg in configs:
        r = results[cfg.key]
        base = results.get(cfg.base)
        if r.get("median_rps") is None or not base or \
                base.get("median_rps") is None:
            continue
        if all(x.get("pair_ratio") for x in r["runs"]):
            # side by side with a bare app on the same CPU (measure_pair)
            paired = [x["pair_ratio"] for x in r["runs"]]
            r["ratio"] = median(paired)
        else:
            r["ratio"] = r["median_rps"] / base["median_rps"]
            # per round: this config / the bare run of the same round
            paired = [a["rps"] / b["rps"] for a, b in
                      zip(r["runs"], base["runs"])]
        r["paired_ratios"] = paired
        r["paired_median"] = median(paired)
        r["paired_min"], r["paired_max"] = min(paired), max(paired)
        added = [x["server_cpu_us_per_req"] - x["base_cpu_us_per_req"]
                 for x in r["runs"] if "base_cpu_us_per_req" in x
                 and "server_cpu_us_per_req" in x]
        if added:
            r["added_cpu_us_per_req"] = median(added)
        elif base["server_cpu_us_per_req"] is not None and \
                r["server_cpu_us_per_req"] is not None:
            r["added_cpu_us_per_req"] = (r["server_cpu_us_per_req"]
                                         - base["server_cpu_us_per_req"])
        target = TARGETS.get(cfg.key)
        mw = r.get("middleware")
        samples = cfg.key not in NO_SAMPLING
        if mw is not None and (mw.get("errors")
                               or (samples and not mw.get("sampled"))
                               or (not samples and mw.get("sampled"))):
            # greqprof failed on (some) requests, or did not sample as
            # configured: the row does not measure what its label says
            r["invalid"] = ("greqprof internal errors on %d of %d requests, "
                            "%d sampled" % (mw.get("errors", 0),
                                            mw.get("requests", 0),
                                            mw.get("sampled", 0)))
        if cfg.app_config == "gevent-monitor" and not all(
                x.get("monitor") for x in r["runs"] if "monitor" in x):
            r["invalid"] = "gevent's monitor thread did not run"
        if target is not None:
            r["target"] = target
            if r.get("invalid"):
                r["verdict"] = "INVALID"
            else:
                r["verdict"] = "met" if r["ratio"] >= target else "MISSED"


# ---------------------------------------------------------------------------
# in-process microbenchmark (diagnosis)

#: (app, requests per repetition; sampled cases make a tenth of that)
MICRO_APPS = [("noop", 20000), ("spawn", 5000), ("hello", 2000)]
MICRO_REPS = 3       # repetitions per process
MICRO_PASSES = 3     # processes per case, interleaved with the other cases
MICRO_CASES = ["bare", "hooks", "unsampled-noblock", "unsampled",
               "sampled-linger0", "sampled", "sampled-calls"]
MICRO_LABELS = {
    "bare": "no middleware",
    "hooks": "no middleware, greqprof C hooks installed",
    "unsampled-noblock": "pct=0, blocking_ms=None",
    "unsampled": "unsampled request (pct=0, blocking detection on)",
    "sampled-linger0": "sampled request, linger=0",
    "sampled": "sampled request (default linger=1.0)",
    "sampled-calls": "sampled request, calls=True",
}


def run_micro(quick):
    """{app: {case: [ns per request, every repetition]}}.  Each case runs
    in a fresh process (no hook state carries over), MICRO_PASSES times,
    the passes interleaved with the other cases so that a slow spell of
    the machine does not land on one case only."""
    passes, reps = (1, 1) if quick else (MICRO_PASSES, MICRO_REPS)
    out = {"reps": passes * reps}
    for app, _n in MICRO_APPS:
        out[app] = {case: [] for case in MICRO_CASES}
    for pas in range(passes):
        for app, n in MICRO_APPS:
            for case in MICRO_CASES:
                if out[app][case] is None:
                    continue
                k = n if not case.startswith("sampled") else max(n // 10, 200)
                if quick:
                    k = 200
                cmd = [sys.executable, SERVER, "--micro", case,
                       "--micro-app", app, "--micro-n", str(k),
                       "--micro-reps", str(reps)]
                try:
                    p = subprocess.run(cmd, capture_output=True, text=True,
                                       timeout=300, cwd=ROOT)
                    m = re.search(r"^MICRO (.*)$", p.stdout, re.M)
                    if not m:
                        raise RuntimeError((p.stderr or p.stdout)[-300:])
                    out[app][case].extend(json.loads(m.group(1))["ns"])
                except Exception as exc:
                    bu.log("  micro %s %s failed: %s" % (app, case, exc))
                    out[app][case] = None
        bu.log("  micro pass %d/%d done" % (pas + 1, passes))
    return out


def micro_rows(micro):
    """Best (lowest) of the repetitions: CPU time only grows with noise."""
    rows = []
    for case in MICRO_CASES:
        row = [MICRO_LABELS[case]]
        for app, _n in MICRO_APPS:
            ns = micro[app].get(case)
            base = micro[app].get("bare")
            if not ns:
                row += ["failed", ""]
                continue
            m = min(ns)
            row.append("%.0f" % m)
            row.append("" if case == "bare" or not base
                       else "%+.0f" % (m - min(base)))
        rows.append(row)
    return rows


def micro_headers(micro):
    return ["in-process, CPU ns per request (best of %d)" % micro["reps"],
            "noop app", "+ vs bare", "spawn+join app", "+ vs bare",
            "/hello handler", "+ vs bare"]


def _f(x, spec):
    return "—" if x is None else spec % x


def table_rows(results, configs, quick):
    rows = []
    for cfg in configs:
        r = results[cfg.key]
        if r["status"] != "ok":
            rows.append([cfg.label, "skipped: " + r["reason"].splitlines()[0]
                         if r["reason"] else "skipped"] + [""] * 7)
            continue
        mw = r.get("middleware")
        sampled = ("%d / %d" % (mw["sampled"], mw["requests"])
                   if mw else "—")
        if mw and (mw.get("errors") or mw.get("blocking")):
            sampled += " (errors %d, blocking %d)" % (mw["errors"],
                                                     mw["blocking"])
        if cfg.key in TARGETS:
            tgt = "≥ %g" % TARGETS[cfg.key]
            if quick:
                tgt += " (not judged: --quick)"
            else:
                tgt += ": " + r.get("verdict", "—")
        else:
            tgt = ""
        if "paired_median" not in r:
            paired = "—"
        elif all(x.get("pair_ratio") for x in r["runs"]):
            paired = "%.3f–%.3f" % (r["paired_min"], r["paired_max"])
        else:
            paired = "%.3f (%.3f–%.3f)" % (
                r["paired_median"], r["paired_min"], r["paired_max"])
        rows.append([
            cfg.label,
            "%.0f (%.0f–%.0f)" % (r["median_rps"], r["min_rps"],
                                  r["max_rps"]),
            _f(r.get("ratio"), "%.3f"),
            paired,
            "%s / %s" % (_f(r["p50_ms"], "%.1f"), _f(r["p99_ms"], "%.1f")),
            _f(r["server_cpu_us_per_req"], "%.0f") +
            (" (%+.0f)" % r["added_cpu_us_per_req"]
             if r.get("added_cpu_us_per_req") is not None
             and cfg.key != cfg.base else ""),
            _f(r["server_cpu_util"], "%.2f"),
            sampled,
            tgt,
        ])
    return rows


#: the default (measure_pair): each row ran side by side with a bare app
HEADERS_PAIR = ["configuration", "req/s median (min–max), sharing a CPU "
                "with a bare app", "× bare (median)", "× bare (min–max)",
                "latency p50 / p99 ms"]
HEADERS = ["configuration", "req/s median (min–max)", "× bare",
           "paired × bare (min–max)", "latency p50 / p99 ms",
           "server CPU µs/req (+ vs bare)", "server CPU util",
           "sampled / requests", "target"]


def header_lines(info, args, command):
    v = info["versions"]
    return [
        "date: %s" % info["date"],
        "machine: %s, nproc=%s, clocksource=%s" % (
            info["cpu_model"], info["nproc"], info["clocksource"]),
        "python: %s (%s)" % (info["python"], info["platform"]),
        "packages: " + ", ".join(
            "%s %s" % (k, v.get(k) or "absent") for k in
            ("greqprof", "gevent", "greenlet", "werkzeug", "yappi",
             "gunicorn")),
        "greqprof checkout: %s; wrk: %s" % (info.get("git") or "unknown",
                                            info.get("wrk") or "absent"),
        "load: wrk -t%d -c%d -d%ds (+%gs warm-up per server), %d round(s), "
        "order rotated per round, %s; %s" % (
            args.threads, args.connections, args.duration, args.warmup,
            args.rounds,
            "every server alone (--sequential)" if args.sequential else
            "every configuration side by side with a bare app on the same "
            "CPU (the bare row: two bare apps)",
            "server pinned to CPU %d, wrk to CPU %d" % (args.server_cpu,
                                                        args.wrk_cpu)
            if args.server_cpu is not None else "no CPU pinning"),
        ("endpoint: GET %s, %d rows: bare app %.0f µs CPU/request "
         "in-process (no server)" % (URL_PATH, args.rows,
                                     info.get("app_us") or 0))
        if args.app == "hello" else
        "endpoint: GET %s (a child greenlet, a 1 ms gevent.sleep, a JSON "
        "body)" % URL_PATH,
        "loadavg before: %s, after: %s; rest of the machine during the "
        "measurements (CPUs busy outside the server and wrk): median %s, "
        "max %s; steal median %s" % (
            info.get("loadavg_before"), info.get("loadavg_after"),
            _f(info.get("other_cpu_median"), "%.2f"),
            _f(info.get("other_cpu_max"), "%.2f"),
            _f(info.get("steal_cpu_median"), "%.2f")),
        "command: %s" % command,
    ]


def _git_commit():
    """The checkout that was measured: `git describe --always --dirty`."""
    try:
        out = subprocess.run(["git", "-C", ROOT, "describe", "--always",
                              "--dirty"], capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or None
    except Exception:
        return None


def _loadavg():
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return None


def _importable(mod):
    import importlib.util
    try:
        return importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):
        return False


def _app_us(rows):
    try:
        out = subprocess.run([sys.executable, SERVER, "--measure-app",
                              "--rows", str(rows)], capture_output=True,
                             text=True, timeout=120, cwd=ROOT)
        m = re.search(r"APP_US ([\d.]+)", out.stdout)
        return float(m.group(1)) if m else None
    except Exception:
        return None


def _ab_cfg(spec):
    """A Cfg from ``[CHECKOUT:]CONFIG`` (--ab)."""
    root, sep, rest = spec.partition(":")
    if sep and os.path.isdir(root):
        if not os.path.isfile(os.path.join(root, "bench", "_load_server.py")):
            raise SystemExit("%s is not a greqprof checkout" % root)
        cfg = Cfg(spec, spec, root=os.path.abspath(root))
        cfg.app_config = rest
        return cfg
    cfg = Cfg(spec, spec)
    cfg.app_config = spec
    return cfg


def run_ab(specs, args):
    """--ab A B: B side by side with A, args.rounds times; prints every
    round and the medians (B/A req/s, B-A server CPU per request)."""
    a, b = _ab_cfg(specs[0]), _ab_cfg(specs[1])
    ratios, deltas = [], []
    for rnd in range(args.rounds):
        try:
            r = measure_pair(b, a, args)
        except Skip as e:
            bu.log("round %d skipped: %s" % (rnd + 1, e))
            continue
        ratios.append(r["pair_ratio"])
        d = None
        if "server_cpu_us_per_req" in r and "base_cpu_us_per_req" in r:
            d = r["server_cpu_us_per_req"] - r["base_cpu_us_per_req"]
            deltas.append(d)
        print("round %d: B/A req/s %.3f%s" % (
            rnd + 1, r["pair_ratio"],
            "" if d is None else ", B-A %+.1f us/req of server CPU "
            "(A %.0f)" % (d, r["base_cpu_us_per_req"])), flush=True)
    if not ratios:
        return 1
    print("A = %s\nB = %s\nmedian B/A req/s %.3f (%.3f-%.3f)%s" % (
        specs[0], specs[1], median(ratios), min(ratios), max(ratios),
        ", B-A %+.1f us/req" % median(deltas) if deltas else ""))
    return 0


def main():
    p = bu.argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=bu.argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=int, default=5,
                   help="seconds of wrk load per measurement (default 5)")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds; each runs every configuration once, in "
                        "rotated order (default 5)")
    p.add_argument("--warmup", type=float, default=None,
                   help="seconds of untimed wrk load on each fresh server "
                        "before the measurement (default 1; 0 with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 round of 1 s, no warm-up; numbers "
                        "mean nothing, targets are not judged")
    p.add_argument("--gunicorn", action="store_true",
                   help="also run bare and pct=0.05 under gunicorn -k "
                        "gevent -w 1")
    p.add_argument("--only", metavar="KEYS",
                   help="comma-separated config keys (the bare rows always "
                        "run); see --list")
    p.add_argument("--list", action="store_true",
                   help="list the configuration keys and exit")
    p.add_argument("--connections", type=int, default=16,
                   help="wrk -c (default 16)")
    p.add_argument("--threads", type=int, default=1,
                   help="wrk -t (default 1)")
    p.add_argument("--rows", type=int, default=24,
                   help="rows rendered by /hello (its cost; default 24)")
    p.add_argument("--app", choices=sorted(APP_PATHS), default="hello",
                   help="the route put under load: hello (default: ~150 us "
                        "of app CPU) or api (issue 16's light app: a child "
                        "greenlet, a 1 ms sleep, a JSON body)")
    p.add_argument("--no-pin", action="store_true",
                   help="do not pin the server to the last CPU and wrk to "
                        "the first (pinning is on when there are >= 2 CPUs)")
    p.add_argument("--json", metavar="PATH",
                   help="also write every run's numbers to PATH")
    p.add_argument("--markdown", action="store_true",
                   help="print a Markdown section (machine, command, table)")
    p.add_argument("--micro", action="store_true",
                   help="also run an in-process microbenchmark of "
                        "ProfilingMiddleware.__call__ on dummy apps (CPU ns "
                        "per request, unsampled and sampled paths)")
    p.add_argument("--micro-only", action="store_true",
                   help="run only the microbenchmark (no server, no wrk)")
    p.add_argument("--sequential", action="store_true",
                   help="run every server alone, one after the other, and "
                        "compare medians (the default runs each "
                        "configuration side by side with a bare app on the "
                        "same CPU: see measure_pair)")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 when a greqprof row misses its target")
    p.add_argument("--ab", nargs=2, metavar=("A", "B"),
                   help="measure B side by side with A only, each "
                        "[CHECKOUT:]CONFIG (see above)")
    args = p.parse_args()
    global URL_PATH
    URL_PATH = APP_PATHS[args.app]
    command = " ".join(shlex.quote(a) for a in
                       [os.path.relpath(sys.executable, ROOT)
                        if sys.executable.startswith(ROOT) else
                        sys.executable,
                        os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)]
                       + sys.argv[1:])
    if args.quick:
        args.rounds, args.duration = 1, 1
    if args.warmup is None:
        args.warmup = 0 if args.quick else 1
    args.server_cpu = args.wrk_cpu = None
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:
        cpus = []
    if not args.no_pin and len(cpus) >= 2:
        args.wrk_cpu, args.server_cpu = cpus[0], cpus[-1]

    if args.ab:
        if wrk_version() is None:
            raise SystemExit("--ab needs wrk on PATH")
        return run_ab(args.ab, args)
    configs = CONFIGS + (GUNICORN_CONFIGS if args.gunicorn else [])
    if args.list:
        for c in CONFIGS + GUNICORN_CONFIGS:
            print("%-20s %s" % (c.key, c.label))
        return 0
    if args.only:
        wanted = {k.strip() for k in args.only.split(",") if k.strip()}
        known = {c.key for c in configs}
        if wanted - known:
            raise SystemExit("unknown config key(s): %s (known: %s)"
                             % (", ".join(sorted(wanted - known)),
                                ", ".join(sorted(known))))
        configs = [c for c in configs
                   if c.key in wanted or c.key == c.base]

    info = bu.machine_info()
    for mod in ("werkzeug", "gunicorn"):
        info["versions"][mod] = bu._version(mod)
    info["wrk"] = wrk_version()
    info["git"] = _git_commit()
    info["loadavg_before"] = _loadavg()
    bu.log("measuring the app's own cost ...")
    info["app_us"] = _app_us(args.rows)
    for line in header_lines(info, args, command)[:-2]:
        bu.log(line)

    if args.micro_only:
        args.rounds = 0
        configs = []
    results = {}
    live = []
    for cfg in configs:
        reason = None
        if info["wrk"] is None:
            reason = "wrk not found on PATH"
        elif cfg.needs and not _importable(cfg.needs):
            reason = "%s not installed" % cfg.needs
        results[cfg.key] = {"label": cfg.label, "server": cfg.server,
                            "status": "skipped" if reason else "ok",
                            "reason": reason or "", "runs": []}
        if reason:
            bu.log("SKIPPED %s: %s" % (cfg.key, reason))
        else:
            live.append(cfg)

    by_key = {c.key: c for c in configs}
    for rnd in range(args.rounds):
        k = rnd % len(live) if live else 0
        order = live[k:] + live[:k]
        for cfg in order:
            r = results[cfg.key]
            if r["status"] != "ok":
                continue
            try:
                if args.sequential:
                    run = measure(cfg, args)
                else:
                    run = measure_pair(cfg, by_key[cfg.base], args)
            except Exception as exc:   # Skip, or e.g. the server hung up
                reason = str(exc) if isinstance(exc, Skip) else "%s: %s" % (
                    type(exc).__name__, exc)
                r["status"], r["reason"] = "skipped", reason
                bu.log("  SKIPPED %s: %s" % (cfg.key, reason))
                continue
            run["round"] = rnd
            run["position"] = order.index(cfg)
            r["runs"].append(run)
            bu.log("  round %d/%d %-20s %8.0f req/s  server %s µs/req, "
                   "util %s; wrk %s; rest of machine %s CPU"
                   % (rnd + 1, args.rounds, cfg.key, run["rps"],
                      _f(run.get("server_cpu_us_per_req"), "%.0f"),
                      _f(run.get("server_cpu_util"), "%.2f"),
                      _f(run.get("wrk_cpu_util"), "%.2f"),
                      _f(run.get("other_cpu"), "%.2f")))
    # a bare row that failed makes its comparisons meaningless
    for cfg in configs:
        base = results[cfg.base]
        if results[cfg.key]["status"] == "ok" and base["status"] != "ok":
            results[cfg.key]["status"] = "skipped"
            results[cfg.key]["reason"] = "its bare row was skipped"
        # drop runs of a config skipped half-way so pairs stay aligned
    for cfg in configs:
        r = results[cfg.key]
        if r["status"] == "ok" and len(r["runs"]) != len(
                results[cfg.base]["runs"]):
            r["status"], r["reason"] = "skipped", "incomplete runs"
    micro = None
    if args.micro or args.micro_only:
        bu.log("in-process microbenchmark ...")
        micro = run_micro(args.quick)
    info["loadavg_after"] = _loadavg()
    summarize(results, configs)
    allruns = [x for c in configs for x in results[c.key]["runs"]]
    other = [x["other_cpu"] for x in allruns if "other_cpu" in x]
    steal = [x["steal_cpu"] for x in allruns if "steal_cpu" in x]
    info["other_cpu_median"] = median(other)
    info["other_cpu_max"] = max(other) if other else None
    info["steal_cpu_median"] = median(steal)

    rows = table_rows(results, configs, args.quick)
    headers = HEADERS if args.sequential else HEADERS_PAIR + HEADERS[5:]
    notes = []
    for cfg in configs:
        r = results[cfg.key]
        if r["status"] == "ok" and (r["errors"] or r["tracebacks"]):
            notes.append("%s: %d wrk socket errors / non-2xx responses, %d "
                         "server tracebacks" % (cfg.key, r["errors"],
                                                r["tracebacks"]))
    for cfg in configs:
        if results[cfg.key].get("invalid"):
            notes.append("%s: INVALID: %s (see the stderr of the server)"
                         % (cfg.key, results[cfg.key]["invalid"]))
    missed = [c.key for c in configs
              if results[c.key].get("verdict") in ("MISSED", "INVALID")]
    if info.get("other_cpu_median") is not None and \
            info["other_cpu_median"] > 0.1:
        notes.append("WARNING: the machine was not quiet: other work used "
                     "%.2f CPUs (median, max %.2f) while wrk ran; the "
                     "numbers are not worth publishing, rerun on an idle "
                     "machine" % (info["other_cpu_median"],
                                  info["other_cpu_max"]))
    if args.quick:
        notes.append("--quick: 1 round of 1 s; the numbers mean nothing and "
                     "targets are not judged")
    elif missed:
        notes.append("target not met: " + ", ".join(
            "%s (%s: %.3f, target ≥ %g)" % (
                k, results[k]["verdict"], results[k]["ratio"],
                results[k]["target"]) for k in missed))

    if args.markdown:
        print("### Load overhead (`load_overhead.py`)\n")
        for line in header_lines(info, args, command):
            if line.startswith("command: "):
                line = "command: `%s`" % line[len("command: "):]
            print("* " + line)
        if configs:
            print()
            print(bu.md_table(headers, rows))
        if notes:
            print()
            for n in notes:
                print("* " + n)
        if micro:
            print()
            print(bu.md_table(micro_headers(micro), micro_rows(micro)))
    else:
        for line in header_lines(info, args, command):
            print(line)
        if configs:
            print()
            print(bu.text_table(headers, rows))
        for n in notes:
            print(n)
        if micro:
            print()
            print(bu.text_table(micro_headers(micro), micro_rows(micro)))

    if args.json:
        bu.write_json(args.json, {
            "benchmark": "load_overhead", "command": command,
            "machine": info, "parameters": {
                "duration_s": args.duration, "rounds": args.rounds,
                "warmup_s": args.warmup, "threads": args.threads,
                "connections": args.connections, "rows": args.rows,
                "path": URL_PATH, "quick": args.quick,
                "server_cpu": args.server_cpu, "wrk_cpu": args.wrk_cpu},
            "targets": TARGETS, "results": results, "micro": micro})
    if args.strict and missed and not args.quick:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
