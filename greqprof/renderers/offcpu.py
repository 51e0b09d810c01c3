"""Off-CPU flame graph: where a request's greenlets waited, as speedscope
JSON (https://www.speedscope.app).

One ``sampled`` profile: each wait site of RequestProfile.waits is one
sample, its stack (outermost first, ending at the site) weighted by the
time waited there, in microseconds.  The flame graph shows which code the
request waited in; a profile with no waits (or a whole-process one) gives
an empty profile."""
import json

from .base import Renderer
from .speedscope import SCHEMA_URL, _Frames


def parse_stack_entry(entry):
    """("function", "file", line) of a ``"file:line in function"`` string
    (file names may hold ':' and ' in '); line 0 when it has none."""
    where, sep, fn = entry.rpartition(" in ")
    if not sep:
        return entry, "", 0
    file, sep, line = where.rpartition(":")
    # (ASCII digits only: str.isdigit() is also true of '\u00b2', which
    # int() refuses)
    if not sep or not line or not line.isascii() or not line.isdigit():
        return fn, where, 0
    return fn, file, int(line)


class OffCpuRenderer(Renderer):
    name = "offcpu"
    extension = "offcpu.speedscope.json"
    description = ("speedscope JSON, off-CPU: the stacks the request's "
                   "greenlets waited in, weighted by time waited")

    def document(self, profile):
        v = self.view(profile)
        waits = v.request.waits if v.request is not None else []
        frames = _Frames()
        samples, weights = [], []
        for w in waits:
            stack = list(w.stack) or ["%s:%d in %s" % (w.filename, w.lineno,
                                                       w.fn_name)]
            path = []
            for entry in stack:
                fn, file, line = parse_stack_entry(entry)
                path.append(frames.get(entry, fn, file or None,
                                       line or None))
            samples.append(path)
            weights.append(round(w.seconds * 1e6, 3))
        total = round(sum(weights), 3)
        return {
            "$schema": SCHEMA_URL,
            "shared": {"frames": frames.frames},
            "profiles": [{
                "type": "sampled",
                "name": "off-CPU: time waited (%d sites)" % len(waits),
                "unit": "microseconds", "startValue": 0, "endValue": total,
                "samples": samples, "weights": weights}],
            "name": "greqprof waits %s" % v.title,
            "activeProfileIndex": 0,
            "exporter": "greqprof",
        }

    def render(self, profile):
        return json.dumps(self.document(profile), separators=(",", ":"))
