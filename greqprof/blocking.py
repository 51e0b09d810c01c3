"""Blocking alerts: the long spans the C hooks queue become BlockingEvents,
kept with the request they belong to and logged as WARNINGs that do not
flood (one per site, the code that held the loop, per blocking_interval;
the rest summed up; issue 16, item 5)."""
import os
from time import monotonic as _monotonic

from . import _collect, _lowlevel, _registry, logs
from ._lowlevel import NS
from .report import blocking_site, render_blocking, safe
from .routes import path_route
from .request_profile import BlockingEvent, fit_json

#: greqprof's own directory: its frames are not the app's
OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: blocking events kept per request (more are logged, not kept)
MAX_PER_REQUEST = 100


def drain(mw, eng):
    """Turns this thread's queued long-span records into blocking
    events: each is logged as a WARNING and kept with the open request
    it belongs to (by its profile, else by its greenlet).  greqprof's own
    work: not in the profile of the request whose greenlet runs it."""
    if not _registry.long_spans:
        return
    _registry.own_work()
    recs = _lowlevel.drain_long_spans(eng.thread_ident)
    done = 0
    try:
        for rec in recs:
            done += 1
            _report_long_span(mw, eng, rec)
    finally:
        if done < len(recs):
            # (a handler raised a GreenletExit or Timeout: the rest
            # is reported by the next drain)
            _lowlevel.requeue_long_spans(recs[done:])


def _report_long_span(mw, eng, rec):
    owner = eng.profile_requests.get(rec[7]) if rec[7] else None
    if owner is not None and rec[2] < owner.start_ns:
        owner = None  # a freed profile's address, reused since
    if owner is None:
        owner = _request_of_greenlet(eng, rec[10], rec[9], rec[2])
    ev = _blocking_event(mw, eng, rec, owner)
    if owner is not None and \
            len(owner.blocking) < MAX_PER_REQUEST:
        owner.blocking.append(ev)
    # Several middlewares may share this thread's engine: the one that
    # served the request reports it (when it reaches its threshold); a
    # span of no request, each that it reaches.
    for m in _reporters(eng, mw, owner):
        if rec[3] - rec[2] >= m.config.blocking_ns > 0:
            m.stats["blocking"] += 1
            _count_route(m, owner, ev)
            log_blocking(m, ev)


def _reporters(eng, mw, owner):
    """The middlewares that report a long span of owner's request: the one
    that served it, else (no request, or its middleware gone) every one
    the thread serves."""
    every = list(eng.middlewares) or [mw]
    if isinstance(owner, _UnsampledRequest):
        mine = [m for m in every if id(m) == owner.middleware_id]
    else:
        mine = [m for m in every if m is getattr(owner, "owner", None)]
    return mine or every


def _count_route(mw, owner, ev):
    """Counts the event by its request's route: a sampled request's when
    its profile is delivered (its route is known at the end), an
    unsampled one's now, by the name the app or its framework gave it so
    far (set_route, Flask's rule, Django's route), else by its path (a
    ``route=`` callable is asked only at the request's end)."""
    agg = getattr(mw, "_routes", None)
    if agg is None:
        return
    try:
        if owner is None:
            agg.add_blocking(None, ev.wall)
        elif getattr(owner, "profile", None) is None:
            agg.add_blocking(_route_so_far(owner), ev.wall)
        else:
            agg.count_blocking(ev.wall)
    except Exception as e:
        mw._internal_error("routes", e)


def _route_so_far(req):
    """The route an unsampled request counts under as far as it is known
    now (its name is cleaned by the routes table)."""
    for attr in ("route", "stack_route"):
        name = getattr(req, attr, None)
        if type(name) is str and name:
            return name
    return path_route(req.path or "")


def _request_of_greenlet(eng, chain, note, start=None):
    """The request a long span outside every request profile belongs
    to: the open request seen by observers only (no profile) of its
    greenlet or of the nearest of its spawners (chain: their ids, from
    the hooks), else the unsampled request noted for them (note:
    (method, path, request id, route) or None).  A spawner's sampled
    request is not it: a greenlet of that request would be in its
    profile (the spawner may serve its next request by now), nor is a
    spawner's request begun after the span (start, wall ns)."""
    requests = eng.requests
    for i, gid in enumerate(chain):
        req = requests.get(gid)
        if req is None:
            continue
        if req.profile is not None or (
                i and start is not None and start < req.start_ns):
            break
        return req
    return _UnsampledRequest(note) if note is not None else None


