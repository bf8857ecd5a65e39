# Two commands do all set-up on a fresh machine:
#   make test    venv + torch + build (CUDA kernels compiled when nvcc is found) + the quick tier
#   make bench   venv + torch + build + kernel benchmark
# make test-full runs the full tier (every parameter combination; tests/tiers.py), make test-rest
# what it adds to make test.
# Inside an existing environment (e.g. a GPU machine with torch, no network):
#   pip install --no-build-isolation -e . && pytest          (pytest --full: the full tier)
# CI's legs (.ci/run): test, test-rest, test-sanitize, test-torch-old, test-package;
# docs/testing.md says which risk each one tests.

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.15.0
# Real models for the tests and the benchmark (built from configs, random weights):
# torchvision pairs with torch's version, transformers and timm are pinned for repeatable runs.
TORCHVISION_VERSION ?= 0.29.2
TRANSFORMERS_VERSION ?= 5.18.0
TIMM_VERSION ?= 1.0.31
PY := $(VENV)/bin/python
# A non-wrapper nvcc for torch's build (setup.py also defaults this).
export CUDA_HOME ?= $(if $(wildcard /usr/local/cuda/bin/nvcc),/usr/local/cuda,)
# The versions above are exact pins: a machine-wide pip constraint file that caps torch below
# them would make the install impossible (and one that agrees changes nothing), so pip reads none.
export PIP_CONSTRAINT := /dev/null
# pytest-xdist workers: the suite is mostly single-threaded Python, and these machines have 2 cores.
WORKERS ?= 2
PYTEST_ARGS ?= -n $(WORKERS) --dist loadgroup --durations=15

# pytest with pytest-xdist as a pair that works: xdist 3.8 names an xdist_group in item._nodeid,
# which pytest 9.2 no longer reads, so groups split across workers (tests/tooling/test_tiers.py).
DEPS := torch==$(TORCH_VERSION) torchvision==$(TORCHVISION_VERSION) transformers==$(TRANSFORMERS_VERSION) timm==$(TIMM_VERSION) \
	ninja numpy pytest==9.1.1 pytest-xdist==3.8.0 build hypothesis expecttest matplotlib onnx onnxruntime onnxscript
