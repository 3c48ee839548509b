"""Chunk validation: do a tensor's chunks tile it exactly once? (pure functions, no I/O)

Used by the global planner (``plan/global_plan.py``) on every collective save, where a large world
means many chunks per tensor, so the common case (1-D sharding) is decided with array operations
(:func:`tiles_along_one_dim`) and only the undecided cases (grids, overlaps, out-of-bounds
chunks) run the exact sweep (:func:`sweep_chunks`), which also words the errors.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import torch

#: From this many chunks on, :func:`validate_chunks` first tries the vectorized check.
VECTOR_MIN = 32

Chunk = tuple[tuple[int, ...], tuple[int, ...]]


def validate_chunks(fqn: str, size: tuple[int, ...], chunks: Sequence[Chunk]) -> list[str]:
    """Check that ``chunks`` (offsets, sizes) tile a tensor of ``size`` exactly once; return one
    message per problem, each naming ``fqn`` (empty: ok).

    Bounds are checked per chunk and the chunks' volumes must add up to the tensor's; volume
    equality plus no overlap means no gap. Overlaps are found by a sweep along the dimension in
    which the chunks' start offsets take the most distinct values (the sharded one), keeping the
    chunks still open at the sweep position in a heap by end: O(n log n + n k) for n non-empty
    chunks, where k is the number of chunks sharing a position along that dimension (1 for 1-D
    sharding, the split count of the other dimensions for a grid). The sweep stops at the third
    overlap, so an invalid plan cannot make it quadratic either.
    """
    nd = len(size)
    if nd == 0:
        if len(chunks) != 1:
            return [f"{fqn!r}: a 0-d tensor must have exactly one chunk, found {len(chunks)}"]
        return []
    if len(chunks) >= VECTOR_MIN and all(len(o) == nd and len(z) == nd for o, z in chunks):
        offs = torch.tensor([o for o, _ in chunks], dtype=torch.int64).reshape(len(chunks), nd)
        sizes = torch.tensor([z for _, z in chunks], dtype=torch.int64).reshape(len(chunks), nd)
        verdict = tiles_along_one_dim(size, offs, sizes)
        if verdict is True:
            return []
        if verdict is False:
            vol = int(sizes.prod(dim=1).sum())
            return [f"{fqn!r}: chunks cover {vol} of {math.prod(size)} elements (a gap)"]
    return sweep_chunks(fqn, size, chunks)


def sweep_chunks(fqn: str, size: tuple[int, ...], chunks: Sequence[Chunk]) -> list[str]:
    """The exact check of :func:`validate_chunks` (bounds, volume, overlap sweep), for a tensor
    of at least one dimension."""
    errors: list[str] = []
    nd = len(size)
    vol = 0
    boxes: list[Chunk] = []
    for off, sz in chunks:
        if len(off) != nd or len(sz) != nd:
            return [f"{fqn!r}: chunk at {list(off)} has {len(off)} dims, tensor has {nd}"]
        if any(o < 0 or n < 0 or o + n > d for o, n, d in zip(off, sz, size)):
            errors.append(f"{fqn!r}: chunk at {list(off)} of size {list(sz)} lies outside the "
                          f"tensor of size {list(size)}")
        v = math.prod(sz)
        vol += v
        if v > 0:
            boxes.append((off, sz))
    overlaps = _overlaps(fqn, size, boxes)
    errors += overlaps
    if not overlaps and vol != math.prod(size):
        errors.append(f"{fqn!r}: chunks cover {vol} of {math.prod(size)} elements (a gap)")
    return errors


def _overlaps(fqn: str, size: tuple[int, ...], boxes: list[Chunk], limit: int = 3) -> list[str]:
    """Up to ``limit`` overlapping pairs among non-empty ``boxes`` (the sweep)."""
    if len(boxes) < 2:
        return []
    nd = len(size)
    dim = max(range(nd), key=lambda d: (len({b[0][d] for b in boxes}), size[d], -d))
    boxes = sorted(boxes, key=lambda b: (b[0][dim], b[0]))
    found: list[str] = []
    open_: list[tuple[int, int]] = []  # (end along dim, box index): a heap
    for i, (off, sz) in enumerate(boxes):
        start = off[dim]
        while open_ and open_[0][0] <= start:
            heapq.heappop(open_)
        for _, j in open_:
            o2, s2 = boxes[j]
            if all(a < b + lb and b < a + la for a, la, b, lb in zip(off, sz, o2, s2)):
                found.append(f"{fqn!r}: chunks at {list(o2)} and {list(off)} overlap")
                if len(found) >= limit:
                    return found
        heapq.heappush(open_, (start + sz[dim], i))
    return found


def tiles_along_one_dim(size: tuple[int, ...], offs: torch.Tensor, sizes: torch.Tensor) -> bool | None:
    """The common case, vectorized: every chunk in bounds and the non-empty chunks disjoint
    along one dimension (1-D sharding). ``True``: they tile the tensor; ``False``: in bounds and
    disjoint but a gap; ``None``: undecided (a bound violated, chunks sharing positions along
    every dimension as in a grid, or an overlap): :func:`sweep_chunks` decides."""
    nd = len(size)
    if nd == 0:
        return None
    if bool(((offs < 0) | (sizes < 0) | (offs + sizes > torch.tensor(size, dtype=torch.int64))).any()):
        return None
    vols = sizes.prod(dim=1)
    vol = int(vols.sum())
    keep = vols > 0
    offs, sizes = offs[keep], sizes[keep]
    if offs.shape[0] > 1:
        distinct = [int(torch.unique(offs[:, d]).numel()) for d in range(nd)]
        dim = max(range(nd), key=lambda d: (distinct[d], size[d], -d))
        order = torch.argsort(offs[:, dim], stable=True)
        starts = offs[order, dim]
        ends = starts + sizes[order, dim]
        if not bool((starts[1:] >= torch.cummax(ends, dim=0).values[:-1]).all()):
            return None
    return vol == math.prod(size)
