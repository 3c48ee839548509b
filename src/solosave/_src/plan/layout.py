"""Deterministic layout: which file each item goes to, the global ``Metadata`` built from write
results, and the layout guard of reuse saves (pure functions, no I/O, no collectives).

Everything here is a function of the *structure* (keys, shapes, dtypes, world size,
``workers``), never of the values, so the byte layout of a save is reproducible and a prepared
metadata stays valid. Who writes each item is decided in ``plan/global_plan.py``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    TensorStorageMetadata,
)

from solosave._src.coordination.protocol import ItemKind, ItemSpec, PlacedItem, WriteResult
from solosave._src.formats.dcp import ItemKey, key_name, key_sort

SDM = dict[str, TensorStorageMetadata | BytesStorageMetadata]


def shared_size(cache: dict[tuple[int, ...], torch.Size], t: tuple[int, ...]) -> torch.Size:
    """One ``torch.Size`` per distinct chunk size (a smaller ``.metadata``, fewer objects)."""
    size = cache.get(t)
    if size is None:
        size = cache[t] = torch.Size(t)
    return size


def bucket_items(items: Sequence[ItemSpec], workers: int) -> list[list[ItemSpec]]:
    """Split one rank's items into ``workers`` files, deterministically.

    BYTES items go round-robin by key; tensors, largest first (ties by key), each to the file
    with the fewest bytes so far (ties: lowest file). Within a file: BYTES items first, then
    tensors, each group in key order, which fixes every offset given the record lengths.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    byte_items = sorted((s for s in items if s.kind is ItemKind.BYTES), key=lambda s: key_sort(s.key))
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
# The global Metadata (coordinator, collective path)
# ---------------------------------------------------------------------------------------------

def check_results_cover(state_dict_metadata: Mapping[str, object],
                        results: Iterable[WriteResult]) -> list[str]:
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
                for k in sorted(expected - set(got), key=key_sort)]
    problems += [f"{k[0]} written {n} times" for k, n in got.items() if n > 1]
    problems += [f"{k[0]} was written but is not in the plan" for k in set(got) - expected]
    return problems


# ---------------------------------------------------------------------------------------------
# The layout guard (reuse mode, every rank, locally)
# ---------------------------------------------------------------------------------------------

def check_layout(expected: Sequence[PlacedItem], written: Iterable[WriteResult]) -> list[str]:
    """Compare this rank's write results with the prepared layout, in both directions.

    Forward: every written item must be in the prepared layout at the same
    ``(relative_path, offset, length)``. Reverse: every item the prepared metadata places in this
    rank's files must have been written. Returns one message per drifted item (empty: ok).
    """
    written = list(written)
    if written == [(p.key, p.relative_path, p.offset, p.length) for p in expected]:
        return []  # the usual case, in one comparison: every item where it was prepared, in order
    want = {p.key: p for p in expected}
    seen: set[ItemKey] = set()
    drifts: list[str] = []
    for key, rel, off, length in written:
        name = key_name(key)
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
        drifts.append(f"{key_name(key)}: prepared in {p.relative_path}@{p.offset} but not written")
    return drifts
