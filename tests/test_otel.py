"""OpenTelemetry export (greqprof/otel.py, the ``otel`` extra).

The request's span is made by opentelemetry-instrumentation-wsgi's
``OpenTelemetryMiddleware`` wrapping ours, as in production:
``OpenTelemetryMiddleware(ProfilingMiddleware(app, otel=True))``, served by
a real ``gevent.pywsgi`` server on 127.0.0.1.  Spans are collected with the
SDK's InMemorySpanExporter, and in the last tests sent by the real OTLP/HTTP
exporter to a receiver this test runs on 127.0.0.1 that decodes them with
opentelemetry-proto.

Needs: opentelemetry-api opentelemetry-sdk opentelemetry-instrumentation-wsgi
opentelemetry-exporter-otlp-proto-http opentelemetry-proto (skipped
without them, except the test that greqprof works without opentelemetry).
"""
import gzip
import http.server as httpserver
import importlib
import sys
import threading
import time

import gevent
import pytest

from greqprof import ConfigError, ProfilingMiddleware

from test_middleware import (http, serve,  # noqa: F401
                             wait_for)

pytestmark = pytest.mark.timeout(60)

OTEL_MISSING_MESSAGE = "otel=True needs `pip install greqprof[otel]`"


def _have(*modules):
    try:
        for m in modules:
            importlib.import_module(m)
    except ImportError:
        return False
    return True


needs_sdk = pytest.mark.skipif(
    not _have("opentelemetry.sdk.trace",
              "opentelemetry.instrumentation.wsgi"),
    reason="needs opentelemetry-sdk and opentelemetry-instrumentation-wsgi")
needs_otlp = pytest.mark.skipif(
    not _have("opentelemetry.exporter.otlp.proto.http.trace_exporter",
              "opentelemetry.proto.collector.trace.v1.trace_service_pb2"),
    reason="needs opentelemetry-exporter-otlp-proto-http and "
           "opentelemetry-proto")

BLOCK_S = 0.12
BLOCKING_MS = 50


# ---------------------------------------------------------------------------
# the app

def _child():
    gevent.sleep(0.02)
    sum(range(20000))


def _late_child():
    # Runs after the response has ended: its spans belong to the request
    # but come after the request's span has ended.
    gevent.sleep(0.05)
    sum(range(20000))
    gevent.sleep(0)
    sum(range(20000))


def blocking_handler():
    time.sleep(BLOCK_S)  # gevent is not monkey-patched: holds the loop


def app(environ, start_response):
    path = environ["PATH_INFO"]
    if path == "/block":
        blocking_handler()
    elif path == "/children":
        gevent.spawn(_child).join()
    elif path == "/fire":
        gevent.spawn(_late_child)   # not joined
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok\n"]


# ---------------------------------------------------------------------------
# fixtures

@pytest.fixture(scope="module")
def provider():
    """One SDK TracerProvider for the module, also the global one (the
    ``otel=True`` path uses the global provider), with an in-memory
    exporter."""
    if not _have("opentelemetry.sdk.trace"):
        pytest.skip("needs opentelemetry-sdk")
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import \
        InMemorySpanExporter
    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(tp)
    if trace.get_tracer_provider() is not tp:
        pytest.skip("another global TracerProvider is already set")
    tp.test_exporter = exporter
    yield tp
    tp.shutdown()


@pytest.fixture
def spans(provider):
    provider.test_exporter.clear()
    return provider.test_exporter


@pytest.fixture
def traced(serve, provider):  # noqa: F811
    """traced(**middleware_options) -> Served: our middleware inside
    OpenTelemetryMiddleware, served by pywsgi."""
    from opentelemetry.instrumentation.wsgi import OpenTelemetryMiddleware

    def start(tracer_provider=provider, **kw):
        kw.setdefault("pct", 1.0)
        kw.setdefault("blocking_ms", BLOCKING_MS)
        kw.setdefault("linger", 0.3)
        kw.setdefault("report", False)
        return serve(app, wrap=lambda mw: OpenTelemetryMiddleware(
            mw, tracer_provider=tracer_provider), **kw)
    return start


