"""Soak test: examples/wsgi_app.py served by gevent.pywsgi behind
ProfilingMiddleware (pct=1.0, calls=True, report=False), driven by wrk for a
fixed number of requests, each with a unique X-Request-ID.

    .venv/bin/python bench/soak.py                    # 200,000 requests
    .venv/bin/python bench/soak.py --requests 20000
    .venv/bin/python bench/soak.py --quick            # 3,000 requests
    .venv/bin/python bench/soak.py --client python    # no wrk: gevent client

The server runs in a subprocess (``--serve``).  Its WSGI app is the example
app plus ``/soak``, a cheap route in the example app's style (spawns a child
greenlet, yields, joins it), so hundreds of thousands of requests fit in a
few minutes; the load mixes in the example app's own ``/``, ``/fire`` (a
greenlet that outlives the response: the linger path) and ``/stream``
(chunked body).  Outside the middleware, the server

* records every X-Request-ID it receives, and its sink every profile's
  request_id, in preallocated per-(phase, client thread) counters, so the
  accounting itself does not grow memory;
* answers ``/__soak`` with JSON: requests seen, profiles delivered, request
  ids with no profile (lost), with more than one (doubled), profiles for
  ids never seen, the middleware's stats and open count, its own VmRSS and
  the sizes of greqprof's bounded registries.

The driver runs three phases (warm-up 10 %, then two halves of the rest)
with the ids ``<phase>-<thread>-<n>``, reads the server's VmRSS from
/proc/PID/status before the load and after each phase, and prints a report
(``--json PATH`` writes it too).  Exit status 0 only when: no transport
error, no non-2xx response, every request the server saw was profiled
exactly once, no profile for an unknown id, nothing skipped, and RSS growth
after warm-up under ``--max-growth-mb`` (default 10).

wrk (Debian's ``wrk`` package) generates the load with a Lua script (one
counter per wrk thread, read back in done()); each wrk thread stops itself
after its share of responses, and the driver ends wrk with SIGINT once the
server has been quiet.  A connection's request in flight when its thread
stops is sent and served (and profiled) but its response is not read:
"sent" >= "seen by the server" >= "responses received".
"""
import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PHASES = ("warmup", "middle", "end")

# ---------------------------------------------------------------------------
# the server (a subprocess)


def rss_kb(pid):
    """VmRSS of a process in kB (from /proc/PID/status)."""
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS for pid %d" % pid)


class Ledger:
    """Per-(phase, thread) byte counters indexed by the request number:
    how many times each request id was seen / profiled (saturating at
    255).  Preallocated, so counting allocates nothing per request."""

    def __init__(self, phases, threads, size):
        self.size = size
        self.arrays = {(p, t): bytearray(size + 1)
                       for p in range(phases) for t in range(threads)}
        self.other = {}   # unparsable / out-of-range ids (should stay empty)

    def add(self, rid):
        key = None
        if rid:
            parts = rid.split("-")
            if len(parts) == 3 and all(x.isdigit() for x in parts):
                p, t, n = (int(x) for x in parts)
                key = (p, t)
        arr = self.arrays.get(key) if key is not None else None
        if arr is None or not 0 < n <= self.size:
            if len(self.other) < 10000:
                self.other[rid] = self.other.get(rid, 0) + 1
            return
        if arr[n] < 255:
            arr[n] += 1


