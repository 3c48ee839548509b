"""Rank functions of the load tests (module-level: spawned processes import them).

The resharding state: DTensors over a 1-d mesh whose chunk boundaries at W=2 and W=3 do not
align, two of them sharded along another dimension at load than at save (inner-dimension
reads), one large enough for the direct read path, plus a replicated plain tensor and a value.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import solosave
from solosave._src.core.errors import IndexUnusable

SHAPES = {"a": ((10, 6), torch.float32), "b": ((4, 7), torch.bfloat16), "c": ((600, 256), torch.float32),
          "d": ((600, 256), torch.float32), "i": ((9, 5), torch.int8)}
#: The dimension each tensor is sharded along when saved, and when loaded.
SAVE_DIM = {"a": 0, "b": 1, "c": 0, "d": 0, "i": 0}
LOAD_DIM = {"a": 0, "b": 1, "c": 1, "d": 0, "i": 1}


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    out = {}
    for k, (shape, dt) in SHAPES.items():
        out[k] = (torch.randn(shape, generator=g).to(dt) if dt.is_floating_point
                  else torch.randint(-100, 100, shape, generator=g).to(dt))
    out["p"] = torch.arange(1000, dtype=torch.int64)
    return out


def _state(ws: int, dims: dict[str, int], values: dict[str, torch.Tensor], step: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    sd = {k: distribute_tensor(values[k], mesh, [Shard(dims[k])]) for k in SHAPES}
    sd["p"] = values["p"].clone()
    sd["step"] = step
    return sd


def save_sharded(rank: int, ws: int, root: str) -> None:
    """Save the state at this world size with solosave (``root/solo``) and stock DCP (``root/stock``)."""
    sd = _state(ws, SAVE_DIM, full_tensors(), 41)
    with solosave.AsyncCheckpointer(worker="thread") as ckpt:
        ckpt.save(sd, os.path.join(root, "solo")).wait(timeout=60)
    dcp.save(sd, checkpoint_id=os.path.join(root, "stock"))


def load_resharded(rank: int, ws: int, root: str) -> dict:
    """Load both checkpoints with both loaders into shards along ``LOAD_DIM``; which values
    came back bit for bit (the full tensors, gathered)."""
    want = full_tensors()
    zeros = {k: torch.zeros_like(v) for k, v in want.items()}
    out = {}
    for src in ("solo", "stock"):
        for how in ("solosave", "dcp"):
            sd = _state(ws, LOAD_DIM, zeros, 0)
            path = os.path.join(root, src)
            solosave.load(sd, path) if how == "solosave" else dcp.load(sd, checkpoint_id=path)
            ok = {k: torch.equal(sd[k].full_tensor(), want[k]) for k in SHAPES}
            ok["p"] = torch.equal(sd["p"], want["p"])
            ok["step"] = sd["step"] == 41
            out[f"{src}/{how}"] = ok
    return out


def errors_agree(rank: int, ws: int, root: str) -> list[str]:
    """A failure on one rank only (a wrong shape on rank 1; rank 1's data file truncated)
    raises the same error on every rank."""
    path = os.path.join(root, "ck")
    dcp.save({"w": torch.arange(8.0), f"r{rank}": torch.full((4096,), float(rank))}, checkpoint_id=path)
    errors = []
    for case in ("shape", "truncated"):
        if case == "truncated" and rank == 1:
            with open(os.path.join(path, "__1_0.distcp"), "r+b") as f:
                f.truncate(100)
        dist.barrier()
        sd = {"w": torch.zeros(9 if case == "shape" and rank == 1 else 8), f"r{rank}": torch.zeros(4096)}
        try:
            solosave.load(sd, path)
            errors.append("loaded")
        except Exception as e:  # noqa: BLE001 - reported to the test
            errors.append(f"{type(e).__name__}: {e}")
    return errors


def custom_planner_loads(rank: int, ws: int, root: str) -> dict:
    """A planner with a global step of its own goes through DCP's collective load (which
    calls that step on rank 0); the values arrive as with the default planner."""
    from solosave._src.load.load import SafeLoadPlanner

    calls = []

    class Planner(SafeLoadPlanner):
        def create_global_plan(self, global_plan):
            calls.append(len(global_plan))
            return super().create_global_plan(global_plan)

    path = os.path.join(root, "ck")
    dcp.save({"w": torch.arange(8.0), f"r{rank}": torch.full((4096,), float(rank))}, checkpoint_id=path)
    sd = {"w": torch.zeros(8), f"r{rank}": torch.zeros(4096)}
    solosave.load(sd, path, planner=Planner())
    return {"calls": calls, "ok": torch.equal(sd["w"], torch.arange(8.0)) and bool((sd[f"r{rank}"] == rank).all())}


def index_loads(rank: int, ws: int, root: str) -> dict:
    """Save with solosave (a create save, then a reuse save into another directory), then load
    both at this world size through the load index only (``.metadata`` is never parsed: the
    parser raises), and once with ``use_index=False``; collectives of the index load counted."""
    from unittest import mock

    import solosave._src.load.load as sl

    sd = _state(ws, SAVE_DIM, full_tensors(), 41)
    with solosave.AsyncCheckpointer(prepared_metadata=os.path.join(root, "prep.md"),
                                    create_prepared_metadata=True, worker="thread") as ckpt:
        kinds = [ckpt.save(sd, os.path.join(root, name)).wait(timeout=60).mode for name in ("c0", "c1")]
    want = full_tensors()
    out: dict = {"kinds": kinds}
    calls: list[str] = []
    real_ar, real_bc = dist.all_reduce, dist.broadcast_object_list

    def count(name, fn):
        def wrapped(*a, **k):
            calls.append(name)
            return fn(*a, **k)
        return wrapped

    for name in ("c0", "c1"):
        for use_index in (True, False):
            got = _state(ws, LOAD_DIM, {k: torch.zeros_like(v) for k, v in want.items()}, 0)
            calls.clear()
            parse = mock.patch.object(sl, "parse_metadata", side_effect=AssertionError("parsed .metadata"))
            with mock.patch.object(dist, "all_reduce", count("all_reduce", real_ar)), \
                    mock.patch.object(dist, "broadcast_object_list", count("broadcast", real_bc)):
                # the index path's own collectives (a cooperative load's are counted in
                # tests/multiproc/test_cooperative_load.py)
                if use_index:
                    with parse:
                        solosave.load(got, os.path.join(root, name), cooperative=False)
                else:
                    solosave.load(got, os.path.join(root, name), use_index=False, cooperative=False)
            ok = all(torch.equal(got[k].full_tensor(), want[k]) for k in SHAPES)
            out[f"{name}/{use_index}"] = (ok and torch.equal(got["p"], want["p"]) and got["step"] == 41, list(calls))
    # The last rank cannot use the index (unusable there only): the others have loaded through it
    # already; every rank then takes part in the .metadata broadcast, and only that rank parses it
    # and loads from it.
    got = _state(ws, LOAD_DIM, {k: torch.zeros_like(v) for k, v in want.items()}, 0)
    calls.clear()
    refuse = mock.patch.object(sl.LoadIndex, "open", side_effect=IndexUnusable("refused in this test"))
    with mock.patch.object(dist, "all_reduce", count("all_reduce", real_ar)), \
            mock.patch.object(dist, "broadcast_object_list", count("broadcast", real_bc)):
        if rank == ws - 1:
            with refuse:
                solosave.load(got, os.path.join(root, "c1"), cooperative=False)
        else:  # these ranks loaded through the index: they take part in the broadcast, parse nothing
            with mock.patch.object(sl, "parse_metadata", side_effect=AssertionError("parsed .metadata")):
                solosave.load(got, os.path.join(root, "c1"), cooperative=False)
    out["mixed"] = (all(torch.equal(got[k].full_tensor(), want[k]) for k in SHAPES) and torch.equal(got["p"], want["p"])
                    and got["step"] == 41, list(calls))
    # The same, cooperative (the default): every rank takes part in each pass's sketch (the
    # ranks that loaded through the index stand aside in the second) and the values still agree.
    got = _state(ws, LOAD_DIM, {k: torch.zeros_like(v) for k, v in want.items()}, 0)
    calls.clear()
    with mock.patch.object(dist, "all_reduce", count("all_reduce", real_ar)), \
            mock.patch.object(dist, "broadcast_object_list", count("broadcast", real_bc)):
        if rank == ws - 1:
            with refuse:
                solosave.load(got, os.path.join(root, "c1"))
        else:
            solosave.load(got, os.path.join(root, "c1"))
    ok = all(torch.equal(got[k].full_tensor(), want[k]) for k in SHAPES)
    out["mixed/cooperative"] = (ok and torch.equal(got["p"], want["p"]) and got["step"] == 41, list(calls))
    return out


def same_sharding_loads(rank: int, ws: int, root: str) -> dict:
    """Save the DTensor state (and a replicated DTensor ``r``) with solosave at this world size,
    then load it back at the same sharding with ``solosave.load`` and stock ``dcp.load``: whether
    every value came back, and which keys solosave read whole (planned from the load index)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    import solosave._src.load.load as sl

    def state(values: dict, step: int) -> dict:
        sd = _state(ws, SAVE_DIM, values, step)
        sd["r"] = distribute_tensor(values["r"], init_device_mesh("cpu", (ws,)), [Replicate()])
        return sd

    want = full_tensors() | {"r": torch.arange(300 * 200, dtype=torch.float32).reshape(300, 200)}
    path = os.path.join(root, "solo")
    with solosave.AsyncCheckpointer(worker="thread") as ckpt:
        ckpt.save(state(want, 41), path).wait(timeout=60)
    whole: list[str] = []
    real = sl.read_items

    def spy(directory, items, storage_data, planner, reads=(), cooperation=None):
        whole.extend(read.fqn for read, _ in reads)
        return real(directory, items, storage_data, planner, reads, cooperation)

    from torch.distributed.tensor import DTensor

    chunk_lists: list[str] = []  # DTensor.__create_chunk_list__ calls of solosave.load
    real_chunks = DTensor.__create_chunk_list__

    def count(self):
        chunk_lists.append("")
        return real_chunks(self)

    out: dict = {}
    for how in ("solosave", "dcp"):
        got = state({k: torch.zeros_like(v) for k, v in want.items()}, 0)
        sl.read_items = spy
        if how == "solosave":
            DTensor.__create_chunk_list__ = count
        try:
            solosave.load(got, path) if how == "solosave" else dcp.load(got, checkpoint_id=path)
        finally:
            sl.read_items = real
            DTensor.__create_chunk_list__ = real_chunks
        out[how] = (all(torch.equal(got[k].full_tensor(), want[k]) for k in [*SHAPES, "r"])
                    and torch.equal(got["p"], want["p"]) and got["step"] == 41)
    out["whole"] = sorted(whole)
    out["chunk_lists"] = len(chunk_lists)
    return out


