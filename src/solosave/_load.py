"""Loading: stock DCP loading, with ``.metadata`` read once per process group and unpickled
through the allowlist.

Who calls what (every rank of ``process_group``, when torch.distributed is initialised):
:func:`load` -> the coordinator (group rank 0) reads ``.metadata`` from storage and broadcasts
its bytes (or the reason it could not) in one ``broadcast_object_list`` through
:class:`~solosave._coordinate.Channel` -> every rank unpickles them (allowlisted) and runs DCP's
load with a reader that serves them, so storage sees one read of ``.metadata`` per load instead
of one per rank (at W=4096 that file is about 114 MiB, see docs/benchmarks.md). DCP's load then
performs its own collectives (a gather of load plans and a scatter, in DCP's code).
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ._coordinate import DistChannel
from ._errors import CorruptCheckpointError, PreparedMetadataError, UnsafeMetadataError
from ._format import METADATA_FILE, check_ranges
from ._safe_pickle import safe_loads


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor records are unpickled with
    ``torch.load(weights_only=True)``: only torch's safe types and the classes in
    ``safe_globals`` (the caller's own, trusted types) can be loaded; a crafted record that
    names anything else raises :class:`~solosave.UnsafeMetadataError` and executes nothing."""

    def __init__(self, safe_globals: Sequence[Any] = (), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.safe_globals = list(safe_globals)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            with torch.serialization.safe_globals(self.safe_globals):
                obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeMetadataError(
                f"refusing to load the record of {fqn!r}: {str(e).splitlines()[0]} Nothing was executed. If "
                "the checkpoint is yours and holds your own classes, pass them as "
                "solosave.load(..., safe_globals=[YourClass])") from None
        if self.flatten_state_dict:
            _set_at(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class SafeFileSystemReader(FileSystemReader):
    """A ``FileSystemReader`` whose ``read_metadata`` refuses pickles outside the allowlist and
    explains a missing or corrupt ``.metadata``, and whose ``read_data`` first checks that every
    byte range this rank will read lies inside its data file (a truncated or missing ``.distcp``
    raises :class:`~solosave.CorruptCheckpointError` instead of yielding garbage)."""

    def read_data(self, plan: Any, planner: Any) -> Any:
        needed = {item.storage_index: self.storage_data[item.storage_index] for item in plan.items}
        problems = check_ranges(self.path, needed)
        if problems:
            raise CorruptCheckpointError(
                f"checkpoint {os.fspath(self.path)} is damaged: {'; '.join(problems)}. Load an "
                "earlier checkpoint; `solosave verify` lists every problem.", problems)
        return super().read_data(plan, planner)

    #: ``.metadata`` parsed before DCP's load started (see :func:`load`); ``None``: read the
    #: file here (a reader used with stock ``dcp.load``).
    metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = self.metadata
        if md is None:
            md = parse_metadata(read_metadata_bytes(self.path), self.path)
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def _set_at(root: Any, path: Sequence[Any], value: Any) -> None:
    """Put ``value`` at the object path ``path`` of nested dicts and lists (DCP's flattening
    paths), creating containers on the way as DCP does."""
    node = root
    for key, nxt in zip(path[:-1], path[1:]):
        if isinstance(node, list):
            while len(node) <= key:
                node.append(None)
            if node[key] is None:
                node[key] = [] if isinstance(nxt, int) else {}
            node = node[key]
        else:
            node = node.setdefault(key, [] if isinstance(nxt, int) else {})
    last = path[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = value


def parse_metadata(data: bytes, directory: str | os.PathLike) -> Metadata:
    """Unpickle ``.metadata`` bytes through the allowlist; a clear error if they are not a
    DCP ``Metadata``."""
    path = os.path.join(os.fspath(directory), METADATA_FILE)
    md = safe_loads(data, what=path)
    if not isinstance(md, Metadata):
        raise PreparedMetadataError(f"{path}: holds a {type(md).__name__}, not a DCP Metadata")
    return md


def read_metadata_bytes(path: str | os.PathLike) -> bytes:
    """The bytes of ``<path>/.metadata``; a clear error if the checkpoint is not published."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {os.fspath(path)!r} does not exist")
    try:
        with open(os.path.join(os.fspath(path), METADATA_FILE), "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise PreparedMetadataError(
            f"{os.fspath(path)}: no {METADATA_FILE}; this is not a published checkpoint (a failed or "
            "unfinished save leaves none). Load an earlier checkpoint.") from None


def _share_metadata(path: str | os.PathLike, process_group: Any) -> bytes:
    """Group rank 0 reads ``.metadata``; every rank receives its bytes or raises rank 0's error."""
    ch = DistChannel(process_group)
    payload: tuple[str, Any] | None = None
    if ch.is_coordinator:
        try:
            payload = ("ok", read_metadata_bytes(path))
        except (OSError, PreparedMetadataError) as e:
            payload = (type(e).__name__, str(e))
    kind, value = ch.broadcast_object(payload)
    if kind == "ok":
        return value
    if kind == "FileNotFoundError":
        raise FileNotFoundError(value)
    raise PreparedMetadataError(f"{value} (read by rank 0)")


def load(state_dict: dict[str, Any], path: str | os.PathLike, *, process_group: Any = None,
         planner: Any = None, read_metadata_once: bool = True, safe_globals: Sequence[Any] = ()) -> None:
    """Load the checkpoint at ``path`` into ``state_dict`` in place (collective over
    ``process_group`` when torch.distributed is initialised; one process otherwise).

    Resharding works as in DCP: tensors and DTensors receive the chunks they cover, whatever the
    world size the checkpoint was saved at. ``read_metadata_once``: group rank 0 reads
    ``.metadata`` and broadcasts it (one storage read per load); ``False``: every rank reads it,
    as stock DCP does. Errors are the same on every rank and derive from ``Exception``: a
    missing or unpublished checkpoint, or an unsafe ``.metadata``, raises solosave's own error
    before DCP's load starts. Loading is safe against crafted checkpoints: ``.metadata`` is
    unpickled through an allowlist, non-tensor records with ``torch.load(weights_only=True)``
    (extend what they may hold with ``safe_globals``; a custom ``planner`` decides for itself),
    and every file read must lie inside the checkpoint directory. Top-level values with
    ``load_state_dict()`` (modules, optimizers) are loaded into, as DCP does.
    """
    distributed = dist.is_available() and dist.is_initialized()
    reader = SafeFileSystemReader(path)
    # Read and parse before DCP's load: DCP would swallow a reader's error into its own
    # "metadata is None" AssertionError when it falls back to per-rank metadata.
    data = (_share_metadata(path, process_group) if distributed and read_metadata_once
            else read_metadata_bytes(path))
    reader.metadata = parse_metadata(data, path)
    try:
        if planner is None:
            planner = SafeLoadPlanner(safe_globals)
        dcp.load(state_dict, storage_reader=reader, planner=planner,
                 process_group=process_group, no_dist=not distributed)
    except CheckpointException as e:
        # DCP wraps each rank's exception in a BaseException; re-raise the underlying one (ours
        # first: they are the same on every rank) so that ``except Exception`` sees it.
        inner = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
        for exc in inner:
            if isinstance(exc, (CorruptCheckpointError, PreparedMetadataError, UnsafeMetadataError)):
                raise exc from e
        for exc in inner:
            if isinstance(exc, Exception):
                raise exc from e
        raise
