"""Thin private layer over greqprof._core: one Python call per C call, every
error code turned into an exception by ``_check``, handles freed by ``ffi.gc``.
Nothing here runs per greenlet switch or per function call."""
import struct
import sys

from . import _registry
from ._core import ffi, lib
from .errors import LibraryError, ProfilerStateError

NS = 1e-9

# Fills greqprof._registry with the hooks' containers and C types (the
# middleware's base type among them) before anything imports them.
if lib.gqp_py_init() != 0:
    raise ImportError("greqprof._core could not initialise its CPython "
                      "hooks (is greenlet importable?)")

# A body freed while the collector runs finishes its request later, not in
# the middle of whatever code the collection interrupted (_sampled.c).
import gc as _gc   # noqa: E402
if _registry.gc_phase not in _gc.callbacks:
    _gc.callbacks.append(_registry.gc_phase)


def _original(module, name):
    """The unpatched function even under gevent.monkey (greqprof works with
    OS threads: a patched get_ident names the greenlet, not the thread)."""
    try:
        from gevent import monkey
        return monkey.get_original(module, name)
    except Exception:  # no gevent, or never patched
        mod = __import__(module)
        return getattr(mod, name)


#: the OS thread id, as libgreqprof and sys._current_frames() know it
real_get_ident = _original("_thread", "get_ident")
#: thread-local storage of OS threads (not greenlet-local under patching)
RealThreadLocal = _original("_thread", "_local")
#: a lock of OS threads (under patching, a gevent lock waited on from
#: another thread can hang it; for sections that never yield)
RealLock = _original("_thread", "allocate_lock")
#: its reentrant kind (a section a collected body's finalizer may enter
#: again from inside itself, delivering a profile)
RealRLock = _original("_thread", "RLock")


class _ThreadToken:
    """Stands for one OS thread while it lives: thread idents are reused
    once a thread has ended, this object is not.  Kept only in a real
    thread-local, so it is dropped when its thread ends (in that thread,
    as CPython clears the ending thread's state), and then runs the
    callbacks registered in on_exit."""

    __slots__ = ("on_exit", "__weakref__")

    def __init__(self):
        self.on_exit = []

    def __del__(self):
        if sys.is_finalizing():
            return   # (the interpreter's exit: atexit did what it could)
        for fn in self.on_exit:
            try:
                fn()
            except BaseException:   # (never fail a thread's end)
                pass


_thread_mark = RealThreadLocal()


def thread_token():
    """The calling OS thread's _ThreadToken."""
    tok = getattr(_thread_mark, "token", None)
    if tok is None:
        tok = _thread_mark.token = _ThreadToken()
    return tok


def _check(rc, what):
    if rc < 0:
        name = ffi.string(lib.gqp_err_name(rc)).decode()
        msg = ffi.string(lib.gqp_strerror(rc)).decode()
        raise LibraryError(rc, name, "%s failed: %s (%s)" % (what, msg, name))
    return rc


def library_version():
    """Version string of the libgreqprof compiled into greqprof._core."""
    return ffi.string(lib.gqp_version_string()).decode()


class ClockOrigin:
    """Maps the profile's wall-clock readings to the epoch."""

    __slots__ = ("epoch_origin", "wall_origin")

    def __init__(self, epoch_origin, wall_origin):
        self.epoch_origin = epoch_origin
        self.wall_origin = wall_origin

    def to_epoch(self, wall_ns):
        """Seconds since the epoch for a wall-clock reading in ns."""
        return (self.epoch_origin + (wall_ns - self.wall_origin)) * NS


# gqp_func_stat and gqp_edge_stat rows, unpacked whole (a calls=True
# profile has a row per function and per edge: reading each field through
# cffi cost ~30k instructions a sample)
_FUNC_ROW = struct.Struct("=QQQqq")
_EDGE_ROW = struct.Struct("=QQQQqq")
if (ffi.sizeof("gqp_func_stat"), ffi.sizeof("gqp_edge_stat")) != \
        (_FUNC_ROW.size, _EDGE_ROW.size):
    raise ImportError("greqprof: the library's gqp_func_stat/gqp_edge_stat "
                      "are not the rows _lowlevel reads")


