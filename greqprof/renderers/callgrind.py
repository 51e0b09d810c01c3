"""Callgrind format: KCachegrind / QCachegrind and ``callgrind_annotate``.

One event, ``us`` (microseconds of the profile's clock).  Each function is a
``fl=``/``fn=`` block with its exclusive cost on its ``def`` line, followed
by one ``cfl=``/``cfn=``/``calls=`` entry per callee with the inclusive cost
of those calls (format reference: valgrind's docs/callgrind-format)."""
import re

from .._text import clean
from .base import Renderer, func_key

_UNSAFE = re.compile(r"[\x00-\x1f\x7f]")


def _clean(text):
    # One line per record: a name must never contain a line break (nor a
    # character a UTF-8 writer refuses: greqprof/_text.py).
    return clean(_UNSAFE.sub("?", str(text))) or "?"


def _us(seconds):
    return max(int(round(seconds * 1e6)), 0)


class CallgrindRenderer(Renderer):
    name = "callgrind"
    extension = "callgrind"
    needs_calls = True
    description = "callgrind (KCachegrind, callgrind_annotate)"

    def filename(self, base):
        # KCachegrind recognises files by this prefix.
        return "callgrind.out.%s" % base

    def render(self, profile):
        v = self.view(profile)
        files = {}
        fns = {}

        def fl(name):
            # Compressed names: "(n) name" the first time, "(n)" after.
            name = _clean(name or "~")
            if name in files:
                return "(%d)" % files[name]
            files[name] = len(files) + 1
            return "(%d) %s" % (files[name], name)

        def fn(f):
            name = _clean(f.qualname if not f.module
                          else "%s.%s" % (f.module, f.qualname))
            if f.filename == "~":
                name = "<built-in> " + name
            key = func_key(f)
            if key in fns:
                return "(%d)" % fns[key][0]
            fns[key] = (len(fns) + 1, name)
            return "(%d) %s" % (fns[key][0], name)

        known = {func_key(f): f for f in v.calls}
        title = v.title
        out = [
            "# callgrind format",
            "version: 1",
            "creator: greqprof",
            "pid: %d" % v.pid,
            "cmd: %s" % _clean(title),
            "positions: line",
            "event: us : Time (microseconds, %s clock)" % _clean(v.clock),
            "events: us",
        ]
        body = []
        total = 0
        for f in v.calls:
            self_us = _us(f.tsub)
            total += self_us
            body.append("")
            body.append("fl=" + fl(f.filename))
            body.append("fn=" + fn(f))
            body.append("%d %d" % (f.lineno, self_us))
            for c in f.children:
                target = known.get(func_key(c), c)
                body.append("cfl=" + fl(target.filename))
                body.append("cfn=" + fn(target))
                body.append("calls=%d %d" % (max(c.ncall, 1), target.lineno))
                body.append("%d %d" % (f.lineno, _us(c.ttot)))
        out.append("summary: %d" % total)
        out.extend(body)
        out.append("")
        out.append("totals: %d" % total)
        return "\n".join(out) + "\n"
