"""The sectioned prepared-metadata format (version 4; versions 2 and 3 are still read): every
rank reads only its own part.

A prepared file used to be one pickle of the whole ``Metadata``, read and unpickled by every
rank at start-up (at W=4096, 114 MiB and ~25 s per rank). Version 2 cuts it into sections that
are found through fixed-width offset tables, so a rank reads a few kilobytes whatever the world
size::

    b"SOLOSAVE-PREPARED\\n"  b"4\\n"  <one JSON line: the header>  <CRC32 line>  <body>

    CRC32 line   8 hex digits and a newline: the CRC32 of every byte before it (version 4)

    body (offsets in the header and the tables are relative to its start):
      rank table      W entries of (offset u64, length u32, crc u32): rank r's section
      bucket table    B entries of the same form: the key directory
      structure       pickle: {fqn: (kind, dtype name, global size)} (O(number of keys))
      template        the ``.metadata`` pickle with placeholders (``MetadataTemplate``): only
                      the coordinator reads it, to publish
      index           the body of the load index beside every ``.metadata`` (``index/writer``)
      rank sections   u32 number of files; per file: u32 rows, u16 name length, the name
                      (UTF-8); then every row of every file, in order: little-endian int64
                      ``[fqn id, dims (-1: BYTES), offset, length, chunk offsets, chunk sizes]``
                      (offsets and sizes zero-padded to the header's ``width``)
      buckets         little-endian int64 rows ``[fqn id, dims, chunk offsets]``: the keys whose
                      hash falls in the bucket

An fqn id is the position of the fqn in the structure section (every rank reads it anyway).
Version 3 sections are columns: the coordinator of a create save writes them with array
operations (at W=4096, 800k rows; version 2 pickled a tuple per row, which took seconds). In a
version-2 file, rank sections and buckets are pickles of the same rows and keys.

Who reads what: every rank the header, its table entry, its section and the structure (its
reuse plan); a rank holding an item written by another rank (a replica, an empty trailing
chunk) also the directory bucket of that key; the coordinator also the template and the index.

Integrity: each section's CRC32 is seeded with the file's random ``file_id``, so a section
that is corrupt, truncated, or read from a file replaced since its header was read fails its
check with a clear :class:`PreparedMetadataError`. Version 4 adds a CRC32 of the header itself,
which holds the positions of the template's placeholders: one changed digit there would make
every reuse save publish a ``.metadata`` that no loader can read. Every header field, offset
table entry and row is checked for its type and range before it is used, every pickle is
loaded through the allowlist, and every data file name a rank section gives its rank is checked
(:func:`~solosave._src.formats.dcp.data_file_problem`): a crafted file is refused with a
:class:`PreparedMetadataError`, never makes a rank write outside its checkpoint directory, and
never makes a reader allocate more than the file holds.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import struct
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from solosave._src.coordination.protocol import PlacedItem
from solosave._src.core.checksum import crc32
from solosave._src.core.errors import PreparedMetadataError
from solosave._src.formats.dcp import ItemKey, data_file_problem, parse_file_name
from solosave._src.formats.metadata_template import MetadataTemplate
from solosave._src.formats.safe_pickle import safe_loads
from solosave._src.prepared.buckets import bucket_count, column_buckets
from solosave._src.storage.sources import Source

MAGIC = b"SOLOSAVE-PREPARED\n"
VERSION = 4
#: The versions the reader opens.
READ_VERSIONS = (2, 3, 4)
#: The version from which the header has a CRC32 line.
HEADER_CRC_VERSION = 4
_ENTRY = struct.Struct("<QII")
_COUNT = struct.Struct("<I")
_FILE = struct.Struct("<IH")
_HEAD_READ = 4096
_HEAD_MAX = 1 << 20
_FIX = "delete the file and recreate it (create_prepared_metadata=True or `solosave prepare`)"

#: One row of a rank section: fqn, chunk offsets (None: BYTES item), offset, length, chunk sizes.
Row = tuple[str, "tuple[int, ...] | None", int, int, "tuple[int, ...] | None"]


def _crc(file_id: bytes, data: bytes | memoryview) -> int:
    return crc32(data, crc32(file_id))


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------

def structure_of(state_dict_metadata: Mapping[str, Any]) -> dict[str, tuple]:
    """``{fqn: (kind, dtype name, global size)}``: what a reuse plan checks every held item
    against (kind 0: tensor, 1: bytes, as ``ItemKind``)."""
    from solosave._src.formats.dcp import dtype_name

    out: dict[str, tuple] = {}
    for fqn, m in state_dict_metadata.items():
        if hasattr(m, "chunks"):
            out[fqn] = (0, dtype_name(m.properties.dtype), tuple(int(s) for s in m.size))
        else:
            out[fqn] = (1, None, None)
    return out


def _dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=4)


@dataclass(frozen=True)
class LayoutColumns:
    """Every rank's placed items as columns: what :func:`build_prepared` writes."""

    #: ``(rows, 4 + 2 * width)`` int64, sorted by rank, file, offset: fqn id (its position in
    #: the structure), dims (-1: BYTES), offset, length, chunk offsets, chunk sizes (zero-padded).
    rows: torch.Tensor
    #: Per rank: its files in order, each with its number of rows.
    files: list[list[tuple[str, int]]]

    @property
    def width(self) -> int:
        return (int(self.rows.shape[1]) - 4) // 2