class _ProfileReaders:
    """The readers of a profile, over ``self.ptr`` (cffi): shared by
    RawProfile and RequestRawProfile."""

    __slots__ = ()

    @property
    def epoch_origin(self):
        return lib.gqp_profile_epoch_origin(self.ptr)

    @property
    def wall_origin(self):
        return lib.gqp_profile_wall_origin(self.ptr)

    def to_epoch(self, wall_ns):
        """Seconds since the epoch for a wall-clock reading in ns."""
        return (self.epoch_origin + (wall_ns - self.wall_origin)) * NS

    def spans(self):
        n = lib.gqp_profile_span_count(self.ptr)
        buf = ffi.new("gqp_span[]", max(n, 1))
        got = lib.gqp_py_read_spans(self.ptr, buf, n)
        return [(s.greenlet_id, s.start_ns, s.end_ns, s.cpu_ns, s.flags, s.tag)
                for s in buf[0:got]]

    @property
    def spans_dropped(self):
        return lib.gqp_profile_spans_dropped(self.ptr)

    def longest(self, by="wall"):
        out = ffi.new("gqp_span *")
        fn = (lib.gqp_profile_longest_cpu_span if by == "cpu"
              else lib.gqp_profile_longest_span)
        if fn(self.ptr, out) < 0:
            return None
        return (out.greenlet_id, out.start_ns, out.end_ns, out.cpu_ns,
                out.flags, out.tag)

    def funcs(self):
        """[(key, ncall, nactual, ttot_ns, tsub_ns)]"""
        n = lib.gqp_profile_func_count(self.ptr)
        buf = ffi.new("gqp_func_stat[]", max(n, 1))
        got = lib.gqp_py_read_funcs(self.ptr, buf, n)
        return list(_FUNC_ROW.iter_unpack(ffi.buffer(buf,
                                                     got * _FUNC_ROW.size)))

    def edges(self):
        """[(caller_key, callee_key, ncall, nactual, ttot_ns, tsub_ns)]"""
        n = lib.gqp_profile_edge_count(self.ptr)
        buf = ffi.new("gqp_edge_stat[]", max(n, 1))
        got = lib.gqp_py_read_edges(self.ptr, buf, n)
        return list(_EDGE_ROW.iter_unpack(ffi.buffer(buf,
                                                     got * _EDGE_ROW.size)))

    def greenlets(self):
        n = lib.gqp_profile_greenlet_count(self.ptr)
        buf = ffi.new("gqp_greenlet_stat[]", max(n, 1))
        got = lib.gqp_py_read_greenlets(self.ptr, buf, n)
        out = []
        for g in buf[0:got]:
            out.append((g.greenlet_id, g.wall_ns, g.cpu_ns, g.switches,
                        g.first_ns, g.last_ns, bool(g.finished),
                        ffi.string(g.name).decode("utf-8", "replace"),
                        ffi.string(g.fn_name).decode("utf-8", "replace")))
        return out

    @property
    def calls_dropped(self):
        return lib.gqp_profile_calls_dropped(self.ptr)

    @property
    def greenlets_dropped(self):
        return lib.gqp_profile_greenlets_dropped(self.ptr)


class RawProfile(_ProfileReaders):
    """Owns one gqp_profile."""

    def __init__(self, max_spans=10000, keep="first", max_funcs=65536,
                 max_greenlets=65536, clock=None):
        out = ffi.new("gqp_profile **")
        _check(lib.gqp_profile_new(out), "gqp_profile_new")
        self.ptr = ffi.gc(out[0], lib.gqp_profile_free)
        # Only what differs from the library's defaults: one profile is
        # made per sampled request.
        if max_spans != 10000:
            self._set(lib.GQP_PROFILE_MAX_SPANS, max_spans, "max_spans")
        if keep == "last":
            self._set(lib.GQP_PROFILE_SPAN_POLICY, lib.GQP_KEEP_LAST, "keep")
        if max_funcs != 65536:
            self._set(lib.GQP_PROFILE_MAX_FUNCS, max_funcs, "max_funcs")
            self._set(lib.GQP_PROFILE_MAX_EDGES, max_funcs * 4, "max_edges")
        if max_greenlets != 65536:
            self._set(lib.GQP_PROFILE_MAX_GREENLETS, max_greenlets,
                      "max_greenlets")
        if clock is not None:   # (None: the tracer's call clock)
            self._set(lib.GQP_PROFILE_CALL_CLOCK,
                      lib.GQP_CLOCK_WALL if clock == "wall"
                      else lib.GQP_CLOCK_CPU, "clock")

    def _set(self, param, value, name):
        _check(lib.gqp_profile_set(self.ptr, param, int(value)),
               "setting %s=%r" % (name, value))

    def close(self):
        if not lib.gqp_profile_is_closed(self.ptr):
            _check(lib.gqp_profile_close(self.ptr), "gqp_profile_close")

    @property
    def closed(self):
        return bool(lib.gqp_profile_is_closed(self.ptr))

    def clear(self):
        _check(lib.gqp_profile_clear(self.ptr), "gqp_profile_clear")

    @property
    def attached(self):
        """Live greenlets whose spans go to this profile."""
        return lib.gqp_profile_attached(self.ptr)


