"""Per-thread tracing engine behind ProfilingMiddleware.

Each OS thread that serves requests gets one tracer with the C hooks
installed (lazily, on its first request).  Greenlets that are not part of a
sampled request are attached to no profile: the hooks then only time their
spans, which is what blocking detection needs.

A watchdog OS thread (optional) looks at every engine's running span a few
times per blocking threshold and, when one has held the loop too long,
captures the stack that is running at that moment (like gevent's monitor
thread), because the stack at switch-out time can be far from the code that
blocked."""
import os
import threading
import weakref

from . import _lowlevel, _registry
from ._lowlevel import RawTracer, RealThreadLocal, real_get_ident

_engines = {}          # thread ident -> Engine
_engines_lock = threading.Lock()
_local = RealThreadLocal()
_fork_generation = [0]

#: running Profilers (profiler.py keeps it): one whose session holds a
#: thread's hooks gives way to a new engine there (_new_engine)
running_profilers = weakref.WeakSet()


def _after_fork_in_child():
    # The child starts clean: the engines (and the open profiles they
    # reference) belong to the parent's threads.  Hooks installed in the
    # forking thread stay in place but go quiet until a new engine takes
    # over (gqp_py_thread_start replaces a quiet state).
    me = real_get_ident()
    for eng in list(_engines.values()):
        eng.abandon()
        if eng.thread_ident == me:
            # The forking thread lives on in the child: take its hooks out
            # so a fresh engine can install its own.
            try:
                eng.tracer.uninstall()
            except Exception:
                pass
    _engines.clear()
    _registry.hub_ids.clear()
    global _engines_lock
    _engines_lock = threading.Lock()   # (maybe held by a thread now gone)
    _local.__dict__.clear()
    _fork_generation[0] += 1
    Watchdog.instance = None
    Watchdog._place_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


#: CPU clock window (ns) while a sampled profile is open in a thread: each
#: span's CPU time is within it (docs/accuracy.md) ...
CPU_WINDOW_PROFILING = 100000
#: ... and while none is: only blocking spans (>= blocking_ms) need CPU
#: time then, and reading the clock (a system call) every 100 us would cost
#: a few per request
CPU_WINDOW_IDLE = 10000000
# (the hooks count open profiles per thread: the C request path opens them
# too, _sampled.c)
_registry.cpu_windows(CPU_WINDOW_PROFILING, CPU_WINDOW_IDLE)


class Engine:
    """The tracer of one thread plus the bookkeeping of its open requests."""

    def __init__(self, config):
        self.config = config
        self.tracer = RawTracer(
            cpu_mode=config.cpu_mode, call_clock=config.clock,
            long_span_ns=config.blocking_ns, cpu_window_ns=CPU_WINDOW_IDLE)
        # Greenlets in no sampled request keep the idle window while one
        # is open: its neighbours' switches make no clock system calls.
        self.tracer.set(_lowlevel.lib.GQP_TRACER_CPU_WINDOW_OTHERS_NS,
                        CPU_WINDOW_IDLE, "cpu window of others")
        self.tracer.set_default(None)
        # The call hook is only on while a sampled request wants calls
        # (acquire_calls/release_calls): unsampled requests pay nothing
        # per call.
        self.tracer.install(calls=True, builtins=False, inherit=True,
                            stacks=True, calls_later=True)
        self.blocking_ns = config.blocking_ns
        self.hub_gid = None
        # the middlewares served by this thread (they share the engine)
        self.middlewares = weakref.WeakSet()
        self.calls_users = 0
        self.thread_ident = real_get_ident()
        self.pid = os.getpid()
        # greenlet id -> (method, path, request_id) of open requests
        self.requests = {}
        # profile address -> (method, path, request_id) of sampled requests
        self.profile_requests = {}
        self.drain_started = False
        # the greenlet closing profiles open longer than max_lifetime
        self.reaper_started = False
        # greenlet id -> request whose profile waits for its children
        self.lingering = {}
        # sampled requests waiting for their greenlets, and the greenlet
        # that finishes them (loops._finisher_loop)
        self.pending = []
        self.finisher = None
        self.finisher_wake = None
        self.finisher_woken = False
        self.finisher_polls = 0   # (passes over `pending`: tests count)
        # (greenlet id, span start ns) -> stack seen by the watchdog
        self.sampled_stacks = {}
        self.generation = _fork_generation[0]
        self.abandoned = False
        # the Profiler session recorded through this tracer (its default
        # profile), or None (profiler._Session.share)
        self.session = None
        # the thread's hub: a request finished from another thread wakes
        # this thread's finisher through its loop
        try:
            import gevent
            self.hub = gevent.get_hub()
        except Exception:
            self.hub = None

    def profile_opened(self):
        # The first open profile narrows the CPU window: the next event
        # re-reads the clock (the last reading is older than the new
        # window), so this profile's first span is exact.
        _registry.profile_window(self.tracer.hooks_addr, 1)

    def profile_closed(self):
        if not self.abandoned:
            _registry.profile_window(self.tracer.hooks_addr, -1)

    def acquire_calls(self):
        self.calls_users += 1
        if self.calls_users == 1:
            self.tracer.set_calls(True)

    def release_calls(self):
        if self.calls_users > 0:
            self.calls_users -= 1
            if self.calls_users == 0 and not self.abandoned:
                self.tracer.set_calls(False)

    def abandon(self):
        self.abandoned = True

    def stop(self):
        self.tracer.uninstall()