def server_span(exporter, path, timeout=10.0):
    """The finished SERVER span of the request to `path`."""
    from opentelemetry.trace import SpanKind

    def find():
        return [s for s in exporter.get_finished_spans()
                if s.kind == SpanKind.SERVER
                and span_path(s.attributes) == path]
    found = wait_for(find, timeout, "the server span of %s" % path)
    assert len(found) == 1, found
    return found[0]


def span_path(attrs):
    """The request path of a server span (old or new HTTP conventions)."""
    for key in ("url.path", "http.target"):
        if attrs.get(key):
            return attrs[key].split("?")[0]
    url = attrs.get("http.url") or attrs.get("url.full") or ""
    return "/" + url.split("://", 1)[-1].partition("/")[2].split("?")[0]


def greqprof_attrs(span):
    return {k: v for k, v in span.attributes.items()
            if k.startswith("greqprof.")}


SAMPLED_KEYS = {"greqprof.sampled", "greqprof.cpu_ms", "greqprof.wall_ms",
                "greqprof.spans", "greqprof.longest_span_ms",
                "greqprof.waiting_ms", "greqprof.greenlets"}
EVENT_KEYS = {"wall_ms", "cpu_ms", "greenlet", "greenlet_id", "fn_name",
              "stack"}


# ---------------------------------------------------------------------------
# without opentelemetry

@pytest.fixture
def no_opentelemetry(monkeypatch):
    """Makes ``import opentelemetry`` fail, as when it is not installed."""
    for name in list(sys.modules):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "opentelemetry", None)


def test_without_opentelemetry_otel_is_a_config_error(no_opentelemetry):
    # greqprof itself, and its otel module, import without opentelemetry.
    import greqprof.otel
    importlib.reload(greqprof.otel)
    with pytest.raises(ConfigError) as e:
        greqprof.otel.OtelObserver()
    assert str(e.value) == OTEL_MISSING_MESSAGE
    for kw in ({"otel": True}, {"otel": True, "otel_spans": True},
               {"environ": {"GREQPROF_OTEL": "1"}}):
        with pytest.raises(ConfigError) as e:
            ProfilingMiddleware(app, **kw)
        assert str(e.value).startswith(OTEL_MISSING_MESSAGE)
        if "environ" in kw:  # names the variable that asked for it
            assert str(e.value).endswith("(set by GREQPROF_OTEL)")
    # Off (the default), opentelemetry is never needed.
    mw = ProfilingMiddleware(app, environ={})
    assert mw.observers == []


@needs_sdk
def test_otel_options_add_the_observer(provider):
    from greqprof.otel import OtelObserver
    mw = ProfilingMiddleware(app, otel=True, environ={})
    [obs] = mw.observers
    assert isinstance(obs, OtelObserver) and obs.child_spans is False
    mw = ProfilingMiddleware(app, environ={"GREQPROF_OTEL": "1",
                                           "GREQPROF_OTEL_SPANS": "1"})
    [obs] = mw.observers
    assert isinstance(obs, OtelObserver) and obs.child_spans is True
    # otel_spans alone does not turn the export on
    assert ProfilingMiddleware(app, otel_spans=True,
                               environ={}).observers == []
    # explicit observers are kept, the OtelObserver comes after them
    mine = object()
    mw = ProfilingMiddleware(app, otel=True, observers=[mine], environ={})
    assert mw.observers[0] is mine
    assert isinstance(mw.observers[1], OtelObserver)


# ---------------------------------------------------------------------------
# attributes and events on the request's span

