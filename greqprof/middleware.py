"""ProfilingMiddleware: per-request, greenlet-aware profiles for WSGI apps
served by gevent, plus blocking alerts for every request."""
import atexit
import hmac
import json
import logging
import math
import os
import random
import re
import socket
import sys
import threading
import weakref
from time import monotonic as _monotonic

from . import _collect, _lowlevel, _registry
from ._lowlevel import NS, RequestRawProfile
from . import engine as _engine
from .engine import engine_for_thread
from . import config
from .config import UNSET
from .errors import ConfigError
from ._text import clean
from .report import render_blocking, safe
from .request_profile import BlockingEvent, RequestProfile

try:
    from greenlet import getcurrent
except ImportError:  # pragma: no cover - greenlet is a dependency
    raise

MAX_PATH = 2048
#: environ key with the outermost ProfilingMiddleware of a request
MARK_KEY = "greqprof.middleware"
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
MAX_REQUEST_ID = 200


_middlewares = weakref.WeakSet()


def _after_fork_in_child():
    # Profiles open in the parent are the parent's to report: the child
    # starts with none counted against max_open.
    for mw in list(_middlewares):
        mw._open = 0
        mw.pid = os.getpid()  # (a system call: not made per profile)
        mw._disarm()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _Config:
    """Validated options shared by the middleware and its engines."""

    def __init__(self, pct, calls, clock, blocking_ms, max_spans, stacks,
                 watchdog, max_open):
        # Each against its documented range (config.py, docs/production.md).
        check = config.check
        pct, clock = check("pct", pct), check("clock", clock)
        blocking_ms = check("blocking_ms", blocking_ms)
        max_spans = check("max_spans", max_spans)
        max_open = check("max_open", max_open)
        calls, stacks = check("calls", calls), check("stacks", stacks)
        watchdog = check("watchdog", watchdog)
        self.pct = float(pct)
        self.calls = bool(calls)
        self.clock = clock
        self.blocking_ns = int(blocking_ms * 1e6) if blocking_ms else 0
        self.max_spans = max_spans
        self.stacks = bool(stacks)
        self.watchdog = bool(watchdog)
        self.max_open = max_open
        # Spans need CPU time for the report; the estimate reads the thread
        # CPU clock at most every 100 us while a sampled request is open,
        # every 10 ms otherwise (engine.CPU_WINDOW_*).
        self.cpu_mode = "estimate"


#: _begin's answer for a request to the inspector's own pages
_INSPECTOR = object()


#: an open request (C, _sampled.c): greenlet, gid, profile, addr, method,
#: path, status, start_ns, end_ns, request_id, sampled_by, error, done,
#: blocking, observed, generation, engine
_OpenRequest = _registry.Request


