# greqprof -- one entry point for building and testing.
#   make test     system tools (installed with apt when run as root), the C
#                 library + C tests (plain, ASan+UBSan, valgrind, TSan, fuzz
#                 replay), the extension under ASan (pytest-asan), then a
#                 manylinux wheel per supported Python (3.10-3.13) installed
#                 in a clean venv with the suite run against it (test-wheels)
#   make pytest   the Python suite against the editable install in .venv
#   make sdist / make wheel      dist/: the sdist, one wheel per Python
#   make sdist-test / floors / debian12   see docs/packaging.md
#   make demo     run the example app with the middleware against real requests
#   make bench    overhead benchmarks (see bench/README.md)
CC      ?= gcc
CLANG   ?= clang
PYTHON  ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
B       := build/c

VERSION_MAJOR := $(shell sed -n 's/^\#define GQP_VERSION_MAJOR \([0-9]*\)/\1/p' libgreqprof/include/greqprof.h)
VERSION_MINOR := $(shell sed -n 's/^\#define GQP_VERSION_MINOR \([0-9]*\)/\1/p' libgreqprof/include/greqprof.h)
VERSION_PATCH := $(shell sed -n 's/^\#define GQP_VERSION_PATCH \([0-9]*\)/\1/p' libgreqprof/include/greqprof.h)
VERSION := $(VERSION_MAJOR).$(VERSION_MINOR).$(VERSION_PATCH)
SONAME  := libgreqprof.so.$(VERSION_MAJOR)

