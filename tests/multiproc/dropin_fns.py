"""Rank functions of tests/multiproc/test_dcp_dropin.py: solosave.async_save / solosave.save used
exactly as DCP's (a change of import), and their checkpoints read by stock DCP."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

import solosave
from solosave._src.testing.introspect import worker_pid
from tests.multiproc.rank_fns import model_sd
from tests.support import assert_equal, fresh, zeros_like


def as_dcp_user(rank: int, ws: int, root: str) -> dict:
    """Three async saves and a synchronous one through the default saver, then a fresh start of
    it after close(); every checkpoint loads with stock DCP."""
    fresh(root)
    out: dict = {"modes": [], "collectives": []}
    sd = model_sd(rank)
    futures = []
    for step in range(3):
        sd["meta"]["step"] = step
        fut = solosave.async_save(sd, checkpoint_id=f"{root}/step_{step}")
        md = fut.result(timeout=120)
        assert isinstance(md, Metadata) and md.storage_meta.checkpoint_id.endswith(f"step_{step}")
        futures.append(fut)
        r = solosave.default_saver.last_result()
        out["modes"].append(r.mode)
        out["collectives"].append(r.collectives("all"))
    pids = {worker_pid(solosave.default_saver.checkpointer(dist.group.WORLD))}
    md = solosave.save(sd, checkpoint_id=f"{root}/sync")
    assert isinstance(md, Metadata) and "model.w" in md.state_dict_metadata
    pids.add(worker_pid(solosave.default_saver.checkpointer()))
    out["one_worker"] = len(pids) == 1
    out["mode_sync"] = solosave.default_saver.last_result().mode
    solosave.default_saver.close()  # a reset: the next save sets up a new checkpointer
    assert solosave.default_saver.checkpointer() is None
    solosave.async_save(sd, checkpoint_id=f"{root}/after_close").result(timeout=120)
    out["mode_after_close"] = solosave.default_saver.last_result().mode
    solosave.default_saver.close()
    dist.barrier()
    got = zeros_like(model_sd(rank))
    dcp.load(got, checkpoint_id=f"{root}/step_2")
    assert_equal(got["model"], sd["model"])
    assert got["meta"]["step"] == 2
    return out


def overlapped_response(rank: int, ws: int, root: str) -> list:
    """With overlap_staging, DCP's AsyncSaveResponse: staging completes, then the upload."""
    fresh(root)
    with solosave.DcpSaver(overlap_staging=True) as saver:
        resp = saver.async_save(model_sd(rank), checkpoint_id=f"{root}/c")
        assert type(resp).__name__ == "AsyncSaveResponse"
        assert resp.staging_completion.result(timeout=120) is None
        md = resp.upload_completion.result(timeout=120)
    return sorted(md.state_dict_metadata)[:2]


def failed_save_on_every_rank(rank: int, ws: int, root: str) -> str:
    """A value that only rank 1 cannot serialize: the future raises on every rank, nothing is
    published (the same CheckpointError as the checkpointer's)."""
    fresh(root)
    sd = model_sd(rank)
    if rank == 1:
        sd["meta"]["bad"] = lambda: None
    else:
        sd["meta"]["bad"] = 0
    with solosave.DcpSaver() as saver:
        try:
            fut = saver.async_save(sd, checkpoint_id=f"{root}/c")
        except TypeError as e:  # the failing rank raises at once, as AsyncCheckpointer.save does
            return f"raised: {e}"
        try:
            fut.result(timeout=120)
        except solosave.CheckpointError as e:
            return f"future: {type(e).__name__}"
    return "no error"


def same_id_again_and_again(rank: int, ws: int, root: str) -> dict:
    """Saves to one checkpoint_id ("latest"), sync and async: each returns its own Metadata
    without reading the checkpoint back (reading is made to fail here), the same on every rank,
    and the last one is what the directory holds."""
    import solosave._src.save.dcp_saver as dcp_saver

    def no_reading(*args, **kwargs):
        raise AssertionError("the save read its checkpoint back")

    dcp_saver.storage_for = no_reading  # the test's process only: a save must not read the path
    sd = {"model": {"w": torch.arange(8.0) + rank}, "step": 0}
    ids = []
    with solosave.DcpSaver() as saver:
        for step in range(6):
            sd["step"] = step
            if step % 2:
                md = saver.async_save(sd, checkpoint_id=f"{root}/latest").result(timeout=120)
            else:
                md = saver.save(sd, checkpoint_id=f"{root}/latest")
            assert isinstance(md, Metadata) and md.storage_meta.checkpoint_id == f"{root}/latest"
            assert "model.w" in md.state_dict_metadata
            ids.append(md.storage_meta.save_id)
    dist.barrier()
    on_disk = dcp.FileSystemReader(f"{root}/latest").read_metadata()
    return {"ids": ids, "on_disk": on_disk.storage_meta.save_id,
            "same_entries": sorted(on_disk.state_dict_metadata) == sorted(md.state_dict_metadata)}
