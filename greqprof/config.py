"""The one place that reads configuration from the environment.

Operators who cannot edit code set ``GREQPROF_*`` variables; they are read
once, when the middleware is constructed.  Arguments given in code win.  An
invalid value fails at start-up with a ConfigError naming the variable.
"""
import logging
import math
import os
import re
from collections.abc import Mapping

from ._text import clean as _clean
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

# Every option has one spec below: it parses its GREQPROF_* string
# (``spec(var, raw)``) and checks a value given in code (``spec.check(option,
# value)``) against the same documented range (``spec.doc``, listed in
# docs/production.md).  Errors are ConfigErrors naming the option or
# variable.  Numbers from the environment are plain ASCII decimals (no
# ``1_000``, no non-ASCII digits, no nan/inf).  To add an option: one row in
# VARIABLES (or OPTIONS for code-only options) and ``check(name, value)``
# where the value is used.

_INT_RE = re.compile(r"[+-]?[0-9]+\Z", re.ASCII)
_FLOAT_RE = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
                       r"(?:[eE][+-]?[0-9]+)?\Z", re.ASCII)


def _show(value, secret):
    return "<hidden>" if secret else _clean(repr(value), 80)


class _Spec:
    """A documented range of values for one option."""
    doc = ""
    secret = False   # never echo the value in an error

    def __call__(self, var, raw):
        """The value of a GREQPROF_* variable's string ``raw``."""
        try:
            if not isinstance(raw, str):
                raise _Bad("expected a string")
            return self.validate(self.parse(raw))
        except _Bad as e:
            raise ConfigError("%s=%s: %s" % (var, _show(raw, self.secret),
                                             self._why(e))) from None

    def parse(self, raw):
        return raw.strip()

    def check(self, name, value):
        """``value`` as the option holds it; ConfigError naming ``name``
        when it is outside the range."""
        try:
            return self.validate(value)
        except _Bad as e:
            raise ConfigError("%s %s, got %s" % (
                name, self._why(e), _show(value, self.secret))) from None

    def _why(self, e):
        return "must be %s%s" % (self.doc, ": %s" % e if str(e) else "")

    def validate(self, value):
        return value


class _Bad(Exception):
    """A value outside a spec's range (turned into a ConfigError)."""


def _num(x):
    return str(int(x)) if x == int(x) else repr(x)


class _Number(_Spec):
    def __init__(self, lo, hi, integer=False, lo_open=False, off=False,
                 zero_off=False, unit=""):
        # zero_off: "0" in the environment means off (None)
        self.lo, self.hi, self.integer = lo, hi, integer
        self.lo_open, self.off, self.zero_off = lo_open, off, zero_off
        kind = "an integer" if integer else "a number"
        #: how the range says off (the CLI says it its way: name_flags)
        self.off_doc = "None (%soff in the environment)" % (
            "0 or " if zero_off else "")
        self.doc = "%s %s %s%s%s" % (
            kind, "above %s and at most" % _num(lo) if lo_open
            else "from %s to" % _num(lo), _num(hi),
            " %s" % unit if unit else "",
            ", or %s" % self.off_doc if off else "")

    def parse(self, raw):
        v = raw.strip()
        if self.off and v.lower() in ("off", "none", ""):
            return None
        if not (_INT_RE if self.integer else _FLOAT_RE).match(v):
            raise _Bad("not %s (plain ASCII digits)"
                       % ("an integer" if self.integer else "a number"))
        x = int(v) if self.integer else float(v)
        if self.zero_off and x == 0 and \
                not re.search("[1-9]", re.split("[eE]", v)[0]):
            return None   # (a literal zero; "1e-400" is 0.0 but no "off")
        return x

    def validate(self, value):
        if value is None and self.off:
            return None
        types = (int,) if self.integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, types):
            raise _Bad("")
        try:
            x = value if self.integer else float(value)
        except OverflowError:
            raise _Bad("out of range") from None
        if x != x or x < self.lo or x > self.hi or \
                (self.lo_open and x == self.lo):
            raise _Bad("")
        return x


class _Bool(_Spec):
    doc = "True or False (1/0, true/false, yes/no, on/off in the environment)"

    def parse(self, raw):
        v = raw.strip().lower()
        if v in _TRUE:
            return True
        if v in _FALSE:
            return False
        raise _Bad("expected one of 1/0, true/false, yes/no, on/off")

    def validate(self, value):
        if not isinstance(value, bool):
            raise _Bad("")
        return value


class _Choice(_Spec):
    def __init__(self, *options):
        self.options = options
        self.doc = "one of %s" % ", ".join(repr(o) for o in options)

    def parse(self, raw):
        return raw.strip().lower()

    def validate(self, value):
        if not isinstance(value, str) or value not in self.options:
            raise _Bad("")
        return value


