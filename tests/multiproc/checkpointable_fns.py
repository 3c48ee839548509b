"""Rank functions of tests/multiproc/test_checkpointable.py: DCP checkpointable objects (several
chunks of one key per rank), ``io.BytesIO`` values and values saved whole, saved by
solosave in create and reuse mode and read back by stock DCP and by ``solosave.load``."""

from __future__ import annotations

import io

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import solosave
from solosave._src.plan.local_plan import WholeValue
from solosave._src.testing.checkpointable import ChunkedTensor, row_chunks
from tests.support import fresh

ROWS = 8  # rows of the chunked tensor; each rank of W=2 holds two chunks of two rows


def full_weight(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, 4, generator=torch.Generator().manual_seed(seed))


def my_rows(rank: int, ws: int) -> list[tuple[int, int]]:
    """Rank ``r`` of ``ws`` holds every ``ws``-th pair of rows, starting at pair ``r``: several
    chunks per rank, interleaved as a virtual pipeline interleaves layers."""
    return [(a, a + 2) for a in range(2 * rank, ROWS, 2 * ws)]


def state(rank: int, ws: int, seed: int) -> dict:
    """Non-tensor values are the same on every rank: like a plain tensor, a key held by several
    ranks is one value, written once (DCP's rule)."""
    return {"w": row_chunks(full_weight(seed), my_rows(rank, ws)),
            "bias": torch.full((3,), float(seed)),
            "blob": io.BytesIO(bytes([seed, 0, 255]) * (3 + seed)),
            "objects": WholeValue([{"seed": seed, "rng": torch.arange(seed)}])}


def empty_target(rank: int, ws: int) -> dict:
    return {"w": row_chunks(torch.zeros(ROWS, 4), my_rows(rank, ws)), "bias": torch.zeros(3),
            "blob": io.BytesIO(), "objects": None}


def check_loaded(got: dict, rank: int, ws: int, seed: int) -> None:
    want = state(rank, ws, seed)
    for (off, t), (woff, wt) in zip(got["w"].chunks, want["w"].chunks):
        assert off == woff and torch.equal(t, wt), (off, woff)
    assert torch.equal(got["bias"], want["bias"])
    assert isinstance(got["blob"], io.BytesIO) and got["blob"].getvalue() == want["blob"].getvalue()
    (objects,) = got["objects"]  # the list, whole: not flattened into objects.0.seed, ...
    assert objects["seed"] == seed and torch.equal(objects["rng"], torch.arange(seed))


def save_create_then_reuse(rank: int, ws: int, root: str) -> list:
    """A create save and two reuse saves of new values; each rank checks the last one by
    loading it with stock DCP and with solosave.load. Returns (mode, collectives, cache hits)."""
    fresh(root)
    out = []
    with solosave.AsyncCheckpointer(prepared_metadata=f"{root}/prep.md", create_prepared_metadata=True) as ck:
        for seed in (1, 2, 3):
            r = ck.save(state(rank, ws, seed), f"{root}/c{seed}").wait(120)
            out.append((r.mode, r.collectives("all"), ck._session.structure.hits))
    dist.barrier()
    got = empty_target(rank, ws)
    dcp.load(got, checkpoint_id=f"{root}/c3")
    check_loaded(got, rank, ws, 3)
    got = empty_target(rank, ws)
    solosave.load(got, f"{root}/c3")
    check_loaded(got, rank, ws, 3)
    return out


def load_at_one_rank(rank: int, ws: int, root: str) -> list:
    """World size 1: the whole tensor, and the chunks of a different chunking, from the W=2
    checkpoint (DCP reshards through the chunk metadata)."""
    whole = {"w": torch.zeros(ROWS, 4), "bias": torch.zeros(3)}
    dcp.load(whole, checkpoint_id=f"{root}/c3")
    assert torch.equal(whole["w"], full_weight(3)) and torch.equal(whole["bias"], torch.full((3,), 3.0))
    odd = {"w": ChunkedTensor((ROWS, 4), [((0, 0), torch.zeros(3, 4)), ((3, 0), torch.zeros(5, 4))])}
    solosave.load(odd, f"{root}/c3")
    assert torch.equal(torch.cat([t for _, t in odd["w"].chunks]), full_weight(3))
    return [list(o) for o, _ in odd["w"].chunks]
