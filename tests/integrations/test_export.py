"""solosave.export / `solosave export`: full, unsharded tensors out of a DCP checkpoint, as
safetensors (sharded with an index above a size limit) or one torch.save file."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import solosave
from solosave._src.tools import export as _export
from solosave.cli import main
from tests.support import dcp_save_local, run_ranks

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]
safetensors_torch = pytest.importorskip("safetensors.torch")


def _state():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 8, generator=g)
    w[0, :4] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")])  # bits, not values
    return {
        "model": {"w": w, "emb": torch.randn(32, 4, generator=g).to(torch.bfloat16),
                  "half": torch.randn(5, generator=g).half(), "scalar": torch.tensor(3.5)},
        "ids": torch.arange(-6, 6, dtype=torch.int64), "small": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "mask": torch.tensor([True, False, True]),
        "step": 7, "name": "run-a", "sched": [1, 2, 3],
    }


TENSORS = {"model.w", "model.emb", "model.half", "model.scalar", "ids", "small", "mask"}


def _flat(sd, prefix=""):
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


@pytest.fixture()
def ckpt(tmp_path):
    d = tmp_path / "ck"
    dcp_save_local(_state(), checkpoint_id=str(d))
    return d


def _saved_keys(ckpt):
    from solosave._src.load.load import parse_metadata, read_metadata_bytes

    return set(parse_metadata(read_metadata_bytes(ckpt), ckpt).state_dict_metadata)


def test_safetensors_round_trip_is_bit_exact_and_reports_non_tensors(ckpt, tmp_path):
    rep = solosave.export(ckpt, tmp_path / "out")
    assert rep.files == ("model.safetensors",) and rep.index is None and rep.format == "safetensors"
    assert sorted(os.listdir(tmp_path / "out")) == ["model.safetensors"]
    got = safetensors_torch.load_file(tmp_path / "out" / "model.safetensors")
    want = _flat(_state())
    assert set(got) == TENSORS
    for k in TENSORS:
        assert _same_bits(got[k], want[k]), k
    assert got["model.emb"].dtype == torch.bfloat16 and got["small"].dtype == torch.int8
    assert got["model.scalar"].shape == torch.Size([])
    non_tensors = _saved_keys(ckpt) - TENSORS
    assert non_tensors and {k for k, _ in rep.skipped} == non_tensors  # step, name, sched
    assert all("non-tensor" in r for _, r in rep.skipped)
    assert rep.tensors == len(TENSORS) and rep.values == 0
    assert rep.total_size == sum(want[k].numel() * want[k].element_size() for k in TENSORS)
    with safetensors_torch.safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}  # what transformers checks before loading


def test_torch_format_keeps_every_value(ckpt, tmp_path):
    rep = solosave.export(ckpt, tmp_path / "out", format="torch")
    assert rep.files == ("model.pt",) and rep.skipped == ()
    got = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    want = _flat(_state())
    assert set(got) == _saved_keys(ckpt)
    for k in TENSORS:
        assert _same_bits(got[k], want[k]), k
    assert got["step"] == 7 and got["name"] == "run-a"
    assert rep.values == len(got) - len(TENSORS)


def test_sharding_and_index_match_hugging_face(tmp_path):
    sd = {"a": torch.ones(100), "b": torch.full((100,), 2.0), "c": torch.full((100,), 3.0),
          "d": torch.arange(300, dtype=torch.float32), "e": torch.ones(10, dtype=torch.int16)}
    dcp_save_local(sd, checkpoint_id=str(tmp_path / "ck"))
    rep = solosave.export(tmp_path / "ck", tmp_path / "out", max_shard_size="1KB")  # 1000 bytes
    # a+b = 800 bytes; c would take that past 1000 -> new shard; d (1200 bytes, over the limit)
    # alone; e (20 bytes) would take d's shard further past it -> a shard of its own
    names = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert list(rep.files) == names and rep.index == "model.safetensors.index.json"
    assert sorted(os.listdir(tmp_path / "out")) == sorted([*names, rep.index])
    index = json.loads((tmp_path / "out" / rep.index).read_text())
    assert index["metadata"]["total_size"] == 3 * 400 + 1200 + 20 == rep.total_size
    expect = {"a": names[0], "b": names[0], "c": names[1], "d": names[2], "e": names[3]}
    assert index["weight_map"] == expect and list(index["weight_map"]) == sorted(expect)
    for key, name in expect.items():
        shard = safetensors_torch.load_file(tmp_path / "out" / name)
        assert set(shard) == {k for k, n in expect.items() if n == name}
        assert torch.equal(shard[key], sd[key])


def test_torch_format_shards_too_when_asked(ckpt, tmp_path):
    rep = solosave.export(ckpt, tmp_path / "out", format="torch", max_shard_size=600)
    assert rep.index == "model.pt.index.json" and len(rep.files) > 1
    index = json.loads((tmp_path / "out" / rep.index).read_text())
    assert set(index["weight_map"]) == _saved_keys(ckpt)
    merged = {}
    for name in rep.files:
        merged.update(torch.load(tmp_path / "out" / name, weights_only=True))
    assert merged["step"] == 7 and _same_bits(merged["model.w"], _state()["model"]["w"])


def test_shards_are_read_and_written_one_at_a_time(ckpt, tmp_path, monkeypatch):
    events = []
    read, write = _export._read_shard, _export._write_file
    monkeypatch.setattr(_export, "_read_shard", lambda d, md, shard, *a: (
        events.append(("read", tuple(e.key for e in shard))), read(d, md, shard, *a))[1])
    monkeypatch.setattr(_export, "_write_file", lambda fmt, values, out, name: (
        events.append(("write", tuple(values))), write(fmt, values, out, name))[1])
    seen = []
    rep = solosave.export(ckpt, tmp_path / "out", max_shard_size=300, progress=lambda n, t: seen.append((n, t)))
    assert len(rep.files) >= 3
    assert [kind for kind, _ in events] == ["read", "write"] * len(rep.files)
    for (_, keys), (_, names) in zip(events[::2], events[1::2]):
        assert keys == names  # each load asks DCP for that shard's tensors only
    assert sum(n for n, _ in seen) == rep.total_size and {t for _, t in seen} == {rep.total_size}


def test_prefix_and_keys_select_and_rename(ckpt, tmp_path):
    rep = solosave.export(ckpt, tmp_path / "a", prefix="model.")
    got = safetensors_torch.load_file(tmp_path / "a" / "model.safetensors")
    assert set(got) == {"w", "emb", "half", "scalar"} and rep.skipped == ()
    rep = solosave.export(ckpt, tmp_path / "b", keys=["ids", "step"], format="torch")
    assert set(torch.load(tmp_path / "b" / "model.pt", weights_only=True)) == {"ids", "step"}
    solosave.export(ckpt, tmp_path / "c", keys=lambda k: k.endswith("w"))
    assert set(safetensors_torch.load_file(tmp_path / "c" / "model.safetensors")) == {"model.w"}
    with pytest.raises(KeyError, match="not in the checkpoint: nope"):
        solosave.export(ckpt, tmp_path / "d", keys=["ids", "nope"])
    with pytest.raises(ValueError, match="nothing to export"):
        solosave.export(ckpt, tmp_path / "d", prefix="optim.")
    assert not (tmp_path / "d").exists()


def test_unsupported_dtype_is_reported_not_dropped_silently(tmp_path):
    sd = {"z": torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex128), "w": torch.ones(2)}
    dcp_save_local(sd, checkpoint_id=str(tmp_path / "ck"))
    rep = solosave.export(tmp_path / "ck", tmp_path / "st")
    assert [k for k, _ in rep.skipped] == ["z"] and "complex128" in rep.skipped[0][1]
    solosave.export(tmp_path / "ck", tmp_path / "pt", format="torch")
    assert torch.equal(torch.load(tmp_path / "pt" / "model.pt", weights_only=True)["z"], sd["z"])


# -- a checkpoint saved by 2 ranks, each holding part of the tensors ---------------------------

def _save_sharded(rank, ws, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    full = _full_tensors()
    sd = {"model": {"rows": distribute_tensor(full["model.rows"], mesh, [Shard(0)]),
                    "cols": distribute_tensor(full["model.cols"], mesh, [Shard(1)]),
                    "rep": distribute_tensor(full["model.rep"], mesh, [Replicate()])},
          "ids": full["ids"], "step": 11}
    with solosave.AsyncCheckpointer(persistent_worker=False, timeout=60) as ck:
        ck.save(sd, f"{root}/ck").wait(60)
    return rank


def _full_tensors():
    return {"model.rows": torch.arange(24 * 5, dtype=torch.float32).reshape(24, 5),
            "model.cols": (torch.arange(4 * 10, dtype=torch.float32) / 7).reshape(4, 10).to(torch.bfloat16),
            "model.rep": torch.arange(7, dtype=torch.int32), "ids": torch.arange(9, dtype=torch.int64) * 3}


@pytest.mark.timeout(150)
def test_export_assembles_tensors_saved_in_shards_by_two_ranks(tmp_path):
    run_ranks(_save_sharded, 2, str(tmp_path), timeout=120)
    from solosave._src.load.load import parse_metadata, read_metadata_bytes

    md = parse_metadata(read_metadata_bytes(tmp_path / "ck"), tmp_path / "ck")
    assert len(md.state_dict_metadata["model.rows"].chunks) == 2  # one chunk per rank
    assert len(md.state_dict_metadata["model.cols"].chunks) == 2
    assert len({info.relative_path for info in md.storage_data.values()}) == 2  # both ranks wrote
    rep = solosave.export(tmp_path / "ck", tmp_path / "st", max_shard_size=400)
    got = {}
    for name in rep.files:
        got.update(safetensors_torch.load_file(tmp_path / "st" / name))
    full = _full_tensors()
    assert set(got) == set(full) and len(rep.files) > 1
    for k, v in full.items():
        assert _same_bits(got[k], v), k
    assert [k for k, _ in rep.skipped] == ["step"]
    solosave.export(tmp_path / "ck", tmp_path / "pt", format="torch")
    pt = torch.load(tmp_path / "pt" / "model.pt", weights_only=True)
    assert pt["step"] == 11 and all(_same_bits(pt[k], v) for k, v in full.items())


# -- refusals ------------------------------------------------------------------------------------

def test_refuses_a_non_empty_out_unless_overwrite(ckpt, tmp_path):
    out = tmp_path / "out"
    solosave.export(ckpt, out, max_shard_size=300)
    (out / "README.md").write_text("mine")
    with pytest.raises(solosave.CheckpointExistsError, match="--overwrite"):
        solosave.export(ckpt, out)
    rep = solosave.export(ckpt, out, overwrite=True)  # one file now: the old shards must go
    assert sorted(os.listdir(out)) == ["README.md", "model.safetensors"] and rep.index is None
    with pytest.raises(ValueError, match="another directory than the checkpoint"):
        solosave.export(ckpt, ckpt, overwrite=True)


def test_refuses_without_metadata_or_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(solosave.PreparedMetadataError, match=r"no \.metadata"):
        solosave.export(tmp_path / "empty", tmp_path / "out")
    with pytest.raises(FileNotFoundError):
        solosave.export(tmp_path / "missing", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_without_safetensors_says_what_to_install(ckpt, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match=r"pip install 'solosave\[export\]'"):
        solosave.export(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    solosave.export(ckpt, tmp_path / "pt", format="torch")  # the torch format needs nothing more


def test_bad_arguments(ckpt, tmp_path):
    with pytest.raises(ValueError, match="unknown export format"):
        solosave.export(ckpt, tmp_path / "o", format="gguf")
    for bad in ("5 parsecs", "0", -1, "GB"):
        with pytest.raises(ValueError):
            solosave.export(ckpt, tmp_path / "o", max_shard_size=bad)
    assert _export.parse_size("5GB") == 5 * 10**9 and _export.parse_size("2MiB") == 2 << 20
    assert _export.parse_size("1.5kb") == 1500 and _export.parse_size(123) == 123


def test_a_damaged_checkpoint_fails_and_leaves_no_files(ckpt, tmp_path):
    data = ckpt / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(solosave.CorruptCheckpointError, match="truncated"):
        solosave.export(ckpt, tmp_path / "out", max_shard_size=300)
    assert os.listdir(tmp_path / "out") == []


def test_a_failed_write_removes_the_shards_already_written(ckpt, tmp_path, monkeypatch):
    write = _export._write_file
    calls = []

    def failing(fmt, values, out, name):
        calls.append(name)
        if len(calls) == 2:
            raise OSError("disk full")
        write(fmt, values, out, name)

    monkeypatch.setattr(_export, "_write_file", failing)
    with pytest.raises(OSError, match="disk full"):
        solosave.export(ckpt, tmp_path / "out", max_shard_size=300)
    assert os.listdir(tmp_path / "out") == []


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_record_that_would_run_code_is_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    dcp_save_local({"x": Evil(str(marker)), "w": torch.ones(2)}, checkpoint_id=str(tmp_path / "ck"))
    rep = solosave.export(tmp_path / "ck", tmp_path / "st")  # safetensors never unpickles records
    assert [k for k, _ in rep.skipped] == ["x"]
    with pytest.raises(solosave.UnsafeMetadataError, match="'x'"):
        solosave.export(tmp_path / "ck", tmp_path / "pt", format="torch")
    assert not marker.exists() and os.listdir(tmp_path / "pt") == []


# -- memory: a checkpoint 8x the shard size ------------------------------------------------------

@pytest.mark.timeout(180)
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmRSS / VmHWM from /proc")
def test_peak_memory_is_about_one_shard(tmp_path):
    mib = 1 << 20
    sd = {f"layer{i}": torch.full((2 * mib,), float(i)) for i in range(12)}  # 12 x 8 MiB = 96 MiB
    dcp_save_local(sd, checkpoint_id=str(tmp_path / "ck"))
    del sd
    script = textwrap.dedent(f"""
        import solosave, torch

        def kib(field):
            return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field))

        before = kib("VmRSS:")
        rep = solosave.export({str(tmp_path / "ck")!r}, {str(tmp_path / "out")!r}, max_shard_size="8MiB")
        print(len(rep.files), (kib("VmHWM:") - before) * 1024)
    """)
    # A fixed mmap threshold: glibc's adaptive one would serve these 8 MiB buffers from the heap and
    # keep freed ones for reuse (shards of GBs are always mapped and unmapped, as here).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(mib)}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=150, env=env)
    assert r.returncode == 0, r.stderr
    files, grew = map(int, r.stdout.split())
    assert files == 12
    assert grew < 3 * 8 * mib, f"peak RSS grew by {grew / mib:.1f} MiB exporting 96 MiB in 8 MiB shards"


# -- the command line ----------------------------------------------------------------------------

def test_cli_export_prints_files_and_what_it_left_out(ckpt, tmp_path, capsys):
    assert main(["export", str(ckpt), str(tmp_path / "out"), "--max-shard-size", "300"]) == 0
    out = capsys.readouterr().out
    assert "model.safetensors.index.json" in out and "model-00001-of-" in out
    assert "value(s) not exported" in out and "- step: non-tensor value" in out
    assert main(["export", str(ckpt), str(tmp_path / "pt"), "--format", "torch", "--prefix", "model.",
                 "--json", "--no-progress"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["files"] == ["model.pt"] and rep["tensors"] == 4 and rep["skipped"] == []
    assert set(torch.load(tmp_path / "pt" / "model.pt", weights_only=True)) == {"w", "emb", "half", "scalar"}


def test_cli_progress_bar_when_asked(ckpt, tmp_path, capsys):
    assert main(["export", str(ckpt), str(tmp_path / "out"), "--progress"]) == 0
    assert "export [" in capsys.readouterr().err


@pytest.mark.parametrize("make_args, needle", [
    (lambda p, ck: [str(ck), str(p / "out"), "--prefix", "zzz"], "nothing to export"),
    (lambda p, ck: [str(p / "missing"), str(p / "out")], "does not exist"),
    (lambda p, ck: [str(p), str(p / "out")], "no .metadata"),
    (lambda p, ck: [str(ck), str(ck.parent)], "not empty"),
])
def test_cli_errors_are_one_line(ckpt, tmp_path, capsys, make_args, needle):
    assert main(["export", *make_args(tmp_path, ckpt)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("solosave export: error:") and needle in err and "Traceback" not in err


def test_cli_without_safetensors(ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    assert main(["export", str(ckpt), str(tmp_path / "out")]) == 2
    assert "pip install 'solosave[export]'" in capsys.readouterr().err


def test_cli_rejects_a_bad_size_and_documents_its_flags(ckpt, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["export", str(ckpt), str(tmp_path / "out"), "--max-shard-size", "lots"])
    assert e.value.code == 2 and "cannot read the size" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["export", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--format", "--max-shard-size", "--overwrite", "--progress", "--prefix", "--json"):
        assert flag in out