def build_server(args):
    import gevent
    from gevent import pywsgi

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import wsgi_app  # noqa: E402  examples/wsgi_app.py

    import logging

    from greqprof import ProfilingMiddleware, _registry, engine

    nphases = len(PHASES)
    seen = Ledger(nphases, args.threads, args.expect)
    profiled = Ledger(nphases, args.threads, args.expect)
    counts = {"seen": 0, "profiles": 0, "no_rid": 0}
    log_levels = {}

    class CountingHandler(logging.Handler):
        """greqprof's log lines (blocking warnings, internal errors) are
        counted, not printed: the soak is about state, not output."""

        def emit(self, record):
            log_levels[record.levelname] = log_levels.get(
                record.levelname, 0) + 1
            if record.levelno >= logging.ERROR and \
                    log_levels[record.levelname] <= 5:
                sys.stderr.write("greqprof %s: %s\n"
                                 % (record.levelname, record.getMessage()))

    log = logging.getLogger("greqprof.soak")
    log.addHandler(CountingHandler())
    log.propagate = False
    log.setLevel(logging.INFO)

    def sink(profile):
        counts["profiles"] += 1
        profiled.add(profile.request_id)

    def aggregate(n):
        total = 0
        for i in range(n):
            total += i * i % 7
            if i == n // 2:
                gevent.sleep(0)
        return total

    def soak(environ, start_response):
        child = gevent.spawn(aggregate, 100)
        rows = ["%d:%s" % (i, "x" * (i % 7)) for i in range(20)]
        gevent.sleep(0)
        body = ("%s %d\n" % (",".join(rows), child.get())).encode()
        start_response("200 OK", [("Content-Type", "text/plain"),
                                  ("Content-Length", str(len(body)))])
        return [body]

    def inner(environ, start_response):
        if environ.get("PATH_INFO") == "/soak":
            return soak(environ, start_response)
        return wsgi_app.app(environ, start_response)

    mw = ProfilingMiddleware(inner, pct=1.0, calls=True, report=False,
                             sink=sink, logger=log, max_open=100000,
                             linger=1.0)

    def status():
        lost = doubled = profiles_for_unseen = 0
        per_phase = {}
        for (p, t), s_arr in seen.arrays.items():
            p_arr = profiled.arrays[(p, t)]
            ph = per_phase.setdefault(PHASES[p], {"seen": 0, "profiled": 0})
            if not any(s_arr) and not any(p_arr):
                continue
            for n in range(1, seen.size + 1):
                s, c = s_arr[n], p_arr[n]
                if s:
                    ph["seen"] += s
                    if c == 0:
                        lost += 1
                    elif c > 1 or s > 1:
                        doubled += 1
                elif c:
                    profiles_for_unseen += 1
                ph["profiled"] += c
        eng = getattr(engine._local, "engine", None)
        return {
            "pid": os.getpid(), "rss_kb": rss_kb(os.getpid()),
            "seen": counts["seen"], "profiles": counts["profiles"],
            "no_rid": counts["no_rid"], "lost": lost, "doubled": doubled,
            "profiles_for_unseen": profiles_for_unseen,
            "unparsed_seen": len(seen.other),
            "unparsed_profiles": len(profiled.other),
            "per_phase": per_phase, "open": mw._open,
            "mw_stats": dict(mw.stats), "log_levels": dict(log_levels),
            "registry": {"names": len(_registry.names),
                         "codes": len(_registry.codes),
                         "stacks": len(_registry.stacks),
                         "long_spans": len(_registry.long_spans)},
            "engine": ({"requests": len(eng.requests),
                        "profile_requests": len(eng.profile_requests),
                        "lingering": len(eng.lingering),
                        "sampled_stacks": len(eng.sampled_stacks)}
                       if eng is not None else None),
        }

    def outer(environ, start_response):
        if environ.get("PATH_INFO") == "/__soak":
            body = json.dumps(status()).encode()
            start_response("200 OK", [("Content-Type", "application/json"),
                                      ("Content-Length", str(len(body)))])
            return [body]
        counts["seen"] += 1
        rid = environ.get("HTTP_X_REQUEST_ID")
        if rid:
            seen.add(rid)
        else:
            counts["no_rid"] += 1
        return mw(environ, start_response)

    class NoDelayWSGIServer(pywsgi.WSGIServer):
        """pywsgi writes headers and body in two send() calls: without
        TCP_NODELAY, Nagle + delayed ACK cap a keep-alive connection at
        ~25 requests/s."""

        def handle(self, sock, address):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            return super().handle(sock, address)

    server = NoDelayWSGIServer(("127.0.0.1", args.port), outer, log=None,
                               error_log=None)
    return server, status


