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

import os
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ._coordinate import Channel
from ._errors import CorruptCheckpointError, PreparedMetadataError
from ._publish import METADATA_FILE
from ._safe_pickle import safe_loads
from ._verify import check_ranges


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
    ch = Channel(process_group)
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
         planner: Any = None, read_metadata_once: bool = True) -> None:
    """Load the checkpoint at ``path`` into ``state_dict`` in place (collective over
    ``process_group`` when torch.distributed is initialised; one process otherwise).

    Resharding works as in DCP: tensors and DTensors receive the chunks they cover, whatever the
    world size the checkpoint was saved at. ``read_metadata_once``: group rank 0 reads
    ``.metadata`` and broadcasts it (one storage read per load); ``False``: every rank reads it,
    as stock DCP does. Errors are the same on every rank and derive from ``Exception``: a
    missing or unpublished checkpoint, or an unsafe ``.metadata``, raises solosave's own error
    before DCP's load starts.
    """
    distributed = dist.is_available() and dist.is_initialized()
    reader = SafeFileSystemReader(path)
    # Read and parse before DCP's load: DCP would swallow a reader's error into its own
    # "metadata is None" AssertionError when it falls back to per-rank metadata.
    data = (_share_metadata(path, process_group) if distributed and read_metadata_once
            else read_metadata_bytes(path))
    reader.metadata = parse_metadata(data, path)
    try:
        dcp.load(state_dict, storage_reader=reader, planner=planner,
                 process_group=process_group, no_dist=not distributed)
    except CheckpointException as e:
        # DCP wraps each rank's exception in a BaseException; re-raise the underlying one (ours
        # first: they are the same on every rank) so that ``except Exception`` sees it.
        inner = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
        for exc in inner:
            if isinstance(exc, (CorruptCheckpointError, PreparedMetadataError)):
                raise exc from e
        for exc in inner:
            if isinstance(exc, Exception):
                raise exc from e
        raise
