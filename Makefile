# Quick start: `make demo` (the main job) and `make test` (the test suite). Both create the
# virtual environment .venv on first use (torch pinned to the local CPU wheel, see
# requirements-dev.txt).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-slow bench clean

$(BIN)/solosave: pyproject.toml requirements-dev.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-dev.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $@

demo: $(BIN)/solosave
	$(BIN)/solosave demo --nproc 2 --saves 6

test: $(BIN)/solosave
	$(BIN)/python -m pytest -q -m "not slow"

test-slow: $(BIN)/solosave
	$(BIN)/python -m pytest -q -m slow

bench: $(BIN)/solosave
	$(BIN)/python benchmarks/bench_save.py

clean:
	rm -rf $(VENV) runs bench-out
