"""Shared helpers for the greqprof benchmarks (not a public module).

The scripts in this folder are run as ``python bench/<script>.py``, so this
file is imported as a sibling module.  Everything here is standard library:
the benchmarks must run (and skip rows cleanly) on an interpreter that lacks
greqprof, yappi or gevent.
"""

import argparse
import datetime
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time


class Skip(Exception):
    """A configuration cannot run here; the message says why."""


# ---------------------------------------------------------------------------
# configurations

class Config:
    """One profiler setup.  Subclasses override prepare/start/stop.

    prepare() runs once, before any timing; it raises Skip when a package
    is missing or the requested API is not there.  start() and stop() wrap
    every timed run; they are outside the timed region.
    """

    #: short machine-readable id (used by --only and in the JSON)
    key = "bare"
    #: human label for tables
    label = "bare"
    #: notes appended to the label (e.g. API fallbacks)
    note = ""

    def prepare(self):
        pass

    def start(self):
        pass

    def stop(self):
        pass


class Bare(Config):
    key = "bare"
    label = "bare (no profiler)"


def _import_greqprof():
    try:
        import greqprof  # noqa: F401
    except Exception as exc:  # ImportError, or a broken build (OSError, ...)
        raise Skip("greqprof not importable: %s: %s"
                   % (type(exc).__name__, exc))
    return greqprof


class Greqprof(Config):
    """greqprof.Profiler(**kwargs).  A fresh profiler per run, so results
    never accumulate across repetitions."""

    def __init__(self, key, label, optional_kwargs=None, **kwargs):
        self.key = key
        self.label = label
        self.kwargs = kwargs
        # knobs that may not exist yet: tried first, dropped (with a note)
        # when the constructor rejects them
        self.optional_kwargs = optional_kwargs or {}
        self.prof = None
        self.last = None     # the profiler of the latest run, stopped
        self.mod = None

    def _make(self):
        return self.mod.Profiler(**self.kwargs)

    def prepare(self):
        self.mod = _import_greqprof()
        if self.optional_kwargs:
            try:
                self.mod.Profiler(**dict(self.kwargs, **self.optional_kwargs))
                self.kwargs.update(self.optional_kwargs)
            except TypeError as exc:
                self.note = "(%s not accepted: %s; library default used)" % (
                    _fmt_kwargs(self.optional_kwargs),
                    exc)
        try:
            self._make()
        except Exception as exc:
            raise Skip("greqprof.Profiler(%s) failed: %s: %s"
                       % (_fmt_kwargs(self.kwargs), type(exc).__name__, exc))

    def start(self):
        self.prof = self._make()
        self.prof.start()

    def stop(self):
        prof, self.prof = self.prof, None
        if prof is not None:
            prof.stop()
            self.last = prof


def _fmt_kwargs(kw):
    return ", ".join("%s=%r" % kv for kv in kw.items())


class Yappi(Config):
    """yappi with the greenlet context backend and the given clock."""

    def __init__(self, clock):
        self.clock = clock
        self.key = "yappi-" + clock
        self.label = "yappi %s, greenlet backend" % clock
        self.yappi = None

    def prepare(self):
        try:
            import yappi
        except Exception as exc:
            raise Skip("yappi not importable: %s: %s"
                       % (type(exc).__name__, exc))
        self.yappi = yappi
        try:
            yappi.set_context_backend("greenlet")
        except Exception as exc:
            raise Skip("yappi.set_context_backend('greenlet') failed: %s"
                       % exc)

    def start(self):
        y = self.yappi
        y.clear_stats()
        y.set_context_backend("greenlet")
        y.set_clock_type(self.clock)
        y.start(builtins=False)

    def stop(self):
        self.yappi.stop()
        self.yappi.clear_stats()


class CProfile(Config):
    key = "cprofile"
    label = "cProfile"

    def prepare(self):
        import cProfile
        self.mod = cProfile
        self.prof = None

    def start(self):
        # builtins=False: same job as greqprof/yappi (no C-function entries)
        self.prof = self.mod.Profile(builtins=False)
        self.prof.enable()

    def stop(self):
        self.prof.disable()
        self.prof = None


class GreenletSettraceNoop(Config):
    key = "py-settrace"
    label = "pure-Python greenlet.settrace no-op"

    def prepare(self):
        try:
            import greenlet
        except Exception as exc:
            raise Skip("greenlet not importable: %s" % exc)
        self.greenlet = greenlet
        self.old = None

    def start(self):
        def callback(event, args):
            pass
        self.old = self.greenlet.settrace(callback)

    def stop(self):
        self.greenlet.settrace(self.old)
        self.old = None


class GreenletSettraceC(GreenletSettraceNoop):
    """A C builtin as the greenlet.settrace callback: operator.is_(event,
    (origin, target)) does nothing useful, so this is the floor for any
    settrace-based hook (greenlet's own tracing path plus one C call)."""
    key = "c-settrace"
    label = "C greenlet.settrace no-op (operator.is_)"

    def start(self):
        import operator
        self.old = self.greenlet.settrace(operator.is_)


