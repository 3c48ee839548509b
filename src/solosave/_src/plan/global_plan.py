"""The global plan of a collective save (coordinator only; pure functions, no I/O, no collectives).

:func:`global_plan` takes every rank's :class:`~solosave._src.coordination.protocol.PlanRequest` (columnar items,
what it staged, what it already wrote in a reuse fallback) and decides DCP's
``state_dict_metadata`` and who writes what, with array operations over all ranks' items at once
(no Python object per item per rank: at W=4096 ranks of a Llama-7B-like model that is 800k
items). It runs in named phases, each stating the invariant it establishes:

1. :func:`_merge` - every item of every rank in one set of columns; fqn ids by first
   appearance over ranks (the order of DCP's ``state_dict_metadata``).
2. :func:`_check_fqns` - every item of one fqn has the same kind, dtype, rank and global size.
3. :func:`_unique_items` - items identified by (fqn, chunk offsets); one chunk has one size.
4. :func:`_check_tiling` - each tensor's chunks tile it exactly once (``plan/chunks.py``).
5. :func:`_staged_items` - every item is staged by some rank, by no rank twice.
6. :func:`_assign_writers` - one writer per item among the ranks that staged it: an item
   staged by one rank goes to it; replicated items, largest first (ties by name), go to the
   holder with the fewest bytes so far (ties: lowest rank), unless a holder already wrote it.
7. :func:`_state_dict_metadata` - DCP's metadata, chunks sorted by offsets, equal sizes shared.

Any violation raises :class:`PlanValidationError` naming the items and the fix; every rank
receives that message. ``plan/columns`` matches the write results to the plan's chunks (``chunks``) and
``plan/metadata_pickle`` writes the ``.metadata`` pickle from them.
The per-item reference implementation of the same decisions lives in ``tests/unit/plan/oracle.py``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)

from solosave._src.coordination.protocol import ItemKind, PlanRequest
from solosave._src.core.errors import PlanValidationError
from solosave._src.core.gc_pause import gc_paused
from solosave._src.formats.dcp import dtype_from_name
from solosave._src.plan.chunks import VECTOR_MIN, sweep_chunks, tiles_along_one_dim, validate_chunks
from solosave._src.plan.columns import ChunkTable, int_column
from solosave._src.plan.layout import SDM, shared_size


@dataclass(frozen=True)
class GlobalPlan:
    """What the coordinator decided for one collective save."""

    state_dict_metadata: SDM
    #: Per rank: positions, in its held list, of the items it writes (ascending).
    writes: list[list[int]]
    #: Reuse fallback: every rank's pre-written files are exactly its assignment.
    skip_write: bool
    planner_data: dict
    drifts: dict[int, list[str]]
    #: The chunks of ``state_dict_metadata`` as columns.
    chunks: ChunkTable
    #: The chunk id (in ``chunks``) of every held item, rank by rank in held order, and the
    #: number of items each rank holds: how ``WrittenColumns`` rows are matched to chunks.
    held_chunks: torch.Tensor
    held_counts: list[int]


@dataclass
class _Cols:
    """All ranks' items as columns (phase 1); one row per (rank, held position)."""

    world: int
    counts: list[int]       # items per rank
    names: list[str]        # fqn by id
    fid: torch.Tensor       # fqn id per row
    kinds: torch.Tensor
    dtype: torch.Tensor     # global dtype id per row
    dt_names: list
    nbytes: torch.Tensor
    nds: torch.Tensor       # dims per row, -1 for BYTES
    offs: torch.Tensor      # (rows, maxnd), zero-padded
    sizes: torch.Tensor
    gsz: torch.Tensor


@dataclass
class _Fqns:
    """Per fqn: its first row's kind, dtype, dims and global size (phase 2)."""

    kind: list[int]
    dtype: list[int]
    nd: list[int]
    gsize: list[list[int]]


