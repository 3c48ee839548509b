"""The ``.metadata`` pickle as a template: serialized once, rendered per checkpoint."""

from __future__ import annotations

import dataclasses
import pickle
import struct
import uuid

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta


def pickled_str(s: str) -> bytes:
    """``s`` as a protocol-2 pickle writes it (``BINUNICODE``)."""
    b = s.encode("utf-8", "surrogatepass")  # as pickle writes str (paths may hold any byte)
    return b"X" + struct.pack("<I", len(b)) + b


def replace_checkpoint_id(data: bytes, old: str, new: str) -> bytes | None:
    """A rendered ``.metadata`` (``data``, from :meth:`MetadataTemplate.render`) whose
    ``storage_meta.checkpoint_id`` ``old`` becomes ``new``, everything else byte for byte the
    same (the copy of a checkpoint in another place). ``None`` when ``old`` is not found exactly
    once in the pickle (not a rendering of that id: the caller keeps the bytes as they are)."""
    a = pickled_str(str(old))
    if data.count(a) != 1:
        return None
    i = data.index(a)
    return b"".join((data[:i], pickled_str(str(new)), data[i + len(a):]))


class MetadataTemplate:
    """A ``Metadata`` pickled once, with placeholders for the per-checkpoint ``storage_meta``.

    Protocol 2 is used: it has no frames, and it encodes every string as ``BINUNICODE`` (opcode,
    4-byte length, UTF-8), so a string can be replaced by one of another length without
    touching anything else. Stock DCP reads the result with a plain ``pickle.load``.
    """

    def __init__(self, metadata: Metadata) -> None:
        tag = uuid.uuid4().hex
        self._ph_id = f"\x00solosave-checkpoint-id-{tag}\x00"
        self._ph_save = f"\x00solosave-save-id-{tag}\x00"
        md = dataclasses.replace(metadata, storage_meta=StorageMeta(checkpoint_id=self._ph_id,
                                                                   save_id=self._ph_save))
        data = pickle.dumps(md, protocol=2)
        a, b = pickled_str(self._ph_id), pickled_str(self._ph_save)
        if data.count(a) != 1 or data.count(b) != 1:  # pragma: no cover - defensive
            raise RuntimeError("metadata template placeholders are not unique")
        i, j = data.index(a), data.index(b)
        if i > j:  # pragma: no cover - dataclass field order puts checkpoint_id first
            raise RuntimeError("unexpected storage_meta field order")
        self._parts = (data[:i], data[i + len(a):j], data[j + len(b):])
        self.nbytes = len(data)

    @classmethod
    def from_parts(cls, parts: tuple[bytes, bytes, bytes]) -> MetadataTemplate:
        """A template from the three pieces of a pickle around its two placeholders (as a
        prepared file stores them: ``parts``)."""
        self = cls.__new__(cls)
        self._parts = parts
        self.nbytes = sum(map(len, parts))
        return self

    @property
    def parts(self) -> tuple[bytes, bytes, bytes]:
        """The pickle before, between and after the two placeholders."""
        return self._parts

    def render(self, checkpoint_id: str, save_id: str | None = None) -> bytes:
        return b"".join(self.render_parts(checkpoint_id, save_id))

    def render_parts(self, checkpoint_id: str, save_id: str | None = None) -> tuple[bytes, ...]:
        """:meth:`render` as pieces to write one after the other: publishing writes them
        without joining them first (at W=4096 the pickle is 100 MiB; the join took 0.2 s)."""
        p0, p1, p2 = self._parts
        return (p0, pickled_str(str(checkpoint_id)), p1, pickled_str(save_id or str(uuid.uuid4())), p2)


