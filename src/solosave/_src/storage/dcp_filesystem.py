"""DCP's ``FileSystemBase`` over a :class:`~solosave._src.storage.base.Storage`: how DCP's own read
path (``FileSystemReader.read_data``) reads a checkpoint whose storage is not
:attr:`~solosave._src.storage.base.Storage.local_files` (what :func:`solosave.load` does for a URL)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemBase

from solosave._src.storage.base import Storage
from solosave._src.storage.registry import backend_for


class DcpFileSystem(FileSystemBase):
    """Reads through ``storage``; solosave writes checkpoints itself, so every write is refused."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "r" not in mode:
            raise ValueError("solosave reads URL checkpoints through DCP; it writes them itself")
        with self.storage.open_read(os.fspath(path)) as f:
            yield f

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return self.storage.join(os.fspath(path), suffix)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        raise ValueError("solosave never renames in object storage")

    def init_path(self, path: str | os.PathLike) -> str:
        return self.storage.normalize(os.fspath(path))

    def mkdir(self, path: str | os.PathLike) -> None:
        self.storage.makedirs(os.fspath(path))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return not backend_for(checkpoint_id).local_files

    def exists(self, path: str | os.PathLike) -> bool:
        return self.storage.exists(os.fspath(path))

    def rm_file(self, path: str | os.PathLike) -> None:
        self.storage.remove(os.fspath(path))


__all__ = ["DcpFileSystem"]
