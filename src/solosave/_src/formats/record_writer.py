"""Tensor records written from raw bytes, identical in form to ``torch.save`` (background worker).

A DCP tensor record is a ``torch.save`` archive (a zip) of one tensor. Per record, ``torch.save``
pickles the tensor, writes a handful of small zip entries, copies the storage bytes and computes
the zip's CRC32 of them. For a given dtype and shape, everything but the storage bytes and the
two CRC fields is the same on every save. :func:`build_frame` builds that frame once per
``(dtype, shape)`` by running ``torch.save`` under ``torch.serialization.skip_data`` into a sink
that keeps only the metadata bytes (no storage is read or allocated), and finds the fields that
depend on the storage bytes through :mod:`solosave._src.formats.torch_zip` (the one parser of the
archive's zip layout). Writing a record is then ``prefix``, the staged bytes straight from the
staging buffer, and ``suffix`` with the CRC32 patched in: the byte layout of ``torch.save``'s own
record, so stock ``torch.load`` / DCP read it (``tests/unit/formats/test_records.py`` compares
the bytes).

The archive's ``.data/serialization_id`` entry (an opaque id folded from the CRC32s of the
entries) is recomputed per record too. Tensors whose storage is not exactly their bytes (views,
non-contiguous, empty) and torch builds without ``skip_data`` take ``torch.save`` itself.
"""

from __future__ import annotations

import ctypes
import threading
import zlib
from dataclasses import dataclass
from typing import IO, Any, cast

import numpy as np
import torch

from solosave._src.core.checksum import crc32
from solosave._src.formats import torch_zip

_MASK = (1 << 64) - 1


def _hash_combine(seed: int, value: int) -> int:
    """c10::hash_combine on 64 bits (how ``torch.save`` folds its records' CRC32s into the
    archive's serialization id)."""
    return (seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _MASK) + (seed >> 2)) & _MASK)) & _MASK


_ID_DIGITS = 20


def _fold(seed: np.ndarray, value: np.ndarray | np.uint64) -> np.ndarray:
    """:func:`_hash_combine` on arrays of uint64 (numpy's uint64 arithmetic wraps, as c10's)."""
    return seed ^ (value + np.uint64(0x9E3779B9) + (seed << np.uint64(6)) + (seed >> np.uint64(2)))


@dataclass(frozen=True, slots=True)
class TensorFrame:
    """The bytes of a ``torch.save`` record around the storage bytes of one (dtype, shape).

    ``suffixes_with(crcs)`` patches what depends on the storage bytes, for many records at
    once: the data entry's CRC32 (in its data descriptor and its central directory entry) and
    the serialization id (the CRC32s of the archive's entries folded in order, written as 20
    decimal digits), with that entry's own CRC32s."""

    prefix: bytes
    suffix: bytes
    nbytes: int
    #: Offsets in ``suffix`` of the data entry's CRC32 fields.
    crc_at: tuple[int, ...]
    #: The serialization id's fold of the CRC32s of the entries before the data entry, and the
    #: CRC32s of the entries after it (the id folds every entry's CRC32 in archive order).
    fold_seed: int
    chain_after: tuple[int, ...]
    #: Offset in ``suffix`` of the id's last 20 digits, and of the id entry's CRC32 fields.
    id_at: int
    id_crc_at: tuple[int, ...]
    #: The id entry's CRC32 as a function of its last 20 digits. A CRC32 is affine over GF(2)
    #: for a fixed length, so it is ``id_crc_base`` (all 20 digits ``0``) XOR, per digit
    #: position ``p`` holding ``d``, the little-endian uint32 ``id_crc_table[4 * (10 * p + d)]``.
    id_crc_base: int
    id_crc_table: bytes

    @property
    def length(self) -> int:
        """Bytes of one record: prefix, storage bytes, suffix."""
        return len(self.prefix) + self.nbytes + len(self.suffix)

    def suffixes_with(self, crcs: np.ndarray) -> np.ndarray:
        """The suffixes of records whose storage bytes have the CRC32s ``crcs`` (uint32), one
        row each (uint8, shape ``(len(crcs), len(suffix))``): array operations, no loop per
        record."""
        crcs = np.ascontiguousarray(crcs, dtype=np.uint32)
        n = len(crcs)
        out = np.tile(np.frombuffer(self.suffix, np.uint8), (n, 1))
        as_bytes = crcs.astype("<u4").view(np.uint8).reshape(n, 4)
        for at in self.crc_at:
            out[:, at:at + 4] = as_bytes
        folded = _fold(np.full(n, self.fold_seed, np.uint64), crcs.astype(np.uint64))
        for c in self.chain_after:
            folded = _fold(folded, np.uint64(c))
        digits = np.empty((n, _ID_DIGITS), np.uint8)
        for p in range(_ID_DIGITS - 1, -1, -1):
            digits[:, p] = folded % np.uint64(10)
            folded //= np.uint64(10)
        out[:, self.id_at:self.id_at + _ID_DIGITS] = digits + ord("0")
        table = np.frombuffer(self.id_crc_table, "<u4").reshape(_ID_DIGITS, 10)
        id_crc = np.bitwise_xor.reduce(table[np.arange(_ID_DIGITS), digits], axis=1) ^ np.uint32(self.id_crc_base)
        id_bytes = id_crc.astype("<u4").view(np.uint8).reshape(n, 4)
        for at in self.id_crc_at:
            out[:, at:at + 4] = id_bytes
        return out

    def suffix_with(self, crc: int) -> bytes:
        """The suffix of one record whose storage bytes have the CRC32 ``crc`` (the same bytes
        as a row of :meth:`suffixes_with`, computed per record: far cheaper than a batch of
        one; the path of writers that see records one by one)."""
        s = bytearray(self.suffix)
        for at in self.crc_at:
            torch_zip.put_crc(s, at, crc)
        folded = _hash_combine(self.fold_seed, crc)
        for c in self.chain_after:
            folded = _hash_combine(folded, c)
        s[self.id_at:self.id_at + _ID_DIGITS] = b"%020d" % folded
        id_crc = zlib.crc32(bytes(s[self.id_at - _ID_DIGITS:self.id_at + _ID_DIGITS]))
        for at in self.id_crc_at:
            torch_zip.put_crc(s, at, id_crc)
        return bytes(s)