class _Text(_Spec):
    """Printable text of 1 to ``max_len`` characters (``pattern``: a regex
    it must match; ``ascii``: printable ASCII only; ``header_value``: no
    space at either end, which servers strip from a header's value so it
    could never be equal)."""

    def __init__(self, doc, max_len=200, pattern=None, ascii=False,
                 min_len=1, secret=False, optional=False,
                 header_value=False):
        self.doc, self.max_len, self.min_len = doc, max_len, min_len
        self.optional, self.header_value = optional, header_value
        self.pattern = re.compile(pattern + r"\Z") if pattern else None
        self.ascii, self.secret = ascii, secret

    def validate(self, value):
        if value is None and self.optional:
            return None
        if not isinstance(value, str):
            raise _Bad("")
        if not value.strip():
            raise _Bad("empty")
        if len(value) < self.min_len:
            raise _Bad("fewer than %d characters" % self.min_len)
        if len(value) > self.max_len:
            raise _Bad("longer than %d characters" % self.max_len)
        if not value.isprintable() or (self.ascii and not value.isascii()):
            raise _Bad("control or non-%s characters"
                       % ("ASCII" if self.ascii else "printable"))
        if self.pattern is not None and not self.pattern.match(value):
            raise _Bad("")
        if self.header_value and value != value.strip():
            raise _Bad("spaces at either end (servers strip them from "
                       "header values)")
        return value


class _Header(_Text):
    """A request header name the WSGI environ carries as ``HTTP_*``."""
    #: PEP 3333 puts these two in CONTENT_TYPE / CONTENT_LENGTH, and they
    #: describe the request's body: never a trigger.
    NOT_HTTP = ("content-type", "content-length")

    def __init__(self):
        super().__init__("a header name (letters, digits and dashes, up to "
                         "128; not Content-Type or Content-Length)", 128,
                         pattern=_TOKEN, ascii=True, optional=True)

    def validate(self, value):
        value = super().validate(value)
        if value is not None and value.lower() in self.NOT_HTTP:
            raise _Bad("WSGI servers pass %s outside the HTTP_* keys and "
                       "it describes the request body; use a header of "
                       "its own, e.g. X-Greqprof-Trigger" % value)
        return value


class _Logger(_Text):
    def __init__(self):
        super().__init__("a logging.Logger or a logger name (printable, up "
                         "to 200 characters)")

    def validate(self, value):
        if isinstance(value, logging.Logger):
            return value
        return super().validate(value)


class _Path(_Spec):
    doc = "a directory path (str or os.PathLike, no NUL, up to 4096 characters)"

    def validate(self, value):
        if value is None:
            return None
        try:
            path = os.fspath(value)
        except TypeError:
            raise _Bad("") from None
        if not isinstance(path, str):
            raise _Bad("a str path is expected")
        if not path.strip():
            raise _Bad("empty")
        if "\0" in path:
            raise _Bad("contains a NUL character")
        if len(path) > 4096:
            raise _Bad("longer than 4096 characters")
        return value


class _Names(_Spec):
    """A list (or comma-separated string) of 1 to 32 names."""

    def __init__(self, doc, item):
        self.doc, self.item = doc, item

    def parse(self, raw):
        items = [x.strip() for x in raw.split(",") if x.strip()]
        if not items:
            raise _Bad("expected a comma-separated list")
        return items

    def validate(self, value):
        if value is None:
            return None
        if isinstance(value, str):
            value = [x.strip() for x in value.split(",") if x.strip()]
        try:
            items = list(value)
        except TypeError:
            raise _Bad("") from None
        if not items or len(items) > 32:
            raise _Bad("")
        for x in items:
            self.item.validate(x)
        return items


class _Formats(_Names):
    """Output format names: those greqprof.renderers knows, lower case."""

    def __init__(self):
        self.item = None

    @property
    def doc(self):
        from .renderers import RENDERERS
        return "a list of 1 to 32 of: %s (lower case)" % ", ".join(
            sorted(RENDERERS))

    def validate(self, value):
        from .renderers import RENDERERS
        if value is None:
            return None
        if isinstance(value, str):
            value = [x.strip() for x in value.split(",") if x.strip()]
        # (bytes would be a list of ints, a dict its keys)
        if isinstance(value, (bytes, bytearray, memoryview, Mapping)):
            raise _Bad("type %s, not a list" % type(value).__name__)
        try:
            items = list(value)
        except TypeError:
            raise _Bad("type %s, not a list" % type(value).__name__) from None
        if not items:
            raise _Bad("empty (formats=None, the default, writes json; "
                       "leave profile_dir unset to write no files)")
        if len(items) > 32:
            raise _Bad("%d names, more than 32" % len(items))
        for x in items:
            if not isinstance(x, str) or x not in RENDERERS:
                near = isinstance(x, str) and x.strip().lower() in RENDERERS
                raise _Bad("unknown format %s%s" % (
                    _show(x, False), " (did you mean %r?)"
                    % x.strip().lower() if near else ""))
        # (a set has no order of its own: sorted, the same every run)
        return sorted(items) if isinstance(value, (set, frozenset)) \
            else items


