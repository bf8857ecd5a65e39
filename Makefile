# Two commands do all set-up on a fresh machine:
#   make test    venv + torch + build (CUDA kernels compiled when nvcc is found) + test suite
#   make bench   venv + torch + build + kernel benchmark
# Inside an existing environment (e.g. a GPU machine with torch, no network):
#   pip install --no-build-isolation -e . && pytest

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.14.1
PY := $(VENV)/bin/python
# A non-wrapper nvcc for torch's build (setup.py also defaults this).
export CUDA_HOME ?= $(if $(wildcard /usr/local/cuda/bin/nvcc),/usr/local/cuda,)

DEPS_STAMP := $(VENV)/.deps-$(TORCH_VERSION)
BUILD_STAMP := .stamp-build
SOURCES := setup.py pyproject.toml $(wildcard csrc/*) $(wildcard relu_ext/*.py)

.PHONY: test test-cpu-only bench build deps clean

test: $(BUILD_STAMP)
	$(PY) -m pytest tests

# A RELU_EXT_FORCE_CPU=1 build, made in a scratch copy so the main build stays,
# must import and pass the CPU tests (its own test asserts it has no CUDA kernels).
test-cpu-only: $(DEPS_STAMP)
	rm -rf build/cpu-only && mkdir -p build/cpu-only
	git ls-files -z | xargs -0 cp --parents -t build/cpu-only
	cd build/cpu-only && RELU_EXT_FORCE_CPU=1 $(abspath $(PY)) setup.py -q build_ext --inplace
	cd build/cpu-only && RELU_EXT_FORCE_CPU=1 PYTHONPATH=$(abspath build/cpu-only) $(abspath $(PY)) -m pytest -q -p no:cacheprovider \
		tests/test_exact.py tests/test_examples_and_errors.py

bench: $(BUILD_STAMP)
	$(PY) bench/run.py $(BENCH_ARGS)

build: $(BUILD_STAMP)

deps: $(DEPS_STAMP)

$(DEPS_STAMP):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q torch==$(TORCH_VERSION) ninja numpy pytest hypothesis
	touch $@

$(BUILD_STAMP): $(DEPS_STAMP) $(SOURCES)
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	$(PY) -c "import relu_ext; print('relu_ext build:', relu_ext.build_info())"
	touch $@

clean:
	rm -rf build *.egg-info relu_ext/*.so $(BUILD_STAMP)
