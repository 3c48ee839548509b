"""The per-item reference planner and metadata builder: the test oracles of
``solosave._src.plan.global_plan`` and of ``solosave._src.plan.columns`` / ``plan/metadata_pickle`` / ``index/writer``.

One Python object per item and plain loops: slow at scale, easy to check by reading. The tests
assert that the columnar planner decides exactly what this one decides (metadata, writers and
the same error wording), and that the columnar ``.metadata`` unpickles equal to
:func:`build_metadata`'s.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

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

from solosave._src.coordination.protocol import ItemKind, ItemSpec, PackedSpecs, PlanRequest, WriteResult
from solosave._src.core.errors import PlanValidationError
from solosave._src.core.gc_pause import gc_paused
from solosave._src.formats.dcp import METADATA_VERSION, ItemKey, dtype_from_name, item_key
from solosave._src.plan.chunks import validate_chunks
from solosave._src.plan.columns import ChunkTable, ResultColumns
from solosave._src.plan.layout import check_results_cover, shared_size
from solosave._src.prepared.convert import _chunk_sizes, _rows_of, columns_from_rows
from solosave._src.prepared.sections import VERSION, _template_section, build_prepared, structure_of


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


class _TensorGroup:
    """The chunks of one tensor seen so far, while merging the ranks' items."""

    __slots__ = ("size", "dtype", "chunks", "bad")

    def __init__(self, size: tuple[int, ...], dtype: str | None) -> None:
        self.size = size
        self.dtype = dtype
        self.chunks: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.bad = False


_BYTES = object()


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
            chunks=[ChunkStorageMetadata(offsets=torch.Size(off), sizes=shared_size(sizes_cache, sz))
                    for off, sz in chunks],
        )
    if errors:
        shown = "; ".join(errors[:20]) + (f"; ... ({len(errors)} errors)" if len(errors) > 20 else "")
        raise PlanValidationError(f"the ranks' state dicts do not form one checkpoint: {shown}")
    return md




def unpack_specs(packed: PackedSpecs) -> list[ItemSpec]:
    """The :class:`ItemSpec` objects of a ``pack_specs`` payload (``owner`` is not sent): the
    per-item reading of the columns that ``global_plan`` reads as arrays."""
    kind_of = tuple(ItemKind)
    out = []
    pos = 0
    for i, fqn in enumerate(packed.fqns):
        nd = packed.ndims[i]
        if nd < 0:
            o = z = g = None
        else:
            nums = packed.numbers
            o = tuple(nums[pos:pos + nd])
            z = tuple(nums[pos + nd:pos + 2 * nd])
            g = tuple(nums[pos + 2 * nd:pos + 3 * nd])
            pos += 3 * nd
        out.append(ItemSpec(fqn, kind_of[packed.kinds[i]], o, z, g,
                            packed.dtype_table[packed.dtype_index[i]], packed.nbytes[i]))
    return out


def oracle_plan(requests: Sequence[PlanRequest]) -> tuple[dict, list[list[int]]]:
    """``(state_dict_metadata, writes)`` as ``global_plan`` decides them, per item."""
    held = [unpack_specs(r.specs) for r in requests]
    staged = [[held[r][i] for i in (req.staged if req.staged is not None else range(len(held[r])))]
              for r, req in enumerate(requests)]
    sdm = build_state_dict_metadata(s for specs in held for s in specs)
    keys = {s.key for specs in staged for s in specs}
    nobody = {s.key for specs in held for s in specs} - keys
    if nobody:
        raise PlanValidationError(f"{len(nobody)} item(s) were staged by no rank")
    prefer: dict[ItemKey, int] = {}
    for r, req in enumerate(requests):
        for i in req.prewritten.positions if req.prewritten is not None else ():
            prefer.setdefault(held[r][i].key, r)
    assigned = assign_writers(staged, prefer)
    writes = []
    for r, specs in enumerate(held):
        pos = {s.key: i for i, s in enumerate(specs)}
        writes.append(sorted(pos[s.key] for s in assigned[r]))
    return sdm, writes


