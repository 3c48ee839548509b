"""The key directory of a prepared file: which bucket a key ``(fqn, chunk offsets)`` falls in.

A rank holding an item that another rank writes (a replica, an empty trailing chunk) checks
that the prepared metadata places it by reading the one directory bucket of its key
(``prepared/sections``). :func:`key_bucket` hashes one key (every rank, at start-up);
:func:`column_buckets` hashes many keys given as columns, with the same result (the
coordinator, writing a prepared file). Pure functions.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from solosave._src.formats.dcp import ItemKey
from solosave._src.plan.columns import distinct_rows

#: Keys per directory bucket (a rank looking up one key reads about 1 KiB).
BUCKET_KEYS = 16


def key_bucket(key: ItemKey, buckets: int) -> int:
    """The directory bucket of ``key`` (stable across processes and runs)."""
    fqn, offsets = key
    text = fqn + "\x00" + ("-" if offsets is None else ",".join(map(str, offsets)))
    return zlib.crc32(text.encode("utf-8", "surrogatepass")) % buckets


def bucket_count(keys: int) -> int:
    """The number of directory buckets of a prepared file with ``keys`` keys."""
    return max(1, -(-keys // BUCKET_KEYS))




def column_buckets(names: Sequence[str], fid: torch.Tensor, nd: torch.Tensor, offs: torch.Tensor,
                   buckets: int) -> torch.Tensor:
    """:func:`key_bucket` of many keys given as columns: fqn id (into ``names``), dims (-1: a
    BYTES item) and zero-padded chunk offsets. CRC32 is affine in its start value:
    ``crc(text, seed) == crc(text, 0) ^ crc(zeros, seed) ^ crc(zeros, 0)`` for ``zeros`` of the
    text's length, so the CRC of each distinct offsets text and one term per (fqn, text length)
    give every key's."""
    if not fid.numel():
        return fid
    distinct, inverse = distinct_rows(torch.cat([(nd + 1)[:, None], offs], dim=1))
    texts = [("-" if r[0] == 0 else ",".join(map(str, r[1:r[0]]))).encode() for r in distinct.tolist()]
    text_crc = torch.tensor([zlib.crc32(t) for t in texts], dtype=torch.int64)
    lengths = sorted({len(t) for t in texts})
    length_id = torch.tensor([lengths.index(len(t)) for t in texts], dtype=torch.int64)
    seeds = [zlib.crc32((f + "\x00").encode("utf-8", "surrogatepass")) for f in names]
    shift = torch.tensor([[zlib.crc32(bytes(n), seed) ^ zlib.crc32(bytes(n)) for n in lengths] for seed in seeds],
                         dtype=torch.int64).reshape(len(seeds), len(lengths))
    crc = text_crc[inverse] ^ shift[fid, length_id[inverse]]
    return crc % buckets
