"""Local paths: the storage backend of every path without a ``scheme://``.

Data files are written in place and fsynced at commit (:class:`LocalDataFile`, a buffered file
whose descriptor the writer also uses for ``writev``); small objects are replaced by a
:class:`RenameCommit`: a temporary file beside the destination, written and fsynced, renamed
over it (``os.replace`` is atomic on POSIX), then the directory fsynced so that the rename
itself survives a power loss. Stock DCP's ``FileSystemWriter.finish`` removes the old
``.metadata`` before its rename and fsyncs no directory; this does neither.
"""

from __future__ import annotations

import ctypes
import errno
import io
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

from solosave._src.storage.base import Commit, Data, DataFile, Storage

#: ``s3:/bucket/...``: a URL after ``pathlib.Path`` collapsed its ``//``.
_MANGLED = re.compile(r"^(s3a?|gs|gcs|az|abfss?|adl|oss|hf|memory):/[^/]")


def fsync_dir(directory: str | os.PathLike) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: The most one ``pread`` of :func:`pread_all` asks for: a length read from a damaged file
#: allocates at most this much beyond what the file holds.
PREAD_CHUNK = 16 << 20


def pread_all(fd: int, offset: int, length: int) -> bytes:
    """``length`` bytes of ``fd`` from ``offset`` (``pread`` until done; shorter only at the end
    of the file). Read in pieces of at most ``PREAD_CHUNK``, so that a ``length`` taken from a
    damaged file never allocates more than the file holds."""
    parts, done = [], 0
    while done < length:
        b = os.pread(fd, min(length - done, PREAD_CHUNK), offset + done)
        if not b:
            break
        parts.append(b)
        done += len(b)
    return b"".join(parts)