class _Callable(_Spec):
    def __init__(self, doc, optional=True):
        self.doc, self.optional = doc, optional

    def validate(self, value):
        if value is None and self.optional:
            return None
        if not callable(value):
            raise _Bad("")
        return value


class _Seed(_Spec):
    doc = "None, an int, a float, a str or bytes"

    def validate(self, value):
        if value is None or (isinstance(value, (int, float, str, bytes,
                                                bytearray))
                             and not isinstance(value, bool)):
            return value
        raise _Bad("")


# Kept for other modules' rows in VARIABLES: the old parser factories.
def _float(lo=None, hi=None, allow_off=False):
    return _Number(-math.inf if lo is None else lo,
                   math.inf if hi is None else hi, off=allow_off)


def _int(lo, hi=2 ** 31 - 1):
    return _Number(lo, hi, integer=True)


def _choice(*options):
    return _Choice(*options)


_bool = _Bool()
_text = _Text("printable text")
_list = _Names("a list of names", _Text("a name"))

#: spans kept per request: each costs 40 bytes, allocated as the request
#: records them; the cap bounds a request's memory (max_open of them)
MAX_SPANS = 100000
#: the smallest blocking_ms that is on (1 microsecond)
MIN_BLOCKING_MS = 0.001
_TOKEN = r"[A-Za-z0-9][A-Za-z0-9-]*"

#: variable -> (middleware option, spec, default)
VARIABLES = {
    "GREQPROF_PCT": ("pct", _Number(0.0, 1.0), 0.05),
    "GREQPROF_CALLS": ("calls", _bool, False),
    "GREQPROF_CLOCK": ("clock", _choice("cpu", "wall"), "cpu"),
    # (below 0.001 ms, i.e. 1000 ns, a threshold is no longer a useful
    # one and int(blocking_ms * 1e6) reaches 0, which means off)
    "GREQPROF_BLOCKING_MS": ("blocking_ms", _Number(
        MIN_BLOCKING_MS, 3600000.0, off=True, zero_off=True,
        unit="milliseconds"), 100),
    "GREQPROF_JSON_LOGS": ("json_logs", _bool, False),
    "GREQPROF_MAX_SPANS": ("max_spans", _Number(1, MAX_SPANS, integer=True),
                           1000),
    "GREQPROF_LINGER": ("linger", _Number(0.0, 60.0, unit="seconds"), 1.0),
    "GREQPROF_LOGGER": ("logger", _Logger(), "greqprof"),
    "GREQPROF_PROFILE_DIR": ("profile_dir", _Path(), None),
    "GREQPROF_FORMATS": ("formats", _Formats(), None),
    "GREQPROF_TRIGGER_HEADER": ("trigger_header", _Header(), None),
    "GREQPROF_TRIGGER_SECRET": ("trigger_secret", _Text(
        "a string of 8 to 1024 printable ASCII characters, no space at "
        "either end", 1024, ascii=True, min_len=8, secret=True,
        optional=True, header_value=True), None),
    "GREQPROF_OTEL": ("otel", _bool, False),
    "GREQPROF_OTEL_SPANS": ("otel_spans", _bool, False),
    "GREQPROF_ENABLED": ("enabled", _bool, True),
    "GREQPROF_BLOCKING_INTERVAL": ("blocking_interval", _Number(
        0.0, 86400.0, unit="seconds"), 10.0),
    "GREQPROF_JSON_MAX_BYTES": ("json_max_bytes", _Number(
        1024, 2 ** 30, integer=True, unit="bytes"), 65536),
    # (0 or None: off; at most 1000 samples a second; on by default: its
    # cost at 100 Hz is within the noise of the bench, docs/fleet.md)
    "GREQPROF_STACK_HZ": ("stack_hz", _Number(
        0.0, 1000.0, off=True, zero_off=True, unit="samples per second"),
        100),
    "GREQPROF_MAX_ROUTES": ("max_routes", _Number(
        1, 100000, integer=True), 500),
    "GREQPROF_METRICS_PATH": ("metrics_path", _Text(
        "a path like '/_greqprof/metrics' (printable ASCII, no ?, # or %, "
        "no . or .. segment, up to 200)", 200,
        pattern=r"(?!.*/\.\.?(?:/|\Z))/[!$&'()*+,;=:@/.~\w-]*[^/]",
        ascii=True, optional=True), None),
    "GREQPROF_SUMMARY_S": ("summary_s", _Number(
        0.1, 86400.0, off=True, zero_off=True, unit="seconds"), 60.0),
}

