"""calls=True: the registry of functions named for call tables stays
bounded when the app makes code at run time (exec, eval, namedtuple): the
oldest quarter goes past 20,000 functions.  (Found in review: every code
object ever profiled was kept alive.)"""
import pytest

from greqprof import _registry
from test_middleware import ok
from test_middleware import serve  # noqa: F401

pytestmark = pytest.mark.timeout(120)

CAP = 20000   # _hooks.c GQP_PY_MAX_CODES


def test_the_codes_registry_is_bounded(serve):
    def app(environ, start_response):
        for _ in range(150):
            eval("lambda: 1")()   # a fresh code object each time
        return ok()(environ, start_response)

    s = serve(app, pct=1.0, calls=True, report=False, blocking_ms=None)
    assert s.get("/warm").status == 200
    peak = 0
    for i in range(170):          # ~25,500 fresh functions
        assert s.get("/r%d" % i).status == 200
        peak = max(peak, len(_registry.codes))
    assert CAP * 3 // 4 <= peak <= CAP
    # and the newest profiles still name their functions
    p = s.profile_for("/r169")
    assert any(f.name == "<lambda>" for f in p.calls)
