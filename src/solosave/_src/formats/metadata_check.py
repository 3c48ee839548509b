"""Whether an unpickled ``.metadata`` has the shape DCP's loaders rely on.

The allowlisted unpickler (:mod:`solosave._src.formats.safe_pickle`) guarantees that a
``.metadata`` builds only DCP's dataclasses and builtins, not that they hold what they should: a
damaged file can give a ``Metadata`` whose ``storage_data`` is a string, a chunk without
``sizes`` (``BUILD`` sets whatever attributes the pickle names), or a storage entry with a
negative length. DCP's planner and reader would then fail with an ``AttributeError`` or worse
deep inside a load. :func:`metadata_problem` checks the whole object once, after unpickling, so
that such a file is refused with one clear error instead (loads, ``solosave verify``, ``export``,
``inspect``, and the read-back of a prepared file's ``.metadata`` template before it is published).
Whether the files it names lie inside the checkpoint directory is :func:`~solosave._src.formats.dcp.check_ranges`'
question, asked before any read.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain
from operator import attrgetter
from typing import Any, TypeGuard

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from solosave._src.core.errors import PreparedMetadataError
from solosave._src.formats.safe_pickle import safe_loads

try:  # torch >= 2.4 moved it; the field set is the same
    from torch.distributed.checkpoint.filesystem import _StorageInfo
except ImportError:  # pragma: no cover
    from torch.distributed.checkpoint._storage_utils import _StorageInfo  # type: ignore[no-redef,attr-defined]

__all__ = ["loads_metadata", "metadata_problem"]

_MISSING = object()


def _dims(value: Any) -> TypeGuard[tuple[int, ...]]:
    """A tuple (``torch.Size`` is one) of non-negative ints."""
    return type(value) in (tuple, torch.Size) and all(type(v) is int and v >= 0 for v in value)


def _tensor_problem(fqn: str, m: TensorStorageMetadata) -> str | None:
    props, size, chunks = (getattr(m, f, _MISSING) for f in ("properties", "size", "chunks"))
    if not isinstance(props, TensorProperties) or not isinstance(getattr(props, "dtype", None), torch.dtype):
        return f"{fqn!r}: its tensor properties are missing or have no dtype"
    for field, kind in (("layout", torch.layout), ("memory_format", torch.memory_format)):
        if not isinstance(getattr(props, field, _MISSING), kind):
            return f"{fqn!r}: its {field} is not a torch.{kind.__name__}"
    if not _dims(size):
        return f"{fqn!r}: its size is not a tuple of non-negative ints"
    if not isinstance(chunks, list):
        return f"{fqn!r}: its chunks are not a list"
    for c in chunks:
        offsets, sizes = getattr(c, "offsets", _MISSING), getattr(c, "sizes", _MISSING)
        if (type(c) is not ChunkStorageMetadata or not _dims(offsets) or not _dims(sizes)
                or len(offsets) != len(size) or len(sizes) != len(size)):
            return f"{fqn!r}: a chunk is not a box of {len(size)} dimension(s)"
    return None


def _storage_problem(index: Any, info: Any) -> str | None:
    fqn, offset = getattr(index, "fqn", _MISSING), getattr(index, "offset", _MISSING)
    if type(index) is not MetadataIndex or not isinstance(fqn, str) or not isinstance(offset, (tuple, type(None))):
        return "a storage_data key is not a MetadataIndex of a name and chunk offsets"
    rel, off, n = (getattr(info, f, _MISSING) for f in ("relative_path", "offset", "length"))
    if (type(info) is not _StorageInfo or not isinstance(rel, str) or type(off) is not int or type(n) is not int
            or off < 0 or n < 0):
        return f"the storage entry of {fqn!r} is not a file name, a non-negative offset and a length"
    transforms = getattr(info, "transform_descriptors", None)
    if transforms is not None and _transforms_problem(transforms):
        return f"the storage entry of {fqn!r} has transform descriptors that are not strings"
    return None


def metadata_problem(md: Any) -> str | None:
    """``None`` if ``md`` is a DCP ``Metadata`` whose every part has the type and range DCP's
    loaders rely on (see the module docstring), else the first problem found (one line).

    A ``.metadata`` can hold millions of entries: the check runs over columns of them with
    ``map`` (:func:`_columns_ok`), and looks for the first problem item by item only when that
    fails."""
    try:
        if _columns_ok(md):
            return None
    except (AttributeError, TypeError, ValueError):
        pass  # a missing attribute or a value of another type: found and named below
    return _first_problem(md) or "its entries are not what DCP writes"


def _all_types(values: Any, *types: type) -> bool:
    return set(map(type, values)) <= set(types)


def _columns_ok(md: Any) -> bool:
    """Every rule of :func:`_first_problem`, over columns (raises on a missing attribute)."""
    if type(md) is not Metadata or type(md.state_dict_metadata) is not dict or type(md.storage_data) is not dict:
        return False
    sdm = md.state_dict_metadata
    if not _all_types(sdm, str) or not _all_types(sdm.values(), TensorStorageMetadata, BytesStorageMetadata):
        return False
    tensors = [m for m in sdm.values() if type(m) is TensorStorageMetadata]
    props = list(map(_PROPERTIES, tensors))
    sizes = list(map(_SIZE, tensors))
    chunk_lists = list(map(_CHUNKS, tensors))
    if not (_all_types(props, TensorProperties) and _all_types(map(_DTYPE, props), torch.dtype)
            and _all_types(map(_LAYOUT, props), torch.layout)
            and _all_types(map(_MEMORY_FORMAT, props), torch.memory_format) and _all_types(chunk_lists, list)):
        return False
    chunks = [c for cs in chunk_lists for c in cs]
    if not _all_types(chunks, ChunkStorageMetadata):
        return False
    offsets, extents = list(map(_OFFSETS, chunks)), list(map(_SIZES, chunks))
    dims = [len(size) for size, cs in zip(sizes, chunk_lists) for _ in cs]
    return (_dim_tuples(chain(sizes, offsets, extents)) and list(map(len, offsets)) == dims
            and list(map(len, extents)) == dims and _storage_ok(md.storage_data) and _top_ok(md))


def _dim_tuples(values: Iterable[Any]) -> bool:
    """Every value a tuple of non-negative ints (``torch.Size`` holds only ints)."""
    values = list(values)
    if not _all_types(values, torch.Size, tuple):
        return False
    plain = [v for v in values if type(v) is tuple]
    return _all_types(chain.from_iterable(plain), int) and min(map(min, filter(None, values)), default=0) >= 0


def _storage_ok(storage: dict) -> bool:
    infos = list(storage.values())
    keys = list(storage)
    if not (_all_types(keys, MetadataIndex) and _all_types(map(_FQN, keys), str)
            and _all_types(map(_KEY_OFFSET, keys), torch.Size, tuple, type(None))
            and _all_types(infos, _StorageInfo) and _all_types(map(_PATH, infos), str)):
        return False
    starts, lengths = list(map(_OFFSET, infos)), list(map(_LENGTH, infos))
    if not (_all_types(starts, int) and _all_types(lengths, int) and min(starts, default=0) >= 0
            and min(lengths, default=0) >= 0):
        return False
    transforms = [t for t in (getattr(i, "transform_descriptors", None) for i in infos) if t is not None]
    return not any(map(_transforms_problem, transforms))


def _transforms_problem(transforms: Any) -> bool:
    return not (isinstance(transforms, (list, tuple)) and all(isinstance(t, str) for t in transforms))


def _top_ok(md: Any) -> bool:
    planner_data = getattr(md, "planner_data", None)
    storage_meta = getattr(md, "storage_meta", None)
    version = getattr(md, "version", None)
    return ((planner_data is None or type(planner_data) is dict)
            and (storage_meta is None or type(storage_meta) is StorageMeta)
            and (version is None or isinstance(version, str)))


_PROPERTIES, _SIZE, _CHUNKS = (attrgetter(f) for f in ("properties", "size", "chunks"))
_DTYPE, _LAYOUT, _MEMORY_FORMAT = (attrgetter(f) for f in ("dtype", "layout", "memory_format"))
_OFFSETS, _SIZES, _FQN, _KEY_OFFSET = (attrgetter(f) for f in ("offsets", "sizes", "fqn", "offset"))
_PATH, _OFFSET, _LENGTH = (attrgetter(f) for f in ("relative_path", "offset", "length"))


def _first_problem(md: Any) -> str | None:
    """The rules of :func:`metadata_problem`, item by item: the first problem, named."""
    if not isinstance(md, Metadata):
        return f"it holds a {type(md).__name__}, not a DCP Metadata"
    sdm = getattr(md, "state_dict_metadata", _MISSING)
    if type(sdm) is not dict:
        return "its state_dict_metadata is not a dict"
    for fqn, m in sdm.items():
        if not isinstance(fqn, str):
            return f"a state_dict_metadata key is a {type(fqn).__name__}, not a str"
        if type(m) is TensorStorageMetadata:
            problem = _tensor_problem(fqn, m)
            if problem:
                return problem
        elif type(m) is not BytesStorageMetadata:
            return f"{fqn!r}: a {type(m).__name__}, not tensor or bytes storage metadata"
    storage = getattr(md, "storage_data", _MISSING)
    if type(storage) is not dict:
        return "its storage_data is not a dict"
    for index, info in storage.items():
        problem = _storage_problem(index, info)
        if problem:
            return problem
    planner_data = getattr(md, "planner_data", None)
    if planner_data is not None and type(planner_data) is not dict:
        return "its planner_data is not a dict"
    storage_meta = getattr(md, "storage_meta", None)
    if storage_meta is not None and type(storage_meta) is not StorageMeta:
        return "its storage_meta is not a StorageMeta"
    version = getattr(md, "version", None)
    if version is not None and not isinstance(version, str):
        return "its version is not a string"
    return None


def loads_metadata(data: bytes, what: str) -> Metadata:
    """``data`` unpickled through the allowlist (:func:`~solosave._src.formats.safe_pickle.safe_loads`)
    and checked (:func:`metadata_problem`): a DCP ``Metadata`` DCP's loaders can use, or a
    :class:`~solosave.PreparedMetadataError` naming ``what`` and the first problem."""
    md = safe_loads(data, what=what)
    problem = metadata_problem(md)
    if problem:
        raise PreparedMetadataError(f"{what}: {problem}: the file is corrupt or crafted")
    return md
