"""OpenTelemetry export of greqprof's findings (the ``otel`` extra).

    pip install greqprof[otel]

    app = OpenTelemetryMiddleware(ProfilingMiddleware(app, otel=True))

:class:`OtelObserver` is a ProfilingMiddleware observer.  It does not
create the request's span: a tracing middleware outside greqprof (e.g.
opentelemetry-instrumentation-wsgi's ``OpenTelemetryMiddleware``) does, and
the observer decorates that span:

* when the response ends (the span is still open), the numbers of a
  sampled request as ``greqprof.*`` attributes, and one ``greqprof.blocking``
  span event per blocking span, for sampled and unsampled requests alike;
* with ``child_spans=True``, once the profile is complete (after
  ``linger``), one child span per greenlet span of the profile with its real
  start and end times, under the request's span although that one has
  ended by then.

Attribute and event names are listed in docs/production.md.  opentelemetry
is imported lazily: greqprof does not need it unless this observer is used.
"""
from .errors import ConfigError

#: instrumentation scope of the child spans
SCOPE = "greqprof"

_MS = 1000.0


def _ns(seconds):
    return int(round(seconds * 1e9))


class OtelObserver:
    """Puts greqprof's per-request data on the current OpenTelemetry span.

    :param child_spans: also create one child span per greenlet span of
        each sampled request (``GREQPROF_OTEL_SPANS=1``).  Off by default:
        a request can have up to ``max_spans`` of them.
    :param tracer_provider: the TracerProvider for the child spans (default:
        the global one).
    """

    def __init__(self, child_spans=False, tracer_provider=None):
        try:
            from opentelemetry import trace
        except ImportError:
            raise ConfigError(
                "otel=True needs `pip install greqprof[otel]`") from None
        self._trace = trace
        self.child_spans = bool(child_spans)
        self._tracer_provider = tracer_provider
        self._tracer = None
        self._fallback = None  # when a request object has no `observed`

    def __repr__(self):
        return "<OtelObserver child_spans=%r>" % (self.child_spans,)

    # -- per-request state: kept on the request itself ----------------------
    def _remember(self, req, span):
        observed = getattr(req, "observed", None)
        if isinstance(observed, list):
            observed.append((self, span))
            return
        if self._fallback is None:
            import weakref
            self._fallback = weakref.WeakKeyDictionary()
        self._fallback[req] = span

    def _span_of(self, req):
        observed = getattr(req, "observed", None)
        if isinstance(observed, list):
            for owner, span in observed:
                if owner is self:
                    return span
            return None
        if self._fallback is not None:
            return self._fallback.get(req)
        return None

    def _get_tracer(self):
        if self._tracer is None:
            from . import __version__
            self._tracer = self._trace.get_tracer(
                SCOPE, __version__, tracer_provider=self._tracer_provider)
        return self._tracer

    # -- observer hooks ------------------------------------------------------
    def on_begin(self, req):
        """Captures the request's span (the current span, when recording)."""
        span = self._trace.get_current_span()
        if span is not None and span.is_recording():
            self._remember(req, span)

    def on_response_end(self, req, snapshot, blocking_events):
        """The response is done and its span still open: attributes of a
        sampled request, and an event per blocking span (every request)."""
        span = self._span_of(req)
        if span is None or not span.is_recording():
            return
        if snapshot is not None:
            span.set_attributes(self.attributes(snapshot))
        else:
            span.set_attribute("greqprof.sampled", False)
        for ev in blocking_events:
            span.add_event("greqprof.blocking", self.event_attributes(ev),
                           timestamp=_ns(ev.start))

    def on_profile(self, req, profile):
        """The profile is complete: its greenlet spans as child spans."""
        if not self.child_spans:
            return
        parent = self._span_of(req)
        if parent is None:
            return
        ctx = self._trace.set_span_in_context(parent)
        tracer = self._get_tracer()
        for s in profile.spans:
            attrs = {
                "greqprof.greenlet_id": s.greenlet_id,
                "greqprof.greenlet": s.greenlet_name,
                "greqprof.fn_name": s.fn_name,
                "greqprof.wall_ms": s.wall * _MS,
                "greqprof.finished": s.finished,
                "greqprof.long": s.long,
            }
            if s.cpu is not None:
                attrs["greqprof.cpu_ms"] = s.cpu * _MS
            if s.stack:
                attrs["greqprof.stack"] = s.stack
            child = tracer.start_span(
                s.fn_name or s.greenlet_name or "greqprof.span", context=ctx,
                start_time=_ns(s.start), attributes=attrs)
            child.end(end_time=_ns(s.end))

    # -- what is exported ----------------------------------------------------
    @staticmethod
    def attributes(profile):
        """The ``greqprof.*`` span attributes of a (partial) profile."""
        attrs = {
            "greqprof.sampled": True,
            "greqprof.wall_ms": profile.wall * _MS,
            "greqprof.spans": len(profile.spans) + profile.dropped_spans,
            "greqprof.waiting_ms": profile.waiting.seconds * _MS,
            "greqprof.greenlets": len(profile.greenlets),
        }
        if profile.cpu is not None:
            attrs["greqprof.cpu_ms"] = profile.cpu * _MS
        if profile.longest_span is not None:
            attrs["greqprof.longest_span_ms"] = \
                profile.longest_span.wall * _MS
        return attrs

    @staticmethod
    def event_attributes(ev):
        """The attributes of a ``greqprof.blocking`` span event."""
        attrs = {
            "wall_ms": ev.wall * _MS,
            "greenlet": ev.greenlet_name,
            "greenlet_id": ev.greenlet_id,
            "fn_name": ev.fn_name,
        }
        if ev.cpu is not None:
            attrs["cpu_ms"] = ev.cpu * _MS
        stack = ev.sampled_stack or ev.stack
        if stack:
            attrs["stack"] = stack
        return attrs
