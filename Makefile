VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-fast lint bench

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh

# vLLM's CPU build, for the vllm engine's tests (the default job does not need it)
$(VENV)/.vllm: $(VENV)/.installed
	bash scripts/setup.sh --vllm

demo: setup  ## README command 1: the default arithmetic RL job, end to end
	$(BIN)/jetroll run configs/arithmetic.yaml

test: setup $(VENV)/.vllm  ## README command 2: the whole suite, slow end-to-end tests included, on both cores (a module per worker)
	$(BIN)/pytest -q -n 2 --dist loadfile

test-fast: setup $(VENV)/.vllm  ## the fast tier: no job, bench or eval subprocess (tests/tiers.py), on both cores
	$(BIN)/pytest -q -m "not slow and not job" -n 2 --dist loadfile

lint: setup
	$(BIN)/ruff check shared services functions bench tests scripts

bench: setup
	$(BIN)/jetroll bench engine
