# The cffi extension is declared here because setuptools reads
# ``cffi_modules`` only from setup(); everything else is in pyproject.toml.
from setuptools import setup
from setuptools.command.build_ext import build_ext


def _is_rpath(arg):
    return arg.startswith(("-Wl,-rpath", "-Wl,-R"))


class BuildExt(build_ext):
    """Links without the interpreter's own run-time search path.

    A CPython built with --enable-shared (pyenv's, for one) puts
    ``-Wl,-rpath,<prefix>/lib`` in LDSHARED, so every extension it builds
    carries a RUNPATH into the build machine.  _core needs no libpython and
    no other library of that directory; a wheel must not point there.
    """

    def build_extensions(self):
        for attr in ("linker_so", "linker_so_cxx"):
            cmd = getattr(self.compiler, attr, None)
            if cmd:
                setattr(self.compiler, attr,
                        [a for a in cmd if not _is_rpath(a)])
        super().build_extensions()


setup(cffi_modules=["greqprof/_ffi_build.py:ffi"],
      cmdclass={"build_ext": BuildExt})
