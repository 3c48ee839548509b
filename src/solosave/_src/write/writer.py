"""Step 3 of a save: writing one rank's ``__{rank}_{n}.distcp`` files (background worker).

:class:`FileWriter` is the storage extension point: it writes the records of one file and
reports ``(key, relative_path, offset, length)`` per record. Subclass it to change how bytes
reach storage (tests subclass it to inject I/O errors); pass an instance as
``AsyncCheckpointer(writer=...)``. It must be picklable (it travels to the worker process).

Record format (what stock DCP reads): a tensor is a ``torch.save`` record of exactly the
tensor's bytes; a BYTES item is the raw ``torch.save`` payload of the object, followed by zero
padding up to its slot length when ``torch.load`` still reads it so (see
:func:`padded_payload`). Padding gives small objects room to change without changing the
layout (see :func:`bytes_slot`).
"""

from __future__ import annotations

import errno
import functools
import io
import os
import pickle
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import torch

from solosave._src.coordination.protocol import WriteResult
from solosave._src.core.checksum import crc32
from solosave._src.formats.checksum_sidecar import sidecar_bytes
from solosave._src.formats.dcp import ItemKey, checksum_path
from solosave._src.formats.record_writer import CrcAhead, FrameCache, TensorFrame, raw_bytes, record_crc
from solosave._src.storage.base import DataFile
from solosave._src.storage.registry import storage_for
from solosave._src.storage.writeback import start_writeback, writev_all


class _CrcStream:
    """A write-only file wrapper that keeps a running CRC32 of everything written through it."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.crc = 0

    def write(self, b: bytes | bytearray | memoryview) -> int:
        self.crc = crc32(b, self.crc)
        return self.raw.write(b)

    def write_stable(self, b: memoryview) -> int:
        self.crc = crc32(b, self.crc)
        return _write_stable(self.raw, b)

    def take(self) -> int:
        crc, self.crc = self.crc, 0
        return crc

    def __getattr__(self, name: str) -> object:  # tell, flush, fileno, close, ...
        return getattr(self.raw, name)


def _write_stable(stream: BinaryIO, data: memoryview) -> int:
    """Write staged bytes, which stay valid until the file is closed: an object upload sends
    them without a copy (``ObjectUpload.write_stable``); a file just writes them."""
    write = getattr(stream, "write_stable", None)
    return write(data) if write is not None else stream.write(data)


def bytes_slot(n: int) -> int:
    """Slot length of a BYTES record whose payload is ``n`` bytes, on the collective path.

    ``n`` plus 1/8 (at least 256 bytes) of headroom, rounded up to 512: an int, a float, a short
    string or a fixed-size RNG state keep their slot whatever their value; a payload that outgrows
    its slot on a reuse save is a layout drift (the fallback path handles it).
    """
    return (n + max(256, n // 8) + 511) // 512 * 512


def padded_payload(payload: bytes, length: int) -> bytes | None:
    """``payload`` followed by zeros up to ``length``, if ``torch.load`` still reads it back.

    The zip reader behind ``torch.load`` finds the archive by searching backwards from the end,
    and some padding sizes defeat that search; so padding is limited to the payload's own size
    and every padded record is checked by loading it once. ``None``: it cannot be padded (the
    record keeps its natural length, which a reuse save reports as a layout drift).

    The check reads the archive and its pickle without resolving the classes it names
    (:class:`_Stub` stands in for them): the worker process does not have the trainer's
    ``__main__``, and resolving a class defined there failed the check on every save, so such
    a value never kept its padded slot and every save whose payload size changed took the
    collective path. Nothing of the user's code runs in the worker here.
    Storages are mapped to the CPU: the worker never touches CUDA.
    """
    extra = length - len(payload)
    if extra == 0:
        return payload
    if extra < 0 or extra > len(payload):
        return None
    data = payload + b"\0" * extra
    try:
        # map_location: a value holding CUDA tensors is read back on the CPU, so the worker never
        # initialises CUDA (and, without CUDA, such a value still keeps its padded slot)
        torch.load(io.BytesIO(data), weights_only=False, pickle_module=_structure_only, map_location="cpu")
    except Exception:  # noqa: BLE001 - any failure means: do not pad
        return None
    return data


class _Stub:
    """Stands in for every class a padded payload names (see :func:`padded_payload`)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __setstate__(self, state: object) -> None:
        pass

    @classmethod
    def _make(cls, *args: object, **kwargs: object) -> _Stub:
        return cls()


