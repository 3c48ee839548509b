"""fsspec URLs (``s3://bucket/run/step_100``, ``gs://...``, ``memory://...``): the storage backend
of every ``scheme://`` path that no other backend registered.

A URL is never put through ``pathlib`` (``Path("s3://b/x")`` is the local path ``s3:/b/x``).
Object stores have no rename: a data file is one object that appears whole when its upload
completes (:mod:`solosave._src.storage.upload`: concurrent multipart on S3), and a small object
is replaced by a :class:`PutCommit`, one single-object write (readers see the old object or the
new one, never a part); unpublishing deletes ``.metadata``. Other fsspec filesystems (``file``,
``sftp``, ...) replace by a :class:`MoveCommit`: a temporary object moved over the destination.
On both, a commit begun writes nothing until it is finished.

fsspec and its backends (s3fs: ``pip install 'solosave[s3]'``) are imported when a URL's
storage is first built, never by path operations. Credentials and endpoint come from the
backend's usual sources (for S3 the standard AWS variables: ``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ...) and from ``storage_options``, the keyword arguments handed to the
filesystem (``CheckpointerOptions.storage_options``, ``solosave.load(..., storage_options=)``).
Errors of the storage client become ``OSError``\\ s whose message says what to fix
(:func:`solosave._src.storage.upload.storage_error`). Listing caches are dropped before every
query: the worker processes write what the trainer then lists.
"""

from __future__ import annotations

import contextlib
import posixpath
import re
import uuid
from collections.abc import Iterator, Mapping
from typing import Any, BinaryIO

from solosave._src.storage.base import Commit, Data, Storage, joined
from solosave._src.storage.upload import ObjectUpload, S3Upload, StreamUpload, storage_error

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
#: Object stores: no directories (nothing to create) and a single write is atomic.
OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "gcsfs", "az", "abfs", "abfss", "adl", "oss", "memory"})
INSTALL_HINT = "pip install 'solosave[s3]'"


class PutCommit(Commit):
    """An object store's commit: the single write of the whole object is the commit, so
    :meth:`write_aside` only keeps the bytes and :meth:`finish` writes them (one PUT)."""

    storage: FsspecStorage

    def _write_aside(self, data: Data) -> None:
        self._data = joined(data)

    def _finish(self) -> None:
        data, self._data = self._data, b""
        st = self.storage
        with st.errors(self.path):
            st.fs.pipe_file(self.path, data)
            st.fs.invalidate_cache(self.path)

    def _discard(self) -> None:
        self._data = b""


class MoveCommit(Commit):
    """A commit on an fsspec filesystem with directories (``file``, ``sftp``, ...): :meth:`write_aside`
    keeps the bytes (nothing is written before the commit is decided), :meth:`finish` writes
    them to a temporary object beside the destination and moves it over the destination (the
    filesystem's rename), removing it if the move fails."""

    storage: FsspecStorage

    def _write_aside(self, data: Data) -> None:
        self._data = joined(data)

    def _finish(self) -> None:
        st, data, self._data = self.storage, self._data, b""
        tmp = st.join(st.dirname(self.path), f".{st.basename(self.path)}.tmp.{uuid.uuid4().hex[:8]}")
        with st.errors(self.path):
            st.fs.pipe_file(tmp, data)
            try:
                st.fs.mv(tmp, self.path)
            except BaseException:
                st.remove(tmp)
                raise
            st.fs.invalidate_cache(self.path)

    def _discard(self) -> None:
        self._data = b""


