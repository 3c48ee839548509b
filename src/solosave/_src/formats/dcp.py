"""The DCP on-disk conventions solosave writes and reads (the bottom of formats: imports only core).

Everything that says what a checkpoint directory looks like lives here, so that the writer, the
planner, the prepared metadata, the loader and ``solosave verify`` agree by construction:

* file names: ``__{rank}_{n}.distcp`` data files, ``.metadata`` (published last), the CRC32
  sidecar ``<data file>.crc32`` (what it holds: :mod:`solosave._src.formats.checksum_sidecar`),
  the load index ``.solosave-index``;
* item keys: an item is identified by ``(fqn, chunk offsets)`` (``offsets`` ``None`` for a
  non-tensor); :func:`item_key` is the one normaliser from any of DCP's spellings
  (``MetadataIndex``, ``torch.Size``, lists) to that tuple;
* dtype names as solosave writes them into its own messages (``"float32"``);
* byte-range checks: every ``(file, offset, length)`` named by a ``.metadata`` lies inside a data
  file within the checkpoint directory (:func:`check_ranges`): a name without ``..`` or ``/``
  (:func:`confined_path`) of a regular file, not a symbolic link that leads out of the directory
  (:func:`local_file_problem`);
* which names a data file may have where solosave writes one (:func:`data_file_problem`): the
  one check of every file name a prepared file or a converted ``Metadata`` gives a rank to write.
"""

from __future__ import annotations

import os
import stat
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from solosave._src.core.compat import METADATA_HAS_VERSION

#: The published metadata: written last, atomically; its presence makes a checkpoint complete.
METADATA_FILE = ".metadata"
#: DCP's on-disk format version written into ``Metadata.version``.
DCP_VERSION = "1.0.0"
#: ``Metadata(..., **METADATA_VERSION)``: the version field, where this torch's ``Metadata`` has one
#: (``solosave._src.core.compat.METADATA_HAS_VERSION``).
METADATA_VERSION: dict[str, str] = {"version": DCP_VERSION} if METADATA_HAS_VERSION else {}
#: The load index beside ``.metadata`` (``solosave._src.index.writer``); stock DCP ignores it.
INDEX_FILE = ".solosave-index"
DATA_SUFFIX = ".distcp"
#: Suffix of the checksum sidecar of a data file: ``__0_0.distcp`` -> ``__0_0.distcp.crc32``.
CHECKSUM_SUFFIX = ".crc32"

#: An item's identity: its flattened key and, for tensors, the chunk offsets.
ItemKey = tuple[str, tuple[int, ...] | None]


def file_name(rank: int, n: int) -> str:
    """The ``n``-th data file of ``rank``: ``__{rank}_{n}.distcp``."""
    return f"__{rank}_{n}{DATA_SUFFIX}"


def parse_file_name(name: str) -> tuple[int, int] | None:
    """``"__3_1.distcp"`` -> ``(3, 1)``; ``None`` for anything else."""
    if not (name.startswith("__") and name.endswith(DATA_SUFFIX)):
        return None
    parts = name[2:-len(DATA_SUFFIX)].split("_")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def data_file_problem(name: Any, rank: int | None = None) -> str | None:
    """``None`` if ``name`` is a data file name ``__{r}_{n}.distcp`` (with ``r == rank`` when
    ``rank`` is given), else why not. Every file a rank writes is named so, directly inside the
    checkpoint directory: anything else in a prepared file (``../x``, an absolute path) is
    crafted or corrupt, and must never reach a writer."""
    parsed = parse_file_name(name) if isinstance(name, str) else None
    if parsed is None:
        return f"{name!r} is not a data file name ('__{{rank}}_{{n}}{DATA_SUFFIX}' inside the checkpoint directory)"
    if rank is not None and parsed[0] != rank:
        return f"{name!r} is a data file of rank {parsed[0]}, placed on rank {rank}"
    return None


def checksum_path(data_file: str) -> str:
    """The sidecar that holds the per-record CRC32s of ``data_file``."""
    return data_file + CHECKSUM_SUFFIX


def item_key(fqn: str, offsets: Iterable[int] | None) -> ItemKey:
    """The one key normaliser: ``(fqn, tuple of int offsets or None)``."""
    return (fqn, tuple(int(o) for o in offsets) if offsets is not None else None)


def index_key(index: MetadataIndex) -> ItemKey:
    """The ``ItemKey`` of a ``storage_data`` key."""
    return item_key(index.fqn, index.offset)


