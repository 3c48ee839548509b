import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from solosave.cli import main


@pytest.fixture()
def ckpt(tmp_path):
    d = tmp_path / "ck"
    dcp.save({"w": torch.ones(3, 2), "step": 4}, checkpoint_id=str(d), no_dist=True)
    return d


def test_inspect_text_and_json(ckpt, capsys):
    assert main(["inspect", str(ckpt)]) == 0
    assert "w" in capsys.readouterr().out
    assert main(["inspect", str(ckpt), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert {i["key"] for i in rep["items"]} == {"w", "step"}
    assert list(rep["files"]) == ["__0_0.distcp"]


def test_prepare_then_inspect(ckpt, tmp_path, capsys):
    out = tmp_path / "p.md"
    assert main(["prepare", "--from", str(ckpt), "--out", str(out), "--world-size", "1", "--workers", "1"]) == 0
    assert main(["inspect", str(out), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert rep["fingerprint"]["world_size"] == 1


@pytest.mark.parametrize("make, needle", [
    (lambda p: p / "missing", "no such file"),
    (lambda p: p, "no .metadata"),
    (lambda p: (p / "corrupt").write_bytes(b"\x80\x04garbage") and p / "corrupt", "truncated or corrupt"),
])
def test_bad_input_clear_message_no_traceback(tmp_path, capsys, make, needle):
    assert main(["inspect", str(make(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_python_m_solosave_help():
    r = subprocess.run([sys.executable, "-m", "solosave", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "inspect" in r.stdout and "demo" in r.stdout


@pytest.mark.timeout(240)
def test_demo_main_job_runs(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "solosave", "demo", "--nproc", "2", "--saves", "3",
                        "--out", str(tmp_path / "demo")], capture_output=True, text=True, timeout=200, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "matches bit for bit: True" in r.stdout
    assert r.stdout.count("mode=reuse") == 2 and "all_reduce x1 (8 B)" in r.stdout