class FsspecStorage(Storage):
    """An fsspec filesystem, addressed by full URLs (see the module docstring). Saves write the
    load index here too; loads read it by ranged reads."""

    load_index = True

    def __init__(self, protocol: str, options: Mapping[str, Any] | None = None, where: str = "") -> None:
        self.protocol = protocol
        self.object_store = protocol in OBJECT_STORES
        self.commit_type = PutCommit if self.object_store else MoveCommit
        self.fs = _filesystem(protocol, dict(options or {}), where or f"{protocol}://")

    @classmethod
    def from_path(cls, path: str, options: Mapping[str, Any] | None = None) -> FsspecStorage:
        head = _URL.match(path)
        if head is None:
            raise ValueError(f"{path!r} is not a URL (scheme://...)")
        return cls(head.group(1).lower(), options, path)

    # -- paths ----------------------------------------------------------------------------------
    @classmethod
    def normalize(cls, path: Any) -> str:
        """``path`` without trailing slashes (``s3://b/run/`` and ``s3://b/run`` are one directory)."""
        head = _URL.match(path)
        rest = path[head.end():].rstrip("/") if head else path.rstrip("/")
        return (head.group(0) if head else "") + rest

    @classmethod
    def join(cls, base: Any, name: str) -> str:
        return f"{cls.normalize(base)}/{name}"

    @classmethod
    def basename(cls, path: Any) -> str:
        return posixpath.basename(cls.normalize(path))

    @classmethod
    def dirname(cls, path: Any) -> str:
        url = cls.normalize(path)
        head = _URL.match(url)
        start = head.end() if head else 0
        return url[:start] + posixpath.dirname(url[start:])

    @contextlib.contextmanager
    def errors(self, url: str) -> Iterator[None]:
        """Errors of the storage client inside, as the built-in error they mean, with the fix."""
        try:
            yield
        except Exception as e:
            better = storage_error(e, url)
            if better is None:
                raise
            raise better from e

    # -- destinations ---------------------------------------------------------------------------
    def prepare_destination(self, path: str, known: set[str]) -> None:
        """Check once per bucket (``known``: the roots checked) that the bucket exists."""
        head = _URL.match(path)
        root = path[:head.end()] + path[head.end():].split("/", 1)[0] if head else path
        if root not in known:
            self.check_container(path)
            known.add(root)

    def check_container(self, url: str) -> None:
        """Raise ``FileNotFoundError`` if ``url``'s bucket does not exist (S3; a no-op elsewhere).
        A bucket these credentials may not inspect is left to the writes to judge."""
        if self.protocol not in ("s3", "s3a"):
            return
        bucket = self.fs.split_path(url)[0]
        try:
            with self.errors(url):
                self.fs.invalidate_cache(bucket)
                self.fs.info(bucket)
        except FileNotFoundError:
            raise FileNotFoundError(f"bucket {bucket!r} of {url} does not exist; create it, or fix the "
                                    "URL (and the endpoint, AWS_ENDPOINT_URL, if it is not AWS)") from None
        except PermissionError:
            pass

    # -- queries --------------------------------------------------------------------------------
    def exists(self, path: str) -> bool:
        with self.errors(path):
            self.fs.invalidate_cache(path)
            return bool(self.fs.exists(path))

    def isdir(self, path: str) -> bool:
        with self.errors(path):
            self.fs.invalidate_cache(path)
            return bool(self.fs.isdir(path))

    def isfile(self, path: str) -> bool:
        with self.errors(path):
            self.fs.invalidate_cache(path)
            return bool(self.fs.isfile(path))

    def listdir(self, path: str) -> list[str]:
        with self.errors(path):
            self.fs.invalidate_cache(path)
            return [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(path, detail=False)]

    def size(self, path: str) -> int:
        with self.errors(path):
            self.fs.invalidate_cache(path)
            return int(self.fs.size(path))

    def sizes(self, path: str) -> dict[str, int]:
        """One listing (on S3 one LIST request) instead of a request per object."""
        with self.errors(path):
            self.fs.invalidate_cache(path)
            return {posixpath.basename(e["name"].rstrip("/")): int(e.get("size") or 0)
                    for e in self.fs.ls(path, detail=True) if e.get("type") != "directory"}

    # -- reads ----------------------------------------------------------------------------------
    def read(self, path: str) -> bytes:
        with self.errors(path):
            return self.fs.cat_file(path)

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        """One ranged GET, no read-ahead. A range that starts at or past the end reads nothing
        (S3 refuses such a range: its size is asked only then)."""
        if length <= 0:
            return b""
        with self.errors(path):
            try:
                return self.fs.cat_file(path, start=offset, end=offset + length)
            except OSError:
                if offset >= self.size(path):
                    return b""
                raise

    def open_read(self, path: str) -> BinaryIO:
        with self.errors(path):
            return self.fs.open(path, "rb")

    # -- writes ---------------------------------------------------------------------------------
    def makedirs(self, path: str) -> None:
        if not self.object_store:  # (s3fs would create a missing *bucket* here: never wanted)
            with self.errors(path):
                self.fs.makedirs(path, exist_ok=True)

    def open_data(self, path: str, *, fsync: bool = True, part_size: int = 16 << 20,
                  concurrency: int = 8) -> ObjectUpload:
        """An upload (no fsync: the object appears, whole, when committed): concurrent
        multipart on S3, the filesystem's own stream elsewhere."""
        with self.errors(path):
            if self.protocol in ("s3", "s3a"):
                return S3Upload(self.fs, path, part_size, concurrency)
            self.makedirs(posixpath.dirname(path))
            return StreamUpload(self.fs, path)

    def remove(self, path: str) -> None:
        with self.errors(path):
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass
            self.fs.invalidate_cache(path)

    def remove_tree(self, path: str) -> None:
        with self.errors(path):
            try:
                self.fs.rm(path, recursive=True)
            except FileNotFoundError:
                pass
            self.fs.invalidate_cache(path)


def _filesystem(protocol: str, options: dict[str, Any], where: str) -> Any:
    """The fsspec filesystem of ``protocol`` (fsspec caches instances by their arguments)."""
    try:
        import fsspec
    except ImportError as e:
        raise ImportError(f"{where} is a URL, and URLs need fsspec: {INSTALL_HINT}") from e
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except ValueError:
        raise ValueError(f"unknown storage protocol {protocol!r} in {where}: solosave takes local paths and "
                         f"fsspec URLs such as s3://bucket/path ({INSTALL_HINT})") from None
    except ImportError as e:
        raise ImportError(f"{where} needs the fsspec backend of {protocol}:// ({e}): for S3, "
                          f"{INSTALL_HINT}") from e
    try:
        return cls(**options)
    except TypeError as e:
        raise ValueError(f"storage_options {sorted(options)} were refused by the {protocol}:// "
                         f"filesystem: {e}") from e


__all__ = ["OBJECT_STORES", "FsspecStorage", "MoveCommit", "PutCommit"]