#: option -> spec of the options that only code sets
OPTIONS = {
    "max_open": _Number(1, 1000000, integer=True),
    "ui_keep": _Number(1, 10000, integer=True),
    # (no %: PATH_INFO arrives decoded; no . or .. segment: browsers
    # remove them; either way no request would reach the inspector)
    "ui_path": _Text("a path like '/_greqprof' (printable ASCII, no ?, # "
                     "or %, no . or .. segment, up to 200)", 200,
                     pattern=r"(?!.*/\.\.?(?:/|\Z))/[!$&'()*+,;=:@/.~\w-]*",
                     ascii=True, optional=True),
    "ui_token": _Text("a string of 8 to 1024 printable ASCII characters, "
                      "no space at either end", 1024, ascii=True,
                      min_len=8, secret=True, optional=True,
                      header_value=True),
    "ui_hosts": _Names("a list of host names or IP addresses",
                       _Text("a host name", 255)),
    "stacks": _bool, "watchdog": _bool, "report": _bool,
    "sink": _Callable("a callable or None"),
    "rng": _Callable("a callable returning floats in [0, 1), or None"),
    "seed": _Seed(),
    "route": _Callable("a callable environ -> str, or None"),
}
OPTIONS.update({opt: spec for opt, spec, _ in VARIABLES.values()})


def check(option, value):
    """``value`` checked against ``option``'s documented range (ConfigError
    naming the option otherwise); returns the value as the option holds
    it (``formats`` a list; ``blocking_ms=0`` is refused in code, where
    None is off, and GREQPROF_BLOCKING_MS=0 reads as None)."""
    return OPTIONS[option].check(option, value)


#: options that may be read from the environment
ENV_OPTIONS = {opt: var for var, (opt, _, _) in VARIABLES.items()}


def resolve(explicit, environ=None):
    """Fills every option left UNSET in `explicit` from `environ` (default
    os.environ), else from its built-in default.  Returns a new dict.

    Unknown ``GREQPROF_*`` variables are rejected too, so a typo does not
    silently leave profiling misconfigured."""
    env = os.environ if environ is None else environ
    for var in env:
        if isinstance(var, str) and var.startswith("GREQPROF_") and \
                var not in VARIABLES and var not in IGNORED:
            raise ConfigError("unknown environment variable %s (known: %s)"
                              % (_clean(var, 80), ", ".join(sorted(VARIABLES))))
    out = dict(explicit)
    sources = {}
    for var, (opt, parse, default) in VARIABLES.items():
        if opt in out and out[opt] is not UNSET:
            # Given in code: the same range as the variable's.
            out[opt] = parse.check(opt, out[opt])
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


# (a quoted value, or one _show cut: no closing quote, "...[N more]")
_QUOTED = (r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\""
           r"|'(?:[^'\\]|\\.)*\\?\.\.\.\[\d+ more\]"
           r"|\"(?:[^\"\\]|\\.)*\\?\.\.\.\[\d+ more\]")


def name_flags(error, flags, off=()):
    """A ConfigError about options a command line set, with its flags
    named instead (``flags``: option -> flag; ``off``: option -> the
    flag's value that means off, said instead of None).  Quoted values,
    and the value after ", got " that ends check's messages, are left as
    they are."""
    text = str(error)
    if not flags:
        return error
    for opt, value in dict(off).items():
        spec = OPTIONS[opt]
        if text.startswith("%s must be %s" % (opt, spec.doc)):
            text = text.replace(spec.off_doc, "%s (off)" % value, 1)
    names = re.compile(
        r"(%s)|(, got )|(?<![\w/.-])(%s)(?:=True)?(?![\w/.-])" % (
            _QUOTED, "|".join(re.escape(o) for o in flags)))
    out, at = [], 0
    for m in names.finditer(text):
        if m.group(2):
            break   # (the value as given: never rewritten)
        if m.group(3):
            out += [text[at:m.start()], flags[m.group(3)]]
            at = m.end()
    text = "".join(out) + text[at:]
    return error if text == str(error) else ConfigError(text)


#: variables used by tests and tools, not by the middleware
IGNORED = {"GREQPROF_SCREENSHOTS"}
