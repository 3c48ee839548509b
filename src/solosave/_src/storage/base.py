"""The storage protocol: where a checkpoint's bytes go, and how each kind of write becomes visible.

A :class:`Storage` is one backend (local files, an fsspec filesystem, ...). Every module outside
this folder reaches storage through :func:`~solosave._src.storage.registry.storage_for`, which
picks the backend once from the path's scheme (``s3://bucket/run`` -> fsspec, a plain path ->
local), and then only through the methods below: no caller asks which backend it holds. Where
backends truly behave differently, the backend says so through a named capability
(:attr:`Storage.local_files`, :attr:`Storage.load_index`, :attr:`Storage.commit_type`).

A backend should expect the following sequence of calls for one save (``<dir>``: the
checkpoint directory, already :meth:`~Storage.normalize`\\ d):

0) (every rank, ``save()`` in the trainer) :meth:`~Storage.check_destination` ``(<dir>)``;
   :meth:`~Storage.exists` ``(<dir>/.metadata)`` (a published checkpoint is refused unless
   ``overwrite``); :meth:`~Storage.prepare_destination` ``(<dir>, known)``.
1) (every rank, worker) :meth:`~Storage.makedirs` ``(<dir>)``, then :meth:`~Storage.remove`
   ``(<dir>/.metadata)``: never an old ``.metadata`` beside new data.
2) (every rank, worker, one thread per data file) :meth:`~Storage.open_data` ->
   :meth:`DataFile.write` / :meth:`DataFile.write_stable` per piece -> :meth:`DataFile.commit`
   (or :meth:`DataFile.close` on an error); the checksum sidecar of the file the same way.
3) (coordinator only, after every rank's data files are committed) the load index, if
   :attr:`~Storage.load_index`: :meth:`~Storage.commit`; then ``.metadata``, last:
   :meth:`~Storage.commit`, or :meth:`~Storage.begin_commit` while the data is still being
   written and :meth:`Commit.finish` once every rank agreed (:meth:`Commit.discard` otherwise).

Loading reads ``.metadata`` with :meth:`~Storage.read` (group rank 0), or the load index with
:meth:`~Storage.read_range` (every rank), then the data files: with ``os`` calls where
:attr:`~Storage.local_files`, else with concurrent :meth:`~Storage.read_range_into` calls
(``load/range_read.py``; checkpoints whose records need DCP's stream transforms: DCP's read
path over :meth:`~Storage.open_read`, :class:`~solosave._src.storage.dcp_filesystem.DcpFileSystem`).
Prepared files are read by sections with :meth:`~Storage.read_range`. Retention removes
``<dir>/.metadata`` first, then :meth:`~Storage.remove_tree`. The ``latest`` marker and the
prepared file are replaced with :meth:`~Storage.commit`.

What every backend guarantees:

* a **commit** (:class:`Commit`, of the backend's :attr:`~Storage.commit_type`) replaces one
  small object atomically: readers see the old object or the new one, whole, never a part; a
  crash at any point leaves one of the two (a stray temporary may remain, never at the
  object's name);
* a **data file** (:class:`DataFile`) is durable once committed; on an object store it appears
  only then. On a file system it is written in place: it becomes part of a checkpoint only
  when a ``.metadata`` naming it is committed, which happens last;
* a missing object raises ``FileNotFoundError``; errors of a storage client become built-in
  ``OSError`` subclasses whose message says what to fix.

Adding a storage backend
------------------------
Two files change, nothing else:

1. ``storage/<name>.py``: a subclass of :class:`Storage` that implements the abstract methods,
   sets :attr:`~Storage.commit_type` (an existing :class:`Commit` type or one of its own) and
   the capabilities that hold for it, and whose :meth:`~Storage.from_path` builds it from a
   path and the user's ``storage_options``. Import an optional client package inside the
   methods that need it, or at the top of the module (the registry imports the module only
   when a path of its scheme is used, and says what to install if that import fails).
2. one registration line in ``storage/registry.py``:
   ``REGISTRY.register(("myfs",), "solosave._src.storage.<name>:<Class>", install="pip install ...")``.

``tests/unit/storage/test_registry.py`` registers an in-memory backend in a few lines: a model.
"""

from __future__ import annotations

import io
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, BinaryIO, ClassVar

#: What a commit writes: bytes, or pieces of them in order (written without joining them where
#: the backend can).
Data = bytes | bytearray | memoryview | Sequence[bytes]


def joined(data: Data) -> bytes | bytearray | memoryview:
    """``data`` as one buffer (pieces joined)."""
    return data if isinstance(data, (bytes, bytearray, memoryview)) else b"".join(data)


