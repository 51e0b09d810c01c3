"""gunicorn configuration: the example app under gunicorn's gevent worker,
profiled by greqprof.

    .venv/bin/gunicorn -c examples/gunicorn.conf.py
    GREQPROF_PCT=1 .venv/bin/gunicorn -c examples/gunicorn.conf.py --preload
    GREQPROF_JSON_LOGS=1 PROFILE_LOG_FILE=/tmp/greqprof.jsonl \\
        .venv/bin/gunicorn -c examples/gunicorn.conf.py --max-requests 1000
    GREQPROF_OTEL=1 OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 \\
        .venv/bin/gunicorn -c examples/gunicorn.conf.py

Every greqprof option comes from the GREQPROF_* environment variables
(docs/production.md has the table), read when each worker builds its
middleware.  Command-line flags (-b, -w, --max-requests, --preload ...) win
over the settings below, as usual with gunicorn.

How the middleware is put in: the app module (examples/wsgi_app.py) exports
the plain WSGI app, and the post_worker_init hook below wraps it in each
worker, after gunicorn's gevent worker has monkey-patched and forked.  So
every worker has its own ProfilingMiddleware, built in its own process,
whether or not the app was imported in the master first (--preload).
Wrapping in the app module (``application = ProfilingMiddleware(app)``)
works too; the hook keeps the app module free of profiling code.

With GREQPROF_OTEL=1 each worker also sets up OpenTelemetry tracing (an
OTLP/HTTP exporter configured by the OTEL_* variables) around the
middleware; see docs/production.md.

Reports go to the ``greqprof`` logger, configured below: text reports and
blocking WARNINGs on stderr with the worker's pid, or, with
GREQPROF_JSON_LOGS=1, one JSON object per line (the pid is in each object),
appended to the file named by PROFILE_LOG_FILE when it is set.
"""
import os

# Imported here, in the master before gunicorn's gevent worker
# monkey-patches, so that greqprof's per-thread state uses real thread
# locals (docs/production.md, "Under gunicorn").
import greqprof  # noqa: F401

HERE = os.path.dirname(os.path.abspath(__file__))

# -- server -----------------------------------------------------------------
wsgi_app = "wsgi_app:app"        # examples/wsgi_app.py, without profiling
pythonpath = HERE
bind = "127.0.0.1:8088"
worker_class = "gevent"
workers = 2
worker_connections = 1000
# Restarting workers now and then bounds any slow leak (the app's, or a
# profiler's); each new worker profiles from its first request.
max_requests = 0                 # e.g. --max-requests 10000
max_requests_jitter = 0
timeout = 30
graceful_timeout = 10


# -- profiling ----------------------------------------------------------------
def post_worker_init(worker):
    """Wraps the worker's app in greqprof's middleware (in the worker, after
    the fork and gevent's monkey-patching), unless the app module did."""
    from greqprof import ProfilingMiddleware
    from greqprof.otel import OtelObserver   # needs no opentelemetry
    mw = worker.wsgi
    if not isinstance(mw, ProfilingMiddleware):
        # Options from GREQPROF_*; an invalid value raises ConfigError here
        # and the worker fails to boot, so a typo cannot go unnoticed.
        mw = ProfilingMiddleware(mw)
    app = mw
    if any(isinstance(o, OtelObserver) for o in mw.observers):
        app = _traced(mw)
    worker.wsgi = app
    worker.greqprof = mw
    worker.log.info("Profiling with greqprof in worker %s: %r", worker.pid,
                    mw)


def worker_exit(server, worker):
    """Delivers the profiles still waiting for their requests' greenlets
    (see the middleware's linger option) before the worker goes away, then
    sends the spans OpenTelemetry still has queued."""
    mw = getattr(worker, "greqprof", None)
    if mw is not None:
        mw.flush()
    _flush_otel()


