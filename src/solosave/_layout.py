"""Deterministic layout: who writes each item, which file it goes to, and the global Metadata.

Everything here is a pure function of the *structure* (keys, shapes, dtypes, world size,
``workers``), never of the values, so the byte layout of a save is reproducible and a prepared
metadata stays valid. Used by the coordinator on the collective path and by every rank's
background worker when bucketing; no I/O and no collectives here.
"""

from __future__ import annotations

import functools
import gc
import heapq
import math
import operator
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ._plan import ItemKey, ItemKind, ItemSpec, dtype_from_name

P = ParamSpec("P")
R = TypeVar("R")

#: DCP's on-disk format version written into ``Metadata.version``.
DCP_VERSION = "1.0.0"


def file_name(rank: int, n: int) -> str:
    return f"__{rank}_{n}.distcp"


def parse_file_name(name: str) -> tuple[int, int] | None:
    """``"__3_1.distcp"`` -> ``(3, 1)``; ``None`` for anything else."""
    if not (name.startswith("__") and name.endswith(".distcp")):
        return None
    parts = name[2:-len(".distcp")].split("_")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def storage_index(spec_key: ItemKey) -> MetadataIndex:
    fqn, offsets = spec_key
    return MetadataIndex(fqn, offsets) if offsets is not None else MetadataIndex(fqn)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while building millions of small objects.

    The coordinator's structures hold no reference cycles; with the collector on, its
    generation-2 passes over the growing heap took about 40% of a large global plan build
    (measured by the scale simulation). Reference counting still frees everything.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _without_gc(fn: Callable[P, R]) -> Callable[P, R]:
    @functools.wraps(fn)
    def inner(*args: P.args, **kwargs: P.kwargs) -> R:
        with gc_paused():
            return fn(*args, **kwargs)
    return inner


def index_key(index: MetadataIndex) -> ItemKey:
    return (index.fqn, tuple(index.offset) if index.offset is not None else None)


# ---------------------------------------------------------------------------------------------
# Who writes what
# ---------------------------------------------------------------------------------------------

@_without_gc
def assign_writers(
    staged: Sequence[Iterable[ItemSpec]],
    prefer: Mapping[ItemKey, int] | None = None,
) -> list[list[ItemSpec]]:
    """Choose one writer per item among the ranks that staged it.

    Items held by one rank go to it. Replicated items are visited in a fixed order (largest
    first, then by key) and each goes to the holder with the fewest bytes assigned so far (ties:
    lowest rank), unless ``prefer`` names a holder (a rank that already wrote it). Returns the
    per-rank items, each list sorted by key. Linear in the items plus a sort of the replicated
    ones.
    """
    first: dict[ItemKey, int] = {}
    multi: dict[ItemKey, list[int]] = {}
    out: list[list[ItemSpec]] = []
    for rank, specs in enumerate(staged):
        mine: list[ItemSpec] = []
        for s in specs:
            k = (s.fqn, s.offsets)
            r0 = first.setdefault(k, rank)
            if r0 == rank:
                mine.append(s)
            elif k in multi:
                multi[k].append(rank)
            else:
                multi[k] = [r0, rank]
        out.append(mine)
    spec_of: dict[ItemKey, ItemSpec] = {}
    if multi:  # take replicated items back from their first holder; placed below
        for r in {hs[0] for hs in multi.values()}:
            keep = []
            for s in out[r]:
                k = (s.fqn, s.offsets)
                if k in multi:
                    spec_of[k] = s
                else:
                    keep.append(s)
            out[r] = keep
    load = [sum(max(s.nbytes, 1) for s in lst) for lst in out]
    order = sorted(multi, key=lambda k: (-spec_of[k].nbytes, k[0], k[1] or ()))
    for k in order:
        hs = multi[k]
        p = prefer.get(k) if prefer else None
        r = p if p is not None and p in hs else min(hs, key=lambda x: (load[x], x))
        out[r].append(spec_of[k])
        load[r] += max(spec_of[k].nbytes, 1)
    by_key = operator.attrgetter("fqn", "offsets")  # offsets differ only between tensor chunks
    for lst in out:
        lst.sort(key=by_key)
    return out


def _sort_key(s: ItemSpec) -> tuple:
    return (s.fqn, s.offsets or ())


