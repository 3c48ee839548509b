"""Where a prepared file's bytes come from: a file of any storage backend, or bytes in memory.

A :class:`Source` gives random access by offset and counts the bytes read (the scale benchmark
reports them per rank). :class:`~solosave._src.prepared.sections.SectionReader` reads every section through
one. Any rank may use any source; none of them is shared between processes (a pickled source
reopens its file).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from solosave._src.core.errors import PreparedMetadataError
from solosave._src.storage.registry import backend_for, storage_for


class Source:
    """Random access to a prepared file; counts the bytes it read (``bytes_read``)."""

    where: str = "memory"
    bytes_read: int = 0

    def read(self, offset: int, length: int) -> bytes:
        data = self._read(offset, length)
        self.bytes_read += len(data)
        return data

    def _read(self, offset: int, length: int) -> bytes:
        raise NotImplementedError


class BytesSource(Source):
    def __init__(self, data: bytes, where: str = "memory") -> None:
        self.data, self.where = data, where

    def _read(self, offset: int, length: int) -> bytes:
        return self.data[offset:offset + length]


class StorageSource(Source):
    """A file of any storage backend (a local path or a URL), read by ranges through
    :meth:`~solosave._src.storage.base.Storage.read_range`; only its path and options are kept,
    so a pickled source reopens its file."""

    def __init__(self, path: str | os.PathLike, options: Mapping[str, Any] | None = None) -> None:
        self.where, self.options = backend_for(path).normalize(path), dict(options or {})

    def _read(self, offset: int, length: int) -> bytes:
        try:
            return storage_for(self.where, self.options).read_range(self.where, offset, length)
        except OSError as e:
            raise PreparedMetadataError(f"{self.where}: cannot read ({e})") from e
