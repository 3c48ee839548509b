"""Write results as columns (coordinator, collective path; pure functions, no I/O).

At W=4096 ranks of a Llama-7B-like model a create save gathers 800k write results. Turning
each into normalised key tuples, a set and a dict of ``MetadataIndex``/``_StorageInfo`` objects
took most of ``finish`` (docs/benchmarks.md, the scale section). Here the rows are matched to
the plan's chunks with array operations instead: :class:`ChunkTable` is the plan's chunks as columns (made by
``plan/global_plan`` from its own columns, or from a ``state_dict_metadata``), and
:func:`placed_columns` gives every result row the id of its chunk (through the held positions
ranks report, ``WrittenColumns``) and checks that the results cover the plan exactly once.
``plan/metadata_pickle`` and ``prepared/sections`` build the ``.metadata`` pickle and the prepared file
from these columns.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from solosave._src.coordination.protocol import WrittenColumns
from solosave._src.core.errors import PlanValidationError


@dataclass(frozen=True)
class ChunkTable:
    """The chunks of a ``state_dict_metadata`` as columns. Chunk ids ``bounds[f]:bounds[f+1]``
    are fqn ``f``'s chunks in the order of its ``chunks`` list (a BYTES fqn has one id)."""

    names: list[str]        #: fqns, in the order of the ``state_dict_metadata``
    nd: list[int]           #: per fqn: number of dims, -1 for a BYTES item
    bounds: list[int]       #: per fqn: its first chunk id (and the total at the end)
    offs: torch.Tensor      #: (chunks, max dims) int64, zero-padded
    sizes: torch.Tensor     #: (chunks, max dims) int64, zero-padded

    @property
    def n(self) -> int:
        return self.bounds[-1] if self.bounds else 0

    @classmethod
    def from_metadata(cls, sdm: Mapping[str, object]) -> ChunkTable:
        """The table of a ``state_dict_metadata`` of objects (one Python pass over its chunks)."""
        names, nd, bounds, offs, sizes = [], [], [0], [], []
        for fqn, m in sdm.items():
            names.append(fqn)
            if isinstance(m, TensorStorageMetadata):
                nd.append(len(m.size))
                offs += [list(c.offsets) for c in m.chunks]
                sizes += [list(c.sizes) for c in m.chunks]
            else:
                nd.append(-1)
                offs.append([])
                sizes.append([])
            bounds.append(len(offs))
        width = max((d for d in nd if d > 0), default=0)
        return cls(names, nd, bounds, _padded(offs, width), _padded(sizes, width))

    def fids(self) -> torch.Tensor:
        """The fqn id of every chunk id."""
        return torch.repeat_interleave(torch.arange(len(self.names), dtype=torch.int64),
                                       torch.tensor(self.bounds, dtype=torch.int64).diff())


def _padded(rows: list[list[int]], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, :len(r)] = torch.tensor(r, dtype=torch.int64)
    return out


@dataclass(frozen=True)
class ResultColumns:
    """Every rank's write results, one row each, in gather order (rank by rank)."""

    uid: torch.Tensor       #: the chunk id (``ChunkTable``) of each row
    rank: torch.Tensor
    file: torch.Tensor      #: index into ``files``
    offset: torch.Tensor
    length: torch.Tensor
    files: list[str]        #: data file names, in order of first appearance
    world: int              #: the number of ranks (reports)

    @property
    def n(self) -> int:
        return int(self.uid.numel())


_TORCH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def int_column(arrays: Iterable[array]) -> torch.Tensor:
    """Integer ``array`` objects (typecodes ``b``, ``h``, ``i``, ``l``, ``q``) concatenated into
    one int64 tensor."""
    parts = [torch.frombuffer(bytearray(a), dtype=_TORCH_INT[a.itemsize]).to(torch.int64) for a in arrays if len(a)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def placed_columns(table: ChunkTable, held_chunks: torch.Tensor, held_counts: Sequence[int],
                   reports: Sequence[WrittenColumns]) -> ResultColumns:
    """Every rank's :class:`~solosave._src.coordination.protocol.WrittenColumns` matched to ``table`` through the
    plan's ``held_chunks`` (the chunk of each rank's held position); raises
    :class:`PlanValidationError`, naming the items, unless every chunk of the plan was written
    exactly once and every row is an item its rank holds."""
    world = len(reports)
    counts = [len(c.positions) for c in reports]
    rank = torch.repeat_interleave(torch.arange(world, dtype=torch.int64), torch.tensor(counts, dtype=torch.int64))
    pos = int_column([c.positions for c in reports])
    held = torch.tensor(list(held_counts), dtype=torch.int64)
    bad = (pos < 0) | (pos >= held[rank]) if pos.numel() else pos.bool()
    if bool(bad.any()):
        r = int(rank[bad][0])
        raise PlanValidationError(f"write results do not cover the plan: rank {r} reported item position "
                                  f"{int(pos[bad][0])} of {held_counts[r]} held items")
    start = torch.cumsum(held, 0) - held
    uid = held_chunks[start[rank] + pos] if pos.numel() else pos
    seen = torch.bincount(uid, minlength=table.n)
    if table.n and not bool((seen == 1).all()):
        problems = [f"{_key_text(table, int(u))} written {int(seen[u])} times" for u in
                    torch.nonzero(seen != 1).flatten()[:10].tolist()]
        raise PlanValidationError("write results do not cover the plan: " + "; ".join(problems))
    files: dict[str, int] = {}
    ids: list[int] = []   # every rank's file names, as ids into ``files``
    base: list[int] = []  # where each rank's names start in ``ids``
    for c in reports:
        base.append(len(ids))
        ids.extend(files.setdefault(f, len(files)) for f in c.files)
    local = int_column([c.file for c in reports])
    file = torch.tensor(ids or [0], dtype=torch.int64)[torch.tensor(base, dtype=torch.int64)[rank] + local] \
        if pos.numel() else pos
    return ResultColumns(uid, rank, file, int_column([c.offset for c in reports]),
                         int_column([c.length for c in reports]), list(files), world)


def _key_text(table: ChunkTable, uid: int) -> str:
    f = next(i for i in range(len(table.names)) if table.bounds[i] <= uid < table.bounds[i + 1])
    if table.nd[f] < 0:
        return repr(table.names[f])
    return f"{table.names[f]!r} chunk at offsets {tuple(table.offs[uid, :table.nd[f]].tolist())}"




def sorted_rows(*columns: torch.Tensor) -> torch.Tensor:
    """The permutation that sorts rows by ``columns`` (the first is the most significant)."""
    order = torch.arange(columns[0].numel(), dtype=torch.int64)
    for col in reversed(columns):  # stable sorts, least significant first
        order = order[torch.sort(col[order], stable=True).indices]
    return order


def distinct_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct rows of a non-negative int64 matrix (sorted) and each row's index among
    them; one integer key per row when they fit (``torch.unique(dim=0)`` is slow)."""
    n, width = rows.shape
    if not n or not width:
        return rows[:1], torch.zeros(n, dtype=torch.int64)
    radix = [int(rows[:, d].max()) + 1 for d in range(width)]
    if bool((rows < 0).any()) or math.prod(radix) >= (1 << 62):
        return torch.unique(rows, dim=0, return_inverse=True)
    key = rows[:, 0].clone()
    for d in range(1, width):
        key = key * radix[d] + rows[:, d]
    values, inverse = torch.unique(key, return_inverse=True)
    first = torch.full((values.numel(),), n, dtype=torch.int64).scatter_reduce_(
        0, inverse, torch.arange(n, dtype=torch.int64), "amin")
    return rows[first], inverse


