"""Clean text: the one rule for every string greqprof records.

Text that comes from the app, the environ or the interpreter (paths,
methods, request ids, statuses, greenlet and function names, file names,
stacks, error messages) may hold lone surrogates, control characters or
bidi/format characters.  Any of those can make an output fail (a UTF-8 log
handler, ``json.dumps(ensure_ascii=False)`` written to a file) or show text
in a misleading order in a log viewer.  greqprof cleans such text once,
when it records it, so every output can print it as it is.

The C code that records strings applies the same rule: an ASCII string whose
bytes are all 0x20..0x7e passes unchanged there, anything else goes through
``clean`` (looked up once at init).
"""

__all__ = ["clean"]


def _escape(ch):
    n = ord(ch)
    if n < 0x100:
        return "\\x%02x" % n
    if n < 0x10000:
        return "\\u%04x" % n
    return "\\U%08x" % n


def clean(value, limit=None):
    """Return ``value`` as valid, printable text.

    * ``None`` -> ``None``.
    * ``bytes``/``bytearray`` -> decoded as latin-1 (WSGI's rule), then
      cleaned.
    * Any other non-str -> ``str(value)`` (``repr`` if ``str()`` raises),
      then cleaned.
    * A str for which ``str.isprintable()`` is true is returned as it is
      (no copy; a str subclass becomes a plain str).
    * Otherwise every non-printable character (lone surrogates, C0/C1
      controls including newline and tab, format characters such as U+202E,
      U+2066-U+2069, U+200B, U+FEFF, line/paragraph separators, non-ASCII
      spaces) is escaped visibly: below 0x100 as ``\\xNN``, else
      ``\\uNNNN`` or ``\\UNNNNNNNN``.  Callers that keep multi-line text,
      such as stacks, clean it line by line.

    ``limit``: when given (an int >= 0) and the cleaned text is longer, it
    is cut to ``limit`` characters followed by ``...[N more]``, N being the
    number of cleaned characters cut off.
    """
    if value is None:
        return None
    if type(value) is not str:
        value = _to_str(value)
    if not value.isprintable():
        value = "".join([c if c.isprintable() else _escape(c) for c in value])
    if limit is not None and len(value) > limit:
        if limit < 0:
            raise ValueError("clean: limit must be >= 0, got %r" % (limit,))
        value = "%s...[%d more]" % (value[:limit], len(value) - limit)
    return value


def _to_str(value):
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("latin-1")
    if isinstance(value, str):
        # A subclass may override __str__/__eq__/__hash__; keep the plain text.
        return str.__str__(value)
    try:
        text = str(value)
    except Exception:
        try:
            text = repr(value)
        except Exception:
            text = "<%s object>" % type(value).__name__
    if type(text) is not str:
        text = str.__str__(text)
    return text


def clean_lines(text, limit=None):
    """``clean`` for multi-line text such as stacks: each line is cleaned
    (``limit`` applies per line), the line breaks stay."""
    if text is None:
        return None
    if type(text) is not str:
        text = _to_str(text)
    lines = text.split("\n")
    if limit is None and all([line.isprintable() for line in lines]):
        return text   # (the common case: no copy)
    return "\n".join([clean(line, limit) for line in lines])