class ProfilingMiddleware(_registry.MiddlewareBase):
    """Wraps a WSGI app served by gevent.

    :param pct: share of requests (0.0-1.0) that get a full profile.
    :param calls: also collect function statistics for sampled requests.
    :param clock: ``"cpu"`` or ``"wall"`` for function times.
    :param blocking_ms: a span this long (wall milliseconds) is reported as
        a blocking WARNING, for every request, sampled or not (None: off).
    :param logger: logger name (or Logger) for reports.
    :param sink: callable receiving each finished :class:`RequestProfile`.
    :param json_logs: log one JSON line per profile / blocking event
        instead of the text report (for log shippers).
    :param json_max_bytes: longest JSON log line (bytes); a profile's
        spans and function table are cut to their top entries to fit
        (``"cut"`` says how many; sinks, files and the inspector get
        everything).
    :param blocking_interval: seconds between two blocking WARNINGs of the
        same site (the code that held the loop); the others are counted
        and summed up in one line (0: log every one).
    :param max_spans: spans kept per request profile (more are counted).
    :param stacks: capture stacks of blocking spans.
    :param seed: seed of the sampling RNG (reproducible sampling), or
    :param rng: a callable returning floats in [0, 1).
    :param trigger_header: header name whose value, when equal to
        ``trigger_secret`` (compared in constant time), profiles that one
        request regardless of ``pct``.  Off unless both are given.
    :param max_open: sampled profiles open at once; beyond it requests are
        not sampled (counted in ``stats['skipped_full']``).  Trigger-header
        requests have 8 slots of their own besides, so ordinary sampling
        (long streams) never takes theirs.
    :param report: log the text/JSON report of sampled requests.
    :param watchdog: run a watchdog thread that captures what a blocking
        greenlet is running while it holds the loop.
    :param max_lifetime: seconds a sampled request's profile may stay
        open (default 60): a longer request (a stream, a long poll) has its
        profile closed and delivered then, with ``truncated=True``, and
        its slot freed.
    :param linger: after the response ends, wait up to this many seconds
        for greenlets the request spawned (joined or not) before the
        profile is closed and reported; 0 reports at once (greenlets not
        yet started are then missed).
    :param profile_dir: write every profile to this directory, one file
        per format in ``formats`` (default ``["json"]``; any renderer name,
        see docs/viewing.md), named ``<UTC time>-<pid>-<path>-<n>.<ext>``.
    :param ui_path: serve the development inspector under this path (e.g.
        ``"/_greqprof"``); requests there go to it instead of the app.
        Off unless set.  Only loopback clients may use it unless
        ``ui_allow`` (addresses/networks) or ``ui_token`` (required as
        ``?token=`` or ``X-Greqprof-Token``) is given; it keeps the last
        ``ui_keep`` profiles.  The Host header must always name loopback
        or one of ``ui_hosts`` (host names or IP addresses), against DNS
        rebinding (docs/viewing.md).
    """

    def __init__(self, app, pct=UNSET, *, calls=UNSET, clock=UNSET,
                 blocking_ms=UNSET, logger=UNSET, sink=None,
                 json_logs=UNSET, max_spans=UNSET, stacks=True, seed=None,
                 rng=None, trigger_header=UNSET, trigger_secret=UNSET,
                 max_open=64, report=True, watchdog=True, linger=UNSET,
                 profile_dir=UNSET, formats=UNSET, ui_path=None, ui_allow=None,
                 ui_token=None, ui_keep=50, ui_hosts=None, otel=UNSET,
                 otel_spans=UNSET, observers=(), environ=None,
                 max_lifetime=60.0, blocking_interval=UNSET,
                 json_max_bytes=UNSET):
        if not callable(app):
            raise ConfigError("app must be a WSGI callable, got %r" % (app,))
        self.app = app
        # Options left at their default may come from GREQPROF_* variables
        # (greqprof/config.py); arguments given here win.
        opts = config.resolve(dict(
            pct=pct, calls=calls, clock=clock, blocking_ms=blocking_ms,
            logger=logger, json_logs=json_logs, max_spans=max_spans,
            trigger_header=trigger_header, trigger_secret=trigger_secret,
            linger=linger, profile_dir=profile_dir, formats=formats,
            otel=otel, otel_spans=otel_spans,
            blocking_interval=blocking_interval,
            json_max_bytes=json_max_bytes), environ)
        self.enabled = opts["enabled"]
        pct, calls, clock = opts["pct"], opts["calls"], opts["clock"]
        blocking_ms, logger = opts["blocking_ms"], opts["logger"]
        json_logs, max_spans = opts["json_logs"], opts["max_spans"]
        trigger_header = opts["trigger_header"]
        trigger_secret = opts["trigger_secret"]
        linger, profile_dir = opts["linger"], opts["profile_dir"]
        formats = opts["formats"]
        sources = opts["_sources"]

        # Validation that needs several options runs here; an error about
        # an option set by a GREQPROF_* variable names the variable.
        def configure():
            self.observers = list(observers)
            if opts["otel"]:
                from .otel import OtelObserver
                self.observers.append(
                    OtelObserver(child_spans=opts["otel_spans"]))
            self.linger = linger
            self.max_lifetime = max_lifetime
            self.config = _Config(pct, calls, clock, blocking_ms, max_spans,
                                  stacks, watchdog, max_open)
            if sink is not None and not callable(sink):
                raise ConfigError("sink must be callable, got %r" % (sink,))
            self.sink = sink
            self.json_logs = bool(json_logs)
            self.report = config.check("report", report)
            config.check("seed", seed)
            self._blocking_sites = _BlockingSites(float(config.check(
                "blocking_interval", opts["blocking_interval"])))
            self.json_max_bytes = config.check("json_max_bytes",
                                               opts["json_max_bytes"])
            self.log = (logger if isinstance(logger, logging.Logger)
                        else logging.getLogger(logger))
            if rng is not None and not callable(rng):
                raise ConfigError("rng must be a callable returning [0, 1)")
            self._random = rng or random.Random(seed).random
            if (trigger_header is None) != (trigger_secret is None):
                raise ConfigError("trigger_header and trigger_secret must be "
                                  "given together")
            if trigger_header is not None:
                if not isinstance(trigger_header, str) or not trigger_header:
                    raise ConfigError("trigger_header must be a header name")
                if not isinstance(trigger_secret, str) or len(trigger_secret) < 8:
                    raise ConfigError("trigger_secret must be a string of at "
                                      "least 8 characters")
                self._trigger_key = "HTTP_" + trigger_header.upper().replace(
                    "-", "_")
                self._trigger_secret = trigger_secret.encode("utf-8")
            else:
                self._trigger_key = None
                self._trigger_secret = None
            self._engine = None   # the last engine this middleware joined
            _middlewares.add(self)
            self._errors_logged = set()
            self.pid = os.getpid()
            self.hostname = socket.gethostname()
            self.stats = {"requests": 0, "sampled": 0, "skipped_full": 0,
                          "blocking": 0, "errors": 0, "delivered": 0,
                          "blocking_not_logged": 0}
            # -- profile files and the dev inspector (docs/viewing.md) --------
            from .inspector import ProfileOutputs
            self._outputs = ProfileOutputs.create(
                self.config.calls, profile_dir=profile_dir, formats=formats,
                ui_path=ui_path, ui_allow=ui_allow, ui_token=ui_token,
                ui_keep=ui_keep, ui_hosts=ui_hosts)
            self.inspector = self._outputs.ui if self._outputs else None
            # The C part runs unsampled requests (_fastpath.c) and the
            # common sampled ones (_sampled.c) by itself; the rest comes
            # back to _call_slow.
            cfg = self.config
            self._fast_setup(cfg.pct, self._random, self._trigger_key,
                             bool(cfg.blocking_ns),
                             self.inspector is not None or bool(self.observers),
                             self.stats, cfg.calls, self.linger,
                             cfg.max_open, cfg.max_spans, RequestRawProfile)
            self._finalize_setup(RequestProfile, _collect.request_records,
                                 cfg.clock, self.hostname)
            self._lifecycle_setup(bool(self.observers))

        try:
            configure()
        except ConfigError as e:
            raise config.name_source(e, sources) from None

    @property
    def max_lifetime(self):
        """Seconds a sampled request's profile may stay open: past it, the
        profile is closed, delivered with ``truncated=True`` and its slot
        freed, though the request goes on (a long stream, a long poll)."""
        return self._max_lifetime

    @max_lifetime.setter
    def max_lifetime(self, seconds):
        if isinstance(seconds, bool) or \
                not isinstance(seconds, (int, float)) or \
                not math.isfinite(seconds) or not 0 < seconds <= 1e6:
            raise ConfigError("max_lifetime must be a number of seconds "
                              "from 0 (excluded) to 1e6, got %r"
                              % (seconds,))
        self._max_lifetime = float(seconds)
        self._max_lifetime_ns = int(seconds * 1e9)

    @property
    def linger(self):
        """Seconds a finished sampled request waits for the greenlets it
        spawned (assignable; the C path follows)."""
        return self._linger

    @linger.setter
    def linger(self, linger):
        linger = config.check("linger", linger)
        self._set_linger(float(linger))
        self._linger = float(linger)

    def flush(self, timeout=None):
        """Finishes, at once, the profiles of this thread that are still
        waiting for their requests' greenlets (see ``linger``), so nothing
        is lost when a worker exits: those of every middleware the thread
        serves, each delivered by its own.  ``timeout``: seconds after
        which the rest is given up, a delivery under way included (a
        gevent.Timeout interrupts a sink or a log handler that waits on
        gevent; one that blocks the whole thread without yielding, such as
        an unpatched ``time.sleep``, cannot be interrupted); None: no
        limit.  Returns how many were delivered.

        It also runs by itself at interpreter exit (``atexit``, for the
        thread that exits) and, under ``python -m greqprof serve``, on
        SIGTERM and SIGINT."""
        return flush_thread(timeout)

    def __repr__(self):
        # Never show the trigger secret.
        return "<ProfilingMiddleware pct=%r calls=%r blocking_ms=%r>" % (
            self.config.pct, self.config.calls,
            self.config.blocking_ns / 1e6 or None)

    # -- the WSGI entry point ---------------------------------------------
    # __call__ is MiddlewareBase's, in C (_fastpath.c): a request that is
    # not sampled runs the app with no greqprof frame under it.  It hands
    # the other requests to _call_slow.

    def _call_slow(self, environ, start_response, drawn=None):
        """A request the C path does not run alone: drawn for a profile
        (drawn="pct": already drawn and counted), or one it does not decide
        (the trigger header, the inspector, observers, a thread not set up
        yet), which Python decides."""
        req = None
        if self.enabled and not isinstance(environ, dict):
            # (a dict is marked by the C path)
            try:
                outer = environ.get(MARK_KEY)
                if outer is self and self._reentered():
                    # forwarded to this middleware again: profiled once
                    return self.app(environ, start_response)
                if outer is not None and outer is not self:
                    self._defer(outer)
                    return self.app(environ, start_response)
                if outer is None:
                    environ[MARK_KEY] = self
            except Exception:
                pass
        if self.enabled:  # (GREQPROF_ENABLED=0: a plain pass-through)
            try:
                req = self._begin(environ, drawn)
            except Exception as e:  # greqprof must never break the app
                self._internal_error("begin", e)
        if req is None:
            return self.app(environ, start_response)
        if req is _INSPECTOR:
            return self.inspector(environ, start_response)  # not profiled
        return self._call_profiled(req, environ, start_response)

    def _reentered_here(self):
        """_reentered() in a thread this middleware is not armed for: an
        open request of this middleware on the running greenlet, in this
        thread's engine."""
        eng = _engine.current_engine()
        if eng is None:
            return False
        req = eng.requests.get(eng.tracer.greenlet_id(getcurrent()))
        return req is not None and req.owner is self and not req.done

    def _defer(self, outer):
        """This middleware serves requests that another ProfilingMiddleware
        around it profiles already: it passes them through (once logged)."""
        if getattr(self, "_deferring", False):
            return
        self._deferring = True
        try:
            self.log.warning(
                "greqprof: this ProfilingMiddleware is wrapped in another "
                "one (%r); it passes requests through and the outer one "
                "profiles them", outer)
        except Exception:
            pass

    # _call_profiled(req, environ, start_response) is MiddlewareBase's, in
    # C (_sampled.c): the app runs with a C start_response and its body is
    # passed through a C wrapper whose close() finishes the request.

    # -- per request ----------------------------------------------------------
    def _sample(self, environ):
        if self._trigger_key is not None:
            value = environ.get(self._trigger_key)
            if value is not None and hmac.compare_digest(
                    value.encode("latin-1", "replace"),
                    self._trigger_secret):
                return "trigger"
        pct = self.config.pct
        if pct >= 1.0 or (pct > 0.0 and self._random() < pct):
            return "pct"
        return None

    def _begin(self, environ, drawn=None):
        """The policy of a request the C path does not decide by itself:
        None for a request that is not followed (the common case), else
        the open request begun by the C lifecycle (or _INSPECTOR).
        drawn: the C path already drew (and counted) this request, sampled
        by that."""
        cfg = self.config
        if drawn is not None:
            sampled_by = drawn
        else:
            if self.inspector is not None and self.inspector.matches(environ):
                return _INSPECTOR
            self.stats["requests"] += 1
            sampled_by = self._sample(environ)
        if sampled_by is None and not self.observers:
            if cfg.blocking_ns:
                self._note_unsampled(environ)
            else:
                # What the greenlet spawns now is not its previous,
                # lingering request's.
                eng = _engine.current_engine()
                if eng is not None and eng.lingering:
                    self._stop_lingering(eng, getcurrent())
            return None
        eng = engine_for_thread(cfg)
        self._join(eng)
        # (C: the one place a followed request begins, _sampled.c's
        # open_request; it calls back _observe_begin)
        return self._begin_request(environ, sampled_by, eng.tracer.hooks_addr,
                                   eng, _engine.fork_generation())

    # -- the lifecycle's Python hooks (called by the C lifecycle, at fixed
    # points, for what is the user's: observers and function statistics) --

    def _observe_begin(self, req):
        for obs in self.observers:
            self._notify(obs, "on_begin", req)

    def _observe_end(self, req):
        """The response of req ended (its greenlet left the profile):
        blocking spans are drained and observers see the request while
        their trace span is still open.  A request without a profile also
        closes its greenlet's long-running span, so that span is reported
        under its name."""
        eng = req.engine
        if req.profile is None and self.config.blocking_ns and \
                req.gid is not None and not req.greenlet.dead:
            run = eng.tracer.running_since()
            if run is not None and run[1] == req.gid and \
                    req.end_ns - run[0] >= self.config.blocking_ns and \
                    not _registry.greenlet_profile(eng.tracer.addr,
                                                   req.greenlet):
                # (a greenlet in a profile is another request's by now)
                eng.tracer.attach_id(req.greenlet, 0)
        self._drain_blocking(eng)
        # (a truncated request's profile is delivered already)
        snapshot = (self._build(eng, req, snapshot=True)
                    if req.profile is not None and not req.truncated
                    else None)
        for obs in self.observers:
            self._notify(obs, "on_response_end", req, snapshot,
                         list(req.blocking))

    def _observe_profile(self, req, profile):
        for obs in self.observers:
            self._notify(obs, "on_profile", req, profile)

    @staticmethod
    def _calls_of(req):
        # greqprof's own frames (the middleware around the app) are
        # profiling overhead, not the app's time.
        return [f for f in _collect.func_stats([req.profile])
                if not f.filename.startswith(_OWN_DIR)]

    def _stop_lingering(self, eng, g):
        """g starts a new request while its previous sampled request still
        waits for its children: from now on, what g spawns is not that
        request's, nor are g's blocking spans (C: end_lingering, which the
        C path runs too)."""
        self._end_lingering(eng.tracer.hooks_addr, eng, g)

    @staticmethod
    def _let_children_start():
        """(end_lingering) The running greenlet went straight on to its
        next request (HTTP pipelining) while its previous one waits for its
        children: it yields once, so that the children it spawned for that
        one and that have not run yet start, and join that profile, before
        the next request begins (as when the next request is read from the
        socket).  Not from the hub, which may not wait."""
        import gevent
        hub = gevent.get_hub()
        if getcurrent() is not hub:
            gevent.sleep(0)

    def _note_unsampled(self, environ):
        """An unsampled request: no profile, no wrapping of the response,
        just a note of its method and path on its greenlet, which a
        blocking span of that greenlet (or of one it spawned) takes when it
        ends.  The C path does the same for the requests it runs
        (_fastpath.c); this one sets up the thread's engine and arms the C
        path for it."""
        eng = _engine.current_engine()
        if eng is None or eng.blocking_ns > self.config.blocking_ns:
            # (also lowers a shared engine's threshold to this one's)
            eng = engine_for_thread(self.config)
        self._join(eng)
        g = getcurrent()
        if eng.lingering:
            self._stop_lingering(eng, g)
        gid = _registry.greenlet_id(eng.tracer.addr, g)
        if gid:
            _registry.note(eng.tracer.hooks_addr, gid,
                           environ.get("REQUEST_METHOD"),
                           environ.get("PATH_INFO"),
                           environ.get("HTTP_X_REQUEST_ID"))

    def _join(self, eng):
        """This thread's engine serves this middleware: registered with it,
        its drain loop running (blocking detection on), and the C path
        armed for its thread."""
        if self._engine is not eng:
            eng.middlewares.add(self)
            self._engine = eng
        if self.config.blocking_ns and not eng.drain_started:
            self._start_drain_loop(eng)
        if not eng.reaper_started:
            self._start_reaper(eng)
        self._arm(eng.tracer.hooks_addr, eng, _engine.fork_generation())

    def _notify(self, observer, event, *args):
        fn = getattr(observer, event, None)
        if fn is not None:
            try:
                fn(*args)
            except Exception as e:
                self._internal_error("observer %s" % event, e)

    def _schedule_finalize(self, eng, req):
        """Queues req for the engine's finisher greenlet (one per thread,
        not one per request).  It wakes through a loop callback queued after
        the start callbacks of the children the request just spawned, so
        they have made their first switch, and joined, by then."""
        eng.pending.append((self, req))
        if not eng.finisher_woken:
            self._wake_finisher_soon(eng)

    def _wake_finisher_soon(self, eng):
        eng.finisher_woken = True
        import gevent
        gevent.get_hub().loop.run_callback(self._wake_finisher, eng)

    def _wake_finisher_from_thread(self, eng):
        """A request of eng's thread was finished from this (another)
        thread: eng's finisher is woken in its own thread."""
        hub = eng.hub
        if hub is not None and not eng.abandoned:
            hub.loop.run_callback_threadsafe(self._wake_finisher_soon, eng)

    def _wake_finisher(self, eng):
        # Runs in the hub: the finisher is spawned from here so it belongs
        # to no request.
        import gevent
        fin = eng.finisher
        if not eng.reaper_started and not eng.abandoned:
            # (the reaper was killed: started again)
            eng.reaper_started = True
            gevent.spawn(_reaper_main, eng)
        if fin is None or fin.dead:
            eng.finisher = gevent.spawn(_finisher_loop, eng)
        elif eng.finisher_wake is not None:  # (else: not started yet)
            eng.finisher_wake.set()

    # _finalize(eng, req) is MiddlewareBase's, in C (_sampled.c's
    # mw_finalize): every profile is closed, built and delivered there.

    def _build(self, eng, req, snapshot=False):
        """The RequestProfile of req (_sampled.c's build_profile, which
        the C lifecycle calls itself); snapshot=True reads an open profile
        without consuming its stacks (for observers), and without its
        blocking events."""
        calls = self._calls_of(req) if self.config.calls else None
        return self._build_profile(eng.tracer.addr, req, snapshot, calls)

    def _drain_loop(self, eng):
        """Reports blocking spans of greenlets outside requests, once a
        second (requests drain at their end)."""
        import gevent
        while not eng.abandoned:
            gevent.sleep(1.0)
            try:
                self._drain_blocking(eng)
                for mw in list(eng.middlewares) or [self]:
                    mw._log_blocking_summaries()
            except Exception as e:
                self._internal_error("drain", e)

    def _start_reaper(self, eng):
        eng.reaper_started = True
        try:
            import gevent
            # Spawned from the hub so it belongs to no request.
            gevent.get_hub().loop.run_callback(gevent.spawn, _reaper_main,
                                               eng)
        except Exception as e:
            self._internal_error("reaper", e)

    def _truncate(self, eng, req, now):
        """req's profile has been open longer than max_lifetime: closed
        and delivered now, marked truncated; the request goes on
        unprofiled (its end finds it done)."""
        req.truncated = True
        req.done = True
        req.end_ns = now
        g = req.greenlet
        try:
            # (detached only from this request's profile: by now g may
            # serve another request, in that one's profile)
            if not g.dead and _registry.greenlet_profile(
                    eng.tracer.addr, g) == req.addr:
                eng.tracer.attach_id(g, 0)
            if eng.lingering.get(id(g)) is req:
                del eng.lingering[id(g)]
        finally:
            self._finalize(eng, req)

    def _start_drain_loop(self, eng):
        eng.drain_started = True
        try:
            import gevent
            # Spawned from the hub so it belongs to no request.
            gevent.get_hub().loop.run_callback(
                gevent.spawn, self._drain_loop, eng)
        except Exception as e:
            self._internal_error("drain", e)

    MAX_BLOCKING_PER_REQUEST = 100

    def _drain_blocking(self, eng, req=None):
        """Turns this thread's queued long-span records into blocking
        events: each is logged as a WARNING and kept with the open request
        it belongs to (by its profile, else by its greenlet)."""
        if not _registry.long_spans:
            return
        recs = _lowlevel.drain_long_spans(eng.thread_ident)
        done = 0
        try:
            for rec in recs:
                done += 1
                self._report_long_span(eng, rec)
        finally:
            if done < len(recs):
                # (a handler raised a GreenletExit or Timeout: the rest
                # is reported by the next drain)
                _lowlevel.requeue_long_spans(recs[done:])

    def _report_long_span(self, eng, rec):
        owner = eng.profile_requests.get(rec[7]) if rec[7] else None
        if owner is not None and rec[2] < owner.start_ns:
            owner = None  # a freed profile's address, reused since
        if owner is None:
            owner = self._request_of_greenlet(eng, rec[10], rec[9], rec[2])
        ev = self._blocking_event(eng, rec, owner)
        if owner is not None and \
                len(owner.blocking) < self.MAX_BLOCKING_PER_REQUEST:
            owner.blocking.append(ev)
        # Several middlewares may share this thread's engine: each
        # reports what reaches its own threshold.
        for mw in list(eng.middlewares) or [self]:
            if rec[3] - rec[2] >= mw.config.blocking_ns > 0:
                mw.stats["blocking"] += 1
                mw._log_blocking(ev)

    @staticmethod
    def _request_of_greenlet(eng, chain, note, start=None):
        """The request a long span outside every request profile belongs
        to: the open request seen by observers only (no profile) of its
        greenlet or of the nearest of its spawners (chain: their ids, from
        the hooks), else the unsampled request noted for them (note:
        (method, path, request id) or None).  A spawner's sampled request
        is not it: a greenlet of that request would be in its profile (the
        spawner may serve its next request by now), nor is a spawner's
        request begun after the span (start, wall ns)."""
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

    def _blocking_event(self, eng, rec, owner):
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
            request_id=rid, pid=self.pid, hostname=self.hostname)

    # -- output -------------------------------------------------------------
    def _log_blocking(self, ev):
        """A blocking event's WARNING: the first of its site in each
        blocking_interval; the rest are counted (and summed up by
        _log_blocking_summaries)."""
        try:
            sites = self._blocking_sites
            admitted = sites.admit(ev, _monotonic())
            if not admitted:
                self.stats["blocking_not_logged"] += 1
                return
            logged = False
            try:
                _ensure_visible(self.log)
                for summary in sites.expired(_monotonic()) \
                        if sites.pending else ():
                    self._log_summary(*summary)
                if self.json_logs:
                    self.log.warning(json.dumps(ev.to_dict()))
                else:
                    self.log.warning(render_blocking(ev))
                logged = True
            finally:
                if not logged:
                    # (a handler raised, e.g. GreenletExit: the event is
                    # requeued, and its site must let it through then)
                    sites.undo(admitted)
        except Exception as e:
            self._internal_error("logging", e)

    def _log_blocking_summaries(self, force=False):
        """One line per site whose interval ended with WARNINGs held back:
        how many, and the longest."""
        try:
            for summary in self._blocking_sites.expired(_monotonic(),
                                                         force):
                _ensure_visible(self.log)
                self._log_summary(*summary)
        except Exception as e:
            self._internal_error("logging", e)

    def _log_summary(self, site, n, longest, seconds):
        if self.json_logs:
            self.log.warning(json.dumps({
                "schema": "greqprof.blocking_summary/1", "site": site,
                "not_logged": n, "longest": longest, "interval": seconds}))
        else:
            self.log.warning(
                "Blocking spans not logged: %d more at %s within %g s of "
                "its last WARNING (the longest %.1f ms)"
                % (n, safe(site, 400), seconds, longest * 1000.0))

    def _deliver(self, profile):
        if self.report:
            try:
                log = self.log
                _ensure_visible(log)
                if log.isEnabledFor(logging.INFO) and _would_emit(log):
                    if self.json_logs:
                        log.info(profile.to_json(
                            max_bytes=self.json_max_bytes))
                    else:
                        log.info(profile.report())
            except Exception as e:
                self._internal_error("logging", e)
        if self.sink is not None:
            try:
                self.sink(profile)
            except Exception as e:
                self._internal_error("sink", e)
        if self._outputs is not None:  # profile_dir / inspector ring
            self._outputs.deliver(profile, self._internal_error)
        self.stats["delivered"] += 1

    def _internal_error(self, where, exc):
        """Logs an internal failure once per place; never raises."""
        self.stats["errors"] += 1
        if where in self._errors_logged:
            return
        self._errors_logged.add(where)
        try:
            # (the message may quote request data: escaped like reports)
            self.log.error("greqprof: %s failed (%s: %s); the request was not "
                           "affected; further %s errors are counted in "
                           "stats['errors']", where, type(exc).__name__,
                           safe(str(exc), 300), where)
        except Exception:
            pass


