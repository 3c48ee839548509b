"""Decoding one tensor record of a ``.distcp`` file without unpickling it generically.

A tensor record is what ``torch.save`` writes for one tensor: a zip archive (entries stored
uncompressed) holding ``<prefix>/data.pkl`` (a small pickle that calls
``torch._utils._rebuild_tensor_v2`` or ``_v3`` on one storage), ``<prefix>/byteorder``, the
storage bytes in ``<prefix>/data/<key>`` and a few bookkeeping entries. :func:`parse_tensor_record`
finds the entries through :mod:`solosave._src.formats.torch_zip` (the one parser of that zip
layout; offsets relative to the record's first byte, as torch's writer records them), runs
``data.pkl`` through an unpickler that knows only those rebuild functions and storage classes -
mapped to inert stand-ins that record their arguments, so nothing of torch's or anyone's code
runs - plus dtypes and ``OrderedDict``, and returns where the storage lies in the record and
which tensor view of it was saved (:class:`TensorLayout`).
Records of one shape share their zip structure and ``data.pkl``: a :class:`RecordCache`
(one per load) keeps both, so most records are decoded by comparing a few hundred bytes.

Anything else (another archive form, a compressed entry, a big-endian record, a pickle naming
any other global, more than one storage) returns ``None``: the caller then loads the record
with ``torch.load(weights_only=True)``, as DCP does. Called by :mod:`solosave._src.load.read_path` only.
"""

from __future__ import annotations

import io
import math
import pickle
import sys
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from solosave._src.formats import torch_zip
from solosave._src.formats.safe_pickle import check_lengths

#: ``get(offset, n)``: ``n`` bytes of the record from ``offset`` (relative to its first byte).
Getter = torch_zip.Getter

_DTYPES: dict[str, torch.dtype] = {n: v for n, v in vars(torch).items() if isinstance(v, torch.dtype)}
_LEGACY_STORAGES: dict[str, torch.dtype] = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool, "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}


class _NotPlain(Exception):
    """The record is not a plain ``torch.save`` of one tensor: load it the general way."""


@dataclass(frozen=True, slots=True)
class _StorageType:
    dtype: torch.dtype | None  # None: an UntypedStorage (its numel counts bytes)


@dataclass(frozen=True, slots=True)
class _Storage:
    type: _StorageType
    key: str
    numel: int


@dataclass(frozen=True, slots=True)
class _Spec:
    """What ``data.pkl`` says: storage key, dtype, element count of the storage, saved view."""

    key: str
    dtype: torch.dtype
    storage_numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _ints(value: Any) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(type(v) is int and v >= 0 for v in value):
        raise _NotPlain
    return value


def _spec(storage: Any, offset: Any, size: Any, stride: Any, dtype: torch.dtype | None) -> _Spec:
    if not isinstance(storage, _Storage) or type(offset) is not int or offset < 0:
        raise _NotPlain
    size, stride = _ints(size), _ints(stride)
    if len(size) != len(stride):
        raise _NotPlain
    if storage.type.dtype is None:  # v3: an untyped storage of bytes and an explicit dtype
        if dtype is None:
            raise _NotPlain
        item = dtype.itemsize
        if item == 0 or storage.numel % item:
            raise _NotPlain
        return _Spec(storage.key, dtype, storage.numel // item, offset, size, stride)
    if dtype is not None and dtype != storage.type.dtype:
        raise _NotPlain
    return _Spec(storage.key, storage.type.dtype, storage.numel, offset, size, stride)


def _no_hooks(hooks: Any, metadata: Any) -> None:
    if not isinstance(hooks, OrderedDict) or hooks or metadata not in (None, {}):
        raise _NotPlain


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any,
                metadata: Any = None) -> _Spec:
    _no_hooks(hooks, metadata)
    return _spec(storage, offset, size, stride, None)


def _rebuild_v3(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any,
                dtype: Any, metadata: Any = None) -> _Spec:
    _no_hooks(hooks, metadata)
    if not isinstance(dtype, torch.dtype):
        raise _NotPlain
    return _spec(storage, offset, size, stride, dtype)


