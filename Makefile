# Quick start: `make train` (the main job) and `make test` (the test suite). Both create the
# virtual environment .venv on first use (torch pinned to the local CPU wheel, see
# requirements-dev.txt).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

TRAIN_DIR ?= runs/train

.PHONY: train test test-slow lint wheel-smoke bench device-check test-torch-versions clean

$(BIN)/solosave: pyproject.toml requirements-dev.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-dev.txt
	# torchtitan (tests/integrations/test_titan.py) without its declared dependencies: they add ~60 packages
	# (wandb, datasets, tensorboard, pandas, pyarrow...) that its checkpointer never imports; the
	# two it does import are pinned in requirements-dev.txt. Adds about 5 s; torch stays as pinned.
	$(BIN)/pip install -q --no-deps torchtitan==0.3.0
	$(BIN)/pip install -q --no-deps megatron-core==0.16.1  # tests/integrations/test_megatron.py (see requirements-dev.txt)
	$(BIN)/pip install -q --no-deps -e .
	touch $@

# The main job: 2 ranks train a small GPT for 40 steps, saving every 5 steps asynchronously;
# the first save creates the prepared metadata, every later one reuses it (one 8-byte all_reduce).
train: $(BIN)/solosave
	rm -rf $(TRAIN_DIR)
	$(BIN)/solosave train --nproc 2 --steps 40 --save $(TRAIN_DIR)/ckpt --save-interval 5 \
		--async-save --use-persistent-ckpt-worker --ckpt-metadata $(TRAIN_DIR)/prepared.metadata \
		--ckpt-metadata-create --keep-last 3 --json-log $(TRAIN_DIR)/saves.jsonl

test: $(BIN)/solosave
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(BIN)/solosave
	$(BIN)/ruff check src tests benchmarks tools

test-slow: $(BIN)/solosave
	$(BIN)/python -m pytest -q -m slow

# The package as users get it: sdist, wheel built from it, installed into a fresh virtual
# environment, a 2-rank job and `solosave verify` run from outside the repository.
wheel-smoke: $(BIN)/solosave
	$(BIN)/python tools/wheel_smoke.py

# On a machine with a GPU and a CUDA build of torch (not run yet: see tools/device_check.py).
device-check:
	timeout 300 $(PY) tools/device_check.py

# Core tests on the newest torch on this machine's index and the oldest claimed (CUDA builds of
# several GB each, run on the CPU; not in CI): tools/torch_versions.sh.
test-torch-versions:
	tools/torch_versions.sh

bench: $(BIN)/solosave
	$(BIN)/python -m benchmarks --plots docs/img

clean:
	rm -rf $(VENV) runs bench-out
