"""Loading: stock DCP loading, with ``.metadata`` read through the allowlisted unpickler."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ._errors import PreparedMetadataError
from ._publish import METADATA_FILE
from ._safe_pickle import safe_loads


class SafeFileSystemReader(FileSystemReader):
    """A ``FileSystemReader`` whose ``read_metadata`` refuses pickles outside the allowlist and
    explains a missing or corrupt ``.metadata``."""

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
    dcp.load(state_dict, storage_reader=SafeFileSystemReader(path), planner=planner,
             process_group=process_group, no_dist=not (dist.is_available() and dist.is_initialized()))
