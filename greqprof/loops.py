"""The greenlets and hooks that finish profiles outside requests: the
finisher (queued profiles, once their requests' greenlets are done), the
reaper (profiles open past max_lifetime), the drain loop (blocking spans
outside requests) and the flush of a thread's waiting profiles (on demand
and at interpreter exit).  None of these greenlets keeps the event loop
running by itself: gevent.wait() returns once the app is idle."""
import atexit
import weakref
from time import monotonic as _monotonic

from greenlet import getcurrent

from . import _lowlevel, _registry, blocking
from . import engine as _engine

#: every ProfilingMiddleware alive (the exit flush and fork look at them)
live_middlewares = weakref.WeakSet()


def wake_finisher_soon(eng):
    """The finisher of eng (its thread's) wakes at the next loop
    callbacks."""
    eng.finisher_woken = True
    import gevent
    gevent.get_hub().loop.run_callback(_wake_finisher, eng)


def wake_finisher_from_thread(eng):
    """A request of eng's thread was finished from this (another)
    thread: eng's finisher is woken in its own thread."""
    hub = eng.hub
    if hub is not None and not eng.abandoned:
        hub.loop.run_callback_threadsafe(wake_finisher_soon, eng)


def _wake_finisher(eng):
    # Runs in the hub: the finisher is spawned from here so it belongs
    # to no request.
    import gevent
    fin = eng.finisher
    if not eng.reaper_started and not eng.abandoned:
        # (the reaper was killed: started again)
        eng.reaper_started = True
        gevent.spawn(_reaper_main, weakref.ref(eng))
    if fin is None or fin.dead:
        eng.finisher = gevent.spawn(_finisher_loop, weakref.ref(eng))
    elif eng.finisher_wake is not None:  # (else: not started yet)
        eng.finisher_wake.set()


# The background greenlets below hold their engine by a weak reference
# (_live), never across a switch: once its thread ends they stay suspended
# in that thread's hub for good, and must not keep the engine (its tracer,
# its requests) alive for the life of the process.

def _live(ref):
    """The engine behind ref, or None once it is gone or abandoned."""
    eng = ref()
    return None if eng is None or eng.abandoned else eng


def drain_loop(mw_ref, ref):
    """Reports blocking spans of greenlets outside requests, once a
    second (requests drain at their end), and the routes summary line
    when it is due.  Holds its middleware weakly, as its engine: in a
    thread that ended, this greenlet is never resumed, and what it held
    (the middleware, its sink and what that keeps) stayed alive."""
    import gevent
    while _live(ref) is not None:
        # (ref=False: this timer alone does not keep the loop running;
        # gevent.wait() returns once the app is idle, and the loop goes
        # on here when it runs again)
        gevent.sleep(1.0, ref=False)
        eng = _live(ref)
        if eng is None:
            return
        # (the engine's other middlewares when the first one is gone; with
        # none, it waits for one: it lives as long as its engine, as before)
        mw = mw_ref() or next(iter(list(eng.middlewares)), None)
        if mw is not None:
            try:
                blocking.drain(mw, eng)
                for m in list(eng.middlewares) or [mw]:
                    blocking.log_summaries(m)
                    m._drained_at = _monotonic()
                    m._routes_tick()
            except Exception as e:
                mw._internal_error("drain", e)
        del eng, mw   # (not held while suspended)


#: seconds without a pass after which another thread's ticker is taken
#: for stalled (its loop blocked or stopped)
TICKER_STALE_S = 3.0


def ticker_needed(mw):
    """Whether a ticker (ticker_loop) should start in the calling thread
    for mw: none passed within TICKER_STALE_S in any thread, and none is
    stuck in this one (a log handler that hangs there would hold one more
    every time).  Forgets tickers of threads that ended (their thread
    token is gone: no frame of another thread is looked at, which kept
    its objects alive)."""
    now = _monotonic()
    me = _lowlevel.thread_token()
    tickers = mw._tickers
    for tok, (g, since) in list(tickers.items()):
        if tok() is None or (g is not None and g.dead):
            tickers.pop(tok, None)
        elif now - since < TICKER_STALE_S or tok() is me:
            return False
    return True


