"""How long the route table's periodic passes hold the GIL, by table size.

    python bench/route_tables.py [--routes 500,4000] [--repeat 15]

The drain loop of each serving thread (a greenlet, so the event loop waits
meanwhile) takes a snapshot for the recent window once a minute
(RouteAggregates.tick) and builds the summary line once per summary_s
(summary_records + summary_line); the inspector's Routes page and
mw.routes() read the whole table (to_records, since start or recent).
Each table has N routes of 5 requests each, every tenth route sampled
once; "busy" is the share of routes that counted requests since the last
snapshot.  Prints the minimum over --repeat runs in milliseconds (the
machine's noise only adds).  Run it with PYTHONPATH at another checkout
to compare (an older tree without summary_records times to_records for
the summary, which is what it ran).
"""
import argparse
import random
import time

from greqprof import _registry, routes
from greqprof.routes import RECENT_STEP_S, RouteAggregates


def table(n, seed=1):
    agg = RouteAggregates(_registry.RouteCounts, max_routes=n + 10)
    rnd = random.Random(seed)
    for i in range(n):
        for _ in range(5):
            agg.counts.record("/r%d" % i, 200, False,
                              rnd.lognormvariate(-5, 1))
        if i % 10 == 0:
            agg.add_sampled("/r%d" % i, 0.001, 0.001)
    return agg, rnd


def touch(agg, rnd, n, busy):
    for i in range(0, n, max(1, round(1 / busy))):
        agg.counts.record("/r%d" % i, 200, False, rnd.lognormvariate(-5, 1))


def best(fn, repeat):
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out) * 1e3


def time_tick(n, busy, repeat):
    agg, rnd = table(n)
    now = [1000.0]
    agg.tick(now=now[0])
    runs = []
    for _ in range(repeat):
        touch(agg, rnd, n, busy)
        now[0] += RECENT_STEP_S
        t0 = time.perf_counter()
        agg.tick(now=now[0])
        runs.append(time.perf_counter() - t0)
    return min(runs) * 1e3


def time_recent(n, busy, repeat):
    agg, rnd = table(n)
    agg.tick(now=1000.0)
    touch(agg, rnd, n, busy)
    return best(lambda: agg.to_records("recent", now=1030.0), repeat)


def time_since_start(n, repeat):
    agg, _ = table(n)
    return best(agg.to_records, repeat)


def time_summary(n, repeat):
    agg, _ = table(n)
    read = getattr(agg, "summary_records", agg.to_records)
    return best(lambda: routes.summary_line(read(), 100, 60), repeat)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--routes", default="500,4000",
                    help="table sizes, comma-separated (default 500,4000)")
    ap.add_argument("--repeat", type=int, default=15)
    a = ap.parse_args()
    sizes = [int(x) for x in a.routes.split(",")]
    print("| pass | " + " | ".join("%d routes" % n for n in sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    rows = [
        ("recent-window snapshot (tick), 5 % busy",
         lambda n: time_tick(n, 0.05, a.repeat)),
        ("summary line (summary_records + summary_line)",
         lambda n: time_summary(n, a.repeat)),
        ("to_records() since start", lambda n: time_since_start(n, a.repeat)),
        ('to_records("recent"), 5 % busy',
         lambda n: time_recent(n, 0.05, a.repeat)),
        ('to_records("recent"), all busy',
         lambda n: time_recent(n, 1.0, a.repeat)),
    ]
    for label, fn in rows:
        print("| %s | " % label + " | ".join(
            "%.1f ms" % fn(n) for n in sizes) + " |", flush=True)


if __name__ == "__main__":
    main()
