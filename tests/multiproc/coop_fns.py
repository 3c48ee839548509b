"""Rank functions of the cooperative-load tests (module-level: spawned processes import them).

The state: three tensors sharded by rows (``Shard(0)``) whose saved chunks are at least 64 KiB
(so that a load shares them). Saved at W = 2 or 4 over a 1-d mesh; loaded at W = 4 as 2
replicas x 2 shards (a 2-d mesh, ``[Replicate(), Shard(0)]``), or resharded over a 1-d mesh.
Bytes read from the data files are counted independently of the library
(``benchmarks.ranks.counting_distcp_reads``: ``os.preadv`` and ``os.pread`` wrapped in the rank's
process, counting what they return for descriptors open on a ``.distcp`` file).
"""

from __future__ import annotations

import os
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import solosave
from benchmarks.coop_load import sharded_state as _state
from benchmarks.ranks import counting_distcp_reads

SHAPES = {"w0": ((512, 256), torch.float32), "w1": ((1024, 96), torch.bfloat16), "e": ((2048, 64), torch.int8)}


def values() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    out = {}
    for k, (shape, dt) in SHAPES.items():
        out[k] = (torch.randn(shape, generator=g).to(dt) if dt.is_floating_point
                  else torch.randint(-100, 100, shape, generator=g).to(dt))
    return out


def save(rank: int, ws: int, path: str) -> None:
    with solosave.AsyncCheckpointer(worker="thread") as ckpt:
        ckpt.save(_state(ws, values()), path).wait(timeout=60)


def _calls() -> Any:
    names: list[str] = []
    real = {n: getattr(dist, n) for n in ("all_reduce", "all_gather_object", "broadcast_object_list")}

    def wrap(name: str) -> Any:
        def wrapped(*a: Any, **k: Any) -> Any:
            names.append(name)
            return real[name](*a, **k)
        return wrapped

    patches = [mock.patch.object(dist, n, wrap(n)) for n in real]
    return names, patches


def load(rank: int, ws: int, path: str, replicas: int, cooperative: bool | None, stock_path: str = "") -> dict:
    """Load ``path`` at this world size (``replicas`` x shards), with solosave (cooperative or
    not) and with stock ``dcp.load`` (from ``stock_path``, default ``path``): what came back, what
    was read, which collectives ran."""
    want = values()
    got = _state(ws, {k: torch.zeros_like(v) for k, v in want.items()}, replicas)
    names, patches = _calls()
    with counting_distcp_reads() as counted:
        for p in patches:
            p.start()
        try:
            result = solosave.load(got, path, cooperative=cooperative)
        finally:
            for p in patches:
                p.stop()
    ok = all(torch.equal(got[k].full_tensor(), want[k]) for k in SHAPES)
    stock = _state(ws, {k: torch.zeros_like(v) for k, v in want.items()}, replicas)
    dcp.load(stock, checkpoint_id=stock_path or path)
    same_as_stock = all(torch.equal(got[k].to_local(), stock[k].to_local()) for k in SHAPES)
    return {"ok": ok, "same_as_stock": same_as_stock, "counted": counted[0], "result": result.as_dict(),
            "is_str": isinstance(result, str) and result == path, "calls": names}


def load_failing(rank: int, ws: int, path: str, replicas: int, failing_rank: int, how: str) -> str:
    """Load ``path`` cooperatively where ``failing_rank`` cannot read its share (``how``:
    ``"read"``: its storage read raises) or this rank's copy of a record is damaged (``how``:
    ``"damaged"``: the file was damaged by the test before); returns the error every rank raised."""
    from solosave._src.load import read_path

    got = _state(ws, {k: torch.zeros_like(v) for k, v in values().items()}, replicas)

    def refuse(self: Any, rel: str, offset: int, into: torch.Tensor) -> bool:
        raise OSError(f"injected read failure on rank {rank} ({rel} at {offset})")

    patch = mock.patch.object(read_path.LocalRanges, "__call__", refuse)
    if how == "read" and rank == failing_rank:
        patch.start()
    try:
        solosave.load(got, path, cooperative=not how.endswith("/alone"))
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        return f"{type(e).__name__}: {e}"
    finally:
        if how == "read" and rank == failing_rank:
            patch.stop()
    return "loaded"


def load_with_a_dying_reader(rank: int, ws: int, path: str, dying: int) -> str:
    """Load cooperatively where rank ``dying``'s process exits as it starts reading its share;
    the others return what they raised and after how long."""
    import time

    from solosave._src.load import read_path

    got = _state(ws, {k: torch.zeros_like(v) for k, v in values().items()}, 2)

    def die(self: Any, rel: str, offset: int, into: torch.Tensor) -> bool:
        os._exit(3)

    patch = mock.patch.object(read_path.LocalRanges, "__call__", die)
    if rank == dying:
        patch.start()
    t0 = time.monotonic()
    try:
        solosave.load(got, path, cooperative=True)
    except Exception as e:  # noqa: BLE001 - what each surviving rank raised is the result
        return f"{type(e).__name__} after {time.monotonic() - t0:.0f} s: {e}"
    return "loaded"
