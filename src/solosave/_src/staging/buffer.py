"""The staging buffer: host memory that the trainer owns and its worker maps.

A file in ``/dev/shm`` (POSIX shared memory) **unlinked as soon as it is created**: the trainer
keeps its descriptor and mapping, and hands the descriptor to its worker over their pipe
(``SCM_RIGHTS``), once per buffer. With no name left in ``/dev/shm`` nothing can leak it: its
memory goes back when the last process that maps it (the trainer, the worker) ends, however they
end, even when the whole job is SIGKILLed together with the resource tracker that would have
unlinked a named segment. The file's pages are **reserved up front** (``posix_fallocate``): a
``/dev/shm`` too small for it (Docker's default is 64 MiB) is then an error at allocation, not a
``SIGBUS`` when the copy touches a missing page. On that error, or when
``SOLOSAVE_STAGING_DIR`` / ``staging_dir`` asks for it, the buffer is an (equally unlinked) file
in a directory with room, with one warning saying how to give the container more shared memory.

A buffer is freed (unregistered, unmapped, its descriptor closed) only once it is closed *and*
no lease on it is left. Staging takes a lease while copies into it may still run (an overlapped
CPU copy thread, copies on a CUDA side stream), so ``close()`` never unmaps memory that a copy
still writes: the last lease to go frees it.

CUDA: a buffer is registered as pinned memory (``cudaHostRegister`` with the portable flag) and
unregistered in a short-lived thread of its own that first makes the trainer's device current.
A failed CUDA runtime call leaves its error as the calling thread's last error, which CUDA reports
at that thread's next kernel launch: in a thread of its own the error ends with the thread
instead of failing the trainer's next kernel. A failed registration means unpinned (slower)
copies, with a warning.

Owners: :class:`_Buffer` is made and closed by the trainer's ``staging.Stager``;
:class:`BufferReader` is the worker's view of it (``engine.Engine``), mapped from the descriptor
its trainer handed over (:meth:`BufferReader.adopt`).
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
import threading
import uuid
from collections.abc import Callable

import torch

from solosave._src.coordination.protocol import ItemSpec, StagedItem, StagedSave
from solosave._src.formats.dcp import dtype_from_name
from solosave._src.staging.device import HOST_REGISTER_PORTABLE, DeviceRuntime

log = logging.getLogger("solosave")

#: Prefix of every shared-memory segment and staging file solosave creates.
SEGMENT_PREFIX = "solosave_"
#: Environment variable: a directory for file-backed staging buffers (instead of /dev/shm).
STAGING_DIR_ENV = "SOLOSAVE_STAGING_DIR"
_SHM_DIR = "/dev/shm"  # noqa: S108 - where Linux keeps POSIX shared memory, not a temp file
#: Bound of one registration or unregistration call (pinning the pages of a large buffer takes time).
REGISTER_TIMEOUT_S = 300.0


class _Buffer:
    """One staging buffer (see the module docstring). Trainer side; ``lease()``, ``close()`` and
    a lease's ``release()`` may be called from any thread."""

    def __init__(self, size: int, staging_dir: str | None) -> None:
        self.size = max(size, 1)
        name = f"{SEGMENT_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:12]}"
        self.fd = -1
        #: The buffer's identity in the jobs (``shm:<name>`` or ``file:<path>``; no file by it).
        self.name = ""
        if staging_dir is None:
            try:
                self.fd, self.name = _create(_SHM_DIR, name, self.size), f"shm:{name}"
            except OSError as e:
                staging_dir = tempfile.gettempdir()
                log.warning(
                    "solosave: /dev/shm cannot hold the %d-byte staging buffer (%s); staging in a "
                    "file under %s instead. Give the container more shared memory (docker run "
                    "--shm-size=<per-rank state x ranks per host + 10%%>, or --ipc=host), or set "
                    "%s to a directory with room to silence this.", self.size, e.strerror or e,
                    staging_dir, STAGING_DIR_ENV)
        if self.fd < 0:
            where = staging_dir or tempfile.gettempdir()
            self.fd, self.name = _create(where, name, self.size), f"file:{os.path.join(where, name)}"
        try:
            self._mmap: mmap.mmap | None = mmap.mmap(self.fd, self.size)
        except OSError:
            os.close(self.fd)
            raise
        self.base: torch.Tensor | None = torch.frombuffer(self._mmap, dtype=torch.uint8, count=self.size)
        self.pinned = False
        self._runtime: DeviceRuntime | None = None
        self._device = 0
        self._lock = threading.Lock()
        self._leases = 0
        self._closing = False
        self._freed = False
        self._handed = False

    # -- pinning -------------------------------------------------------------------------------
    def pin(self, runtime: DeviceRuntime, device: int) -> None:
        """Register the buffer as pinned memory for every device (see the module docstring); on
        failure the copies run unpinned, with a warning. Called by the trainer's thread."""
        if self.base is None:
            raise RuntimeError("internal: pinning a freed staging buffer")
        ptr, size = self.base.data_ptr(), self.size
        rc = _in_own_thread(runtime, device, lambda: runtime.host_register(ptr, size, HOST_REGISTER_PORTABLE))
        if rc != 0:
            log.warning("solosave: cudaHostRegister of the %d-byte staging buffer failed (%s); "
                        "device-to-host copies run unpinned (slower)", self.size,
                        "it did not return in time" if rc is None else f"code {rc}")
            return
        self.pinned, self._runtime, self._device = True, runtime, device

    def view(self, offset: int, spec: ItemSpec) -> torch.Tensor:
        dtype = dtype_from_name(spec.dtype or "")
        if spec.nbytes == 0 or self.base is None:
            return torch.empty(spec.sizes or (), dtype=dtype)
        return self.base[offset:offset + spec.nbytes].view(dtype).view(spec.sizes or ())

    # -- the worker's mapping ------------------------------------------------------------------
    def take_handoff(self) -> tuple[str, int] | None:
        """``(name, descriptor)`` the first time it is asked (for the worker to map), then
        ``None``. The descriptor stays the buffer's: whoever receives it duplicates it."""
        with self._lock:
            if self._handed or self._freed:
                return None
            self._handed = True
            return self.name, self.fd

    # -- lifetime ------------------------------------------------------------------------------
    def lease(self) -> _Lease:
        """Keep the buffer mapped (and registered) until the lease is released."""
        with self._lock:
            if self._freed:
                raise RuntimeError("internal: a lease on a freed staging buffer")
            self._leases += 1
        return _Lease(self)

    @property
    def busy(self) -> bool:
        """A copy into the buffer may still run (a lease is held)."""
        return self._leases > 0

    def close(self) -> None:
        """Free the buffer now, or when its last lease is released. Idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            now = self._leases == 0
        if now:
            self._free()

    def _release(self) -> None:
        with self._lock:
            self._leases -= 1
            now = self._closing and self._leases == 0
        if now:
            self._free()

    def _free(self) -> None:
        with self._lock:
            if self._freed:
                return
            self._freed = True
        if self.pinned and self._runtime is not None and self.base is not None:
            rt, ptr = self._runtime, self.base.data_ptr()
            if _in_own_thread(rt, self._device, lambda: rt.host_unregister(ptr)) is None:
                # unmapping pages a registration call still holds would be worse than keeping them
                log.warning("solosave: cudaHostUnregister of the staging buffer did not return "
                            "within %.0f s; its memory stays mapped", REGISTER_TIMEOUT_S)
                return
            self.pinned = False
        self.base = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # a memoryview export is still alive: the mapping goes with it
                pass
            self._mmap = None
        os.close(self.fd)
        self.fd = -1


class _Lease:
    """One holder's claim on a :class:`_Buffer`; ``release()`` is idempotent."""

    __slots__ = ("_buffer",)

    def __init__(self, buffer: _Buffer) -> None:
        self._buffer: _Buffer | None = buffer

    def release(self) -> None:
        buf, self._buffer = self._buffer, None
        if buf is not None:
            buf._release()