def find_middleware(app, depth=8):
    """The ProfilingMiddleware that app is or carries (Flask's
    ``app.wsgi_app = ProfilingMiddleware(app.wsgi_app)``, a wrapper's
    ``.app``/``.application``/``__wrapped__``), looked for up to depth
    objects deep; None when there is none."""
    seen = set()
    todo = [(app, 0)]
    while todo:
        obj, d = todo.pop(0)
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, ProfilingMiddleware):
            return obj
        if d >= depth:
            continue
        for name in ("wsgi_app", "app", "application", "__wrapped__",
                     "__self__"):
            try:
                inner = getattr(obj, name, None)
            except Exception:
                continue
            if inner is not None and not isinstance(inner, (str, bytes)):
                todo.append((inner, d + 1))
    return None


#: notes kept per request, and characters per note
MAX_NOTES = 50
MAX_NOTE = 1000
MAX_ERROR = 1000


class ProfileHandle:
    """What the app may attach to the request being profiled (see
    :func:`current_profile`).  False (and its methods do nothing) when
    the request is not sampled."""

    __slots__ = ("_req",)

    def __init__(self, req):
        self._req = req

    @property
    def sampled(self):
        """True when the request is being profiled."""
        req = self._req
        return req is not None and req.profile is not None

    def __bool__(self):
        return self.sampled

    def _open(self):
        # (once finalized, what is attached reaches no profile)
        req = self._req
        return req is not None and req.greenlet is not None and \
            not req.finalizing

    def note(self, text):
        """Adds a note (any text; cleaned, cut to 1000 characters; 50 at
        most per request) to the request's profile."""
        if self._open():
            notes = self._req.notes
            if notes is None:
                notes = self._req.notes = []
            if len(notes) < MAX_NOTES:
                notes.append(clean(text, MAX_NOTE))

    def set_error(self, error):
        """Records an exception (``"Type: message"``) or a text as the
        request's ``error``, e.g. one the framework handled itself."""
        if not self._open():
            return
        if isinstance(error, BaseException):
            try:
                msg = str(error)
            except Exception:
                msg = "<unprintable>"
            error = "%s: %s" % (type(error).__name__, msg)
        self._req.error = clean(error, MAX_ERROR)

    def __repr__(self):
        return "<greqprof.ProfileHandle %s>" % (
            "sampled" if self.sampled else "not sampled")


