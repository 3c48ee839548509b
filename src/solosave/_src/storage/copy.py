"""Copying one file from one storage to another, streamed: the durable copy of two tiers.

:func:`stream_into` reads a file of any backend in chunks (``open_read``) and writes each chunk
into a :class:`~solosave._src.storage.base.DataFile` the caller opened on the destination and
commits after it returns (on an object store: the upload's parts go out concurrently while the
next chunk is read, and the object appears whole at the commit). Memory stays bounded by one
chunk being read plus the destination's parts in flight (``concurrency * part_size`` on S3),
whatever the file's size. Called from one thread per file; no collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from solosave._src.storage.base import Storage

#: Bytes read from the source per step (the destination's part size is independent of it).
CHUNK = 8 << 20


def stream_into(src: Storage, path: str, out: Any, chunk: int = CHUNK,
                stop: Callable[[], bool] | None = None) -> int:
    """Write the bytes of ``path`` (of ``src``) into ``out`` (a ``DataFile``; not committed
    here), ``chunk`` bytes at a time; returns the bytes written. ``stop()``: checked between
    chunks; when it says so the copy ends with ``InterruptedError`` (the caller abandons
    ``out``)."""
    done = 0
    with src.open_read(path) as f:
        while True:
            if stop is not None and stop():
                raise InterruptedError(f"the copy of {path} was stopped after {done} bytes")
            data = f.read(chunk)
            if not data:
                return done
            # a fresh bytes object per chunk: an upload keeps it without copying (it cannot change)
            out.write(data if type(data) is bytes else bytes(data))
            done += len(data)


__all__ = ["CHUNK", "stream_into"]
