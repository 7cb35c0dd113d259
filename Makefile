# Two entry points, each self-contained on a fresh machine:
#   make demo  -- create .venv if needed, install, run the main job on the bundled digits data
#   make test  -- create .venv if needed, install, run the test suite (slow tests excluded)
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
# torch==2.13.0 is a local CPU wheel on these machines; installing it first keeps the
# `torch>=2.2` requirement satisfied without pulling a multi-GB CUDA build. The `test` extra holds
# every optional dependency `make test` and `make demo` use (cli, baselines, lightning, ...).
TORCH   ?= torch==2.13.0

.PHONY: demo test test-slow lint lint-strict bench clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]" "$(TORCH)"
	rm -f $(VENV)/.installed-* && touch $@

demo: $(STAMP)
	$(BIN)/rankwise bench --dataset digits --quick --output runs/demo

test: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow -q

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples

# complexity <= 12 and google-style docstrings (settings in pyproject.toml [tool.ruff.lint.*])
lint-strict: $(STAMP)
	$(BIN)/ruff check src benchmarks examples --select C90,D --ignore D105,D107

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_retrieval.py
	$(BIN)/python benchmarks/bench_losses.py

clean:
	rm -rf $(VENV) runs .pytest_cache
