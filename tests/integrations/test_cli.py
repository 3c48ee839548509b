import json
import subprocess
import sys

import pytest
import torch

from solosave.cli import main
from tests.support import dcp_save_local


@pytest.fixture()
def ckpt(tmp_path):
    d = tmp_path / "ck"
    dcp_save_local({"w": torch.ones(3, 2), "step": 4}, checkpoint_id=str(d))
    return d


def test_inspect_text_and_json(ckpt, capsys):
    assert main(["inspect", str(ckpt)]) == 0
    assert "w" in capsys.readouterr().out
    assert main(["inspect", str(ckpt), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert {i["key"] for i in rep["items"]} == {"w", "step"}
    assert list(rep["files"]) == ["__0_0.distcp"]
    assert rep["bytes_per_rank"] == {"0": rep["files"]["__0_0.distcp"]}


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


def test_python_m_solosave_help_lists_every_subcommand():
    r = subprocess.run([sys.executable, "-m", "solosave", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    for cmd in ("train", "inspect", "verify", "prepare"):
        assert cmd in r.stdout


@pytest.mark.parametrize("cmd, needles", [
    (["inspect", "--help"], ["--json", "prepared-metadata file"]),
    (["verify", "--help"], ["--prepared", "--no-checksums", "--json"]),
    (["prepare", "--help"], ["--from", "--out", "--world-size", "--workers"]),
])
def test_subcommand_help_is_complete(cmd, needles, capsys):
    with pytest.raises(SystemExit) as e:
        main(cmd)
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(n in out for n in needles)


def test_train_help_lists_megatron_flags(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for flag in ("--save", "--save-interval", "--load", "--async-save", "--use-persistent-ckpt-worker",
                 "--ckpt-metadata", "--ckpt-metadata-create", "--ckpt-assume-constant-structure",
                 "--dist-ckpt-workers", "--keep-last", "--nproc", "--steps", "--seed", "--json-log"):
        assert flag in out


@pytest.mark.parametrize("make, needle", [
    (lambda p: p / "missing", "no such checkpoint directory"),
    (lambda p: p, "no .metadata"),
])
def test_verify_bad_input(tmp_path, capsys, make, needle):
    assert main(["verify", str(make(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_verify_with_corrupt_prepared_file(ckpt, tmp_path, capsys):
    bad = tmp_path / "bad.md"
    bad.write_bytes(b"SOLOSAVE-PREPARED\n1\n{not json")
    assert main(["verify", str(ckpt), "--prepared", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "truncated or corrupt" in err and "Traceback" not in err


@pytest.mark.parametrize("flags", [["--world-size", "0"], ["--workers", "-3"], ["--workers", "two"]])
def test_prepare_refuses_bad_counts(ckpt, tmp_path, capsys, flags):
    with pytest.raises(SystemExit) as e:
        main(["prepare", "--from", str(ckpt), "--out", str(tmp_path / "p.md"), *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert ">= 1" in err and "Traceback" not in err
    assert not (tmp_path / "p.md").exists()


@pytest.mark.parametrize("target", [".metadata", "__0_0.distcp", "."])
def test_prepare_never_writes_over_a_checkpoint(ckpt, capsys, target, case_log):
    """``solosave prepare --out CKPT/.metadata`` (or a data file, or the directory) and
    ``save_prepared_metadata(p, "CKPT/.metadata")`` are refused: the checkpoint stays loadable."""
    import solosave

    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    out = ckpt / target if target != "." else ckpt
    assert main(["prepare", "--from", str(ckpt), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "refusing to write a prepared-metadata file there" in err and "Traceback" not in err
    with pytest.raises(solosave.PreparedMetadataError, match="is a checkpoint's .metadata|a file of a checkpoint|"
                       "is a directory"):
        solosave.save_prepared_metadata(solosave.load_prepared_metadata(ckpt), out)
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    got = {"w": torch.zeros(3, 2), "step": 0}
    solosave.load(got, ckpt)
    assert torch.equal(got["w"], torch.ones(3, 2)) and got["step"] == 4
    name = {".metadata": "CKPT/.metadata", "__0_0.distcp": "CKPT/__0_0.distcp", ".": "CKPT"}[target]
    case_log(f"solosave prepare --out {name}, and save_prepared_metadata(p, '{name}')",
             f"exit 2 / PreparedMetadataError ('refusing to write a prepared-metadata file there: {name} "
             f"{err.split(str(out), 1)[-1].strip().split('. ')[0]}'); the checkpoint's files are byte-identical "
             "and it loads")