def bucket_items(items: Sequence[ItemSpec], workers: int) -> list[list[ItemSpec]]:
    """Split one rank's items into ``workers`` files, deterministically.

    BYTES items go round-robin by key; tensors, largest first (ties by key), each to the file
    with the fewest bytes so far (ties: lowest file). Within a file: BYTES items first, then
    tensors, each group in key order, which fixes every offset given the record lengths.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    byte_items = sorted((s for s in items if s.kind is ItemKind.BYTES), key=_sort_key)
    tensors = sorted((s for s in items if s.kind is ItemKind.TENSOR),
                     key=lambda s: (-s.nbytes, s.fqn, s.offsets or ()))
    buckets: list[list[ItemSpec]] = [[] for _ in range(workers)]
    sizes = [0] * workers
    for i, s in enumerate(byte_items):
        buckets[i % workers].append(s)
    for s in tensors:
        j = min(range(workers), key=lambda b: (sizes[b], b))
        buckets[j].append(s)
        sizes[j] += s.nbytes
    return [sorted(b, key=lambda s: (int(s.kind is ItemKind.TENSOR), s.fqn, s.offsets or ()))
            for b in buckets]


# ---------------------------------------------------------------------------------------------
# The global Metadata
# ---------------------------------------------------------------------------------------------

class PlanValidationError(ValueError):
    """The ranks' items do not form a consistent global checkpoint."""


class _TensorGroup:
    """The chunks of one tensor seen so far, while merging the ranks' items."""

    __slots__ = ("size", "dtype", "chunks", "bad")

    def __init__(self, size: tuple[int, ...], dtype: str | None) -> None:
        self.size = size
        self.dtype = dtype
        self.chunks: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.bad = False


_BYTES = object()


@_without_gc
def build_state_dict_metadata(all_specs: Iterable[ItemSpec]) -> dict[str, TensorStorageMetadata | BytesStorageMetadata]:
    """Merge every rank's items (duplicates of replicated items allowed) into DCP's
    ``state_dict_metadata`` and validate each tensor's chunks (see :func:`validate_chunks`).

    Linear in the items, plus one sort of each tensor's chunks: O(n log n) in the chunks. Equal
    chunk sizes share one ``torch.Size`` (smaller ``.metadata``, fewer objects to load).
    """
    groups: dict[str, _TensorGroup | object] = {}
    errors: list[str] = []
    for s in all_specs:
        g = groups.get(s.fqn)
        if g is None:
            if s.kind is ItemKind.BYTES:
                groups[s.fqn] = _BYTES
                continue
            if s.global_size is None or s.offsets is None or s.sizes is None:
                raise PlanValidationError(f"{s.fqn!r}: a tensor item without offsets/sizes")
            g = groups[s.fqn] = _TensorGroup(s.global_size, s.dtype)
        elif (g is _BYTES) != (s.kind is ItemKind.BYTES):
            if g is not _BYTES and not g.bad:  # type: ignore[union-attr]
                g.bad = True  # type: ignore[union-attr]
            errors.append(f"{s.fqn!r} is a tensor on some ranks and a non-tensor on others")
            continue
        if g is _BYTES:
            continue
        if g.bad:  # type: ignore[union-attr]
            continue
        if s.global_size != g.size or s.dtype != g.dtype:  # type: ignore[union-attr]
            g.bad = True  # type: ignore[union-attr]
            errors.append(f"{s.fqn!r} has size {list(g.size)} {g.dtype} on one rank "  # type: ignore[union-attr]
                          f"and {list(s.global_size or ())} {s.dtype} on another")
            continue
        prev = g.chunks.setdefault(s.offsets, s.sizes)  # type: ignore[union-attr,arg-type]
        if prev != s.sizes:
            g.bad = True  # type: ignore[union-attr]
            errors.append(f"{s.fqn!r}: the chunk at {list(s.offsets or ())} has size {list(prev)} on "
                          f"one rank and {list(s.sizes or ())} on another")
    md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    sizes_cache: dict[tuple[int, ...], torch.Size] = {}
    for fqn, g in groups.items():
        if g is _BYTES:
            md[fqn] = BytesStorageMetadata()
            continue
        assert isinstance(g, _TensorGroup)  # noqa: S101 - the two kinds of group
        if g.bad:
            continue
        chunks = sorted(g.chunks.items())
        errors.extend(validate_chunks(fqn, g.size, chunks))
        md[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype_from_name(g.dtype or "float32")),
            size=torch.Size(g.size),
            chunks=[ChunkStorageMetadata(offsets=torch.Size(off), sizes=_shared_size(sizes_cache, sz))
                    for off, sz in chunks],
        )
    if errors:
        shown = "; ".join(errors[:20]) + (f"; ... ({len(errors)} errors)" if len(errors) > 20 else "")
        raise PlanValidationError(f"the ranks' state dicts do not form one checkpoint: {shown}")
    return md