class RequestRawProfile(_registry.ProfileRef, _ProfileReaders):
    """One request's profile: owned by C (_sampled.c's ProfileRef, which
    the C request path makes without cffi, and which has its close(),
    closed, attached and addr), read like a RawProfile.  No instance
    dict."""

    __slots__ = ()

    @classmethod
    def for_request(cls, max_spans):
        try:
            return _registry.new_profile(cls, max_spans)
        except MemoryError:  # (the only way gqp_profile_new can fail)
            _check(lib.GQP_ENOMEM, "gqp_profile_new")

    @property
    def ptr(self):
        # (self keeps the profile alive while the caller uses the pointer)
        return ffi.cast("gqp_profile *", self.addr)


class RawTracer:
    """Owns one gqp_tracer; feeds it from the calling thread's hooks."""

    def __init__(self, cpu_mode="estimate", call_clock="cpu",
                 long_span_ns=0, cpu_window_ns=100000, max_depth=1024,
                 history=4096):
        out = ffi.new("gqp_tracer **")
        _check(lib.gqp_tracer_new(out), "gqp_tracer_new")
        self.ptr = ffi.gc(out[0], lib.gqp_tracer_free)
        self.addr = int(ffi.cast("uintptr_t", self.ptr))
        mode = {"off": lib.GQP_CPU_OFF, "estimate": lib.GQP_CPU_ESTIMATE,
                "exact": lib.GQP_CPU_EXACT}[cpu_mode]
        self.set(lib.GQP_TRACER_CPU_MODE, mode, "cpu mode")
        self.set(lib.GQP_TRACER_CALL_CLOCK,
                 lib.GQP_CLOCK_WALL if call_clock == "wall"
                 else lib.GQP_CLOCK_CPU, "call clock")
        self.set(lib.GQP_TRACER_LONG_SPAN_NS, long_span_ns, "long span")
        self.set(lib.GQP_TRACER_CPU_WINDOW_NS, cpu_window_ns, "cpu window")
        self.set(lib.GQP_TRACER_MAX_DEPTH, max_depth, "max depth")
        if history != 4096:
            self.set(lib.GQP_TRACER_HISTORY, history, "history")
        self.hooks = None
        self.hooks_addr = 0
        self.thread_ident = None

    def set(self, param, value, what):
        _check(lib.gqp_tracer_set(self.ptr, param, int(value)),
               "setting tracer %s=%r" % (what, value))

    def set_default(self, profile):
        _check(lib.gqp_tracer_set_default(
            self.ptr, profile.ptr if profile is not None else ffi.NULL),
            "gqp_tracer_set_default")

    def set_session(self, profile):
        """profile (None: none) also receives the spans and calls of the
        greenlets attached to other profiles: a whole-thread view."""
        _check(lib.gqp_tracer_set_session(
            self.ptr, profile.ptr if profile is not None else ffi.NULL),
            "gqp_tracer_set_session")

    def install(self, calls, builtins, inherit, stacks, calls_later=False):
        """Installs the C hooks in the calling thread.  With calls_later
        the call hook waits for set_calls(True)."""
        flags = ((lib.GQP_PY_CALLS if calls else 0)
                 | (lib.GQP_PY_CALLS_LATER if calls_later else 0)
                 | (lib.GQP_PY_BUILTINS if builtins else 0)
                 | (lib.GQP_PY_INHERIT if inherit else 0)
                 | (lib.GQP_PY_STACKS if stacks else 0))
        err = ffi.new("int *")
        st = lib.gqp_py_thread_start(self.ptr, flags, err)
        if st == ffi.NULL:
            reason = {
                -1: "greenlet or greqprof._registry could not be imported",
                -2: "another greqprof profiler is already running in this "
                    "thread",
                -3: "out of memory",
                -4: "greenlet.settrace() failed",
            }.get(err[0], "error %d" % err[0])
            raise ProfilerStateError("cannot start profiling: " + reason)
        self.hooks = st
        self.hooks_addr = int(ffi.cast("uintptr_t", st))
        self.thread_ident = real_get_ident()

    def set_calls(self, on):
        """Turns the call hook on/off; only from the installing thread."""
        _check(lib.gqp_py_calls(self.hooks, 1 if on else 0), "set_calls")

    def reinstall_calls(self):
        """Puts the call hook back after something replaced it in this
        thread (only from the installing thread)."""
        _check(lib.gqp_py_reinstall_calls(self.hooks), "reinstall_calls")

    def uninstall(self):
        if self.hooks is None:
            return
        self.hooks_addr = 0
        lib.gqp_py_thread_stop(self.hooks)
        lib.gqp_py_thread_free(self.hooks)
        self.hooks = None

    def attach_id(self, greenlet, profile_addr):
        """Routes `greenlet`'s spans and calls to the profile at
        ``profile_addr`` (RawProfile.addr; 0: detach), in one call without
        cffi.  Returns the greenlet's id.  Must be called from the thread
        this tracer is installed in."""
        return _check(_registry.attach(self.hooks_addr, greenlet,
                                       profile_addr), "attach")

    def set_spawn_profile(self, greenlet, profile):
        """Greenlets spawned by `greenlet` inherit `profile` (a
        RequestRawProfile, or None) from now on."""
        _check(_registry.set_spawn_profile(
            self.addr, greenlet, profile.addr if profile is not None else 0),
            "set_spawn_profile")

    def greenlet_id(self, greenlet):
        out = ffi.new("uint64_t *")
        if lib.gqp_tracer_greenlet_id(self.ptr, id(greenlet), out) < 0:
            return None
        return out[0]

    def running_since(self):
        """(start_ns, greenlet id) of the running span, or None; safe
        from any thread (and keeps the GIL)."""
        return _registry.running_since(self.addr)