@dataclass
class _Unique:
    """Unique items (phase 3): ``inv`` maps each row to its item id; items sorted by
    (fqn id, offsets), so each tensor's chunks are contiguous, ``bounds[f]:bounds[f+1]``."""

    inv: torch.Tensor
    fid: torch.Tensor
    offs: torch.Tensor
    sizes: torch.Tensor
    nbytes: torch.Tensor
    bounds: list[int]

    @property
    def n(self) -> int:
        return int(self.fid.numel())


def global_plan(requests: Sequence[PlanRequest]) -> GlobalPlan:
    """Decide the global plan from every rank's request (see the module docstring)."""
    with gc_paused():
        cols = _merge(requests)
        fq = _check_fqns(cols)
        uq = _unique_items(cols)
        _check_tiling(cols, fq, uq)
        st_rank, st_uid, st_pos = _staged_items(requests, cols, uq)
        owner = _assign_writers(requests, cols, fq, uq, st_rank, st_uid)
        mine = owner[st_uid] == st_rank
        per_rank = torch.bincount(st_rank[mine], minlength=cols.world).tolist()
        writes = [sorted(t.tolist()) for t in torch.split(st_pos[mine], per_rank)]
        sdm = _state_dict_metadata(cols, fq, uq)
    planner_data: dict = {}
    for req in requests:
        planner_data.update(req.planner_data)
    skip = _prewritten_fit(requests, writes)
    drifts = {r: list(req.drifts) for r, req in enumerate(requests) if req.drifts}
    chunks = ChunkTable(cols.names, fq.nd, uq.bounds, uq.offs, uq.sizes)
    return GlobalPlan(sdm, writes, skip, planner_data, drifts, chunks, uq.inv, cols.counts)


# -- phase 1 -----------------------------------------------------------------------------------

def _bytes(chunks: Iterable[bytes]) -> torch.Tensor:
    data = b"".join(chunks)
    if not data:
        return torch.zeros(0, dtype=torch.int64)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


def _merge(requests: Sequence[PlanRequest]) -> _Cols:
    packed = [r.specs for r in requests]
    counts = [len(p.fqns) for p in packed]
    fid_of: dict[str, int] = {}
    fid_parts, prev_names, prev_ids = [], None, None
    for p in packed:  # consecutive ranks usually hold the same names: map them once
        if p.fqns != prev_names or prev_ids is None:
            prev_ids = torch.tensor([fid_of.setdefault(f, len(fid_of)) for f in p.fqns], dtype=torch.int64)
            prev_names = p.fqns
        fid_parts.append(prev_ids)
    fid = torch.cat(fid_parts) if fid_parts else torch.zeros(0, dtype=torch.int64)
    dt_of: dict[str | None, int] = {}
    table_map: list[int] = []
    table_base = []
    for p in packed:
        table_base.append(len(table_map))
        table_map.extend(dt_of.setdefault(d, len(dt_of)) for d in p.dtype_table)
    n = sum(counts)
    base = torch.repeat_interleave(torch.tensor(table_base, dtype=torch.int64),
                                   torch.tensor(counts, dtype=torch.int64))
    dtype = (torch.tensor(table_map, dtype=torch.int64)[_bytes(p.dtype_index for p in packed) + base]
             if n else torch.zeros(0, dtype=torch.int64))
    nds = int_column(p.ndims for p in packed)
    offs, sizes, gsz = _dims(nds, int_column(p.numbers for p in packed))
    return _Cols(len(requests), counts, list(fid_of), fid, _bytes(p.kinds for p in packed), dtype,
                 list(dt_of), int_column(p.nbytes for p in packed), nds, offs, sizes, gsz)