_NO_PROFILE = ProfileHandle(None)


def current_profile():
    """The :class:`ProfileHandle` of the request the calling greenlet
    serves (or was spawned by, directly or not), for the app to attach an
    exception or a note to its profile; a handle that does nothing (and
    is false) when the request is not sampled.  Never raises."""
    try:
        eng = _engine.current_engine()
        if eng is None or not eng.profile_requests:
            return _NO_PROFILE
        # The profile the greenlet is in (its request's, or inherited from
        # the request that spawned it): not its spawner's current request,
        # which on a keep-alive connection may be a later one.
        addr = _registry.greenlet_profile(eng.tracer.addr, getcurrent())
        req = eng.profile_requests.get(addr) if addr else None
        return ProfileHandle(req) if req is not None else _NO_PROFILE
    except Exception:
        return _NO_PROFILE


def flush_thread(timeout=None):
    """ProfilingMiddleware.flush() for the calling thread's engine."""
    from .engine import current_engine
    eng = current_engine()
    if eng is None:
        return 0
    deadline = None if timeout is None else _monotonic() + timeout
    n = 0
    # pending, not lingering: a request whose greenlet went on to its
    # next request left lingering but still waits for its children.
    # Each by its own middleware (several may share the thread).
    for mw, req in list(eng.pending):
        left = None if deadline is None else deadline - _monotonic()
        if left is not None and left <= 0:
            break
        if req.profile is not None and req.greenlet is not None and \
                not req.finalizing:
            if not _finalize_within(mw, eng, req, left):
                break   # (out of time in a delivery: the rest is given up)
            n += 1
    return n


