"""pstats / cProfile dump: ``pstats.Stats(path)``, snakeviz, gprof2dot,
tuna and every other reader of ``cProfile.Profile.dump_stats`` files."""
import marshal

from .base import Renderer, func_key


def pstats_label(f):
    """cProfile's key of a FuncStat: (filename, lineno, funcname).

    C functions are keyed like cProfile keys them: ``("~", 0,
    "<built-in method name>")``; Python functions use the qualified name so
    methods of different classes stay apart."""
    if f.filename == "~" or (not f.filename and not f.lineno):
        owner = f.module if f.module and f.module != "builtins" else ""
        name = "%s.%s" % (owner, f.qualname) if owner else f.qualname
        return ("~", 0, "<built-in method %s>" % name)
    return (f.filename, f.lineno, f.qualname)


def stats_dict(calls):
    """The dict cProfile's ``Profile.create_stats()`` makes::

        {label: (cc, nc, tt, ct, callers)}
        callers = {caller label: (nc, cc, tt, ct)}

    (``cc`` primitive calls, ``nc`` all calls, ``tt`` exclusive and ``ct``
    inclusive seconds.)  Callers are the callee edges of every FuncStat,
    inverted; the per-caller tuple is in cProfile's own order (nc first),
    which is what ``pstats`` and snakeviz read."""
    labels = {}
    stats = {}
    for f in calls:
        label = pstats_label(f)
        labels[func_key(f)] = label
        prev = stats.get(label)
        if prev is None:
            stats[label] = [f.nactualcall, f.ncall, f.tsub, f.ttot, {}]
        else:  # two functions with the same label: merge like cProfile
            prev[0] += f.nactualcall
            prev[1] += f.ncall
            prev[2] += f.tsub
            prev[3] += f.ttot
    for f in calls:
        caller = labels[func_key(f)]
        for c in f.children:
            callee = labels.get(func_key(c))
            if callee is None or callee not in stats:
                continue  # the callee never returned: no entry of its own
            callers = stats[callee][4]
            prev = callers.get(caller, (0, 0, 0.0, 0.0))
            callers[caller] = (prev[0] + c.ncall, prev[1] + c.nactualcall,
                               prev[2] + c.tsub, prev[3] + c.ttot)
    return {k: tuple(v) for k, v in stats.items()}


class PstatsRenderer(Renderer):
    name = "pstats"
    extension = "pstats"
    binary = True
    needs_calls = True
    description = "cProfile dump (pstats.Stats, snakeviz, gprof2dot)"

    def render(self, profile):
        v = self.view(profile)
        return marshal.dumps(stats_dict(v.calls))