def partial_dtensor_loads(rank: int, ws: int, root: str) -> dict:
    """A ``Partial`` DTensor in the state dict (DCP cannot load into one): with
    ``allow_partial_load`` and its key absent from the checkpoint, and strictly; what
    ``solosave.load`` and stock ``dcp.load`` do (the error's type and text, or ``None``)."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    from solosave._src.load.load import SafeLoadPlanner

    path = os.path.join(root, "partial")
    sd = _state(ws, SAVE_DIM, full_tensors(), 41)
    with solosave.AsyncCheckpointer(worker="thread") as ckpt:
        ckpt.save(sd, path).wait(timeout=60)
    mesh = init_device_mesh("cpu", (ws,))
    out: dict = {}
    for allow in (True, False):
        for how in ("solosave", "dcp"):
            got = _state(ws, SAVE_DIM, {k: torch.zeros_like(v) for k, v in full_tensors().items()}, 0)
            got["nokey"] = DTensor.from_local(torch.zeros(10, 6), mesh, [Partial()], shape=(10, 6), stride=(6, 1))
            try:
                if how == "solosave":
                    solosave.load(got, path, planner=SafeLoadPlanner(allow_partial_load=allow))
                else:
                    dcp.load(got, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=allow))
                out[f"{how}/{allow}"] = None if torch.equal(got["c"].full_tensor(), full_tensors()["c"]) else "wrong"
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - compared below (DCP's wrapper is a BaseException)
                inner = next(iter(e.failures.values())) if hasattr(e, "failures") else e
                inner = inner[0] if isinstance(inner, tuple) else inner
                out[f"{how}/{allow}"] = f"{type(inner).__name__}: {inner}"
    return out
