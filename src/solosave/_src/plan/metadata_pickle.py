"""The ``.metadata`` pickle of a collective save, written from columns (coordinator only).

Stock DCP reads ``.metadata`` with a plain ``pickle.load``; what it must get is a ``Metadata``
equal to the ``Metadata`` object DCP's own finish step would build. Building that object (800k
``MetadataIndex``/``_StorageInfo`` objects at W=4096) and pickling it (``_StorageInfo`` has a
Python ``__getstate__``, called once per entry) took most of a create save's ``finish`` at
scale (docs/benchmarks.md, the scale section). :func:`metadata_template` writes the same pickle without those objects:

1. a *skeleton* ``Metadata`` - the plan's ``state_dict_metadata`` with a placeholder string for
   each tensor's ``chunks`` list, a placeholder for ``storage_data`` and ``storage_meta``
   placeholders - is pickled by ``pickle`` (protocol 2, as ``MetadataTemplate``), a few
   hundred objects;
2. each placeholder string is replaced by the opcodes of its value, written for all rows at
   once with numpy: fixed-width rows of ``NEWOBJ``/``BUILD`` records whose memo references
   (``LONG_BINGET``) and integers (``BININT`` or 8-byte ``LONG1``) are columns. Memo slots are
   numbered after the skeleton's, so they never collide; each chunk's offsets ``torch.Size`` is
   stored once and shared by its ``storage_data`` key, as ``build_metadata`` shares it.

The result unpickles (stock ``pickle``, ``safe_loads``) to a ``Metadata`` equal to
``build_metadata``'s (tests/unit/plan/test_metadata_pickle.py); its ``storage_meta`` placeholders make it
a :class:`~solosave._src.formats.metadata_template.MetadataTemplate`.
"""

from __future__ import annotations

import io
import pickle
import struct
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from solosave._src.formats.dcp import METADATA_VERSION
from solosave._src.formats.metadata_template import MetadataTemplate
from solosave._src.plan.columns import ChunkTable, ResultColumns, distinct_rows

_I32 = 1 << 31


def _ustr(s: str) -> bytes:
    """``BINUNICODE``, as pickle writes a ``str`` at protocol 2."""
    b = s.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(b)) + b


def _global(cls: type) -> bytes:
    return f"c{cls.__module__}\n{cls.__qualname__}\n".encode()


class _Memo:
    """Memo slots after the skeleton's; ``put`` stores the stack top (and pops it)."""

    def __init__(self, first: int) -> None:
        self.next = first

    def take(self, count: int = 1) -> int:
        first, self.next = self.next, self.next + count
        return first

    def put(self, value_ops: bytes) -> tuple[int, bytes]:
        slot = self.take()
        return slot, value_ops + b"r" + struct.pack("<I", slot) + b"0"


