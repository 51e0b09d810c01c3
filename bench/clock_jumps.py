"""How far the thread CPU clock jumps on this machine, with no profiler.

Every greqprof CPU figure is a difference of CLOCK_THREAD_CPUTIME_ID
readings, so it can be no steadier than that clock.  This script burns
15 ms of thread CPU time at a time, in greenlets of three OS threads with
their own hubs (they hand the GIL to each other), and reports how often
the clock read past the 15 ms it was asked for by more than 1 ms between
two consecutive readings of one loop: a jump no code of the loop could
have used (docs/accuracy.md, "When the clock itself jumps").

    python bench/clock_jumps.py [--rounds N] [--threads K]
"""
import argparse
import statistics
import threading
import time

import gevent

ASK = 0.015


def burn(out):
    gevent.sleep(0)
    clock = time.thread_time
    start = now = clock()
    end = start + ASK
    step = 0.0
    while now < end:
        prev, now = now, clock()
        step = max(step, now - prev)
    out.append((now - start, step))
    gevent.sleep(0)


def hub_thread(k, out):
    gevent.joinall([gevent.spawn(burn, out) for _ in range(k)])
    gevent.get_hub().destroy(destroy_loop=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--threads", type=int, default=3)
    a = ap.parse_args()
    if a.rounds < 1 or a.threads < 1:
        ap.error("--rounds and --threads must be at least 1")
    out = []
    for _ in range(a.rounds):
        ts = [threading.Thread(target=hub_thread, args=(2 + i, out))
              for i in range(a.threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    read = [r for r, _ in out]
    steps = [s for _, s in out]
    over = sum(r > ASK + 0.001 for r in read)
    print("burns of %.0f ms: %d, in %d threads" % (ASK * 1e3, len(out),
                                                  a.threads))
    print("read: median %.2f ms, max %.2f ms; over %.0f ms: %d (%.1f %%)"
          % (statistics.median(read) * 1e3, max(read) * 1e3, ASK * 1e3 + 1,
             over, 100.0 * over / len(read)))
    print("largest step between two consecutive readings: %.2f ms; "
          "steps over 1 ms: %d" % (max(steps) * 1e3,
                                   sum(s > 0.001 for s in steps)))


if __name__ == "__main__":
    main()