def _id_crc_table(suffix: bytes, id_at: int) -> tuple[int, bytes]:
    """``(id_crc_base, id_crc_table)`` of :class:`TensorFrame` for the 40-digit id that ends
    20 bytes after ``id_at`` in ``suffix``."""
    zeros = bytearray(suffix[id_at - _ID_DIGITS:id_at]) + b"0" * _ID_DIGITS
    base = zlib.crc32(zeros)
    table = np.empty((_ID_DIGITS, 10), "<u4")
    for p in range(_ID_DIGITS):
        for d in range(10):
            probe = bytearray(zeros)
            probe[_ID_DIGITS + p] = ord("0") + d
            table[p, d] = zlib.crc32(probe) ^ base
    return base, table.tobytes()


class _Sink:
    """A seekable write-only file that keeps what is written and where (no storage bytes under
    ``skip_data``: the writer seeks over them)."""

    def __init__(self) -> None:
        self.pos = 0
        self.end = 0
        self.parts: list[tuple[int, bytes]] = []

    def write(self, b: Any) -> int:
        data = bytes(b)
        self.parts.append((self.pos, data))
        self.pos += len(data)
        self.end = max(self.end, self.pos)
        return len(data)

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else self.end + pos
        return self.pos

    def flush(self) -> None:
        pass


def _stitch(parts: list[tuple[int, bytes]], start: int, stop: int) -> bytes:
    out = bytearray(stop - start)
    for pos, data in parts:
        if start <= pos < stop:
            out[pos - start:pos - start + len(data)] = data
    return bytes(out)


def build_frame(dtype: torch.dtype, shape: tuple[int, ...]) -> TensorFrame | None:
    """The frame of a contiguous ``dtype`` tensor of ``shape``, or ``None`` where it cannot be
    built (no ``skip_data`` in this torch, an empty tensor, an archive of unexpected form)."""
    skip = getattr(torch.serialization, "skip_data", None)
    template = torch.empty(shape, dtype=dtype)  # untouched pages: nothing is read or copied
    nbytes = template.numel() * template.element_size()
    if skip is None or nbytes == 0:
        return None
    sink = _Sink()
    with skip():
        torch.save(template, cast("IO[bytes]", sink))  # torch calls only write, tell, seek and flush
    holes = _holes(sink)
    if len(holes) != 1 or holes[0][1] - holes[0][0] != nbytes:
        return None
    start, stop = holes[0]
    prefix, suffix = _stitch(sink.parts, 0, start), _stitch(sink.parts, stop, sink.end)
    try:
        return _frame(prefix, suffix, nbytes, stop)
    except ValueError:  # an archive of a form this code does not know
        return None


def _holes(sink: _Sink) -> list[tuple[int, int]]:
    holes, covered = [], 0
    for pos, data in sorted(sink.parts):
        if pos > covered:
            holes.append((covered, pos))
        covered = max(covered, pos + len(data))
    return holes