def _dims(nds: torch.Tensor, numbers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row offsets, sizes and global size, zero-padded to the largest rank."""
    n = nds.numel()
    maxnd = max(int(nds.max()), 0) if n else 0
    if not maxnd:
        z = torch.zeros((n, 0), dtype=torch.int64)
        return z, z, z
    width = torch.clamp(nds, min=0)
    starts = torch.cumsum(3 * width, 0) - 3 * width
    col = torch.arange(maxnd, dtype=torch.int64)[None, :]
    at = starts[:, None] + col
    valid = col < width[:, None]
    pad = numbers.numel()  # index of the appended padding value 0
    numbers = torch.cat([numbers, numbers.new_zeros(1)])
    w = width[:, None]
    return tuple(numbers[torch.where(valid, at + k * w, pad)] for k in range(3))  # type: ignore[return-value]


# -- phase 2 -----------------------------------------------------------------------------------

def _first_of(groups: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Position of the first element of each group (``len(groups)`` for an empty group)."""
    n = groups.numel()
    return torch.full((n_groups,), n, dtype=torch.int64).scatter_reduce_(
        0, groups, torch.arange(n, dtype=torch.int64), "amin")


def _check_fqns(c: _Cols) -> _Fqns:
    nf = len(c.names)
    first = _first_of(c.fid, nf)
    per = torch.cat([torch.stack([c.kinds, c.dtype, c.nds], dim=1), c.gsz], dim=1)
    bad_rows = (per != per[first][c.fid]).any(dim=1) if c.fid.numel() else torch.zeros(0, dtype=torch.bool)
    if bool(bad_rows.any()):
        errors = []
        for row in torch.nonzero(bad_rows).flatten().tolist()[:20]:
            f = int(c.fid[row])
            a, b = int(first[f]), row
            if int(c.kinds[a]) != int(c.kinds[b]):
                errors.append(f"{c.names[f]!r} is a tensor on some ranks and a non-tensor on others")
            else:
                errors.append(f"{c.names[f]!r} has size {_gsize(c, a)} {c.dt_names[int(c.dtype[a])]} on one "
                              f"rank and {_gsize(c, b)} {c.dt_names[int(c.dtype[b])]} on another")
        raise _invalid(errors, int(bad_rows.sum()))
    f_per = per[first] if nf else per[:0]
    if bool((f_per[:, 0] > int(ItemKind.BYTES)).any()):
        raise PlanValidationError("internal: an item of unknown kind in a plan request")
    return _Fqns(f_per[:, 0].tolist(), f_per[:, 1].tolist(), f_per[:, 2].tolist(), f_per[:, 3:].tolist())


def _gsize(c: _Cols, row: int) -> list[int]:
    return c.gsz[row, :max(int(c.nds[row]), 0)].tolist()


def _invalid(errors: list[str], total: int | None = None) -> PlanValidationError:
    total = len(errors) if total is None else total
    shown = "; ".join(errors[:20]) + (f"; ... ({total} errors)" if total > 20 else "")
    return PlanValidationError(f"the ranks' state dicts do not form one checkpoint: {shown}")


# -- phase 3 -----------------------------------------------------------------------------------

def _unique_items(c: _Cols) -> _Unique:
    n, maxnd = c.fid.numel(), c.offs.shape[1]
    radix = [int(c.offs[:, d].max()) + 1 if n else 1 for d in range(maxnd)]
    # one integer key per row (fqn id, offsets in mixed radix) when it fits in int64 and no
    # offset is negative (the tiling check reports those); otherwise the slower row-wise unique
    if not bool((c.offs < 0).any()) and math.prod(radix) * max(len(c.names), 1) < (1 << 62):
        key = c.fid.clone()
        for d in range(maxnd):
            key = key * radix[d] + c.offs[:, d]
        _, inv = torch.unique(key, return_inverse=True)
    else:
        _, inv = torch.unique(torch.cat([c.fid[:, None], c.offs], dim=1), dim=0, return_inverse=True)
    nu = int(inv.max()) + 1 if n else 0
    first = _first_of(inv, nu)
    if maxnd and n:
        clash = (c.sizes != c.sizes[first][inv]).any(dim=1)
        if bool(clash.any()):
            errors = []
            for row in torch.nonzero(clash).flatten().tolist()[:20]:
                a, nd = int(first[inv[row]]), int(c.nds[row])
                errors.append(f"{c.names[int(c.fid[row])]!r}: the chunk at {c.offs[row, :nd].tolist()} has "
                              f"size {c.sizes[a, :nd].tolist()} on one rank and {c.sizes[row, :nd].tolist()} "
                              "on another")
            raise _invalid(errors, int(clash.sum()))
    u_fid = c.fid[first]
    bounds = torch.searchsorted(u_fid, torch.arange(len(c.names) + 1, dtype=torch.int64)).tolist()
    return _Unique(inv, u_fid, c.offs[first], c.sizes[first], c.nbytes[first], bounds)


# -- phase 4 -----------------------------------------------------------------------------------

def _check_tiling(c: _Cols, fq: _Fqns, u: _Unique) -> None:
    errors: list[str] = []
    for f, name in enumerate(c.names):
        if fq.kind[f] != int(ItemKind.TENSOR):
            continue
        nd, a, b = fq.nd[f], u.bounds[f], u.bounds[f + 1]
        size = tuple(fq.gsize[f][:nd])
        verdict = None
        if b - a >= VECTOR_MIN and nd > 0:
            verdict = tiles_along_one_dim(size, u.offs[a:b, :nd], u.sizes[a:b, :nd])
        if verdict is True:
            continue
        chunks = list(zip(map(tuple, u.offs[a:b, :nd].tolist()), map(tuple, u.sizes[a:b, :nd].tolist())))
        errors += sweep_chunks(name, size, chunks) if nd > 0 else validate_chunks(name, size, chunks)
    if errors:
        raise _invalid(errors)


# -- phase 5 -----------------------------------------------------------------------------------

def _staged_items(requests: Sequence[PlanRequest], c: _Cols, u: _Unique
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per staged row: its rank, item id and position in the rank's held list."""
    parts, ranks = [], []
    for r, req in enumerate(requests):
        pos = (torch.arange(c.counts[r], dtype=torch.int64) if req.staged is None
               else torch.tensor(req.staged, dtype=torch.int64))
        if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= c.counts[r]):
            raise PlanValidationError(f"internal: rank {r} staged an item it does not hold")
        parts.append(pos)
        ranks.append(torch.full((pos.numel(),), r, dtype=torch.int64))
    st_pos = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    st_rank = torch.cat(ranks) if ranks else torch.zeros(0, dtype=torch.int64)
    base = torch.tensor([0] + c.counts, dtype=torch.int64).cumsum(0)[:-1]
    st_uid = u.inv[st_pos + base[st_rank]] if st_pos.numel() else st_pos
    nobody = torch.nonzero(torch.bincount(st_uid, minlength=u.n) == 0).flatten()
    if nobody.numel():
        names = ", ".join(sorted({c.names[int(f)] for f in u.fid[nobody].tolist()})[:10])
        raise PlanValidationError(
            f"{nobody.numel()} item(s) were staged by no rank ({names}): the structure changed on "
            "some ranks but not others; the next save stages every item again and re-plans")
    pair = st_uid * c.world + st_rank
    if pair.numel() != torch.unique(pair).numel():
        raise PlanValidationError("internal: a rank staged one item twice")
    return st_rank, st_uid, st_pos


# -- phase 6 -----------------------------------------------------------------------------------

def _prefer(requests: Sequence[PlanRequest], c: _Cols, u: _Unique) -> torch.Tensor | None:
    """Reuse fallback: per item, the lowest rank that already wrote it (the world size: none);
    ``None`` when no rank pre-wrote anything."""
    kept = [(r, req.prewritten.positions) for r, req in enumerate(requests) if req.prewritten is not None]
    if not any(len(pos) for _, pos in kept):
        return None
    start = torch.tensor([0, *c.counts], dtype=torch.int64).cumsum(0)
    rows = torch.cat([start[r] + int_column([pos]) for r, pos in kept])
    ranks = torch.cat([torch.full((len(pos),), r, dtype=torch.int64) for r, pos in kept])
    if bool(((rows < start[ranks]) | (rows >= start[ranks + 1])).any()):
        raise PlanValidationError("internal: a rank reported a pre-written item it does not hold")
    return torch.full((u.n,), c.world, dtype=torch.int64).scatter_reduce_(0, u.inv[rows], ranks, "amin")


def _assign_writers(requests: Sequence[PlanRequest], c: _Cols, fq: _Fqns, u: _Unique, st_rank: torch.Tensor,
                    st_uid: torch.Tensor) -> torch.Tensor:
    """The writer rank of every item (see phase 6 in the module docstring)."""
    holders = torch.bincount(st_uid, minlength=u.n)
    owner = torch.full((u.n,), -1, dtype=torch.int64)
    single = holders[st_uid] == 1
    owner[st_uid[single]] = st_rank[single]
    weight = torch.clamp(u.nbytes, min=1)
    load = torch.zeros(c.world, dtype=torch.int64).scatter_add_(0, st_rank[single], weight[st_uid[single]]).tolist()
    multi = ~single
    if not bool(multi.any()):
        return owner
    m_uid, m_rank = st_uid[multi], st_rank[multi]
    order = torch.argsort(m_uid * c.world + m_rank)
    m_uid, m_rank = m_uid[order], m_rank[order]
    uids, per_uid = torch.unique_consecutive(m_uid, return_counts=True)
    groups = [g.tolist() for g in torch.split(m_rank, per_uid.tolist())]
    name_rank = {f: j for j, f in enumerate(sorted(c.names))}
    by_name = torch.tensor([name_rank[f] for f in c.names], dtype=torch.int64)[u.fid[uids]].tolist()
    uid_list, neg_nb, wl = uids.tolist(), (-u.nbytes[uids]).tolist(), weight[uids].tolist()
    prefer = _prefer(requests, c, u)
    first = prefer[uids].tolist() if prefer is not None else [c.world] * len(uid_list)
    own = [0] * len(uid_list)
    for j in sorted(range(len(uid_list)), key=lambda j: (neg_nb[j], by_name[j], uid_list[j])):
        hs = groups[j]
        p = first[j]
        r = p if p in hs else min(hs, key=lambda x: (load[x], x))
        own[j] = r
        load[r] += wl[j]
    owner[uids] = torch.tensor(own, dtype=torch.int64)
    return owner


def _prewritten_fit(requests: Sequence[PlanRequest], writes: list[list[int]]) -> bool:
    """Every rank pre-wrote (reuse fallback) exactly the items now assigned to it."""
    if not requests or any(req.prewritten is None for req in requests):
        return False
    return all(req.prewritten is not None and sorted(req.prewritten.positions) == mine
               for req, mine in zip(requests, writes))


# -- phase 7 -----------------------------------------------------------------------------------

def _state_dict_metadata(c: _Cols, fq: _Fqns, u: _Unique) -> SDM:
    md: SDM = {}
    cache: dict[tuple[int, ...], torch.Size] = {}
    for f, fqn in enumerate(c.names):
        if fq.kind[f] != int(ItemKind.TENSOR):
            md[fqn] = BytesStorageMetadata()
            continue
        nd, a, b = fq.nd[f], u.bounds[f], u.bounds[f + 1]
        seg = u.sizes[a:b, :nd]
        radix = [int(seg[:, d].max()) + 1 for d in range(nd)] if b > a else []
        if nd and b - a > 1 and math.prod(radix) < (1 << 62):  # few distinct sizes: one torch.Size each
            key = seg[:, 0].clone()  # rows as one integer each (torch.unique(dim=0) is slow)
            for d in range(1, nd):
                key = key * radix[d] + seg[:, d]
            _, inverse = torch.unique(key, return_inverse=True)
            distinct = seg[_first_of(inverse, int(inverse.max()) + 1)]
            shared = [shared_size(cache, tuple(z)) for z in distinct.tolist()]
            sizes = [shared[j] for j in inverse.tolist()]
        else:
            sizes = [shared_size(cache, tuple(z)) for z in seg.tolist()]
        md[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype_from_name(c.dt_names[fq.dtype[f]] or "float32")),
            size=torch.Size(fq.gsize[f][:nd]),
            chunks=list(map(ChunkStorageMetadata, map(torch.Size, u.offs[a:b, :nd].tolist()), sizes)),
        )
    return md