def finish_metadata(state_dict_metadata: Mapping[str, Any], results: Sequence[WriteResult], planner_data: Mapping) -> Metadata:
    """The ``Metadata`` of a collective save from its plan and every rank's write results
    (keys normalised); raises :class:`PlanValidationError` if they do not cover the plan."""
    problems = check_results_cover(state_dict_metadata, results)
    if problems:
        raise PlanValidationError("write results do not cover the plan: " + "; ".join(problems[:10]))
    with gc_paused():
        return build_metadata(state_dict_metadata, results, planner_data)


def build_metadata(state_dict_metadata: Mapping[str, TensorStorageMetadata | BytesStorageMetadata],
                   results: Iterable[WriteResult], planner_data: Mapping | None) -> Metadata:
    """Assemble DCP ``Metadata`` from the merged items and the write results; ``storage_meta``
    is set at publish time.

    Each ``storage_data`` key reuses the string of its ``state_dict_metadata`` entry and the
    ``torch.Size`` of its chunk's offsets, with the chunk's position as index hint: equal values
    to what DCP builds, but shared objects, so the pickle stores them once (a smaller
    ``.metadata`` that every loading rank unpickles faster).
    """
    hints: dict[str, tuple[str, dict | None]] = {}
    for fqn, m in state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            hints[fqn] = (fqn, {tuple(c.offsets): (i, c.offsets) for i, c in enumerate(m.chunks)})
        else:
            hints[fqn] = (fqn, None)
    paths: dict[str, str] = {}
    storage_data: dict[MetadataIndex, _StorageInfo] = {}
    for (fqn, offsets), rel, off, length in results:
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
    return Metadata(state_dict_metadata=dict(state_dict_metadata), planner_data=dict(planner_data or {}),
                    storage_data=storage_data, storage_meta=None, **METADATA_VERSION)


def result_columns(table: ChunkTable, sdm: Mapping[str, Any],
                   results_by_rank: Sequence[Sequence[WriteResult] | None]) -> ResultColumns:
    """Keyed write results (``results_by_rank[r]``: rank ``r``'s ``(key, file, offset, length)``
    rows) as the coordinator's ``ResultColumns``, one row at a time: the reference for
    ``_results.placed_columns``; raises ``PlanValidationError`` like it."""
    rows = [(item_key(*k), rel, int(off), int(n)) for rs in results_by_rank for k, rel, off, n in rs or ()]
    problems = check_results_cover(sdm, rows)
    if problems:
        raise PlanValidationError("write results do not cover the plan: " + "; ".join(problems[:10]))
    ids = {}
    for f, fqn in enumerate(table.names):
        a, b = table.bounds[f], table.bounds[f + 1]
        if table.nd[f] < 0:
            ids[(fqn, None)] = a
            continue
        for i, o in enumerate(table.offs[a:b, :table.nd[f]].tolist()):
            ids[(fqn, tuple(o))] = a + i
    file_of: dict[str, int] = {}
    ranks = [r for r, rs in enumerate(results_by_rank) for _ in rs or ()]

    def col(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    return ResultColumns(col([ids[k] for k, *_ in rows]), col(ranks),
                         col([file_of.setdefault(rel, len(file_of)) for _, rel, _, _ in rows]),
                         col([r[2] for r in rows]), col([r[3] for r in rows]), list(file_of), len(results_by_rank))


def prepared_from_results(state_dict_metadata: Mapping[str, Any], results_by_rank: Sequence[Iterable[tuple]],
                          template: Any, storage_meta: tuple[str, str] | None, fields: dict[str, Any]) -> bytes:
    """A prepared file made from a collective save's plan, every rank's write results
    (``results_by_rank[r]``: rank ``r``'s ``(key, file, offset, length)`` rows) and the template
    it publishes, one row at a time: the reference for ``_results.prepared_from_columns``."""
    sizes = _chunk_sizes(state_dict_metadata)
    rank_rows = []
    for rows in results_by_rank:
        files: dict[str, list] = defaultdict(list)
        for key, rel, off, n in rows:
            files[rel].append((key[0], key[1], off, n, sizes.get(key) if key[1] is not None else None))
        rank_rows.append(_rows_of(files))
    structure = structure_of(state_dict_metadata)
    return build_prepared({**fields, "format_version": VERSION}, structure,
                          columns_from_rows(list(structure), rank_rows), _template_section(template),
                          storage_meta)[0]
