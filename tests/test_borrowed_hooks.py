"""Borrowed references in the hooks (_hooks.c) across code that runs
Python (issue 15, item 1).

The greenlet hook reads a new greenlet's names from the app's objects:
its instance dict, its run callable's attributes.  That is Python code of
the app's, which can free what the hook is working on: the dict being
searched, the hook's own state (by stopping the profiler), the profile the
names go to and the tracer (by dropping the profiler).  Each case runs in
a child interpreter whose freed memory is overwritten (PYTHONMALLOC=debug
for Python's allocator, MALLOC_PERTURB_ for glibc's), so a read of freed
memory crashes it instead of passing unnoticed; under `make pytest-asan`
the child inherits AddressSanitizer, which reports it."""
import os
import subprocess
import sys
import textwrap

import pytest

import greqprof

pytestmark = pytest.mark.timeout(120)

#: the directory greqprof is imported from (the in-place or the ASan build)
PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(
    greqprof.__file__)))


def run_child(code, tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [PKG_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                      if p])
    env["PYTHONMALLOC"] = "debug"
    env["MALLOC_PERTURB_"] = "165"
    env["PYTHONFAULTHANDLER"] = "1"
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(code))
    proc = subprocess.run([sys.executable, str(script)], cwd=str(tmp_path),
                          env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, timeout=100)
    out = proc.stdout.decode(errors="replace")
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode == 0, (proc.returncode, out, err[-4000:])
    return out


def test_a_dict_replaced_while_a_greenlets_name_is_looked_up(tmp_path):
    """The lookup of "name" in a greenlet's __dict__ meets a key with the
    same hash, whose __eq__ replaces the greenlet's __dict__: the dict
    being searched must stay alive until the lookup is over."""
    out = run_child("""
        import greenlet, greqprof

        class Evil:
            def __init__(self, g):
                self.g = g
            def __hash__(self):
                return hash("name")
            def __eq__(self, other):
                g, self.g = self.g, None
                if g is not None:
                    g.__dict__ = {"name": "replaced"}  # frees the old one
                return False

        class D(dict):
            pass

        class G(greenlet.greenlet):
            pass

        def run():
            return 1

        with greqprof.Profiler() as prof:
            for i in range(20):
                g = G(run)
                d = D(("k%d" % j, j) for j in range(40))
                d[Evil(g)] = 1
                g.__dict__ = d
                del d
                assert g.switch() == 1
                assert g.__dict__ == {"name": "replaced"}
        names = {s.name for s in prof.greenlet_stats()}
        print("ok", sorted(names))
    """, tmp_path)
    assert out.startswith("ok"), out
    # the dict searched had no "name": the greenlets go by their class
    assert "'G'" in out, out


NAMED_RUN = """
    import gc, gevent, greenlet, greqprof

    class Run:
        # greqprof names a gevent Greenlet after its run callable: the
        # lookup of __qualname__ comes here (instances have none)
        def __call__(self):
            return 7
        def __getattr__(self, name):
            if name == "__qualname__":
                on_name()
                return "Run.named"
            raise AttributeError(name)
"""


def test_the_profiler_stopped_while_the_hook_names_a_greenlet(tmp_path):
    """The run callable's __getattr__ stops the profiler: the hook's state
    is freed by the stop, while the hook is still using it."""
    out = run_child(NAMED_RUN + """
    prof = greqprof.Profiler()

    def on_name():
        if prof.running:
            prof.stop()

    prof.start()
    for i in range(3):
        assert gevent.spawn(Run()).get() == 7
    assert not prof.running
    print("ok", len(prof.greenlet_stats()))
    # the hooks are gone: profiling again works
    with greqprof.Profiler() as again:
        assert greenlet.greenlet(lambda: 3).switch() == 3
    print("again", len(again.greenlet_stats()))
    """, tmp_path)
    assert "ok" in out and "again" in out, out


def test_a_gc_callback_drops_the_profiler_during_naming(tmp_path):
    """A garbage collection runs while the hook names a greenlet, and a
    gc callback stops the profiler and drops it: the hook's state, the
    tracer and the profile it is naming the greenlet in are all let go
    of while the hook still holds their addresses."""
    out = run_child(NAMED_RUN + """
    holder = [greqprof.Profiler()]

    def on_gc(phase, info):
        if phase == "start" and holder:
            prof = holder.pop()
            if prof.running:
                prof.stop()
            prof.clear()

    def on_name():
        gc.callbacks.append(on_gc)
        try:
            gc.collect()
        finally:
            gc.callbacks.remove(on_gc)

    holder[0].start()
    assert gevent.spawn(Run()).get() == 7
    assert not holder
    gc.collect()
    with greqprof.Profiler() as again:
        assert greenlet.greenlet(lambda: 3).switch() == 3
    print("ok", len(again.greenlet_stats()))
    """, tmp_path)
    assert out.startswith("ok"), out
