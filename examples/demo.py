"""`make demo`: serve examples/wsgi_app.py with the middleware on a free
loopback port, send a handful of real HTTP requests (one of them blocks the
event loop), print the reports and the blocking warning, and exit."""
import logging
import os
import sys

import gevent
from gevent import pywsgi, socket

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import wsgi_app  # noqa: E402


def get(port, path):
    conn = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        conn.sendall(b"GET " + path + b" HTTP/1.1\r\nHost: demo\r\n"
                     b"Connection: close\r\n\r\n")
        data = b""
        while True:
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
    finally:
        conn.close()
    return data.split(b"\r\n", 1)[0].decode()


def main():
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(levelname)s %(name)s: %(message)s")
    delivered = []
    app = wsgi_app.make_app(pct=1.0, calls=True, sink=delivered.append,
                            linger=0.5)
    server = pywsgi.WSGIServer(("127.0.0.1", 0), app, log=None)
    server.start()
    port = server.server_port
    print("demo: serving examples/wsgi_app.py on http://127.0.0.1:%d" % port)
    paths = [b"/", b"/fire", b"/stream", b"/block"]
    for path in paths:
        print("demo: GET %s -> %s" % (path.decode(), get(port, path)))
    # Two concurrent requests: each profile holds only its own greenlets.
    jobs = [gevent.spawn(get, port, b"/") for _ in range(2)]
    gevent.joinall(jobs, timeout=10)
    deadline = 50
    while len(delivered) < len(paths) + 2 and deadline:
        gevent.sleep(0.1)
        deadline -= 1
    server.stop()
    print("demo: %d profiles delivered; %d blocking span(s) reported"
          % (len(delivered), app.stats["blocking"]))
    return 0 if len(delivered) == len(paths) + 2 and app.stats["blocking"] \
        else 1


if __name__ == "__main__":
    sys.exit(main())