def unlink_if_present(path: Any) -> None:
    """Remove the local file ``path``; nothing to do if it is already gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2  # linux/fs.h


def exchange_paths(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Swap what the names ``a`` and ``b`` point to, atomically (Linux ``renameat2`` with
    ``RENAME_EXCHANGE``: a reader sees one or the other, never neither), then fsync their
    directory. Returns ``False``, changing nothing, where the kernel, the C library or the file
    system does not offer it; raises ``OSError`` for other failures."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):  # no glibc >= 2.28 here
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            return False
        raise OSError(err, f"exchanging {os.fspath(a)} and {os.fspath(b)}: {os.strerror(err)}")
    fsync_dir(os.path.dirname(os.path.abspath(b)))
    return True


def replace_path(new: str | os.PathLike, final: str | os.PathLike, remove: Any) -> None:
    """Put the directory (or file) ``new`` at ``final``, whatever ``final`` holds now (a
    directory, a file, a link, nothing), so that ``final`` always names a complete one: with an
    atomic exchange where the system has one (the old one then sits at ``new`` until
    ``remove(path)`` deletes it), else by renaming the old one aside first (one brief moment
    without ``final``; the old one stays under ``.<name>.replaced`` until it is deleted)."""
    final_p = Path(final)
    if not (final_p.exists() or final_p.is_symlink()):
        os.rename(new, final)
    elif exchange_paths(new, final):
        remove(Path(new))
    else:
        aside = final_p.with_name(f".{final_p.name}.replaced")
        remove(aside)
        os.rename(final, aside)
        os.rename(new, final)
        remove(aside)
    fsync_dir(final_p.parent)


def check_local_path(path: str | os.PathLike) -> None:
    """Refuse a URL that went through ``pathlib.Path`` (``s3:/bucket/...``): saving there would
    create a local directory named ``s3:``."""
    text = os.fspath(path)
    if isinstance(text, str) and _MANGLED.match(text):
        raise ValueError(f"{text!r} looks like a URL whose '//' was collapsed by pathlib.Path; pass "
                         f"the URL as a string (e.g. {text.replace(':/', '://', 1)!r})")


class RenameCommit(Commit):
    """A file system's commit: :meth:`write_aside` writes and fsyncs a temporary file beside the
    destination (``.<name>.tmp.<pid>.<random>``), :meth:`finish` renames it over the
    destination and fsyncs the directory, :meth:`discard` removes it. With ``fsync=False``
    nothing is fsynced (tests, and writers told not to)."""

    def _write_aside(self, data: Data) -> None:
        dst = Path(self.path).absolute()  # renamed later: a change of working directory must not matter
        tmp = dst.with_name(f".{dst.name}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        try:
            with open(tmp, "wb") as f:
                f.writelines([data] if isinstance(data, (bytes, bytearray, memoryview)) else data)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
        except BaseException:
            unlink_if_present(tmp)
            raise
        self._dst, self._tmp = dst, tmp

    def _finish(self) -> None:
        try:
            os.replace(self._tmp, self._dst)
        except BaseException:
            unlink_if_present(self._tmp)
            raise
        if self.fsync:
            fsync_dir(self._dst.parent)

    def _discard(self) -> None:
        unlink_if_present(self._tmp)


class LocalDataFile(io.BufferedWriter, DataFile):
    """A data file on a local file system: a buffered file (its descriptor is usable for
    ``writev``) whose :meth:`commit` flushes, fsyncs (unless ``fsync=False``) and closes it."""

    def __init__(self, path: str, fsync: bool = True) -> None:
        raw = io.FileIO(path, "wb")
        try:
            # the buffer size open() would choose: the file system's block size
            size = os.fstat(raw.fileno()).st_blksize
        except OSError:
            size = io.DEFAULT_BUFFER_SIZE
        super().__init__(raw, size if size > 1 else io.DEFAULT_BUFFER_SIZE)
        self.fsync = fsync

    def commit(self) -> None:
        self.flush()
        if self.fsync:
            os.fsync(self.fileno())
        self.close()


class RenamedDataFile:
    """A local data file that appears whole or not at all: written under a temporary name beside
    ``path`` (``open_data(tmp)``: a :class:`LocalDataFile`, or a writer's) and renamed into place
    by :meth:`commit`, which then fsyncs the directory (unless ``fsync=False``), as
    :class:`RenameCommit` does for whole buffers; :meth:`close` abandons it and removes the
    temporary file. For files received in pieces (the peer copies of two tiers)."""

    def __init__(self, path: str, open_data: Any, fsync: bool = True) -> None:
        self.path, self.fsync = path, fsync
        self._tmp = f"{path}.incoming"
        self._out = open_data(self._tmp)

    def write(self, data: Any) -> int:
        return self._out.write(data)

    def commit(self) -> None:
        self._out.commit()
        os.replace(self._tmp, self.path)
        if self.fsync:
            fsync_dir(os.path.dirname(os.path.abspath(self.path)))

    def close(self) -> None:
        try:
            self._out.close()
        finally:
            unlink_if_present(self._tmp)


class LocalStorage(Storage):
    """Local paths (see the module docstring): ``os`` calls, data files in place, commits by
    rename. Stateless; ``storage_options`` do not apply."""

    local_files = True
    load_index = True
    commit_type = RenameCommit

    @classmethod
    def from_path(cls, path: str, options: Mapping[str, Any] | None = None) -> LocalStorage:
        return cls()

    @classmethod
    def normalize(cls, path: Any) -> str:
        return os.fspath(Path(path))

    @classmethod
    def join(cls, base: Any, name: str) -> str:
        return os.path.join(os.fspath(base), name)

    @classmethod
    def basename(cls, path: Any) -> str:
        return os.path.basename(os.fspath(path))

    @classmethod
    def dirname(cls, path: Any) -> str:
        return os.path.dirname(os.fspath(path))

    def free_bytes(self, path: str) -> int | None:
        p = Path(path).absolute()
        while not p.exists() and p != p.parent:  # the nearest directory that exists holds the space
            p = p.parent
        try:
            return shutil.disk_usage(p).free
        except OSError:
            return None

    def same_location(self, a: str, b: str) -> bool:
        """Resolved locations (symbolic links, ``..``), then, for paths that exist, device and
        inode (a bind mount reaches one directory under two resolved names)."""
        if os.path.realpath(a) == os.path.realpath(b):
            return True
        try:
            return os.path.samefile(a, b)
        except OSError:  # one of them does not exist (yet): only its resolved name can tell
            return False

    def check_destination(self, path: str) -> None:
        check_local_path(path)
        p = Path(path)
        if any(len(os.fsencode(part)) > 255 for part in p.parts):
            raise ValueError(f"destination {path!r} has a name longer than 255 bytes, the "
                             "file-system limit; choose a shorter name")
        if p.exists() and not p.is_dir():
            raise ValueError(f"destination {path!r} exists and is not a directory")

    def prepare_destination(self, path: str, known: set[str]) -> None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot create checkpoint directory {path!r}: {e.strerror}; "
                             "choose a writable location") from e
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"checkpoint directory {path!r} is not writable; choose a "
                             "writable location or fix its permissions")

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def isfile(self, path: str) -> bool:
        return os.path.isfile(path)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def read(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        fd = os.open(path, os.O_RDONLY)
        try:
            return pread_all(fd, offset, length)
        finally:
            os.close(fd)

    def read_range_into(self, path: str, offset: int, out: memoryview) -> int:
        fd = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < len(out):
                got = os.preadv(fd, [out[done:]], offset + done)
                if got <= 0:
                    break
                done += got
            return done
        finally:
            os.close(fd)

    def open_read(self, path: str) -> BinaryIO:
        return open(path, "rb")  # noqa: SIM115 - the caller closes it

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def open_data(self, path: str, *, fsync: bool = True, part_size: int = 16 << 20,
                  concurrency: int = 8) -> LocalDataFile:
        return LocalDataFile(path, fsync)

    def remove(self, path: str) -> None:
        unlink_if_present(path)

    def remove_tree(self, path: str) -> None:
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            pass


__all__ = ["LocalDataFile", "LocalStorage", "RenameCommit", "RenamedDataFile", "check_local_path", "exchange_paths",
           "fsync_dir", "replace_path",
           "pread_all", "unlink_if_present"]
