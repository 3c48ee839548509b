"""Where a checkpoint's bytes go: a local path, or an fsspec URL (``s3://bucket/run/step_100``).

Everything that reads or writes storage outside the record format goes through
:func:`storage_for`, which picks the backend from the path: a string with ``scheme://`` is a
URL (never put through ``pathlib``: ``Path("s3://b/x")`` is the local path ``s3:/b/x``); anything
else is local. Both backends give the same guarantees, each with its own primitive:

* :class:`LocalStorage` (as solosave always did): data files written in place and fsynced;
  ``.metadata``, the prepared file and ``latest`` replaced by :func:`atomic_write` (temporary
  file, fsync, rename, directory fsync);
* :class:`FsspecStorage` (object stores have no rename): a data file is one object that appears
  whole when its upload completes (:mod:`solosave._src.storage.upload`); ``.metadata``, the prepared file and
  ``latest`` are each replaced by **one single-object write** (a PUT: readers see the old object
  or the new one, never a part); unpublishing deletes ``.metadata``.

fsspec and its backends (s3fs: ``pip install 'solosave[s3]'``) are imported only when a URL is
used. Credentials and endpoint come from the backend's usual sources (for S3 the standard AWS
variables: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...) and from ``storage_options``, the
keyword arguments handed to the filesystem (``CheckpointerOptions.storage_options``,
``solosave.load(..., storage_options=)``). Errors of the storage client become ``OSError``s
whose message says what to fix (:func:`solosave._src.storage.upload.storage_error`).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import re
import shutil
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from torch.distributed.checkpoint.filesystem import FileSystemBase

from solosave._src.core.errors import CheckpointExistsError, PreparedMetadataError
from solosave._src.formats.dcp import METADATA_FILE
from solosave._src.storage.upload import ObjectUpload, S3Upload, StreamUpload, storage_error

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
#: ``s3:/bucket/...``: a URL after ``pathlib.Path`` collapsed its ``//``.
_MANGLED = re.compile(r"^(s3a?|gs|gcs|az|abfss?|adl|oss|hf|memory):/[^/]")
#: Object stores: no directories (nothing to create) and a single write is atomic.
OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "gcsfs", "az", "abfs", "abfss", "adl", "oss", "memory"})
INSTALL_HINT = "pip install 'solosave[s3]'"


def is_url(path: Any) -> bool:
    """Whether ``path`` is an fsspec URL (``scheme://...``) rather than a local path."""
    return isinstance(path, str) and _URL.match(path) is not None


def normalize_url(url: str) -> str:
    """``url`` without trailing slashes (``s3://b/run/`` and ``s3://b/run`` are one directory)."""
    head = _URL.match(url)
    rest = url[head.end():].rstrip("/") if head else url.rstrip("/")
    return (head.group(0) if head else "") + rest


def join(base: str | os.PathLike, name: str) -> str:
    """``base/name``: ``/`` for URLs, ``os.path.join`` for local paths."""
    if is_url(base):
        return f"{normalize_url(base)}/{name}"  # type: ignore[arg-type]
    return os.path.join(os.fspath(base), name)


def basename(path: str | os.PathLike) -> str:
    return posixpath.basename(normalize_url(path)) if is_url(path) else os.path.basename(os.fspath(path))


def check_local_path(path: str | os.PathLike) -> None:
    """Refuse a URL that went through ``pathlib.Path`` (``s3:/bucket/...``): saving there would
    create a local directory named ``s3:``."""
    text = os.fspath(path)
    if isinstance(text, str) and _MANGLED.match(text):
        raise ValueError(f"{text!r} looks like a URL whose '//' was collapsed by pathlib.Path; pass "
                         f"the URL as a string (e.g. {text.replace(':/', '://', 1)!r})")


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


class StagedCommit:
    """A replacement of one file, written ahead and not yet visible: :meth:`finish` makes it
    visible (atomically), :meth:`discard` drops it; either is idempotent and the first one wins.

    Locally :meth:`LocalStorage.stage_commit` writes (and fsyncs) the temporary file at once, so
    that :meth:`finish` is a rename and a directory fsync; elsewhere the write waits for
    :meth:`finish` (on an object store the single PUT is the commit)."""

    def __init__(self, finish: Any, discard: Any) -> None:
        self._finish, self._discard, self.done = finish, discard, False

    def finish(self) -> None:
        if not self.done:
            self.done = True
            self._finish()

    def discard(self) -> None:
        if not self.done:
            self.done = True
            self._discard()


def unlink_if_present(path: Any) -> None:
    """Remove the local file ``path``; nothing to do if it is already gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def stage_local(path: str | os.PathLike, data: bytes | Sequence[bytes], fsync: bool = True) -> StagedCommit:
    """Write ``data`` (bytes, or pieces of them in order) to a temporary file beside the local
    file ``path`` (fsynced); the returned commit renames it over ``path`` and fsyncs the
    directory. Nothing is left behind if writing fails."""
    path = Path(path).absolute()  # renamed later: a change of working directory must not matter
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.writelines([data] if isinstance(data, (bytes, bytearray, memoryview)) else data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
    except BaseException:
        unlink_if_present(tmp)
        raise

    def finish() -> None:
        try:
            os.replace(tmp, path)
        except BaseException:
            unlink_if_present(tmp)
            raise
        if fsync:
            fsync_dir(path.parent)

    return StagedCommit(finish, lambda: unlink_if_present(tmp))


def atomic_write(path: str | os.PathLike, data: bytes | Sequence[bytes], fsync: bool = True) -> None:
    """Replace the local file ``path`` with ``data`` (bytes, or pieces of them in order)
    atomically (temp file, fsync, rename, fsync directory): the commit primitive of
    :class:`LocalStorage`."""
    stage_local(path, data, fsync=fsync).finish()


class LocalStorage:
    """Local paths: the ``os`` calls solosave always made (see the module docstring)."""

    url = False

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

    def open_read(self, path: str) -> BinaryIO:
        return open(path, "rb")  # noqa: SIM115 - the caller closes it

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` (fewer at the end of the file)."""
        with open(path, "rb") as f:
            return os.pread(f.fileno(), length, offset)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def commit(self, path: str, data: bytes | Sequence[bytes], fsync: bool = True) -> None:
        atomic_write(path, data, fsync=fsync)

    def stage_commit(self, path: str, data: bytes | Sequence[bytes], fsync: bool = True) -> StagedCommit:
        """:meth:`commit` in two steps: the bytes written now, the rename at ``finish()``."""
        return stage_local(path, data, fsync=fsync)

    def remove(self, path: str) -> None:
        unlink_if_present(path)

    def remove_tree(self, path: str) -> None:
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            pass


LOCAL = LocalStorage()


class FsspecStorage:
    """An fsspec filesystem, addressed by full URLs (see the module docstring). Listing caches
    are dropped before every query: the worker processes write what the trainer then lists."""

    url = True

    def __init__(self, protocol: str, options: Mapping[str, Any] | None = None, where: str = "") -> None:
        self.protocol = protocol
        self.object_store = protocol in OBJECT_STORES
        self.fs = _filesystem(protocol, dict(options or {}), where or f"{protocol}://")

    @contextlib.contextmanager
    def _errors(self, url: str) -> Iterator[None]:
        try:
            yield
        except Exception as e:
            better = storage_error(e, url)
            if better is None:
                raise
            raise better from e

    def exists(self, path: str) -> bool:
        with self._errors(path):
            self.fs.invalidate_cache(path)
            return bool(self.fs.exists(path))

    def isdir(self, path: str) -> bool:
        with self._errors(path):
            self.fs.invalidate_cache(path)
            return bool(self.fs.isdir(path))

    def isfile(self, path: str) -> bool:
        with self._errors(path):
            self.fs.invalidate_cache(path)
            return bool(self.fs.isfile(path))

    def listdir(self, path: str) -> list[str]:
        """Names directly under ``path``; ``FileNotFoundError`` if there is nothing."""
        with self._errors(path):
            self.fs.invalidate_cache(path)
            return [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(path, detail=False)]

    def size(self, path: str) -> int:
        with self._errors(path):
            self.fs.invalidate_cache(path)
            return int(self.fs.size(path))

    def read(self, path: str) -> bytes:
        with self._errors(path):
            return self.fs.cat_file(path)

    def open_read(self, path: str) -> BinaryIO:
        with self._errors(path):
            return self.fs.open(path, "rb")

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` (fewer at the end): one ranged GET, no read-ahead."""
        with self._errors(path):
            return self.fs.cat_file(path, start=offset, end=offset + length)

    def makedirs(self, path: str) -> None:
        if not self.object_store:  # (s3fs would create a missing *bucket* here: never wanted)
            with self._errors(path):
                self.fs.makedirs(path, exist_ok=True)

    def commit(self, path: str, data: bytes | Sequence[bytes], fsync: bool = True) -> None:
        """Replace ``path`` by ``data`` (bytes, or pieces of them in order) at once: one PUT on
        an object store; elsewhere a temporary file renamed over it."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            data = b"".join(data)
        with self._errors(path):
            if self.object_store:
                self.fs.pipe_file(path, data)
            else:
                tmp = join(posixpath.dirname(path), f".{posixpath.basename(path)}.tmp.{uuid.uuid4().hex[:8]}")
                self.fs.pipe_file(tmp, data)
                self.fs.mv(tmp, path)
            self.fs.invalidate_cache(path)

    def stage_commit(self, path: str, data: bytes | Sequence[bytes], fsync: bool = True) -> StagedCommit:
        """:meth:`commit` deferred to ``finish()`` (the single write is the commit)."""
        return StagedCommit(lambda: self.commit(path, data, fsync=fsync), lambda: None)

    def remove(self, path: str) -> None:
        with self._errors(path):
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass
            self.fs.invalidate_cache(path)

    def remove_tree(self, path: str) -> None:
        with self._errors(path):
            try:
                self.fs.rm(path, recursive=True)
            except FileNotFoundError:
                pass
            self.fs.invalidate_cache(path)

    def open_upload(self, path: str, part_size: int, concurrency: int) -> ObjectUpload:
        """A data file's upload (:mod:`solosave._src.storage.upload`): concurrent multipart on S3."""
        with self._errors(path):
            if self.protocol in ("s3", "s3a"):
                return S3Upload(self.fs, path, part_size, concurrency)
            self.makedirs(posixpath.dirname(path))
            return StreamUpload(self.fs, path)

    def check_container(self, url: str) -> None:
        """Raise ``FileNotFoundError`` if ``url``'s bucket does not exist (S3; a no-op elsewhere).
        A bucket these credentials may not inspect is left to the writes to judge."""
        if self.protocol not in ("s3", "s3a"):
            return
        bucket = self.fs.split_path(url)[0]
        try:
            with self._errors(url):
                self.fs.invalidate_cache(bucket)
                self.fs.info(bucket)
        except FileNotFoundError:
            raise FileNotFoundError(f"bucket {bucket!r} of {url} does not exist; create it, or fix the "
                                    "URL (and the endpoint, AWS_ENDPOINT_URL, if it is not AWS)") from None
        except PermissionError:
            pass


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


def storage_for(path: Any, options: Mapping[str, Any] | None = None) -> LocalStorage | FsspecStorage:
    """The storage of ``path``: :class:`FsspecStorage` for a URL (``options``: keyword
    arguments of its filesystem), :data:`LOCAL` otherwise."""
    if is_url(path):
        head = _URL.match(path)
        return FsspecStorage(head.group(1).lower(), options, path)  # type: ignore[union-attr]
    return LOCAL


def path_exists(path: Any, options: Mapping[str, Any] | None = None) -> bool:
    return storage_for(path, options).exists(path if is_url(path) else os.fspath(path))


def check_url_destination(url: str, overwrite: bool, options: Mapping[str, Any] | None,
                          known: set[str]) -> str:
    """``save()``'s checks of a URL destination (this rank, no collective): the filesystem
    exists, the bucket exists (once per bucket: ``known`` holds those seen), and no published
    checkpoint is there unless ``overwrite`` (one HEAD request per save, none with ``overwrite``).
    Returns the normalized URL."""
    url = normalize_url(url)
    st = storage_for(url, options)
    if not overwrite and st.exists(join(url, METADATA_FILE)):  # wrong credentials fail here
        raise CheckpointExistsError(
            f"destination {url!r} already holds a complete checkpoint; choose a new directory or "
            "pass overwrite=True (its .metadata is removed before any data is written)")
    root = url[:url.index("://") + 3] + url[url.index("://") + 3:].split("/", 1)[0]
    if root not in known and isinstance(st, FsspecStorage):
        st.check_container(url)
        known.add(root)
    return url


def read_checkpoint_metadata(url: str, options: Mapping[str, Any] | None = None) -> bytes:
    """The bytes of ``<url>/.metadata``; ``FileNotFoundError`` if nothing is there,
    :class:`~solosave.PreparedMetadataError` if the checkpoint is not published."""
    st = storage_for(url, options)
    try:
        return st.read(join(url, METADATA_FILE))
    except FileNotFoundError:
        pass
    if not st.isdir(url):
        raise FileNotFoundError(f"checkpoint directory {url!r} does not exist")
    raise PreparedMetadataError(
        f"{url}: no {METADATA_FILE}; this is not a published checkpoint (a failed or unfinished save "
        "leaves none). Load an earlier checkpoint.")


class DcpFileSystem(FileSystemBase):
    """DCP's ``FileSystemBase`` over a URL's storage, for ``FileSystemReader``'s read path
    (what :func:`solosave.load` reads a URL checkpoint with)."""

    def __init__(self, storage: FsspecStorage) -> None:
        self.storage = storage

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "r" not in mode:
            raise ValueError("solosave reads URL checkpoints through DCP; it writes them itself")
        with self.storage.open_read(os.fspath(path)) as f:
            yield f

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return join(os.fspath(path), suffix)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        raise ValueError("solosave never renames in object storage")

    def init_path(self, path: str | os.PathLike) -> str:
        return normalize_url(os.fspath(path))

    def mkdir(self, path: str | os.PathLike) -> None:
        self.storage.makedirs(os.fspath(path))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return is_url(checkpoint_id)

    def exists(self, path: str | os.PathLike) -> bool:
        return self.storage.exists(os.fspath(path))

    def rm_file(self, path: str | os.PathLike) -> None:
        self.storage.remove(os.fspath(path))
