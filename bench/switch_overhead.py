#!/usr/bin/env python
"""Nanoseconds a profiler ADDS to every greenlet switch.

Two workloads, each timed under every configuration in the same process:

  raw     two bare greenlets ping-ponging (a.switch / b.switch) -- the
          cheapest switch there is, so any hook cost shows in full;
  gevent  many gevent greenlets each looping on gevent.sleep(0), i.e. the
          greenlet -> hub -> greenlet switching of a real gevent program.

Configurations: bare; greqprof spans only (calls=False) with the wall clock,
with CPU time estimated, with CPU time read at every switch; a pure-Python
greenlet.settrace callback that does nothing (what any Python-level switch
hook costs at least) and a C builtin as the callback (what any settrace-based
hook costs at least); yappi (cpu and wall clocks, greenlet backend).

Result per configuration: added ns/switch = (median t_cfg - median t_bare) /
switches, where `switches` is counted (not assumed) with a greenlet.settrace
counter in an untimed calibration run.  See bench/README.md.

    python bench/switch_overhead.py            # full run, text table
    python bench/switch_overhead.py --markdown # table for README
    python bench/switch_overhead.py --quick    # smoke test (seconds)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _benchutil as bu  # noqa: E402

# Targets (ns added per switch) for the greqprof rows.
TARGETS = {
    "greqprof-wall": 60,
    "greqprof-cpu": 400,
    "greqprof-cpu-exact": 400,
}

# Set while a workload is inside its timed region; the calibration counter
# only counts switches then.
_TIMED = [False]


def configs():
    return [
        bu.Bare(),
        bu.Greqprof("greqprof-wall",
                    'greqprof wall, spans only (clock="wall", calls=False)',
                    clock="wall", calls=False),
        bu.Greqprof("greqprof-cpu",
                    'greqprof CPU estimate (clock="cpu", calls=False)',
                    optional_kwargs={"cpu": "estimate"},
                    clock="cpu", calls=False),
        bu.Greqprof("greqprof-cpu-exact",
                    'greqprof CPU exact (clock="cpu", calls=False, '
                    'cpu="exact")',
                    clock="cpu", calls=False, cpu="exact"),
        bu.GreenletSettraceNoop(),
        bu.GreenletSettraceC(),
        bu.Yappi("cpu"),
        bu.Yappi("wall"),
    ]


# ---------------------------------------------------------------------------
# workloads: each returns a callable that runs once and returns the elapsed
# ns of its timed region

def make_raw(iters):
    from greenlet import greenlet

    clock = bu.timer()

    def workload():
        def a_run():
            sw = gb.switch
            for _ in range(iters):
                sw()

        def b_run():
            sw = ga.switch
            while True:
                sw()

        ga = greenlet(a_run)
        gb = greenlet(b_run)
        _TIMED[0] = True
        t0 = clock()
        ga.switch()          # main -> a; a <-> b `iters` times; a ends -> main
        t1 = clock()
        _TIMED[0] = False
        gb.throw()           # untimed: let b die while the profiler still runs
        return t1 - t0

    return workload


def make_gevent(ngreenlets, sleeps):
    import gevent

    clock = bu.timer()
    gevent.sleep(0)          # create the hub outside any measurement

    def worker():
        sleep = gevent.sleep
        for _ in range(sleeps):
            sleep(0)

    def workload():
        gs = [gevent.spawn(worker) for _ in range(ngreenlets)]  # no switch yet
        _TIMED[0] = True
        t0 = clock()
        gevent.joinall(gs)
        t1 = clock()
        _TIMED[0] = False
        return t1 - t0

    return workload


def count_switches(workload):
    """Switch events ('switch' and 'throw') inside the timed region of one
    run of workload, counted with a greenlet.settrace callback."""
    import greenlet
    n = [0]

    def counter(event, args):
        if _TIMED[0] and event in ("switch", "throw"):
            n[0] += 1

    old = greenlet.settrace(counter)
    try:
        workload()
    finally:
        greenlet.settrace(old)
    return n[0]


def check_recorded(cfgs, switches):
    """What each greqprof profiler recorded in its last timed run: the
    switches it saw (sum of GreenletStat.switches; the untimed tail of the
    run adds a few) -- a profiler that misses switches would look cheap."""
    out = {}
    for cfg in cfgs:
        prof = getattr(cfg, "last", None)
        if prof is None:
            continue
        try:
            seen = sum(g.switches for g in prof.greenlet_stats())
            out[cfg.key] = {"switches_recorded": seen,
                            "switches_timed": switches,
                            "ok": seen >= switches}
        except Exception as exc:
            out[cfg.key] = {"error": "%s: %s" % (type(exc).__name__, exc),
                            "ok": False}
        cfg.last = None
    return out


def recorded_lines(recorded):
    lines = []
    for key, r in recorded.items():
        if "error" in r:
            lines.append("%s: could not read greenlet_stats(): %s"
                         % (key, r["error"]))
        else:
            lines.append("%s recorded %d switches (timed region: %d)%s" % (
                key, r["switches_recorded"], r["switches_timed"],
                "" if r["ok"] else " -- MISSING SWITCHES"))
    return lines


# ---------------------------------------------------------------------------

def analyse(cfgs, raw_results, switches, quick):
    base = raw_results["bare"]["times_ns"]
    mb = bu.median(base)
    rows = []
    for cfg in cfgs:
        r = raw_results[cfg.key]
        row = {"key": cfg.key, "label": cfg.label + (
            " " + cfg.note if cfg.note else ""),
            "status": r["status"], "reason": r["reason"],
            "times_ns": r["times_ns"], "target_ns": TARGETS.get(cfg.key)}
        if r["status"] == "ok" and r["times_ns"] and mb is not None:
            m = bu.median(r["times_ns"])
            row["median_ms"] = m / 1e6
            row["ns_per_switch"] = m / switches
            if cfg.key != "bare":
                row["added_ns_per_switch"] = (m - mb) / switches
                d = [x / switches
                     for x in bu.paired_deltas(r["times_ns"], base)]
                row["paired_added_median"] = bu.median(d)
                row["paired_added_iqr"] = bu.iqr(d)
            t = TARGETS.get(cfg.key)
            if t is not None:
                row["meets_target"] = (None if quick
                                       else row["added_ns_per_switch"] <= t)
        rows.append(row)
    return rows


HEADERS = ["configuration", "median ms", "ns/switch", "added ns/switch",
           "paired Δ median (IQR)", "target", "verdict"]


def table_rows(rows):
    """Table cells, plus the notes (skip reasons) to print under the table."""
    out, notes = [], []
    for r in rows:
        if r["status"] != "ok":
            notes.append("%s skipped: %s" % (r["key"], r["reason"]))
            out.append([r["label"], "skipped [%d]" % len(notes), "", "", "",
                        bu.fmt(r["target_ns"], "≤ %d", ""), "skipped"])
            continue
        lo, hi = r.get("paired_added_iqr", (None, None))
        t = r["target_ns"]
        if t is None:
            verdict = ""
        elif r.get("meets_target") is None:
            verdict = "not judged (--quick)"
        else:
            verdict = "meets" if r["meets_target"] else "MISSES"
        out.append([
            r["label"],
            bu.fmt(r.get("median_ms"), "%.2f"),
            bu.fmt(r.get("ns_per_switch"), "%.0f"),
            "—" if r["key"] == "bare" else bu.fmt(
                r.get("added_ns_per_switch"), "%+.0f"),
            "" if lo is None else "%+.0f (%+.0f … %+.0f)" % (
                r["paired_added_median"], lo, hi),
            "" if t is None else "≤ %d" % t,
            verdict,
        ])
    return out, notes


def main(argv=None):
    p = bu.base_argparser(__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=None,
                   help="raw ping-pong round trips (2 switches each); "
                        "default 250000, 2000 with --quick")
    p.add_argument("--greenlets", type=int, default=None,
                   help="gevent greenlets (default 100, 10 with --quick)")
    p.add_argument("--sleeps", type=int, default=None,
                   help="gevent.sleep(0) per greenlet (default 1000, 50 "
                        "with --quick)")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 when a greqprof row misses its target")
    args = p.parse_args(argv)

    cfgs = bu.select(configs(), args.only)
    if args.list:
        for c in configs():
            print("%-20s %s" % (c.key, c.label))
        return 0

    reps = args.reps or (2 if args.quick else 7)
    iters = args.iters or (2000 if args.quick else 250000)
    ngl = args.greenlets or (10 if args.quick else 100)
    sleeps = args.sleeps or (50 if args.quick else 1000)

    info = bu.machine_info()   # before pinning: nproc is the machine's
    pinned = bu.apply_pin(args.pin)
    timer = bu.set_timer(args.timer)
    for line in bu.machine_lines(info):
        bu.log(line)

    try:
        import greenlet  # noqa: F401
    except Exception as exc:
        print("greenlet is not importable (%s): nothing to measure; all "
              "rows skipped" % exc)
        return 0

    workloads = [("raw", "two raw greenlets ping-ponging", make_raw(iters),
                  {"iters": iters})]
    skipped_workloads = {}
    try:
        workloads.append((
            "gevent",
            "%d gevent greenlets x %d gevent.sleep(0)" % (ngl, sleeps),
            make_gevent(ngl, sleeps), {"greenlets": ngl, "sleeps": sleeps}))
    except Exception as exc:
        skipped_workloads["gevent"] = "gevent not usable: %s: %s" % (
            type(exc).__name__, exc)
        bu.log("gevent workload SKIPPED: %s" % skipped_workloads["gevent"])

    payload = {"benchmark": "switch_overhead", "quick": args.quick,
               "reps": reps, "timer": timer, "pinned_cpu": pinned, "machine": info,
               "targets_ns": TARGETS,
               "workloads": {}, "skipped_workloads": skipped_workloads}
    any_miss = []
    for name, desc, wl, params in workloads:
        wl()                                 # warm caches/allocators
        switches = count_switches(wl)
        bu.log("workload %s: %s; %d switches per run, %d reps"
               % (name, desc, switches, reps))
        cfgs = bu.select(configs(), args.only)   # fresh objects per workload
        res = bu.run_alternating(cfgs, wl, reps, label=name)
        rows = analyse(cfgs, res, switches, args.quick)
        recorded = check_recorded(cfgs, switches)
        payload["workloads"][name] = {
            "recorded": recorded,
            "description": desc, "params": params,
            "switches_per_run": switches,
            "bare_spread_pct": bu.spread_pct(res["bare"]["times_ns"]),
            "rows": rows}
        for r in rows:
            if r.get("meets_target") is False:
                any_miss.append("%s/%s: %+.0f ns > %d ns" % (
                    name, r["key"], r["added_ns_per_switch"], r["target_ns"]))

    bu.finish_info(info)
    # ---- report
    out = []
    if args.markdown:
        out.append("### Greenlet switch overhead%s" % (
            " (QUICK smoke run: numbers meaningless)" if args.quick else ""))
        out.append("")
        out.append("%s · nproc %s · %s · %s · clocksource %s" % (
            info["cpu_model"], info["nproc"], info["python"], info["date"],
            info["clocksource"]))
        out.append("")
        out.append("Versions: " + ", ".join(
            "%s %s" % (k, v or "absent") for k, v in info["versions"].items()))
        out.append("")
        ll = bu.load_line(info)
        out.append(ll[0].upper() + ll[1:] + ".")
        out.append("")
        for name, w in payload["workloads"].items():
            out.append("**%s** (%s; %d switches per run; median of %d "
                       "alternating reps; bare run-to-run spread (IQR) %s%%)"
                       % (name, w["description"], w["switches_per_run"], reps,
                          bu.fmt(w["bare_spread_pct"], "%.1f")))
            out.append("")
            cells, notes = table_rows(w["rows"])
            out.append(bu.md_table(HEADERS, cells))
            out.append("")
            for i, n in enumerate(notes, 1):
                out.append("[%d] %s  " % (i, n))
            for x in recorded_lines(w["recorded"]):
                out.append("check: %s  " % x)
            if notes or w["recorded"]:
                out.append("")
        for name, why in skipped_workloads.items():
            out.append("**%s**: skipped: %s" % (name, why))
            out.append("")
        out.append("`python bench/switch_overhead.py --markdown`; added "
                   "ns/switch = (median t_cfg − median t_bare) / switches; "
                   "paired Δ = per-repetition differences t_cfg − t_bare "
                   "(median and interquartile range) / switches.%s" % (
                       " Pinned to CPU %d." % pinned if pinned is not None
                       else "") + (" Timer: thread CPU time (--timer cpu)."
                                   if timer == "cpu" else ""))
    else:
        out.extend(bu.machine_lines(info))
        out.append(bu.load_line(info))
        out.append("timer: %s%s" % (
            "thread CPU time (--timer cpu)" if timer == "cpu"
            else "wall (perf_counter_ns)",
            "; pinned to CPU %d" % pinned if pinned is not None else ""))
        for name, w in payload["workloads"].items():
            out.append("")
            out.append("== %s: %s; %d switches/run; median of %d reps; bare "
                       "spread (IQR) %s%%%s" % (
                name, w["description"], w["switches_per_run"], reps,
                bu.fmt(w["bare_spread_pct"], "%.1f"),
                " [QUICK: numbers meaningless]" if args.quick else ""))
            cells, notes = table_rows(w["rows"])
            out.append(bu.text_table(HEADERS, cells))
            for i, n in enumerate(notes, 1):
                out.append("  [%d] %s" % (i, n))
            for x in recorded_lines(w["recorded"]):
                out.append("  check: %s" % x)
        for name, why in skipped_workloads.items():
            out.append("")
            out.append("== %s: skipped: %s" % (name, why))
    if any_miss:
        out.append("")
        out.append("TARGET MISSED: " + "; ".join(any_miss))
    print("\n".join(out))

    if args.json:
        bu.write_json(args.json, payload)
    return 1 if (args.strict and any_miss) else 0


if __name__ == "__main__":
    sys.exit(main())