def _blocking_event(mw, eng, rec, owner):
    tid, gid, start, end, cpu, _flags, tag, paddr = rec[:8]
    name, fn = rec[11] or _registry.names.get(gid) or (
        "greenlet-%d" % gid, "")
    # A sampled request's profile still needs the stack for its span
    # (_build takes it); otherwise nothing else will.
    keep = owner is not None and owner.profile is not None
    take = _registry.stacks.get if keep else _registry.stacks.pop
    stack = take(tag, None) if tag else None
    sampled = eng.sampled_stacks.pop((gid, start), None)
    method = path = rid = None
    if owner is not None:
        method, path, rid = owner.method, owner.path, owner.request_id
    name, fn, stack, sampled, method, path, rid = _collect.blocking_texts(
        name, fn, stack, sampled, method, path, rid)
    if owner is not None and getattr(owner, "gid", None) == gid and \
            method and path:
        # the request's own greenlet: named after the request, as in
        # its profile (an unsampled request's is not known)
        name = "%s %s" % (method, path)
    if fn and (not name or name == "Greenlet" or
               name.startswith(("Greenlet-", "greenlet-"))):
        name = fn   # (unnamed: by its function, as in profiles)
    origin_epoch = _lowlevel.lib.gqp_clock_epoch_ns() - _lowlevel.wall_ns()
    return BlockingEvent(
        greenlet_id=gid, greenlet_name=name or "", fn_name=fn or "",
        start=(start + origin_epoch) * NS, end=(end + origin_epoch) * NS,
        wall=(end - start) * NS, cpu=None if cpu < 0 else cpu * NS,
        stack=stack, sampled_stack=sampled, method=method, path=path,
        request_id=rid, pid=mw.pid, hostname=mw.hostname)


def log_blocking(mw, ev):
    """A blocking event's WARNING: the first of its site in each
    blocking_interval; the rest are counted (and summed up by
    log_summaries)."""
    try:
        sites = mw._blocking_sites
        admitted = sites.admit(ev, _monotonic())
        if not admitted:
            mw.stats["blocking_not_logged"] += 1
            return
        logged = False
        try:
            logs.ensure_visible(mw.log, mw.json_logs)
            for summary in sites.expired(_monotonic()) \
                    if sites.pending else ():
                _log_summary(mw, *summary)
            if mw.json_logs:
                mw.log.warning(ev.to_json(max_bytes=mw.json_max_bytes))
            else:
                mw.log.warning(render_blocking(ev))
            logged = True
        finally:
            if not logged:
                # (a handler raised, e.g. GreenletExit: the event is
                # requeued, and its site must let it through then)
                sites.undo(admitted)
    except Exception as e:
        mw._internal_error("logging", e)


def log_summaries(mw, force=False):
    """One line per site whose interval ended with WARNINGs held back:
    how many, and the longest."""
    _registry.own_work()
    try:
        for summary in mw._blocking_sites.expired(_monotonic(), force):
            logs.ensure_visible(mw.log, mw.json_logs)
            _log_summary(mw, *summary)
    except Exception as e:
        mw._internal_error("logging", e)


def _log_summary(mw, site, n, longest, seconds):
    if mw.json_logs:
        mw.log.warning(fit_json({
            "schema": "greqprof.blocking_summary/1", "site": site,
            "not_logged": n, "longest": longest, "interval": seconds},
            mw.json_max_bytes))
    else:
        mw.log.warning(
            "Blocking spans not logged: %d more at %s within %g s of "
            "its last WARNING (the longest %.1f ms)"
            % (n, safe(site, 400), seconds, longest * 1000.0))


class BlockingSites:
    """Per site, when its last WARNING was logged and what was held back
    since; at most MAX sites (past that the oldest is summed up early)."""

    MAX = 1000

    def __init__(self, interval):
        self.interval = interval
        self.sites = {}   # site -> [logged_at, not_logged, longest]
        self.pending = []  # summaries due before the next WARNING

    def admit(self, ev, now):
        """Truthy: log ev now (pass it to undo() if that failed).  False:
        counted against its site instead."""
        if self.interval <= 0:
            return True
        site = blocking_site(ev)
        entry = self.sites.get(site)
        if entry is not None and now - entry[0] < self.interval:
            entry[1] += 1
            entry[2] = max(entry[2], ev.wall)
            return False
        if entry is None and len(self.sites) >= self.MAX:
            self._make_room(now)
        if entry is not None and entry[1]:
            # (its summary was not printed yet: it goes with this one)
            self.pending.append((site, entry[1], entry[2], self.interval))
            entry = [entry[0], 0, 0.0]
        self.sites[site] = [now, 0, 0.0]
        return (site, entry)

    def undo(self, admitted):
        """Forgets that admit() let an event through (it was not logged)."""
        if admitted is True:
            return
        site, previous = admitted
        if previous is None:
            self.sites.pop(site, None)
        else:
            self.sites[site] = previous

    def _make_room(self, now):
        for site in list(self.sites)[:self.MAX // 4]:
            entry = self.sites.pop(site)
            if entry[1]:
                self.pending.append((site, entry[1], entry[2],
                                     self.interval))

    def expired(self, now, force=False):
        """(site, not_logged, longest seconds, interval) of the sites
        whose interval ended with WARNINGs held back; those sites are
        forgotten."""
        out = self.pending
        self.pending = []
        for site, entry in list(self.sites.items()):
            if force or now - entry[0] >= self.interval:
                del self.sites[site]
                if entry[1]:
                    out.append((site, entry[1], entry[2], self.interval))
        return out


class _UnsampledRequest:
    """What a blocking report needs of an unsampled request."""

    __slots__ = ("method", "path", "request_id", "route", "profile",
                 "blocking", "middleware_id")

    def __init__(self, note):
        # (str or None: the notes keep only str; the middleware by its
        # address, or None)
        method, path, rid, route, self.middleware_id = note
        self.method = method or ""
        self.path = path or ""
        self.request_id = rid or None
        self.route = route or None
        self.profile = None
        self.blocking = []
