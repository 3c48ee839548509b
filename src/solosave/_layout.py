"""Deterministic layout: who writes each item, which file it goes to, and the global Metadata.

Everything here is a pure function of the *structure* (keys, shapes, dtypes, world size,
``workers``), never of the values, so the byte layout of a save is reproducible and a prepared
metadata stays valid. Used by the coordinator on the collective path and by every rank's
background worker when bucketing; no I/O and no collectives here.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

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


def index_key(index: MetadataIndex) -> ItemKey:
    return (index.fqn, tuple(int(o) for o in index.offset) if index.offset is not None else None)


# ---------------------------------------------------------------------------------------------
# Who writes what
# ---------------------------------------------------------------------------------------------

def assign_writers(
    staged: Sequence[Iterable[ItemSpec]],
    prefer: Mapping[ItemKey, int] | None = None,
) -> list[list[ItemSpec]]:
    """Choose one writer per item among the ranks that staged it.

    Items held by one rank go to it. Replicated items are visited in a fixed order (largest
    first, then by key) and each goes to the holder with the fewest bytes assigned so far (ties:
    lowest rank), unless ``prefer`` names a holder (a rank that already wrote it). Returns the
    per-rank items, each list sorted by key.
    """
    holders: dict[ItemKey, list[int]] = defaultdict(list)
    spec_of: dict[ItemKey, ItemSpec] = {}
    for rank, specs in enumerate(staged):
        for s in specs:
            holders[s.key].append(rank)
            spec_of.setdefault(s.key, s)
    load = [0] * len(staged)
    out: list[list[ItemSpec]] = [[] for _ in staged]
    single = [k for k, h in holders.items() if len(h) == 1]
    for k in single:
        r = holders[k][0]
        out[r].append(spec_of[k])
        load[r] += max(spec_of[k].nbytes, 1)
    multi = [k for k, h in holders.items() if len(h) > 1]
    multi.sort(key=lambda k: (-spec_of[k].nbytes, k[0], k[1] or ()))
    for k in multi:
        hs = holders[k]
        p = prefer.get(k) if prefer else None
        r = p if p is not None and p in hs else min(hs, key=lambda x: (load[x], x))
        out[r].append(spec_of[k])
        load[r] += max(spec_of[k].nbytes, 1)
    for lst in out:
        lst.sort(key=_sort_key)
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


def build_state_dict_metadata(all_specs: Iterable[ItemSpec]) -> dict[str, TensorStorageMetadata | BytesStorageMetadata]:
    """Merge every rank's items (duplicates of replicated items allowed) into DCP's
    ``state_dict_metadata`` and validate each tensor's chunks (see :func:`validate_chunks`)."""
    md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    seen: set[ItemKey] = set()
    errors: list[str] = []
    for s in all_specs:
        if s.key in seen:
            continue
        seen.add(s.key)
        prev = md.get(s.fqn)
        if s.kind is ItemKind.BYTES:
            if prev is not None and not isinstance(prev, BytesStorageMetadata):
                errors.append(f"{s.fqn!r} is a tensor on some ranks and a non-tensor on others")
                continue
            md[s.fqn] = BytesStorageMetadata()
            continue
        assert s.global_size is not None and s.offsets is not None and s.sizes is not None  # noqa: S101 - spec invariant
        if prev is None:
            prev = md[s.fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype_from_name(s.dtype or "float32")),
                size=torch.Size(s.global_size),
                chunks=[],
            )
        elif not isinstance(prev, TensorStorageMetadata):
            errors.append(f"{s.fqn!r} is a tensor on some ranks and a non-tensor on others")
            continue
        elif tuple(prev.size) != s.global_size or prev.properties.dtype != dtype_from_name(s.dtype or ""):
            errors.append(f"{s.fqn!r} has size {list(prev.size)} {prev.properties.dtype} on one rank "
                          f"and {list(s.global_size)} {s.dtype} on another")
            continue
        prev.chunks.append(ChunkStorageMetadata(offsets=torch.Size(s.offsets), sizes=torch.Size(s.sizes)))
    for fqn, m in md.items():
        if isinstance(m, TensorStorageMetadata):
            m.chunks.sort(key=lambda c: tuple(c.offsets))
            errors.extend(validate_chunks(fqn, tuple(m.size), [(tuple(c.offsets), tuple(c.sizes)) for c in m.chunks]))
    if errors:
        shown = "; ".join(errors[:20]) + (f"; ... ({len(errors)} errors)" if len(errors) > 20 else "")
        raise PlanValidationError(f"the ranks' state dicts do not form one checkpoint: {shown}")
    return md