class _Rows:
    """Fixed-width rows of pickle opcodes, built column by column with numpy."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.cols: list[np.ndarray] = []

    def const(self, ops: bytes) -> _Rows:
        self.cols.append(np.broadcast_to(np.frombuffer(ops, dtype=np.uint8), (self.n, len(ops))))
        return self

    def u32(self, opcode: bytes | np.ndarray, values: Any) -> _Rows:
        """One opcode (or an opcode per row) followed by a 4-byte little-endian value."""
        op = np.full((self.n, 1), opcode[0], np.uint8) if isinstance(opcode, bytes) else opcode.reshape(-1, 1)
        v = np.broadcast_to(np.asarray(values, dtype="<i8"), (self.n,)).astype("<u4")
        self.cols += [op, v.view(np.uint8).reshape(self.n, 4)]
        return self

    def get(self, slot: Any) -> _Rows:
        return self.u32(b"j", slot)  # LONG_BINGET

    def put(self, slot: Any) -> _Rows:
        return self.u32(b"r", slot)  # LONG_BINPUT

    def integer(self, values: np.ndarray) -> _Rows:
        """``BININT`` when every value fits in 32 bits, else 8-byte ``LONG1``."""
        values = np.asarray(values, dtype="<i8")
        if not values.size or (int(values.min()) >= -_I32 and int(values.max()) < _I32):
            self.cols += [np.full((self.n, 1), ord("J"), np.uint8),
                          values.astype("<i4").view(np.uint8).reshape(self.n, 4)]
        else:
            self.const(b"\x8a\x08")
            self.cols.append(values.view(np.uint8).reshape(self.n, 8))
        return self

    def build(self) -> np.ndarray:
        return np.hstack(self.cols) if self.n else np.zeros((0, 0), np.uint8)


def metadata_template(sdm: Mapping[str, Any], planner_data: Mapping, table: ChunkTable,
                      results: ResultColumns) -> MetadataTemplate:
    """The ``.metadata`` pickle of ``sdm`` and the write results, as a template (see the module
    docstring); ``table`` holds ``sdm``'s chunks, ``results`` rows are matched to it."""
    if list(sdm) != table.names:
        raise ValueError("internal: the chunk table does not describe the state_dict_metadata")
    tag = uuid.uuid4().hex
    ph_chunks = {fqn: f"\x00solosave-chunks-{tag}-{f}\x00" for f, fqn in enumerate(table.names)
                 if table.nd[f] >= 0}
    ph_data, ph_id, ph_save = (f"\x00solosave-{what}-{tag}\x00" for what in ("storage", "checkpoint-id", "save-id"))
    skeleton = Metadata(
        state_dict_metadata={fqn: TensorStorageMetadata(m.properties, m.size, ph_chunks[fqn])  # type: ignore[arg-type]
                             if fqn in ph_chunks else m for fqn, m in sdm.items()},
        planner_data=dict(planner_data or {}), storage_data=ph_data,
        storage_meta=StorageMeta(checkpoint_id=ph_id, save_id=ph_save), **METADATA_VERSION)
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=2)
    pickler.dump(skeleton)
    memo = pickler.memo.copy()
    fqn_slot = np.array([memo[id(k)][0] for k in skeleton.state_dict_metadata], dtype=np.int64)
    data = buf.getvalue()
    m = _Memo(max((slot for slot, _ in memo.values()), default=-1) + 1)
    del memo, pickler, skeleton
    prelude, slots, file_slots = _prelude(m, results.files)
    sizes, chunk_ops, first = _chunks(table, m, slots)
    storage = _storage_data(table, results, fqn_slot, first, slots, file_slots)
    segments = [chunk_ops[fqn] for fqn in ph_chunks] + [storage]
    needles = [_ustr(ph_chunks[fqn]) for fqn in ph_chunks] + [_ustr(ph_data)]
    segments[0] = prelude + sizes + segments[0]
    out, pos = [], 0
    for needle, seg in zip(needles, segments):
        at = data.find(needle, pos)
        if at < 0:
            raise RuntimeError("internal: a placeholder of the metadata skeleton was not found")
        out += [data[pos:at], seg]
        pos = at + len(needle)
    out.append(data[pos:])
    whole = b"".join(out)
    a, b = _ustr(ph_id), _ustr(ph_save)
    i, j = whole.find(a), whole.find(b)
    if i < 0 or j < i:
        raise RuntimeError("internal: the storage_meta placeholders were not found in order")
    return MetadataTemplate.from_parts((whole[:i], whole[i + len(a):j], whole[j + len(b):]))


def _prelude(m: _Memo, files: list[str]) -> tuple[bytes, dict[str, int], list[int]]:
    """Opcodes that memoise the classes, field names, ``None`` and data file names (each value
    is put in its slot and popped), their slots, and the files' slots."""
    ops, slots = [], {}
    for name, value in (("chunk", _global(ChunkStorageMetadata)), ("size", _global(torch.Size)),
                        ("index", _global(MetadataIndex)), ("info", _global(_StorageInfo)), ("none", b"N"),
                        *((f"s_{s}", _ustr(s)) for s in ("offsets", "sizes", "fqn", "index", "offset",
                                                          "relative_path", "length"))):
        slots[name], put = m.put(value)
        ops.append(put)
    file_slots = []
    for rel in files:
        slot, put = m.put(_ustr(rel))
        file_slots.append(slot)
        ops.append(put)
    return b"".join(ops), slots, file_slots


