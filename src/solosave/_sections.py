"""The sectioned prepared-metadata format (version 2): every rank reads only its own part.

A prepared file used to be one pickle of the whole ``Metadata``, read and unpickled by every
rank at start-up (at W=4096, 114 MiB and ~25 s per rank). Version 2 cuts it into sections that
are found through fixed-width offset tables, so a rank reads a few kilobytes whatever the world
size::

    b"SOLOSAVE-PREPARED\\n"  b"2\\n"  <one JSON line: the header>  <body>

    body (offsets in the header and the tables are relative to its start):
      rank table      W entries of (offset u64, length u32, crc u32): rank r's section
      bucket table    B entries of the same form: the key directory
      structure       pickle: {fqn: (kind, dtype name, global size)} (O(number of keys))
      template        the ``.metadata`` pickle with placeholders (``MetadataTemplate``): only
                      the coordinator reads it, to publish
      index           the body of the load index beside every ``.metadata`` (``_index``)
      rank sections   pickle: [(file, [(fqn, offsets, offset, length, chunk sizes), ...]), ...]
      buckets         pickle: the keys ``(fqn, offsets)`` whose hash falls in the bucket

Who reads what: every rank the header, its table entry, its section and the structure (its
reuse plan); a rank holding an item written by another rank (a replica, an empty trailing
chunk) also the directory bucket of that key; the coordinator also the template and the index.

Integrity: each section's CRC32 is seeded with the file's random ``file_id``, so a section
that is corrupt, truncated, or read from a file replaced since its header was read fails its
check with a clear :class:`PreparedMetadataError`. Pickles are loaded through the allowlist.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import struct
import uuid
import zlib
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ._errors import PreparedMetadataError
from ._format import ItemKey, index_key, parse_file_name
from ._index import body_from_metadata
from ._layout import gc_paused
from ._protocol import PlacedItem
from ._publish import MetadataTemplate
from ._safe_pickle import safe_loads
from ._storage import pread_all

MAGIC = b"SOLOSAVE-PREPARED\n"
VERSION = 2
_ENTRY = struct.Struct("<QII")
#: Keys per directory bucket (a rank looking up one key reads about 1 KiB).
BUCKET_KEYS = 16
_HEAD_READ = 4096
_HEAD_MAX = 1 << 20
_FIX = "delete the file and recreate it (create_prepared_metadata=True or `solosave prepare`)"

#: One row of a rank section: fqn, chunk offsets (None: BYTES item), offset, length, chunk sizes.
Row = tuple[str, "tuple[int, ...] | None", int, int, "tuple[int, ...] | None"]


# ---------------------------------------------------------------------------------------------
# Sources: where the bytes come from (a local file, a URL, or bytes in memory)
# ---------------------------------------------------------------------------------------------

class Source:
    """Random access to a prepared file; counts the bytes it read (``bytes_read``)."""

    where: str = "memory"
    bytes_read: int = 0

    def read(self, offset: int, length: int) -> bytes:
        data = self._read(offset, length)
        self.bytes_read += len(data)
        return data

    def _read(self, offset: int, length: int) -> bytes:
        raise NotImplementedError


class BytesSource(Source):
    def __init__(self, data: bytes, where: str = "memory") -> None:
        self.data, self.where = data, where

    def _read(self, offset: int, length: int) -> bytes:
        return self.data[offset:offset + length]


class FileSource(Source):
    """A local file, read with ``pread`` (no seek shared between threads)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.where = os.fspath(path)

    def _read(self, offset: int, length: int) -> bytes:
        try:
            fd = os.open(self.where, os.O_RDONLY)
        except OSError as e:
            raise PreparedMetadataError(f"{self.where}: cannot read ({e})") from e
        try:
            return pread_all(fd, offset, length)
        finally:
            os.close(fd)


class StorageSource(Source):
    """A file behind an fsspec URL (ranged reads through the storage's ``open_read``)."""

    def __init__(self, url: str, options: Mapping[str, Any] | None = None) -> None:
        self.where, self.options = url, dict(options or {})

    def _read(self, offset: int, length: int) -> bytes:
        from ._storage import storage_for

        with storage_for(self.where, self.options).open_read(self.where) as f:
            f.seek(offset)
            return f.read(length)


def _crc(file_id: bytes, data: bytes) -> int:
    return zlib.crc32(data, zlib.crc32(file_id))


def key_bucket(key: ItemKey, buckets: int) -> int:
    """The directory bucket of ``key`` (stable across processes and runs)."""
    fqn, offsets = key
    text = fqn + "\x00" + ("-" if offsets is None else ",".join(map(str, offsets)))
    return zlib.crc32(text.encode("utf-8", "surrogatepass")) % buckets