class Commit(ABC):
    """One atomic replacement of a small object (``.metadata``, the load index, a prepared file,
    ``latest``): readers see the old object or the new one, whole.

    Called from one thread at a time, in this order: the backend builds it
    (:meth:`Storage.begin_commit`) -> :meth:`write_aside` once (the bytes go where readers do not look,
    if the type has such a place) -> :meth:`finish` (the new object becomes visible at once) or
    :meth:`discard` (it never does). The first of ``finish``/``discard`` wins; later calls do
    nothing. A process that dies after :meth:`write_aside` and before :meth:`finish` leaves the old
    object, or none if there was none.
    """

    def __init__(self, storage: Storage, path: str, fsync: bool = True) -> None:
        self.storage, self.path, self.fsync = storage, path, fsync
        self._lock = threading.Lock()
        self._state = "new"  # -> "written" -> "done"; "done" at once if writing aside fails

    @property
    def done(self) -> bool:
        """Whether it was finished or discarded (or its staging failed)."""
        return self._state == "done"

    def write_aside(self, data: Data) -> None:
        """Write ``data`` ahead, invisible to readers; on an error nothing is left behind."""
        with self._lock:
            if self._state != "new":
                raise RuntimeError(f"internal: the commit of {self.path} was written aside twice")
            self._state = "done"  # until staging succeeded: finish() and discard() do nothing
        self._write_aside(data)
        self._state = "written"

    def finish(self) -> None:
        """Make the object written aside visible, atomically."""
        with self._lock:
            if self._state == "done":
                return
            if self._state != "written":
                raise RuntimeError(f"internal: the commit of {self.path} was finished before it was written aside")
            self._state = "done"
        self._finish()

    def discard(self) -> None:
        """Drop the object written aside; the old one stays."""
        with self._lock:
            state, self._state = self._state, "done"
        if state == "written":
            self._discard()

    @abstractmethod
    def _write_aside(self, data: Data) -> None: ...

    @abstractmethod
    def _finish(self) -> None: ...

    @abstractmethod
    def _discard(self) -> None: ...


class DataFile(ABC):
    """A data file being written (``__{rank}_{n}.distcp``, its checksum sidecar): a write-only
    stream, written from one thread in this order: :meth:`write` / :meth:`write_stable` per
    piece -> :meth:`commit` (durable; on an object store the object appears now, whole) or
    :meth:`close` (abandoned: on an object store nothing appears; a file keeps what was written,
    which no ``.metadata`` names)."""

    @abstractmethod
    def write(self, b: Any) -> int:
        """Write ``b`` (a copy is taken if the backend keeps it past the call)."""

    def write_stable(self, b: Any) -> int:
        """Write ``b``, which the caller keeps valid and unchanged until :meth:`commit` or
        :meth:`close` returns (a backend may send it later without copying it)."""
        return self.write(b)

    @abstractmethod
    def tell(self) -> int: ...

    def fileno(self) -> int:
        """The file descriptor, where there is one (the writer then batches with ``writev``)."""
        raise io.UnsupportedOperation("this data file has no file descriptor")

    @abstractmethod
    def commit(self) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