class _StubUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        if module.startswith(("torch", "collections", "builtins", "copyreg", "numpy")):
            return super().find_class(module, name)
        return _Stub._make if name and name[0].islower() else _Stub


class _StructureOnly:
    """A ``pickle_module`` for ``torch.load`` that resolves no user class."""

    Unpickler = _StubUnpickler
    __name__ = "solosave-structure-only"

    @staticmethod
    def load(f: object, **kwargs: object) -> object:
        return _StubUnpickler(f, **kwargs).load()  # type: ignore[arg-type]


_structure_only = _StructureOnly()


@dataclass(frozen=True, slots=True)
class Record:
    """One record to write: a CPU tensor or a serialized payload, and its padded length."""

    key: ItemKey
    tensor: torch.Tensor | None = None
    payload: bytes | None = None
    #: Pad the record with zeros up to this length (BYTES records only); ``None``: no padding.
    pad_to: int | None = None


def _write_error(stream: BinaryIO, record: Record, e: Exception) -> OSError:
    """The ``OSError`` behind a failed ``torch.save`` into ``stream`` (a full disk shows up as
    ``inline_container.cc ... unexpected pos``)."""
    need = record.tensor.numel() * record.tensor.element_size() if record.tensor is not None else 0
    try:
        st = os.fstatvfs(stream.fileno())
        if st.f_bavail * st.f_frsize < need + (1 << 20):
            return OSError(errno.ENOSPC, f"No space left on device while writing {record.key[0]!r} "
                           f"({need} bytes; {st.f_bavail * st.f_frsize} bytes free)")
    except (OSError, AttributeError, ValueError):
        pass
    code = e.errno if isinstance(e, OSError) and e.errno else errno.EIO
    return OSError(code, f"writing {record.key[0]!r} failed: {e}")


#: Bytes gathered before one ``writev`` batch goes out.
_BATCH_BYTES = 8 << 20
#: The first batch of a file: the disk starts once its records' CRCs are known, and the
#: batches double from here to ``_BATCH_BYTES`` (the disk starts sooner than with 8 MiB from
#: the start: CHANGELOG).
_FIRST_BATCH_BYTES = 1 << 20
#: Records of one frame in a batch from which their suffixes are built at once
#: (``suffixes_with``, a fixed cost plus a small one per record) rather than one by one
#: (``suffix_with``): about where the two cost the same.
_SUFFIXES_AT_ONCE = 64