def serve(args):
    import gevent
    server, status = build_server(args)
    server.start()
    print("PORT %d" % server.server_port, flush=True)

    def stop(*_):
        server.stop(timeout=2)
    gevent.signal_handler(signal.SIGTERM, stop)
    server.serve_forever()
    if args.status_file:
        with open(args.status_file, "w") as f:
            json.dump(status(), f)


# ---------------------------------------------------------------------------
# the driver

WRK_LUA = r"""
-- Unique X-Request-ID per request: <phase>-<wrk thread>-<counter>.
local threads = {}
local next_tid = 0

function setup(thread)
   thread:set("tid", next_tid)
   next_tid = next_tid + 1
   table.insert(threads, thread)
end

function init(args)
   phase = args[1]
   limit = tonumber(args[2])
   sent = 0
   received = 0
   bad = 0
end

function request()
   sent = sent + 1
   local n = sent
   local path = "/soak"
   if n % 100 == 0 then
      path = "/fire"
   elseif n % 100 == 50 then
      path = "/stream"
   elseif n % 250 == 7 then
      path = "/"
   end
   return wrk.format("GET", path,
                     {["X-Request-ID"] = phase .. "-" .. tid .. "-" .. n})
end

function response(status, headers, body)
   received = received + 1
   if status < 200 or status > 299 then
      bad = bad + 1
   end
   if received >= limit then
      wrk.thread:stop()
   end
end

function done(summary, latency, requests)
   local s, r, b = 0, 0, 0
   for _, t in ipairs(threads) do
      s = s + t:get("sent")
      r = r + t:get("received")
      b = b + t:get("bad")
   end
   local e = summary.errors
   io.write(string.format(
      "SOAK sent=%d received=%d non2xx=%d completed=%d connect=%d " ..
      "read=%d write=%d status=%d timeout=%d\n",
      s, r, b, summary.requests, e.connect, e.read, e.write, e.status,
      e.timeout))
end
"""


def path_for(n):
    """The same mix as the Lua script."""
    if n % 100 == 0:
        return "/fire"
    if n % 100 == 50:
        return "/stream"
    if n % 250 == 7:
        return "/"
    return "/soak"


def http_get_json(port, path, timeout=30):
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        s.sendall(("GET %s HTTP/1.1\r\nHost: soak\r\nConnection: close"
                   "\r\n\r\n" % path).encode())
        data = b""
        while True:
            c = s.recv(65536)
            if not c:
                break
            data += c
    finally:
        s.close()
    return json.loads(data.split(b"\r\n\r\n", 1)[1])


class Server:
    def __init__(self, args, status_file):
        cmd = [sys.executable, os.path.abspath(__file__), "--serve",
               "--expect", str(args.per_thread_max), "--threads",
               str(args.threads), "--status-file", status_file]
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True,
                                     cwd=ROOT)
        line = self.proc.stdout.readline()
        m = re.match(r"PORT (\d+)", line or "")
        if not m:
            self.proc.kill()
            self.stderr.seek(0)
            raise SystemExit("the soak server did not start:\n%s"
                             % self.stderr.read()[-3000:])
        self.port = int(m.group(1))
        self.pid = self.proc.pid

    def status(self):
        return http_get_json(self.port, "/__soak")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def stderr_tail(self):
        self.stderr.seek(0)
        return self.stderr.read()[-3000:]


