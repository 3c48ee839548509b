"""The sketch of a cooperative load: which byte ranges might be needed by more than one rank,
found with one small ``all_reduce`` instead of gathering every rank's list.

Each rank hashes the keys of the records it would share (``(file, offset, length, checkpoint)``,
each once)
into :data:`BUCKETS` counters and adds one to each; slot :data:`BUCKETS` counts the ranks that
failed before reading; the last two slots add a 16-bit hash ``h`` of the rank's host and
``h * h``, from which every rank learns whether the job spans more than one host
(:func:`hosts_differ`: the hashes' variance is zero only when they are all equal). After the
``all_reduce(SUM)`` (in :meth:`Channel.all_reduce_sum`, int64), a record can be needed by two
ranks only if its bucket holds two or more: no bucket above one proves that no range is shared
(no false negative), and the load goes on with no other collective. A collision only costs
the gather of the candidate keys that follows. Two host names with the same hash look like one
host: a local-files load then does not cooperate (it reads as it would without).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

#: Counters of the sketch (8 bytes each, with three more slots: a 32 KiB ``all_reduce``).
BUCKETS = 4096
_FAILED, _HOST, _HOST_SQ = BUCKETS, BUCKETS + 1, BUCKETS + 2

#: ``(file, offset, length, digest of the checkpoint's location)``.
Key = tuple[str, int, int, int]


def bucket_of(key: Key) -> int:
    """The counter of ``key``, the same in every process (no per-process hash seed)."""
    return zlib.crc32(f"{key[0]}\0{key[1]}\0{key[2]}\0{key[3]}".encode()) % BUCKETS


def host_hash(host: str) -> int:
    return zlib.crc32(host.encode()) & 0xFFFF


def sketch_of(keys: Iterable[Key] | None, host: str = "") -> list[int]:
    """This rank's contribution: one per bucket of its distinct ``keys``; ``None``: this rank
    failed; and its ``host``'s hash (see the module docstring)."""
    counts = [0] * (BUCKETS + 3)
    h = host_hash(host)
    counts[_HOST], counts[_HOST_SQ] = h, h * h
    if keys is None:
        counts[_FAILED] = 1
        return counts
    for b in {bucket_of(k) for k in keys}:
        counts[b] += 1
    return counts


def hosts_differ(summed: list[int], ranks: int) -> bool:
    """Whether the ``ranks`` contributions of ``summed`` came from more than one host (by hash)."""
    return ranks * summed[_HOST_SQ] - summed[_HOST] ** 2 != 0


def candidates(keys: Iterable[Key], summed: list[int]) -> list[Key]:
    """The keys of ``keys`` whose bucket shows two or more ranks (possibly shared)."""
    return sorted(k for k in set(keys) if summed[bucket_of(k)] >= 2)


def failed_ranks(summed: list[int]) -> int:
    return summed[_FAILED]


def any_shared(summed: list[int]) -> bool:
    return any(c >= 2 for c in summed[:BUCKETS])
