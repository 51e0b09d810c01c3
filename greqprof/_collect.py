"""Turns raw tuples read from profiles into the public records.

Shared by the whole-process Profiler and per-request profiles."""
import struct

from . import _registry
from ._lowlevel import NS, ClockOrigin, func_info
from ._text import clean, clean_lines
from .stats import (ChildStat, FuncStat, GreenletStat, Span, WaitedOn,
                    WaitEvent, Waiting, WaitSite)

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
            names[g[0]] = (clean(g[7]), clean(g[8]))
    return names


# Text from the interpreter and the app (greenlet and function names, file
# names, stacks) is cleaned here, where C rows become records: every output
# can then print it as it is (greqprof/_text.py).  Names are cleaned once
# per greenlet or function, not per span.

def _clean_names(names):
    """{gid: (name, fn_name)} with both cleaned (a new dict only when some
    name needed it)."""
    if not names:
        return names
    out = None
    for gid, n in names.items():
        if n and not (_printable(n[0]) and _printable(n[1])):
            if out is None:
                out = dict(names)
            out[gid] = (clean(n[0]), clean(n[1]))
    return names if out is None else out


def _printable(text):
    return text is None or (type(text) is str and text.isprintable())


def blocking_texts(name, fn, stack, sampled, method, path, rid):
    """A blocking event's texts, cleaned (blocking._blocking_event)."""
    return (clean(name), clean(fn), clean_lines(stack), clean_lines(sampled),
            clean(method), clean(path), clean(rid))


def _clean_stacks(stacks):
    if not stacks:
        return stacks
    return {tag: clean_lines(text) for tag, text in stacks.items()}


def _name_of(gid, names):
    n = names.get(gid) or _registry.names.get(gid)
    if not n:
        return ("greenlet-%d" % gid, "")
    return (clean(n[0]) or "", clean(n[1]) or "")


def make_span(rp, raw, names, stacks=None):
    gid, start, end, cpu, flags, tag = raw
    name, fn = _name_of(gid, names)
    stack = None
    if tag:
        stack = (stacks.get(tag) if stacks is not None
                 else clean_lines(_registry.stacks.get(tag)))
    # (positional: Span's fields in order; keywords would build a dict per
    # span)
    return Span(gid, name, fn, rp.to_epoch(start), rp.to_epoch(end),
                (end - start) * NS, None if cpu < 0 else cpu * NS,
                bool(flags & SPAN_FINISHED), stack, bool(flags & SPAN_LONG))


def spans(raw_profiles, stacks=None):
    names = greenlet_names(raw_profiles)
    stacks = _clean_stacks(stacks)
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
        else:
            name, fn = clean(name), clean(fn)
        out.append(GreenletStat(gid, name, fn, None if cpu < 0 else cpu * NS,
                                wall * NS, sw, fin))  # (fields in order)
    out.sort(key=lambda g: g.id)
    return out


def func_stats(raw_profiles, skip_dir=None):
    """Merges the function tables of several profiles by key; functions
    whose file is under ``skip_dir`` get no entry of their own (they stay
    their callers' children)."""
    raw_profiles = list(raw_profiles)
    if len(raw_profiles) == 1:
        # (a request's profile: its rows have distinct keys already)
        rp = raw_profiles[0]
        funcs = {row[0]: row[1:] for row in rp.funcs()}
        edges = {row[:2]: row[2:] for row in rp.edges()}
    else:
        funcs, edges = _merged(raw_profiles)
    infos = {key: _func_info(key) for key in funcs}
    if skip_dir is not None:
        funcs = {key: f for key, f in funcs.items()
                 if not infos[key][3].startswith(skip_dir)}
    children = {}
    for (caller, callee), (ncall, nact, ttot, tsub) in edges.items():
        info = infos.get(callee) or _func_info(callee)
        children.setdefault(caller, []).append(_frozen(ChildStat, {
            "name": info[0], "qualname": info[1], "module": info[2],
            "lineno": info[4], "ncall": ncall, "nactualcall": nact,
            "ttot": ttot * NS, "tsub": tsub * NS, "filename": info[3]}))
    out = []
    for key, (ncall, nact, ttot, tsub) in funcs.items():
        if ncall == 0:
            continue  # entered but not returned yet
        name, qual, module, filename, lineno = infos[key]
        kids = children.get(key, ())
        if len(kids) > 1:
            kids.sort(key=lambda c: -c.ttot)
        out.append(_frozen(FuncStat, {
            "name": name, "qualname": qual, "module": module,
            "filename": filename, "lineno": lineno, "ncall": ncall,
            "nactualcall": nact, "ttot": ttot * NS, "tsub": tsub * NS,
            "children": tuple(kids)}))
    out.sort(key=lambda f: -f.ttot)
    return out


def _merged(raw_profiles):
    """The function and edge rows of several profiles, summed by key."""
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
    return funcs, edges


def _frozen(cls, fields):
    """cls(**fields) for a frozen dataclass without __post_init__, every
    field given: its generated __init__ makes one object.__setattr__ call
    per field, and a calls=True profile builds one record per function
    and per edge."""
    obj = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


