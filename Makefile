# Two entry points, each self-contained on a fresh machine:
#   make demo  -- create .venv if needed, install, compare 4 losses on the bundled digits (instances)
#   make test  -- create .venv if needed, install, run the test suite (slow tests excluded)
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
# torch==2.13.0 is a local CPU wheel on these machines; installing it first keeps the
# `torch>=2.2` requirement satisfied without pulling a multi-GB CUDA build. The `test` extra holds
# every optional dependency `make test` and `make demo` use (cli, baselines, lightning, ...).
TORCH   ?= torch==2.13.0

.PHONY: demo test test-slow lint bench clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]" "$(TORCH)"
	rm -f $(VENV)/.installed-* && touch $@

# the many-class instance protocol on the bundled digits (issue 7): 4 losses x 150 steps of 16 x 4;
# runs/demo is the demo's own folder, replaced on each run (--overwrite)
demo: $(STAMP)
	$(BIN)/rankwise bench --dataset digits-instances --quick --losses contrastive,ap,soprc,auc \
		--output runs/demo --overwrite sampler.batch_size=64

# two pytest workers (pytest-xdist): the suite took 642 s in one process and 451 s in two on a
# quiet 2-core machine (2026-11-28); TEST_WORKERS=0 runs it in one process
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" -q -n $(TEST_WORKERS)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow -q

# ruff's rules include complexity <= 12 and google-style docstrings (pyproject.toml [tool.ruff.lint]);
# mypy checks src/ ([tool.mypy])
lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_retrieval.py
	$(BIN)/python benchmarks/bench_losses.py

clean:
	rm -rf $(VENV) runs .pytest_cache
