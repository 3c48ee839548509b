"""Write results as columns (coordinator, collective path; pure functions, no I/O).

At W=4096 ranks of a Llama-7B-like model a create save gathers 800k write results. Turning
each into normalised key tuples, a set and a dict of ``MetadataIndex``/``_StorageInfo`` objects
took most of ``finish`` (issue 15). Here the rows are matched to the plan's chunks with array
operations instead: :class:`ChunkTable` is the plan's chunks as columns (made by
``_global_plan`` from its own columns, or from a ``state_dict_metadata``), and
:func:`result_columns` gives every result row the id of its chunk and checks that the results
cover the plan exactly once. ``_metadata_pickle`` and ``_sections`` build the ``.metadata``
pickle and the prepared file from these columns.
"""

from __future__ import annotations

import math
import zlib
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ._layout import PlanValidationError, check_results_cover
from ._protocol import WriteResult, result_keys
from ._publish import MetadataTemplate
from ._sections import VERSION, _file_order, _template_section, bucket_count, build_prepared, structure_of


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


def _int_column(values: Sequence[int]) -> torch.Tensor:
    if not values:
        return torch.zeros(0, dtype=torch.int64)
    return torch.frombuffer(bytearray(array("q", values)), dtype=torch.int64)


def result_columns(table: ChunkTable, sdm: Mapping[str, object],
                   results_by_rank: Sequence[Sequence[WriteResult] | None]) -> ResultColumns:
    """Every rank's ``(key, file, offset, length)`` rows as columns matched to ``table``;
    raises :class:`PlanValidationError` (naming the items) unless every chunk of the plan has
    exactly one row and every row is a chunk of the plan."""
    counts = [len(rows or ()) for rows in results_by_rank]
    rows = [row for rs in results_by_rank for row in rs or ()]
    if rows:
        keys, rels, offsets, lengths = zip(*rows)
        fqns, chunk_offs = zip(*keys)
    else:
        rels = offsets = lengths = fqns = chunk_offs = ()
    file_of: dict[str, int] = {}
    file = [file_of.setdefault(rel, len(file_of)) for rel in rels]
    uid = _match(table, fqns, chunk_offs)
    if uid is None:
        uid = _match_slowly(table, sdm, rows)
    return ResultColumns(uid, torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int64),
                                                      torch.tensor(counts, dtype=torch.int64)),
                         _int_column(file), _int_column(offsets), _int_column(lengths), list(file_of),
                         len(counts))


def _match(table: ChunkTable, fqns: Sequence[str], offsets: Sequence) -> torch.Tensor | None:
    """The chunk id of each row, by array operations; ``None`` when a row does not match
    exactly one chunk, the coverage is not exact, or the keys do not fit in int64."""
    n, nc = len(fqns), table.n
    fid_of = {f: i for i, f in enumerate(table.names)}
    fid = torch.tensor([fid_of.get(f, -1) for f in fqns], dtype=torch.int64)
    nds = torch.tensor([-1 if o is None else len(o) for o in offsets], dtype=torch.int64)
    table_nd = torch.tensor(table.nd, dtype=torch.int64)
    if n != nc or (n and (bool((fid < 0).any()) or bool((nds != table_nd[fid]).any()))):
        return None
    if not n:
        return fid
    flat = _int_column(list(chain.from_iterable(o for o in offsets if o is not None)))
    rows = pad_rows(nds, flat, table.offs.shape[1])
    if bool((rows < 0).any()) or bool((table.offs < 0).any()):
        return None
    width = table.offs.shape[1]
    radix = [max(int(table.offs[:, d].max()), int(rows[:, d].max())) + 1 for d in range(width)]
    if math.prod(radix) * max(len(table.names), 1) >= (1 << 62):
        return None
    row_key, chunk_key = fid.clone(), table.fids()
    for d in range(width):
        row_key = row_key * radix[d] + rows[:, d]
        chunk_key = chunk_key * radix[d] + table.offs[:, d]
    sorted_keys, order = torch.sort(chunk_key)
    pos = torch.searchsorted(sorted_keys, row_key).clamp_(max=nc - 1)
    if not bool((sorted_keys[pos] == row_key).all()):
        return None
    uid = order[pos]
    if not bool((torch.bincount(uid, minlength=nc) == 1).all()):
        return None
    return uid


def pad_rows(nds: torch.Tensor, flat: torch.Tensor, width: int) -> torch.Tensor:
    """Rows of ``nds[i]`` values each (none for a negative count), concatenated in ``flat``, as
    a zero-padded ``(rows, width)`` tensor."""
    n = nds.numel()
    w = torch.clamp(nds, min=0)
    starts = torch.cumsum(w, 0) - w
    col = torch.arange(width, dtype=torch.int64)[None, :]
    values = torch.cat([flat, flat.new_zeros(1)])
    at = torch.where(col < w[:, None], starts[:, None] + col, flat.numel())
    return values[at] if n else torch.zeros((0, width), dtype=torch.int64)


