# Quick start: `make train` (the main job) and `make test` (the test suite). Both create the
# virtual environment .venv on first use. `make train` installs only what the main job needs
# (requirements-train.txt: torch pinned to the local CPU wheel, numpy, isal; then solosave);
# `make test` and the other targets add the test, lint, benchmark, S3 and torchtitan extras on
# top (requirements-dev.txt). Each set has its stamp file, so `make test` after `make train`
# installs only the rest.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TRAIN_DEPS := $(VENV)/.installed-train
DEV_DEPS := $(VENV)/.installed-dev
# --no-compile: no byte-compiling of every installed module (most of torch's are never imported
# by the job; Python compiles those it imports on first use).
PIP := $(BIN)/pip install -q --no-compile
# Every interpreter that the targets start (ranks, workers, tests) may cache the bytecode of
# what it imports (in .venv, src/ and tests/; all ignored by git and left out of the sdist): an
# environment with PYTHONDONTWRITEBYTECODE set (this project's machines have it) otherwise
# recompiles torch, sympy and DCP from source in every process, which made each worker's start
# much costlier (docs/benchmarks.md, section 9: what a worker's start costs).
unexport PYTHONDONTWRITEBYTECODE

TRAIN_DIR ?= runs/train
# pytest-xdist processes for `make test`: most tests wait on process start-ups, deadlines and
# other ranks, so one and a half per usable core (3 on 2 cores) keeps the CPU busy without
# starving the ranks of tests that run at once (3 against 4: docs/benchmarks.md, section 9).
TEST_JOBS ?= $(shell $(PY) -c "import os; n = len(os.sched_getaffinity(0)); print(max(2, n + n // 2))")

.PHONY: train test test-slow lint typecheck wheel-smoke bench device-check test-torch-versions clean

$(TRAIN_DEPS): pyproject.toml requirements-train.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) -r requirements-train.txt
	$(PIP) --no-deps -e .
	touch $@

# The extras go in with uv (pinned; pip installs it): much faster here than pip, which spent most
# of its time on its own CPU (docs/benchmarks.md, section 9). uv reads no pip configuration:
# where uv cannot be installed or cannot reach the packages (an index that only pip is configured
# for), pip installs them instead.
# torch stays as requirements-train.txt pinned it (the installed 2.13.0 satisfies every extra).
# torchtitan (tests/integrations/test_titan.py) goes in without its declared dependencies: they add
# ~60 packages (wandb, datasets, tensorboard, pandas, pyarrow...) that its checkpointer never
# imports; the two it does import are pinned in requirements-dev.txt. So does megatron-core
# (tests/integrations/test_megatron.py; see requirements-dev.txt).
UV := $(BIN)/uv pip install -q --python $(BIN)/python
NO_DEPS_EXTRAS := torchtitan==0.3.0 megatron-core==0.16.1
$(DEV_DEPS): $(TRAIN_DEPS) requirements-dev.txt
	$(PIP) uv==0.13.9 || echo "uv could not be installed: pip installs the extras"
	(test -x $(BIN)/uv && $(UV) -r requirements-dev.txt) || $(PIP) -r requirements-dev.txt
	(test -x $(BIN)/uv && $(UV) --no-deps $(NO_DEPS_EXTRAS)) || $(PIP) --no-deps $(NO_DEPS_EXTRAS)
	touch $@

# The main job: 2 ranks train a small GPT for 40 steps, saving every 5 steps asynchronously;
# the first save creates the prepared metadata, every later one reuses it (one 8-byte all_reduce).
train: $(TRAIN_DEPS)
	rm -rf $(TRAIN_DIR)
	$(BIN)/solosave train --nproc 2 --steps 40 --save $(TRAIN_DIR)/ckpt --save-interval 5 \
		--async-save --use-persistent-ckpt-worker --ckpt-metadata $(TRAIN_DIR)/prepared.metadata \
		--ckpt-metadata-create --keep-last 3 --json-log $(TRAIN_DIR)/saves.jsonl

# The suite without the soaks, TEST_JOBS tests at a time (make test TEST_JOBS=0: one at a time).
test: $(DEV_DEPS)
	$(BIN)/python -m pytest -q -m "not slow" -n $(TEST_JOBS) --dist loadgroup

lint: $(DEV_DEPS)
	$(BIN)/ruff check src tests benchmarks tools

# mypy with the project's configuration ([tool.mypy] in pyproject.toml): zero errors on src/.
typecheck: $(DEV_DEPS)
	$(BIN)/mypy

test-slow: $(DEV_DEPS)
	$(BIN)/python -m pytest -q -m slow

# The package as users get it: sdist, wheel built from it, installed into a fresh virtual
# environment, a 2-rank job and `solosave verify` run from outside the repository.
wheel-smoke: $(DEV_DEPS)
	$(BIN)/python tools/wheel_smoke.py

# On a machine with a GPU and the torch installed there (no venv, no install, no network): the
# source tree on PYTHONPATH, one line per section as it goes, a JSON summary in $OUT when set,
# at most 8 minutes (the script's budget; `timeout` is the backstop). See tools/device_check.py.
device-check:
	PYTHONPATH=$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH} timeout 600 $(PY) -u tools/device_check.py $(DEVICE_CHECK_ARGS)

# Core tests on the oldest torch that pyproject.toml claims, on 2.11 (the lent GPU machine's) and on
# the newest (CUDA builds of several GB each, run on the CPU; not in CI): tools/torch_versions.sh.
# TORCH_VERSIONS="2.12.1 2.13.0:python3.12" picks others; TORCH_VENV_PREFIX=/somewhere/torch- uses
# venvs kept outside the repository (default: .venv-torch-<version> here).
test-torch-versions:
	tools/torch_versions.sh $(TORCH_VERSIONS)

bench: $(DEV_DEPS)
	$(BIN)/python -m benchmarks --plots docs/img

clean:
	rm -rf $(VENV) runs bench-out
