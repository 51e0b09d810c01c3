"""Clean text (the shared contract of issue 15): every string greqprof
records from the app, the environ or the interpreter is valid, printable
text, so no output can fail on its content."""


def _escape(ch):
    o = ord(ch)
    if o < 0x100:
        return "\\x%02x" % o
    if o < 0x10000:
        return "\\u%04x" % o
    return "\\U%08x" % o


def clean(value, limit=None):
    """None -> None.  bytes/bytearray -> decoded as latin-1 (WSGI's rule),
    then cleaned.  Any other non-str -> str(value) (repr if str() raises),
    then cleaned.  A str that is already printable is returned as it is;
    otherwise every non-printable character (controls, format characters,
    lone surrogates, separators, newlines, tabs) is escaped visibly
    (\\xNN, \\uNNNN, \\UNNNNNNNN).  limit: the cleaned text cut to limit
    characters plus '...[N more]'."""
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).decode("latin-1")
    elif not isinstance(value, str):
        try:
            value = str(value)
        except Exception:
            try:
                value = repr(value)
            except Exception:
                value = "<%s object>" % type(value).__name__
        if not isinstance(value, str):
            value = "<%s object>" % type(value).__name__
    if type(value) is not str:
        value = str.__str__(value)
    if not value.isprintable():
        value = "".join(ch if ch.isprintable() else _escape(ch)
                        for ch in value)
    if limit is not None and len(value) > limit:
        value = "%s...[%d more]" % (value[:limit], len(value) - limit)
    return value
