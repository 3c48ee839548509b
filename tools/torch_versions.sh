#!/usr/bin/env bash
# Core tests on other torch versions (`make test-torch-versions`; not in CI: each venv is a CUDA
# build of several GB, run on the CPU).
#
# Usage: tools/torch_versions.sh [VERSION[:PYTHON] ...]   (--list: the default versions and tests)
#   Default: the oldest torch that pyproject.toml claims on the oldest Python it claims, 2.11.0
#   (the lent GPU machine's torch) on Python 3.12 (its Python), and the newest claimed on python3.
#   An interpreter that is not on PATH is replaced by python3; the summary names the one used.
# Environment:
#   TORCH_VENV_PREFIX   each version's venv is "${TORCH_VENV_PREFIX}VERSION" (default: .venv-torch-
#                       in the repository, ignored by git). A missing venv is created (torch,
#                       numpy, pytest, isal from the registry); an existing one is used as it is,
#                       and must hold that torch version.
#   TORCH_VERSIONS_OUT  folder for the summary and the logs (default: bench-out).
# The tests import solosave from this tree's src/ (PYTHONPATH), so one venv serves every checkout.
# Writes a summary line per version to $TORCH_VERSIONS_OUT/torch-versions.txt (replacing that
# version's earlier line) and the full pytest output to $TORCH_VERSIONS_OUT/torch-VERSION.log;
# exit status 1 if any version failed.
set -uo pipefail
cd "$(dirname "$0")/.."
DEFAULT_VERSIONS=(2.8.0:python3.10 2.11.0:python3.12 2.14.1:python3)
# The core subset: every unit test, and the multi-process tests of saving, reuse, loading and the
# structure check.
CORE=(tests/unit/ tests/multiproc/test_checkpointer.py tests/multiproc/test_reuse.py
      tests/multiproc/test_load.py tests/multiproc/test_structure.py)
if [ "${1:-}" = "--list" ]; then  # the defaults, for tests/unit/test_torch_versions.py
  printf 'version %s\n' "${DEFAULT_VERSIONS[@]}"; printf 'test %s\n' "${CORE[@]}"; exit 0
fi
SPECS=("$@")
[ ${#SPECS[@]} -eq 0 ] && SPECS=("${DEFAULT_VERSIONS[@]}")
prefix="${TORCH_VENV_PREFIX:-.venv-torch-}"
outdir="${TORCH_VERSIONS_OUT:-bench-out}"
mkdir -p "$outdir"
out="$outdir/torch-versions.txt"
touch "$out"
for spec in "${SPECS[@]}"; do sed -i "/^torch ${spec%%:*}: /d" "$out"; done
status=0
for spec in "${SPECS[@]}"; do
  v="${spec%%:*}"
  py="python3"
  [ "$spec" != "$v" ] && command -v "${spec#*:}" > /dev/null && py="${spec#*:}"
  venv="$prefix$v"
  log="$outdir/torch-$v.log"
  t0=$(date +%s)
  if [ ! -x "$venv/bin/python" ]; then
    "$py" -m venv "$venv" &&
      "$venv/bin/pip" install -q "torch==$v" "numpy<3" pytest==8.3.3 pytest-timeout==2.3.1 isal==1.9.1 ||
      { echo "torch $v: install FAILED (into $venv with $py)" | tee -a "$out"; status=1; continue; }
  fi
  have=$("$venv/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none)
  have="${have%%+*}"  # without the local part (+cpu, +cu130)
  if [ "$have" != "$v" ]; then
    echo "torch $v: $venv holds torch '$have', not $v: remove it or point TORCH_VENV_PREFIX elsewhere" | tee -a "$out"
    status=1
    continue
  fi
  pyv=$("$venv/bin/python" -c 'import platform; print(platform.python_version())')
  t1=$(date +%s)
  PYTHONPATH="$PWD/src:$PWD" "$venv/bin/python" -m pytest -q -rf -p no:cacheprovider "${CORE[@]}" > "$log" 2>&1
  rc=$?
  res="$(tail -1 "$log")$(grep '^FAILED' "$log" | sed 's/^/; /' | tr -d '\n')"
  t2=$(date +%s)
  line="torch $v: $res (Python $pyv, install $((t1 - t0)) s, tests $((t2 - t1)) s; $(date -u +%F))"
  echo "$line" | tee -a "$out"
  [ "$rc" -eq 0 ] || status=1
done
exit $status