def engine_for_thread(config):
    """The calling thread's engine, created on first use.  Several
    middlewares in one thread share it; the blocking threshold is the
    smallest they asked for (each filters its own reports)."""
    eng = getattr(_local, "engine", None)
    if eng is not None and not eng.abandoned:
        if config.blocking_ns and (not eng.blocking_ns
                                   or config.blocking_ns < eng.blocking_ns):
            eng.blocking_ns = config.blocking_ns
            eng.tracer.set(_lowlevel.lib.GQP_TRACER_LONG_SPAN_NS,
                           config.blocking_ns, "long span")
            if config.watchdog:   # (a first one without blocking_ms)
                Watchdog.ensure(config.blocking_ns)
        return eng
    eng = _new_engine(config)
    _local.engine = eng
    with _engines_lock:
        _engines[eng.thread_ident] = eng
    _watch_thread_end(eng)
    if config.watchdog and config.blocking_ns:
        Watchdog.ensure(config.blocking_ns)
    return eng


def _new_engine(config):
    """A new engine for the calling thread.  A Profiler running in the
    thread (a thread has one set of hooks) gives way: its session goes on
    through the engine's tracer (profiler._Session.share)."""
    from .errors import ProfilerStateError
    try:
        return Engine(config)
    except ProfilerStateError:
        session = _profiler_session()
        if session is None:
            raise
        session.tracer.uninstall()
        eng = Engine(config)
        session.share(eng)
        return eng


def _profiler_session():
    """The session of a running Profiler that holds the calling thread's
    hooks (Profiler._session_holding_hooks), or None."""
    for prof in list(running_profilers):
        session = prof._session_holding_hooks()
        if session is not None:
            return session
    return None


def _watch_thread_end(eng):
    """eng's requests are finished when its thread ends: nothing else
    would ever deliver them or give their max_open slots back."""
    tok = _lowlevel.thread_token()
    # (engines shut down in this thread are let go of)
    tok.on_exit[:] = [fn for fn in tok.on_exit if fn.live()]
    tok.on_exit.append(_EndOfThread(eng))


class _EndOfThread:
    """thread_ended(engine), called as the engine's thread ends.  It holds
    the engine until then (nothing else does for sure: the thread-local
    that names it may be cleared first, and greqprof's background
    greenlets hold it weakly, loops.py), and lets go of it after."""

    __slots__ = ("eng",)

    def __init__(self, eng):
        self.eng = eng

    def live(self):
        return self.eng is not None and not self.eng.abandoned

    def __call__(self):
        eng, self.eng = self.eng, None
        if eng is not None:
            thread_ended(eng)


def truncate(mw, eng, req, now):
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
        mw._finalize(eng, req)


def _drain_last(eng):
    """The blocking spans of eng's thread its drain loop (once a second)
    has not reported yet: reported now, as the thread serves no more, or
    never (and left queued under an ident a later thread may be given,
    which would report them as its own)."""
    from . import blocking
    for mw in list(eng.middlewares)[:1]:
        _quietly(blocking.drain, mw, eng)


