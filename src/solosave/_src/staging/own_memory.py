"""Reading this process's own memory without crashing when it is freed meanwhile.

An overlapped CPU staging copies a saved tensor in a thread while the training thread runs on.
A training loop that breaks the contract (it resizes or frees a saved tensor, or the base of a
saved view, before ``wait_staged()``) may unmap that memory in the middle of a copy: a plain
copy then dies with SIGSEGV. :func:`read_own_memory` copies with Linux's ``process_vm_readv``
on this process instead: memory that is no longer mapped makes it fail (``EFAULT``), not crash,
and the staging reports a :class:`~solosave.StagingRaceError`. Memory freed but still mapped reads
as whatever it holds; the staging's check after the copy (the storage's pointer and size, the
version counters) fails the save then. Where the kernel refuses the call (seccomp, an old
kernel), ``None`` tells the caller to copy with torch (the race is then narrowed to one piece,
not closed).
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading

__all__ = ["read_own_memory"]


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_lock = threading.Lock()
_readv: list = []  # [the libc function, or None where there is none]; set on first use


def _function() -> object | None:
    with _lock:
        if not _readv:
            try:
                f = ctypes.CDLL(None, use_errno=True).process_vm_readv
                f.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.POINTER(_Iovec),
                              ctypes.c_ulong, ctypes.c_ulong]
                f.restype = ctypes.c_ssize_t
                _readv.append(f)
            except (OSError, AttributeError):  # not Linux, or no glibc >= 2.15
                _readv.append(None)
        return _readv[0]


def read_own_memory(dst: int, src: int, nbytes: int) -> bool | None:
    """Copy ``nbytes`` from address ``src`` to address ``dst`` of this process. ``True``: copied;
    ``False``: part of ``src`` is no longer mapped (nothing may be taken from ``dst``); ``None``:
    this system does not allow the call (copy another way)."""
    f = _function()
    if f is None:
        return None
    done = 0
    while done < nbytes:
        local, remote = _Iovec(dst + done, nbytes - done), _Iovec(src + done, nbytes - done)
        got = f(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)  # type: ignore[operator]
        if got < 0:
            err = ctypes.get_errno()
            if err in (errno.EPERM, errno.ENOSYS, errno.EACCES) and done == 0:
                with _lock:
                    _readv[:] = [None]  # refused here: every later copy goes the other way at once
                return None
            return False
        if got == 0:
            return False
        done += got
    return True
