"""The clean-text contract (greqprof/_text.py, issue 15 item 2)."""
import pytest

from greqprof._text import clean


def test_none_and_printable_pass_unchanged():
    assert clean(None) is None
    s = "GET /caf\u00e9 \u65e5\u672c"
    assert clean(s) is s  # fast path: no copy


@pytest.mark.parametrize("raw, expected", [
    ("a\udcffb", "a\\udcffb"),            # lone surrogate (os.fsdecode)
    ("\ud800", "\\ud800"),
    ("x\u202ey", "x\\u202ey"),            # RIGHT-TO-LEFT OVERRIDE
    ("\u2066\u2067\u2068\u2069", "\\u2066\\u2067\\u2068\\u2069"),
    ("zero\u200bwidth", "zero\\u200bwidth"),
    ("\ufeffbom", "\\ufeffbom"),
    ("line\u2028sep\u2029", "line\\u2028sep\\u2029"),
    ("a\nb\tc\r\x00\x1b[31m", "a\\x0ab\\x09c\\x0d\\x00\\x1b[31m"),
    ("c1\x85\x9b", "c1\\x85\\x9b"),
    ("nb\xa0sp", "nb\\xa0sp"),
    ("\U000e0001tag", "\\U000e0001tag"),   # LANGUAGE TAG (format char)
])
def test_non_printable_is_escaped(raw, expected):
    out = clean(raw)
    assert out == expected
    assert out.isprintable()
    out.encode("utf-8")  # never fails


def test_bytes_are_latin1():
    assert clean(b"200 OK") == "200 OK"
    assert clean(bytearray(b"caf\xe9")) == "caf\u00e9"
    assert clean(b"\xff\x80\n") == "\u00ff\\x80\\x0a"


def test_other_objects():
    assert clean(42) == "42"

    class BadStr:
        def __str__(self):
            raise RuntimeError("no")

        def __repr__(self):
            return "<Bad\n>"

    assert clean(BadStr()) == "<Bad\\x0a>"

    class Worse:
        def __str__(self):
            raise RuntimeError("no")

        __repr__ = __str__

    assert clean(Worse()) == "<Worse object>"

    class Sub(str):
        pass

    out = clean(Sub("abc"))
    assert type(out) is str and out == "abc"


def test_limit():
    assert clean("abcdef", limit=3) == "abc...[3 more]"
    assert clean("abc", limit=3) == "abc"
    # the limit counts cleaned characters
    assert clean("\n\n", limit=4) == "\\x0a...[4 more]"
    with pytest.raises(ValueError):
        clean("abc", limit=-1)


def test_clean_lines_keeps_line_breaks():
    from greqprof._text import clean_lines
    stack = '  File "a.py", line 1, in f\n  File "b.py", line 2, in g\n'
    assert clean_lines(stack) is stack
    assert clean_lines('  File "\udcff.py"\n\x1b\r\n') == \
        '  File "\\udcff.py"\n\\x1b\\x0d\n'
    assert clean_lines(None) is None
    assert clean_lines("abcdef\nxy", limit=3) == "abc...[3 more]\nxy"
