"""The whole-process, greenlet-aware Profiler."""
import os
import sys
import threading
import weakref

from . import _collect, _lowlevel, _registry
from .engine import current_engine, running_profilers
from ._lowlevel import RawProfile, RawTracer, real_get_ident, thread_token
from .errors import ConfigError, ProfilerStateError

CLOCKS = ("cpu", "wall")
CPU_MODES = ("estimate", "exact")


def _check_positive(name, value, integer=False, allow_zero=False,
                    hi=None):
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError("%s must be a number, got %r" % (name, value))
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError("%s must be %s, got %r"
                          % (name, ">= 0" if allow_zero else "> 0", value))
    # (NaN fails both comparisons: refused here too)
    if hi is not None and not value <= hi:
        raise ConfigError("%s must be at most %s, got %r" % (name, hi, value))
    return value


#: documented maxima (docs/production.md): spans kept per thread, seconds
#: of the CPU window and of the stack threshold, and the C library's depth
MAX_SPANS = 10000000
MAX_CPU_WINDOW = 1.0
MAX_STACK_THRESHOLD = 3600.0
MAX_DEPTH = 1 << 24


def _after_fork_in_child():
    # The child keeps profiling the thread that forked, from a clean slate:
    # data recorded before the fork belongs to the parent, and the other
    # threads' sessions have no thread here.
    me = real_get_ident()
    for prof in list(running_profilers):
        prof._forked(me)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _Session:
    """The tracer and profile of one OS thread."""

    def __init__(self, tracer, profile, thread_name, engine=None,
                 calls=False):
        self.tracer = tracer
        self.calls = calls
        self.profile = profile
        self.thread_name = thread_name
        self.thread_ident = real_get_ident()
        # (the ident of a thread that ended is given to later threads)
        self._thread = weakref.ref(thread_token())
        #: the ProfilingMiddleware engine whose tracer this session shares
        #: (a thread has one set of hooks), or None
        self.engine = engine

    def is_this_thread(self):
        """Whether this is the calling OS thread's session."""
        return self._thread() is thread_token()

    def share(self, eng):
        """From now on this session is recorded through eng's tracer (the
        thread's ProfilingMiddleware): every greenlet outside sampled
        requests goes to this session's profile (the tracer's default), and
        the greenlets of sampled requests go to it too (the tracer's
        session profile) while their requests' profiles get what they
        would without it.  A tracer has one default and one session
        profile: a second Profiler in the thread is refused, as it is
        without a middleware."""
        if getattr(eng, "session", None) is not None:
            raise ProfilerStateError(
                "cannot start profiling: another greqprof profiler is "
                "already running in this thread")
        eng.session = self
        eng.tracer.set_default(self.profile)
        eng.tracer.set_session(self.profile)
        eng.profile_opened()
        if self.calls:
            eng.acquire_calls()
        self.tracer = eng.tracer
        self.engine = eng

    def end(self, calls):
        """Stops recording into this session, from any thread: only the
        session's own thread touches its hooks (the call hook is a
        per-thread setting), another thread asks it through its hub."""
        if self.engine is None:
            # (from another thread the hooks only go quiet, under the GIL)
            if self.tracer is not None:
                self.tracer.uninstall()
            return
        # The middleware goes on: its hooks stay, the thread's greenlets
        # outside requests go back to no profile.
        eng, self.engine = self.engine, None
        if getattr(eng, "session", None) is self:
            eng.session = None
        if eng.abandoned:
            return
        if eng.thread_ident == real_get_ident():
            self.tracer.set_session(None)
            self.tracer.set_default(None)
            if calls:
                eng.release_calls()
            eng.profile_closed()
            return
        # Another thread's engine: detached now, with the GIL held (its
        # hooks record nothing more here); its call hook is released by
        # its own thread, the next time its loop runs.
        _lowlevel._check(_registry.unset_profiles(eng.tracer.addr),
                         "unset_profiles")
        eng.profile_closed()
        if calls and eng.hub is not None:
            eng.hub.loop.run_callback_threadsafe(_release_calls, eng)


def _release_calls(eng):
    # (runs in eng's thread, from its hub)
    try:
        eng.release_calls()
    except Exception:  # the engine went away meanwhile: nothing to release
        pass