#: function key -> (the code registry's object, its cleaned info): a
#: sampled request with calls=True names the same functions as the last
#: one, so each is looked up and cleaned once (bounded: emptied when full)
_info_cache = {}
INFO_CACHE_MAX = 8192


def _func_info(key):
    obj = _registry.codes.get(key)
    hit = _info_cache.get(key)
    if hit is not None and hit[0] is obj and obj is not None:
        return hit[1]   # (the same code object: a key reused is missed)
    name, qual, module, filename, lineno = func_info(key)
    info = (clean(name), clean(qual), clean(module), clean(filename), lineno)
    if obj is not None:
        if len(_info_cache) >= INFO_CACHE_MAX:
            _info_cache.clear()
        _info_cache[key] = (obj, info)
    return info


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
     _dropped_spans, _dropped_calls, epoch0, wall0, names, stacks) = raw[:13]
    origin = ClockOrigin(epoch0, wall0)
    st = _clean_stacks(stacks) or {}
    names = request_names(_clean_names(names))
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
        waited.append(WaitedOn(greenlet_id=gid, name=clean(name) or "",
                               fn_name=clean(fn) or "", seconds=ns * NS))
    return {
        "spans": spans,
        "longest_span": (make_span(origin, SPAN_ROW.unpack(longest), names,
                                   st) if longest is not None else None),
        "greenlets": greenlets,
        "cpu": sum(cpus) if cpus else None,
        "waiting": Waiting(seconds=wait_ns * NS, top=tuple(waited),
                           complete=complete),
        **wait_sites(raw[13] if len(raw) > 13 else ((), b"", 0, b"", 0),
                     origin),
    }


#: a gqp_wait_event: (greenlet_id, start_ns, end_ns, site, reserved), and
#: a gqp_wait_stat: (site key, wait_ns, count, greenlets, tag, reserved)
WAIT_EVENT_ROW = struct.Struct("=QqqII")
WAIT_SITE_ROW = struct.Struct("=QqQQII")


def wait_sites(raw, origin):
    """The "waits", "dropped_waits", "wait_events" and
    "dropped_wait_events" fields from read_waits (_hooks.c)."""
    records, stats, dropped, events, events_dropped = raw
    sites = []
    for rec, (_key, ns, count, greenlets, _tag, _r) in zip(
            records, WAIT_SITE_ROW.iter_unpack(stats)):
        # (a record the registry dropped: the site's time without a name)
        _code, fn, filename, line, stack = rec or (None, "?", "", 0, ())
        sites.append(WaitSite(fn, filename, line, stack, ns * NS, count,
                              greenlets))
    order = sorted(range(len(sites)), key=lambda i: -sites[i].seconds)
    rank = {i: r for r, i in enumerate(order)}
    return {
        "waits": [sites[i] for i in order],
        "dropped_waits": dropped,
        "wait_events": [
            WaitEvent(gid, origin.to_epoch(a), origin.to_epoch(b), rank[i])
            for gid, a, b, i, _ in WAIT_EVENT_ROW.iter_unpack(events)
            if i in rank],
        "dropped_wait_events": events_dropped,
    }


#: the one field of a row route_numbers reads (a GREENLET_ROW's CPU, a
#: WAIT_SITE_ROW's ns): no tuple of seven ints built per row
_ROW_CPU = struct.Struct("=16xq32x")
_SITE_NS = struct.Struct("=8xq24x")
assert _ROW_CPU.size == GREENLET_ROW.size
assert _SITE_NS.size == WAIT_SITE_ROW.size


def route_numbers(raw):
    """(cpu seconds or None, waiting seconds, [(wait site, seconds)]) of a
    deferred profile's raw data, without building its fields (the route
    aggregates read these of every sampled request)."""
    cpu, seen = 0, False
    for (ns,) in _ROW_CPU.iter_unpack(raw[1]):
        if ns >= 0:
            cpu += ns
            seen = True
    sites = []
    if len(raw) > 13:
        records, stats = raw[13][0], raw[13][1]
        texts = _site_texts
        for rec, (ns,) in zip(records, _SITE_NS.iter_unpack(stats)):
            hit = texts.get(id(rec))   # (_site_text's hit, inline)
            sites.append((hit[1] if hit is not None and hit[0] is rec
                          else _site_text(rec), ns * NS))
    return (cpu * NS if seen else None), raw[4] * NS, sites


#: id of a wait site's record (the registry's tuple, the same object from
#: one sampled request to the next; kept here, so its id is not reused)
#: -> (record, its "fn (file:line)" text); bounded.  (Not keyed by the
#: record itself: a code object's hash reads its whole contents.)
_site_texts = {}


def _site_text(rec):
    if rec is None:
        return "? (:0)"   # (a record the registry dropped)
    hit = _site_texts.get(id(rec))
    if hit is not None and hit[0] is rec:
        return hit[1]
    if len(_site_texts) >= 4096:
        _site_texts.clear()
    text = "%s (%s:%d)" % (rec[1], rec[2], rec[3])
    _site_texts[id(rec)] = (rec, text)
    return text
