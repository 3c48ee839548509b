"""The reading half of the load index (:mod:`solosave._src.index.writer` has the format): every loading
rank, alone, before DCP's planner (:func:`solosave.load`).

:meth:`LoadIndex.open` checks that the index belongs to the ``.metadata`` beside it (its length
and ``save_id``); :meth:`LoadIndex.metadata_for` reads the directory, the geometries of the
groups of the requested keys and the row blocks of the chunks that overlap the requested boxes,
and returns a DCP ``Metadata`` of exactly those; :func:`wanted_of` gives the boxes of a
flattened state dict. Local files are read with ``pread``; an index of any other storage (a
URL) through the storage's :meth:`~solosave._src.storage.base.Storage.read_range`, one ranged
read per lookup.
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
from solosave._src.storage.base import Storage
from solosave._src.storage.local import pread_all

__all__ = ["LoadIndex", "wanted_of"]

_HEAD_READ = 64 << 10
#: The first read of an index or ``.metadata`` on storage that is not local files.
_STORAGE_HEAD = 1 << 20

#: A request: per flattened key, the boxes ``(offsets, sizes)`` a rank loads (``None``: all of it).
Wanted = Mapping[str, "Sequence[tuple[Sequence[int], Sequence[int]]] | None"]


def _enum(name: Any, kind: type) -> Any:
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, kind):
        raise ValueError(f"unknown {kind.__name__} {name!r}")
    return value


class _LocalFile:
    """A local file read with ``pread`` (``FileNotFoundError`` at once if it is missing)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)

    def read(self, offset: int, length: int) -> bytes:
        return pread_all(self._fd, offset, length)

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _StorageFile:
    """A file of any storage, read by ranges (``FileNotFoundError`` at the first read). Each
    request costs a round trip (on an object store, a GET): the first read fetches at least
    :data:`_STORAGE_HEAD` bytes and later reads inside them are served from memory, so a small
    index costs one request."""

    def __init__(self, storage: Storage, path: str) -> None:
        self.storage, self.path = storage, path
        self._head = b""
        self._size: int | None = None

    def read(self, offset: int, length: int) -> bytes:
        if offset + length <= len(self._head):
            return self._head[offset:offset + length]
        if offset == 0 and not self._head:
            self._head = self.storage.read_range(self.path, 0, max(length, _STORAGE_HEAD))
            if len(self._head) < max(length, _STORAGE_HEAD):  # the whole object: its size is known
                self._size = len(self._head)
            return self._head[:length]
        return self.storage.read_range(self.path, offset, length)

    def size(self) -> int:
        if self._size is None:
            self._size = self.storage.size(self.path)
        return self._size

    def close(self) -> None:
        self._head = b""


def _open_file(storage: Storage | None, directory: str, name: str) -> _LocalFile | _StorageFile:
    if storage is None or storage.local_files:
        return _LocalFile(os.path.join(directory, name))
    return _StorageFile(storage, storage.join(directory, name))


