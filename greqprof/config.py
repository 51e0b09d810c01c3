"""The one place that reads configuration from the environment.

Operators who cannot edit code set ``GREQPROF_*`` variables; they are read
once, when the middleware is constructed.  Arguments given in code win.  An
invalid value fails at start-up with a ConfigError naming the variable.
"""
import math
import os

from .errors import ConfigError


class _Unset:
    def __repr__(self):
        return "<default>"

    def __bool__(self):
        return False


#: Default marker for options that may come from the environment.
UNSET = _Unset()

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _bool(var, raw):
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ConfigError("%s=%r: expected one of 1/0, true/false, yes/no, on/off"
                      % (var, raw))


def _float(lo=None, hi=None, allow_off=False):
    def parse(var, raw):
        v = raw.strip()
        if allow_off and v.lower() in ("off", "none", ""):
            return None
        try:
            x = float(v)
        except ValueError:
            raise ConfigError("%s=%r: not a number" % (var, raw)) from None
        if not math.isfinite(x) or (lo is not None and x < lo) or \
                (hi is not None and x > hi):
            raise ConfigError("%s=%r: must be between %s and %s"
                              % (var, raw, lo, "inf" if hi is None else hi))
        return x
    return parse


def _int(lo):
    def parse(var, raw):
        try:
            x = int(raw.strip())
        except ValueError:
            raise ConfigError("%s=%r: not an integer" % (var, raw)) from None
        if x < lo:
            raise ConfigError("%s=%r: must be >= %d" % (var, raw, lo))
        return x
    return parse


def _choice(*options):
    def parse(var, raw):
        v = raw.strip().lower()
        if v not in options:
            raise ConfigError("%s=%r: must be one of %s"
                              % (var, raw, ", ".join(options)))
        return v
    return parse


def _text(var, raw):
    v = raw.strip()
    if not v:
        raise ConfigError("%s is set but empty" % var)
    return v


def _list(var, raw):
    items = [x.strip() for x in raw.split(",") if x.strip()]
    if not items:
        raise ConfigError("%s=%r: expected a comma-separated list"
                          % (var, raw))
    return items


def _positive_or_off(var, raw):
    v = _float(lo=0.0, allow_off=True)(var, raw)
    if v == 0.0:
        return None
    return v


#: variable -> (middleware option, parser, default)
VARIABLES = {
    "GREQPROF_PCT": ("pct", _float(0.0, 1.0), 0.05),
    "GREQPROF_CALLS": ("calls", _bool, False),
    "GREQPROF_CLOCK": ("clock", _choice("cpu", "wall"), "cpu"),
    "GREQPROF_BLOCKING_MS": ("blocking_ms", _positive_or_off, 100),
    "GREQPROF_JSON_LOGS": ("json_logs", _bool, False),
    "GREQPROF_MAX_SPANS": ("max_spans", _int(1), 1000),
    "GREQPROF_LINGER": ("linger", _float(0.0, 60.0), 1.0),
    "GREQPROF_LOGGER": ("logger", _text, "greqprof"),
    "GREQPROF_PROFILE_DIR": ("profile_dir", _text, None),
    "GREQPROF_FORMATS": ("formats", _list, None),
    "GREQPROF_TRIGGER_HEADER": ("trigger_header", _text, None),
    "GREQPROF_TRIGGER_SECRET": ("trigger_secret", _text, None),
    "GREQPROF_OTEL": ("otel", _bool, False),
    "GREQPROF_OTEL_SPANS": ("otel_spans", _bool, False),
    "GREQPROF_ENABLED": ("enabled", _bool, True),
    "GREQPROF_BLOCKING_INTERVAL": ("blocking_interval", _float(0.0), 10.0),
    "GREQPROF_JSON_MAX_BYTES": ("json_max_bytes", _int(1024), 65536),
}

#: options that may be read from the environment
ENV_OPTIONS = {opt: var for var, (opt, _, _) in VARIABLES.items()}


def resolve(explicit, environ=None):
    """Fills every option left UNSET in `explicit` from `environ` (default
    os.environ), else from its built-in default.  Returns a new dict.

    Unknown ``GREQPROF_*`` variables are rejected too, so a typo does not
    silently leave profiling misconfigured."""
    env = os.environ if environ is None else environ
    for var in env:
        if var.startswith("GREQPROF_") and var not in VARIABLES \
                and var not in IGNORED:
            raise ConfigError("unknown environment variable %s (known: %s)"
                              % (var, ", ".join(sorted(VARIABLES))))
    out = dict(explicit)
    sources = {}
    for var, (opt, parse, default) in VARIABLES.items():
        if opt in out and out[opt] is not UNSET:
            continue
        raw = env.get(var)
        if raw is not None:
            out[opt] = parse(var, raw)
            sources[opt] = var
        else:
            out[opt] = default
    out["_sources"] = sources
    return out


def name_source(error, sources):
    """A ConfigError about options that came from the environment, with
    the variables named (validation that needs several options runs after
    parsing, where only option names are known)."""
    text = str(error)
    named = [var for opt, var in sorted(sources.items()) if opt in text]
    if not named:
        return error
    # Options the message names that nothing set: say which variable would.
    missing = [var for opt, var in sorted(ENV_OPTIONS.items())
               if opt in text and opt not in sources
               and var not in named]
    note = "set by %s" % ", ".join(named)
    if missing:
        note += "; not set: %s" % ", ".join(missing)
    return ConfigError("%s (%s)" % (text, note))


#: variables used by tests and tools, not by the middleware
IGNORED = {"GREQPROF_SCREENSHOTS"}