class _SpecUnpickler(pickle.Unpickler):
    """Knows the few globals of a plain tensor's ``data.pkl``, each as an inert stand-in."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_v2
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return _rebuild_v3
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        if module == "torch" and name in _LEGACY_STORAGES:
            return _StorageType(_LEGACY_STORAGES[name])
        if module == "torch.storage" and name == "UntypedStorage":
            return _StorageType(None)
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        raise _NotPlain

    def persistent_load(self, pid: Any) -> _Storage:
        if (not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage"
                or not isinstance(pid[1], _StorageType) or not isinstance(pid[2], str)
                or type(pid[4]) is not int or pid[4] < 0):
            raise _NotPlain
        return _Storage(pid[1], pid[2], pid[4])


def _parse_pickle(data: bytes) -> _Spec:
    try:
        check_lengths(data)  # the unpickler would allocate what a BINBYTES opcode claims first
        spec = _SpecUnpickler(io.BytesIO(data)).load()
    except _NotPlain:
        raise
    except Exception as e:  # noqa: BLE001 - any malformed pickle: not a plain record
        raise _NotPlain from e
    if not isinstance(spec, _Spec):
        raise _NotPlain
    return spec


@dataclass(frozen=True, slots=True)
class Region:
    """The bytes of one read request inside the record's storage: ``[lo, hi)`` relative to the
    storage's first byte, and the view of those bytes that forms the requested chunk."""

    lo: int
    hi: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    contiguous: bool            # the chunk is exactly the bytes ``[lo, hi)``, row-major
    numel: int


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """Where a record's storage lies (``payload_start``, ``payload_len``: bytes relative to the
    record's first byte) and the tensor view of it that was saved."""

    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    payload_start: int
    payload_len: int

    def region(self, offsets: Sequence[int], lengths: Sequence[int]) -> Region:
        """The storage bytes of the chunk ``[offsets, offsets + lengths)`` of the saved tensor
        (DCP's ``ReadItem.storage_offsets`` / ``lengths``); ``ValueError`` if it lies outside."""
        if len(offsets) != len(self.size) or len(lengths) != len(self.size):
            raise ValueError(f"a read of {len(lengths)} dimension(s) from a saved tensor of size "
                             f"{list(self.size)}")
        first = self.storage_offset
        for o, n, s, st in zip(offsets, lengths, self.size, self.stride):
            if o < 0 or n < 0 or o + n > s:
                raise ValueError(f"the chunk at {list(offsets)} of size {list(lengths)} lies outside "
                                 f"the saved tensor of size {list(self.size)}")
            first += o * st
        lengths = tuple(int(n) for n in lengths)
        numel = math.prod(lengths)
        item = self.dtype.itemsize
        if numel == 0:
            return Region(0, 0, lengths, self.stride, True, 0)
        last = first + sum((n - 1) * st for n, st in zip(lengths, self.stride))
        return Region(first * item, (last + 1) * item, lengths, self.stride,
                      _row_major(lengths, self.stride), numel)