def bucket_count(keys: int) -> int:
    """The number of directory buckets of a prepared file with ``keys`` keys."""
    return max(1, -(-keys // BUCKET_KEYS))


def key_buckets(keys: Iterable[ItemKey], buckets: int) -> list[int]:
    """``key_bucket`` of every key, for many keys: the CRC of each fqn and the text of each
    offsets tuple are computed once (800k keys at W=4096 share 200 fqns and few offsets)."""
    seeds: dict[str, int] = {}
    texts: dict[Any, bytes] = {}
    out = []
    for fqn, offsets in keys:
        seed = seeds.get(fqn)
        if seed is None:
            seed = seeds[fqn] = zlib.crc32((fqn + "\x00").encode("utf-8", "surrogatepass"))
        text = texts.get(offsets)
        if text is None:
            text = texts[offsets] = ("-" if offsets is None else ",".join(map(str, offsets))).encode()
        out.append(zlib.crc32(text, seed) % buckets)
    return out


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------

def structure_of(state_dict_metadata: Mapping[str, Any]) -> dict[str, tuple]:
    """``{fqn: (kind, dtype name, global size)}``: what a reuse plan checks every held item
    against (kind 0: tensor, 1: bytes, as ``ItemKind``)."""
    from ._format import dtype_name

    out: dict[str, tuple] = {}
    for fqn, m in state_dict_metadata.items():
        if hasattr(m, "chunks"):
            out[fqn] = (0, dtype_name(m.properties.dtype), tuple(int(s) for s in m.size))
        else:
            out[fqn] = (1, None, None)
    return out


def _dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=4)


def build_prepared(fingerprint: dict[str, Any], structure: dict[str, tuple],
                   rank_rows: Sequence[Sequence[tuple[str, Sequence[Row]]]],
                   template: tuple[bytes, tuple[int, int, int, int]] | None,
                   storage_meta: tuple[str, str] | None,
                   bucket_keys: list[list[ItemKey]] | None = None,
                   index_body: bytes | None = None) -> tuple[bytes, dict[str, Any]]:
    """The bytes of a version-2 prepared file and its header.

    ``fingerprint``: the JSON fields of the fingerprint, less ``structure_hash`` (computed
    here from the sections, so equal layouts give equal hashes); ``rank_rows[r]``: rank ``r``'s
    files, each with its rows in offset order; ``template``: the ``.metadata`` pickle with
    placeholders and ``(i, len_a, j, len_b)`` where they are; ``storage_meta``: the
    ``(checkpoint_id, save_id)`` of the metadata (``None``: none); ``bucket_keys``: the keys of
    each directory bucket, when the caller has them (``None``: computed from the rows);
    ``index_body``: the body of the load index every publication writes (``_index``).
    """
    file_id = uuid.uuid4().bytes
    world = len(rank_rows)
    rank_blobs = [_dumps([(rel, list(rows)) for rel, rows in files]) for files in rank_rows]
    if bucket_keys is None:
        keys: list[ItemKey] = [(row[0], row[1]) for files in rank_rows for _, rows in files for row in rows]
        bucket_keys = [[] for _ in range(bucket_count(len(keys)))]
        for k, b in zip(keys, key_buckets(keys, len(bucket_keys))):
            bucket_keys[b].append(k)
    n_buckets = len(bucket_keys)
    bucket_blobs = [_dumps(b) for b in bucket_keys]
    structure_blob = _dumps(structure)
    h = hashlib.sha256(structure_blob)
    for b in rank_blobs:
        h.update(b)
    tpl = template[0] if template is not None else b""
    pos = _ENTRY.size * (world + n_buckets)
    parts: list[bytes] = []
    rank_table, bucket_table = bytearray(), bytearray()

    def place(blob: bytes, table: bytearray | None = None) -> list[int]:
        nonlocal pos
        entry = [pos, len(blob), _crc(file_id, blob)]
        if table is not None:
            table += _ENTRY.pack(*entry)
        parts.append(blob)
        pos += len(blob)
        return entry

    s_entry = place(structure_blob)
    t_entry = place(tpl)
    i_entry = place(index_body) if index_body is not None else None
    for b in rank_blobs:
        place(b, rank_table)
    for b in bucket_blobs:
        place(b, bucket_table)
    names = [parse_file_name(rel) for files in rank_rows for rel, _ in files]
    max_files = max((n[1] + 1 for n in names if n is not None), default=0)
    header = {"version": VERSION, "file_id": file_id.hex(), "world": world, "buckets": n_buckets,
              "max_files": max_files, "ranks_with_files": sum(1 for f in rank_rows if f),
              "fingerprint": {**fingerprint, "structure_hash": h.hexdigest()[:32]},
              "structure": s_entry, "template": (t_entry + list(template[1])) if template else None, "index": i_entry,
              "storage_meta": list(storage_meta) if storage_meta else None, "body_size": pos}
    line = json.dumps(header, sort_keys=True).encode() + b"\n"
    data = b"".join([MAGIC, b"2\n", line, bytes(rank_table), bytes(bucket_table), *parts])
    return data, header


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class RankLayout:
    """One rank's part of a prepared metadata: its files, each with its items in offset order,
    and the chunk sizes of its tensor items."""

    files: tuple[tuple[str, tuple[PlacedItem, ...]], ...]
    sizes: dict[ItemKey, tuple[int, ...]]


def is_sectioned(head: bytes) -> bool:
    return head.startswith(MAGIC + b"2\n")


class SectionReader:
    """Reads the sections of one version-2 prepared file (see the module docstring)."""

    def __init__(self, source: Source) -> None:
        self.source = source
        head = source.read(0, _HEAD_READ)
        if not is_sectioned(head):
            raise PreparedMetadataError(f"{source.where}: not a version-2 prepared-metadata file")
        start = len(MAGIC) + 2
        end = head.find(b"\n", start)
        while end < 0 and len(head) < _HEAD_MAX:
            more = source.read(len(head), _HEAD_READ * 16)
            if not more:
                break
            head += more
            end = head.find(b"\n", start)
        try:
            if end < 0:
                raise ValueError("no end of header")
            self.header: dict[str, Any] = json.loads(head[start:end])
            self.file_id = bytes.fromhex(self.header["file_id"])
            self.world = int(self.header["world"])
            self.buckets = int(self.header["buckets"])
        except (ValueError, KeyError, TypeError) as e:
            raise PreparedMetadataError(f"{source.where}: prepared-metadata header is truncated or "
                                        f"corrupt ({e}); {_FIX}") from e
        self.body = end + 1
        self._check_extent()
        self.structure()  # small, read by every rank: a corrupt file fails here, on every rank

    def _check_extent(self) -> None:
        """A file shorter or longer than its header says is refused when it is opened."""
        size = self.header.get("body_size")
        if size is None:
            return
        end = self.body + int(size)
        last, beyond = self.source.read(end - 1, 1), self.source.read(end, 1)
        if len(last) != 1 or beyond:
            raise PreparedMetadataError(f"{self.source.where}: prepared-metadata file is truncated or "
                                        f"corrupt (its length is not the {end} bytes its header says); {_FIX}")

    def __getstate__(self) -> dict[str, Any]:
        return {"source": self.source, "header": self.header, "body": self.body}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.source, self.header, self.body = state["source"], state["header"], state["body"]
        self.file_id = bytes.fromhex(self.header["file_id"])
        self.world, self.buckets = int(self.header["world"]), int(self.header["buckets"])

    def _section(self, entry: Sequence[int], what: str) -> bytes:
        off, length, crc = int(entry[0]), int(entry[1]), int(entry[2])
        data = self.source.read(self.body + off, length) if length else b""
        if len(data) != length:
            raise PreparedMetadataError(f"{self.source.where}: {what} is truncated ({len(data)} of "
                                        f"{length} bytes); {_FIX}")
        if _crc(self.file_id, data) != crc:
            raise PreparedMetadataError(f"{self.source.where}: {what} is truncated or corrupt (checksum "
                                        f"mismatch, or the file changed since it was opened); {_FIX}")
        return data

    def _entry(self, table_index: int, what: str) -> tuple[int, int, int]:
        raw = self.source.read(self.body + table_index * _ENTRY.size, _ENTRY.size)
        if len(raw) != _ENTRY.size:
            raise PreparedMetadataError(f"{self.source.where}: the offset table entry of {what} is "
                                        f"truncated; {_FIX}")
        return _ENTRY.unpack(raw)

    def _load(self, data: bytes, what: str) -> Any:
        return safe_loads(data, what=f"{self.source.where} ({what})")

    def structure(self) -> dict[str, tuple]:
        out = self._load(self._section(self.header["structure"], "the structure section"), "structure")
        if not isinstance(out, dict):
            raise PreparedMetadataError(f"{self.source.where}: the structure section is corrupt; {_FIX}")
        return out

    def rank_layout(self, rank: int) -> RankLayout:
        if not 0 <= rank < self.world:
            return RankLayout((), {})
        what = f"the section of rank {rank}"
        rows = self._load(self._section(self._entry(rank, what), what), what)
        try:
            return layout_from_rows(rows)
        except (TypeError, ValueError) as e:
            raise PreparedMetadataError(f"{self.source.where}: {what} is corrupt ({e}); {_FIX}") from e

    def bucket(self, index: int) -> frozenset[ItemKey]:
        what = f"directory bucket {index}"
        keys = self._load(self._section(self._entry(self.world + index, what), what), what)
        return frozenset((k[0], tuple(k[1]) if k[1] is not None else None) for k in keys)

    def index_body(self) -> bytes | None:  # None: a file made before the load index
        entry = self.header.get("index")
        return self._section(entry, "the load index section") if entry else None

    def template_parts(self) -> tuple[bytes, bytes, bytes] | None:
        t = self.header.get("template")
        if not t:
            return None
        data = self._section(t[:3], "the template section")
        i, a, j, b = (int(x) for x in t[3:7])
        return data[:i], data[i + a:j], data[j + b:]


def layout_from_rows(files: Iterable[tuple[str, Iterable[Row]]]) -> RankLayout:
    """A :class:`RankLayout` from the rows of a rank section."""
    out, sizes = [], {}
    for rel, rows in files:
        placed = []
        for fqn, offsets, off, length, sz in rows:
            key = (str(fqn), tuple(offsets) if offsets is not None else None)
            placed.append(PlacedItem(key, str(rel), int(off), int(length)))
            if sz is not None:
                sizes[key] = tuple(sz)
        out.append((str(rel), tuple(placed)))
    return RankLayout(tuple(out), sizes)


def _chunk_sizes(state_dict_metadata: Mapping[str, Any]) -> dict[ItemKey, tuple[int, ...]]:
    sizes: dict[ItemKey, tuple[int, ...]] = {}
    for fqn, m in state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            for c in m.chunks:
                sizes[(fqn, tuple(c.offsets))] = tuple(c.sizes)  # torch.Size: a tuple of ints
    return sizes


def _file_order(rel: str) -> tuple:
    parsed = parse_file_name(rel)
    return (0, parsed[1], rel) if parsed is not None else (1, 0, rel)


def _rows_of(files: Mapping[str, list]) -> list[tuple[str, list]]:
    return [(rel, sorted(files[rel], key=lambda r: r[2])) for rel in sorted(files, key=_file_order)]


def _template_section(tpl: MetadataTemplate) -> tuple[bytes, tuple[int, int, int, int]]:
    p0, p1, p2 = tpl.parts
    return b"".join((p0, p1, p2)), (len(p0), 0, len(p0) + len(p1), 0)


def prepared_from_results(state_dict_metadata: Mapping[str, Any], results_by_rank: Sequence[Iterable[tuple]],
                          template: MetadataTemplate, storage_meta: tuple[str, str] | None,
                          fields: dict[str, Any]) -> bytes:
    """A version-2 prepared file made directly from a collective save's plan, every rank's write
    results (``results_by_rank[r]``: rank ``r``'s ``(key, file, offset, length)`` rows) and the
    template it publishes: nothing is read back or pickled twice."""
    with gc_paused():
        sizes = _chunk_sizes(state_dict_metadata)
        rank_rows = []
        for rows in results_by_rank:
            files: dict[str, list] = defaultdict(list)
            for key, rel, off, n in rows:
                files[rel].append((key[0], key[1], off, n, sizes.get(key) if key[1] is not None else None))
            rank_rows.append(_rows_of(files))
        return build_prepared({**fields, "format_version": VERSION}, structure_of(state_dict_metadata),
                              rank_rows, _template_section(template), storage_meta)[0]


def sections_from_metadata(md: Metadata, fields: dict[str, Any], where: str = "metadata") -> bytes:
    """A version-2 prepared file converted from a whole ``Metadata`` (every entry is read)."""
    if not isinstance(md, Metadata):
        raise PreparedMetadataError(f"{where}: expected a torch.distributed.checkpoint Metadata, got "
                                    f"{type(md).__name__}")
    if not md.storage_data and md.state_dict_metadata:
        raise PreparedMetadataError(
            f"{where}: the metadata has no storage_data (it is not a complete, published "
            "checkpoint metadata); use the .metadata of a finished save")
    with gc_paused():
        sizes = _chunk_sizes(md.state_dict_metadata)
        by_rank: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        for idx, info in md.storage_data.items():
            rel = info.relative_path
            parsed = parse_file_name(rel)
            if parsed is None:
                raise PreparedMetadataError(f"{where}: unexpected data file name {rel!r}; it was not "
                                            "written by a FileSystemWriter-style saver")
            key = index_key(idx)
            by_rank[parsed[0]][rel].append((key[0], key[1], int(info.offset), int(info.length),
                                            sizes.get(key) if key[1] is not None else None))
        world = max(fields.get("world_size") or 0, max(by_rank, default=-1) + 1)
        rank_rows = [_rows_of(by_rank[r]) if r in by_rank else [] for r in range(world)]
        sm = md.storage_meta
        return build_prepared({**fields, "format_version": VERSION}, structure_of(md.state_dict_metadata),
                              rank_rows, _template_section(MetadataTemplate(md)),
                              (str(sm.checkpoint_id), str(sm.save_id)) if sm is not None else None,
                              index_body=body_from_metadata(md))[0]
