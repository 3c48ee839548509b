"""Loading: stock DCP loading, with ``.metadata`` read through the allowlisted unpickler."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from torch.distributed.checkpoint.api import CheckpointException

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
        files = {self.storage_data[item.storage_index].relative_path for item in plan.items}
        needed = {item.storage_index: self.storage_data[item.storage_index] for item in plan.items}
        problems = check_ranges(self.path, needed, files)
        if problems:
            raise CorruptCheckpointError(
                f"checkpoint {os.fspath(self.path)} is damaged: {'; '.join(problems)}. Load an "
                "earlier checkpoint; `solosave verify` lists every problem.", problems)
        return super().read_data(plan, planner)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = os.path.join(os.fspath(self.path), METADATA_FILE)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise PreparedMetadataError(
                f"{self.path}: no {METADATA_FILE}; this is not a published checkpoint (a failed or "
                "unfinished save leaves none). Load an earlier checkpoint.") from None
        md = safe_loads(data, what=path)
        if not isinstance(md, Metadata):
            raise PreparedMetadataError(f"{path}: holds a {type(md).__name__}, not a DCP Metadata")
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def load(state_dict: dict[str, Any], path: str | os.PathLike, *, process_group: Any = None,
         planner: Any = None) -> None:
    """Load the checkpoint at ``path`` into ``state_dict`` in place (collective over
    ``process_group`` when torch.distributed is initialised; one process otherwise).

    Resharding works as in DCP: tensors and DTensors receive the chunks they cover, whatever the
    world size the checkpoint was saved at.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {os.fspath(path)!r} does not exist")
    try:
        dcp.load(state_dict, storage_reader=SafeFileSystemReader(path), planner=planner,
                 process_group=process_group, no_dist=not (dist.is_available() and dist.is_initialized()))
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
