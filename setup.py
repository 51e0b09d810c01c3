# The cffi extension is declared here because setuptools reads
# ``cffi_modules`` only from setup(); everything else is in pyproject.toml.
from setuptools import setup

setup(cffi_modules=["greqprof/_ffi_build.py:ffi"])
