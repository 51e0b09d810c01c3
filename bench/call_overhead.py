#!/usr/bin/env python
"""Slowdown of a call-heavy greenlet workload under each profiler.

Workload: recursive fib(n) (default fib(22): 57,313 Python calls) computed
`rounds` times in each of `greenlets` gevent greenlets, which yield with
gevent.sleep(0) between rounds -- so call events and greenlet switches are
interleaved, as in a real server.  (Without gevent a raw-greenlet round robin
stands in for the hub; the output says so.)

Configurations, timed in the same process with alternating order: bare;
cProfile; greqprof Profiler(clock="cpu", calls=True) and (clock="wall",
calls=True); yappi cpu and wall with the greenlet backend.

Result per configuration: median time, ratio to bare, ratio to cProfile and
added ns per Python call = (median t_cfg - median t_bare) / fib calls.
Target: greqprof <= cProfile.  See bench/README.md.

    python bench/call_overhead.py            # full run, text table
    python bench/call_overhead.py --markdown # table for README
    python bench/call_overhead.py --quick    # smoke test (seconds)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _benchutil as bu  # noqa: E402

# greqprof rows must not be slower than cProfile (ratio to cProfile <= 1.0)
TARGET_VS_CPROFILE = 1.0
GREQPROF_KEYS = ("greqprof-cpu", "greqprof-wall")


def configs():
    return [
        bu.Bare(),
        bu.CProfile(),
        bu.Greqprof("greqprof-cpu",
                    'greqprof cpu (clock="cpu", calls=True)',
                    clock="cpu", calls=True),
        bu.Greqprof("greqprof-wall",
                    'greqprof wall (clock="wall", calls=True)',
                    clock="wall", calls=True),
        bu.Yappi("cpu"),
        bu.Yappi("wall"),
    ]


def fib(n):
    if n < 2:
        return n
    return fib(n - 1) + fib(n - 2)


def fib_calls(n):
    """Number of fib() calls made by fib(n)."""
    a, b = 1, 1            # calls(0), calls(1)
    if n < 2:
        return 1
    for _ in range(n - 1):
        a, b = b, a + b + 1
    return b


def make_gevent(ngreenlets, rounds, n):
    import gevent

    clock = bu.timer()
    gevent.sleep(0)        # create the hub outside any measurement

    def worker():
        sleep = gevent.sleep
        for _ in range(rounds):
            fib(n)
            sleep(0)

    def workload():
        gs = [gevent.spawn(worker) for _ in range(ngreenlets)]
        t0 = clock()
        gevent.joinall(gs)
        t1 = clock()
        return t1 - t0

    return workload


def make_raw(ngreenlets, rounds, n):
    """Stand-in when gevent is missing: the main greenlet round-robins."""
    from greenlet import greenlet, getcurrent

    clock = bu.timer()

    def workload():
        main = getcurrent()

        def worker():
            back = main.switch
            for _ in range(rounds):
                fib(n)
                back()

        gs = [greenlet(worker) for _ in range(ngreenlets)]
        t0 = clock()
        while gs:
            for g in gs:
                g.switch()
            gs = [g for g in gs if not g.dead]
        t1 = clock()
        return t1 - t0

    return workload


def check_recorded(cfgs, expected):
    """fib calls each greqprof profiler recorded in its last timed run
    (FuncStat.ncall of fib): a profiler that misses calls would look
    cheap."""
    out = {}
    for cfg in cfgs:
        prof = getattr(cfg, "last", None)
        if prof is None:
            continue
        try:
            n = sum(f.ncall for f in prof.func_stats()
                    if f.name == "fib" or f.qualname == "fib")
            out[cfg.key] = {"fib_calls_recorded": n,
                            "fib_calls_expected": expected,
                            "ok": n == expected}
        except Exception as exc:
            out[cfg.key] = {"error": "%s: %s" % (type(exc).__name__, exc),
                            "ok": False}
        cfg.last = None
    return out


def recorded_lines(recorded):
    lines = []
    for key, r in recorded.items():
        if "error" in r:
            lines.append("check: %s: could not read func_stats(): %s"
                         % (key, r["error"]))
        else:
            lines.append("check: %s recorded %d fib calls (expected %d)%s" % (
                key, r["fib_calls_recorded"], r["fib_calls_expected"],
                "" if r["ok"] else " -- MISMATCH"))
    return lines


def analyse(cfgs, res, ncalls, quick):
    base = res["bare"]["times_ns"]
    mb = bu.median(base)
    cp = res.get("cprofile", {}).get("times_ns") or []
    mc = bu.median(cp)
    rows = []
    for cfg in cfgs:
        r = res[cfg.key]
        row = {"key": cfg.key, "label": cfg.label + (
            " " + cfg.note if cfg.note else ""),
            "status": r["status"], "reason": r["reason"],
            "times_ns": r["times_ns"]}
        if r["status"] == "ok" and r["times_ns"] and mb:
            m = bu.median(r["times_ns"])
            row["median_ms"] = m / 1e6
            row["ratio_to_bare"] = m / mb
            # paired per-repetition ratios: spread of the slowdown
            pr = [a / b for a, b in zip(r["times_ns"], base)]
            row["paired_ratio_median"] = bu.median(pr)
            row["paired_ratio_iqr"] = bu.iqr(pr)
            if cfg.key != "bare":
                row["added_ns_per_call"] = (m - mb) / ncalls
            if mc:
                row["ratio_to_cprofile"] = m / mc
            if cfg.key in GREQPROF_KEYS:
                row["target_ratio_to_cprofile"] = TARGET_VS_CPROFILE
                if quick:
                    row["meets_target"] = None
                elif mc:
                    row["meets_target"] = m / mc <= TARGET_VS_CPROFILE
                else:
                    row["meets_target"] = None   # no cProfile to compare
        rows.append(row)
    return rows


HEADERS = ["configuration", "median ms", "× bare", "paired × bare (IQR)",
           "× cProfile", "added ns/call", "target", "verdict"]


def table_rows(rows):
    out, notes = [], []
    for r in rows:
        tgt = "≤ 1.00 × cProfile" if r["key"] in GREQPROF_KEYS else ""
        if r["status"] != "ok":
            notes.append("%s skipped: %s" % (r["key"], r["reason"]))
            out.append([r["label"], "skipped [%d]" % len(notes), "", "", "",
                        "", tgt, "skipped"])
            continue
        lo, hi = r.get("paired_ratio_iqr", (None, None))
        if not tgt:
            verdict = ""
        elif r.get("meets_target") is None:
            verdict = ("not judged (--quick)" if "target_ratio_to_cprofile"
                       in r and r.get("ratio_to_cprofile") is not None
                       else "not judged")
        else:
            verdict = "meets" if r["meets_target"] else "MISSES"
        out.append([
            r["label"],
            bu.fmt(r.get("median_ms"), "%.1f"),
            bu.fmt(r.get("ratio_to_bare"), "%.2f"),
            "" if lo is None or r["key"] == "bare"
            else "%.2f (%.2f … %.2f)" % (r["paired_ratio_median"], lo, hi),
            bu.fmt(r.get("ratio_to_cprofile"), "%.2f"),
            "—" if r["key"] == "bare" else bu.fmt(
                r.get("added_ns_per_call"), "%+.0f"),
            tgt,
            verdict,
        ])
    return out, notes


def main(argv=None):
    p = bu.base_argparser(__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=None,
                   help="fib argument (default 22, 15 with --quick)")
    p.add_argument("--greenlets", type=int, default=None,
                   help="greenlets (default 4, 2 with --quick)")
    p.add_argument("--rounds", type=int, default=None,
                   help="fib(n) per greenlet, sleep(0) after each (default 5, "
                        "2 with --quick)")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 when a greqprof row misses its target")
    args = p.parse_args(argv)

    if args.list:
        for c in configs():
            print("%-20s %s" % (c.key, c.label))
        return 0
    cfgs = bu.select(configs(), args.only)
    if args.only and "cprofile" not in {c.key for c in cfgs}:
        bu.log("note: cprofile not selected: no '× cProfile' column values")

    reps = args.reps or (2 if args.quick else 7)
    n = args.n if args.n is not None else (15 if args.quick else 22)
    ngl = args.greenlets or (2 if args.quick else 4)
    rounds = args.rounds or (2 if args.quick else 5)
    ncalls = ngl * rounds * fib_calls(n)

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
    try:
        wl = make_gevent(ngl, rounds, n)
        sched = "gevent (gevent.sleep(0) between rounds)"
    except Exception as exc:
        wl = make_raw(ngl, rounds, n)
        sched = ("raw greenlet round robin (gevent not usable: %s: %s)"
                 % (type(exc).__name__, exc))
    desc = "fib(%d) x %d rounds in %d greenlets, %s; %d fib calls per run" % (
        n, rounds, ngl, sched, ncalls)
    bu.log("workload: " + desc)

    wl()                                   # warm up
    res = bu.run_alternating(cfgs, wl, reps, label="calls")
    rows = analyse(cfgs, res, ncalls, args.quick)
    recorded = check_recorded(cfgs, ncalls)
    misses = ["%s: %.2f × cProfile" % (r["key"], r["ratio_to_cprofile"])
              for r in rows if r.get("meets_target") is False]

    payload = {"benchmark": "call_overhead", "quick": args.quick,
               "reps": reps, "timer": timer, "pinned_cpu": pinned, "machine": info,
               "bare_spread_pct": bu.spread_pct(res["bare"]["times_ns"]),
               "target_ratio_to_cprofile": TARGET_VS_CPROFILE,
               "workload": {"description": desc, "n": n, "greenlets": ngl,
                            "rounds": rounds, "scheduler": sched,
                            "fib_calls_per_run": ncalls},
               "rows": rows, "recorded": recorded}

    bu.finish_info(info)
    cells, notes = table_rows(rows)
    checks = recorded_lines(recorded)
    out = []
    if args.markdown:
        out.append("### Call-heavy workload slowdown%s" % (
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
        out.append("Workload: %s; median of %d alternating reps; bare "
                   "run-to-run spread (IQR) %s%%." % (
                       desc, reps, bu.fmt(payload["bare_spread_pct"], "%.1f")))
        out.append("")
        out.append(bu.md_table(HEADERS, cells))
        out.append("")
        for i, note in enumerate(notes, 1):
            out.append("[%d] %s  " % (i, note))
        for c in checks:
            out.append(c + "  ")
        if notes or checks:
            out.append("")
        out.append("`python bench/call_overhead.py --markdown`; × bare and "
                   "× cProfile are ratios of medians; added ns/call = "
                   "(median t_cfg − median t_bare) / fib calls; paired = "
                   "per-repetition ratios (median and interquartile "
                   "range).%s" % (
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
        out.append("")
        out.append("== %s; median of %d reps; bare spread (IQR) %s%%%s" % (
            desc, reps, bu.fmt(payload["bare_spread_pct"], "%.1f"),
            " [QUICK: numbers meaningless]" if args.quick else ""))
        out.append(bu.text_table(HEADERS, cells))
        for i, note in enumerate(notes, 1):
            out.append("  [%d] %s" % (i, note))
        for c in checks:
            out.append("  " + c)
    if misses:
        out.append("")
        out.append("TARGET MISSED (greqprof ≤ cProfile): "
                   + "; ".join(misses))
    print("\n".join(out))

    if args.json:
        bu.write_json(args.json, payload)
    return 1 if (args.strict and misses) else 0


if __name__ == "__main__":
    sys.exit(main())