def _finalize_within(mw, eng, req, seconds):
    """mw._finalize(eng, req), its delivery interrupted by a gevent.Timeout
    after seconds (None: no limit).  False when it was: the request is
    released undelivered.  (A sink that blocks the thread without yielding
    to gevent cannot be interrupted.)"""
    import gevent
    if seconds is None or getcurrent() is gevent.get_hub():
        mw._finalize(eng, req)   # (the hub cannot wait for a Timeout)
        return True
    timer = gevent.Timeout(seconds)
    timer.start()
    try:
        mw._finalize(eng, req)
    except gevent.Timeout as e:
        if e is not timer:
            raise
        return False
    finally:
        timer.close()
    return True


#: seconds the flush at interpreter exit may take at most
EXIT_FLUSH_S = 5.0


def _flush_at_exit():
    """atexit: the profiles still lingering or queued in the exiting
    thread are delivered (bounded by EXIT_FLUSH_S)."""
    if not _middlewares:
        return
    try:
        flush_thread(EXIT_FLUSH_S)
    except BaseException:   # (never fail the interpreter's exit)
        pass


atexit.register(_flush_at_exit)


# -- visible by default (issue 16, item 4) ----------------------------------

class _DefaultHandler(logging.StreamHandler):
    """The handler greqprof adds to its logger when nothing in the logger's
    hierarchy has one (werkzeug does the same for its own logger): reports
    and WARNINGs go to stderr.  It steps aside as soon as any other handler
    appears in the hierarchy, so the application's logging configuration,
    made before or after, wins."""

    def __init__(self, logger, set_level):
        super().__init__()
        self._logger = logger
        self._set_level = set_level   # we set the logger's level to INFO
        self.setFormatter(logging.Formatter(
            "%(asctime)s %(levelname)s [%(name)s] %(message)s"))

    @property
    def stream(self):
        return sys.stderr   # (the current one: it may be replaced)

    @stream.setter
    def stream(self, value):
        pass

    def emit(self, record):
        if self._others():
            self._retire()
            return   # (the record goes on to the application's handlers)
        super().emit(record)

    def _others(self):
        c = self._logger
        while c is not None:
            for h in c.handlers:
                if h is not self:
                    return True
            if not c.propagate:
                return False
            c = c.parent
        return False

    def _retire(self):
        self._logger.removeHandler(self)
        if self._set_level and self._logger.level == logging.INFO:
            self._logger.setLevel(logging.NOTSET)


