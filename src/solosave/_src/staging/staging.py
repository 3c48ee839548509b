"""Step 2 of a save: staging (calling thread, every rank, no collective).

Values are copied into host memory owned by solosave before ``save()`` returns, so the caller
may change its tensors right away (snapshot semantics). Tensors go into **one staging buffer per
staging layout** (the list of items this rank stages, with their sizes), allocated once and
reused by every save of the same structure; each tensor is a view at an aligned offset, so the
worker process maps one buffer, not one file descriptor per tensor. Non-tensor values are
serialized with ``torch.save`` and travel inside the job message.

The buffer (``staging/buffer.py``) is shared memory that the worker maps. A staging holds a lease
on it while its copies may still run: a buffer is never unmapped, unregistered or reused under a
copy (``close()``, a staging that timed out, a new save: a new save of the same structure whose
buffer is still written by an old copy gets a new buffer). It also holds the source tensors and
their storages until the copies end, so a tensor the caller drops stays valid under its copy.

CUDA tensors (through ``staging/device.py``'s runtime; tests pass a recording fake): the buffer is
registered as pinned memory; torch runs a device-to-host copy on the current stream of the
*source's* device, so the copies of each source device run on a side stream of that device,
which first waits for that device's current stream, and record one event per device. Blocking
mode: each device's current stream then waits for its event, so later kernels (the next
optimizer step) cannot overwrite a tensor before it is copied. A source with its conjugate or
negative bit is resolved first (torch would fix such a copy up on the host before the bytes
land). The events stay in the trainer process: the checkpointer's submit thread (which first
makes the trainer's device current) waits for them before the job goes to the worker, so the
worker never initialises CUDA.

Overlapped staging (``overlap=True``): the copies proceed after ``stage()`` returns (a thread for
CPU tensors, the side streams for CUDA ones). Every torch optimizer's ``step()`` waits for them
first (:data:`STEP_GUARD`, a global optimizer step pre-hook): an optimizer updating DTensors
in place moves no version counter, so without it nothing could see its writes (D1). A staged
tensor changed in place (its version counter, or its DTensor's), resized, or whose storage was
freed or replaced before its copy fails the save with :class:`StagingRaceError`; the CPU copy
checks its sources before each piece (at most :data:`PIECE_BYTES`) and never reads a storage that
changed.

Owner: :class:`Stager` and :class:`Staging` live in the trainer process; the worker reads the
buffer through ``buffer.BufferReader``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from solosave._src.coordination.protocol import ItemKind, ItemSpec, StagedItem, StagedSave
from solosave._src.core.errors import SaveTimeoutError, StagingRaceError
from solosave._src.formats.dcp import ItemKey
from solosave._src.plan.local_plan import serialize_bytes, value_key
from solosave._src.staging.buffer import STAGING_DIR_ENV, BufferReader, _Buffer, _Lease
from solosave._src.staging.device import CudaRuntime, DeviceRuntime
from solosave._src.staging.own_memory import read_own_memory

#: Alignment of every tensor inside a staging buffer (bytes).
ALIGN = 64
#: An overlapped CPU copy runs in pieces of at most this many bytes (a larger contiguous tensor in
#: slices), each after a check that its sources are unchanged.
PIECE_BYTES = 8 << 20


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(slots=True)
class _Plan:
    """How one list of specs is staged into one buffer: computed once per list (the structure
    cache hands the same list to every save of an unchanged structure)."""

    specs: list[ItemSpec]
    buffer: _Buffer | None
    tensors: list[ItemSpec]
    #: Where the plan's values hold each of ``tensors`` (``plan/local_plan.value_key``).
    sources: list[Any]
    others: list[ItemSpec]
    views: list[torch.Tensor]
    items: tuple[StagedItem, ...]
    #: Positions (in ``tensors``) of the host tensors, and of each source device's tensors.
    host: list[int]
    by_device: dict[int, list[int]]


class Stager:
    """Copies the items a rank writes into reusable host buffers (trainer side).

    ``stage()`` is called from the calling thread only, one save at a time. Keeps the buffer of
    the most recent staging layout (a new structure, or a buffer still written by an earlier
    copy, gets a new one; the old one is freed when its copies end). ``close()`` closes the
    buffer (see ``buffer._Buffer``). ``staging_dir``: file-backed buffers in this directory
    instead of shared memory (default: ``$SOLOSAVE_STAGING_DIR`` if set). ``runtime``: the CUDA
    runtime (tests pass a fake). ``timeout``: how long an optimizer step waits for overlapped
    copies before it fails their save instead.
    """

    def __init__(self, staging_dir: str | None = None, runtime: DeviceRuntime | None = None,
                 timeout: float = 600.0) -> None:
        self.staging_dir = staging_dir or os.environ.get(STAGING_DIR_ENV) or None
        self.runtime: DeviceRuntime = runtime if runtime is not None else CudaRuntime()
        self.timeout = timeout
        self._layout: tuple | None = None
        self._offsets: dict = {}
        self._buffer: _Buffer | None = None
        self._plan: _Plan | None = None
        self._streams: dict[int, Any] = {}  # a side stream per source device
        self._overlapped: Staging | None = None

    def _ensure(self, tensors: list[ItemSpec], pinned: bool) -> _Buffer | None:
        layout = tuple((s.key, s.nbytes, s.dtype, s.sizes) for s in tensors) + (pinned,)
        buf = self._buffer
        if layout == self._layout and buf is not None and not buf.busy:
            return buf
        self._drop_buffer()
        if not tensors:
            self._layout = layout
            return None
        offsets, pos = {}, 0
        for s in tensors:
            offsets[s.key] = pos
            pos += _align(s.nbytes)
        buf = _Buffer(pos, self.staging_dir)
        if pinned:
            buf.pin(self.runtime, self.runtime.current_device())
        self._buffer, self._offsets, self._layout = buf, offsets, layout
        return buf

    def _plan_for(self, specs: list[ItemSpec], values: Mapping[str | ItemKey, Any]) -> _Plan:
        p = self._plan
        if (p is not None and p.specs is specs and p.buffer is self._buffer
                and (p.buffer is not None and not p.buffer.busy or not p.tensors)):
            return p
        tensors = [s for s in specs if s.kind is ItemKind.TENSOR]
        sources = [value_key(s, values) for s in tensors]
        host: list[int] = []
        by_device: dict[int, list[int]] = {}
        for k, source in enumerate(sources):
            d = self.runtime.device_of(values[source])
            if d is None:
                host.append(k)
            else:
                by_device.setdefault(d, []).append(k)
        buf = self._ensure(tensors, pinned=bool(by_device))
        offsets = self._offsets
        views = [buf.view(offsets[s.key], s) for s in tensors] if buf is not None else []
        self._plan = _Plan(specs, buf, tensors, sources, [s for s in specs if s.kind is not ItemKind.TENSOR], views,
                           tuple(StagedItem(s, offsets[s.key]) for s in tensors), host, by_device)
        return self._plan

    def stage(self, specs: list[ItemSpec], values: Mapping[str | ItemKey, Any], overlap: bool = False,
              watch: Mapping[str, Any] | None = None) -> tuple[StagedSave, Staging]:
        """Copy ``specs``' values (looked up by fqn in ``values``) into host memory.

        Non-tensor values are serialized now, in every mode. Tensors: copied before this
        returns (CPU), or enqueued on side streams that the current streams wait for (CUDA).
        With ``overlap``, the copies proceed after this returns (a thread for CPU tensors, the
        side streams alone for CUDA ones) and the returned :class:`Staging` says when they end.
        ``watch``: objects whose version counters also tell of a change, by fqn (a DTensor's,
        whose local shard is the value staged).
        """
        plan = self._plan_for(specs, values)
        # first, as it may raise (a value that does not pickle): then no copy has started
        others = tuple(StagedItem(s, -1, serialize_bytes(s.fqn, values[s.fqn])) for s in plan.others)
        srcs = [values[k] for k in plan.sources]
        buf = plan.buffer
        rt = self.runtime
        staging = Staging(rt, buf, rt.current_device() if plan.by_device else None, self.timeout)
        if plan.by_device:
            # a failure while enqueueing keeps the lease: copies already queued may still write
            staging.hold(plan, srcs, overlap, watch)
            staging.events = self._copy_device(plan, srcs, overlap)
        elif overlap and srcs:
            staging.hold(plan, srcs, overlap, watch)
            try:
                threading.Thread(target=staging.run, args=(lambda: _copy_pieces(plan, srcs, staging.verify),),
                                 name="solosave-stage", daemon=True).start()
            except BaseException:
                staging._finish()
                raise
        else:
            _copy_cpu(plan.views, srcs)
        if overlap and not staging.immediate:
            STEP_GUARD.add(staging)
            self._overlapped = staging
        return StagedSave(buf.name if buf else None, buf.size if buf else 0, plan.items + others), staging

    def _copy_device(self, plan: _Plan, srcs: list[Any], overlap: bool) -> dict[int, Any]:
        """Per source device: its side stream waits for its current stream, copies its sources,
        records an event; blocking mode: the current stream then waits for that event."""
        rt = self.runtime
        events: dict[int, Any] = {}
        with torch.no_grad():
            for k in plan.host:
                plan.views[k].copy_(srcs[k] if srcs[k].is_cpu else srcs[k].cpu())
            for device, positions in plan.by_device.items():
                side = self._streams.get(device)
                if side is None:
                    side = self._streams[device] = rt.new_stream(device)
                current = rt.current_stream(device)
                side.wait_stream(current)
                with rt.use_stream(side):
                    for k in positions:
                        src = srcs[k]
                        if src.is_conj() or src.is_neg():  # resolved on the side stream, then copied
                            src = src.resolve_conj().resolve_neg()
                        rt.copy(plan.views[k], src)
                        if overlap:
                            rt.record_stream(srcs[k], side)  # its memory is not reused before the copy
                    event = rt.new_event()
                    event.record(side)
                if not overlap:
                    current.wait_event(event)
                events[device] = event
        return events

    def hand_to(self, reader: BufferReader) -> None:
        """Give ``reader`` (in this process) a descriptor of the current buffer (tests, tools)."""
        if self._buffer is not None and self._buffer.fd >= 0:
            reader.adopt(self._buffer.name, os.dup(self._buffer.fd))

    def _drop_buffer(self) -> None:
        if self._buffer is not None:
            self._buffer.close()  # freed now, or when the copies still running into it end
        self._buffer = None
        self._layout = None
        self._offsets = {}
        self._plan = None

    def close(self) -> None:
        """Close the buffer; an overlapped staging still running no longer holds up optimizer
        steps (its save is abandoned)."""
        if self._overlapped is not None:
            STEP_GUARD.discard(self._overlapped)
            self._overlapped = None
        self._drop_buffer()


def _copy_cpu(views: list[torch.Tensor], srcs: list[Any]) -> None:
    if not srcs:
        return
    with torch.no_grad():
        if _foreach_copy is not None and all(s.is_cpu for s in srcs):
            _foreach_copy(views, srcs)
            return
        for dst, src in zip(views, srcs):
            dst.copy_(src if src.is_cpu else src.cpu())


_foreach_copy = getattr(torch, "_foreach_copy_", None)


def _copy_pieces(plan: _Plan, srcs: list[Any], verify: Any) -> None:
    """The overlapped CPU copy (staging thread): pieces of at most :data:`PIECE_BYTES`, each
    after ``verify(i, j)`` checked that sources ``i..j-1`` are unchanged (it raises otherwise)."""
    views = plan.views
    sizes = [s.nbytes for s in plan.tensors]
    i, n = 0, len(srcs)
    while i < n:
        j, size = i + 1, sizes[i]
        while j < n and size + sizes[j] <= PIECE_BYTES:
            size += sizes[j]
            j += 1
        if j == i + 1 and size > PIECE_BYTES and views[i].is_contiguous() and srcs[i].is_contiguous():
            step = max(PIECE_BYTES // views[i].element_size(), 1)
            flat = views[i].view(-1)
            for a in range(0, flat.numel(), step):
                verify(i, j)
                _read_piece(flat[a:a + step], srcs[i].view(-1)[a:a + step])
        else:
            verify(i, j)
            for k in range(i, j):
                _read_piece(views[k], srcs[k])
        i = j


def _read_piece(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy CPU tensor ``src`` into ``dst`` (contiguous, of the staging buffer) through
    :func:`read_own_memory`: a source freed meanwhile fails the staging instead of crashing it.
    A strided source (a view) is read whole (the bytes it reaches) into a bounce buffer first."""
    if src.numel() == 0:
        return
    if src.is_conj() or src.is_neg() or not src.is_cpu:  # lazy views that torch resolves while copying
        _copy_cpu([dst], [src])
        return
    extent = _extent(src) - src.storage_offset() * src.element_size()
    if src.is_contiguous():
        done = read_own_memory(dst.data_ptr(), src.data_ptr(), src.nbytes)
    elif extent > 4 * src.nbytes:  # a thin view of a large base: not worth reading the base whole
        done = None
    else:
        bounce = torch.empty(extent, dtype=torch.uint8)
        done = read_own_memory(bounce.data_ptr(), src.data_ptr(), bounce.nbytes)
        if done:
            with torch.no_grad():
                dst.copy_(bounce.view(src.dtype).as_strided(src.shape, src.stride()))
    if done is None:
        _copy_cpu([dst], [src])
    elif not done:
        raise StagingRaceError("a saved tensor's memory was freed while it was being staged, so the checkpoint "
                               "would hold lost values; call handle.wait_staged() before resizing or freeing "
                               "saved tensors (or their bases)")