def _frame(prefix: bytes, suffix: bytes, nbytes: int, base: int) -> TensorFrame:
    """Locate in ``suffix`` (archive offset ``base``, right after the storage bytes) what
    :meth:`TensorFrame.suffixes_with` patches: the data entry's CRC32 in its data descriptor
    (the first bytes of ``suffix``) and in its central header; the serialization id's digits,
    and its CRC32 in its descriptor and central header."""
    length = base + len(suffix)

    def get(at: int, n: int) -> bytes:  # only the bytes from ``base`` on are in the frame
        if at < base:
            raise ValueError("a zip structure the frame needs lies before the storage bytes")
        return suffix[at - base:at - base + n]

    d = torch_zip.find_directory(get, length, torch_zip.ONE_TENSOR_MAX_ENTRIES)
    entries = torch_zip.central_entries(torch_zip.read_exact(get, d.offset, d.size, length), d.count)
    data = [e for e in entries if e.name.endswith(b"/data/0")]
    ident = [e for e in entries if e.name.endswith(b"/.data/serialization_id")]
    if len(data) != 1 or len(ident) != 1 or ident[0] is not entries[-1]:
        raise ValueError("unexpected entries")
    id_data = torch_zip.stored_data(get, ident[0], length)[0] - base
    if ident[0].size != 2 * _ID_DIGITS or not suffix[id_data:id_data + 2 * _ID_DIGITS].isdigit():
        raise ValueError("serialization id is not 40 digits")
    at = entries.index(data[0])
    seed = 0
    for e in entries[:at]:
        seed = _hash_combine(seed, e.crc)
    id_crc_base, table = _id_crc_table(suffix, id_data + _ID_DIGITS)
    cd_at = d.offset - base  # the central directory's offset in ``suffix``
    id_descriptor = id_data + ident[0].size
    return TensorFrame(prefix, suffix, nbytes,
                       crc_at=(torch_zip.descriptor_crc_at(suffix, 0), cd_at + data[0].crc_at),
                       fold_seed=seed, chain_after=tuple(e.crc for e in entries[at + 1:-1]),
                       id_at=id_data + _ID_DIGITS,
                       id_crc_at=(torch_zip.descriptor_crc_at(suffix, id_descriptor), cd_at + ident[0].crc_at),
                       id_crc_base=id_crc_base, id_crc_table=table)


class FrameCache:
    """Frames by ``(dtype, shape)``, built on first use (one per distinct tensor shape), and
    each tensor's frame and bytes by identity (the worker writes the same staged views on every
    save of a structure: looked up, not recomputed)."""

    #: Tensors remembered by identity before the memo starts afresh (a bound, not a tuning knob).
    MEMO_LIMIT = 1 << 17

    def __init__(self) -> None:
        self._frames: dict[tuple[torch.dtype, tuple[int, ...]], TensorFrame | None] = {}
        self._memo: dict[int, tuple[torch.Tensor, TensorFrame, memoryview] | None] = {}

    def get(self, tensor: torch.Tensor) -> TensorFrame | None:
        """The frame for ``tensor``, or ``None`` if it must go through ``torch.save``."""
        if not (tensor.device.type == "cpu" and tensor.is_contiguous() and tensor.storage_offset() == 0):
            return None
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0 or tensor.untyped_storage().nbytes() != nbytes:
            return None
        key = (tensor.dtype, tuple(tensor.shape))
        if key not in self._frames:
            self._frames[key] = build_frame(*key)
        return self._frames[key]

    def lookup(self, tensor: torch.Tensor) -> tuple[TensorFrame, memoryview] | None:
        """``tensor``'s frame and bytes, or ``None`` if it must go through ``torch.save``."""
        hit = self._memo.get(id(tensor))
        if hit is not None and hit[0] is tensor:
            return hit[1], hit[2]
        frame = self.get(tensor)
        if frame is None:
            return None
        if len(self._memo) >= self.MEMO_LIMIT:
            self._memo = {}
        data = raw_bytes(tensor)
        self._memo[id(tensor)] = (tensor, frame, data)
        return frame, data


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (valid while ``tensor`` lives)."""
    n = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_ubyte * n).from_address(tensor.data_ptr())).cast("B")


def record_crc(data: memoryview) -> int:
    """The zip CRC32 of a record's storage bytes (releases the GIL on large buffers)."""
    return crc32(data)


class CrcAhead:
    """The CRC32s of a file's framed records, computed in file order by one helper thread while
    the writer thread writes earlier records (zlib releases the GIL), so the writer rarely waits.

    ``get(i)`` blocks until record ``i``'s CRC is known; ``close()`` stops the thread (bounded:
    it finishes the record it is on). One per ``write_file`` call."""

    def __init__(self, views: list[memoryview | None]) -> None:
        self._views = views
        self._crcs: list[int] = [0] * len(views)
        self._done = 0
        self._stop = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="solosave-crc", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for i, view in enumerate(self._views):
            if self._stop:
                break
            if view is not None:
                self._crcs[i] = crc32(view)
            with self._cond:
                self._done = i + 1
                self._cond.notify()

    def get(self, i: int) -> int:
        if self._done <= i:
            with self._cond:
                while self._done <= i:
                    if not self._cond.wait(timeout=60.0) and not self._thread.is_alive():
                        raise RuntimeError("internal: the CRC thread ended early")
        return self._crcs[i]

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        self._views = []