def _match_slowly(table: ChunkTable, sdm: Mapping[str, object], rows: list) -> torch.Tensor:
    """The per-row path: the problems named by ``check_results_cover``, or the chunk ids by a
    dict (keys too large for the array path)."""
    keyed = result_keys(rows)
    problems = check_results_cover(sdm, keyed)
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
    return torch.tensor([ids[k] for k, *_ in keyed], dtype=torch.int64)


def prepared_from_columns(sdm: Mapping[str, object], table: ChunkTable, res: ResultColumns,
                          template: MetadataTemplate, storage_meta: tuple[str, str] | None,
                          fields: dict[str, Any], index_body: bytes | None = None) -> bytes:
    """The version-2 prepared file of a collective save (``_sections.prepared_from_results``)
    from the columns: rows sorted by rank, file and offset with array operations, then cut
    into each rank's files."""
    chunk_offs: list = [None] * table.n
    chunk_sizes: list = [None] * table.n
    for f, nd in enumerate(table.nd):
        a, b = table.bounds[f], table.bounds[f + 1]
        if nd >= 0:
            chunk_offs[a:b] = map(tuple, table.offs[a:b, :nd].tolist())
            chunk_sizes[a:b] = map(tuple, table.sizes[a:b, :nd].tolist())
    file_pos = torch.tensor([p for p, _ in sorted(enumerate(res.files), key=lambda x: _file_order(x[1]))],
                            dtype=torch.int64).argsort()
    order = sorted_rows(res.rank, file_pos[res.file] if res.n else res.file, res.offset)
    uid, rank, file = res.uid[order], res.rank[order], res.file[order]
    fids = table.fids()[uid].tolist()
    uids = uid.tolist()
    rows = list(zip([table.names[f] for f in fids], [chunk_offs[u] for u in uids], res.offset[order].tolist(),
                    res.length[order].tolist(), [chunk_sizes[u] for u in uids]))
    rank_rows: list[list[tuple[str, list]]] = [[] for _ in range(res.world)]
    cut = torch.nonzero((rank.diff() != 0) | (file.diff() != 0)).flatten().add(1).tolist() if res.n else []
    starts, ranks, files = [0] + cut, rank.tolist(), file.tolist()
    for a, b in zip(starts, cut + [res.n]):
        if b > a:
            rank_rows[ranks[a]].append((res.files[files[a]], rows[a:b]))
    n_buckets = bucket_count(res.n)
    bucket = chunk_buckets(table, n_buckets)[uid]
    in_bucket = torch.sort(bucket, stable=True)
    per = torch.bincount(in_bucket.values, minlength=n_buckets).tolist()
    keys = [(r[0], r[1]) for r in rows]
    keys = [keys[i] for i in in_bucket.indices.tolist()]
    bucket_keys, at = [], 0
    for k in per:
        bucket_keys.append(keys[at:at + k])
        at += k
    return build_prepared({**fields, "format_version": VERSION}, structure_of(sdm), rank_rows,
                          _template_section(template), storage_meta, bucket_keys, index_body)[0]


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


def chunk_buckets(table: ChunkTable, buckets: int) -> torch.Tensor:
    """``_sections.key_bucket`` of every chunk's key, by columns. CRC32 is affine in its
    start value: ``crc(text, seed) == crc(text, 0) ^ crc(zeros, seed) ^ crc(zeros, 0)`` for
    ``zeros`` of the text's length, so the CRC of each distinct offsets text and one term per
    (fqn, text length) give every key's."""
    fids = table.fids()
    nds = torch.tensor(table.nd, dtype=torch.int64)[fids] if table.n else fids
    distinct, inverse = distinct_rows(torch.cat([(nds + 1)[:, None], table.offs], dim=1))
    texts = [("-" if r[0] == 0 else ",".join(map(str, r[1:r[0]]))).encode() for r in distinct.tolist()]
    text_crc = torch.tensor([zlib.crc32(t) for t in texts], dtype=torch.int64)
    lengths = sorted({len(t) for t in texts})
    length_id = torch.tensor([lengths.index(len(t)) for t in texts], dtype=torch.int64)
    seeds = [zlib.crc32((f + "\x00").encode("utf-8", "surrogatepass")) for f in table.names]
    shift = torch.tensor([[zlib.crc32(bytes(n), seed) ^ zlib.crc32(bytes(n)) for n in lengths] for seed in seeds],
                         dtype=torch.int64).reshape(len(seeds), len(lengths))
    crc = text_crc[inverse] ^ shift[fids, length_id[inverse]]
    return crc % buckets


def sorted_rows(*columns: torch.Tensor) -> torch.Tensor:
    """The permutation that sorts rows by ``columns`` (the first is the most significant)."""
    order = torch.arange(columns[0].numel(), dtype=torch.int64)
    for col in reversed(columns):  # stable sorts, least significant first
        order = order[torch.sort(col[order], stable=True).indices]
    return order
