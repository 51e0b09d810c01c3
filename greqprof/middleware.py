"""ProfilingMiddleware: per-request, greenlet-aware profiles for WSGI apps
served by gevent, plus blocking alerts for every request."""
import logging
import math
import os
import random
import socket
import weakref
from time import monotonic as _monotonic

from . import _collect, _registry, blocking, logs, loops, policy, routes, sampler
from . import _lowlevel
from ._lowlevel import RequestRawProfile
from . import engine as _engine
from .engine import engine_for_thread
from . import config
from .config import UNSET
from .errors import ConfigError
from .report import safe
from .request_profile import RequestProfile

try:
    from greenlet import getcurrent
except ImportError:  # pragma: no cover - greenlet is a dependency
    raise

#: environ key with the outermost ProfilingMiddleware of a request
MARK_KEY = "greqprof.middleware"


def _after_fork_in_child():
    # Profiles open in the parent are the parent's to report: the child
    # starts with none counted against max_open.
    for mw in list(loops.live_middlewares):
        mw._open = 0
        mw.pid = os.getpid()  # (a system call: not made per profile)
        mw._disarm()
        if getattr(mw, "_routes", None) is not None:   # (None: init failed)
            try:
                mw._new_routes()
            except Exception as e:
                mw._routes.after_fork()   # (the parent's counts, usable)
                mw._internal_error("routes", e)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _mounted_route(environ):
    """The path route of a request to an app mounted under a SCRIPT_NAME
    (SCRIPT_NAME + PATH_INFO), else None."""
    root = environ.get("SCRIPT_NAME")
    if type(root) is not str or not root:
        return None
    try:
        return routes.RouteNamer.path_name(environ)
    except Exception:   # (odd environ values: PATH_INFO's route stays)
        return None


def _in_loop_of(hub):
    """Whether the calling greenlet runs under hub's loop (a server's
    greenlet, or one it made): a hub that merely exists, as an engine
    makes one in a thread a sync server serves, may never run."""
    g = getcurrent()
    for _ in range(16):
        g = g.parent
        if g is None:
            return False
        if g is hub:
            return not hub.dead
    return False