class LoadIndex:
    """An open ``.solosave-index`` that belongs to the ``.metadata`` beside it.

    :meth:`open` returns ``None`` when the checkpoint has no index (stock DCP, older solosave)
    and raises :class:`IndexUnusable` when it has one that cannot be used.
    """

    def __init__(self, directory: str, f: _LocalFile | _StorageFile, header: dict[str, Any],
                 directory_json: dict[str, Any], blobs_at: int, size: int) -> None:
        self.directory, self._f, self.header = directory, f, header
        self.files: list[str] = directory_json["files"]
        self.keys: dict[str, list[Any]] = directory_json["keys"]
        self.groups: list[list[int]] = directory_json["groups"]
        self.planner_data: dict[str, list[Any]] = directory_json.get("planner_data") or {}
        self.version: str | None = directory_json.get("version")
        #: Per file, the end of its last record (``None``: an index written before they were kept).
        self.file_ends: list[int] | None = directory_json.get("file_ends")
        ends = self.file_ends
        if ends is not None and (not isinstance(ends, list) or len(ends) != len(self.files)
                                 or not all(type(e) is int and e >= 0 for e in ends)):
            raise TypeError("file_ends is not one non-negative int per file")
        if not (isinstance(self.files, list) and isinstance(self.keys, dict) and isinstance(self.groups, list)
                and isinstance(self.planner_data, dict) and isinstance(self.version, (str, type(None)))):
            raise TypeError("files, keys, groups, planner_data or version of another type")
        for name in self.files:
            if confined_path(directory, name) is None:
                raise ValueError(f"it names data file {name!r}, not a file inside the checkpoint directory")
        self._blobs_at, self._size = blobs_at, size
        self._geometry: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        #: Bytes read from the index so far (header, directory, geometries, row blocks).
        self.bytes_read = 0

    # -- opening ---------------------------------------------------------------------------
    @classmethod
    def open(cls, directory: str | os.PathLike, storage: Storage | None = None) -> LoadIndex | None:
        """The index of ``directory``: a local one, or one of ``storage`` (read by ranges)."""
        directory = os.fspath(directory)
        if storage is None or storage.local_files:
            path = os.path.join(directory, INDEX_FILE)
            why = local_file_problem(directory, path)
            if why is not None:
                raise IndexUnusable(f"{path}: {why}")
        try:
            f = _open_file(storage, directory, INDEX_FILE)
            head = f.read(0, _HEAD_READ)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise IndexUnusable(f"{directory}: cannot read its load index ({e})") from e
        try:
            return cls._open(directory, f.path, f, head, storage)
        except OSError as e:
            f.close()
            raise IndexUnusable(f"{f.path}: cannot read it ({e})") from e
        except BaseException:
            f.close()
            raise

    @classmethod
    def _open(cls, directory: str, path: str, f: _LocalFile | _StorageFile, head: bytes,
              storage: Storage | None) -> LoadIndex:
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
        size = f.size()
        if size != body + body_length or body_length < PREFIX.size:
            raise IndexUnusable(f"{path}: truncated or extended (not the {body + body_length} bytes its "
                                "header says)")
        _check_published(directory, md_length, save_id, save_id_at, storage)
        prefix = head[body:body + PREFIX.size] if body + PREFIX.size <= len(head) else _read_exact(
            f, body, PREFIX.size, path)
        dir_len, dir_crc = PREFIX.unpack(prefix)
        at = body + PREFIX.size
        if at + dir_len > size:  # the length field has no checksum of its own: never read what it claims
            raise IndexUnusable(f"{path}: its directory length ({dir_len} bytes) runs past the end of the file")
        raw = head[at:at + dir_len] if at + dir_len <= len(head) else _read_exact(f, at, dir_len, path)
        if zlib.crc32(raw) != dir_crc:
            raise IndexUnusable(f"{path}: its directory is corrupt (checksum mismatch)")
        try:
            self = cls(directory, f, header, json.loads(raw), at + dir_len, size)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise IndexUnusable(f"{path}: its directory is corrupt ({e})") from e
        self.bytes_read = len(head) if at + dir_len <= len(head) else len(head) + dir_len
        return self

    @property
    def path(self) -> str:
        return self._f.path

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> LoadIndex:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- lookups ---------------------------------------------------------------------------
    def _read(self, offset: int, length: int, what: str) -> bytes:
        if offset < 0 or length < 0 or self._blobs_at + offset + length > self._size:
            raise IndexUnusable(f"{self.path}: {what} lies outside the file (offset {offset}, {length} bytes)")
        data = _read_exact(self._f, self._blobs_at + offset, length, self.path, what)
        self.bytes_read += length
        return data

    def geometry(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """Group ``g``'s chunk offsets and sizes, ``(chunks, dims)`` int64 each."""
        got = self._geometry.get(g)
        if got is None:
            n, nd, _, off, length, crc, _ = self.groups[g]
            blob = self._read(off, length, f"the geometry of group {g}")
            if zlib.crc32(blob) != crc:
                raise IndexUnusable(f"{self.path}: the geometry of group {g} is "
                                    "corrupt (checksum mismatch)")
            arr = np.frombuffer(_inflate(blob, 16 * n * nd), "<i8")
            if arr.size != 2 * n * nd:
                raise IndexUnusable(f"{self.path}: the geometry of group {g} "
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
                if zlib.crc32(raw[i, :width].data) != int(raw[i, width:].view("<u4")[0]):
                    raise IndexUnusable(f"{self.path}: the rows of chunk {a + i} "
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
            raise IndexUnusable(f"{self.path}: corrupt ({err!r})") from err
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
            raise IndexUnusable(f"{self.path}: corrupt ({err!r})") from err
        version: dict[str, Any] = {"version": self.version} if METADATA_VERSION and self.version else {}
        md = Metadata(state_dict_metadata=sdm, planner_data=planner_data, storage_data=storage, **version)
        problem = metadata_problem(md)  # only this rank's entries: cheap
        if problem:
            raise IndexUnusable(f"{self.path}: its entries are not a DCP Metadata "
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


def _check_published(directory: str, md_length: int, save_id: str, save_id_at: int,
                     storage: Storage | None = None) -> None:
    """The ``.metadata`` beside the index is the one it was written for."""
    want = pickled_str(save_id)
    try:
        f = _open_file(storage, directory, METADATA_FILE)
        try:
            if isinstance(f, _StorageFile):  # one request: from the save_id to one byte past the end
                tail = f.read(save_id_at, md_length + 1 - save_id_at)
                got = tail[:len(want)] if len(tail) == md_length - save_id_at else b""
            else:
                got = f.read(save_id_at, len(want)) if f.size() == md_length else b""
        finally:
            f.close()
    except FileNotFoundError:
        raise IndexStale(f"{directory}: has a load index but no {METADATA_FILE}") from None
    if got != want:
        raise IndexStale(f"the load index of {directory} belongs to another {METADATA_FILE} (it was "
                         "written by another save into this directory)")


def _read_exact(f: _LocalFile | _StorageFile, offset: int, length: int, path: str, what: str = "the file") -> bytes:
    data = f.read(offset, length)
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