def start_ticker(mw, hub):
    """ticker_loop for mw in hub (the calling thread's, its loop running),
    spawned from the hub so that it belongs to no request."""
    import gevent
    key = weakref.ref(_lowlevel.thread_token())   # (this OS thread)
    mw._tickers[key] = (None, _monotonic())   # (queued: g not known yet)
    ref = weakref.ref(mw)

    def spawn():
        m = ref()
        if m is not None:
            m._tickers[key] = (gevent.spawn(ticker_loop, ref, key),
                               _monotonic())
    hub.loop.run_callback(spawn)


def ticker_loop(mw_ref, key):
    """The routes' tick (summary, metrics sync, recent window) of a
    middleware no drain loop ticks, once a second while its requests run;
    it ends a second after the last one, once their summary is logged.
    Ticks are left to a drain loop that runs meanwhile."""
    import gevent
    me = getcurrent()
    seen = None
    while True:
        mw = mw_ref()
        if mw is None:
            return
        n = mw._routes.counts.requests
        if n == seen and (not mw.summary_s or mw._summary_seen == n):
            mw._tickers.pop(key, None)
            # (a request another thread ended meanwhile found this one
            # running: it goes on)
            if mw._routes.counts.requests == n:
                return
        seen = n
        mw._tickers[key] = (me, _monotonic())
        if _monotonic() - mw._drained_at >= 0.9:
            mw._routes_tick()   # (never raises)
        del mw   # (not held while suspended)
        gevent.sleep(1.0, ref=False)


def start_reaper(mw, eng):
    eng.reaper_started = True
    try:
        import gevent
        # Spawned from the hub so it belongs to no request.
        gevent.get_hub().loop.run_callback(gevent.spawn, _reaper_main,
                                           weakref.ref(eng))
    except Exception as e:
        mw._internal_error("reaper", e)


def start_drain_loop(mw, eng):
    eng.drain_started = True
    try:
        import gevent
        # Spawned from the hub so it belongs to no request.
        gevent.get_hub().loop.run_callback(
            gevent.spawn, drain_loop, weakref.ref(mw), weakref.ref(eng))
    except Exception as e:
        mw._internal_error("drain", e)


#: while a profile waits for greenlets its request left running, the
#: finisher looks again after FINISH_POLL_S, doubling each time up to
#: FINISH_POLL_MAX_S: a request whose background greenlet runs for the
#: whole linger (1 s by default) costs ~25 wake-ups, not 200, and its
#: profile is delivered at most FINISH_POLL_MAX_S after it is done
FINISH_POLL_S = 0.005
FINISH_POLL_MAX_S = 0.05

#: seconds the finisher stays up after a batch, collecting more: profiles
#: then finish in batches, with one wake-up each instead of one per sampled
#: request (a wake-up is a loop callback, an Event and two switches)
FINISH_BATCH_S = 0.01


def _finisher_loop(ref):
    """Finishes queued profiles whose requests' greenlets are all done (or
    whose linger ran out); sleeps while nothing waits."""
    try:
        _finish_pending_forever(ref)
    finally:
        # Killed, or failed: the next request queued wakes a new one.
        eng = ref()
        if eng is not None:
            eng.finisher_woken = False


