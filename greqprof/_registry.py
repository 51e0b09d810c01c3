"""Objects the C hooks hand to Python (see _hooks.c).

The hooks fetch these containers once and fill them; Python code reads them.
They are module globals because cffi cannot return Python objects from C.
"""

#: function key -> code object, or ("builtin", name, module, owner type name)
codes = {}
#: stack tag -> traceback-style text (bounded in C; oldest dropped)
stacks = {}
#: long-span records: (thread_ident, greenlet_id, start_ns, end_ns, cpu_ns,
#: flags, stack_tag, profile_address); bounded in C, drained by readers
long_spans = []
#: greenlet id -> (name, fn_name) for every greenlet seen (bounded in C)
names = {}
#: greenlet id -> id of the greenlet that spawned it (bounded in C)
parents = {}
#: read_profile(profile_address, tracer_address, start_ns, end_ns, top):
#: a request profile's rows in one call (a C function set by the hooks'
#: initialisation; see _hooks.c)
read_profile = None
#: attach(hooks_address, greenlet, profile_address): attaches a greenlet
#: of the hooks' thread to a profile (0: detaches) and returns its id (a C
#: function, see _hooks.c)
attach = None
#: greenlet_id(tracer_address, greenlet): the tracer's id of a greenlet, 0
#: when unseen (a C function, see _hooks.c)
greenlet_id = None
#: the C base of ProfilingMiddleware: runs the path of unsampled requests
#: (see _fastpath.c)
MiddlewareBase = None
#: the last unsampled requests of one thread, for blocking reports
#: (see _fastpath.c)
RequestNotes = None