def thread_ended(eng):
    """eng's thread is ending (called in it, as CPython drops its
    thread-locals; its hub may be gone already): its queued requests are
    delivered as they are, its open ones truncated (their responses will
    never end), every slot given back, and the engine dropped with its
    hooks."""
    if eng.abandoned or eng.pid != os.getpid() or \
            eng.thread_ident != real_get_ident():
        return   # (a forked child drops the parent's threads: not ours)
    now = _lowlevel.wall_ns()
    hub_before = _hub_now()
    try:
        # What waits from now on (a sink that switches) waits in a hub
        # gevent makes anew, which the hooks do not know for the hub: no
        # blocking spans are taken from a thread that serves no more.
        eng.tracer.set(_lowlevel.lib.GQP_TRACER_LONG_SPAN_NS, 0, "long span")
    except Exception:
        pass
    _drain_last(eng)
    try:
        # The finisher's pass (C), as if every linger were over: it also
        # tells observers of requests finished from other threads.
        for _ in range(3):   # (a BaseException stops a pass)
            if eng.pending:
                _quietly(_registry.finish_pending, eng, eng.pending,
                         _NO_LINGER_NS)
        for req in list(eng.profile_requests.values()) + \
                list(eng.requests.values()):
            mw = req.owner
            if mw is None or req.finalizing or req.greenlet is None:
                continue
            if not req.done:
                # (its response ends now, as far as anyone will know)
                if mw.observers:
                    req.end_ns = now
                    _quietly(mw._observe_end, req)
                if req.profile is not None:
                    _quietly(truncate, mw, eng, req, now)
                    continue
            _quietly(mw._finalize, eng, req)
    finally:
        # Whatever is left (an error above) is released undelivered.
        eng.abandon()
        for req in list(eng.profile_requests.values()) + \
                list(eng.requests.values()):
            if req.owner is not None:
                _quietly(req.owner._finalize, eng, req)
        del eng.pending[:]
        eng.lingering.clear()
        for mw in list(eng.middlewares):
            if mw._engine is eng:
                mw._engine = None
            try:
                # (armed for this thread, it would hold the engine: no
                # lingering left, so the check does not switch)
                if mw._is_armed():
                    mw._disarm()
            except Exception:
                pass
        with _engines_lock:
            if _engines.get(eng.thread_ident) is eng:
                del _engines[eng.thread_ident]
                _registry.hub_ids.pop(eng.thread_ident, None)
        try:
            eng.stop()
        except Exception:
            pass
        _drop_hub_made_since(hub_before, eng)


def _hub_now():
    try:
        from gevent._hub_local import get_hub_if_exists
        return get_hub_if_exists()
    except Exception:
        return None


def _drop_hub_made_since(before, eng):
    """A sink or observer that switched as the thread ended made gevent a
    new hub here (the thread's own was gone or destroyed by then): it is
    destroyed with its loop, or its file descriptors stayed open for
    good."""
    hub = _hub_now()
    if hub is None or hub is before or hub is eng.hub:
        return
    try:
        hub.destroy(destroy_loop=True)
    except Exception:
        pass


#: a finish_pending time past every request's linger
_NO_LINGER_NS = 1 << 62


def _quietly(fn, *args):
    # (each request on its own: a sink's error is the middleware's to
    # log, and a BaseException must not stop the others)
    try:
        fn(*args)
    except BaseException:
        pass


def fork_generation():
    """Bumped in a child after every fork."""
    return _fork_generation[0]


def current_engine():
    """The calling thread's engine, or None."""
    eng = getattr(_local, "engine", None)
    return None if eng is None or eng.abandoned else eng


def shutdown():
    """Removes the hooks from the calling thread (tests, reconfiguration)."""
    eng = getattr(_local, "engine", None)
    if eng is not None:
        if not eng.abandoned:
            _drain_last(eng)
        eng.abandon()
        eng.stop()
        _local.engine = None
        with _engines_lock:
            _engines.pop(eng.thread_ident, None)
            # (the next engine's tracer gives the hub another id)
            _registry.hub_ids.pop(eng.thread_ident, None)