def _le(t: torch.Tensor) -> bytes:
    return np.ascontiguousarray(t.numpy(), dtype="<i8").tobytes()


def build_prepared(fingerprint: dict[str, Any], structure: dict[str, tuple], layout: LayoutColumns,
                   template: tuple[bytes, tuple[int, int, int, int]] | None,
                   storage_meta: tuple[str, str] | None,
                   index_body: bytes | None = None) -> tuple[bytes, dict[str, Any]]:
    """The bytes of a version-4 prepared file and its header.

    ``fingerprint``: the JSON fields of the fingerprint, less ``structure_hash`` (computed
    here from the sections, so equal layouts give equal hashes); ``layout``: every rank's
    files and rows; ``template``: the ``.metadata`` pickle with placeholders and
    ``(i, len_a, j, len_b)`` where they are; ``storage_meta``: the ``(checkpoint_id, save_id)``
    of the metadata (``None``: none); ``index_body``: the body of the load index every
    publication writes (``index/writer``).
    """
    file_id = uuid.uuid4().bytes
    world, width = len(layout.files), layout.width
    rows = layout.rows
    raw = memoryview(_le(rows))
    row_bytes = 8 * (4 + 2 * width)
    rank_blobs, at = [], 0
    for files in layout.files:
        parts = [_COUNT.pack(len(files))]
        for rel, k in files:
            name = rel.encode("utf-8", "surrogatepass")
            parts.append(_FILE.pack(k, len(name)) + name)
        k = sum(k for _, k in files)
        parts.append(raw[at * row_bytes:(at + k) * row_bytes])
        rank_blobs.append(b"".join(parts))
        at += k
    if at != rows.shape[0]:
        raise ValueError(f"internal: the files of the layout hold {at} rows, the layout has {rows.shape[0]}")
    n_buckets = bucket_count(at)
    keys = rows[:, [0, 1, *range(4, 4 + width)]]
    bucket = column_buckets(list(structure), keys[:, 0], keys[:, 1], keys[:, 2:], n_buckets)
    in_bucket = torch.sort(bucket, stable=True)
    key_raw = memoryview(_le(keys[in_bucket.indices]))
    key_bytes = 8 * (2 + width)
    ends = torch.cumsum(torch.bincount(in_bucket.values, minlength=n_buckets), 0).mul_(key_bytes).tolist()
    bucket_blobs = [key_raw[a:b] for a, b in zip([0] + ends[:-1], ends)]
    structure_blob = _dumps(structure)
    h = hashlib.sha256(structure_blob)
    for blob in rank_blobs:
        h.update(blob)
    tpl = template[0] if template is not None else b""
    pos = _ENTRY.size * (world + n_buckets)
    out: list[bytes | memoryview] = []
    table = bytearray()

    def place(blob: bytes | memoryview, in_table: bool = False) -> list[int]:
        nonlocal pos
        entry = [pos, len(blob), _crc(file_id, blob)]
        if in_table:
            table.extend(_ENTRY.pack(*entry))
        out.append(blob)
        pos += len(blob)
        return entry

    s_entry = place(structure_blob)
    t_entry = place(tpl)
    i_entry = place(index_body) if index_body is not None else None
    for blob in rank_blobs:
        place(blob, True)
    for blob in bucket_blobs:
        place(blob, True)
    names = [parse_file_name(rel) for files in layout.files for rel, _ in files]
    max_files = max((n[1] + 1 for n in names if n is not None), default=0)
    header = {"version": VERSION, "file_id": file_id.hex(), "world": world, "buckets": n_buckets, "width": width,
              "max_files": max_files, "ranks_with_files": sum(1 for f in layout.files if f),
              "fingerprint": {**fingerprint, "structure_hash": h.hexdigest()[:32]},
              "structure": s_entry, "template": (t_entry + list(template[1])) if template else None, "index": i_entry,
              "storage_meta": list(storage_meta) if storage_meta else None, "body_size": pos}
    head = MAGIC + b"%d\n" % VERSION + json.dumps(header, sort_keys=True).encode() + b"\n"
    data = b"".join([head, b"%08x\n" % crc32(head), bytes(table), *out])
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
    return any(head.startswith(MAGIC + b"%d\n" % v) for v in READ_VERSIONS)


