"""The staging buffer: host memory that the trainer owns and its worker maps.

A POSIX shared-memory segment (``/dev/shm``) whose pages are **reserved up front**
(``posix_fallocate``): a ``/dev/shm`` too small for it (Docker's default is 64 MiB) is then an
error at allocation, not a ``SIGBUS`` when the copy touches a missing page. On that error, or
when ``SOLOSAVE_STAGING_DIR`` / ``staging_dir`` asks for it, the buffer is a file in a directory
with room (memory-mapped, shared with the worker the same way), with one warning saying how to
give the container more shared memory. The trainer owns every buffer: it unlinks it on
``close()``, on garbage collection of the checkpointer, and (shared memory) its resource tracker
unlinks it if the process is killed.

Owners: :class:`_Buffer` is made and closed by the trainer's ``_stage.Stager``;
:class:`BufferReader` is the worker's view of it (``_engine.Engine``).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import tempfile
import uuid
from multiprocessing import shared_memory

import torch

from solosave._src.coordination.protocol import ItemSpec, StagedItem, StagedSave
from solosave._src.formats.dcp import dtype_from_name
from solosave._src.save.device import DeviceRuntime
from solosave._src.storage.storage import unlink_if_present

log = logging.getLogger("solosave")

#: Prefix of every shared-memory segment and staging file solosave creates.
SEGMENT_PREFIX = "solosave_"
#: Environment variable: a directory for file-backed staging buffers (instead of /dev/shm).
STAGING_DIR_ENV = "SOLOSAVE_STAGING_DIR"
_SHM_DIR = "/dev/shm"  # noqa: S108 - where Linux keeps POSIX shared memory, not a temp file


class _Buffer:
    """One staging buffer: shared memory with reserved pages, or a memory-mapped file."""

    def __init__(self, size: int, staging_dir: str | None) -> None:
        self.size = max(size, 1)
        self.shm: shared_memory.SharedMemory | None = None
        self.path: str | None = None
        self._mmap: mmap.mmap | None = None
        self._file_unlinked = False
        name = f"{SEGMENT_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:12]}"
        if staging_dir is None:
            try:
                self._create_shm(name)
            except OSError as e:
                staging_dir = tempfile.gettempdir()
                log.warning(
                    "solosave: /dev/shm cannot hold the %d-byte staging buffer (%s); staging in a "
                    "file under %s instead. Give the container more shared memory (docker run "
                    "--shm-size=<per-rank state x ranks per host + 10%%>, or --ipc=host), or set "
                    "%s to a directory with room to silence this.", self.size, e.strerror or e,
                    staging_dir, STAGING_DIR_ENV)
        if self.shm is None:
            self._create_file(os.path.join(staging_dir or tempfile.gettempdir(), name))
        view = self.shm.buf if self.shm is not None else self._mmap
        self.base = torch.frombuffer(view, dtype=torch.uint8, count=self.size)
        self.pinned = False
        self._runtime: DeviceRuntime | None = None

    def _create_shm(self, name: str) -> None:
        shm = shared_memory.SharedMemory(create=True, size=self.size, name=name)
        try:
            os.posix_fallocate(shm._fd, 0, self.size)  # type: ignore[attr-defined]
        except OSError:
            _close_shm(shm)
            raise
        self.shm = shm

    def _create_file(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, self.size)
            self._mmap = mmap.mmap(fd, self.size)
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            raise OSError(e.errno or errno.ENOSPC,
                          f"cannot reserve {self.size} bytes for the staging buffer in "
                          f"{os.path.dirname(path)} ({e.strerror}); set {STAGING_DIR_ENV} to a "
                          "directory with room") from e
        os.close(fd)
        self.path = path

    @property
    def name(self) -> str:
        return f"shm:{self.shm.name}" if self.shm is not None else f"file:{self.path}"

    def pin(self, runtime: DeviceRuntime) -> None:
        rc = runtime.host_register(self.base.data_ptr(), self.size, 0)
        self._runtime = runtime
        if int(rc) != 0:
            log.warning("solosave: cudaHostRegister of the %d-byte staging buffer failed (code %s); "
                        "device-to-host copies run unpinned (slower)", self.size, rc)
            return
        self.pinned = True

    def view(self, offset: int, spec: ItemSpec) -> torch.Tensor:
        dtype = dtype_from_name(spec.dtype or "")
        if spec.nbytes == 0:
            return torch.empty(spec.sizes or (), dtype=dtype)
        return self.base[offset:offset + spec.nbytes].view(dtype).view(spec.sizes or ())

    def forget_path(self) -> None:
        """File-backed: unlink the file once the worker has it mapped (no leftover on a kill)."""
        if self.path is not None and not self._file_unlinked:
            unlink_if_present(self.path)
            self._file_unlinked = True

    def close(self) -> None:
        if self.pinned:
            self._runtime.host_unregister(self.base.data_ptr())
            self.pinned = False
        self.base = None  # type: ignore[assignment]
        if self.shm is not None:
            _close_shm(self.shm)
            self.shm = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # views still alive: the mapping goes with them
                pass
            self._mmap = None
            self.forget_path()


def _close_shm(shm: shared_memory.SharedMemory) -> None:
    try:
        shm.close()
    except BufferError:  # views still alive somewhere: the mapping goes with them
        pass
    try:
        shm.unlink()
    except FileNotFoundError:
        pass


class BufferReader:
    """Worker-side view of the trainer's staging buffer (mapped once, kept while current).

    It maps the segment's file directly (``/dev/shm/<name>`` or the staging file; writable, as
    ``torch.frombuffer`` wants, though the reader only reads), without
    ``multiprocessing.shared_memory``: no resource tracker learns of it, so a reader
    never unlinks, or unregisters, a buffer that its trainer owns (thread mode shares the
    trainer's tracker)."""

    def __init__(self) -> None:
        self._name: str | None = None
        self._mmap: mmap.mmap | None = None
        #: Views made for the items of the current mapping, by item identity (a job of an
        #: unchanged structure brings the same item objects): made once, not per save.
        self._views: dict[int, tuple[StagedItem, torch.Tensor]] = {}

    def tensor(self, staged: StagedSave, item: StagedItem) -> torch.Tensor:
        """A tensor over exactly this item's bytes (its storage is the item, nothing more)."""
        if self.mapping(staged) is None:
            raise ValueError(f"internal: {item.spec.fqn!r} is staged, but its job names no staging buffer")
        hit = self._views.get(id(item))
        if hit is not None and hit[0] is item:
            return hit[1]
        spec = item.spec
        dtype = dtype_from_name(spec.dtype or "")
        if spec.nbytes == 0:
            return torch.empty(spec.sizes or (), dtype=dtype)
        flat = torch.frombuffer(self._mmap, dtype=torch.uint8, count=spec.nbytes, offset=item.offset)
        view = flat.view(dtype).view(spec.sizes or ())
        self._views[id(item)] = (item, view)
        return view

    def mapping(self, staged: StagedSave) -> object:
        """Map ``staged``'s buffer if it is not the current one; returns the mapping, whose
        identity changes whenever earlier views stop being this buffer's."""
        if staged.buffer != self._name or self._mmap is None:
            self.close()
            if staged.buffer is not None:
                self._mmap = _map(staged.buffer, staged.buffer_size)
                self._name = staged.buffer
        return self._mmap

    def keep_only(self, items: list[StagedItem]) -> None:
        """Forget the views of items other than ``items`` (bounded: one structure's views)."""
        if len(self._views) > len(items):
            keep = {id(it) for it in items}
            self._views = {k: v for k, v in self._views.items() if k in keep}

    def close(self) -> None:
        self._views = {}
        if self._mmap is not None:
            try:
                # Unmaps even under live views: torch.frombuffer keeps no buffer export (checked
                # with torch 2.13), so a view made before this must never be read again. The
                # engine's caches drop or replace theirs: they are matched by view or mapping
                # identity, and a new mapping gives new views.
                self._mmap.close()
            except BufferError:  # a memoryview export is still alive; the mapping goes with it
                pass
        self._mmap = None
        self._name = None


def _map(name: str, size: int) -> mmap.mmap:
    kind, _, where = name.partition(":")
    path = os.path.join(_SHM_DIR, where) if kind == "shm" else where
    if kind not in ("shm", "file") or not where:
        raise ValueError(f"internal: unknown staging buffer {name!r}")
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, max(size, 1))
    finally:
        os.close(fd)
