#!/usr/bin/env bash
# Core tests on other torch versions (`make test-torch-versions`; not in CI: each venv is a
# CUDA build of several GB). Usage: tools/torch_versions.sh [VERSION ...] (default: the newest
# and the oldest version the package claims). Writes a summary line per version to
# bench-out/torch-versions.txt (replacing that version's earlier line) and the full pytest output
# to bench-out/torch-<version>.log; exit status 1 if any version failed.
set -uo pipefail
cd "$(dirname "$0")/.."
VERSIONS=("$@")
[ ${#VERSIONS[@]} -eq 0 ] && VERSIONS=(2.14.1 2.6.0)
CORE="tests/unit/formats/test_records.py tests/multiproc/test_structure.py tests/unit/save/test_stage.py tests/unit/plan/test_plan.py tests/unit/dist/test_protocol.py
      tests/unit/plan/test_global_plan.py tests/unit/save/test_engine.py tests/unit/save/test_write.py tests/multiproc/test_load.py tests/multiproc/test_reuse.py
      tests/multiproc/test_checkpointer.py"
mkdir -p bench-out
out=bench-out/torch-versions.txt
touch "$out"
for v in "${VERSIONS[@]}"; do sed -i "/^torch $v: /d" "$out"; done
status=0
for v in "${VERSIONS[@]}"; do
  venv=".venv-torch-$v"
  t0=$(date +%s)
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv" && "$venv/bin/pip" install -q --upgrade pip &&
      "$venv/bin/pip" install -q "torch==$v" "numpy<3" pytest==8.3.3 pytest-timeout==2.3.1 &&
      "$venv/bin/pip" install -q --no-deps -e . || { echo "torch $v: install FAILED" | tee -a "$out"; status=1; continue; }
  fi
  t1=$(date +%s)
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pytest -q -rf -p no:cacheprovider $CORE > "bench-out/torch-$v.log" 2>&1
  rc=$?
  res="$(tail -1 "bench-out/torch-$v.log")$(grep '^FAILED' "bench-out/torch-$v.log" | sed 's/^/; /' | tr -d '\n')"
  t2=$(date +%s)
  line="torch $v: $res (install $((t1 - t0)) s, tests $((t2 - t1)) s; $(date -u +%F))"
  echo "$line" | tee -a "$out"
  [ "$rc" -eq 0 ] || status=1
done
exit $status