class FileWriter:
    """Writes the files of one rank, one thread per file.

    Called only in the background (worker process or thread), by :class:`~solosave._src.engine.engine.Engine`,
    in this order per save: ``write_files`` -> for each file, in a pool thread, ``write_file``
    -> ``open`` / ``write_record`` per record / ``close``.
    """

    fsync: bool = True
    checksums: bool = False
    #: URL destinations: keyword arguments of the fsspec filesystem (set by the engine from
    #: ``CheckpointerOptions.storage_options`` unless given here).
    storage_options: dict | None = None
    #: URL destinations on S3: the size of the first parts of a data file's multipart upload
    #: (parts grow after 2,000 of them) and the parts in flight at once per file; a file's
    #: upload holds at most about ``part_size * upload_concurrency`` bytes of copies.
    part_size: int = 16 << 20
    upload_concurrency: int = 8

    def __init__(self, fsync: bool = True, checksums: bool = False, *, storage_options: dict | None = None,
                 part_size: int | None = None, upload_concurrency: int | None = None) -> None:
        self.fsync = fsync
        #: Record a CRC32 of every record in a sidecar ``<file>.crc32`` (JSON, see
        #: ``formats/checksum_sidecar.py``), written and fsynced before the data file's results
        #: are reported, so before ``.metadata``.
        self.checksums = checksums
        if storage_options is not None:
            self.storage_options = dict(storage_options)
        if part_size is not None:
            self.part_size = part_size
        if upload_concurrency is not None:
            self.upload_concurrency = upload_concurrency

    def open(self, path: str) -> BinaryIO:
        """Open a new data file at ``path`` and return it.

        It is its storage's :class:`~solosave._src.storage.base.DataFile` (a local file, an object
        upload whose object appears only when :meth:`close` commits it); closed by :meth:`close`
        or, on an error, abandoned by its own ``close()``."""
        return storage_for(path, self.storage_options).open_data(  # type: ignore[return-value]
            path, fsync=self.fsync, part_size=self.part_size, concurrency=self.upload_concurrency)

    def write_record(self, stream: BinaryIO, record: Record, crc: Callable[[], int] | None = None) -> None:
        """Write one record at the stream's position.

        A tensor record is ``torch.save``'s archive of the tensor, written from a cached frame
        around the staged bytes (see ``formats/record_writer.py``; byte-identical) or by
        ``torch.save`` itself where no frame fits. ``crc``: gives the CRC32 of the tensor's bytes
        (computed ahead), else computed here."""
        if record.payload is not None:
            stream.write(record.payload)
            return
        if record.tensor is None:
            raise ValueError(f"internal: record {record.key[0]!r} has neither a tensor nor a payload")
        frame = self._frame_cache().get(record.tensor)
        try:
            if frame is None:
                torch.save(record.tensor, stream)
                return
            data = raw_bytes(record.tensor)
            stream.write(frame.prefix)
            _write_stable(stream, data)
            stream.write(frame.suffix_with(crc() if crc is not None else record_crc(data)))
        except (RuntimeError, OSError) as e:  # torch's zip writer hides the OSError of a failed write
            raise _write_error(stream, record, e) from e

    def _frame_cache(self) -> FrameCache:
        cache = self.__dict__.get("_frames")
        if cache is None:
            cache = self.__dict__["_frames"] = FrameCache()
        return cache

    def __getstate__(self) -> dict:
        """Pickled (to the worker process) without the frame cache, which is rebuilt there."""
        return {k: v for k, v in self.__dict__.items() if k != "_frames"}

    def close(self, stream: BinaryIO) -> None:
        """Commit the data file (durable; an object appears now, whole)."""
        if isinstance(stream, DataFile):
            stream.commit()
            return
        stream.flush()  # a plain file from a subclass's own open()
        if self.fsync:
            os.fsync(stream.fileno())
        stream.close()

    def write_file(self, directory: str, relative_path: str, records: Sequence[Record]) -> list[WriteResult]:
        storage = storage_for(directory, self.storage_options)
        path = storage.join(directory, relative_path)
        sidecar = checksum_path(path)
        if not self.checksums:
            storage.remove(sidecar)  # a stale sidecar of an overwritten checkpoint would mislead verify
        raw = self.open(path)
        stream: BinaryIO = _CrcStream(raw) if self.checksums else raw  # type: ignore[assignment]
        results: list[WriteResult] = []
        crcs: list[int] = []
        frames = self._frame_cache()
        framed = [frames.lookup(r.tensor) if r.tensor is not None else None for r in records]
        ahead = CrcAhead([f[1] if f is not None else None for f in framed])
        try:
            if self._can_batch(raw):
                self._write_batched(raw, relative_path, records, framed, ahead, results, crcs)
                records = ()
            for i, rec in enumerate(records):
                offset = stream.tell()
                if rec.payload is not None and rec.pad_to is not None:
                    rec = Record(rec.key, payload=padded_payload(rec.payload, rec.pad_to) or rec.payload)
                self.write_record(stream, rec, functools.partial(ahead.get, i))
                results.append((rec.key, relative_path, offset, stream.tell() - offset))
                if self.checksums:
                    crcs.append(stream.take())  # type: ignore[attr-defined]
        except BaseException:
            raw.close()
            raise
        finally:
            ahead.close()
        self.close(raw)
        if self.checksums:
            self._write_checksums(sidecar, results, crcs)
        return results

    def _can_batch(self, raw: BinaryIO) -> bool:
        """Records go out as ``os.writev`` batches when nothing needs to see them one by one:
        ``write_record`` not overridden and a real file descriptor."""
        if type(self).write_record is not FileWriter.write_record:
            return False
        try:
            raw.fileno()
        except (AttributeError, OSError, ValueError):
            return False
        return True

    def _write_batched(self, raw: BinaryIO, rel: str, records: Sequence[Record], framed: list,
                       ahead: CrcAhead, results: list[WriteResult], crcs: list[int]) -> None:
        """Write ``records`` as ``write_record`` would, gathering up to ~8 MiB of records per
        ``writev`` (framed tensors: prefix, the staged bytes, suffix; the suffixes of a batch
        built at once per frame, see :meth:`TensorFrame.suffixes_with`); records no frame fits
        go through ``torch.save`` on the buffered stream between batches (with checksums,
        through a :class:`_CrcStream`: the file is never read back). An error names the record
        it happened in."""
        raw.flush()
        fd, pos = raw.fileno(), raw.tell()
        batch: list[tuple[int, TensorFrame | None, Any]] = []  # (record, frame or None, data)
        start, limit = pos, _FIRST_BATCH_BYTES
        for i, rec in enumerate(records):
            if framed[i] is not None:
                frame, data = framed[i]
                batch.append((i, frame, data))
                length = frame.length
            elif rec.payload is not None:
                data = padded_payload(rec.payload, rec.pad_to) or rec.payload if rec.pad_to else rec.payload
                batch.append((i, None, data))
                length = len(data)
            else:  # no frame: torch.save, after what is gathered
                self._flush_batch(raw, records, batch, ahead, crcs)
                batch = []
                os.lseek(fd, pos, os.SEEK_SET)
                raw.seek(pos)
                stream: BinaryIO = _CrcStream(raw) if self.checksums else raw  # type: ignore[assignment]
                self.write_record(stream, rec)  # its errors name the record
                try:
                    raw.flush()
                except OSError as e:
                    raise _write_error(raw, rec, e) from e
                results.append((rec.key, rel, pos, raw.tell() - pos))
                pos = start = raw.tell()
                if self.checksums:
                    crcs.append(stream.take())  # type: ignore[attr-defined]
                continue
            results.append((rec.key, rel, pos, length))
            pos += length
            if pos - start >= limit:
                self._flush_batch(raw, records, batch, ahead, crcs)
                if self.fsync:
                    start_writeback(fd, start, pos - start)
                batch, start, limit = [], pos, min(2 * limit, _BATCH_BYTES)
        self._flush_batch(raw, records, batch, ahead, crcs)
        raw.seek(pos)

    def _flush_batch(self, raw: BinaryIO, records: Sequence[Record], batch: list[tuple[int, TensorFrame | None, Any]],
                     ahead: CrcAhead, crcs: list[int]) -> None:
        """One ``writev`` of ``batch`` (see :meth:`_write_batched`); with checksums, each
        record's CRC32 appended to ``crcs``. A failed write names the batch's first record."""
        if not batch:
            return
        suffixes: list[Any] = [None] * len(batch)
        by_frame: dict[int, tuple[TensorFrame, list[int]]] = {}
        for j, (_, frame, _) in enumerate(batch):
            if frame is not None:
                by_frame.setdefault(id(frame), (frame, []))[1].append(j)
        for frame, rows in by_frame.values():
            crcs_of = (ahead.get(batch[j][0]) for j in rows)
            if len(rows) >= _SUFFIXES_AT_ONCE:
                made: Any = frame.suffixes_with(np.fromiter(crcs_of, np.uint32, len(rows)))
            else:
                made = [frame.suffix_with(c) for c in crcs_of]
            for j, row in zip(rows, made):
                suffixes[j] = row
        pieces: list[Any] = []
        for (_, frame, data), suffix in zip(batch, suffixes):
            parts = (data,) if frame is None else (frame.prefix, data, suffix)
            pieces += parts
            if self.checksums:
                crc = 0
                for p in parts:
                    crc = crc32(p, crc)
                crcs.append(crc)
        try:
            writev_all(raw.fileno(), pieces)
        except OSError as e:
            raise _write_error(raw, records[batch[0][0]], e) from e

    def _write_checksums(self, sidecar: str, results: list[WriteResult], crcs: list[int]) -> None:
        """Write the sidecar of a data file (``formats/checksum_sidecar.py``): one CRC32 per record."""
        data = sidecar_bytes((off, n, c) for (_, _, off, n), c in zip(results, crcs, strict=True))
        out = storage_for(sidecar, self.storage_options).open_data(
            sidecar, fsync=self.fsync, part_size=self.part_size, concurrency=self.upload_concurrency)
        try:
            out.write(data)
        except BaseException:
            out.close()
            raise
        out.commit()

    def write_files(self, directory: str, files: Sequence[tuple[str, Sequence[Record]]]) -> list[WriteResult]:
        """Write every file (one thread each); raise the first error after all threads end."""
        if len(files) <= 1:
            return [r for name, recs in files for r in self.write_file(directory, name, recs)]
        with ThreadPoolExecutor(max_workers=len(files), thread_name_prefix="solosave-write") as pool:
            futures = [pool.submit(self.write_file, directory, name, recs) for name, recs in files]
            out: list[WriteResult] = []
            errors = []
            for f in futures:
                try:
                    out.extend(f.result())
                except Exception as e:  # noqa: BLE001 - collected and re-raised below
                    errors.append(e)
            if errors:
                raise errors[0]
            return out