DEPS_HASH := $(shell echo '$(DEPS)' | cksum | cut -d' ' -f1)
DEPS_STAMP := $(VENV)/.deps-$(DEPS_HASH)
# What the build needs; the rest of DEPS installs while it compiles (`ready`).
BUILD_DEPS := torch==$(TORCH_VERSION) ninja numpy
TORCH_STAMP := $(VENV)/.torch-$(DEPS_HASH)
BUILD_STAMP := .stamp-build
SOURCES := setup.py pyproject.toml MANIFEST.in $(wildcard csrc/*/*) $(wildcard src/relu_ext/*.py src/relu_ext/compact/*.py src/relu_ext/bench/*.py)

.PHONY: ready test test-full test-rest test-sanitize test-torch-old test-package wheel bench bench-results build deps \
	deps-torch-old package-venv clean \
	distclean uninstall

# The README's test command: the quick tier.
test: ready
	$(PY) -m pytest $(PYTEST_ARGS) tests

test-full: ready
	$(PY) -m pytest $(PYTEST_ARGS) --full tests

# The full tier less the quick tier: CI's second leg, on make test's build.
test-rest: ready
	$(PY) -m pytest $(PYTEST_ARGS) --rest tests

# Builds the tracked sources in a scratch copy, so the main build stays.
# $(1): folder under build/, $(2): environment for the build, $(3): python (default: the venv's).
define scratch_build
	rm -rf build/$(1) && mkdir -p build/$(1)
	git ls-files -z | xargs -0 cp --parents -t build/$(1)
	cd build/$(1) && $(2) $(abspath $(or $(3),$(PY))) setup.py -q build_ext --inplace
endef
SCRATCH_PYTEST = $(abspath $(PY)) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

# The CPU kernels and bindings built with AddressSanitizer and
# UndefinedBehaviorSanitizer (aborting on the first report), under the quick
# tier of the tests that reach native code (-m native): every size, dtype,
# layout and kernel set at least once, each kernel set with each dtype. The build is
# CPU-only, so it is also the build without CUDA kernels that must import and
# pass (its tests assert it has none). python and torch are not instrumented, so the ASan runtime is
# preloaded, with libstdc++ beside it (else ASan's __cxa_throw interceptor
# finds no real __cxa_throw and aborts at the first C++ exception). Leak
# checking is off: CPython frees little at exit by design.
SAN_CXX ?= $(or $(CXX),c++)
SAN_PRELOAD = $(shell $(SAN_CXX) -print-file-name=libasan.so) $(shell $(SAN_CXX) -print-file-name=libstdc++.so)
test-sanitize: $(DEPS_STAMP)
	$(call scratch_build,sanitize,RELU_EXT_SANITIZE=1)
	cd build/sanitize && RELU_EXT_SANITIZE=1 PYTHONPATH=$(abspath build/sanitize/src) \
		LD_PRELOAD="$(SAN_PRELOAD)" ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 \
		$(SCRATCH_PYTEST) -m native tests

# The GPU machines run torch 2.11: build against it too (a development build:
# the CUDA kernels for one architecture where nvcc exists), then the full
# matrices of the tests of what depends on torch's version (-m torch_version).
# The rest (kernel sets, dtypes, sizes: relu_ext's own code) does not depend on it.
OLD_TORCH ?= 2.11.0
OLD_TORCHVISION ?= 0.26.0
OLD_VENV ?= .venv-torch$(OLD_TORCH)
OLD_PY := $(OLD_VENV)/bin/python
OLD_STAMP := $(OLD_VENV)/.deps-$(DEPS_HASH)
deps-torch-old: $(OLD_STAMP)
$(OLD_STAMP):
	$(PYTHON) -m venv $(OLD_VENV)
	$(OLD_PY) -m pip install -q --upgrade pip setuptools wheel
	$(OLD_PY) -m pip install -q torch==$(OLD_TORCH) torchvision==$(OLD_TORCHVISION) $(filter-out torch==% torchvision==%,$(DEPS))
	touch $@
test-torch-old: $(OLD_STAMP)
	$(OLD_PY) -c "import torch; assert torch.__version__.startswith('$(OLD_TORCH)'), torch.__version__"
	$(call scratch_build,torch-old,,$(OLD_PY))
	cd build/torch-old && PYTHONPATH=$(abspath build/torch-old/src) $(abspath $(OLD_PY)) -m pytest -q -p no:cacheprovider \
		$(PYTEST_ARGS) --full-marked torch_version -m torch_version tests

# make bench writes to bench/out (git ignores it, each run its own name);
# make bench-results into the committed bench/results, on purpose.
bench: ready
	$(PY) -m relu_ext.bench --out bench/out $(BENCH_ARGS)

bench-results: ready
	$(PY) -m relu_ext.bench --out bench/results $(BENCH_ARGS)
	$(PY) bench/make_readme.py

build: $(BUILD_STAMP)

deps: $(DEPS_STAMP)

# The build and the rest of the dependencies side by side: the compile is both cores' work, pip's
# install mostly one core's and the disk's. The build's pip and this one share the venv: the
# second finds torch and its dependencies installed and adds packages beside them.
ready:
	$(MAKE) -j2 --output-sync=target $(BUILD_STAMP) $(DEPS_STAMP)

$(TORCH_STAMP):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q $(BUILD_DEPS)
	touch $@

$(DEPS_STAMP): $(TORCH_STAMP)
	$(PY) -m pip install -q $(DEPS)
	touch $@

$(BUILD_STAMP): $(TORCH_STAMP) $(SOURCES)
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	$(PY) -c "import relu_ext; print('relu_ext build:', relu_ext.build_info())"
	touch $@

# The release build: the sdist (isolated, as a user's `python -m build --sdist` makes it), and
# the wheel in this venv (no isolation: it must be compiled against the installed torch;
# setup.py's full architecture list). The wheel pins torch's major.minor. It is built in this
# tree, which holds what the sdist holds (tests/tooling/test_packaging.py: every tracked file
# but the benchmark's results), so that it reuses the development build's objects: the C++
# files compile once, and only the CUDA files again, for every architecture.
WHL := build/wheel
WHEEL_STAMP := $(WHL)/.built
$(WHEEL_STAMP): $(DEPS_STAMP) $(SOURCES)
	rm -rf $(WHL) && mkdir -p $(WHL)
	$(PY) -m build --sdist --outdir $(WHL) .
	tar -xzf $(WHL)/relu_ext-*.tar.gz -C $(WHL)
	$(PY) -m build --wheel --no-isolation --outdir $(WHL) .
	unzip -p $(WHL)/relu_ext-*.whl '*/METADATA' | tee $(WHL)/METADATA | grep -x 'Requires-Dist: torch==$(basename $(TORCH_VERSION)).\*'
	grep -x 'License-Expression: BSD-3-Clause' $(WHL)/METADATA
	touch $@
wheel: $(WHEEL_STAMP)

# The package leg: the release wheel (every architecture: the one build of CI that compiles
# them all; after `make test`, its C++ objects are that build's). A wheel build in pip's
# default isolated environment stops with the explanation instead of compiling; the wheel
# installs with plain pip into a fresh venv, imports every module, and passes the quick tier
# of two files from the unpacked sdist's root. The venv gets torch (the version the wheel pins)
# and pytest while the wheel compiles: pip is one core's work and the disk's, and then finds the
# wheel's requirement satisfied.
PKG_VENV := build/package-venv
PKG_PY := $(PKG_VENV)/bin/python
package-venv:
	rm -rf $(PKG_VENV) && $(PYTHON) -m venv $(PKG_VENV)
	$(PKG_PY) -m pip install -q torch==$(TORCH_VERSION) pytest
test-package:
	$(MAKE) -j2 --output-sync=target $(WHEEL_STAMP) package-venv
	! $(PY) -m build --wheel --outdir $(WHL)/isolated $(WHL)/relu_ext-*/ > $(WHL)/isolated.log 2>&1
	grep -q 'no-build-isolation' $(WHL)/isolated.log
	$(PKG_PY) -m pip install -q $(WHL)/relu_ext-*.whl
	$(PKG_PY) -c "import pkgutil, importlib, relu_ext; \
		names = [m.name for m in pkgutil.walk_packages(relu_ext.__path__, 'relu_ext.')]; \
		names = [n for n in names if not n.endswith('__main__')]; \
		[importlib.import_module(n) for n in names]; print('imported', len(names), 'modules of relu_ext')"
	cd $(WHL)/relu_ext-*/ && $(abspath $(PKG_PY)) -m pytest -q -p no:cacheprovider --durations=15 \
		tests/activations/test_exact.py tests/tooling/test_packaging.py
	rm -rf $(PKG_VENV)

clean:
	rm -rf build dist src/*.egg-info src/relu_ext/*.so src/relu_ext/_build_config.py $(BUILD_STAMP)

# clean, and the virtual environments make created.
distclean: clean
	rm -rf $(VENV) $(OLD_VENV)

uninstall:
	$(PY) -m pip uninstall -y relu_ext
	rm -f $(BUILD_STAMP)
