# keel: `make train` and `make test` do everything on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
# Empty: pip's configured indexes (PyPI's Linux wheel of torch is a CUDA build; a local CPU wheel wins
# where one is configured). Set e.g. https://download.pytorch.org/whl/cpu or .../whl/cu128 to choose.
TORCH_INDEX_URL ?=
NPROC ?= 2
# Flags of bench/step_overhead.py, e.g. BENCH_ARGS='--shapes tiny --nproc 2 --repeats 1' for a short run.
BENCH_ARGS ?=

.PHONY: train test test-fast test-slow lint bench clean

# What training needs: torch, then keel (editable) with its runtime dependencies only.
$(BIN)/keel: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) $(TORCH)
	$(BIN)/pip install -q -e .
	touch $@

# The test, lint and benchmark tools on top (the `test` extra).
$(VENV)/.test-tools: $(BIN)/keel
	$(BIN)/pip install -q -e '.[test]'
	touch $@

.venv: $(BIN)/keel

train: $(BIN)/keel
	$(BIN)/keel train --config configs/tiny.toml --nproc $(NPROC)

# The one-process tests two at a time; then the multi-process ones (marker `dist`) one at a time: each
# starts several processes, and many time what they start. The suites of minutes (marker `slow`) run apart.
test: test-fast
	OMP_NUM_THREADS=1 $(BIN)/pytest -q -m "dist and not slow" --durations=25

test-slow: $(VENV)/.test-tools
	OMP_NUM_THREADS=1 $(BIN)/pytest -q -m slow --durations=25

test-fast: $(VENV)/.test-tools
	OMP_NUM_THREADS=1 $(BIN)/pytest -q -m "not dist" -n 2 --durations=10

# Style, complexity and statement counts (ruff), the package's import layers and cycles (import-linter), types
# (mypy) and function length: every check runs, and any one failing fails the target.
lint: $(VENV)/.test-tools
	@failed=0; \
	$(BIN)/ruff check src tests bench tools || failed=1; \
	PYTHONPATH=src $(BIN)/lint-imports || failed=1; \
	$(BIN)/mypy || failed=1; \
	$(BIN)/python tools/function_length.py || failed=1; \
	exit $$failed

bench: $(VENV)/.test-tools
	$(BIN)/python bench/step_overhead.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) runs data/stdlib .pytest_cache