def _finish_pending_forever(ref):
    import gevent
    from gevent.event import Event
    eng = _live(ref)
    if eng is None:
        return
    wake = eng.finisher_wake = Event()
    poll = FINISH_POLL_S
    while eng is not None:
        # Up and about to look at `pending`: nobody needs to wake it.
        eng.finisher_woken = True
        # (in C: finalizes the queued requests that are done)
        waiting = _registry.finish_pending(eng, eng.pending,
                                           _lowlevel.wall_ns())
        eng.finisher_polls += 1
        eng = None   # (not held while suspended)
        if waiting == 2:
            poll = FINISH_POLL_S   # (new requests: looked at soon again)
            # Requests seen queued for the first time: the start callbacks
            # of children they spawned run before this greenlet's next
            # turn, then they are looked at again (once per round: more
            # first looks wait for the next round).
            gevent.sleep(0)
            eng = _live(ref)
            if eng is None:
                return
            waiting = _registry.finish_pending(eng, eng.pending,
                                               _lowlevel.wall_ns())
            eng.finisher_polls += 1
            eng = None
        if waiting == 1:
            # (a timer that keeps the loop running: a profile waiting for
            # its request's greenlets, at most `linger`, is delivered
            # before gevent.wait() returns; idle, the finisher waits on
            # an Event, which does not)
            gevent.sleep(poll)
            poll = min(poll * 2, FINISH_POLL_MAX_S)
            eng = _live(ref)
            continue
        poll = FINISH_POLL_S
        gevent.sleep(FINISH_BATCH_S)
        eng = _live(ref)
        if eng is None or eng.pending:
            continue
        eng.finisher_woken = False
        wake.clear()
        eng = None
        wake.wait()
        eng = _live(ref)


def _reaper_main(ref):
    """The reaper greenlet: _reaper_loop, gone on with after a
    BaseException that is not an Exception, nor an exit (a sink's
    gevent.Timeout: the request it came from is released by then).
    Killed (GreenletExit), it is started again by the next request set up
    in Python or the finisher's next wake."""
    import gevent
    try:
        while _live(ref) is not None:
            try:
                _reaper_loop(ref)
            except (gevent.GreenletExit, SystemExit, KeyboardInterrupt):
                raise
            except BaseException:
                pass
    finally:
        eng = ref()
        if eng is not None:
            eng.reaper_started = False


def _reaper_loop(ref):
    """Closes, in the engine's thread, the profiles open longer than
    their middleware's max_lifetime (checked a few times per lifetime, at
    least once a second).  Each request is truncated on its own: an error
    is logged and the next goes on; a BaseException that is not an
    Exception goes on once that request is released (the rest wait for
    the next round)."""
    import gevent
    req = None
    while True:
        eng = _live(ref)
        if eng is None:
            return
        lifetimes = [mw._max_lifetime for mw in list(eng.middlewares)]
        eng = mw = req = None   # (not held while suspended)
        # (ref=False, as the drain loop's: while a request is open,
        # something else keeps the loop running)
        gevent.sleep(min([1.0] + [t / 4 for t in lifetimes]), ref=False)
        eng = _live(ref)
        if eng is None or not eng.profile_requests:
            continue
        if eng.pending and not eng.finisher_woken:
            # (a request finished from another thread was queued here
            # without waking this thread's finisher)
            for mw in list(eng.middlewares)[:1]:
                wake_finisher_soon(eng)
        now = _lowlevel.wall_ns()
        for req in list(eng.profile_requests.values()):
            mw = req.owner
            if mw is None or req.done or req.greenlet is None or \
                    req.finalizing or \
                    now - req.start_ns < mw._max_lifetime_ns:
                continue
            try:
                _engine.truncate(mw, eng, req, now)
            except Exception as e:
                mw._internal_error("max_lifetime", e)
            # (any other BaseException: truncate's _finalize released the
            # request; _reaper_main starts the reaper again)


def flush_thread(timeout=None):
    """ProfilingMiddleware.flush() for the calling thread's engine."""
    eng = _engine.current_engine()
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
        # (an observed request without a profile, finished in another
        # thread: its observers hear of its end here)
        if (req.profile is not None or mw.observers) and \
                req.greenlet is not None and not req.finalizing:
            if not _finalize_within(mw, eng, req, left):
                break   # (out of time in a delivery: the rest is given up)
            n += req.profile is not None
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
    if not live_middlewares:
        return
    try:
        flush_thread(EXIT_FLUSH_S)
    except BaseException:   # (never fail the interpreter's exit)
        pass
    # (the drain loop copies counts to prometheus_client once a second:
    # the last second's would be lost with the process)
    for mw in list(live_middlewares):
        try:
            mw._sync_metrics()
        except BaseException:
            pass


atexit.register(_flush_at_exit)