def _create(directory: str, name: str, size: int) -> int:
    """A new file of ``size`` reserved bytes in ``directory``, already unlinked: its descriptor."""
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    os.unlink(path)  # at once: from here on only descriptors and mappings hold it
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        os.close(fd)
        raise OSError(e.errno, f"cannot reserve {size} bytes for the staging buffer in {directory} "
                      f"({e.strerror}); set {STAGING_DIR_ENV} to a directory with room") from e
    return fd


def _in_own_thread(runtime: DeviceRuntime, device: int, call: Callable[[], int]) -> int | None:
    """Run a CUDA runtime ``call`` in a short-lived thread that first makes ``device`` current
    (see the module docstring); its result, or ``None`` if it did not return in time."""
    result: list[int] = []

    def body() -> None:
        try:
            runtime.set_device(device)
            result.append(int(call()))
        except Exception as e:  # noqa: BLE001 - reported as a failure by the caller
            log.warning("solosave: a CUDA host-registration call raised: %s", e)
            result.append(-1)

    t = threading.Thread(target=body, name="solosave-pin", daemon=True)
    t.start()
    t.join(REGISTER_TIMEOUT_S)
    return result[0] if result else None


class BufferReader:
    """Worker-side view of the trainer's staging buffer (mapped once, kept while current).

    The trainer hands each new buffer's descriptor over (:meth:`adopt`) before the first job
    that names it; the job's ``staged.buffer`` then selects it. The reader maps it (writable, as
    ``torch.frombuffer`` wants, though it only reads) and closes the descriptor; no resource
    tracker ever learns of it."""

    def __init__(self) -> None:
        self._name: str | None = None
        self._mmap: mmap.mmap | None = None
        #: Descriptors handed over and not mapped yet, by buffer name (at most a few: the
        #: trainer hands one per new buffer, just before the job that uses it).
        self._handed: dict[str, int] = {}
        self._lock = threading.Lock()
        #: Views made for the items of the current mapping, by item identity (a job of an
        #: unchanged structure brings the same item objects): made once, not per save.
        self._views: dict[int, tuple[StagedItem, torch.Tensor]] = {}

    def adopt(self, name: str, fd: int) -> None:
        """Take ownership of descriptor ``fd`` of buffer ``name`` (a duplicate, ours to close).
        Called by the worker's loop (process mode) or the trainer's thread (thread mode, while
        the engine is idle); only the newest handed buffer is kept."""
        with self._lock:
            old, self._handed = self._handed, {name: fd}
        for other in old.values():
            os.close(other)

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
        """Map ``staged``'s buffer if it is not the current one; returns the mapping (``None``
        for a job without a buffer), whose identity changes whenever earlier views stop being
        this buffer's. A job without a buffer (nothing staged, or a failed staging) leaves the
        current mapping alone: the next job of the structure names it again."""
        if staged.buffer is None:
            return None
        if staged.buffer != self._name or self._mmap is None:
            with self._lock:
                fd = self._handed.pop(staged.buffer, None)
            if fd is None:
                raise ValueError(f"internal: the staging buffer {staged.buffer!r} was never handed "
                                 "to this worker")
            self.close()
            try:
                self._mmap = mmap.mmap(fd, max(staged.buffer_size, 1))
            finally:
                os.close(fd)
            self._name = staged.buffer
        return self._mmap

    def keep_only(self, items: list[StagedItem]) -> None:
        """Forget the views of items other than ``items`` (bounded: one structure's views)."""
        if len(self._views) > len(items):
            keep = {id(it) for it in items}
            self._views = {k: v for k, v in self._views.items() if k in keep}

    def close(self) -> None:
        """Unmap the current buffer (descriptors handed over but not mapped stay, until the next
        :meth:`adopt` or :meth:`release`)."""
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

    def release(self) -> None:
        """Unmap and close every descriptor (the engine is done)."""
        self.close()
        with self._lock:
            old, self._handed = self._handed, {}
        for fd in old.values():
            os.close(fd)