def validate_chunks(fqn: str, size: tuple[int, ...],
                    chunks: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[str]:
    """Check that ``chunks`` (offsets, sizes) tile a tensor of ``size`` exactly once.

    Bounds are checked per chunk; the total volume must equal the tensor's; overlaps are found
    with a sweep along the largest dimension (sorted by start, an active set pruned by end), which
    is O(n log n) when chunks do not overlap along that dimension (the usual 1-D/2-D sharding).
    Volume equality plus no overlap means no gap.
    """
    errors: list[str] = []
    if len(size) == 0:
        if len(chunks) != 1:
            errors.append(f"{fqn!r}: a 0-d tensor must have exactly one chunk, found {len(chunks)}")
        return errors
    total = math.prod(size)
    vol = 0
    for off, sz in chunks:
        if len(off) != len(size) or len(sz) != len(size):
            errors.append(f"{fqn!r}: chunk at {list(off)} has {len(off)} dims, tensor has {len(size)}")
            return errors
        if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(off, sz, size)):
            errors.append(f"{fqn!r}: chunk at {list(off)} of size {list(sz)} lies outside the "
                          f"tensor of size {list(size)}")
        vol += math.prod(sz)
    dim = max(range(len(size)), key=lambda d: size[d])
    order = sorted(range(len(chunks)), key=lambda i: (chunks[i][0][dim], chunks[i][0]))
    active: list[int] = []
    overlaps = 0
    for i in order:
        off, sz = chunks[i]
        start = off[dim]
        active = [j for j in active if chunks[j][0][dim] + chunks[j][1][dim] > start]
        for j in active:
            o2, s2 = chunks[j]
            if all(a < b + lb and b < a + la for a, la, b, lb in zip(off, sz, o2, s2)) and math.prod(sz) and math.prod(s2):
                overlaps += 1
                if overlaps <= 3:
                    errors.append(f"{fqn!r}: chunks at {list(off)} and {list(o2)} overlap")
        active.append(i)
    if not overlaps and vol != total:
        errors.append(f"{fqn!r}: chunks cover {vol} of {total} elements (a gap)")
    return errors


def build_metadata(
    state_dict_metadata: Mapping[str, TensorStorageMetadata | BytesStorageMetadata],
    results: Iterable[tuple[ItemKey, str, int, int]],
    planner_data: Mapping[str, tuple] | None,
) -> Metadata:
    """Assemble DCP ``Metadata`` from the merged items and the write results
    ``(key, relative_path, offset, length)``; ``storage_meta`` is set at publish time."""
    hints: dict[str, dict[tuple[int, ...], int]] = {}
    for fqn, m in state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            hints[fqn] = {tuple(c.offsets): i for i, c in enumerate(m.chunks)}
    storage_data: dict[MetadataIndex, _StorageInfo] = {}
    for key, rel, off, length in results:
        fqn, offsets = key
        if offsets is None:
            idx = MetadataIndex(fqn)
        else:
            idx = MetadataIndex(fqn, offsets, hints.get(fqn, {}).get(offsets))
        storage_data[idx] = _StorageInfo(rel, off, length)
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
            expected.update((fqn, tuple(int(o) for o in c.offsets)) for c in m.chunks)
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
