/* _hooks.c -- the CPython side of the binding, compiled into greqprof._core.
 *
 * Two hooks feed a thread's gqp_tracer without running Python code:
 *   - a C-implemented callable given to greenlet.settrace (one per switch);
 *   - a Py_tracefunc installed with PyEval_SetProfile (one per call/return).
 * Both chain to whatever was installed before them.
 *
 * Python objects cross the cffi boundary as addresses (id(obj)): the caller
 * keeps the object alive for the duration of the call.  Objects going the
 * other way are put into the dicts of greqprof._registry, which the hooks
 * fetch once at gqp_py_init().
 *
 * cffi releases the GIL around every call from Python, so each function
 * here that touches Python objects takes it back with PyGILState_Ensure.
 *
 * The code is in greqprof/_hooks/, by concern, #included below in this
 * order (a part uses what the parts before it define; hooks.h declares
 * the rest):
 *   hooks.h    the thread state, hookref, registry objects, limits
 *   state.c    the state's lifetime (st_enter/st_leave), small helpers
 *   names.c    greenlet names, qualified names
 *   stacks.c   stack text, long spans, a thread's stack for watchdogs
 *   codes.c    code/line caches, register_code
 *   waits.c    wait sites, read_waits
 *   trace.c    the greenlet switch hook
 *   calls.c    the call hook
 *   install.c  gqp_py_init, thread start/stop, the call hook on/off
 *   entries.c  attach, greenlet_id, running_since, wall_ns, profile_new
 *   reader.c   bulk readers, read_profile
 *   faults.c   allocation failure injection (tests)
 *   sampler.c  the stack sampler (stack_hz) */
#include "_hooks/hooks.h"
#include "_hooks/state.c"
#include "_hooks/names.c"
#include "_hooks/stacks.c"
#include "_hooks/codes.c"
#include "_hooks/waits.c"
#include "_hooks/trace.c"
#include "_hooks/calls.c"
#include "_hooks/install.c"
#include "_hooks/entries.c"
#include "_hooks/reader.c"
#include "_hooks/faults.c"
#include "_hooks/sampler.c"
