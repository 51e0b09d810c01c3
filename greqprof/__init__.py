"""greqprof: a request profiler for gevent WSGI servers.

Spans (one uninterrupted run of a greenlet between two switches), CPU and
wall time, greenlet-aware function statistics and blocking alerts, accounted
by the C library libgreqprof.
"""
from ._lowlevel import library_version
from .errors import (ConfigError, GreqprofError, LibraryError,
                     ProfilerStateError)
from .handle import ProfileHandle, current_profile
from .middleware import ProfilingMiddleware
from .profiler import Profiler
from .request_profile import BlockingEvent, RequestProfile
from .routes import set_route
from .stats import ChildStat, FuncStat, GreenletStat, Span, Waiting, WaitedOn

__version__ = "0.1.0"

__all__ = [
    "Profiler", "ProfilingMiddleware", "current_profile", "ProfileHandle", "RequestProfile", "BlockingEvent",
    "Waiting", "WaitedOn", "Span", "FuncStat", "ChildStat", "GreenletStat",
    "GreqprofError", "ConfigError", "ProfilerStateError", "LibraryError",
    "library_version", "__version__", "set_route",
]