def _flush_otel(timeout_millis=5000):
    """Exports what the tracer provider's batch processors hold, now: the
    worker can still run threads here.  Left to the provider's atexit
    shutdown, the spans are lost on CPython 3.12.0/3.12.1, which refuses to
    start the exporter's thread while the interpreter shuts down."""
    import sys
    otel_trace = sys.modules.get("opentelemetry.trace")
    if otel_trace is None:        # GREQPROF_OTEL off: nothing was traced
        return
    flush = getattr(otel_trace.get_tracer_provider(), "force_flush", None)
    if flush is not None:         # (the API's no-op provider has none)
        flush(timeout_millis)


def _traced(app):
    """GREQPROF_OTEL=1: OpenTelemetry traces of every request, with
    greqprof's attributes and events, sent over OTLP/HTTP in batches.  The
    exporter reads OTEL_EXPORTER_OTLP_ENDPOINT (default
    http://localhost:4318), OTEL_SERVICE_NAME and the other OTEL_*
    variables.  Needs opentelemetry-sdk, opentelemetry-instrumentation-wsgi
    and opentelemetry-exporter-otlp-proto-http."""
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter)
    from opentelemetry.instrumentation.wsgi import OpenTelemetryMiddleware
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    # One provider per worker, made after the fork: the batch processor's
    # thread belongs to this process.  worker_exit sends what is still
    # queued when the worker exits (_flush_otel).
    provider = TracerProvider(resource=Resource.create())
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    # The tracing middleware outside, so greqprof sees the request's span.
    return OpenTelemetryMiddleware(app, tracer_provider=provider)


# -- logging ------------------------------------------------------------------
# Not a GREQPROF_* variable on purpose: those are the middleware's options,
# and it rejects names it does not know.
LOG_FILE = os.environ.get("PROFILE_LOG_FILE")
_json = os.environ.get("GREQPROF_JSON_LOGS", "").strip().lower() in (
    "1", "true", "yes", "on")

_greqprof_handlers = ["greqprof_stderr"]
_handlers = {
    "greqprof_stderr": {
        "class": "logging.StreamHandler",
        "formatter": "greqprof_json" if _json else "greqprof_text",
        "stream": "ext://sys.stderr",
    },
}
if LOG_FILE:
    _greqprof_handlers = ["greqprof_file"]
    _handlers["greqprof_file"] = {
        "class": "logging.FileHandler",
        "formatter": "greqprof_json" if _json else "greqprof_text",
        "filename": LOG_FILE,
        "mode": "a",           # O_APPEND: every worker appends whole lines
        "encoding": "utf-8",
    }

logconfig_dict = {
    "version": 1,
    "disable_existing_loggers": False,
    # gunicorn merges this dict over its own defaults key by key, so its
    # loggers and handlers are repeated here.
    "root": {"level": "INFO", "handlers": ["console"]},
    "loggers": {
        "gunicorn.error": {"level": "INFO", "handlers": ["error_console"],
                           "propagate": False, "qualname": "gunicorn.error"},
        "gunicorn.access": {"level": "INFO", "handlers": ["console"],
                            "propagate": False,
                            "qualname": "gunicorn.access"},
        "greqprof": {"level": "INFO", "handlers": _greqprof_handlers,
                     "propagate": False},
    },
    "handlers": dict(_handlers, **{
        "console": {"class": "logging.StreamHandler", "formatter": "generic",
                    "stream": "ext://sys.stdout"},
        "error_console": {"class": "logging.StreamHandler",
                          "formatter": "generic",
                          "stream": "ext://sys.stderr"},
    }),
    "formatters": {
        "generic": {
            "format": "%(asctime)s [%(process)d] [%(levelname)s] %(message)s",
            "datefmt": "[%Y-%m-%d %H:%M:%S %z]",
        },
        # The text report is several lines; the prefix names the worker.
        "greqprof_text": {
            "format": "%(asctime)s [%(process)d] [%(levelname)s] "
                      "[%(name)s] %(message)s",
            "datefmt": "[%Y-%m-%d %H:%M:%S %z]",
        },
        # One JSON object per record and nothing else, for log shippers.
        "greqprof_json": {"format": "%(message)s"},
    },
}