LIB_SRCS := $(wildcard libgreqprof/*.c)
LIB_HDRS := libgreqprof/include/greqprof.h libgreqprof/internal.h
CTEST_SRCS := $(filter-out libgreqprof/tests/fuzz_%.c,$(wildcard libgreqprof/tests/*.c))
FUZZ_SRC := libgreqprof/tests/fuzz_api.c
CFLAGS_COMMON := -std=c11 -Wall -Wextra -Wpedantic -Wshadow -Ilibgreqprof/include -Ilibgreqprof
CFLAGS  ?= -O2 -g
SAN     := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer

.PHONY: tsan all lib ctest ctest-asan valgrind fuzz fuzz-long fuzz-py venv pytest pytest-asan test demo bench clean \
  system-deps sdist wheel test-wheels sdist-test floors debian12 ci-packaging

all: lib

lib: $(B)/libgreqprof.so.$(VERSION) $(B)/libgreqprof.a

$(B)/shared/%.o: libgreqprof/%.c $(LIB_HDRS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_COMMON) $(CFLAGS) -fPIC -fvisibility=hidden -c $< -o $@

$(B)/libgreqprof.so.$(VERSION): $(patsubst libgreqprof/%.c,$(B)/shared/%.o,$(LIB_SRCS))
	$(CC) -shared -Wl,-soname,$(SONAME) -o $@ $^
	ln -sf libgreqprof.so.$(VERSION) $(B)/$(SONAME)
	ln -sf $(SONAME) $(B)/libgreqprof.so

$(B)/libgreqprof.a: $(patsubst libgreqprof/%.c,$(B)/shared/%.o,$(LIB_SRCS))
	ar rcs $@ $^

# The C tests link the library's sources directly so internal symbols and
# sanitizer instrumentation cover everything.
$(B)/run_tests: $(LIB_SRCS) $(CTEST_SRCS) $(LIB_HDRS) $(wildcard libgreqprof/tests/*.h)
	@mkdir -p $(B)
	$(CC) $(CFLAGS_COMMON) -O1 -g -o $@ $(LIB_SRCS) $(CTEST_SRCS) -lpthread

$(B)/run_tests_asan: $(LIB_SRCS) $(CTEST_SRCS) $(LIB_HDRS) $(wildcard libgreqprof/tests/*.h)
	@mkdir -p $(B)
	$(CC) $(CFLAGS_COMMON) -O1 -g $(SAN) -o $@ $(LIB_SRCS) $(CTEST_SRCS) -lpthread

$(B)/fuzz_replay: $(LIB_SRCS) $(FUZZ_SRC) $(LIB_HDRS)
	@mkdir -p $(B)
	$(CC) $(CFLAGS_COMMON) -O1 -g $(SAN) -DGQP_FUZZ_STANDALONE -o $@ $(LIB_SRCS) $(FUZZ_SRC)

$(B)/fuzz_api: $(LIB_SRCS) $(FUZZ_SRC) $(LIB_HDRS)
	@mkdir -p $(B)
	$(CLANG) $(CFLAGS_COMMON) -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -o $@ $(LIB_SRCS) $(FUZZ_SRC)

# ThreadSanitizer: the functions greqprof.h documents as thread-safe, used
# from several threads at once (libgreqprof/tests/tsan/).
TSAN_SRCS := $(wildcard libgreqprof/tests/tsan/*.c)
$(B)/tsan_tests: $(LIB_SRCS) $(TSAN_SRCS) $(LIB_HDRS)
	@mkdir -p $(B)
	$(CLANG) $(CFLAGS_COMMON) -O1 -g -fsanitize=thread -o $@ $(LIB_SRCS) $(TSAN_SRCS) -lpthread

tsan: $(B)/tsan_tests
	TSAN_OPTIONS=halt_on_error=1 $(B)/tsan_tests

ctest: $(B)/run_tests lib
	$(B)/run_tests

ctest-asan: $(B)/run_tests_asan
	$(B)/run_tests_asan

valgrind: $(B)/run_tests
	GQP_TEST_NOFORK=1 valgrind --quiet --error-exitcode=3 --leak-check=full --errors-for-leak-kinds=all --show-leak-kinds=all $(B)/run_tests

# Short fuzz run: replay the corpus, then ~30 s of new inputs when clang's
# libFuzzer is available (docs/fuzzing.md has the long run).
fuzz: $(B)/fuzz_replay
	$(B)/fuzz_replay libgreqprof/tests/corpus/*
	@if command -v $(CLANG) >/dev/null 2>&1; then \
	  $(MAKE) --no-print-directory $(B)/fuzz_api && \
	  mkdir -p $(B)/corpus && \
	  $(B)/fuzz_api -max_total_time=$${FUZZ_SECONDS:-30} -max_len=4096 $(B)/corpus libgreqprof/tests/corpus; \
	else echo "clang not found: libFuzzer run skipped (corpus replayed)"; fi

fuzz-long: $(B)/fuzz_api
	mkdir -p $(B)/corpus
	$(B)/fuzz_api -max_total_time=$${FUZZ_SECONDS:-3600} -max_len=4096 -jobs=2 $(B)/corpus libgreqprof/tests/corpus

# The Python fuzz targets (tests/fuzz/, hypothesis) run a few seconds each
# in `make pytest`; this runs them longer, from a random seed, and saves
# what fails into tests/fuzz/examples/ (commit it with the fix).
fuzz-py: venv
	GQP_FUZZ_EXAMPLES=$${FUZZ_EXAMPLES:-5000} GQP_FUZZ_SAVE=1 \
	  $(VPY) -m pytest -q -p no:cacheprovider tests/fuzz

$(VPY):
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q -U pip setuptools wheel

venv: $(VPY)
	$(VPY) -m pip install -q cffi greenlet gevent pytest pytest-timeout yappi werkzeug requests gunicorn 'selenium>=4.11' hypothesis \
	  opentelemetry-api opentelemetry-sdk opentelemetry-instrumentation-wsgi \
	  opentelemetry-exporter-otlp-proto-http opentelemetry-proto psycopg2-binary psycogreen flask django prometheus_client
	$(VPY) -m pip install -q --no-build-isolation -e .

pytest: venv
	$(VPY) -m pytest -q -p no:cacheprovider

# The extension (_hooks.c with its parts in greqprof/_hooks/, _fastpath.c,
# _sampled.c, _routes.c and libgreqprof as
# compiled into it) under AddressSanitizer, through the tests that exercise
# it hardest.  Heap
# checks only: greenlet copies stacks around, which stack instrumentation
# reports as errors.  libstdc++ is preloaded so ASan sees greenlet's C++
# exceptions.  Built into build/asan-py, away from the in-place build.
ASAN_PY := build/asan-py
ASAN_TESTS := test_fastpath.py test_sampled_c.py test_middleware.py test_faults.py test_threads_fork.py \
  test_borrowed_hooks.py test_borrowed_refs.py test_lifecycle.py test_lifecycle_review.py \
  test_review_prof.py test_own_work.py test_reading.py \
  test_route_aggregates.py test_routes.py test_dropped_bodies.py
ASAN_RUN = LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libstdc++.so)" \
  ASAN_OPTIONS=detect_leaks=0:replace_intrin=0:detect_stack_use_after_return=0:abort_on_error=1 \
  $(CURDIR)/$(VPY)
pytest-asan: venv
	rm -rf $(ASAN_PY) build/asan-build
	CFLAGS="-fsanitize=address -fno-omit-frame-pointer -g --param asan-stack=0" \
	  LDFLAGS="-fsanitize=address" \
	  $(VPY) setup.py -q build --build-base build/asan-build --build-lib $(ASAN_PY) >/dev/null
	cd $(ASAN_PY) && $(ASAN_RUN) -c "import greqprof._core as c, os; \
	  assert os.path.abspath(c.__file__).startswith(os.getcwd()), c.__file__"
	cd $(ASAN_PY) && $(ASAN_RUN) -m pytest -q -p no:cacheprovider \
	  --rootdir=$(CURDIR) $(addprefix $(CURDIR)/tests/,$(ASAN_TESTS))

# Which Pythons run the whole suite; the others run the subset (.ci/pkg
# SUBSET_EXCLUDE, docs/packaging.md).  The ends of the range run it all:
# 3.13 here, 3.10 in the floors job (ci-packaging).
FULL_PYTHONS ?= 3.13

system-deps:
	@.ci/system-deps

sdist:
	.ci/pkg sdist

wheel: sdist
	.ci/pkg wheel

# The installed wheel of every supported Python found (.ci/pythons) in a
# clean venv; greqprof must be imported from site-packages.  PKG_JOBS runs
# (default 2) share the machine, the full ones started first.
PKG_JOBS ?= 2
test-wheels: wheel
	.ci/pkg reset
	@set -e; full=; subset=; for v in $$(.ci/pythons | cut -d' ' -f1); do \
	  case " $(FULL_PYTHONS) " in *" $$v "*) full="$$full test-wheel:$$v:full";; \
	    *) subset="$$subset test-wheel:$$v:subset";; esac; \
	done; PKG_JOBS=$(PKG_JOBS) .ci/pkg runs $$full $$subset || fail=1; \
	  .ci/pkg summary; exit $${fail:-0}

sdist-test: sdist
	.ci/pkg test-sdist

floors: sdist
	.ci/pkg floors

debian12: sdist
	.ci/pkg debian12

# What .ci/run adds to make test: the sdist, the floors, Debian 12's stack.
ci-packaging: sdist
	@PKG_JOBS=$(PKG_JOBS) .ci/pkg runs floors test-sdist debian12 || fail=1; \
	  .ci/pkg summary; exit $${fail:-0}

test: system-deps ctest ctest-asan valgrind tsan fuzz pytest-asan test-wheels

# The demo needs only the runtime dependencies; the stamp rebuilds the
# editable install when a source changes, not on every run.
DEMO_READY := $(VENV)/.demo-ready
$(DEMO_READY): $(VPY) setup.py pyproject.toml greqprof/_ffi_build.py \
  $(wildcard greqprof/*.c greqprof/*.h greqprof/_hooks/*.c greqprof/_hooks/*.h \
    libgreqprof/*.c libgreqprof/*.h libgreqprof/include/*.h)
	$(VPY) -m pip install -q cffi greenlet gevent
	$(VPY) -m pip install -q --no-build-isolation -e .
	touch $@

demo: $(DEMO_READY)
	$(VPY) examples/demo.py

bench: venv
	$(VPY) bench/switch_overhead.py --markdown
	$(VPY) bench/call_overhead.py --markdown

clean:
	rm -rf build dist greqprof/_core.c greqprof/_core*.so *.egg-info $(DEMO_READY)
