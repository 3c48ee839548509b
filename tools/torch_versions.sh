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
#   TORCH_ROUNDTRIP_BASE  the interpreter of the other side of the round trips (default: the main
#                       .venv/bin/python); empty: no round trips.
# The tests import solosave from this tree's src/ (PYTHONPATH), so one venv serves every checkout.
# After a version's core tests, two round trips (tools/torch_roundtrip.py): checkpoints written by
# the base interpreter's torch and read by this version, then written by this version and read by
# the base; each is loaded with solosave.load and stock DCP, compared bit for bit and verified.
# Writes a summary line per version and one per round trip to $TORCH_VERSIONS_OUT/torch-versions.txt
# (replacing that version's earlier lines), the full pytest output to
# $TORCH_VERSIONS_OUT/torch-VERSION.log and the round trips' to torch-VERSION-roundtrip.log;
# exit status 1 if any version or round trip failed.
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
for spec in "${SPECS[@]}"; do
  v="${spec%%:*}"; sed -i "/^torch ${v}: /d; /^torch [^ ]* -> ${v}: /d; /^torch ${v} -> /d" "$out"
done
base="${TORCH_ROUNDTRIP_BASE-.venv/bin/python}"
status=0
# roundtrip WRITER_PYTHON WRITER_VERSION READER_PYTHON READER_VERSION LOG: one summary line
roundtrip() {
  local dir rc res t0 t1 t2 fails
  dir=$(mktemp -d "${TMPDIR:-/tmp}/torch-roundtrip.XXXXXX")
  t0=$(date +%s)
  echo "== torch $2 writes ($1)" >> "$5"
  PYTHONPATH="$PWD/src" timeout 900 "$1" tools/torch_roundtrip.py write "$dir/ckpt" >> "$5" 2>&1
  rc=$?
  t1=$(date +%s)
  if [ "$rc" -ne 0 ]; then
    res="write FAILED (exit $rc)"
  else
    echo "== torch $4 reads ($3)" >> "$5"
    PYTHONPATH="$PWD/src" timeout 900 "$3" tools/torch_roundtrip.py read "$dir/ckpt" > "$dir/read.txt" 2>&1
    rc=$?
    cat "$dir/read.txt" >> "$5"
    fails=$(grep -E ': FAIL' "$dir/read.txt" | grep -v '^read torch' | sed 's/ (written by.*//' | paste -sd, - | sed 's/,/, /g')
    if [ "$rc" -eq 0 ]; then res="PASS ($(grep ': PASS' "$dir/read.txt" | grep -vc '^read torch') checks)"
    else res="FAIL (exit $rc)${fails:+: $fails}"; fi
  fi
  t2=$(date +%s)
  rm -rf "$dir"
  echo "torch $2 -> $4: $res (write $((t1 - t0)) s, read $((t2 - t1)) s; $(date -u +%F))" | tee -a "$out"
  return "$rc"
}
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
  [ -n "$base" ] || continue
  rtlog="$outdir/torch-$v-roundtrip.log"
  : > "$rtlog"
  basev=$("$base" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none)
  basev="${basev%%+*}"
  if [ "$basev" = none ]; then
    echo "torch ? -> $v: FAILED: no torch in '$base' (TORCH_ROUNDTRIP_BASE)" | tee -a "$out"; status=1; continue
  fi
  roundtrip "$base" "$basev" "$venv/bin/python" "$v" "$rtlog" || status=1
  roundtrip "$venv/bin/python" "$v" "$base" "$basev" "$rtlog" || status=1
done
exit $status