class Storage(ABC):
    """One storage backend. Instances come from :func:`~solosave._src.storage.registry.storage_for`
    and may be used from any thread; path operations and capabilities are class-level (they
    need no connection, so :func:`~solosave._src.storage.registry.backend_for` answers them
    without building one). Paths are strings in the backend's own form (see :meth:`normalize`)."""

    #: Paths name files of this machine's file system, which solosave's fast paths use with
    #: ``os`` calls (``pread`` straight into tensors, ``writev``, ``sync_file_range``). ``False``:
    #: every byte goes through this object, and loads read records through DCP's read path.
    local_files: ClassVar[bool] = False
    #: Saves write the load index (``.solosave-index``) here and loads read it back (by ranges,
    #: :meth:`read_range`).
    load_index: ClassVar[bool] = False
    #: How :meth:`commit` replaces an object (a :class:`Commit` subclass); may be set per instance.
    commit_type: type[Commit]

    @classmethod
    def from_path(cls, path: str, options: Mapping[str, Any] | None = None) -> Storage:
        """The backend serving ``path``; ``options``: the user's ``storage_options`` (keyword
        arguments of the client). Raises what to install or fix if it cannot be built."""
        return cls()

    # -- paths (pure: no I/O) -----------------------------------------------------------------
    @classmethod
    @abstractmethod
    def normalize(cls, path: Any) -> str:
        """The one string every rank derives alike from ``path`` (the same for ``x`` and ``x/``)."""

    @classmethod
    @abstractmethod
    def join(cls, base: Any, name: str) -> str: ...

    @classmethod
    @abstractmethod
    def basename(cls, path: Any) -> str: ...

    @classmethod
    @abstractmethod
    def dirname(cls, path: Any) -> str: ...

    def free_bytes(self, path: str) -> int | None:
        """Bytes that can still be written under ``path`` (``None``: unknown, e.g. an object
        store). Bounds what a peer may send (a header announcing more is refused)."""
        return None

    def same_location(self, a: str, b: str) -> bool:
        """Whether paths ``a`` and ``b`` of this storage reach the same directory or object, so
        that writing one would overwrite the other. The default compares normalized names;
        file systems also resolve links and ``..`` and compare device and inode."""
        return self.normalize(a) == self.normalize(b)

    # -- destinations (save(), every rank, before anything is written) -------------------------
    def check_destination(self, path: str) -> None:
        """Raise ``ValueError`` if ``path`` cannot name a checkpoint directory here (checked
        without writing anything). The default accepts every path."""
        return

    def prepare_destination(self, path: str, known: set[str]) -> None:
        """Make ``path`` ready to receive a checkpoint, or raise what to fix. ``known``: the
        caller's record of containers already checked (a backend may add to it and skip those).
        The default does nothing: the writes themselves create what they need."""
        return

    # -- queries ------------------------------------------------------------------------------
    @abstractmethod
    def exists(self, path: str) -> bool: ...

    @abstractmethod
    def isdir(self, path: str) -> bool: ...

    @abstractmethod
    def isfile(self, path: str) -> bool: ...

    @abstractmethod
    def listdir(self, path: str) -> list[str]:
        """Names directly under ``path``; ``FileNotFoundError`` if there is nothing."""

    @abstractmethod
    def size(self, path: str) -> int: ...

    def sizes(self, path: str) -> dict[str, int]:
        """The size of every object directly under ``path``, by name (a load checks its data
        files' sizes with it). The default asks :meth:`size` of each; a backend whose listing
        carries sizes answers with one listing."""
        return {name: self.size(self.join(path, name)) for name in self.listdir(path)
                if self.isfile(self.join(path, name))}

    # -- reads --------------------------------------------------------------------------------
    @abstractmethod
    def read(self, path: str) -> bytes: ...

    @abstractmethod
    def read_range(self, path: str, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` (fewer only at the end of the object)."""

    def read_range_into(self, path: str, offset: int, out: memoryview) -> int:
        """Read ``len(out)`` bytes at ``offset`` into ``out`` (a writable byte view: a tensor's
        memory); returns the bytes read (fewer only at the end of the object). May be called from
        many threads at once. The default copies what :meth:`read_range` returns; a backend that
        can read into a buffer overrides it."""
        data = self.read_range(path, offset, len(out))
        out[:len(data)] = data
        return len(data)

    @abstractmethod
    def open_read(self, path: str) -> BinaryIO:
        """A seekable binary stream; the caller closes it."""

    # -- writes -------------------------------------------------------------------------------
    @abstractmethod
    def makedirs(self, path: str) -> None:
        """Create the directory ``path`` and its parents (nothing to do on an object store)."""

    @abstractmethod
    def open_data(self, path: str, *, fsync: bool = True, part_size: int = 16 << 20,
                  concurrency: int = 8) -> DataFile:
        """A new data file at ``path`` (see :class:`DataFile`). ``fsync``: make it durable at
        commit; ``part_size`` / ``concurrency``: an upload's first part size and parts in
        flight, where the backend uploads in parts."""

    def begin_commit(self, path: str, data: Data, fsync: bool = True) -> Commit:
        """:meth:`commit` in two steps: the bytes written aside now, visible at ``finish()``."""
        commit = self.commit_type(self, path, fsync)
        commit.write_aside(data)
        return commit

    def commit(self, path: str, data: Data, fsync: bool = True) -> None:
        """Replace ``path`` by ``data`` atomically (see :class:`Commit`)."""
        self.begin_commit(path, data, fsync).finish()

    @abstractmethod
    def remove(self, path: str) -> None:
        """Remove the object ``path``; nothing to do if it is gone."""

    @abstractmethod
    def remove_tree(self, path: str) -> None:
        """Remove ``path`` and everything under it; nothing to do if it is gone."""


__all__ = ["Commit", "Data", "DataFile", "Storage", "joined"]