def _ensure_visible(logger):
    """On a logger's first use by greqprof: when no handler anywhere in its
    hierarchy would print (logging.lastResort does not count: it prints
    WARNINGs only, and only the message), adds a _DefaultHandler."""
    if logger.name in _checked_loggers:
        return
    with _checked_lock:   # (threads: one handler, not one each)
        if logger.name in _checked_loggers:
            return
        if len(_checked_loggers) >= 1000:   # (logger names a user passes)
            _checked_loggers.clear()
        if not logger.hasHandlers():
            set_level = logger.level == logging.NOTSET
            logger.addHandler(_DefaultHandler(logger, set_level))
            if set_level:
                logger.setLevel(logging.INFO)
        _checked_loggers.add(logger.name)


_checked_loggers = set()
_checked_lock = threading.Lock()


def _would_emit(logger, level=logging.INFO):
    """Some handler the record would reach takes ``level`` (levels only;
    filters are the handlers' business).  A report nobody would print is
    not rendered."""
    c = logger
    found = False
    while c is not None:
        for h in c.handlers:
            found = True
            if level >= h.level:
                return True
        if not c.propagate:
            break
        c = c.parent
    # (no handler at all: logging.lastResort, which takes WARNING and up)
    return not found and level >= logging.lastResort.level \
        if logging.lastResort is not None else False


