"""Where the stack sampler puts the samples of a request that is one CPU
loop followed by its response: a pywsgi server in this process whose app
spins --spin-ms of thread CPU in ``spin()`` and returns a one-byte body,
called --requests times by a client greenlet in the same process
(stack_hz=100, pct=0).  Nearly all of the request's CPU is the loop; the
share of its samples found in ``spin()`` says how far samples move from
the moment of their tick (docs/fleet.md, "the sampler's bias").

    python bench/sampler_bias.py [--spin-ms 20] [--requests 50]
"""
import argparse
import time

from gevent import monkey
monkey.patch_all()

import urllib.request  # noqa: E402

from gevent import pywsgi  # noqa: E402

from greqprof import ProfilingMiddleware, sampler  # noqa: E402


def spin(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spin-ms", type=float, default=20.0)
    ap.add_argument("--requests", type=int, default=50)
    a = ap.parse_args()

    def app(environ, start_response):
        spin(a.spin_ms / 1e3)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"x"]
    srv = pywsgi.WSGIServer(("127.0.0.1", 0),
                            ProfilingMiddleware(app, pct=0, stack_hz=100),
                            log=None)
    srv.start()
    for i in range(a.requests):
        urllib.request.urlopen("http://127.0.0.1:%d/spin/%d"
                               % (srv.server_port, i)).read()
    srv.stop()
    rows = [(n, st) for r, st, n in sampler.samples() if r == "/spin/{id}"]
    total = sum(n for n, _ in rows)
    in_spin = sum(n for n, st in rows if st and st[0][0].endswith("spin"))
    print("stats:", sampler.stats())
    print("samples of the request: %d, in spin(): %d (%.0f %%)"
          % (total, in_spin, 100.0 * in_spin / max(total, 1)))
    for n, st in sorted(rows, key=lambda x: -x[0])[:4]:
        print("  %4d  %s" % (n, " <- ".join(
            "%s:%s" % (f[0].rsplit(".", 1)[-1], f[2]) for f in st[:4])))


if __name__ == "__main__":
    main()