def _chunks(table: ChunkTable, m: _Memo, slots: dict[str, int]) -> tuple[bytes, dict[str, bytes], int]:
    """Per tensor fqn, the opcodes of its ``chunks`` list, and the opcodes that memoise every
    distinct chunk size first; chunk ``i``'s offsets are memoised in slot ``first + i`` (the
    third value returned)."""
    prelude = []
    first = m.take(table.n)
    fids = table.fids().numpy()
    nd_of = np.array(table.nd, dtype=np.int64)[fids] if table.n else np.zeros(0, np.int64)
    size_slot = np.zeros(table.n, dtype=np.int64)
    offs_all = table.offs.numpy()
    group_ops: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for nd in sorted({d for d in table.nd if d >= 0}):
        ids = np.nonzero(nd_of == nd)[0]
        distinct, inverse = (t.numpy() for t in distinct_rows(table.sizes[torch.from_numpy(ids), :nd]))
        base = m.next
        for row in distinct.tolist():
            prelude.append(m.put(_size_ops(slots["size"], row))[1])
        size_slot[ids] = base + inverse.reshape(-1)
        rows = _Rows(len(ids)).get(slots["chunk"]).const(b")\x81}(").get(slots["s_offsets"]).get(slots["size"])
        rows.const(b"(")
        for d in range(nd):
            rows.integer(offs_all[ids, d])
        rows.const(b"t\x85R").put(first + ids).get(slots["s_sizes"]).get(size_slot[ids]).const(b"ub")
        group_ops[nd] = (ids, rows.build())
    out: dict[str, bytes] = {}
    for f, fqn in enumerate(table.names):
        if table.nd[f] >= 0:
            ids, built = group_ops[table.nd[f]]
            lo, hi = np.searchsorted(ids, [table.bounds[f], table.bounds[f + 1]])
            out[fqn] = b"](" + built[lo:hi].tobytes() + b"e"
    return b"".join(prelude), out, first


def _size_ops(size_slot: int, dims: list[int]) -> bytes:
    ints = b"".join(b"J" + struct.pack("<i", d) if -_I32 <= d < _I32 else b"\x8a\x08" + struct.pack("<q", d)
                    for d in dims)
    return b"j" + struct.pack("<I", size_slot) + b"(" + ints + b"t\x85R"


def _storage_data(table: ChunkTable, res: ResultColumns, fqn_slot: np.ndarray, first: int,
                  slots: dict[str, int], file_slots: list[int]) -> bytes:
    """The ``storage_data`` dict: per result row a ``MetadataIndex(fqn, offsets, index hint)``
    (a BYTES item's offset and hint are ``None``) and its ``_StorageInfo``."""
    uid = res.uid.numpy()
    fid = table.fids().numpy()[uid] if res.n else np.zeros(0, np.int64)
    is_bytes = np.array(table.nd, dtype=np.int64)[fid] < 0 if res.n else np.zeros(0, bool)
    hint = uid - np.array(table.bounds[:-1], dtype=np.int64)[fid] if res.n else uid
    none = slots["none"]
    rows = _Rows(res.n).get(slots["index"]).const(b")\x81}(").get(slots["s_fqn"]).get(fqn_slot[fid])
    rows.get(slots["s_index"]).u32(np.where(is_bytes, ord("j"), ord("J")).astype(np.uint8),
                                    np.where(is_bytes, none, hint))
    rows.get(slots["s_offset"]).get(np.where(is_bytes, none, first + uid)).const(b"ub")
    rows.get(slots["info"]).const(b")\x81}(").get(slots["s_relative_path"])
    rows.get(np.array(file_slots, dtype=np.int64)[res.file.numpy()] if res.n else 0)
    rows.get(slots["s_offset"]).integer(res.offset.numpy()).get(slots["s_length"]).integer(res.length.numpy())
    rows.const(b"ub")
    return b"}(" + rows.build().tobytes() + b"u"
