"""``tools/torch_versions.sh`` (``make test-torch-versions``): its defaults match the torch range
that ``pyproject.toml`` claims, its test list names files that exist, and it writes one summary
line per version, and one per round trip with ``TORCH_ROUNDTRIP_BASE``, from a venv found under
``TORCH_VENV_PREFIX`` (stub interpreters here: the real venvs are CUDA builds of several GB)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "torch_versions.sh"

def _listed() -> tuple[list[str], list[str]]:
    out = subprocess.run(["bash", str(SCRIPT), "--list"], capture_output=True, text=True, timeout=30, check=True)
    rows = [line.split(" ", 1) for line in out.stdout.splitlines()]
    return [v for k, v in rows if k == "version"], [v for k, v in rows if k == "test"]


def _claimed_range() -> tuple[tuple[int, ...], tuple[int, ...]]:
    # a regular expression, not tomllib: the tests also run on Python 3.10
    (spec,) = re.findall(r'"(torch\s*[<>=][^"]*)"', (ROOT / "pyproject.toml").read_text())
    m = re.fullmatch(r"torch\s*>=\s*([\d.]+)\s*,\s*<\s*([\d.]+)", spec)
    assert m, f"pyproject's torch requirement {spec!r} is not of the form 'torch>=A,<B'"
    return tuple(map(int, m[1].split("."))), tuple(map(int, m[2].split(".")))


def test_default_versions_are_the_oldest_claimed_the_gpu_machines_and_the_newest():
    versions, _ = _listed()
    releases = sorted(tuple(map(int, spec.split(":")[0].split("."))) for spec in versions)
    floor, cap = _claimed_range()
    assert releases[0][:2] == floor[:2], f"oldest tested {releases[0]} is not the claimed floor {floor}"
    assert releases[-1] < cap and releases[-1][:2] == (cap[0], cap[1] - 1), (releases[-1], cap)
    assert (2, 11, 0) in releases  # the torch of the GPU machine lent to this project


def test_core_tests_exist():
    _, tests = _listed()
    assert "tests/unit/" in tests
    missing = [t for t in tests if not (ROOT / t).exists()]
    assert not missing, f"tools/torch_versions.sh lists tests that do not exist: {missing}"


_STUB = """#!/bin/bash
case "$*" in
  *torch.__version__*) echo "{torch}";;
  *python_version*) echo "3.99.1";;
  *"-m pytest"*) echo "PYTHONPATH=$PYTHONPATH ARGS=$*" > "{calls}"
                 echo "FAILED tests/unit/test_layering.py::t - boom"; echo "1 failed, 2 passed in 0.01s"; exit 1;;
  *"torch_roundtrip.py write "*) echo "PYTHONPATH=$PYTHONPATH ARGS=$*" >> "{calls}.rt"; echo "write: PASS";;
  *"torch_roundtrip.py read "*) echo "PYTHONPATH=$PYTHONPATH ARGS=$*" >> "{calls}.rt"; {read};;
  *) exit 3;;