# -- blocking WARNINGs that do not flood (issue 16, item 5) ------------------

_FRAME = re.compile(r'^\s*File "(.*)", line (\d+), in (.*)$')
_NOT_APP = (os.sep + "gevent" + os.sep, os.sep + "greenlet" + os.sep)


def blocking_site(ev):
    """The code that held the loop: "function (file:line)" of the innermost
    app frame (not gevent's, greenlet's or greqprof's) of the watchdog's
    stack, else of the switch-out stack; else the greenlet's function."""
    for stack in (ev.sampled_stack, ev.stack):
        if not stack:
            continue
        for line in reversed(stack.rstrip("\n").split("\n")):
            m = _FRAME.match(line)
            if m is None:
                continue
            filename = m.group(1)
            if filename.startswith(_OWN_DIR) or \
                    any(d in filename for d in _NOT_APP):
                continue
            return "%s (%s:%s)" % (m.group(3), filename, m.group(2))
    return ev.fn_name or ev.greenlet_name or "greenlet %d" % ev.greenlet_id


class _BlockingSites:
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


def _forget(eng, req):
    """req leaves the engine's dicts of open requests."""
    if eng.requests.get(req.gid) is req:
        del eng.requests[req.gid]
    if eng.profile_requests.get(req.addr) is req:
        del eng.profile_requests[req.addr]


