"""What naming a request's route costs the unsampled path, without a
server: the middleware (pct=0, no switch hook, no sampler) called
directly, on one path over and over (its name comes from the path cache)
against a new id in every request (/items/<n>/detail: named from the
path each time), beside the bare app.  Medians of --reps runs of --n
calls each, in the same process.

    python bench/route_names.py [--n 20000] [--reps 5]
"""
import argparse
import statistics
import time

from greqprof import ProfilingMiddleware


def app(environ, start_response):
    start_response("200 OK", [])
    return [b"ok"]


def _start_response(*args):
    return None


def per_call(fn, paths):
    t = time.perf_counter()
    for p in paths:
        list(fn({"PATH_INFO": p, "SCRIPT_NAME": "", "REQUEST_METHOD": "GET"},
                _start_response))
    return (time.perf_counter() - t) / len(paths) * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    mw = ProfilingMiddleware(app, pct=0.0, report=False, stack_hz=0,
                             blocking_ms=None, summary_s=None)
    rows = {"bare app": [], "one path (cached)": [],
            "a new id each request": []}
    for k in range(args.reps):   # (alternating: the host's drift shared)
        rows["bare app"].append(per_call(app, ["/x"] * args.n))
        rows["one path (cached)"].append(
            per_call(mw, ["/items/42/detail"] * args.n))
        rows["a new id each request"].append(per_call(
            mw, ["/items/%d/detail" % (k * args.n + i)
                 for i in range(args.n)]))
    for name, v in rows.items():
        print("%-24s %6.2f us a call (median of %d)"
              % (name, statistics.median(v), len(v)))
    print("routes counted:", {r["route"]: r["requests"]
                              for r in mw.routes()})


if __name__ == "__main__":
    main()