esac
"""


_READ_PASS = 'echo "dropin dcp.load (written by torch x, read by y): PASS"; echo "read torch y: PASS"'
_READ_FAIL = ('echo "dropin dcp.load (written by torch x, read by y): PASS"; echo "reuse verify (written by '
              'torch x, read by y): FAIL (checksums failed)"; echo "read torch y: FAIL"; exit 1')


def _stub_venv(prefix: Path, version: str, torch_version: str, read: str = _READ_PASS) -> Path:
    calls = prefix.parent / f"calls-{version}.txt"
    python = Path(f"{prefix}{version}") / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(_STUB.replace("{torch}", torch_version).replace("{calls}", str(calls)).replace("{read}", read))
    python.chmod(0o755)
    return calls


def _run(tmp_path: Path, *versions: str, base: str | None = None) -> subprocess.CompletedProcess:
    if base is None:  # the other side of the round trips: a stub holding torch 8.8.8 whose reads fail
        _stub_venv(tmp_path / "venvs" / "base-", "8.8.8", "8.8.8+cpu", read=_READ_FAIL)
        base = str(tmp_path / "venvs" / "base-8.8.8" / "bin" / "python")
    env = {**os.environ, "TORCH_VENV_PREFIX": str(tmp_path / "venvs" / "t-"),
           "TORCH_VERSIONS_OUT": str(tmp_path / "out"), "TORCH_ROUNDTRIP_BASE": base}
    return subprocess.run(["bash", str(SCRIPT), *versions], capture_output=True, text=True, timeout=60, env=env)


def test_one_summary_line_per_version_from_the_configured_venvs(tmp_path):
    calls = _stub_venv(tmp_path / "venvs" / "t-", "9.9.9", "9.9.9+cu999")
    _stub_venv(tmp_path / "venvs" / "t-", "9.9.8", "9.9.7")  # a venv holding another torch
    for i in range(2):  # a second run replaces the first run's lines
        if i:
            shutil.rmtree(tmp_path / "venvs" / "base-8.8.8")
            (tmp_path / "venvs" / "calls-8.8.8.txt.rt").unlink()
        r = _run(tmp_path, "9.9.9:no-such-python", "9.9.8")
        assert r.returncode == 1, r.stdout + r.stderr
    lines = (tmp_path / "out" / "torch-versions.txt").read_text().splitlines()
    assert len(lines) == 4, lines
    assert re.fullmatch(r"torch 9\.9\.9: 1 failed, 2 passed in 0\.01s; FAILED tests/unit/test_layering\.py::t - boom "
                        r"\(Python 3\.99\.1, install \d+ s, tests \d+ s; \d{4}-\d\d-\d\d\)", lines[0]), lines[0]
    # the round trips: the base writes and 9.9.9 reads, then 9.9.9 writes and the base reads
    assert re.fullmatch(r"torch 8\.8\.8 -> 9\.9\.9: PASS \(1 checks\) \(write \d+ s, read \d+ s; \d{4}-\d\d-\d\d\)",
                        lines[1]), lines[1]
    assert re.fullmatch(r"torch 9\.9\.9 -> 8\.8\.8: FAIL \(exit 1\): reuse verify \(write \d+ s, read \d+ s; "
                        r"\d{4}-\d\d-\d\d\)", lines[2]), lines[2]
    assert "torch 9.9.8: " in lines[3] and "holds torch '9.9.7', not 9.9.8" in lines[3], lines[3]
    base_calls = (tmp_path / "venvs" / "calls-8.8.8.txt.rt").read_text().splitlines()
    own_calls = Path(f"{calls}.rt").read_text().splitlines()
    assert [c.split(" ")[2] for c in base_calls] == ["write", "read"], base_calls
    assert [c.split(" ")[2] for c in own_calls] == ["read", "write"] * 2, own_calls
    assert base_calls[0].split(" ")[-1] == own_calls[-2].split(" ")[-1]  # 9.9.9 reads what the base wrote
    assert all(c.startswith(f"PYTHONPATH={ROOT}/src ARGS=tools/torch_roundtrip.py ") for c in base_calls + own_calls)
    assert "reuse verify (written by torch x, read by y): FAIL" in (tmp_path / "out" / "torch-9.9.9-roundtrip.log").read_text()
    call = calls.read_text()
    assert f"PYTHONPATH={ROOT}/src:{ROOT} " in call  # this checkout's source, not an installed copy
    _, tests = _listed()
    assert call.rstrip().endswith(" ".join(tests)), call
    assert (tmp_path / "out" / "torch-9.9.9.log").read_text().startswith("FAILED")


def test_no_round_trips_without_a_base(tmp_path):
    _stub_venv(tmp_path / "venvs" / "t-", "9.9.9", "9.9.9")
    r = _run(tmp_path, "9.9.9", base="")
    assert r.returncode == 1, r.stdout + r.stderr  # the stub's core tests fail
    lines = (tmp_path / "out" / "torch-versions.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in lines] == ["torch 9.9.9"], lines