# ---------------------------------------------------------------------------
# the measuring loop

def read_port(proc, timeout):
    """The port a bench/_load_server.py process prints ("PORT n"), or None
    when it exits or stays silent for timeout seconds."""
    import re
    import select
    import time
    deadline = time.monotonic() + timeout
    buf = b""
    fd = proc.stdout.fileno()
    while time.monotonic() < deadline:
        r, _, _ = select.select([fd], [], [], 0.1)
        if r:
            chunk = os.read(fd, 256)
            if not chunk:
                return None
            buf += chunk
            m = re.search(rb"PORT (\d+)\n", buf)
            if m:
                return int(m.group(1))
        elif proc.poll() is not None:
            return None
    return None


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def run_alternating(configs, workload, reps, warmup=1, label=""):
    """Time ``workload()`` under every config, ``reps`` times each.

    ``workload()`` does its own untimed setup and returns the elapsed
    nanoseconds of its timed region.  Configs run in list order on even
    repetitions and in reverse order on odd ones, so slow drift (thermal,
    noisy neighbours, allocator state) hits every config alike.  The cyclic
    GC is collected before and disabled during each run.

    Returns {key: {"status": "ok"|"skipped", "reason":..., "times_ns": [...]}}.
    """
    results = {}
    live = []
    for cfg in configs:
        try:
            cfg.prepare()
        except Skip as exc:
            results[cfg.key] = {"status": "skipped", "reason": str(exc),
                                "times_ns": []}
            log("  [%s] SKIPPED %s: %s" % (label, cfg.key, exc))
            continue
        results[cfg.key] = {"status": "ok", "reason": "", "times_ns": []}
        live.append(cfg)

    def one(cfg):
        gc.collect()
        try:
            cfg.start()
        except Exception as exc:
            _safe_stop(cfg)
            raise Skip("start() failed: %s: %s" % (type(exc).__name__, exc))
        gc.disable()
        try:
            elapsed = workload()
        except Exception as exc:
            gc.enable()
            _safe_stop(cfg)
            raise Skip("workload failed under this config: %s: %s"
                       % (type(exc).__name__, exc))
        gc.enable()
        try:
            cfg.stop()
        except Exception as exc:
            raise Skip("stop() failed: %s: %s" % (type(exc).__name__, exc))
        return elapsed

    for rep in range(-warmup, reps):
        order = live if rep % 2 == 0 else live[::-1]
        for cfg in list(order):
            if results[cfg.key]["status"] != "ok":
                continue
            try:
                elapsed = one(cfg)
            except Skip as exc:
                results[cfg.key]["status"] = "skipped"
                results[cfg.key]["reason"] = str(exc)
                log("  [%s] SKIPPED %s: %s" % (label, cfg.key, exc))
                continue
            if rep >= 0:
                results[cfg.key]["times_ns"].append(elapsed)
        if rep >= 0:
            log("  [%s] rep %d/%d done" % (label, rep + 1, reps))
    return results


def _safe_stop(cfg):
    try:
        cfg.stop()
    except Exception:
        pass


def median(xs):
    return statistics.median(xs) if xs else None


def iqr(xs):
    """(p25, p75) of xs; (min, max) for fewer than 4 values."""
    if not xs:
        return (None, None)
    if len(xs) < 4:
        return (min(xs), max(xs))
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return (q[0], q[2])


def paired_deltas(times, base_times):
    """Per-repetition differences cfg - bare (same repetition, adjacent in
    time), robust to drift between repetitions."""
    return [a - b for a, b in zip(times, base_times)]


# ---------------------------------------------------------------------------
# machine description

def _first_cpuinfo(field):
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":")[0].strip() == field:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _nproc():
    exe = shutil.which("nproc")
    if exe:
        try:
            return int(subprocess.check_output([exe], text=True).strip())
        except Exception:
            pass
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count()


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _version(dist, module=None):
    """Version of an importable package; None when it does not import."""
    try:
        mod = __import__(module or dist)
    except Exception:
        return None
    try:
        from importlib import metadata
        return metadata.version(dist)
    except Exception:
        return getattr(mod, "__version__", "?")


def _clock_cost_ns(fn, n=200000):
    fn()
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - t0) / n


def _loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def finish_info(info):
    """Adds the end-of-run load average and a warning when the machine was
    busy (other processes competing for the CPUs skew every number)."""
    info["loadavg_end"] = _loadavg()
    # the benchmark itself keeps one CPU busy: it adds ~1 to the end value
    start, end = info.get("loadavg_start"), info["loadavg_end"]
    busy = ((start is not None and start[0] > 0.5)
            or (end is not None and end[0] > 1.5))
    info["busy_warning"] = bool(busy)
    return info


def load_line(info):
    s = "load average (1/5/15 min) at start %s, at end %s" % (
        info.get("loadavg_start"), info.get("loadavg_end"))
    if info.get("busy_warning"):
        s += " -- WARNING: the machine was busy; numbers are skewed"
    return s


