# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# PyTorch pinned for a reproducible set-up (the package itself only requires torch>=2.3). pip
# picks the build for the platform: on Linux x86_64 from PyPI that is a CUDA build. For the
# CPU-only build: make setup TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu"
TORCH  ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: setup demo test docs clean horovod gpu-check

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(TORCH_INDEX) "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[test,docs]"
	touch $(STAMP)

demo: setup
	$(BIN)/dptrain demo

# The 30 slowest tests are listed at the end: where the suite's time goes (CI keeps it under 30 minutes).
test: setup
	$(BIN)/python -m pytest -q --durations=30 $(PYTEST_ARGS)

# The documentation site (MkDocs, docs/ and mkdocs.yml) into site/, warnings as errors; open site/index.html,
# or serve it while editing with .venv/bin/mkdocs serve. tests/test_docs.py builds it too and runs its examples.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# On one CUDA GPU, in under 8 minutes: every strategy with NCCL, AMP bf16/fp16, dptrain against a plain loop
# (images/s, peak memory); writes benchmarks/results/gpu_check.json (GPU_CHECK_ARGS="--out FILE" to change).
# Without a GPU it says so in one line and succeeds.
gpu-check: setup
	$(BIN)/python benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) runs site .pytest_cache

# Optional, not part of setup: Horovod 0.28.1 (its last release) as a baseline for `dptrain bench`.
# It builds against torch 2.x only as C++17, so the sdist is patched first (about 2 minutes;
# needs cmake, a C++ compiler and network access for the download).
HOROVOD := horovod-0.28.1
HOROVOD_SRC := build/$(HOROVOD)

horovod: setup
	rm -rf $(HOROVOD_SRC) && mkdir -p build
	$(BIN)/python -m pip download --quiet --no-deps --no-binary :all: horovod==0.28.1 -d build
	tar -xzf build/$(HOROVOD).tar.gz -C build
	sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' $(HOROVOD_SRC)/CMakeLists.txt $(HOROVOD_SRC)/horovod/torch/CMakeLists.txt
	sed -i 's/-std=c++11/-std=c++17/' $(HOROVOD_SRC)/third_party/gloo/CMakeLists.txt
	$(BIN)/python -m pip install --quiet setuptools wheel
	HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
	HOROVOD_WITHOUT_MPI=1 $(BIN)/python -m pip install --no-build-isolation $(HOROVOD_SRC)
	$(BIN)/python -c "import horovod.torch; print('horovod', horovod.__version__, 'ready')"