#: seconds the finisher stays up after a batch, collecting more: profiles
#: then finish in batches, with one wake-up each instead of one per sampled
#: request (a wake-up is a loop callback, an Event and two switches)
FINISH_BATCH_S = 0.01


def _finisher_loop(eng):
    """Finishes queued profiles whose requests' greenlets are all done (or
    whose linger ran out); sleeps while nothing waits."""
    try:
        _finish_pending_forever(eng)
    finally:
        # Killed, or failed: the next request queued wakes a new one.
        eng.finisher_woken = False


def _finish_pending_forever(eng):
    import gevent
    from gevent.event import Event
    eng.finisher_wake = Event()
    while not eng.abandoned:
        # Up and about to look at `pending`: nobody needs to wake it.
        eng.finisher_woken = True
        # (in C: finalizes the queued requests that are done)
        waiting = _registry.finish_pending(eng, eng.pending,
                                           _lowlevel.wall_ns())
        if waiting == 2:
            # Requests seen queued for the first time: the start callbacks
            # of children they spawned run before this greenlet's next
            # turn, then they are looked at again (once per round: more
            # first looks wait for the next round).
            gevent.sleep(0)
            waiting = _registry.finish_pending(eng, eng.pending,
                                               _lowlevel.wall_ns())
        if waiting == 1:
            gevent.sleep(0.005)
            continue
        gevent.sleep(FINISH_BATCH_S)
        if eng.pending:
            continue
        eng.finisher_woken = False
        eng.finisher_wake.clear()
        eng.finisher_wake.wait()


def _reaper_main(eng):
    """The reaper greenlet: _reaper_loop, gone on with after a
    BaseException that is not an Exception, nor an exit (a sink's
    gevent.Timeout: the request it came from is released by then).
    Killed (GreenletExit), it is started again by the next request set up
    in Python or the finisher's next wake."""
    import gevent
    try:
        while not eng.abandoned:
            try:
                _reaper_loop(eng)
            except (gevent.GreenletExit, SystemExit, KeyboardInterrupt):
                raise
            except BaseException:
                pass
    finally:
        eng.reaper_started = False


def _reaper_loop(eng):
    """Closes, in the engine's thread, the profiles open longer than
    their middleware's max_lifetime (checked a few times per lifetime, at
    least once a second).  Each request is truncated on its own: an error
    is logged and the next goes on; a BaseException that is not an
    Exception goes on once that request is released (the rest wait for
    the next round)."""
    import gevent
    while not eng.abandoned:
        lifetimes = [mw._max_lifetime for mw in list(eng.middlewares)]
        gevent.sleep(min([1.0] + [t / 4 for t in lifetimes]))
        if eng.abandoned or not eng.profile_requests:
            continue
        if eng.pending and not eng.finisher_woken:
            # (a request finished from another thread was queued here
            # without waking this thread's finisher)
            for mw in list(eng.middlewares)[:1]:
                mw._wake_finisher_soon(eng)
        now = _lowlevel.wall_ns()
        for req in list(eng.profile_requests.values()):
            mw = req.owner
            if mw is None or req.done or req.greenlet is None or \
                    req.finalizing or \
                    now - req.start_ns < mw._max_lifetime_ns:
                continue
            try:
                mw._truncate(eng, req, now)
            except Exception as e:
                mw._internal_error("max_lifetime", e)
            # (any other BaseException: _truncate's _finalize released the
            # request; _reaper_main starts the reaper again)


class _UnsampledRequest:
    """What a blocking report needs of an unsampled request."""

    __slots__ = ("method", "path", "request_id", "profile", "blocking")

    def __init__(self, note):
        method, path, rid = note   # str or None (RequestNotes keeps str)
        self.method = method or ""
        self.path = path or ""
        self.request_id = rid or None
        self.profile = None
        self.blocking = []


def _show_defaults(init):
    """help(ProfilingMiddleware) shows each option's real default, not the
    UNSET marker that lets GREQPROF_* variables fill it in."""
    import inspect
    defaults = {opt: default for opt, _parse, default
                in config.VARIABLES.values()}
    sig = inspect.signature(init)
    init.__signature__ = sig.replace(parameters=[
        p.replace(default=defaults[p.name])
        if p.default is UNSET and p.name in defaults else p
        for p in sig.parameters.values()])


_show_defaults(ProfilingMiddleware.__init__)
