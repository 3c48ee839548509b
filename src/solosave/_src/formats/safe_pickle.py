"""Allowlisted unpickling of DCP ``Metadata`` (``.metadata`` and prepared-metadata files).

A pickle can run arbitrary code when loaded; a ``.metadata`` only ever needs DCP's metadata
dataclasses, ``torch.Size``, dtypes, layouts, paths and builtins (older DCP releases' names of
two of them are read as today's classes). :func:`safe_loads` refuses any other global *before*
resolving it, so a crafted file executes nothing.
"""

from __future__ import annotations

import io
import pickle
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


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        module, name = _ALIASES.get((module, name), (module, name))
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeMetadataError(
            f"refusing to unpickle global {module}.{name}: checkpoint metadata never contains it, "
            "so the file is corrupt or crafted. Nothing was executed. Delete the file or recreate "
            "it (create_prepared_metadata=True / `solosave prepare`)."
        )


def safe_loads(data: bytes, what: str = "metadata") -> Any:
    """Unpickle ``data`` with the allowlist; corrupt or truncated input -> clear error."""
    try:
        return _Unpickler(io.BytesIO(data)).load()
    except UnsafeMetadataError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError, UnicodeDecodeError, ImportError) as e:
        raise PreparedMetadataError(
            f"{what} is truncated or corrupt ({type(e).__name__}: {e}); delete it and recreate it"
        ) from e
