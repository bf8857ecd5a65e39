# Two commands do all set-up on a fresh machine:
#   make test    venv + torch + build (CUDA kernels compiled when nvcc is found) + test suite
#   make bench   venv + torch + build + kernel benchmark
# Inside an existing environment (e.g. a GPU machine with torch, no network):
#   pip install --no-build-isolation -e . && pytest

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

DEPS := torch==$(TORCH_VERSION) torchvision==$(TORCHVISION_VERSION) transformers==$(TRANSFORMERS_VERSION) timm==$(TIMM_VERSION) \
	ninja numpy pytest hypothesis expecttest matplotlib onnx onnxruntime onnxscript
DEPS_STAMP := $(VENV)/.deps-$(TORCH_VERSION)-$(words $(DEPS))
BUILD_STAMP := .stamp-build
SOURCES := setup.py pyproject.toml MANIFEST.in $(wildcard csrc/*/*) $(wildcard src/relu_ext/*.py src/relu_ext/compact/*.py src/relu_ext/bench/*.py)

.PHONY: test test-cpu-only test-sanitize test-torch-old test-package bench bench-results build deps clean distclean uninstall

test: $(BUILD_STAMP)
	$(PY) -m pytest tests

# Builds the tracked sources in a scratch copy, so the main build stays.
# $(1): folder under build/, $(2): environment for the build, $(3): python (default: the venv's).
define scratch_build
	rm -rf build/$(1) && mkdir -p build/$(1)
	git ls-files -z | xargs -0 cp --parents -t build/$(1)
	cd build/$(1) && $(2) $(abspath $(or $(3),$(PY))) setup.py -q build_ext --inplace
endef
SCRATCH_PYTEST = $(abspath $(PY)) -m pytest -q -p no:cacheprovider

# A RELU_EXT_FORCE_CPU=1 build must import and pass the CPU tests
# (its own test asserts it has no CUDA kernels).
test-cpu-only: $(DEPS_STAMP)
	$(call scratch_build,cpu-only,RELU_EXT_FORCE_CPU=1)
	cd build/cpu-only && RELU_EXT_FORCE_CPU=1 PYTHONPATH=$(abspath build/cpu-only/src) $(SCRATCH_PYTEST) \
		tests/activations/test_exact.py tests/activations/test_examples_and_errors.py

# The CPU kernels and bindings built with AddressSanitizer and
# UndefinedBehaviorSanitizer (aborting on the first report), under the whole
# CPU test suite. python and torch are not instrumented, so the ASan runtime is
# preloaded, with libstdc++ beside it (else ASan's __cxa_throw interceptor
# finds no real __cxa_throw and aborts at the first C++ exception). Leak
# checking is off: CPython frees little at exit by design.
SAN_CXX ?= $(or $(CXX),c++)
SAN_PRELOAD = $(shell $(SAN_CXX) -print-file-name=libasan.so) $(shell $(SAN_CXX) -print-file-name=libstdc++.so)
test-sanitize: $(DEPS_STAMP)
	$(call scratch_build,sanitize,RELU_EXT_SANITIZE=1)
	cd build/sanitize && RELU_EXT_SANITIZE=1 PYTHONPATH=$(abspath build/sanitize/src) \
		LD_PRELOAD="$(SAN_PRELOAD)" ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 \
		$(SCRATCH_PYTEST) tests

# The GPU machines run torch 2.11: build against it too (with the CUDA kernels
# where nvcc exists, as in the main build) and run the whole CPU suite there.
OLD_TORCH ?= 2.11.0
OLD_TORCHVISION ?= 0.26.0
OLD_VENV ?= .venv-torch$(OLD_TORCH)
OLD_PY := $(OLD_VENV)/bin/python
OLD_STAMP := $(OLD_VENV)/.deps-$(words $(DEPS))
$(OLD_STAMP):
	$(PYTHON) -m venv $(OLD_VENV)
	$(OLD_PY) -m pip install -q --upgrade pip setuptools wheel
	$(OLD_PY) -m pip install -q torch==$(OLD_TORCH) torchvision==$(OLD_TORCHVISION) $(filter-out torch==% torchvision==%,$(DEPS))
	touch $@
test-torch-old: $(OLD_STAMP)
	$(OLD_PY) -c "import torch; assert torch.__version__.startswith('$(OLD_TORCH)'), torch.__version__"
	$(call scratch_build,torch-old,,$(OLD_PY))
	cd build/torch-old && PYTHONPATH=$(abspath build/torch-old/src) $(abspath $(OLD_PY)) -m pytest -q -p no:cacheprovider tests

# make bench writes to bench/out (git ignores it, each run its own name);
# make bench-results into the committed bench/results, on purpose.
bench: $(BUILD_STAMP)
	$(PY) -m relu_ext.bench --out bench/out $(BENCH_ARGS)

bench-results: $(BUILD_STAMP)
	$(PY) -m relu_ext.bench --out bench/results $(BENCH_ARGS)
	$(PY) bench/make_readme.py

build: $(BUILD_STAMP)

deps: $(DEPS_STAMP)

$(DEPS_STAMP):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q $(DEPS)
	touch $@

$(BUILD_STAMP): $(DEPS_STAMP) $(SOURCES)
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	$(PY) -c "import relu_ext; print('relu_ext build:', relu_ext.build_info())"
	touch $@

# The sdist holds everything a build needs: make it (isolated, as a user's
# `python -m build --sdist` does), build a wheel from it in this venv (no
# isolation: the wheel must be compiled against the installed torch), install
# the wheel with plain pip into a fresh venv, and run the tests from the
# unpacked sdist's root there. Also: the wheel pins torch's major.minor, and
# an isolated wheel build stops with the explanation instead of compiling.
PKG := build/package
PKG_PY := $(PKG)/venv/bin/python
test-package: $(DEPS_STAMP)
	rm -rf $(PKG) && mkdir -p $(PKG)
	$(PY) -m pip install -q build
	$(PY) -m build --sdist --outdir $(PKG) .
	tar -xzf $(PKG)/relu_ext-*.tar.gz -C $(PKG)
	$(PY) -m build --wheel --no-isolation --outdir $(PKG) $(PKG)/relu_ext-*/
	unzip -p $(PKG)/relu_ext-*.whl '*/METADATA' | tee $(PKG)/METADATA | grep -x 'Requires-Dist: torch==$(basename $(TORCH_VERSION)).\*'
	grep -x 'License-Expression: BSD-3-Clause' $(PKG)/METADATA
	! $(PY) -m build --wheel --outdir $(PKG)/isolated $(PKG)/relu_ext-*/ > $(PKG)/isolated.log 2>&1
	grep -q 'no-build-isolation' $(PKG)/isolated.log
	$(PYTHON) -m venv $(PKG)/venv
	$(PKG_PY) -m pip install -q $(PKG)/relu_ext-*.whl torch==$(TORCH_VERSION) pytest numpy hypothesis
	cd $(PKG)/relu_ext-*/ && $(abspath $(PKG_PY)) -m pytest -q -p no:cacheprovider tests/activations/test_exact.py tests/tooling/test_packaging.py
	rm -rf $(PKG)/venv

clean:
	rm -rf build dist src/*.egg-info src/relu_ext/*.so src/relu_ext/_build_config.py $(BUILD_STAMP)

# clean, and the virtual environments make created.
distclean: clean
	rm -rf $(VENV) $(OLD_VENV)

uninstall:
	$(PY) -m pip uninstall -y relu_ext
	rm -f $(BUILD_STAMP)
