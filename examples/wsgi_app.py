"""The classic demo app, profiled by greqprof.

    python examples/wsgi_app.py [--port 8088] [--pct 1.0] [--calls]

Endpoints:
  /          spawns a few CPU-bound greenlets, some yielding with
             gevent.sleep(0), and joins them
  /block     blocks the event loop with an unpatched time.sleep(0.3)
  /stream    a streaming body of 5 chunks, yielding between them
  /fire      spawns a greenlet and returns without joining it
  /error     raises inside the app
"""
import argparse
import logging
import time

import gevent
from gevent import monkey, pywsgi

from greqprof import ProfilingMiddleware


real_sleep = monkey.get_original("time", "sleep")


def burn(n):
    """Burns roughly n milliseconds of CPU."""
    end = time.thread_time() + n / 1000.0
    x = 0
    while time.thread_time() < end:
        x += 1
    return x


def loop(n, yields):
    for _ in range(yields):
        burn(n)
        gevent.sleep(0)
    burn(n)


def index(environ, start_response):
    workers = [gevent.spawn(loop, 5, 2), gevent.spawn(loop, 3, 0),
               gevent.spawn(loop, 8, 1)]
    gevent.joinall(workers)
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"spawned 3 greenlets\n"]


def block(environ, start_response):
    # The real time.sleep even under gevent.monkey (gunicorn's gevent
    # worker patches it): holds the event loop on purpose.
    real_sleep(0.3)
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"blocked the loop for 300 ms\n"]


def stream(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])

    def body():
        for i in range(5):
            burn(2)
            gevent.sleep(0.01)
            yield b"chunk %d\n" % i
    return body()


def fire(environ, start_response):
    gevent.spawn(loop, 2, 3)  # not joined: still attributed to the request
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"fired\n"]


def error(environ, start_response):
    raise RuntimeError("the app failed")


ROUTES = {"/": index, "/block": block, "/stream": stream, "/fire": fire,
          "/error": error}


def app(environ, start_response):
    handler = ROUTES.get(environ.get("PATH_INFO", "/"))
    if handler is None:
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found\n"]
    return handler(environ, start_response)


def make_app(**kw):
    kw.setdefault("pct", 1.0)
    return ProfilingMiddleware(app, **kw)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8088)
    ap.add_argument("--pct", type=float, default=1.0)
    ap.add_argument("--calls", action="store_true")
    ap.add_argument("--bare", action="store_true",
                    help="serve the app without the middleware")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    wsgi = app if args.bare else make_app(pct=args.pct, calls=args.calls)
    server = pywsgi.WSGIServer((args.host, args.port), wsgi, log=None)
    server.start()   # (bound: --port 0 has its port now)
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(server.server_host,
                                                    server.server_host)
    print("serving on http://%s:%d" % ("[%s]" % host if ":" in host else host,
                                       server.server_port), flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