class SectionReader:
    """Reads the sections of one version-2, -3 or -4 prepared file (see the module docstring)."""

    def __init__(self, source: Source) -> None:
        self.source = source
        head = source.read(0, _HEAD_READ)
        if not is_sectioned(head):
            raise PreparedMetadataError(f"{source.where}: not a sectioned (version "
                                        f"{', '.join(map(str, READ_VERSIONS))}) prepared-metadata file")
        start = len(MAGIC) + 2
        self.version = int(head[len(MAGIC):start - 1])
        crc_line = 9 if self.version >= HEADER_CRC_VERSION else 0
        end = head.find(b"\n", start)
        while (end < 0 or len(head) < end + 1 + crc_line) and len(head) < _HEAD_MAX:
            more = source.read(len(head), _HEAD_READ * 16)
            if not more:
                break
            head += more
            end = head.find(b"\n", start)
        try:
            if end < 0:
                raise ValueError("no end of header")
            if crc_line:
                _check_header_crc(head[:end + 1], head[end + 1:end + 1 + crc_line])
            self.header: dict[str, Any] = json.loads(head[start:end])
            self.file_id, self.world, self.buckets, self.width = _checked_header(self.header)
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise PreparedMetadataError(f"{source.where}: prepared-metadata header is truncated or "
                                        f"corrupt ({e}); {_FIX}") from e
        self.body = end + 1 + crc_line
        self._names: list[str] | None = None
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
        self.version, self.width = int(self.header["version"]), int(self.header.get("width", 0))
        self._names = None

    def _section(self, entry: Sequence[int], what: str) -> bytes:
        off, length, crc = (int(x) for x in entry[:3])
        size = self.header.get("body_size")
        if off < 0 or length < 0 or (size is not None and off + length > int(size)):
            raise PreparedMetadataError(f"{self.source.where}: {what} lies outside the file (offset {off}, "
                                        f"{length} bytes): it is corrupt; {_FIX}")
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
        if not isinstance(out, dict) or not all(map(_structure_entry_ok, out.keys(), out.values())):
            raise PreparedMetadataError(f"{self.source.where}: the structure section is corrupt; {_FIX}")
        return out

    def names(self) -> list[str]:
        """The fqns in structure order: what the fqn ids of column sections (version 3 on) refer to."""
        if self._names is None:
            self._names = list(self.structure())
        return self._names

    def rank_layout(self, rank: int) -> RankLayout:
        if not 0 <= rank < self.world:
            return RankLayout((), {})
        what = f"the section of rank {rank}"
        data = self._section(self._entry(rank, what), what)
        try:
            layout = self._columns_layout(data) if self.version >= 3 else layout_from_rows(self._load(data, what))
        except (TypeError, ValueError, IndexError, KeyError, struct.error, OverflowError) as e:
            raise PreparedMetadataError(f"{self.source.where}: {what} is corrupt ({e}); {_FIX}") from e
        for rel, _ in layout.files:  # the names a rank's worker will create: never outside the checkpoint
            why = data_file_problem(rel, rank)
            if why is not None:
                raise PreparedMetadataError(f"{self.source.where}: {what} is corrupt or crafted: {why}; {_FIX}")
        return layout

    def _columns_layout(self, data: bytes) -> RankLayout:
        (n_files,), at = _COUNT.unpack_from(data, 0), _COUNT.size
        files = []
        for _ in range(n_files):
            k, n = _FILE.unpack_from(data, at)
            at += _FILE.size
            files.append((data[at:at + n].decode("utf-8", "surrogatepass"), k))
            at += n
        w = self.width
        rows = self._rows(data, at, 4 + 2 * w, sum(k for _, k in files))
        names, out, sizes, i = self.names(), [], {}, 0
        for rel, k in files:
            placed = []
            for fid, nd, off, length, *dims in rows[i:i + k]:
                key = self._key(names, fid, nd, dims)
                placed.append(PlacedItem(key, rel, off, length))
                if nd >= 0:
                    sizes[key] = tuple(dims[w:w + nd])
            out.append((rel, tuple(placed)))
            i += k
        return RankLayout(tuple(out), sizes)

    @staticmethod
    def _rows(data: bytes, at: int, width: int, count: int | None = None) -> list[list[int]]:
        n, extra = divmod(len(data) - at, 8 * width)
        if extra or (count is not None and n != count):
            want = count if count is not None else "a whole number of"
            raise ValueError(f"{len(data) - at} bytes of rows, not {want} rows of {width} values")
        return np.frombuffer(data, dtype="<i8", offset=at).reshape(n, width).tolist() if n else []

    def _key(self, names: list[str], fid: int, nd: int, dims: list[int]) -> ItemKey:
        if not 0 <= fid < len(names) or not -1 <= nd <= self.width:
            raise ValueError(f"fqn id {fid} or dims {nd} out of range")
        return (names[fid], tuple(dims[:nd]) if nd >= 0 else None)

    def bucket(self, index: int) -> frozenset[ItemKey]:
        what = f"directory bucket {index}"
        data = self._section(self._entry(self.world + index, what), what)
        try:
            if self.version >= 3:
                names = self.names()
                return frozenset(self._key(names, r[0], r[1], r[2:]) for r in self._rows(data, 0, 2 + self.width))
            keys = self._load(data, what)
            return frozenset((str(k[0]), tuple(int(o) for o in k[1]) if k[1] is not None else None) for k in keys)
        except (TypeError, ValueError, IndexError, KeyError, OverflowError) as e:
            raise PreparedMetadataError(f"{self.source.where}: {what} is corrupt ({e}); {_FIX}") from e

    def index_body(self) -> bytes | None:  # None: a file made before the load index
        entry = self.header.get("index")
        return self._section(entry, "the load index section") if entry else None

    def template_parts(self) -> tuple[bytes, bytes, bytes] | None:
        t = self.header.get("template")
        if not t:
            return None
        data = self._section(t[:3], "the template section")
        i, a, j, b = (int(x) for x in t[3:7])
        if not 0 <= i <= i + a <= j <= j + b <= len(data):
            raise PreparedMetadataError(f"{self.source.where}: the placeholder positions of the .metadata template "
                                        f"are corrupt ({[i, a, j, b]} in {len(data)} bytes); {_FIX}")
        return data[:i], data[i + a:j], data[j + b:]


