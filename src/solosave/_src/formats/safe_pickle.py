"""Allowlisted unpickling of DCP ``Metadata`` (``.metadata`` and prepared-metadata files).

A pickle can run arbitrary code when loaded; a ``.metadata`` only ever needs DCP's metadata
dataclasses, ``torch.Size``, dtypes, layouts, paths and builtins (older DCP releases' names of
two of them are read as today's classes). :func:`safe_loads` refuses any other global *before*
resolving it, so a crafted file executes nothing.

It also refuses, before unpickling, a pickle whose length fields run past its end or whose memo
indices exceed its length (:func:`check_lengths`): CPython's unpickler allocates a ``bytes``
object of the length a ``BINBYTES`` opcode states before it finds out that the data is shorter,
and grows its memo to the index a ``LONG_BINPUT`` names, so one crafted opcode could make it
allocate gigabytes. After that walk, every object the unpickler builds is bounded by
the size of the data: the allowlisted callables that could turn a number into memory
(``bytes(n)``, ``copyreg._reconstructor`` of such a type) only take the arguments a real
``.metadata`` holds.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import pickletools
from typing import Any

import torch

from solosave._src.core.errors import PreparedMetadataError, UnsafeMetadataError

_ALLOWED: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch._utils": {"_get_layout"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict", "int", "str", "bytes", "bool", "float"},
    "copyreg": {"_reconstructor"},
}

#: Globals that older DCP releases pickled under another name, each read as today's class: DCP of
#: torch up to about 2.1 wrote ``TensorProperties`` (and the enum of its memory format) from
#: ``torch.distributed._shard.sharded_tensor.metadata``; the classes took the same state. Named
#: one by one, so the rest of that module stays refused.
_ALIASES: dict[tuple[str, str], tuple[str, str]] = {
    ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"):
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"):
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
}


def _bytes(*args: Any) -> bytes:
    """``builtins.bytes`` as a pickle may call it: from bytes or a string, never from a count
    (``bytes(10**12)`` would allocate what the file says)."""
    if args and not isinstance(args[0], (bytes, str)):
        raise pickle.UnpicklingError(f"bytes() of a {type(args[0]).__name__}")
    return bytes(*args)


def _reconstructor(cls: Any, base: Any, state: Any) -> Any:
    """``copyreg._reconstructor`` (protocols 0 and 1) for plain objects only: with any other
    ``base`` it calls ``base.__new__(cls, state)``, e.g. ``bytes.__new__(bytes, 10**12)``."""
    if base is not object:
        raise pickle.UnpicklingError(f"_reconstructor with base {getattr(base, '__name__', base)!r}")
    return copyreg._reconstructor(cls, base, state)  # type: ignore[attr-defined]  # private, untyped in typeshed


_GUARDED: dict[tuple[str, str], Any] = {("builtins", "bytes"): _bytes, ("copyreg", "_reconstructor"): _reconstructor}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        module, name = _ALIASES.get((module, name), (module, name))
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return _GUARDED.get((module, name)) or super().find_class(module, name)
        raise UnsafeMetadataError(
            f"refusing to unpickle global {module}.{name}: checkpoint metadata never contains it, "
            "so the file is corrupt or crafted. Nothing was executed. Delete the file or recreate "
            "it (create_prepared_metadata=True / `solosave prepare`)."
        )


# -- the length walk ---------------------------------------------------------------------------
# What follows each opcode: a fixed number of bytes (>= 0), a length field of 1, 4 (signed or
# not) or 8 bytes and that many bytes, one or two text lines, or the end (STOP).
_LEN1, _LEN4S, _LEN4U, _LEN8, _LINE, _LINES2, _STOP, _UNKNOWN, _MEMO4, _MEMO_LINE = range(-1, -11, -1)
_LEN_OF = {pickletools.TAKEN_FROM_ARGUMENT1: _LEN1, pickletools.TAKEN_FROM_ARGUMENT4: _LEN4S,
           pickletools.TAKEN_FROM_ARGUMENT4U: _LEN4U, pickletools.TAKEN_FROM_ARGUMENT8U: _LEN8}
_WIDTH = {_LEN1: 1, _LEN4S: 4, _LEN4U: 4, _LEN8: 8}


def _opcode_args() -> tuple[int, ...]:
    kinds = [_UNKNOWN] * 256
    for op in pickletools.opcodes:
        arg = op.arg
        if arg is None:
            kind = 0
        elif arg.n >= 0:
            kind = arg.n  # FRAME too: its 8-byte length is all it holds, the frame's opcodes follow
        elif arg.n == pickletools.UP_TO_NEWLINE:
            kind = _LINES2 if arg.name.endswith("_pair") else _LINE
        else:
            kind = _LEN_OF[arg.n]
        kinds[ord(op.code)] = kind
    kinds[ord(pickle.STOP)] = _STOP
    kinds[ord(pickle.LONG_BINPUT)] = _MEMO4  # the memo index: the unpickler's memo grows to it
    kinds[ord(pickle.PUT)] = _MEMO_LINE
    return tuple(kinds)


_ARGS = _opcode_args()


def check_lengths(data: bytes) -> None:
    """Walk the opcodes of the pickle ``data`` without building anything: ``ValueError`` if an
    opcode is unknown, a length field is negative or runs past the end of ``data``, or there is
    no ``STOP``. After it, no opcode can make the unpickler allocate more than ``len(data)``."""
    data = data if isinstance(data, bytes) else bytes(data)
    pos, end, kinds, ints = 0, len(data), _ARGS, int.from_bytes
    while pos < end:
        kind = kinds[data[pos]]
        if kind >= 0:
            pos += kind + 1
            continue
        if kind == _UNKNOWN:
            raise ValueError(f"unknown opcode {data[pos]:#04x} at byte {pos}")
        pos += 1
        if kind == _STOP:
            return
        if kind >= _LEN8:
            width = _WIDTH[kind]
            n = ints(data[pos:pos + width], "little", signed=kind == _LEN4S)
            pos += width + n
            if n < 0 or pos > end:
                raise ValueError(f"a length field of {n} bytes at byte {pos - n - width} runs past the end "
                                 f"({end} bytes)")
            continue
        if kind == _MEMO4:
            index = ints(data[pos:pos + 4], "little")
            pos += 4
        elif kind == _MEMO_LINE:
            nl = data.find(b"\n", pos)
            index = int(data[pos:nl]) if 0 <= nl - pos <= 20 else -1
            pos = nl + 1 if nl >= 0 else end + 1
        else:
            for _ in range(2 if kind == _LINES2 else 1):
                nl = data.find(b"\n", pos)
                if nl < 0:
                    raise ValueError(f"an unterminated text argument at byte {pos}")
                pos = nl + 1
            continue
        if not 0 <= index < end:  # a pickler numbers its memo from 0, at least 2 bytes per entry
            raise ValueError(f"a memo index of {index} in {end} bytes")
    raise ValueError("no STOP opcode: truncated")


def safe_loads(data: bytes, what: str = "metadata") -> Any:
    """Unpickle ``data`` with the allowlist; corrupt, truncated or crafted input -> a clear
    :class:`PreparedMetadataError` (:class:`UnsafeMetadataError` for a global outside the
    allowlist), in memory bounded by ``len(data)``."""
    try:
        check_lengths(data)
        return _Unpickler(io.BytesIO(data)).load()
    except UnsafeMetadataError:
        raise
    except MemoryError:  # never from a length in the data (checked above): this process is out of memory
        raise
    except Exception as e:  # noqa: BLE001 - whatever a malformed pickle makes an allowlisted callable raise
        raise PreparedMetadataError(
            f"{what} is truncated or corrupt ({type(e).__name__}: {e}); delete it and recreate it"
        ) from e