def storage_index(key: ItemKey) -> MetadataIndex:
    """The ``storage_data`` key of an item (no index hint: equal to the hinted one)."""
    fqn, offsets = key
    return MetadataIndex(fqn, offsets) if offsets is not None else MetadataIndex(fqn)


def key_name(key: ItemKey) -> str:
    """``fqn`` for whole items, ``fqn@[offsets]`` for a chunk that does not start at 0."""
    fqn, offsets = key
    return fqn if offsets is None or not any(offsets) else f"{fqn}@{list(offsets)}"


def key_sort(key: ItemKey) -> tuple:
    return (key[0], key[1] or ())


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return value


# ---------------------------------------------------------------------------------------------
# Byte ranges
# ---------------------------------------------------------------------------------------------

def ranges_by_file(storage_data: Mapping[Any, Any]) -> dict[str, list[tuple[int, int, str]]]:
    """``{relative path: [(offset, length, item name), ...]}`` of a ``storage_data`` mapping."""
    per_file: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
    for index, info in storage_data.items():
        per_file[info.relative_path].append((int(info.offset), int(info.length), key_name(index_key(index))))
    return per_file


def confined_path(directory: str | os.PathLike, relative_path: Any) -> str | None:
    """``directory/relative_path`` if it names a file directly inside ``directory`` (no ``..``,
    no absolute path, no sub-directory, no NUL); ``None`` otherwise. DCP's writers only ever
    name files in the checkpoint directory itself, so anything else is a crafted metadata."""
    if not isinstance(relative_path, str) or not relative_path or "\0" in relative_path:
        return None
    if os.path.isabs(relative_path) or os.path.basename(relative_path) != relative_path:
        return None
    if relative_path in (".", ".."):
        return None
    return os.path.join(os.fspath(directory), relative_path)


def local_file_problem(directory: str | os.PathLike, path: str) -> str | None:
    """``None`` if ``path`` (a file directly inside the local checkpoint ``directory``, see
    :func:`confined_path`) is missing or a regular file that lies inside ``directory``; else why
    it must not be read: a symbolic link that leads outside the directory (a checkpoint "copied"
    as links to another, or crafted to make loaders read any file of the machine), or not a
    regular file (a FIFO would block a reader forever). Paths that are not local (URLs) are
    never found here and pass."""
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            real, root = os.path.realpath(path), os.path.realpath(directory)
            if os.path.commonpath([real, root]) != root:
                return "a symbolic link to a file outside the checkpoint directory"
            st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None  # reported by whoever needs the file
    except (OSError, ValueError) as e:
        return f"cannot be examined ({e})"
    return None if stat.S_ISREG(st.st_mode) else "not a regular file"


def check_ranges(directory: str | os.PathLike, storage_data: Mapping[Any, Any],
                 size_of: Callable[[str], int] | None = None) -> list[str]:
    """Every byte range of ``storage_data`` lies inside its data file, which lies inside
    ``directory`` (:func:`confined_path`, :func:`local_file_problem`); one message per problem
    (empty: ok). ``size_of(path)``: a file's size, or
    ``FileNotFoundError`` (default: ``os.stat``; a URL's storage passes its own)."""
    per_file = ranges_by_file(storage_data)
    problems: list[str] = []
    for rel in sorted(per_file, key=str):
        path = confined_path(directory, rel)
        if path is None:
            problems.append(f"{rel!r}: not a file name inside the checkpoint directory "
                            f"({len(per_file[rel])} record(s) point to it); the metadata is crafted or corrupt")
            continue
        if any(off < 0 or n < 0 for off, n, _ in per_file[rel]):
            problems.append(f"{rel}: a record has a negative offset or length")
            continue
        why = local_file_problem(directory, path)
        if why is not None:
            problems.append(f"{rel}: {why}; refusing to read it (every file read must lie inside the checkpoint "
                            "directory)")
            continue
        try:
            size = size_of(path) if size_of is not None else os.stat(path).st_size
        except FileNotFoundError:
            problems.append(f"{rel}: missing ({len(per_file[rel])} record(s) point into it)")
            continue
        end, name = max((off + n, name) for off, n, name in per_file[rel])
        if end > size:
            short = sum(1 for off, n, _ in per_file[rel] if off + n > size)
            problems.append(f"{rel}: truncated: {size} bytes, but .metadata needs {end} "
                            f"({short} record(s) past the end, e.g. {name})")
    return problems