def _check_header_crc(head: bytes, line: bytes) -> None:
    """Version 4: ``line`` holds the CRC32 of ``head`` (every byte before it)."""
    if len(line) != 9 or line[8:] != b"\n" or int(line[:8], 16) != crc32(head):
        raise ValueError("its checksum does not match (the header was changed or damaged)")


def _entry_ok(value: Any, n: int) -> bool:
    return isinstance(value, list) and len(value) == n and all(type(x) is int and x >= 0 for x in value)


def _checked_header(h: Any) -> tuple[bytes, int, int, int]:
    """``(file_id, world, buckets, width)`` of a parsed header whose every field the reader
    uses has its type and range; ``ValueError`` / ``KeyError`` / ``TypeError`` naming the field."""
    if not isinstance(h, dict):
        raise TypeError(f"a JSON {type(h).__name__}, not an object")
    file_id = bytes.fromhex(h["file_id"])
    counts = {k: h.get(k, 0) for k in ("world", "buckets", "width", "max_files", "ranks_with_files")}
    counts["world"], counts["buckets"] = h["world"], h["buckets"]
    for k, v in counts.items():
        if type(v) is not int or v < 0:
            raise ValueError(f"{k} is {v!r}, not a count")
    if counts["buckets"] < 1:
        raise ValueError("no directory buckets")
    fp = h["fingerprint"]
    if not isinstance(fp, dict) or not isinstance(fp.get("structure_hash"), str):
        raise ValueError("the fingerprint has no structure hash")
    for k in ("world_size", "workers", "format_version"):
        if fp.get(k) is not None and type(fp[k]) is not int:
            raise ValueError(f"the fingerprint's {k} is {fp[k]!r}, not a count")
    if not _entry_ok(h["structure"], 3):
        raise ValueError("the structure entry is not three counts")
    for k, n in (("template", 7), ("index", 3)):
        if h.get(k) is not None and not _entry_ok(h[k], n):
            raise ValueError(f"the {k} entry is not {n} counts")
    sm, size = h.get("storage_meta"), h.get("body_size")
    if sm is not None and not (isinstance(sm, list) and len(sm) == 2 and all(isinstance(x, str) for x in sm)):
        raise ValueError("storage_meta is not two strings")
    if size is not None and (type(size) is not int or size < 0):
        raise ValueError(f"body_size is {size!r}")
    return file_id, counts["world"], counts["buckets"], counts["width"]


def _structure_entry_ok(fqn: Any, entry: Any) -> bool:
    """One entry of the structure section: ``fqn -> (kind, dtype name, global size)``."""
    if not isinstance(fqn, str) or not isinstance(entry, tuple) or len(entry) != 3:
        return False
    kind, dtype, size = entry
    if kind == 1:
        return True
    return (kind == 0 and isinstance(dtype, str) and isinstance(size, tuple)
            and all(type(n) is int and n >= 0 for n in size))


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


def _file_order(rel: str) -> tuple:
    parsed = parse_file_name(rel)
    return (0, parsed[1], rel) if parsed is not None else (1, 0, rel)


def _template_section(tpl: MetadataTemplate) -> tuple[bytes, tuple[int, int, int, int]]:
    p0, p1, p2 = tpl.parts
    return b"".join((p0, p1, p2)), (len(p0), 0, len(p0) + len(p1), 0)