def machine_info():
    def noop():
        pass
    loop = _clock_cost_ns(noop)
    return {
        "loadavg_start": _loadavg(),
        "date": datetime.datetime.now(datetime.timezone.utc)
        .strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": _nproc(),
        "cpu_model": _first_cpuinfo("model name") or platform.processor()
        or platform.machine(),
        "python": "%s %s" % (platform.python_implementation(),
                             platform.python_version()),
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "clocksource": _read("/sys/devices/system/clocksource/"
                             "clocksource0/current_clocksource"),
        "versions": {
            "greqprof": _version("greqprof"),
            "greenlet": _version("greenlet"),
            "gevent": _version("gevent"),
            "yappi": _version("yappi"),
            "cffi": _version("cffi"),
        },
        # what a clock read costs from Python (call overhead included; the
        # loop/call cost is given so it can be subtracted)
        "python_call_ns": round(loop, 1),
        "perf_counter_ns_call_ns": round(
            _clock_cost_ns(time.perf_counter_ns), 1),
        "thread_time_ns_call_ns": round(
            _clock_cost_ns(time.thread_time_ns), 1),
    }


def machine_lines(info):
    v = info["versions"]
    vers = ", ".join("%s %s" % (k, v[k] or "absent") for k in
                     ("greqprof", "greenlet", "gevent", "yappi", "cffi"))
    return [
        "date: %s" % info["date"],
        "machine: %s, nproc=%s, clocksource=%s" % (
            info["cpu_model"], info["nproc"], info["clocksource"]),
        "python: %s (%s)" % (info["python"], info["platform"]),
        "packages: %s" % vers,
        "clock reads from Python: perf_counter_ns %.0f ns, thread_time_ns "
        "%.0f ns (an empty Python call: %.0f ns)" % (
            info["perf_counter_ns_call_ns"], info["thread_time_ns_call_ns"],
            info["python_call_ns"]),
    ]


# ---------------------------------------------------------------------------
# output

def base_argparser(description):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true",
                   help="tiny smoke run: checks the script works; the "
                        "numbers mean nothing")
    p.add_argument("--reps", type=int, default=None,
                   help="timed repetitions per configuration (default 7, "
                        "2 with --quick)")
    p.add_argument("--json", metavar="PATH",
                   help="also write all results (raw times included) to PATH")
    p.add_argument("--markdown", action="store_true",
                   help="print the results as a Markdown table (for README)")
    p.add_argument("--only", metavar="KEYS",
                   help="comma-separated config keys to run (bare is always "
                        "run); see --list")
    p.add_argument("--list", action="store_true",
                   help="list the configuration keys and exit")
    p.add_argument("--timer", choices=("wall", "cpu"), default="wall",
                   help="clock of the timed region: wall (perf_counter_ns, "
                        "default) or cpu (thread_time_ns: this thread's CPU "
                        "time, less skewed when other processes compete "
                        "for the CPUs)")
    p.add_argument("--pin", metavar="CPU", type=int, default=None,
                   help="pin the process to this CPU (sched_setaffinity) "
                        "to avoid migrations")
    return p


_TIMER = [time.perf_counter_ns]


def set_timer(name):
    _TIMER[0] = time.thread_time_ns if name == "cpu" else time.perf_counter_ns
    return name


def timer():
    """The clock workloads time their region with (see --timer)."""
    return _TIMER[0]


def apply_pin(cpu):
    if cpu is None:
        return None
    try:
        os.sched_setaffinity(0, {cpu})
    except (AttributeError, OSError, ValueError) as exc:
        log("--pin %d ignored: %s" % (cpu, exc))
        return None
    return cpu


def spread_pct(xs):
    """Run-to-run spread of xs: IQR (min-max below 4 values) as a
    percentage of the median."""
    if not xs:
        return None
    lo, hi = iqr(xs)
    return 100.0 * (hi - lo) / median(xs)


def select(configs, only):
    if not only:
        return configs
    wanted = {k.strip() for k in only.split(",") if k.strip()}
    unknown = wanted - {c.key for c in configs}
    if unknown:
        raise SystemExit("unknown config key(s): %s (known: %s)" % (
            ", ".join(sorted(unknown)), ", ".join(c.key for c in configs)))
    return [c for c in configs if c.key == "bare" or c.key in wanted]


def md_table(headers, rows):
    out = ["| " + " | ".join(headers) + " |",
           "|" + "|".join("---" if i == 0 else "---:"
                          for i in range(len(headers))) + "|"]
    for r in rows:
        out.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(out)


def text_table(headers, rows):
    cols = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cols) for i in range(len(headers))]
    lines = []
    for j, r in enumerate(cols):
        lines.append("  ".join(
            (c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]))
            for i, c in enumerate(r)).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path, payload):
    d = os.path.dirname(os.path.abspath(path))
    if d:
        os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=False)
        f.write("\n")
    log("wrote %s" % path)


def fmt(x, spec="%.0f", none="—"):
    return none if x is None else spec % x
