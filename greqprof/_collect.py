"""Turns raw tuples read from profiles into the public records.

Shared by the whole-process Profiler and per-request profiles."""
import struct

from . import _registry
from ._lowlevel import NS, ClockOrigin, func_info
from .request_profile import WaitedOn, Waiting
from .stats import ChildStat, FuncStat, GreenletStat, Span

SPAN_FINISHED = 0x1
SPAN_LONG = 0x4


def greenlet_names(raw_profiles, raw_greenlets=None):
    """id -> (name, fn_name); raw_greenlets: the profiles' greenlets() rows
    when the caller already read them."""
    names = {}
    rows = raw_greenlets if raw_greenlets is not None else [
        g for rp in raw_profiles for g in rp.greenlets()]
    for g in rows:
        if g[7] or g[8]:
            names[g[0]] = (g[7], g[8])
    return names


def _name_of(gid, names):
    n = names.get(gid) or _registry.names.get(gid)
    if not n:
        return ("greenlet-%d" % gid, "")
    return (n[0] or "", n[1] or "")


def make_span(rp, raw, names, stacks=None):
    gid, start, end, cpu, flags, tag = raw
    name, fn = _name_of(gid, names)
    stack = None
    if tag:
        stack = (stacks.get(tag) if stacks is not None
                 else _registry.stacks.get(tag))
    # (positional: Span's fields in order; keywords would build a dict per
    # span)
    return Span(gid, name, fn, rp.to_epoch(start), rp.to_epoch(end),
                (end - start) * NS, None if cpu < 0 else cpu * NS,
                bool(flags & SPAN_FINISHED), stack, bool(flags & SPAN_LONG))


def spans(raw_profiles, stacks=None):
    names = greenlet_names(raw_profiles)
    out = []
    for rp in raw_profiles:
        out.extend(make_span(rp, s, names, stacks) for s in rp.spans())
    out.sort(key=lambda s: s.start)
    return out


def greenlet_stats(raw_profiles, raw_greenlets=None, names=None):
    merged = {}
    rows = raw_greenlets if raw_greenlets is not None else [
        g for rp in raw_profiles for g in rp.greenlets()]
    for (gid, wall, cpu, sw, _f, _l, fin, name, fn) in rows:
        m = merged.get(gid)
        if m is None:
            merged[gid] = [name, fn, cpu, wall, sw, fin]
        else:
            m[2] = (cpu if m[2] < 0 else m[2] + max(cpu, 0))
            m[3] += wall
            m[4] += sw
            m[5] = m[5] or fin
    out = []
    for gid, (name, fn, cpu, wall, sw, fin) in merged.items():
        if not name and not fn:
            name, fn = _name_of(gid, names or {})
        out.append(GreenletStat(gid, name, fn, None if cpu < 0 else cpu * NS,
                                wall * NS, sw, fin))  # (fields in order)
    out.sort(key=lambda g: g.id)
    return out


def func_stats(raw_profiles):
    """Merges the function tables of several profiles by key."""
    funcs = {}
    for rp in raw_profiles:
        for key, ncall, nact, ttot, tsub in rp.funcs():
            f = funcs.setdefault(key, [0, 0, 0, 0])
            f[0] += ncall
            f[1] += nact
            f[2] += ttot
            f[3] += tsub
    edges = {}
    for rp in raw_profiles:
        for caller, callee, ncall, nact, ttot, tsub in rp.edges():
            e = edges.setdefault((caller, callee), [0, 0, 0, 0])
            e[0] += ncall
            e[1] += nact
            e[2] += ttot
            e[3] += tsub
    infos = {key: func_info(key) for key in funcs}
    children = {}
    for (caller, callee), (ncall, nact, ttot, tsub) in edges.items():
        info = infos.get(callee) or func_info(callee)
        children.setdefault(caller, []).append(ChildStat(
            name=info[0], qualname=info[1], module=info[2], lineno=info[4],
            ncall=ncall, nactualcall=nact, ttot=ttot * NS, tsub=tsub * NS,
            filename=info[3]))
    out = []
    for key, (ncall, nact, ttot, tsub) in funcs.items():
        if ncall == 0:
            continue  # entered but not returned yet
        name, qual, module, filename, lineno = infos[key]
        kids = sorted(children.get(key, ()), key=lambda c: -c.ttot)
        out.append(FuncStat(name=name, qualname=qual, module=module,
                            filename=filename, lineno=lineno, ncall=ncall,
                            nactualcall=nact, ttot=ttot * NS, tsub=tsub * NS,
                            children=tuple(kids)))
    out.sort(key=lambda f: -f.ttot)
    return out


#: rows of read_profile's bytes (_hooks.c): a gqp_span, and
#: (id, wall_ns, cpu_ns, switches, first_ns, last_ns, finished)
SPAN_ROW = struct.Struct("=QqqqII")
GREENLET_ROW = struct.Struct("=QqqQqqQ")


def request_names(names):
    """A request's names (id -> (name, fn_name)) as its profile shows them:
    a greenlet nobody named ("Greenlet", "Greenlet-3") by its function
    (issue 16).  A new dict; names is read_profile's."""
    out = {}
    for gid, pair in names.items():
        name, fn = pair
        if fn and (not name or name == "Greenlet" or
                   name.startswith(("Greenlet-", "greenlet-"))):
            pair = (fn, fn)
        out[gid] = pair
    return out


def request_records(raw):
    """The deferred fields of a request's RequestProfile (see
    RequestProfile's "_loader"), from what read_profile (_hooks.c) read out
    when the request was finalized."""
    (span_rows, greenlet_rows, longest, _end, wait_ns, top, complete,
     _dropped_spans, _dropped_calls, epoch0, wall0, names, stacks) = raw
    origin = ClockOrigin(epoch0, wall0)
    st = stacks or {}
    names = request_names(names)
    # (names has every greenlet's: rows need none of their own)
    spans = [make_span(origin, x, names, st)
             for x in SPAN_ROW.iter_unpack(span_rows)]
    greenlets = greenlet_stats(None, [
        (gid, wall, cpu, sw, first, last, bool(fin), "", "")
        for gid, wall, cpu, sw, first, last, fin
        in GREENLET_ROW.iter_unpack(greenlet_rows)], names)
    cpus = [g.cpu for g in greenlets if g.cpu is not None]
    waited = []
    for gid, ns, n in top:
        name, fn = n or ("greenlet-%d" % gid, "")
        if fn and fn.startswith("greqprof."):
            continue  # greqprof's own housekeeping greenlets
        waited.append(WaitedOn(greenlet_id=gid, name=name or "",
                               fn_name=fn or "", seconds=ns * NS))
    return {
        "spans": spans,
        "longest_span": (make_span(origin, SPAN_ROW.unpack(longest), names,
                                   st) if longest is not None else None),
        "greenlets": greenlets,
        "cpu": sum(cpus) if cpus else None,
        "waiting": Waiting(seconds=wait_ns * NS, top=tuple(waited),
                           complete=complete),
    }
