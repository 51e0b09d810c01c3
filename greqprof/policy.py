"""Which requests get a profile: the validated options (Config), the
trigger header, and the draw of each request the C path hands over."""
import hmac

from . import config
from .errors import ConfigError


class Config:
    """Validated options shared by the middleware and its engines."""

    def __init__(self, pct, calls, clock, blocking_ms, max_spans, stacks,
                 watchdog, max_open):
        # Each against its documented range (config.py, docs/production.md).
        check = config.check
        pct, clock = check("pct", pct), check("clock", clock)
        blocking_ms = check("blocking_ms", blocking_ms)
        max_spans = check("max_spans", max_spans)
        max_open = check("max_open", max_open)
        calls, stacks = check("calls", calls), check("stacks", stacks)
        watchdog = check("watchdog", watchdog)
        self.pct = float(pct)
        self.calls = bool(calls)
        self.clock = clock
        self.blocking_ns = int(blocking_ms * 1e6) if blocking_ms else 0
        self.max_spans = max_spans
        self.stacks = bool(stacks)
        self.watchdog = bool(watchdog)
        self.max_open = max_open
        # Spans need CPU time for the report; the estimate reads the thread
        # CPU clock at most every 100 us while a sampled request is open,
        # every 10 ms otherwise (engine.CPU_WINDOW_*).
        self.cpu_mode = "estimate"


def trigger(header, secret):
    """(environ key, secret bytes) of the trigger header, (None, None)
    when it is off; both or neither must be given."""
    if (header is None) != (secret is None):
        raise ConfigError("trigger_header and trigger_secret must be "
                          "given together")
    if header is None:
        return None, None
    if not isinstance(header, str) or not header:
        raise ConfigError("trigger_header must be a header name")
    if not isinstance(secret, str) or len(secret) < 8:
        raise ConfigError("trigger_secret must be a string of at "
                          "least 8 characters")
    return ("HTTP_" + header.upper().replace("-", "_"),
            secret.encode("utf-8"))


def draw(mw, environ):
    """How a request the C path hands over is sampled: "trigger" (the
    trigger header holds the secret, compared in constant time), "pct"
    (drawn), or None."""
    if mw._trigger_key is not None:
        value = environ.get(mw._trigger_key)
        if value is not None and hmac.compare_digest(
                value.encode("latin-1", "replace"),
                mw._trigger_secret):
            return "trigger"
    pct = mw.config.pct
    if pct >= 1.0 or (pct > 0.0 and mw._random() < pct):
        return "pct"
    return None
