"""The sketch of a cooperative load: which byte ranges might be needed by more than one rank,
found with one small ``all_reduce`` instead of gathering every rank's list.

Each rank hashes the keys of the records it would share (``(file, offset, length)``, each once)
into :data:`BUCKETS` counters and adds one to each; slot :data:`BUCKETS` counts the ranks that
failed before reading. After the ``all_reduce(SUM)`` (in :meth:`Channel.all_reduce_sum`), a
record can be needed by two ranks only if its bucket holds two or more: no bucket above one
proves that no range is shared (no false negative), and the load goes on with no other
collective. A collision only costs the gather of the candidate keys that follows.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

#: Counters of the sketch (4 bytes each: a 16 KiB ``all_reduce``).
BUCKETS = 4096

Key = tuple[str, int, int]


def bucket_of(key: Key) -> int:
    """The counter of ``key``, the same in every process (no per-process hash seed)."""
    return zlib.crc32(f"{key[0]}\0{key[1]}\0{key[2]}".encode()) % BUCKETS


def sketch_of(keys: Iterable[Key] | None) -> list[int]:
    """This rank's contribution: one per bucket of its distinct ``keys``; ``None``: this rank
    failed (the last slot)."""
    counts = [0] * (BUCKETS + 1)
    if keys is None:
        counts[BUCKETS] = 1
        return counts
    for b in {bucket_of(k) for k in keys}:
        counts[b] += 1
    return counts


def candidates(keys: Iterable[Key], summed: list[int]) -> list[Key]:
    """The keys of ``keys`` whose bucket shows two or more ranks (possibly shared)."""
    return sorted(k for k in set(keys) if summed[bucket_of(k)] >= 2)


def failed_ranks(summed: list[int]) -> int:
    return summed[BUCKETS]


def any_shared(summed: list[int]) -> bool:
    return any(c >= 2 for c in summed[:BUCKETS])