def _shared_size(cache: dict[tuple[int, ...], torch.Size], t: tuple[int, ...]) -> torch.Size:
    size = cache.get(t)
    if size is None:
        size = cache[t] = torch.Size(t)
    return size


def validate_chunks(fqn: str, size: tuple[int, ...],
                    chunks: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[str]:
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
    errors: list[str] = []
    nd = len(size)
    if nd == 0:
        if len(chunks) != 1:
            errors.append(f"{fqn!r}: a 0-d tensor must have exactly one chunk, found {len(chunks)}")
        return errors
    if len(chunks) >= _VECTOR_MIN:
        verdict = _validate_disjoint_along_one_dim(fqn, size, chunks)
        if verdict is not None:
            return verdict
    total = math.prod(size)
    vol = 0
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for off, sz in chunks:
        if len(off) != nd or len(sz) != nd:
            errors.append(f"{fqn!r}: chunk at {list(off)} has {len(off)} dims, tensor has {nd}")
            return errors
        if any(o < 0 or n < 0 or o + n > d for o, n, d in zip(off, sz, size)):
            errors.append(f"{fqn!r}: chunk at {list(off)} of size {list(sz)} lies outside the "
                          f"tensor of size {list(size)}")
        v = math.prod(sz)
        vol += v
        if v > 0:
            boxes.append((off, sz))
    overlaps = 0
    if len(boxes) > 1:
        dim = max(range(nd), key=lambda d: (len({b[0][d] for b in boxes}), size[d], -d))
        boxes.sort(key=lambda b: (b[0][dim], b[0]))
        open_: list[tuple[int, int]] = []  # (end along dim, box index): a heap
        for i, (off, sz) in enumerate(boxes):
            start = off[dim]
            while open_ and open_[0][0] <= start:
                heapq.heappop(open_)
            for _, j in open_:
                o2, s2 = boxes[j]
                if all(a < b + lb and b < a + la for a, la, b, lb in zip(off, sz, o2, s2)):
                    overlaps += 1
                    errors.append(f"{fqn!r}: chunks at {list(o2)} and {list(off)} overlap")
                    if overlaps >= 3:
                        return errors
            heapq.heappush(open_, (start + sz[dim], i))
    if not overlaps and vol != total:
        errors.append(f"{fqn!r}: chunks cover {vol} of {total} elements (a gap)")
    return errors


#: From this many chunks on, :func:`validate_chunks` first tries the vectorized check.
_VECTOR_MIN = 32


def _validate_disjoint_along_one_dim(fqn: str, size: tuple[int, ...],
                                     chunks: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[str] | None:
    """The common case of :func:`validate_chunks`, vectorized: every chunk in bounds and the
    non-empty chunks disjoint along one dimension (1-D sharding) -> ``[]`` or the gap error.
    ``None`` when undecided (a bound violated, chunks sharing positions along every dimension,
    as in a grid or an overlap): the exact sweep then decides and words the errors."""
    nd = len(size)
    if any(len(o) != nd or len(z) != nd for o, z in chunks):
        return None
    offs = torch.tensor([o for o, _ in chunks], dtype=torch.int64).reshape(len(chunks), nd)
    sizes = torch.tensor([z for _, z in chunks], dtype=torch.int64).reshape(len(chunks), nd)
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
    total = math.prod(size)
    return [] if vol == total else [f"{fqn!r}: chunks cover {vol} of {total} elements (a gap)"]


@_without_gc
def build_metadata(
    state_dict_metadata: Mapping[str, TensorStorageMetadata | BytesStorageMetadata],
    results: Iterable[tuple[ItemKey, str, int, int]],
    planner_data: Mapping[str, tuple] | None,
) -> Metadata:
    """Assemble DCP ``Metadata`` from the merged items and the write results
    ``(key, relative_path, offset, length)``; ``storage_meta`` is set at publish time.

    Each ``storage_data`` key reuses the string of its ``state_dict_metadata`` entry and the
    ``torch.Size`` of its chunk's offsets, with the chunk's position as index hint: equal values
    to what DCP builds, but shared objects, so the pickle stores them once (a smaller
    ``.metadata`` that every loading rank unpickles faster).
    """
    hints: dict[str, tuple[str, dict[tuple[int, ...], tuple[int, torch.Size]] | None]] = {}
    for fqn, m in state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            hints[fqn] = (fqn, {tuple(c.offsets): (i, c.offsets) for i, c in enumerate(m.chunks)})
        else:
            hints[fqn] = (fqn, None)
    paths: dict[str, str] = {}
    storage_data: dict[MetadataIndex, _StorageInfo] = {}
    for key, rel, off, length in results:
        fqn, offsets = key
        name, chunks = hints.get(fqn, (fqn, None))
        hit = chunks.get(offsets) if chunks is not None and offsets is not None else None
        if hit is not None:
            idx = MetadataIndex(name, None, hit[0])
            # MetadataIndex copies offsets into a new torch.Size; share the chunk's instead.
            object.__setattr__(idx, "offset", hit[1])
        elif offsets is not None:
            idx = MetadataIndex(name, offsets)
        else:
            idx = MetadataIndex(name)
        storage_data[idx] = _StorageInfo(paths.setdefault(rel, rel), off, length)
    return Metadata(
        state_dict_metadata=dict(state_dict_metadata),
        planner_data=dict(planner_data or {}),
        storage_data=storage_data,
        storage_meta=None,
        version=DCP_VERSION,
    )


def check_results_cover(state_dict_metadata: Mapping[str, object],
                        results: Iterable[tuple[ItemKey, str, int, int]]) -> list[str]:
    """Every item/chunk of the metadata has exactly one write result, and nothing else does."""
    expected: set[ItemKey] = set()
    for fqn, m in state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            expected.update((fqn, tuple(c.offsets)) for c in m.chunks)
        else:
            expected.add((fqn, None))
    got: dict[ItemKey, int] = defaultdict(int)
    for key, *_ in results:
        got[key] += 1
    problems = [f"{k[0]}@{list(k[1]) if k[1] is not None else ''} was not written"
                for k in sorted(expected - set(got), key=_key_sort)]
    problems += [f"{k[0]} written {n} times" for k, n in got.items() if n > 1]
    problems += [f"{k[0]} was written but is not in the plan" for k in set(got) - expected]
    return problems


def _key_sort(k: ItemKey) -> tuple:
    return (k[0], k[1] or ())


# ---------------------------------------------------------------------------------------------
# The layout guard (reuse mode, every rank, locally)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class PlacedItem:
    """Where the prepared metadata puts one item: file, offset and length."""

    key: ItemKey
    relative_path: str
    offset: int
    length: int


def check_layout(expected: Sequence[PlacedItem],
                 written: Iterable[tuple[ItemKey, str, int, int]]) -> list[str]:
    """Compare this rank's write results with the prepared layout, in both directions.

    Forward: every written item must be in the prepared layout at the same
    ``(relative_path, offset, length)``. Reverse: every item the prepared metadata places in this
    rank's files must have been written. Returns one message per drifted item (empty: ok).
    """
    want = {p.key: p for p in expected}
    seen: set[ItemKey] = set()
    drifts: list[str] = []
    for key, rel, off, length in written:
        name = _key_name(key)
        p = want.get(key)
        if p is None:
            drifts.append(f"{name}: written to {rel}@{off} but absent from the prepared metadata")
            continue
        seen.add(key)
        if p.relative_path != rel:
            drifts.append(f"{name}: written to {rel}, prepared in {p.relative_path}")
        elif p.length != length:
            drifts.append(f"{name}: length {length} != prepared {p.length}")
        elif p.offset != off:
            drifts.append(f"{name}: offset {off} != prepared {p.offset} in {rel}")
    for key in want.keys() - seen:
        p = want[key]
        drifts.append(f"{_key_name(key)}: prepared in {p.relative_path}@{p.offset} but not written")
    return drifts


def _key_name(key: ItemKey) -> str:
    fqn, offsets = key
    return fqn if offsets is None or not any(offsets) else f"{fqn}@{list(offsets)}"
