"""The load index beside ``.metadata``: a loading rank reads only what its own shards need.

``.metadata`` names every chunk of every tensor; at W=4096 ranks of a Llama-7B-like model it is
about 114 MiB, and unpickling it cost every loading rank about 13 s (docs/benchmarks.md, scale).
A rank loading its own shards needs a few thousand of its millions of entries. The coordinator
of every solosave save therefore writes ``.solosave-index`` next to ``.metadata`` (before it,
from the same columns); stock DCP ignores the file, and ``.metadata`` stays DCP's.

File layout (integers little-endian)::

    b"SOLOSAVE-INDEX\\n" b"1\\n" <one JSON line: the header, this publication's>  <body>

    header  metadata_length, save_id, save_id_at: the length of the ``.metadata`` this index
            belongs to and where that file holds its ``save_id`` (a fresh uuid per publication);
            body_length
    body    (the same bytes for every save of one layout, so a reuse save writes the body that
            the create save made; offsets are relative to the end of the directory)
      prefix      directory length (u64), directory CRC32 (u32)
      directory   JSON: data file names; per fqn ``["t", group, position, dtype, size,
                  requires_grad, pin_memory, layout, memory_format]`` or ``["b", file, offset,
                  length]``; per group ``[chunks, dims, keys, geometry offset, geometry length,
                  geometry CRC32, rows offset]``; ``planner_data``; the DCP version
      geometries  per group of tensors that share one chunk geometry (the same chunks in the
                  same order, e.g. every FSDP weight of one shape): zlib of the chunk offsets and
                  sizes, int64 ``(chunks, dims)`` each
      rows        per group, chunk-major: for chunk ``i`` one 20-byte row (file index u32,
                  offset u64, length u64) per key of the group, then the block's CRC32 (u32)

This module builds and writes it (the coordinator); :mod:`solosave._src.index.reader` reads it. Who reads
what (:meth:`~solosave._src.index.reader.LoadIndex.metadata_for`, every loading rank alone, no collective): the
header, the directory, the geometries of its groups, and the row blocks of the chunks that
overlap its shards (a same-sharding load: one block per group). The result is a DCP
``Metadata`` that holds exactly those keys and chunks, which DCP's planner and reader use as
they use the whole one. A rank checks first that the index belongs to the ``.metadata`` beside
it (length and ``save_id``: a few bytes read); a stale, foreign or corrupt index raises
:class:`IndexUnusable` and the loader reads ``.metadata`` instead.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from torch.distributed.checkpoint.metadata import (
    Metadata,
    TensorStorageMetadata,
)

from solosave._src.core.errors import IndexUnusable
from solosave._src.formats.dcp import INDEX_FILE, METADATA_VERSION, dtype_name, index_key
from solosave._src.formats.metadata_template import MetadataTemplate, pickled_str

if TYPE_CHECKING:  # plan/columns is above index: named for the annotations only
    from solosave._src.plan.columns import ChunkTable, ResultColumns

__all__ = ["INDEX_FILE", "body_from_columns", "body_from_metadata", "render", "shifted"]

MAGIC = b"SOLOSAVE-INDEX\n"
VERSION = 1
ROW = np.dtype([("file", "<u4"), ("offset", "<u8"), ("length", "<u8")])  # packed: 20 bytes
#: The body's prefix (directory length, directory CRC32) and a row block's trailing CRC32.
PREFIX = struct.Struct("<QI")
CRC = struct.Struct("<I")


# ---------------------------------------------------------------------------------------------
# Building (coordinator of a save; ``solosave prepare``)
# ---------------------------------------------------------------------------------------------

def body_from_columns(sdm: Mapping[str, Any], planner_data: Mapping[str, Any] | None, table: ChunkTable,
                      res: ResultColumns) -> bytes:
    """The body of the index of a collective save, from the columns ``finish`` already has:
    ``res`` covers every chunk of ``table`` exactly once (``plan/columns.placed_columns``)."""
    n = table.n
    cfile = np.zeros(n, np.int64)
    coff = np.zeros(n, np.int64)
    clen = np.zeros(n, np.int64)
    uid = res.uid.numpy()
    cfile[uid], coff[uid], clen[uid] = res.file.numpy(), res.offset.numpy(), res.length.numpy()
    return _body(sdm, planner_data, table, list(res.files), cfile, coff, clen)


def body_from_metadata(md: Metadata) -> bytes:
    """The body of the index of a whole DCP ``Metadata`` (``solosave prepare``, tests): every
    entry is visited once."""
    from solosave._src.plan.columns import ChunkTable

    sdm = md.state_dict_metadata
    table = ChunkTable.from_metadata(sdm)
    files: dict[str, int] = {}
    n = table.n
    cfile, coff, clen = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64)
    first = {fqn: table.bounds[f] for f, fqn in enumerate(table.names)}
    #: the rows of each chunk: a chunk listed twice (a crafted metadata) has two rows, both
    #: given its one storage_data entry (none may be left pointing at offset 0, length 0)
    position: dict[tuple[str, Any], list[int]] = {}
    for fqn in table.names:
        m = sdm[fqn]
        if isinstance(m, TensorStorageMetadata):
            for j, c in enumerate(m.chunks):
                position.setdefault((fqn, tuple(int(o) for o in c.offsets)), []).append(first[fqn] + j)
        else:
            position[(fqn, None)] = [first[fqn]]
    for idx, info in md.storage_data.items():
        rows = position.get(index_key(idx))
        if rows is None:
            raise ValueError(f"storage_data names {idx.fqn!r} at {list(idx.offset or ())}, which "
                             "state_dict_metadata does not have")
        for at in rows:
            cfile[at] = files.setdefault(info.relative_path, len(files))
            coff[at], clen[at] = int(info.offset), int(info.length)
    if len(position) != len(md.storage_data):
        raise ValueError("the metadata's storage_data does not cover every chunk of its state_dict_metadata")
    return _body(sdm, md.planner_data, table, list(files), cfile, coff, clen)


def _props(m: TensorStorageMetadata) -> list[Any]:
    p = m.properties
    return [bool(p.requires_grad), bool(p.pin_memory), str(p.layout), str(p.memory_format)]


def _body(sdm: Mapping[str, Any], planner_data: Mapping[str, Any] | None, table: ChunkTable, files: list[str],
          cfile: np.ndarray, coff: np.ndarray, clen: np.ndarray) -> bytes:
    offs, sizes = table.offs.numpy(), table.sizes.numpy()
    groups: dict[tuple, int] = {}
    members: list[list[int]] = []   # per group: the first chunk id of each key
    keys: dict[str, list[Any]] = {}
    for f, fqn in enumerate(table.names):
        a, b, nd = table.bounds[f], table.bounds[f + 1], table.nd[f]
        m = sdm[fqn]
        if nd < 0:
            keys[fqn] = ["b", int(cfile[a]), int(coff[a]), int(clen[a])]
            continue
        geo = (nd, b - a, offs[a:b, :nd].tobytes(), sizes[a:b, :nd].tobytes())
        g = groups.get(geo)
        if g is None:
            g = groups[geo] = len(members)
            members.append([])
        keys[fqn] = ["t", g, len(members[g]), dtype_name(m.properties.dtype), [int(s) for s in m.size], *_props(m)]
        members[g].append(a)
    blobs: list[bytes] = []
    group_rows: list[list[int]] = []
    pos = 0
    for (nd, n, *_), first in zip(groups, members):  # a group's geometry key starts (dims, chunks)
        a = first[0]
        geometry = zlib.compress(np.ascontiguousarray(offs[a:a + n, :nd], "<i8").tobytes()
                            + np.ascontiguousarray(sizes[a:a + n, :nd], "<i8").tobytes(), 1)
        ids = np.asarray(first, np.int64)[None, :] + np.arange(n, dtype=np.int64)[:, None]  # (n, keys)
        rows = np.empty(ids.shape, ROW)
        rows["file"], rows["offset"], rows["length"] = cfile[ids], coff[ids], clen[ids]
        width = len(first) * ROW.itemsize
        raw = rows.view(np.uint8).reshape(n, width)
        block = np.empty((n, width + CRC.size), np.uint8)
        block[:, :width] = raw
        crcs = np.fromiter((zlib.crc32(r.data) for r in raw), np.uint32, n) if width else np.zeros(n, np.uint32)
        block[:, width:] = crcs.astype("<u4").view(np.uint8).reshape(n, CRC.size)
        group_rows.append([n, nd, len(first), pos, len(geometry), zlib.crc32(geometry), pos + len(geometry)])
        blobs += [geometry, block.tobytes()]
        pos += len(geometry) + block.nbytes
    # the least size of each data file (the end of its last record): a shorter one is damaged
    ends = np.zeros(len(files), np.int64)
    if len(cfile):
        np.maximum.at(ends, cfile, coff + clen)
    directory = json.dumps({
        "files": files, "file_ends": [int(e) for e in ends], "keys": keys, "groups": group_rows,
        "planner_data": {k: list(v) for k, v in (planner_data or {}).items()},
        "version": METADATA_VERSION.get("version"),
    }, separators=(",", ":")).encode()
    return b"".join([PREFIX.pack(len(directory), zlib.crc32(directory)), directory, *blobs])


def render(body: bytes, template: MetadataTemplate, checkpoint_id: str, save_id: str) -> bytes:
    """The index file of one publication: ``body`` behind a header that ties it to the
    ``.metadata`` that ``template.render(checkpoint_id, save_id)`` makes."""
    p0, p1, p2 = template.parts
    ckpt = pickled_str(str(checkpoint_id))
    at = len(p0) + len(ckpt) + len(p1)
    header = {"version": VERSION, "metadata_length": at + len(pickled_str(save_id)) + len(p2),
              "save_id": save_id, "save_id_at": at, "body_length": len(body)}
    return b"".join([MAGIC, b"%d\n" % VERSION, json.dumps(header, sort_keys=True).encode(), b"\n", body])


def shifted(data: bytes, delta: int) -> bytes:
    """The index file ``data`` for the same publication whose ``.metadata`` grew by ``delta``
    bytes before its ``save_id`` (the same checkpoint copied elsewhere: its ``checkpoint_id``
    changed length, see ``formats.metadata_template.replace_checkpoint_id``); the body is
    unchanged. Raises :class:`IndexUnusable` if ``data`` is not a version-1 index."""
    start = len(MAGIC) + len(b"%d\n" % VERSION)
    end = data.find(b"\n", start)
    if not data.startswith(MAGIC + b"%d\n" % VERSION) or end < 0:
        raise IndexUnusable(f"not a version-{VERSION} solosave load index")
    try:
        header = json.loads(data[start:end])
        header["metadata_length"] = int(header["metadata_length"]) + delta
        header["save_id_at"] = int(header["save_id_at"]) + delta
    except (ValueError, KeyError, TypeError) as e:
        raise IndexUnusable(f"the load index's header is corrupt ({e})") from e
    return b"".join([data[:start], json.dumps(header, sort_keys=True).encode(), data[end:]])
