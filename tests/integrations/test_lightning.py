"""solosave.lightning with the real lightning package, on 2 gloo ranks (CPU): ModelCheckpoint
every 2 steps with top-k; the first save creates the prepared metadata and every later save (in
this job and the next) reuses it with one 8-byte all_reduce, with no collective in
``trainer.save_checkpoint``; ``fit(ckpt_path=...)`` resumes bit for bit; Lightning's own strategy
loads solosave's checkpoint, and solosave's loads it at another world size; a checkpoint removed
while its save is in flight, a worker killed mid-save, and a directory without ``meta.pt`` never
taken as finished. Rank functions: ``lightning_fns.py``."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("lightning", reason="lightning not installed: pip install 'solosave[lightning]'")

from lightning.fabric.strategies.fsdp import _is_sharded_checkpoint  # noqa: E402

import solosave  # noqa: E402
import solosave.lightning  # noqa: E402
from tests.integrations import lightning_fns as lf  # noqa: E402
from tests.support import assert_equal, run_ranks, run_ranks_tolerant  # noqa: E402

WORLD = 2
REUSE = {"all_reduce": {"count": 1, "bytes": 8}}


def snaps(root, kind, phase, key, world=WORLD):
    return [torch.load(f"{root}/{kind}-{phase}-{r}.pt", weights_only=True)[key] for r in range(world)]


def check_saves(results, steps, first_mode):
    """Per rank: the steps saved, the first save's mode, then reuse saves of one 8-byte
    all_reduce; nothing in the calling thread and no collective in trainer.save_checkpoint."""
    for r in results:
        assert [s for s, *_ in r["saves"]] == steps and r["checkpointer_closed"]
        (_, mode0, _, calling0), *rest = r["saves"]
        assert mode0 == first_mode and calling0 == {}
        for step, mode, coll, calling in rest:
            assert (mode, coll, calling) == ("reuse", REUSE, {}), (step, mode, coll)


def meta(path):
    return torch.load(os.path.join(path, "meta.pt"), weights_only=False)


@pytest.mark.timeout(900)
def test_model_parallel_saves_async_resumes_bit_exactly_and_stock_lightning_loads_it(tmp_path):
    root = str(tmp_path)
    ck = tmp_path / "ck"
    first = run_ranks(lf.fit_job, WORLD, root, "mp", "first", timeout=300)
    check_saves(first, [2, 4, 6, 8], "create")
    assert all(r["in_save"] == [{}] * 4 for r in first)  # no collective in the training thread's save
    assert sorted(os.listdir(ck)) == ["prepared-w2-n1.metadata", "step=6.ckpt", "step=8.ckpt"]  # top 2
    for name in ("step=6.ckpt", "step=8.ckpt"):
        assert (ck / name / ".metadata").is_file() and _is_sharded_checkpoint(ck / name)
    # trainer.save_checkpoint after fit: published (meta.pt included) when it returns, workers stopped
    assert all(r["final"] == (True, True, "create") for r in first)

    resumed = run_ranks(lf.fit_job, WORLD, root, "mp", "resume", timeout=300)
    check_saves(resumed, [8], "reuse")  # a later job's first save reuses the prepared file
    for a, b in zip(snaps(root, "mp", "first", 8), snaps(root, "mp", "resume", 8)):
        assert_equal(a, b)  # model, optimizer, LR schedule and step after resuming from step 6
    # the resumed job's step-8 checkpoint (a new version of the name) holds the same loop state
    assert meta(ck / "step=8-v1.ckpt")["loops"] == meta(ck / "step=8.ckpt")["loops"]

    run_ranks(lf.fit_job, WORLD, root, "mp", "stock", timeout=300)  # Lightning's own strategy
    for a, b in zip(snaps(root, "mp", "first", 8), snaps(root, "mp", "stock", "restored")):
        assert_equal(a, b)

    run_ranks(lf.fit_job, 1, root, "mp", "reshard", timeout=300)  # solosave's, on one rank
    (whole,) = snaps(root, "mp", "reshard", "restored", world=1)
    shards = snaps(root, "mp", "first", 8)
    for k, v in whole["model"].items():
        assert torch.equal(v, torch.cat([s["model"][k] for s in shards])), k  # FSDP2 shards on dim 0
    for i, state in whole["optim"].items():
        assert torch.equal(state["exp_avg"], torch.cat([s["optim"][i]["exp_avg"] for s in shards]))
        assert torch.equal(state["step"], shards[0]["optim"][i]["step"])
    assert (whole["step"], whole["lr"]) == (8, shards[0]["lr"])


@pytest.mark.timeout(600)
def test_fsdp_strategy_saves_async_and_resumes_bit_exactly(tmp_path):
    root = str(tmp_path)
    first = run_ranks(lf.fit_job, WORLD, root, "fsdp", "first", timeout=300)
    check_saves(first, [2, 4, 6, 8], "create")
    # FSDP1's own optimizer state dict gathers; the strategy adds no broadcast and no barrier
    assert all(not {"barrier", "broadcast_object_list"} & set(c) for r in first for c in r["in_save"])
    resumed = run_ranks(lf.fit_job, WORLD, root, "fsdp", "resume", timeout=300)
    check_saves(resumed, [8], "reuse")
    for a, b in zip(snaps(root, "fsdp", "first", 8), snaps(root, "fsdp", "resume", 8)):
        assert_equal(a, b)


@pytest.mark.timeout(600)
def test_removed_in_flight_and_killed_worker_are_never_taken_as_finished(tmp_path):
    root = str(tmp_path)
    victim = 1
    res = run_ranks(lf.faults_job, WORLD, root, victim, timeout=400)
    for rank, r in enumerate(res):
        # meta.pt never exists right after save_checkpoint returns: only after publication
        assert not any(r[f"c{s}_finished_after_save"] for s in (2, 4, 6))
        kind, message, step = r["error"]  # step 6's failure, raised on every rank at the next save
        assert step == 8 and kind == ("WorkerDiedError" if rank == victim else "CheckpointError"), r["error"]
        assert rank == victim or "save to " + os.path.join(root, ".c6.solosave-3") in message  # written beside c6
        assert r["finished"] == {"c2": True, "c4": False, "c6": False} and r["checkpointer_closed"]
    assert res[0]["c4_exists_after_remove"] is False  # removed (by rank 0) once its save finished
    assert sorted(os.listdir(tmp_path / "c2")) == [".metadata", ".solosave-index", "__0_0.distcp",
                                                   "__1_0.distcp", "meta.pt"]
    assert not os.path.exists(tmp_path / "c4")
    assert not os.path.exists(tmp_path / "c6")  # written beside it, never published: never put in place
    assert [n for n in os.listdir(tmp_path) if ".solosave-" in n] == []  # rank 0 removed the failed one
    assert "no checkpoint there" in res[0]["load_c6"]


@pytest.mark.timeout(600)
def test_a_job_killed_while_saving_into_last_ckpt_keeps_the_previous_one(tmp_path, case_log):
    """Was data loss: the save into last.ckpt removed its meta.pt and .metadata first, so a
    SIGKILL meanwhile left no checkpoint and fit(ckpt_path=last.ckpt) was refused."""
    root = str(tmp_path)
    t0 = time.monotonic()
    killed = run_ranks_tolerant(lf.last_ckpt_job, WORLD, root, "kill", timeout=300)
    assert all(kind == "died" for kind, _ in killed.values()), killed
    # step 2's checkpoint is whole: in place, or (the job killed after it was published but before
    # rank 0 put it in place: a loaded machine) beside it, which the next start puts in place
    held = tmp_path / "last.ckpt" if (tmp_path / "last.ckpt").exists() else tmp_path / ".last.ckpt.solosave-1"
    assert sorted(os.listdir(held)) == [".metadata", ".solosave-index", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    for r in run_ranks(lf.last_ckpt_job, WORLD, root, "resume", timeout=300):
        assert r["step"] == 6 and r["left_beside"] == []  # the partial save beside it was removed at start
        assert 2 not in r["resumed_at"]  # resumed after step 2: its step was not trained again
    case_log("Lightning save_last=True, save_top_k=0: the whole job SIGKILLed during the save into last.ckpt",
             "last.ckpt still holds the previous finished checkpoint; fit(ckpt_path=last.ckpt) resumes from it",
             time.monotonic() - t0)


# -- in one process ---------------------------------------------------------------------------

def test_bad_arguments_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="state_dict_type='full'; drop it"):
        solosave.lightning.FSDPStrategy(state_dict_type="full")
    with pytest.raises(ValueError, match="save_distributed_checkpoint=False.*Lightning's own"):
        solosave.lightning.ModelParallelStrategy(save_distributed_checkpoint=False)
    with pytest.raises(TypeError, match="options must be a solosave.CheckpointerOptions, got dict"):
        solosave.lightning.ModelParallelStrategy(options={"workers": 2})
    with pytest.raises(ValueError, match="do not take peer copies.*use durable_root alone"):  # every save refused
        solosave.lightning.FSDPStrategy(options=solosave.CheckpointerOptions(durable_root=str(tmp_path),
                                                                             peer_copies=1, ranks_per_host=1))
    s = solosave.lightning.ModelParallelStrategy(options=solosave.CheckpointerOptions(workers=2))
    with pytest.raises(TypeError, match=r"CheckpointerOptions\(storage_options=...\)"):
        s.save_checkpoint({}, str(tmp_path / "c"), storage_options={"anon": True})
    with pytest.raises(ValueError, match="local \\(or mounted\\) paths only"):
        s.save_checkpoint({}, "s3://bucket/c")
    (tmp_path / "partial").mkdir()
    with pytest.raises(ValueError, match="is not a finished checkpoint: it holds no meta.pt"):
        s.load_checkpoint(tmp_path / "partial")


def test_recovery_puts_only_a_newer_finished_save_in_place(tmp_path):
    from solosave._src.storage.local import exchange_paths
    from solosave.lightning import _recover_beside

    final, side = tmp_path / "last.ckpt", tmp_path / ".last.ckpt.solosave-3"

    def finished(d, tag):
        d.mkdir()
        (d / ".metadata").write_bytes(tag)
        time.sleep(0.02)
        (d / "meta.pt").write_bytes(tag)

    finished(final, b"old")
    finished(side, b"new")
    assert exchange_paths(side, final)  # a job killed right after the exchange: the side name holds the old one
    _recover_beside(tmp_path)
    assert (final / "meta.pt").read_bytes() == b"new" and not side.exists()
    finished(side, b"newer")  # killed after publication, before the exchange: put in place
    _recover_beside(tmp_path)
    assert (final / "meta.pt").read_bytes() == b"newer" and not side.exists()
    side.mkdir()
    (side / ".metadata").write_bytes(b"partial")  # no meta.pt: never finished, removed
    _recover_beside(tmp_path)
    assert not side.exists() and (final / "meta.pt").read_bytes() == b"newer"


def test_removal_takes_meta_first_and_a_link_as_a_link(tmp_path):
    from solosave.lightning import _remove

    ckpt = tmp_path / "step=2.ckpt"
    ckpt.mkdir()
    for name in ("meta.pt", ".metadata", "__0_0.distcp"):
        (ckpt / name).write_bytes(b"x")
    link = tmp_path / "last.ckpt"
    link.symlink_to(ckpt.name)
    _remove(link)
    assert not link.exists() and sorted(os.listdir(ckpt)) == [".metadata", "__0_0.distcp", "meta.pt"]
    _remove(ckpt)
    assert not ckpt.exists()
    _remove(ckpt)  # gone already: nothing to do


def test_importing_solosave_does_not_import_lightning():
    code = "import sys, solosave, solosave.integrations; assert 'lightning' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def test_missing_lightning_names_the_extra(monkeypatch):
    for name in [n for n in sys.modules if n == "lightning" or n.startswith("lightning.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lightning", None)  # import lightning now fails
    monkeypatch.delitem(sys.modules, "solosave.lightning")
    with pytest.raises(ImportError, match=r"pip install 'solosave\[lightning\]'"):
        importlib.import_module("solosave.lightning")