@needs_sdk
def test_sampled_request_attributes_and_blocking_event(traced, spans):
    s = traced(otel=True)
    rid = "otel-block-1"
    assert http(s.port, "/block", headers=[("X-Request-ID", rid)]).status \
        == 200
    profile = s.profile_for("/block")
    span = server_span(spans, "/block")
    attrs = greqprof_attrs(span)
    assert set(attrs) == SAMPLED_KEYS, attrs
    assert attrs["greqprof.sampled"] is True
    # The numbers of the partial profile taken at the end of the response:
    # the final profile can only have more.
    assert 0 < attrs["greqprof.wall_ms"] <= profile.wall * 1000 + 1e-6
    assert attrs["greqprof.wall_ms"] >= BLOCK_S * 1000
    assert attrs["greqprof.longest_span_ms"] >= BLOCK_S * 1000
    assert 1 <= attrs["greqprof.spans"] <= len(profile.spans) + \
        profile.dropped_spans
    assert 1 <= attrs["greqprof.greenlets"] <= len(profile.greenlets)
    # (CPU time is an estimate, and the longest span can have started
    # before the middleware was called: neither is bounded by wall_ms.)
    assert attrs["greqprof.cpu_ms"] >= 0
    assert 0 <= attrs["greqprof.waiting_ms"] <= attrs["greqprof.wall_ms"]
    assert all(isinstance(attrs[k], (int, float)) for k in SAMPLED_KEYS
               if k != "greqprof.sampled")
    # One event for the blocking span, the same as the profile's.  (On a
    # busy machine other spans may hold the loop past 50 ms too: judge the
    # handler's; every event is one of the profile's.)
    events = [e for e in span.events if e.name == "greqprof.blocking"]
    starts = {int(round(b.start * 1e9)): b for b in profile.blocking}
    assert all(e.timestamp in starts for e in events), span.events
    mine = [e for e in events
            if "blocking_handler" in (e.attributes.get("stack") or "")]
    assert len(mine) == 1, span.events
    [ev] = mine
    blocking = starts[ev.timestamp]
    assert set(ev.attributes) == EVENT_KEYS
    assert ev.attributes["wall_ms"] == pytest.approx(blocking.wall * 1000)
    assert ev.attributes["wall_ms"] >= BLOCK_S * 1000
    assert ev.attributes["cpu_ms"] == pytest.approx(blocking.cpu * 1000)
    assert ev.attributes["greenlet"] == blocking.greenlet_name
    assert ev.attributes["greenlet_id"] == blocking.greenlet_id
    assert ev.attributes["fn_name"] == blocking.fn_name
    assert "blocking_handler" in ev.attributes["stack"]
    assert ev.timestamp == int(round(blocking.start * 1e9))
    assert span.start_time <= ev.timestamp <= span.end_time
    assert s.mw.stats["errors"] == 0


@needs_sdk
def test_sampled_request_without_blocking_has_no_event(traced, spans):
    # (well above what a light request may take on a busy machine)
    s = traced(otel=True, blocking_ms=500)
    assert http(s.port, "/children").status == 200
    profile = s.profile_for("/children")
    span = server_span(spans, "/children")
    attrs = greqprof_attrs(span)
    assert set(attrs) == SAMPLED_KEYS
    # the request greenlet and the child it joined
    assert attrs["greqprof.greenlets"] == len(profile.greenlets) == 2
    assert attrs["greqprof.spans"] >= 2
    assert not [e for e in span.events if e.name == "greqprof.blocking"]
    assert profile.blocking == []


@needs_sdk
def test_unsampled_request_gets_blocking_events(traced, spans):
    s = traced(otel=True, pct=0.0)
    assert http(s.port, "/block").status == 200
    assert http(s.port, "/children").status == 200
    block = server_span(spans, "/block")
    assert greqprof_attrs(block) == {"greqprof.sampled": False}
    # (on a busy machine other spans may hold the loop past 50 ms too:
    # judge the handler's)
    def handlers(sp):
        return [e for e in sp.events if e.name == "greqprof.blocking"
                and "blocking_handler" in (e.attributes.get("stack") or "")]
    events = handlers(block)
    assert len(events) == 1, block.events
    assert events[0].attributes["wall_ms"] >= BLOCK_S * 1000
    other = server_span(spans, "/children")
    assert greqprof_attrs(other) == {"greqprof.sampled": False}
    # nothing of /block's on /children, and no event but blocking ones
    assert not handlers(other), other.events
    assert all(e.name == "greqprof.blocking" for e in other.events)
    assert s.profiles == [] and s.mw.stats["errors"] == 0