#: libgreqprof's wall clock (monotonic ns): a C function of the CPython API,
#: which unlike a cffi call keeps the GIL (see _hooks.c)
wall_ns = _registry.wall_ns


def capture_thread_stack(thread_ident):
    """Stack text of what the thread is running now, or None."""
    tag = lib.gqp_py_capture_thread(thread_ident)
    return _registry.stacks.pop(tag, None) if tag else None


def drain_long_spans(thread_ident):
    """The long-span records the hooks queued for one thread, taken out of
    the queue.  Only that thread's: another thread's drain may run while
    this one's logging handler waits (with the GIL released), and each
    thread removes only its own records, so none is taken twice or held
    away from its thread."""
    queue = _registry.long_spans
    recs = [r for r in list(queue) if r[0] == thread_ident]
    for r in recs:
        queue.remove(r)   # (the same object: list.remove tries `is` first)
    return recs


def requeue_long_spans(recs):
    """Puts records back at the front of the queue (not handled yet)."""
    _registry.long_spans[0:0] = recs


_module_by_file = {}


def module_of(filename):
    """Module name for a source file, from sys.modules (cached)."""
    mod = _module_by_file.get(filename)
    if mod is None:
        for name, m in list(sys.modules.items()):
            f = getattr(m, "__file__", None)
            if f:
                _module_by_file.setdefault(f, name)
        mod = _module_by_file.get(filename)
        if mod is None:
            base = filename.rsplit("/", 1)[-1]
            mod = base[:-3] if base.endswith(".py") else base
            _module_by_file[filename] = mod
    return mod


def func_info(key):
    """(name, qualname, module, filename, lineno) of a function key."""
    obj = _registry.codes.get(key)
    if obj is None:
        return ("<unknown>", "<unknown>", "", "", 0)
    if isinstance(obj, tuple):
        _, name, module, owner = obj
        qual = "%s.%s" % (owner, name) if owner else name
        return (name, qual, module or (owner and "builtins") or "", "~", 0)
    qual = getattr(obj, "co_qualname", obj.co_name)
    return (obj.co_name, qual, module_of(obj.co_filename), obj.co_filename,
            obj.co_firstlineno)


def inject_alloc_failures(after=0, count=1):
    """Tests only: after `after` successful allocations, the next `count`
    allocations inside libgreqprof fail (count=0 turns this off)."""
    _check(lib.gqp_py_inject_alloc_failures(after, count),
           "inject_alloc_failures")


def alloc_failures_left():
    return lib.gqp_py_alloc_failures_left()