def _extent(t: torch.Tensor) -> int:
    """Bytes of its storage that ``t`` reaches."""
    if t.numel() == 0:
        return 0
    last = sum((int(n) - 1) * s for n, s in zip(t.shape, t.stride()))
    return (int(t.storage_offset()) + last + 1) * t.element_size()


class Staging:
    """When a save's tensors are staged (trainer side).

    Blocking staging: done when ``stage()`` returns (CPU), or when ``events`` (CUDA, one per
    source device) complete. Overlapped staging: the copies run on after ``stage()``;
    :meth:`wait` (``handle.wait_staged()``) blocks until they are done (CPU) or makes the current
    streams wait for them (CUDA; nothing blocks); every optimizer step does the same first
    (:meth:`before_step`). A staged tensor changed in place, resized, or whose storage was freed
    or replaced before its copy would be saved wrong (or read after it was freed): the staging
    fails instead (``error``, a :class:`StagingRaceError`).

    Who calls what: ``hold``, ``wait``, ``before_step`` the training thread; ``run`` the staging
    thread (CPU overlap); ``synchronize`` and ``settle`` the checkpointer's submit thread.
    """

    def __init__(self, runtime: DeviceRuntime | None = None, buffer: _Buffer | None = None,
                 device: int | None = None, timeout: float = 600.0) -> None:
        self.runtime = runtime if runtime is not None else CudaRuntime()
        self.buffer = buffer
        self.device = device  # the trainer's device at save() (None: no CUDA source)
        self.timeout = timeout
        self.events: dict[int, Any] = {}
        self.sources: list[Any] = []
        self.error: BaseException | None = None
        self._lease: _Lease | None = None
        self._storages: list[Any] = []
        self._names: list[str] = []
        self._watch: list[tuple[str, Any, int]] = []
        self._ptrs: list[int] = []
        self._lock = threading.Lock()
        self._checked = True
        self._ordered = True
        self._done = threading.Event()
        self._done.set()

    def hold(self, plan: _Plan, sources: list[Any], overlap: bool, watch: Mapping[str, Any] | None) -> None:
        """Before the copies start: a lease on the buffer, and the sources and their storages
        (kept until the copies end); overlap: what :meth:`verify` compares against."""
        if self.buffer is not None:
            self._lease = self.buffer.lease()
        self.sources = sources
        self._storages = [t.untyped_storage() for t in sources]
        self._done.clear()
        if overlap:
            self._checked = self._ordered = False
            self._names = [s.fqn for s in plan.tensors]
            self._ptrs = [t.data_ptr() for t in sources]
            self._watch = [(n, t, t._version) for n, t in zip(self._names, sources)]
            if watch:
                self._watch += [(s.fqn, watch[s.fqn], watch[s.fqn]._version) for s in plan.tensors if s.fqn in watch]

    # -- checks --------------------------------------------------------------------------------
    def _changed(self, i: int, j: int) -> str | None:
        for k in range(i, j):
            t, st = self.sources[k], self._storages[k]
            try:
                same = t.untyped_storage().data_ptr() == st.data_ptr() and t.data_ptr() == self._ptrs[k]
                same = same and st.nbytes() >= _extent(t)
            except RuntimeError:  # e.g. its data is no longer allocated
                same = False
            if not same:
                return (f"state_dict[{self._names[k]!r}] was resized, or its storage freed or replaced, "
                        "before its staging completed")
        return None

    def verify(self, i: int, j: int) -> None:
        """Staging thread, before copying sources ``i..j-1``: raise if one changed (its bytes are
        then never read)."""
        why = self._changed(i, j) or next((f"state_dict[{n!r}] was changed in place before its staging "
                                           "completed" for n, t, v in self._watch[i:j] if t._version != v), None)
        if why is not None:
            raise self._race(why)

    def _race(self, why: str) -> StagingRaceError:
        return StagingRaceError(f"{why}, so the checkpoint would hold later values; call "
                                "handle.wait_staged() before changing saved tensors (or use the default "
                                "blocking staging)")

    def _check_once(self) -> None:
        """Record, the first time only, whether a staged tensor changed since ``save()``
        (overlap mode): at the first of the copies' end, ``wait_staged()`` and an optimizer
        step, after which changes can no longer reach the copies."""
        with self._lock:
            if self._checked:
                return
            self._checked = True
            why = self._changed(0, len(self.sources)) if self._ptrs else None
            if why is None:
                why = next((f"state_dict[{n!r}] was changed in place before its staging completed"
                            for n, t, v in self._watch if t._version != v), None)
            if why is not None and self.error is None:
                self.error = self._race(why)

    def check(self) -> None:
        """:meth:`_check_once`, then raise the staging's error, if any."""
        self._check_once()
        if self.error is not None:
            raise self.error

    # -- the staging thread (CPU overlap) ------------------------------------------------------
    def run(self, copy: Any) -> None:
        """Run ``copy``, check, and mark done (the buffer and the sources are let go)."""
        try:
            copy()
            self.check()
        except BaseException as e:  # noqa: BLE001 - reported by the save's handle
            if self.error is None:
                self.error = e
        finally:
            self._finish()

    def _finish(self) -> None:
        """The copies have ended: let go of the buffer and the sources."""
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        self.sources, self._storages = [], []
        STEP_GUARD.discard(self)
        self._done.set()

    # -- the training thread -------------------------------------------------------------------
    def _order(self) -> None:
        """Make each source device's current stream wait for its copies (once)."""
        with self._lock:
            if self._ordered:
                return
            self._ordered = True
        for device, event in self.events.items():
            self.runtime.current_stream(device).wait_event(event)

    def wait(self, timeout: float) -> None:
        """Overlap mode: block until the CPU copies are done (bounded), or order the current
        CUDA streams after the copies; raise the staging's error, if any."""
        if self.events:
            self._order()
            self.check()
        elif not self._done.wait(timeout):
            raise SaveTimeoutError(f"staging did not finish within {timeout:g} s")
        STEP_GUARD.discard(self)
        if self.error is not None:
            raise self.error

    def before_step(self) -> None:
        """An optimizer is about to step (training thread): its in-place writes must come after
        the copies. CUDA: the current streams wait for them; CPU: wait until they are done (at
        most ``timeout``, then the save fails instead of holding later values). Never raises."""
        if self.events:
            self._order()
            self._check_once()  # the step's own writes come after the copies: not a race
        elif not self._done.wait(self.timeout):
            with self._lock:
                if self.error is None:
                    self.error = StagingRaceError(
                        f"optimizer.step() ran while this save's staging copies were still running "
                        f"after {self.timeout:g} s, so the checkpoint would hold later values")
        STEP_GUARD.discard(self)

    # -- the submit thread ---------------------------------------------------------------------
    def _events_done(self, pending: dict[int, Any]) -> bool:
        for device in list(pending):
            with self.runtime.use_device(device):
                if not pending[device].query():
                    return False
            del pending[device]
        return True

    def synchronize(self, timeout: float = 600.0) -> None:
        """Wait (at most ``timeout`` seconds) until the copies are done, then check them. On a
        timeout the copies keep their buffer (see :meth:`settle`)."""
        deadline = time.monotonic() + timeout
        if self.events:
            self.runtime.set_device(self.device if self.device is not None else min(self.events))
            pending = dict(self.events)
            while not self._events_done(pending):  # polled, so that the wait is bounded
                if time.monotonic() > deadline:
                    raise SaveTimeoutError(f"the staging copies did not finish within {timeout:g} s")
                time.sleep(0.0005)
            try:
                self.check()
            finally:
                self._finish()
        elif not self._done.wait(timeout):
            raise SaveTimeoutError(f"the staging copies did not finish within {timeout:g} s")
        if self.error is not None:
            raise self.error

    def settle(self, limit: float) -> None:
        """After a timed-out :meth:`synchronize`: wait (at most ``limit`` seconds more) for the
        CUDA copies to end and let go of their buffer; past that it stays mapped for good. CPU
        copies need nothing: their thread lets go when it ends."""
        if self.events and not self._done.is_set():
            pending = dict(self.events)
            deadline = time.monotonic() + limit
            while not self._events_done(pending):
                if time.monotonic() > deadline:
                    return
                time.sleep(0.01)
            self._finish()

    def handoff(self) -> tuple[str, int] | None:
        """The buffer's ``(name, descriptor)`` if the worker has not been given it yet."""
        return self.buffer.take_handoff() if self.buffer is not None else None

    @property
    def immediate(self) -> bool:
        """Nothing to wait for: the copies are done and checked."""
        return not self.events and self._done.is_set() and self.error is None and self._checked


class _StepGuard:
    """The overlapped stagings whose copies an optimizer step must not overtake.

    One global optimizer step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``:
    torch's registry is process-wide, so this list is too) calls :meth:`Staging.before_step` of
    each pending staging. It is registered at the first overlapped staging and never removed:
    torch iterates its hooks while they run, and removing one then (from a checkpointer's
    close, or its garbage collection) would break the step that iterates; with nothing pending
    the hook returns at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[Staging] = []
        self._registered = False

    def add(self, staging: Staging) -> None:
        with self._lock:
            if not self._registered:
                from torch.optim.optimizer import register_optimizer_step_pre_hook

                register_optimizer_step_pre_hook(self._before_step)
                self._registered = True
            self._pending.append(staging)

    def discard(self, staging: Staging) -> None:
        with self._lock:
            if staging in self._pending:
                self._pending.remove(staging)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        with self._lock:
            pending = list(self._pending)
        for staging in pending:
            staging.before_step()


#: The process's optimizer step guard (see :class:`_StepGuard`).
STEP_GUARD = _StepGuard()