@needs_sdk
def test_no_recording_span_no_export(serve, spans):  # noqa: F811
    """Without a tracing middleware there is no current span: the observer
    does nothing (and costs a get_current_span() per request)."""
    s = serve(app, pct=1.0, otel=True, otel_spans=True,
              blocking_ms=BLOCKING_MS, linger=0.1, report=False)
    assert s.get("/block").status == 200
    s.profile_for("/block")
    gevent.sleep(0.2)
    assert spans.get_finished_spans() == ()
    assert s.mw.stats["errors"] == 0


# ---------------------------------------------------------------------------
# child spans, after linger

def check_child_spans(parent, children, profile, outlived_parent=True):
    """One child span per greenlet span of the profile, with its times,
    under `parent` (proto or SDK objects, normalised by the caller)."""
    assert len(children) == len(profile.spans) > 0
    want = sorted((int(round(s.start * 1e9)), int(round(s.end * 1e9)),
                   s.greenlet_id) for s in profile.spans)
    got = sorted((c["start"], c["end"], c["greenlet_id"]) for c in children)
    assert got == want
    for c in children:
        assert c["trace_id"] == parent["trace_id"]
        assert c["parent_id"] == parent["span_id"]
    if outlived_parent:
        # The unjoined child ran after the request's span had ended.
        assert max(c["end"] for c in children) > parent["end"]


def _sdk_span(s):
    return {"trace_id": s.context.trace_id, "span_id": s.context.span_id,
            "parent_id": s.parent.span_id if s.parent else None,
            "start": s.start_time, "end": s.end_time,
            "greenlet_id": s.attributes.get("greqprof.greenlet_id"),
            "name": s.name, "attributes": dict(s.attributes)}


@needs_sdk
def test_child_spans_after_linger(traced, spans):
    from greqprof.otel import SCOPE
    s = traced(environ={"GREQPROF_OTEL": "1", "GREQPROF_OTEL_SPANS": "1"})
    assert http(s.port, "/fire").status == 200
    profile = s.profile_for("/fire")
    parent = server_span(spans, "/fire")
    # on_profile runs right after the sink got the profile
    children = wait_for(
        lambda: [c for c in spans.get_finished_spans()
                 if c.instrumentation_scope.name == SCOPE],
        what="child spans")
    gevent.sleep(0.1)
    children = [_sdk_span(c) for c in spans.get_finished_spans()
                if c.instrumentation_scope.name == SCOPE]
    check_child_spans(_sdk_span(parent), children, profile)
    assert any(c["name"] == "test_otel._late_child" for c in children)
    for c in children:
        a = c["attributes"]
        assert {"greqprof.greenlet_id", "greqprof.greenlet",
                "greqprof.fn_name", "greqprof.wall_ms",
                "greqprof.finished", "greqprof.long"} <= set(a)
    assert s.mw.stats["errors"] == 0


@needs_sdk
def test_no_child_spans_unless_asked(traced, spans):
    from greqprof.otel import SCOPE
    s = traced(otel=True)
    assert http(s.port, "/fire").status == 200
    s.profile_for("/fire")
    server_span(spans, "/fire")
    gevent.sleep(0.1)
    assert not [c for c in spans.get_finished_spans()
                if c.instrumentation_scope.name == SCOPE]


# ---------------------------------------------------------------------------
# the real OTLP/HTTP exporter to a receiver on 127.0.0.1

class _Receiver(httpserver.ThreadingHTTPServer):
    daemon_threads = True


def _handler(received):
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    class Handler(httpserver.BaseHTTPRequestHandler):
        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(n)
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces":
                self.send_response(404)
                self.end_headers()
                return
            req = trace_service_pb2.ExportTraceServiceRequest()
            req.ParseFromString(body)
            received.append((self.headers.get("Content-Type"), req))
            out = trace_service_pb2.ExportTraceServiceResponse()
            data = out.SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass
    return Handler