#: _begin's answer for a request to the inspector's own pages
_INSPECTOR = object()


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
    :param seed: seed of the sampling RNG, for reproducible sampling
        (None: random).
    :param rng: a callable returning floats in [0, 1), drawn instead of
        the RNG (None: the RNG).
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
    :param stack_hz: samples per second of each serving thread's running
        Python stack, counted per request route (``write_pprof``); the
        hub is left out (default 100).  0 or None: off.
    :param max_lifetime: seconds a sampled request's profile may stay
        open (default 60): a longer request (a stream, a long poll) has its
        profile closed and delivered then, with ``truncated=True``, and
        its slot freed.
    :param linger: after the response ends, wait up to this many seconds
        for greenlets the request spawned (joined or not) before the
        profile is closed and reported (looked at every 5 ms at first,
        then every 50 ms); 0 reports at once (greenlets not yet started
        are then missed).
    :param profile_dir: write every profile to this directory, one file
        per format in ``formats`` (default ``["json"]``; any renderer name,
        see docs/viewing.md), named ``<UTC time>-<pid>-<path>-<n>.<ext>``.
    :param route: a callable ``environ -> str`` naming a request's route
        when the framework gave no template (Flask's is read by itself;
        Django: ``greqprof.routes.DjangoRouteMiddleware``) and
        ``greqprof.set_route`` was not called; None (default): the path,
        id-like segments replaced by ``{id}``.
    :param max_routes: routes kept by :meth:`routes` (default 500); the
        requests of further routes are counted under ``"<other>"``.
    :param summary_s: every this many seconds, when requests ran, log
        one INFO line with the top routes by total CPU and by p99 (default
        60; None: off).
    :param metrics_path: serve Prometheus metrics of the routes under
        this path (e.g. ``"/_greqprof/metrics"``; off unless set; needs
        ``greqprof[prometheus]``), with the inspector's access rules
        (``ui_allow``, ``ui_token``, ``ui_hosts``; loopback only without
        them); docs/fleet.md.
    :param ui_path: serve the development inspector under this path (e.g.
        ``"/_greqprof"``); requests there go to it instead of the app.
        Off unless set.  Only loopback clients may use it unless
        ``ui_allow`` (addresses/networks) or ``ui_token`` (required as
        ``?token=`` or ``X-Greqprof-Token``) is given; it keeps the last
        ``ui_keep`` profiles.  The Host header must always name loopback
        or one of ``ui_hosts`` (host names or IP addresses), against DNS
        rebinding (docs/viewing.md).
    :param otel: export each sampled profile to OpenTelemetry (needs
        ``greqprof[otel]``; docs/production.md).
    :param otel_spans: with ``otel``, a child span per greenlet span.
    :param observers: objects with any of ``on_begin(req)``,
        ``on_response_end(req, snapshot, blocking)`` and
        ``on_profile(req, profile)``; with any, every request is followed
        in Python (docs/production.md).
    :param environ: the mapping the ``GREQPROF_*`` variables are read
        from instead of ``os.environ`` (docs/production.md).
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
                 json_max_bytes=UNSET, stack_hz=UNSET, route=None,
                 max_routes=UNSET, summary_s=UNSET, metrics_path=UNSET):
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
            json_max_bytes=json_max_bytes, stack_hz=stack_hz,
            max_routes=max_routes, summary_s=summary_s,
            metrics_path=metrics_path), environ)
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
            self.config = policy.Config(pct, calls, clock, blocking_ms, max_spans,
                                  stacks, watchdog, max_open)
            if sink is not None and not callable(sink):
                raise ConfigError("sink must be callable, got %r" % (sink,))
            self.sink = sink
            self.json_logs = bool(json_logs)
            self.report = config.check("report", report)
            config.check("seed", seed)
            self._blocking_sites = blocking.BlockingSites(float(config.check(
                "blocking_interval", opts["blocking_interval"])))
            self.json_max_bytes = config.check("json_max_bytes",
                                               opts["json_max_bytes"])
            self.log = (logger if isinstance(logger, logging.Logger)
                        else logging.getLogger(logger))
            if rng is not None and not callable(rng):
                raise ConfigError("rng must be a callable returning [0, 1)")
            self._random = rng or random.Random(seed).random
            self._trigger_key, self._trigger_secret = policy.trigger(
                trigger_header, trigger_secret)
            self._engine = None   # the last engine this middleware joined
            loops.live_middlewares.add(self)
            self._errors_logged = set()
            self.pid = os.getpid()
            self.hostname = socket.gethostname()
            self.stats = {"requests": 0, "sampled": 0, "skipped_full": 0,
                          "blocking": 0, "errors": 0, "delivered": 0,
                          "blocking_not_logged": 0}
            # -- profile files and the dev inspector (docs/viewing.md) --------
            from .inspector import ProfileOutputs
            metrics_path = config.check("metrics_path",
                                        opts["metrics_path"])
            # (the access options serve the metrics page without ui_path)
            ui = ui_path is not None or metrics_path is None
            self._outputs = ProfileOutputs.create(
                self.config.calls, profile_dir=profile_dir, formats=formats,
                ui_path=ui_path, ui_allow=ui_allow if ui else None,
                ui_token=ui_token if ui else None,
                ui_keep=ui_keep, ui_hosts=ui_hosts if ui else None)
            self.inspector = self._outputs.ui if self._outputs else None
            # The C part runs unsampled requests (_fastpath.c) and the
            # common sampled ones (_sampled.c) by itself; the rest comes
            # back to _call_slow.
            cfg = self.config
            # (the sampler names a sample's route from the request's note)
            self._stack_hz = float(opts["stack_hz"] or 0)
            self._fast_setup(cfg.pct, self._random, self._trigger_key,
                             bool(cfg.blocking_ns or self._stack_hz),
                             self.inspector is not None or bool(self.observers),
                             self.stats, cfg.calls, self.linger,
                             cfg.max_open, cfg.max_spans, RequestRawProfile)
            self._finalize_setup(RequestProfile, _collect.request_records,
                                 cfg.clock, self.hostname)
            self._lifecycle_setup(bool(self.observers))
            # -- per-route aggregates of every request (docs/fleet.md) -------
            config.check("route", route)
            self._route_names = {}   # raw route -> its name (sampled)
            self._route_opts = (route, config.check(
                "max_routes", opts["max_routes"]))
            # (Flask's matched url_rule names its requests when Flask is
            # imported by then, as with app.wsgi_app = ...(app.wsgi_app))
            routes.install_flask_hook()
            if self.inspector is not None:
                self.inspector.stack_hz = self._stack_hz
            self.metrics = None
            self._metrics_gate = None
            self.metrics_path = metrics_path
            if metrics_path is not None:
                from .inspector import Inspector
                self._metrics_gate = Inspector(
                    metrics_path, ui_allow=ui_allow, ui_token=ui_token,
                    ui_keep=1, ui_hosts=ui_hosts)
            self.summary_s = config.check("summary_s", opts["summary_s"])
            self._new_routes()

        try:
            configure()
        except ConfigError as e:
            raise config.name_source(e, sources) from None

    def _new_routes(self):
        """Empty per-route aggregates (and their metrics) in place of any
        before: at start, and in a forked child, whose counts are its own
        (the parent's stay the parent's to report and to export)."""
        route, max_routes = self._route_opts
        self._routes = routes.RouteAggregates(_registry.RouteCounts,
                                              max_routes, route)
        self._routes_setup(self._routes.counts)
        if self.inspector is not None:
            self.inspector.routes = self._routes
        if self._metrics_gate is not None:
            from .metrics import Metrics
            gate = self._metrics_gate
            self.metrics = Metrics(self._routes, gate.allowed)
            self._routes.counts.set_metrics(gate.path, self.metrics)
        self._summary_next = _monotonic() + (self.summary_s or 0)
        self._summary_seen = 0
        # (where no drain loop ticks: no hooks, nothing sampled, or its
        # thread gone; see _tick_soon)
        self._drained_at = -1e9   # (a drain loop's last tick)
        # weak ref to a thread's token -> (its ticker greenlet, last pass)
        self._tickers = {}
        if self.summary_s or self.metrics is not None:
            self._routes.counts.set_ticker(self._tick_soon)

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
        limit.  Returns how many were delivered.  A request whose
        response was finished in another thread ends for its observers
        first (``on_response_end``), a request without a profile too.
        With ``metrics_path``, the counts so far go to prometheus_client
        (its multiprocess files), as the drain loop does once a second.

        It also runs by itself at interpreter exit (``atexit``, for the
        thread that exits) and, under ``python -m greqprof serve``, on
        SIGTERM and SIGINT."""
        n = loops.flush_thread(timeout)
        self._sync_metrics()
        return n

    def _sync_metrics(self):
        """What the routes counted goes to prometheus_client now (its
        multiprocess files too), not at the drain loop's next pass: a
        worker that exits keeps its last second's counts."""
        if self.metrics is not None:
            try:
                self.metrics.sync()
            except Exception as e:
                self._internal_error("metrics", e)

    def write_pprof(self, path, route=None):
        """Writes the stack samples so far (``stack_hz``) to ``path`` as a
        gzipped pprof ``profile.proto``: sample types samples/count and
        cpu/nanoseconds (samples x the sampling period), a ``route`` label
        on each sample (docs/fleet.md); only ``route``'s samples when
        given (a name as :meth:`routes` shows it).  The samples are the
        process's: every thread a middleware with ``stack_hz`` serves.
        Returns the number of samples written."""
        if not self._stack_hz:
            raise ConfigError("write_pprof: stack_hz is off for this "
                              "middleware (stack_hz=%r)" % (self._stack_hz,))
        return sampler.write_pprof(path, sampler.period_ns()
                                   or sampler.period_of(self._stack_hz),
                                   route)

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
            try:
                environ["greqprof.no_route"] = True   # (nor counted)
            except Exception:
                pass
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
        _registry.own_work()   # (the WARNING is not the outer profile's)
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
            sampled_by = policy.draw(self, environ)
        if sampled_by is None and not self.observers:
            if cfg.blocking_ns or self._stack_hz:
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
        return _collect.func_stats([req.profile], skip_dir=blocking.OWN_DIR)

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
        ns = self.config.blocking_ns
        if eng is None or (ns and not 0 < eng.blocking_ns <= ns):
            # (also lowers a shared engine's threshold to this one's, or
            # sets it on an engine a middleware without blocking_ms made:
            # stack_hz notes requests without it)
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
                           environ.get("HTTP_X_REQUEST_ID"), self)
            name = _mounted_route(environ)   # (as the C path does)
            if name is not None:
                _registry.sampler_name(name)

    def _join(self, eng):
        """This thread's engine serves this middleware: registered with it,
        its drain loop running (blocking detection on), and the C path
        armed for its thread."""
        if self._engine is not eng:
            eng.middlewares.add(self)
            self._engine = eng
        if (self.config.blocking_ns or self.summary_s or self.metrics) \
                and not eng.drain_started:
            loops.start_drain_loop(self, eng)
        if not eng.reaper_started:
            loops.start_reaper(self, eng)
        # (a second middleware asking more often raises the rate)
        if self._stack_hz and (eng not in sampler.watched or
                               self._stack_hz > sampler.rate()):
            try:
                sampler.watch(eng, self._stack_hz)
            except Exception as e:   # (never the request's problem)
                self._internal_error("stack sampler", e)
        self._arm(eng.tracer.hooks_addr, eng, _engine.fork_generation())

    def _notify(self, observer, event, *args):
        _registry.own_work()
        fn = getattr(observer, event, None)
        if fn is not None:
            try:
                fn(*args)
            except Exception as e:
                self._internal_error("observer %s" % event, e)

    # (the C lifecycle calls these two)
    def _wake_finisher_soon(self, eng):
        loops.wake_finisher_soon(eng)

    def _wake_finisher_from_thread(self, eng):
        loops.wake_finisher_from_thread(eng)

    # _finalize(eng, req) is MiddlewareBase's, in C (_sampled.c's
    # mw_finalize): every profile is closed, built and delivered there.

    def _build(self, eng, req, snapshot=False):
        """The RequestProfile of req (_sampled.c's build_profile, which
        the C lifecycle calls itself); snapshot=True reads an open profile
        without consuming its stacks (for observers), and without its
        blocking events."""
        _registry.own_work()
        calls = self._calls_of(req) if self.config.calls else None
        return self._build_profile(eng.tracer.addr, req, snapshot, calls)

    def _drain_blocking(self, eng):
        """(the C lifecycle calls it) Reports this thread's queued long
        spans: blocking.drain."""
        blocking.drain(self, eng)

    def routes(self, window=None):
        """Per-route aggregates of every request since the middleware
        started, most requests first: plain dicts with ``route``,
        ``requests``, ``errors`` (5xx or an exception), ``status`` (per
        class), ``sampled``, ``wall_mean``, ``wall_max``, ``wall_p50``,
        ``wall_p95``, ``wall_p99`` (seconds; quantiles within 4.4 %),
        ``cpu``, ``waiting`` (seconds per request, estimated from the
        sampled requests; None until one was), ``cpu_total``,
        ``blocking``, ``blocked`` (docs/fleet.md).  ``window="recent"``:
        only the requests of about the last 5 minutes (5 to 6; docs/
        fleet.md says how)."""
        return self._routes.to_records(window)

    def _tick_soon(self):
        """(C calls it at the end of a request, at most once a second) When
        no drain loop ticked lately, a greenlet of the hub's (no
        request's) ticks once a second while requests run and until their
        summary is logged (loops.ticker_loop): a log handler that waits
        does not make the request wait.  A thread without gevent's loop
        (a threaded server) ticks here."""
        if _monotonic() - self._drained_at < 2.0 or \
                not loops.ticker_needed(self):
            return
        hub = _engine._hub_now()
        if hub is None or not _in_loop_of(hub):
            self._routes_tick()
            return
        try:
            loops.start_ticker(self, hub)
        except Exception as e:
            self._tickers.pop(
                weakref.ref(_lowlevel.thread_token()), None)
            self._internal_error("summary", e)

    def _routes_tick(self, now=None):
        """(the drain loop calls it once a second) Logs the routes summary
        when summary_s has passed and requests ran since the last one."""
        try:
            self._routes.tick(now)   # (the recent window's snapshots)
        except Exception as e:
            self._internal_error("routes", e)
        if self.metrics is not None:
            try:
                self.metrics.tick()
            except Exception as e:
                self._internal_error("metrics", e)
        if not self.summary_s:
            return
        try:
            self._log_summary(now)
        except Exception as e:
            self._internal_error("summary", e)

    def _log_summary(self, now):
        """The summary line, when due and requests ran since the last."""
        now = _monotonic() if now is None else now
        if now < self._summary_next:
            return
        self._summary_next = now + self.summary_s
        total = self._routes.counts.requests
        if total == self._summary_seen:
            return
        ran, self._summary_seen = total - self._summary_seen, total
        log = self.log
        logs.ensure_visible(log, self.json_logs)
        if not (log.isEnabledFor(logging.INFO) and logs.would_emit(log)):
            return
        records = self._routes.summary_records()
        log.info(routes.summary_line(records, ran, self.summary_s,
                                     self.pid, self.json_logs))

    def _route_sampled(self, route, profile):
        """(C calls it) A delivered sampled profile of ``route``: its CPU,
        waiting, wait sites and blocking added to the route, read from its
        raw data when it is still deferred (not built for this)."""
        try:
            # (the inspector lists a route's profiles by it; the C table
            # hands the same raw name each time: cleaned once, bounded)
            names = self._route_names
            name = names.get(route) if type(route) is str else None
            if name is None:
                name = routes._name(route)
                if type(route) is str:
                    if len(names) >= 4096:
                        names.clear()
                    names[route] = name
            profile.route = name
            loader = profile.__dict__.get("_loader")
            if loader is not None:
                cpu, waiting, waits = _collect.route_numbers(loader[1])
            else:
                cpu, waiting = profile.cpu, profile.waiting.seconds
                waits = [("%s (%s:%d)" % (w.fn_name, w.filename, w.lineno),
                          w.seconds) for w in profile.waits]
            blocking = profile.blocking
            self._routes.add_named_sample(
                name or routes.OTHER, cpu, waiting, len(blocking),
                sum(ev.wall for ev in blocking) if blocking else 0.0, waits)
        except Exception as e:
            self._internal_error("routes", e)

    def _deliver(self, profile):
        # (logging, rendering, sinks and files are greqprof's work, in
        # whichever greenlet: not in any profile's function table)
        _registry.own_work()
        if self.report:
            try:
                log = self.log
                logs.ensure_visible(log, self.json_logs)
                if log.isEnabledFor(logging.INFO) and logs.would_emit(log):
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
        _registry.own_work()
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