class Profiler:
    """Profiles every greenlet of the calling thread and of threads started
    after :meth:`start`, each thread with its own hub accounted separately.

    :param clock: ``"cpu"`` (a function's time counts only while its own
        greenlet runs on CPU) or ``"wall"`` (elapsed time, including the time
        its greenlet waited: the latency view).
    :param builtins: also record C functions.
    :param calls: record function statistics; ``False`` tracks spans only.
    :param cpu: ``"estimate"`` reads the thread CPU clock at most once per
        ``cpu_window`` seconds (error bounded by the window, see
        docs/accuracy.md); ``"exact"`` reads it at every switch.
    :param max_spans: spans kept per thread (the most recent ones); more are
        counted in :attr:`dropped_spans`.
    :param stack_threshold: spans at least this many seconds long get the
        stack where their greenlet switched out (``None``: never).
    """

    def __init__(self, clock="cpu", builtins=False, calls=True, *,
                 cpu="estimate", cpu_window=0.0001, max_spans=100000,
                 stack_threshold=0.05, max_depth=1024):
        if clock not in CLOCKS:
            raise ConfigError("clock must be 'cpu' or 'wall', got %r"
                              % (clock,))
        if cpu not in CPU_MODES:
            raise ConfigError("cpu must be 'estimate' or 'exact', got %r"
                              % (cpu,))
        self.clock = clock
        self.builtins = bool(builtins)
        self.calls = bool(calls)
        self.cpu = cpu
        self.cpu_window = _check_positive("cpu_window", cpu_window,
                                          allow_zero=True,
                                          hi=MAX_CPU_WINDOW)
        self.max_spans = _check_positive("max_spans", max_spans,
                                         integer=True, allow_zero=True,
                                         hi=MAX_SPANS)
        if stack_threshold is not None:
            _check_positive("stack_threshold", stack_threshold,
                            allow_zero=True, hi=MAX_STACK_THRESHOLD)
        self.stack_threshold = stack_threshold
        self.max_depth = _check_positive("max_depth", max_depth, integer=True,
                                         hi=MAX_DEPTH)
        self._sessions = []
        self._lock = threading.Lock()
        self._running = False
        self._prev_thread_profile = None
        self._starter = None

    # -- state -----------------------------------------------------------
    @property
    def running(self):
        return self._running

    def _cpu_mode(self):
        if self.clock == "wall" and not self.calls:
            return "off"  # no CPU clock is read at all
        return self.cpu

    def _join_engine(self, eng):
        """This thread serves a ProfilingMiddleware, whose hooks are in: the
        session shares its tracer.  Every greenlet of the thread is
        recorded into this session's profile: those outside sampled
        requests as its default profile, those of sampled requests as its
        session profile, while the sampled requests' own profiles go on
        unchanged.  Its calls are timed with this Profiler's clock (a
        profile's own, libgreqprof 0.4); the other tracer settings are the
        middleware's (builtins and stack_threshold do not apply); the CPU
        window is narrowed to 100 us meanwhile."""
        profile = RawProfile(max_spans=self.max_spans, keep="last",
                             clock=self.clock)
        session = _Session(None, profile, threading.current_thread().name,
                           calls=self.calls)
        session.share(eng)
        with self._lock:
            self._sessions.append(session)
        return session

    def _session_holding_hooks(self):
        """This Profiler's session with its own hooks in the calling
        thread, or None (engine.py: a ProfilingMiddleware's engine takes
        the thread's hooks over)."""
        with self._lock:
            for s in self._sessions:
                if s.is_this_thread() and s.engine is None and \
                        s.tracer is not None and self._running:
                    return s
        return None

    def _new_session(self):
        eng = current_engine()
        if eng is not None:
            return self._join_engine(eng)
        # (its own clock: a middleware's engine may take these hooks over,
        # engine._new_engine, and its tracer times calls with its clock)
        profile = RawProfile(max_spans=self.max_spans, keep="last",
                             clock=self.clock)
        session = _Session(self._install_tracer(profile), profile,
                           threading.current_thread().name, calls=self.calls)
        with self._lock:
            self._sessions.append(session)
        return session

    def _install_tracer(self, profile):
        """A tracer of this Profiler's settings recording the calling
        thread into profile, its hooks installed."""
        tracer = RawTracer(
            cpu_mode=self._cpu_mode(), call_clock=self.clock,
            long_span_ns=(int(self.stack_threshold * 1e9)
                          if self.stack_threshold is not None else 0),
            cpu_window_ns=int(self.cpu_window * 1e9),
            max_depth=self.max_depth,
            history=0)  # waiting time is a per-request notion
        tracer.set_default(profile)
        tracer.install(calls=self.calls, builtins=self.builtins,
                       inherit=False,
                       stacks=self.stack_threshold is not None)
        return tracer

    def start(self):
        """Starts profiling the calling thread and threads started later."""
        if self._running:
            raise ProfilerStateError("Profiler.start(): already started")
        self._new_session()
        self._running = True
        self._starter = real_get_ident()
        running_profilers.add(self)
        if hasattr(threading, "getprofile"):
            self._prev_thread_profile = threading.getprofile()
        threading.setprofile(self._thread_bootstrap)
        return self

    def _thread_bootstrap(self, frame, event, arg):
        # Runs once, as the first profile event of a new thread: swap the
        # Python-level hook for the C ones.
        # Put back the hook threading would have installed, then ours on
        # top of it, so ours chains to it.
        sys.setprofile(self._prev_thread_profile)
        if not self._running:
            return
        with self._lock:
            mine = [s for s in self._sessions if s.is_this_thread()]
        try:
            if mine:
                # A green thread (gevent.monkey) in an OS thread we already
                # profile: threading just replaced our call hook; put it
                # back (it still chains to the previous one).
                mine[0].tracer.reinstall_calls()
            else:
                self._new_session()
        except Exception:  # never break the thread being profiled
            pass

    def stop(self):
        """Stops profiling; the data stays readable until :meth:`clear`."""
        if not self._running:
            raise ProfilerStateError("Profiler.stop(): not started")
        if real_get_ident() != self._starter:
            raise ProfilerStateError(
                "Profiler.stop() must be called from the thread that "
                "called start()")
        self._running = False
        running_profilers.discard(self)
        threading.setprofile(self._prev_thread_profile)
        with self._lock:
            sessions = list(self._sessions)
        for s in sessions:
            try:
                s.end(self.calls)
            except Exception:  # (never raise: end every other session)
                pass

    def _forked(self, me):
        with self._lock:
            keep = [s for s in self._sessions if s.is_this_thread()]
            self._sessions = keep
        for s in keep:
            s.profile.clear()
            if s.engine is not None and self._running:
                # It recorded through the middleware's engine, whose hooks
                # the child takes out (engine._after_fork_in_child): it
                # goes on with hooks of its own (a middleware request in
                # the child shares them again, engine._new_engine).
                eng, s.engine = s.engine, None
                try:
                    eng.abandon()
                    eng.tracer.uninstall()
                    s.tracer = self._install_tracer(s.profile)
                except Exception:  # (never break the child)
                    s.tracer = None
        self._starter = me

    def clear(self):
        """Forgets everything recorded so far (also while running)."""
        with self._lock:
            sessions = list(self._sessions)
            if not self._running:
                self._sessions = []
        for s in sessions:
            s.profile.clear()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        if self._running:
            self.stop()
        return False

    # -- results ---------------------------------------------------------
    def _profiles(self):
        with self._lock:
            return [s.profile for s in self._sessions]

    def func_stats(self):
        """Function statistics (list of FuncStat, by inclusive time)."""
        return _collect.func_stats(self._profiles())

    def spans(self):
        """Spans of every greenlet, oldest first (list of Span)."""
        return _collect.spans(self._profiles())

    def greenlet_stats(self):
        """Per-greenlet totals (list of GreenletStat)."""
        return _collect.greenlet_stats(self._profiles())

    @property
    def dropped_spans(self):
        return sum(p.spans_dropped for p in self._profiles())

    @property
    def dropped_calls(self):
        return sum(p.calls_dropped for p in self._profiles())

    def print_stats(self, file=None, limit=30):
        """Prints a cProfile-like table of the top functions."""
        out = file or sys.stdout
        out.write("%8s %8s %10s %10s %10s  %s\n"
                  % ("ncalls", "prim", "tottime", "cumtime", "percall",
                     "function"))
        for f in self.func_stats()[:limit]:
            out.write("%8d %8d %10.6f %10.6f %10.6f  %s (%s:%d)\n"
                      % (f.ncall, f.nactualcall, f.tsub, f.ttot, f.tavg,
                         f.qualname, f.filename, f.lineno))
