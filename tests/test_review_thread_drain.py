"""Probe E: two OS threads with their own hubs.  Thread A's _drain_blocking
takes thread B's long-span record out of the shared _registry.long_spans
(into its local `keep`) and, while A's logging handler waits (GIL released:
real I/O), B finishes its sampled request: B's profile is delivered without
its blocking event, and the WARNING later says "outside any request"."""
import logging
import threading
import time

import gevent
from gevent import pywsgi, socket

from greqprof import ProfilingMiddleware, engine
from test_middleware import burn

EV = {k: threading.Event() for k in ("b_recorded", "a_draining", "b_done")}


def gwait(ev, timeout=10):
    end = time.monotonic() + timeout
    while not ev.is_set() and time.monotonic() < end:
        gevent.sleep(0.005)


class SlowHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.msgs = []

    def emit(self, record):
        self.msgs.append(record.getMessage().split("\n")[0])
        if not EV["a_draining"].is_set():
            EV["a_draining"].set()
            EV["b_done"].wait(10)   # a slow write (GIL released)


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.msgs = []

    def emit(self, record):
        self.msgs.append(record.getMessage().split("\n")[0])


def get(port, path):
    s = socket.create_connection(("127.0.0.1", port), timeout=20)
    s.sendall(("GET %s HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
               % path).encode())
    data = b""
    while True:
        c = s.recv(65536)
        if not c:
            break
        data += c
    s.close()
    return data.split(b"\r\n", 1)[0]


def test_other_threads_record_held_in_keep():
    def app_a(environ, start_response):
        gwait(EV["b_recorded"])
        burn(0.06)
        gevent.sleep(0)
        start_response("200 OK", [])
        return [b"a"]

    def app_b(environ, start_response):
        burn(0.06)
        gevent.sleep(0)             # B's span ends: its record is queued
        EV["b_recorded"].set()
        gwait(EV["a_draining"])
        start_response("200 OK", [])
        return [b"b"]

    profiles_b = []

    def sink_b(p):
        profiles_b.append(p)
        EV["b_done"].set()

    ha, hb = SlowHandler(), Collect()
    logging.getLogger("probeA").addHandler(ha)
    logging.getLogger("probeB").addHandler(hb)
    mwa = ProfilingMiddleware(app_a, pct=1.0, blocking_ms=20, linger=0,
                              logger="probeA", report=False, watchdog=False,
                              sink=lambda p: None)
    mwb = ProfilingMiddleware(app_b, pct=1.0, blocking_ms=20, linger=0,
                              logger="probeB", report=False, watchdog=False,
                              sink=sink_b)
    out = {}

    def serve(name, mw):
        try:
            server = pywsgi.WSGIServer(("127.0.0.1", 0), mw, log=None)
            server.start()
            out[name] = get(server.server_port, "/" + name)
            gevent.sleep(1.5)       # B's drain loop runs once a second
            server.stop()
        finally:
            engine.shutdown()

    ta = threading.Thread(target=serve, args=("a", mwa))
    tb = threading.Thread(target=serve, args=("b", mwb))
    tb.start()
    ta.start()
    ta.join(20)
    tb.join(20)
    print("out", out)
    print("A warnings", ha.msgs)
    print("B warnings", hb.msgs)
    print("B profile blocking", [b.wall for b in profiles_b[0].blocking])
    assert profiles_b[0].blocking, "B's blocking span missing from its profile"
    # (app_b's 60 ms burn, by its CPU: on a loaded machine B's other
    # greenlets, its client's among them, can hold its loop past 20 ms
    # of wall time too, waiting for the GIL)
    mine = [m for m in hb.msgs
            if float(m.split("(CPU ")[1].split(" ms")[0]) >= 50]
    assert mine and all("during GET /b" in m for m in mine), hb.msgs