def _row_major(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for n, st in zip(reversed(size), reversed(stride)):
        if n != 1 and st != expected:
            return False
        expected *= n
    return True


@dataclass(slots=True)
class _Template:
    """The zip structure of one parsed record. Records of equal shape written by the same
    torch differ only in their CRCs (central directory) and in the bytes of their entries, so
    a record whose central directory (CRCs aside) and local headers equal these is parsed by
    comparing bytes instead of parsing them again."""

    cd: bytes                               # the central directory, CRC fields zeroed
    crcs: tuple[int, ...]
    headers: tuple[tuple[int, bytes], ...]  # (offset, bytes) of the local headers relied on
    pkl: tuple[int, int]                    # (start, size) of data.pkl
    order: tuple[int, int]                  # of byteorder
    data: tuple[int, int]                   # of the one storage entry
    data_key: str
    layouts: dict[bytes, TensorLayout | None] = field(default_factory=dict)  # by data.pkl

    def matches(self, get: Getter, cd: Any) -> bool:
        masked = bytearray(cd)
        for at in self.crcs:
            masked[at:at + 4] = b"\0\0\0\0"
        return masked == self.cd and all(bytes(get(at, len(h))) == h for at, h in self.headers)


def _template(get: Getter, length: int, cd: Any, count: int) -> _Template:
    listed = torch_zip.central_entries(cd, count)
    entries = {e.name: e for e in listed}
    crcs = [e.crc_at for e in listed]
    pkl_name = next((n for n in entries if n.endswith(b"/data.pkl")), None)
    if pkl_name is None:
        raise _NotPlain
    prefix = pkl_name[:-len(b"data.pkl")]
    storages = [n for n in entries if n.startswith(prefix + b"data/")]
    if prefix + b"byteorder" not in entries or len(storages) != 1:
        raise _NotPlain
    names = (pkl_name, prefix + b"byteorder", storages[0])
    found = [torch_zip.stored_data(get, entries[n], length) for n in names]
    masked = bytearray(cd)
    for at in crcs:
        masked[at:at + 4] = b"\0\0\0\0"
    headers = tuple((entries[n].local, h) for n, (_, h) in zip(names, found))
    (pkl, _), (order, _), (data, _) = found
    return _Template(bytes(masked), tuple(crcs), headers, (pkl, entries[names[0]].size),
                     (order, entries[names[1]].size), (data, entries[names[2]].size),
                     storages[0][len(prefix) + 5:].decode())


def _layout(spec: _Spec, tpl: _Template) -> TensorLayout | None:
    start, nbytes = tpl.data
    if spec.key != tpl.data_key or nbytes != spec.storage_numel * spec.dtype.itemsize:
        return None
    if math.prod(spec.size) and spec.storage_offset + sum(
            (n - 1) * st for n, st in zip(spec.size, spec.stride)) >= spec.storage_numel:
        return None
    return TensorLayout(spec.dtype, spec.size, spec.stride, spec.storage_offset, start, nbytes)


class RecordCache:
    """What the records of one load share: zip templates by ``(record length, central
    directory offset and size)``, and the meaning of each distinct ``data.pkl``."""

    def __init__(self) -> None:
        self.templates: dict[tuple[int, int, int], _Template] = {}
        self.specs: dict[bytes, _Spec | None] = {}
        #: Per record length, the last layout decoded in full and the bytes that decoding read
        #: (CRC fields aside): a record of that length with the same bytes has that layout.
        self.quick: dict[int, tuple[tuple[tuple[int, bytes], ...], TensorLayout]] = {}

    def spec(self, pkl: bytes) -> _Spec | None:
        if pkl not in self.specs:
            try:
                self.specs[pkl] = _parse_pickle(pkl)
            except _NotPlain:
                self.specs[pkl] = None
        return self.specs[pkl]


def parse_tensor_record(get: Getter, length: int, cache: RecordCache) -> TensorLayout | None:
    """The layout of the tensor record of ``length`` bytes read through ``get``, or ``None`` if
    it is not a plain ``torch.save`` of one little-endian tensor (see the module docstring)."""
    if sys.byteorder != "little":
        return None
    quick = cache.quick.get(length)
    if quick is not None and all(get(at, len(b)) == b for at, b in quick[0]):
        return quick[1]  # a record of a length seen before: compared, not decoded
    try:
        directory = torch_zip.find_directory(get, length, torch_zip.ONE_TENSOR_MAX_ENTRIES)
        cd = torch_zip.read_exact(get, directory.offset, directory.size, length)
        key = (length, directory.offset, directory.size)
        tpl = cache.templates.get(key)
        if tpl is None or not tpl.matches(get, cd):
            tpl = cache.templates[key] = _template(get, length, cd, directory.count)
        if bytes(get(*tpl.order)) != b"little":
            return None
        pkl = bytes(get(*tpl.pkl))
        if pkl not in tpl.layouts:
            spec = cache.spec(pkl)
            tpl.layouts[pkl] = None if spec is None else _layout(spec, tpl)
        layout = tpl.layouts[pkl]
        if layout is not None:
            cache.quick[length] = (_marks(directory, tpl, pkl), layout)
        return layout
    except (_NotPlain, UnicodeError, ValueError, IndexError, KeyError, TypeError, OverflowError):
        return None  # damaged or another form: torch.load(weights_only=True) reads it, or says what is wrong


def _marks(directory: torch_zip.Directory, tpl: _Template, pkl: bytes) -> tuple[tuple[int, bytes], ...]:
    """``(offset, bytes)`` of everything the decoding of this record read except its CRC
    fields: the end records, the central directory, the local headers relied on,
    ``byteorder`` and ``data.pkl``. Another record of the same length holding these bytes
    decodes to the same layout, step for step."""
    marks = list(directory.ends)
    cd_offset = directory.offset
    pos = 0
    for at in sorted(tpl.crcs):  # the central directory between its CRC fields
        if at > pos:
            marks.append((cd_offset + pos, tpl.cd[pos:at]))
        pos = at + 4
    if pos < len(tpl.cd):
        marks.append((cd_offset + pos, tpl.cd[pos:]))
    marks += tpl.headers
    marks += [(tpl.order[0], b"little"), (tpl.pkl[0], pkl)]
    merged: list[tuple[int, bytes]] = []  # adjacent ranges as one comparison (overlapping ones apart)
    for at, b in sorted(marks):
        if merged and merged[-1][0] + len(merged[-1][1]) == at:
            merged[-1] = (merged[-1][0], merged[-1][1] + b)
        else:
            merged.append((at, b))
    return tuple(merged)