def _real_thread_functions():
    try:
        from gevent import monkey
        start = monkey.get_original("_thread", "start_new_thread")
        sleep = monkey.get_original("time", "sleep")
    except Exception:  # gevent missing or not patched: the real ones
        import _thread
        import time
        start, sleep = _thread.start_new_thread, time.sleep
    return start, sleep


def _sampler_hosts(check, period_ns):
    """Has the stack sampler's loop run check() at most every period_ns,
    on its ticks, when it ticks at least that often (True); else runs no
    check there (False)."""
    host = getattr(_registry, "sampler_host", None)   # (sampler.py's C)
    pid, tick = _registry.sampler_tick
    if host is None:
        return False
    if check is not None and tick and pid == os.getpid() and \
            tick <= period_ns:
        host(check, period_ns)
        return True
    host(None, 0)
    return False


class Watchdog:
    """Samples the stack of a greenlet holding the loop too long, from an
    OS thread (never a greenlet, even under monkey-patching): the stack
    sampler's when it ticks at least as often as the watchdog looks (one
    thread taking the GIL instead of two), else one of its own."""

    instance = None
    MAX_STACKS = 256
    _place_lock = threading.Lock()

    def __init__(self, blocking_ns):
        self.period = max(blocking_ns / 3.0, 5e6) * 1e-9
        self.blocking_ns = blocking_ns
        self.running = True
        self.hosted = False   # its checks run in the sampler's thread
        self.thread_gen = 0   # its own thread runs while this is its gen

    @classmethod
    def ensure(cls, blocking_ns):
        with _engines_lock:
            old = cls.instance
            # (one for the process; a middleware with a lower threshold
            # than the first one's gets a new one that looks more often at
            # once, or its blocking spans end before their stack is taken;
            # the old one's thread ends at its next wake-up)
            if old is not None and blocking_ns >= old.blocking_ns:
                return
            cls.instance = cls(blocking_ns)
        cls.replace()

    @classmethod
    def replace(cls):
        """Puts the watchdog's checks where they belong now: into the
        sampler's thread when that ticks often enough, else into a thread
        of its own (started, or kept)."""
        with cls._place_lock:
            wd = cls.instance
            if wd is None:
                _sampler_hosts(None, 0)
                return
            if _sampler_hosts(wd._hosted_check, int(wd.period * 1e9)):
                if not wd.hosted:
                    wd.hosted = True
                    wd.thread_gen += 1   # (its thread ends)
                return
            if wd.hosted or not wd.thread_gen:
                wd.hosted = False
                wd.thread_gen += 1
                start, _ = _real_thread_functions()
                try:
                    start(wd._run, (wd.thread_gen,))
                except BaseException:
                    wd.thread_gen = 0   # (the next replace tries again)
                    raise

    def _hosted_check(self):
        if Watchdog.instance is self and self.hosted:
            self.check()

    def _run(self, gen):
        _, sleep = _real_thread_functions()
        while self.running and Watchdog.instance is self and \
                self.thread_gen == gen:
            sleep(self.period)
            if self.thread_gen != gen:
                break
            try:
                self.check()
            except Exception:
                pass

    def check(self):
        now = _lowlevel.wall_ns()
        for eng in list(_engines.values()):
            run = eng.tracer.running_since()
            if run is None:
                continue
            start, gid = run
            # (read every time: a new engine in the thread numbers its hub
            # anew, and caching the first value read kept a stale id)
            eng.hub_gid = _registry.hub_ids.get(eng.thread_ident)
            if gid == eng.hub_gid:
                continue  # the hub waiting for I/O is not blocking
            key = (gid, start)
            if now - start < (eng.blocking_ns or self.blocking_ns) or \
                    key in eng.sampled_stacks:
                continue
            stack = _lowlevel.capture_thread_stack(eng.thread_ident)
            # (the capture released the GIL: if the span ended meanwhile,
            # the stack may be of what ran next)
            if stack is None or eng.tracer.running_since() != run:
                continue
            if len(eng.sampled_stacks) >= self.MAX_STACKS:
                for old in list(eng.sampled_stacks)[:1]:
                    eng.sampled_stacks.pop(old, None)
            eng.sampled_stacks[key] = stack