def wait_quiet(server, expect_at_least, timeout):
    """Waits until the server saw `expect_at_least` requests, its request
    count stopped moving and no profile is open (lingers included)."""
    deadline = time.monotonic() + timeout
    last = None
    stable_since = time.monotonic()
    while time.monotonic() < deadline:
        st = server.status()
        key = (st["seen"], st["profiles"])
        if key != last:
            last = key
            stable_since = time.monotonic()
        if st["seen"] >= expect_at_least and st["open"] == 0 and \
                time.monotonic() - stable_since >= 0.5:
            return st
        time.sleep(0.2)
    return server.status()


def run_wrk(args, server, phase, per_thread, script, seen_before):
    cmd = ["wrk", "-t%d" % args.threads, "-c%d" % args.connections,
           "-d3600s", "--timeout", "10s", "-s", script,
           "http://127.0.0.1:%d" % server.port, "--", str(phase),
           str(per_thread)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    # Each wrk thread stops after its share; wrk itself sleeps for -d, so
    # end it with SIGINT once the server has seen them all and is quiet.
    target = seen_before + per_thread * args.threads
    deadline = time.monotonic() + args.phase_timeout
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
        st = server.status()
        if st["seen"] >= target:
            wait_quiet(server, target, 30)
            break
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    m = re.search(r"SOAK sent=(\d+) received=(\d+) non2xx=(\d+) "
                  r"completed=(\d+) connect=(\d+) read=(\d+) write=(\d+) "
                  r"status=(\d+) timeout=(\d+)", out)
    if not m:
        raise SystemExit("wrk gave no summary:\n%s" % out[-3000:])
    v = [int(x) for x in m.groups()]
    return {"sent": v[0], "received": v[1], "non2xx": v[2],
            "wrk_completed": v[3],
            "errors": {"connect": v[4], "read": v[5], "write": v[6],
                       "status": v[7], "timeout": v[8]},
            "wrk_output": out}


def run_python_client(args, server, phase, per_thread):
    """The fallback load generator: `threads` x `connections/threads`
    keep-alive connections from gevent greenlets in this process."""
    import gevent
    from gevent import socket as gsocket

    res = {"sent": 0, "received": 0, "non2xx": 0,
           "errors": {"connect": 0, "read": 0, "write": 0, "status": 0,
                      "timeout": 0}}
    conns = max(1, args.connections // args.threads)

    def read_response(f):
        line = f.readline()
        if not line:
            raise EOFError
        code = int(line.split()[1])
        length = None
        chunked = False
        while True:
            h = f.readline()
            if h in (b"\r\n", b""):
                break
            k, v = h.decode("latin-1").split(":", 1)
            k = k.strip().lower()
            if k == "content-length":
                length = int(v)
            elif k == "transfer-encoding" and "chunked" in v:
                chunked = True
        if chunked:
            while True:
                size = int(f.readline().split(b";")[0], 16)
                if size == 0:
                    f.readline()
                    break
                f.read(size)
                f.readline()
        elif length:
            f.read(length)
        return code

    def thread_share(tid):
        counter = [0]

        def conn():
            try:
                s = gsocket.create_connection(("127.0.0.1", server.port),
                                              timeout=10)
            except OSError:
                res["errors"]["connect"] += 1
                return
            f = s.makefile("rb")
            try:
                while counter[0] < per_thread:
                    counter[0] += 1
                    n = counter[0]
                    req = ("GET %s HTTP/1.1\r\nHost: soak\r\n"
                           "X-Request-ID: %d-%d-%d\r\n\r\n"
                           % (path_for(n), phase, tid, n))
                    try:
                        s.sendall(req.encode())
                    except OSError:
                        res["errors"]["write"] += 1
                        return
                    res["sent"] += 1
                    try:
                        code = read_response(f)
                    except gsocket.timeout:
                        res["errors"]["timeout"] += 1
                        return
                    except (OSError, EOFError, ValueError):
                        res["errors"]["read"] += 1
                        return
                    res["received"] += 1
                    if not 200 <= code <= 299:
                        res["non2xx"] += 1
            finally:
                f.close()
                s.close()
        gevent.joinall([gevent.spawn(conn) for _ in range(conns)])

    gevent.joinall([gevent.spawn(thread_share, t)
                    for t in range(args.threads)])
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=200000,
                    help="responses to receive over all phases "
                         "(default 200000)")
    ap.add_argument("--quick", action="store_true",
                    help="3,000 requests (the test suite's size)")
    ap.add_argument("--client", choices=("auto", "wrk", "python"),
                    default="auto")
    ap.add_argument("--threads", type=int, default=2,
                    help="load generator threads (default 2)")
    ap.add_argument("--connections", type=int, default=16,
                    help="keep-alive connections in all (default 16)")
    ap.add_argument("--max-growth-mb", type=float, default=10.0,
                    help="RSS growth allowed after warm-up (default 10)")
    ap.add_argument("--phase-timeout", type=float, default=3600.0)
    ap.add_argument("--json", metavar="PATH",
                    help="also write the report as JSON")
    # server mode (internal)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--expect", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--status-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args)
        return 0
    if args.quick and args.requests == 200000:
        args.requests = 3000
    if args.client == "auto":
        args.client = "wrk" if _have_wrk() else "python"
    if args.connections < args.threads:
        args.connections = args.threads
    total = args.requests
    warm = max(args.threads, total // 10)
    mid = (total - warm) // 2
    shares = [warm, mid, total - warm - mid]
    per_thread = [max(1, -(-s // args.threads)) for s in shares]
    # Room for the requests in flight when a wrk thread stops.
    args.per_thread_max = max(per_thread) + args.connections + 16

    workdir = tempfile.mkdtemp(prefix="greqprof-soak-")
    status_file = os.path.join(workdir, "final-status.json")
    script = os.path.join(workdir, "soak.lua")
    with open(script, "w") as f:
        f.write(WRK_LUA)

    t0 = time.monotonic()
    server = Server(args, status_file)
    report = {"command": " ".join(["bench/soak.py"] + sys.argv[1:]),
              "client": args.client, "requests_target": total,
              "threads": args.threads, "connections": args.connections,
              "server_pid": server.pid, "phases": [], "rss_kb": {}}
    rss_samples = []
    sampling = [True]

    def sampler():
        while sampling[0]:
            try:
                rss_samples.append(rss_kb(server.pid))
            except (OSError, RuntimeError):
                return
            time.sleep(1.0)
    try:
        report["rss_kb"]["start"] = rss_kb(server.pid)
        threading.Thread(target=sampler, daemon=True).start()
        seen_before = 0
        for phase, name in enumerate(PHASES):
            tp = time.monotonic()
            if args.client == "wrk":
                res = run_wrk(args, server, phase, per_thread[phase],
                              script, seen_before)
            else:
                res = run_python_client(args, server, phase,
                                        per_thread[phase])
            st = wait_quiet(server, seen_before, 60)
            seen_before = st["seen"]
            res.pop("wrk_output", None)
            res["phase"] = name
            res["seconds"] = round(time.monotonic() - tp, 1)
            res["rss_kb"] = rss_kb(server.pid)
            report["phases"].append(res)
            report["rss_kb"][{"warmup": "after_warmup", "middle": "middle",
                              "end": "end"}[name]] = res["rss_kb"]
            print("phase %-6s %7d responses in %6.1f s  RSS %d kB"
                  % (name, res["received"], res["seconds"], res["rss_kb"]),
                  file=sys.stderr, flush=True)
        final = server.status()
    finally:
        sampling[0] = False
        server.stop()
    report["server"] = final
    if os.path.exists(status_file):
        with open(status_file) as f:
            report["server_at_shutdown"] = json.load(f)
    report["rss_kb"]["max_sampled"] = max(rss_samples) if rss_samples \
        else None
    report["seconds"] = round(time.monotonic() - t0, 1)
    sent = sum(p["sent"] for p in report["phases"])
    received = sum(p["received"] for p in report["phases"])
    non2xx = sum(p["non2xx"] for p in report["phases"])
    errors = {}
    for p in report["phases"]:
        for k, v in p["errors"].items():
            errors[k] = errors.get(k, 0) + v
    growth_kb = report["rss_kb"]["end"] - report["rss_kb"]["after_warmup"]
    report["totals"] = {
        "sent": sent, "received": received, "non2xx": non2xx,
        "transport_errors": errors,
        "seen_by_server": final["seen"],
        "profiles_delivered": final["profiles"],
        "lost": final["lost"], "doubled": final["doubled"],
        "profiles_for_unseen": final["profiles_for_unseen"],
        "skipped_full": final["mw_stats"]["skipped_full"],
        "greqprof_errors": final["mw_stats"]["errors"],
        "rss_growth_after_warmup_kb": growth_kb,
        "requests_per_second": round(received / max(
            sum(p["seconds"] for p in report["phases"]), 1e-9), 1),
    }
    failures = []
    if sum(errors.values()):
        failures.append("transport errors %r" % errors)
    if non2xx:
        failures.append("%d non-2xx responses" % non2xx)
    if received < total:
        failures.append("only %d of %d responses" % (received, total))
    if final["lost"] or final["doubled"] or final["profiles_for_unseen"] \
            or final["unparsed_seen"] or final["unparsed_profiles"] \
            or final["no_rid"]:
        failures.append("profile accounting: lost %d, doubled %d, for "
                        "unseen ids %d" % (final["lost"], final["doubled"],
                                           final["profiles_for_unseen"]))
    if final["profiles"] != final["seen"]:
        failures.append("%d profiles for %d requests"
                        % (final["profiles"], final["seen"]))
    if final["mw_stats"]["skipped_full"] or final["mw_stats"]["errors"]:
        failures.append("middleware stats %r" % final["mw_stats"])
    if final["open"]:
        failures.append("%d profiles still open" % final["open"])
    if growth_kb > args.max_growth_mb * 1024:
        failures.append("RSS grew %.1f MB after warm-up (limit %.1f)"
                        % (growth_kb / 1024.0, args.max_growth_mb))
    report["failures"] = failures
    report["ok"] = not failures
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if failures:
        sys.stderr.write(server.stderr_tail())
    return 0 if not failures else 1


def _have_wrk():
    from shutil import which
    return which("wrk") is not None


def print_report(r):
    t = r["totals"]
    k = r["rss_kb"]
    lines = [
        "greqprof soak: %s (%s client, %d threads, %d connections)"
        % (r["command"], r["client"], r["threads"], r["connections"]),
        "  requests sent:            %d" % t["sent"],
        "  responses received:       %d" % t["received"],
        "  non-2xx responses:        %d" % t["non2xx"],
        "  transport errors:         %s" % t["transport_errors"],
        "  requests seen by server:  %d" % t["seen_by_server"],
        "  profiles delivered:       %d (lost %d, doubled %d, for unknown "
        "ids %d)" % (t["profiles_delivered"], t["lost"], t["doubled"],
                     t["profiles_for_unseen"]),
        "  middleware stats:         %s" % r["server"]["mw_stats"],
        "  server RSS (kB):          start %d, after warm-up %d, middle %d,"
        " end %d, max sampled %s" % (k["start"], k["after_warmup"],
                                     k["middle"], k["end"],
                                     k["max_sampled"]),
        "  RSS growth after warm-up: %+.1f MB"
        % (t["rss_growth_after_warmup_kb"] / 1024.0),
        "  throughput:               %.0f requests/s; %.0f s in all"
        % (t["requests_per_second"], r["seconds"]),
        "  registries at the end:    %s" % r["server"]["registry"],
        "  result:                   %s" % ("OK" if r["ok"] else
                                            "FAILED: " + "; ".join(
                                                r["failures"])),
    ]
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    sys.exit(main())
