"""Writing many buffers to a file descriptor: ``writev`` in batches and early write-back."""

from __future__ import annotations

import ctypes
import os
from typing import Any


def writev_all(fd: int, pieces: list) -> None:
    """Write ``pieces`` in order at ``fd``'s position: ``os.writev`` in batches of at most
    :data:`IOV_BATCH`, resuming after short writes. Every piece is a buffer whose ``len()`` is
    its size in bytes (``bytes``, a ``"B"`` memoryview, a uint8 array row): nothing is converted
    unless a write comes back short."""
    for start in range(0, len(pieces), IOV_BATCH):
        batch = pieces[start:start + IOV_BATCH]
        n = os.writev(fd, batch)
        if n == sum(map(len, batch)):
            continue
        rest = [memoryview(p).cast("B") for p in batch]
        while rest:
            while rest and n >= len(rest[0]):
                n -= len(rest[0])
                rest.pop(0)
            if rest and n:
                rest[0] = rest[0][n:]
            if rest:
                n = os.writev(fd, rest)


def _libc_sync_file_range() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range()


_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``fd``'s bytes ``[offset, offset + length)`` to disk now,
    without waiting (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``; elsewhere nothing): the
    disk works while the next batch is copied, and the final ``fsync`` has less left to do."""
    if _SYNC_FILE_RANGE is not None and length > 0:
        _SYNC_FILE_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # advisory: errors ignored


#: Buffers per ``writev`` call (Linux's IOV_MAX is 1024).
IOV_BATCH = 768


