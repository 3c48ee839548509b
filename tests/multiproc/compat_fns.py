"""Rank functions of test_dcp_compat.py: what PyTorch's own DCP tests found when solosave stood in
for ``dcp.save`` / ``dcp.load`` (module-level: spawned processes import them)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import solosave

#: DTensor placements on a 2x2 mesh, by short name (S0: Shard(0), R: Replicate()).
PLACEMENTS = ("RR", "S0S1", "S0R", "RS0")


def full_at(step: int) -> torch.Tensor:
    """The 8x8 tensor every rank saves at ``step``."""
    return torch.arange(64, dtype=torch.float32).reshape(8, 8) + 1000 * step


def _placements(name: str) -> list:
    from torch.distributed.tensor import Replicate, Shard

    parts = {"R": Replicate(), "S0": Shard(0), "S1": Shard(1)}
    first = "R" if name.startswith("R") else name[:2]
    return [parts[first], parts[name[len(first):]]]


def placement_changes(rank: int, ws: int, root: str, sequence: list[str], timeout: float) -> list[tuple]:
    """One checkpointer with ``assume_constant_structure=True``; an 8x8 DTensor on a 2x2 mesh is
    saved twice with each placement of ``sequence`` in turn (a change, then the same again).
    Returns ``(directory, placement, mode or error)`` per save."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2))
    out = []
    step = 0
    with solosave.AsyncCheckpointer(assume_constant_structure=True, timeout=timeout) as ck:
        for name in sequence:
            for again in range(2 if out else 1):
                path = f"{root}/s{step}_{name}"
                sd = {"w": distribute_tensor(full_at(step), mesh, _placements(name)), "step": step}
                try:
                    out.append((path, name, step, ck.save(sd, path).wait().mode))
                except solosave.CheckpointError as e:
                    out.append((path, name, step, f"error: {str(e).splitlines()[0]}"))
                step += 1
    return out


def sharded_tensor(fill: float, holders: int):
    """A 6x4 ShardedTensor split by rows over ranks ``0..holders-1`` (ranks beyond hold no shard);
    its element at (i, j) is ``4 * i + j + fill``."""
    from torch.distributed._shard import sharded_tensor as st
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(holders)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates ShardedTensor, DCP saves it
        t = st.zeros(spec, 6, 4)
        for shard in t.local_shards():
            row, n = shard.metadata.shard_offsets[0], shard.tensor.shape[0]
            shard.tensor.copy_(torch.arange(4 * row, 4 * (row + n), dtype=torch.float32).reshape(n, 4) + fill)
    return t


def _shards(t) -> list[list]:
    return [s.tensor.tolist() for s in t.local_shards()]


def sharded_tensors(rank: int, ws: int, root: str, timeout: float) -> dict:
    """A ShardedTensor (held by ranks 0 and 1 only) saved by a create save and a reuse save, then
    loaded back into ShardedTensors of the same sharding by stock ``dcp.load`` and by
    ``solosave.load``; last, a save over the published checkpoint, caught as DCP code catches."""
    out: dict = {"modes": []}
    with solosave.AsyncCheckpointer(prepared_metadata=f"{root}/p.md", create_prepared_metadata=True,
                                    timeout=timeout) as ck:
        for step in range(2):
            sd = {"st": sharded_tensor(100.0 * step, 2), "w": torch.full((3,), float(step)), "step": step}
            out["modes"].append(ck.save(sd, f"{root}/c{step}").wait().mode)
        out["expected"] = _shards(sharded_tensor(100.0, 2))
        try:
            ck.save(sd, f"{root}/c1")
        except CheckpointException as e:  # what code written for dcp.save catches
            out["exists"] = (type(e).__name__, isinstance(e, Exception), str(e))
    for name, load in (("dcp", lambda t: dcp.load(t, checkpoint_id=f"{root}/c1")),
                       ("solosave", lambda t: solosave.load(t, f"{root}/c1"))):
        target = {"st": sharded_tensor(-1.0, 2), "w": torch.zeros(3), "step": -1}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            load(target)
        out[name] = (_shards(target["st"]), target["w"].tolist(), target["step"])
    return out
