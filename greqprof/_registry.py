"""Objects the C hooks hand to Python (see _hooks.c).

The hooks fetch these containers once and fill them; Python code reads them.
They are module globals because cffi cannot return Python objects from C.
"""

#: function key -> code object, or ("builtin", name, module, owner type name)
codes = {}
#: stack tag -> traceback-style text (bounded in C; oldest dropped)
stacks = {}
#: long-span records: (thread_ident, greenlet_id, start_ns, end_ns, cpu_ns,
#: flags, stack_tag, profile_address, greenlet_address, note, chain,
#: names), note and chain being request_note() and names the greenlet's
#: (name, fn_name) at the span's end; bounded in C, drained by readers
long_spans = []
#: wait site tag -> (code, fn_name, filename, lineno, stack) of a site where
#: a sampled request's greenlet waited (bounded in C; taken out when the
#: profile is read)
wait_sites = {}
#: greenlet id -> (name, fn_name) for every greenlet seen (bounded in C)
names = {}
#: thread ident -> the id of that thread's gevent hub, once the hooks saw
#: it run (the watchdog does not take the hub's wait for blocking)
hub_ids = {}
#: [pid, period ns] of the stack sampler's loop running now (0: none):
#: the watchdog's checks move there when it ticks often enough
sampler_tick = [0, 0]
#: attach(hooks_address, greenlet, profile_address): attaches a greenlet
#: of the hooks' thread to a profile (0: detaches) and returns its id (a C
#: function, see _hooks.c)
attach = None
#: greenlet_id(tracer_address, greenlet): the tracer's id of a greenlet, 0
#: when unseen (a C function, see _hooks.c)
greenlet_id = None
#: running_since(tracer_address): (start_ns, greenlet_id) of the running
#: span, or None (a C function, see _hooks.c)
running_since = None
#: wall_ns(): libgreqprof's monotonic clock in ns (a C function)
wall_ns = None


def own_work():
    """What the caller does from here until it returns is greqprof's own
    work (logging, delivery, rendering): left out of the function tables
    of profiles.  The C function (_hooks/calls.c) replaces this no-op when
    the hooks load."""


#: the C base of ProfilingMiddleware: runs the path of unsampled requests
#: (see _fastpath.c)
MiddlewareBase = None
#: note(hooks_address, greenlet_id, method, path, request_id): notes the
#: request that greenlet begins (unsampled requests; see _fastpath.c)
note = None
#: request_note(hooks_address, greenlet): (note, chain): chain is the ids of
#: the greenlet and its live spawners (gevent's spawning_greenlet), note the
#: first (method, path, request_id, route) noted along it, or None (route:
#: the name the app gave the request so far, else None)
request_note = None
#: render_rows(fields, raw, n_spans, n_greenlets, safe, stack): the text
#: report's common part from a deferred profile's rows (a C function, see
#: _render.c; used by greqprof.report)
render_rows = None
#: greenlet_profile(tracer_address, greenlet): the address of the open
#: profile the greenlet is attached to, 0 when none (see _sampled.c)
greenlet_profile = None
#: open_profiles(hooks_address): sampled profiles open in that thread, as
#: its CPU window counts them (see _sampled.c; tests)
open_profiles = None
#: unset_profiles(tracer_address): the tracer's default and session
#: profiles set to none with the GIL held, so from any thread (see
#: _sampled.c; profiler._Session.end)
unset_profiles = None
#: gc_phase(phase, info): in gc.callbacks from import on; tells the C
#: lifecycle that the cyclic collector runs (see _sampled.c)
gc_phase = None
