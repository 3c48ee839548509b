"""The reading half of the load index (:mod:`solosave._src.index.writer` has the format): every loading
rank, alone, before DCP's planner (:func:`solosave.load`).

:meth:`LoadIndex.open` checks that the index belongs to the ``.metadata`` beside it (its length
and ``save_id``); :meth:`LoadIndex.metadata_for` reads the directory, the geometries of the
groups of the requested keys and the row blocks of the chunks that overlap the requested boxes,
and returns a DCP ``Metadata`` of exactly those; :func:`wanted_of` gives the boxes of a
flattened state dict.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
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

from solosave._src.core.errors import IndexStale, IndexUnusable
from solosave._src.formats.dcp import (
    INDEX_FILE,
    METADATA_FILE,
    METADATA_VERSION,
    confined_path,
    dtype_from_name,
    local_file_problem,
)
from solosave._src.formats.metadata_check import metadata_problem
from solosave._src.formats.metadata_template import pickled_str
from solosave._src.index.writer import CRC, MAGIC, PREFIX, ROW, VERSION
from solosave._src.storage.local import pread_all

__all__ = ["IndexStale", "IndexUnusable", "LoadIndex", "wanted_of"]

_HEAD_READ = 64 << 10

#: A request: per flattened key, the boxes ``(offsets, sizes)`` a rank loads (``None``: all of it).
Wanted = Mapping[str, "Sequence[tuple[Sequence[int], Sequence[int]]] | None"]


def _enum(name: Any, kind: type) -> Any:
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, kind):
        raise ValueError(f"unknown {kind.__name__} {name!r}")
    return value


class LoadIndex:
    """An open ``.solosave-index`` that belongs to the ``.metadata`` beside it.

    :meth:`open` returns ``None`` when the checkpoint has no index (stock DCP, older solosave)
    and raises :class:`IndexUnusable` when it has one that cannot be used.
    """

    def __init__(self, directory: str, fd: int, header: dict[str, Any], directory_json: dict[str, Any],
                 blobs_at: int, size: int) -> None:
        self.directory, self._fd, self.header = directory, fd, header
        self.files: list[str] = directory_json["files"]
        self.keys: dict[str, list[Any]] = directory_json["keys"]
        self.groups: list[list[int]] = directory_json["groups"]
        self.planner_data: dict[str, list[Any]] = directory_json.get("planner_data") or {}
        self.version: str | None = directory_json.get("version")
        if not (isinstance(self.files, list) and isinstance(self.keys, dict) and isinstance(self.groups, list)
                and isinstance(self.planner_data, dict) and isinstance(self.version, (str, type(None)))):
            raise TypeError("files, keys, groups, planner_data or version of another type")
        for f in self.files:
            if confined_path(directory, f) is None:
                raise ValueError(f"it names data file {f!r}, not a file inside the checkpoint directory")
        self._blobs_at, self._size = blobs_at, size
        self._geometry: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        #: Bytes read from the index so far (header, directory, geometries, row blocks).
        self.bytes_read = 0

    # -- opening ---------------------------------------------------------------------------
    @classmethod
    def open(cls, directory: str | os.PathLike) -> LoadIndex | None:
        directory = os.fspath(directory)
        path = os.path.join(directory, INDEX_FILE)
        why = local_file_problem(directory, path)
        if why is not None:
            raise IndexUnusable(f"{path}: {why}")
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise IndexUnusable(f"{path}: cannot read it ({e})") from e
        try:
            return cls._open(directory, path, fd)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def _open(cls, directory: str, path: str, fd: int) -> LoadIndex:
        head = os.pread(fd, _HEAD_READ, 0)
        start = len(MAGIC) + 2
        end = head.find(b"\n", start)
        if not head.startswith(MAGIC + b"%d\n" % VERSION) or end < 0:
            raise IndexUnusable(f"{path}: not a version-{VERSION} solosave load index, or its header is truncated")
        try:
            header = json.loads(head[start:end])
            body = end + 1
            body_length, md_length = int(header["body_length"]), int(header["metadata_length"])
            save_id, save_id_at = str(header["save_id"]), int(header["save_id_at"])
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise IndexUnusable(f"{path}: its header is corrupt ({e})") from e
        size = os.fstat(fd).st_size
        if size != body + body_length or body_length < PREFIX.size:
            raise IndexUnusable(f"{path}: truncated or extended (not the {body + body_length} bytes its "
                                "header says)")
        _check_published(directory, md_length, save_id, save_id_at)
        prefix = _read_exact(fd, body, PREFIX.size, path)
        dir_len, dir_crc = PREFIX.unpack(prefix)
        at = body + PREFIX.size
        if at + dir_len > size:  # the length field has no checksum of its own: never read what it claims
            raise IndexUnusable(f"{path}: its directory length ({dir_len} bytes) runs past the end of the file")
        raw = head[at:at + dir_len] if at + dir_len <= len(head) else _read_exact(fd, at, dir_len, path)
        if zlib.crc32(raw) != dir_crc:
            raise IndexUnusable(f"{path}: its directory is corrupt (checksum mismatch)")
        try:
            self = cls(directory, fd, header, json.loads(raw), at + dir_len, size)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise IndexUnusable(f"{path}: its directory is corrupt ({e})") from e
        self.bytes_read = len(head) if at + dir_len <= len(head) else len(head) + dir_len
        return self

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> LoadIndex:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- lookups ---------------------------------------------------------------------------
    def _read(self, offset: int, length: int, what: str) -> bytes:
        path = os.path.join(self.directory, INDEX_FILE)
        if offset < 0 or length < 0 or self._blobs_at + offset + length > self._size:
            raise IndexUnusable(f"{path}: {what} lies outside the file (offset {offset}, {length} bytes)")
        data = _read_exact(self._fd, self._blobs_at + offset, length, path, what)
        self.bytes_read += length
        return data

    def geometry(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """Group ``g``'s chunk offsets and sizes, ``(chunks, dims)`` int64 each."""
        got = self._geometry.get(g)
        if got is None:
            n, nd, _, off, length, crc, _ = self.groups[g]
            blob = self._read(off, length, f"the geometry of group {g}")
            if zlib.crc32(blob) != crc:
                raise IndexUnusable(f"{os.path.join(self.directory, INDEX_FILE)}: the geometry of group {g} is "
                                    "corrupt (checksum mismatch)")
            arr = np.frombuffer(_inflate(blob, 16 * n * nd), "<i8")
            if arr.size != 2 * n * nd:
                raise IndexUnusable(f"{os.path.join(self.directory, INDEX_FILE)}: the geometry of group {g} "
                                    "has the wrong size")
            got = self._geometry[g] = (arr[:n * nd].reshape(n, nd), arr[n * nd:].reshape(n, nd))
        return got

    def _rows(self, g: int, chunks: np.ndarray) -> dict[int, np.ndarray]:
        """The row block of each chunk index in ``chunks`` (sorted, distinct) of group ``g``:
        ``{chunk: rows of its keys}``; adjacent blocks are read together."""
        n, _, k, _, _, _, rows_at = self.groups[g]
        width = k * ROW.itemsize
        block = width + CRC.size
        out: dict[int, np.ndarray] = {}
        if not len(chunks):
            return out
        breaks = np.flatnonzero(np.diff(chunks) != 1) + 1
        for run in np.split(chunks, breaks):
            a, b = int(run[0]), int(run[-1]) + 1
            raw = np.frombuffer(self._read(rows_at + a * block, (b - a) * block, f"the rows of group {g}"),
                                np.uint8).reshape(b - a, block)
            for i in range(b - a):
                if zlib.crc32(raw[i, :width]) != int(raw[i, width:].view("<u4")[0]):
                    raise IndexUnusable(f"{os.path.join(self.directory, INDEX_FILE)}: the rows of chunk {a + i} "
                                        f"of group {g} are corrupt (checksum mismatch)")
                out[a + i] = raw[i, :width].copy().view(ROW)
        return out

    def whole_records(self, wanted: Mapping[str, tuple[Sequence[int], Sequence[int], Sequence[int]]]) -> dict[str, Any]:
        """The storage entry (``_StorageInfo``) of each key of ``wanted`` (``{fqn: (size,
        offsets, sizes)}``: the tensor's global size and the one chunk a rank holds) that the
        checkpoint saved at that size with exactly that chunk as one record: a plain tensor
        whole, or a DTensor's shard at the sharding it was saved with. The keys left out need
        DCP's planner: absent, of another size, resharded, or not tensors. Reads the row block
        of each chunk found (the blocks :meth:`metadata_for` would read)."""
        out: dict[str, Any] = {}
        found: dict[tuple, int | None] = {}
        rows: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        files = self.files
        try:
            for fqn, (size, offsets, sizes) in wanted.items():
                e = self.keys.get(fqn)
                if e is None or e[0] != "t" or e[4] != list(size):
                    continue
                g = int(e[1])
                box = (g, tuple(offsets), tuple(sizes))
                if box not in found:
                    found[box] = self._chunk_at(g, box[1], box[2])
                i = found[box]
                if i is None:
                    continue
                if (g, i) not in rows:
                    rows[g, i] = self._rows(g, np.array([i], np.int64))[i].tolist()
                f, offset, length = rows[g, i][int(e[2])]
                out[fqn] = _StorageInfo(files[f], offset, length)
        except IndexUnusable:
            raise
        except _DAMAGED as err:
            raise IndexUnusable(f"{os.path.join(self.directory, INDEX_FILE)}: corrupt ({err!r})") from err
        return out

    def _chunk_at(self, g: int, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> int | None:
        """The index of group ``g``'s one chunk at ``offsets`` of ``sizes`` (``None``: none, or
        several: a metadata that names a chunk twice is left to DCP's planner)."""
        offs, sz = self.geometry(g)
        if offs.shape[1] != len(offsets):
            return None
        hit = np.flatnonzero((offs == np.asarray(offsets, np.int64)).all(axis=1)
                            & (sz == np.asarray(sizes, np.int64)).all(axis=1))
        return int(hit[0]) if len(hit) == 1 else None

    def metadata_for(self, wanted: Wanted) -> Metadata:
        """A DCP ``Metadata`` with the keys of ``wanted`` that the checkpoint has, each with the
        saved chunks that overlap the requested boxes (DCP's planner reads exactly those), and
        their storage entries."""
        sdm: dict[str, Any] = {}
        storage: dict[MetadataIndex, Any] = {}
        by_group: dict[int, list[tuple[str, list[Any], np.ndarray]]] = {}
        memo: dict[tuple, np.ndarray] = {}
        files = self.files
        try:
            for fqn, boxes in wanted.items():
                e = self.keys.get(fqn)
                if e is None:
                    continue  # DCP's planner reports the missing key (or allows it)
                if e[0] == "b":
                    sdm[fqn] = BytesStorageMetadata()
                    storage[MetadataIndex(fqn)] = _StorageInfo(files[e[1]], int(e[2]), int(e[3]))
                    continue
                g = int(e[1])
                key = (g, None if boxes is None else tuple((tuple(o), tuple(s)) for o, s in boxes))
                idx = memo.get(key)
                if idx is None:
                    idx = memo[key] = _overlapping(*self.geometry(g), key[1])
                by_group.setdefault(g, []).append((fqn, e, idx))
            for g, items in by_group.items():
                offs, sizes = self.geometry(g)
                rows = self._rows(g, np.unique(np.concatenate([idx for *_, idx in items])))
                for fqn, e, idx in items:
                    pos = int(e[2])
                    chunks = []
                    for i in idx.tolist():
                        o, s = torch.Size(offs[i].tolist()), torch.Size(sizes[i].tolist())
                        chunks.append(ChunkStorageMetadata(offsets=o, sizes=s))
                        r = rows[i][pos]
                        storage[MetadataIndex(fqn, o)] = _StorageInfo(files[int(r["file"])], int(r["offset"]),
                                                                      int(r["length"]))
                    props = TensorProperties(dtype=dtype_from_name(e[3]), layout=_enum(e[7], torch.layout),
                                             requires_grad=bool(e[5]), memory_format=_enum(e[8], torch.memory_format),
                                             pin_memory=bool(e[6]))
                    sdm[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(e[4]), chunks=chunks)
            planner_data = {k: tuple(self.planner_data[k]) for k in sdm if k in self.planner_data}
        except IndexUnusable:
            raise
        except _DAMAGED as err:
            raise IndexUnusable(f"{os.path.join(self.directory, INDEX_FILE)}: corrupt ({err!r})") from err
        md = Metadata(state_dict_metadata=sdm, planner_data=planner_data, storage_data=storage,
                      **({"version": self.version} if METADATA_VERSION and self.version else {}))
        problem = metadata_problem(md)  # only this rank's entries: cheap
        if problem:
            raise IndexUnusable(f"{os.path.join(self.directory, INDEX_FILE)}: its entries are not a DCP Metadata "
                                f"({problem})")
        return md


def _inflate(blob: bytes, expected: int) -> bytes:
    """``blob`` decompressed, if it holds ``expected`` bytes: never more than that is produced,
    and an ``expected`` that no ``len(blob)`` bytes of zlib can hold (it compresses at most
    about 1032:1) is refused before anything is allocated."""
    if expected < 0 or expected > 1100 * len(blob) + 1024:
        raise ValueError(f"{len(blob)} compressed bytes cannot hold {expected}")
    d = zlib.decompressobj()
    out = d.decompress(blob, expected + 1)
    if len(out) != expected or d.unconsumed_tail or not d.eof:
        raise ValueError(f"holds {len(out)}{'+' if d.unconsumed_tail else ''} bytes, not {expected}")
    return out


#: What a damaged or crafted directory makes the lookups raise (beyond ``IndexUnusable``).
_DAMAGED = (ValueError, KeyError, IndexError, TypeError, AttributeError, OverflowError, zlib.error, RecursionError)


def _overlapping(offs: np.ndarray, sizes: np.ndarray, boxes: tuple | None) -> np.ndarray:
    """The indices of the chunks that overlap any of ``boxes`` (DCP's test: a common interior
    in every dimension; an empty chunk or box overlaps nothing, a 0-d tensor everything)."""
    n = offs.shape[0]
    if boxes is None or offs.shape[1] == 0:
        return np.arange(n)
    hit = np.zeros(n, bool)
    ends = offs + sizes
    for o, s in boxes:
        bo = np.asarray(o, np.int64)
        if bo.shape[0] != offs.shape[1]:
            return np.arange(n)  # another rank count: let DCP's planner report it
        hit |= np.all((offs < bo + np.asarray(s, np.int64)) & (bo < ends), axis=1)
    return np.flatnonzero(hit)


def _check_published(directory: str, md_length: int, save_id: str, save_id_at: int) -> None:
    """The ``.metadata`` beside the index is the one it was written for."""
    path = os.path.join(directory, METADATA_FILE)
    want = pickled_str(save_id)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise IndexStale(f"{directory}: has a load index but no {METADATA_FILE}") from None
    try:
        size = os.fstat(fd).st_size
        got = os.pread(fd, len(want), save_id_at) if size == md_length else b""
    finally:
        os.close(fd)
    if got != want:
        raise IndexStale(f"{os.path.join(directory, INDEX_FILE)} belongs to another {METADATA_FILE} (it was "
                            "written by another save into this directory)")


def _read_exact(fd: int, offset: int, length: int, path: str, what: str = "the file") -> bytes:
    data = pread_all(fd, offset, length)
    if len(data) != length:
        raise IndexUnusable(f"{path}: {what} is truncated")
    return data



def wanted_of(state_dict: Mapping[str, Any]) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]] | None]:
    """The boxes each value of a flattened state dict loads: a DTensor its local chunks, a plain
    tensor all of it, anything else (a ShardedTensor, bytes) ``None``: every saved chunk."""
    out: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]] | None] = {}
    for fqn, obj in state_dict.items():
        boxes = None
        if hasattr(obj, "__create_chunk_list__"):
            try:
                boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in obj.__create_chunk_list__()]
            except Exception:  # noqa: BLE001 - read every chunk; DCP's planner decides
                boxes = None
        elif type(obj) in (torch.Tensor, torch.nn.Parameter):
            boxes = [((0,) * obj.dim(), tuple(obj.shape))]
        out[fqn] = boxes
    return out