@pytest.fixture
def otlp_receiver():
    """A tiny OTLP/HTTP trace receiver on 127.0.0.1 (its own OS thread:
    gevent is not monkey-patched here)."""
    received = []
    server = _Receiver(("127.0.0.1", 0), _handler(received))
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    server.received = received
    yield server
    server.shutdown()
    server.server_close()
    t.join(5)


def _any_value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def _attrs(kvs):
    return {kv.key: _any_value(kv.value) for kv in kvs}


def _proto_spans(received):
    out = []
    for content_type, req in received:
        assert content_type == "application/x-protobuf"
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    out.append((ss.scope.name, sp))
    return out


@needs_sdk
@needs_otlp
def test_otlp_http_export(traced, otlp_receiver, monkeypatch):
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import \
        OTLPSpanExporter
    from opentelemetry.proto.trace.v1 import trace_pb2
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from greqprof.otel import SCOPE, OtelObserver
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    endpoint = "http://127.0.0.1:%d/v1/traces" % otlp_receiver.server_port
    tp = TracerProvider(resource=Resource.create(
        {"service.name": "greqprof-test"}))
    # Batch processor (its own thread), as in production: exporting never
    # runs in a request greenlet.
    tp.add_span_processor(BatchSpanProcessor(
        OTLPSpanExporter(endpoint=endpoint, timeout=5),
        schedule_delay_millis=100))
    try:
        s = traced(tracer_provider=tp,
                   observers=[OtelObserver(child_spans=True,
                                           tracer_provider=tp)])
        assert http(s.port, "/block",
                    headers=[("X-Request-ID", "otlp-1")]).status == 200
        assert http(s.port, "/fire").status == 200
        block_profile = s.profile_for("/block")
        fire_profile = s.profile_for("/fire")
        want = 2 + len(block_profile.spans) + len(fire_profile.spans)
        gevent.sleep(0.2)
        assert tp.force_flush(10000)
        wait_for(lambda: len(_proto_spans(otlp_receiver.received)) >= want,
                 what="%d spans at the receiver" % want)
    finally:
        tp.shutdown()

    got = _proto_spans(otlp_receiver.received)
    servers = {}
    children = []
    for scope, sp in got:
        a = _attrs(sp.attributes)
        if sp.kind == trace_pb2.Span.SPAN_KIND_SERVER:
            servers[span_path(a)] = (sp, a)
        elif scope == SCOPE:
            children.append(sp)
    assert set(servers) == {"/block", "/fire"}

    sp, a = servers["/block"]
    assert {k for k in a if k.startswith("greqprof.")} == SAMPLED_KEYS
    assert a["greqprof.sampled"] is True
    assert a["greqprof.longest_span_ms"] >= BLOCK_S * 1000
    assert a["greqprof.greenlets"] >= 1 and a["greqprof.spans"] >= 1
    # (on a busy machine other spans may hold the loop past 50 ms too:
    # judge the handler's)
    events = [e for e in sp.events if e.name == "greqprof.blocking"
              and "blocking_handler" in (_attrs(e.attributes).get("stack")
                                         or "")]
    assert len(events) == 1, sp.events
    ev = _attrs(events[0].attributes)
    assert set(ev) == EVENT_KEYS
    assert ev["wall_ms"] >= BLOCK_S * 1000
    [blocking] = [b for b in block_profile.blocking
                  if int(round(b.start * 1e9)) == events[0].time_unix_nano]
    assert ev["fn_name"] == blocking.fn_name

    for path, profile in (("/block", block_profile),
                          ("/fire", fire_profile)):
        parent, _ = servers[path]
        mine = [c for c in children if c.parent_span_id == parent.span_id]
        check_child_spans(
            {"trace_id": parent.trace_id, "span_id": parent.span_id,
             "end": parent.end_time_unix_nano},
            [{"trace_id": c.trace_id, "parent_id": c.parent_span_id,
              "start": c.start_time_unix_nano, "end": c.end_time_unix_nano,
              "greenlet_id": _attrs(c.attributes)["greqprof.greenlet_id"]}
             for c in mine], profile, outlived_parent=(path == "/fire"))
    assert len(children) == len(block_profile.spans) + \
        len(fire_profile.spans)
