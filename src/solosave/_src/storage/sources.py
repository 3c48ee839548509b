"""Where a prepared file's bytes come from: a local file, a URL, or bytes in memory.

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
from solosave._src.storage.storage import pread_all


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


class FileSource(Source):
    """A local file, read with ``pread`` (no seek shared between threads)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.where = os.fspath(path)

    def _read(self, offset: int, length: int) -> bytes:
        try:
            fd = os.open(self.where, os.O_RDONLY)
        except OSError as e:
            raise PreparedMetadataError(f"{self.where}: cannot read ({e})") from e
        try:
            return pread_all(fd, offset, length)
        finally:
            os.close(fd)


class StorageSource(Source):
    """A file behind an fsspec URL (ranged reads through the storage's ``open_read``)."""

    def __init__(self, url: str, options: Mapping[str, Any] | None = None) -> None:
        self.where, self.options = url, dict(options or {})

    def _read(self, offset: int, length: int) -> bytes:
        from solosave._src.storage.storage import storage_for

        with storage_for(self.where, self.options).open_read(self.where) as f:
            f.seek(offset)
            return f.read(length)
