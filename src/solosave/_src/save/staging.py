"""Step 2 of a save: staging (calling thread, every rank, no collective).

Values are copied into host memory owned by solosave before ``save()`` returns, so the caller
may change its tensors right away (snapshot semantics). Tensors go into **one staging buffer per
staging layout** (the list of items this rank stages, with their sizes), allocated once and
reused by every save of the same structure; each tensor is a view at an aligned offset, so the
worker process maps one buffer, not one file descriptor per tensor. Non-tensor values are
serialized with ``torch.save`` and travel inside the job message.

The buffer (``save/buffer.py``) is shared memory that the worker maps.

CUDA tensors: the buffer is registered as pinned memory (``cudaHostRegister``; if that fails the
copies still work, unpinned), the copies run on a side stream that first waits for the current
stream, and the current stream then waits for the copies' event, so later kernels (the next
optimizer step) cannot overwrite a tensor before it is copied. The event stays in the trainer
process: the checkpointer waits for it in a background thread before the job goes to the worker,
so the worker never initialises CUDA.

Owner: :class:`Stager` and :class:`Staging` live in the trainer process; the worker reads the
buffer through ``_buffer.BufferReader``.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from solosave._src.coordination.protocol import ItemKind, ItemSpec, StagedItem, StagedSave
from solosave._src.core.errors import SaveTimeoutError, StagingRaceError
from solosave._src.plan.local_plan import serialize_bytes, value_key
from solosave._src.save.buffer import STAGING_DIR_ENV, _Buffer

#: Alignment of every tensor inside a staging buffer (bytes).
ALIGN = 64


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(slots=True)
class _Plan:
    """How one list of specs is staged: computed once per list (the structure cache hands the
    same list to every save of an unchanged structure)."""

    specs: list[ItemSpec]
    on_cuda: bool
    all_cpu: bool
    tensors: list[ItemSpec]
    #: Where the plan's values hold each of ``tensors`` (``plan/local_plan.value_key``).
    sources: list[Any]
    others: list[ItemSpec]
    views: list[torch.Tensor]
    items: tuple[StagedItem, ...]


class Stager:
    """Copies the items a rank writes into reusable host buffers (trainer side).

    ``stage()`` is called from the calling thread only, one save at a time (the checkpointer
    guarantees that the previous save's worker no longer reads the buffer). Keeps the buffer of
    the most recent staging layout; a new structure allocates a new buffer and frees the old
    one. ``close()`` unlinks every buffer. ``staging_dir``: file-backed buffers in this
    directory instead of shared memory (default: ``$SOLOSAVE_STAGING_DIR`` if set).
    """

    def __init__(self, staging_dir: str | None = None) -> None:
        self.staging_dir = staging_dir or os.environ.get(STAGING_DIR_ENV) or None
        self._layout: tuple | None = None
        self._offsets: dict = {}
        self._buffer: _Buffer | None = None
        self._plan: _Plan | None = None
        self._side_stream: Any = None

    def _ensure(self, tensors: list[ItemSpec], pinned: bool) -> _Buffer | None:
        layout = tuple((s.key, s.nbytes, s.dtype, s.sizes) for s in tensors) + (pinned,)
        if layout == self._layout and self._buffer is not None:
            return self._buffer
        self.close()
        if not tensors:
            self._layout = layout
            return None
        offsets, pos = {}, 0
        for s in tensors:
            offsets[s.key] = pos
            pos += _align(s.nbytes)
        buf = _Buffer(pos, self.staging_dir)
        if pinned:
            buf.pin()
        self._buffer, self._offsets, self._layout = buf, offsets, layout
        return buf

    def _plan_for(self, specs: list[ItemSpec], values: dict[str, Any]) -> _Plan:
        p = self._plan
        if p is not None and p.specs is specs and (self._buffer is not None or not p.tensors):
            return p
        tensors = [s for s in specs if s.kind is ItemKind.TENSOR]
        sources = [value_key(s, values) for s in tensors]
        devices = {values[k].device.type for k in sources}
        buf = self._ensure(tensors, pinned="cuda" in devices)
        offsets = self._offsets
        views = [buf.view(offsets[s.key], s) for s in tensors] if buf is not None else []
        self._plan = _Plan(specs, "cuda" in devices, devices <= {"cpu"}, tensors, sources,
                           [s for s in specs if s.kind is not ItemKind.TENSOR], views,
                           tuple(StagedItem(s, offsets[s.key]) for s in tensors))
        return self._plan

    def stage(self, specs: list[ItemSpec], values: dict[str, Any], overlap: bool = False
              ) -> tuple[StagedSave, Staging]:
        """Copy ``specs``' values (looked up by fqn in ``values``) into host memory.

        Non-tensor values are serialized now, in every mode. Tensors: copied before this
        returns (CPU), or enqueued on a side stream that the current stream waits for (CUDA).
        With ``overlap``, the copies proceed after this returns (a thread for CPU tensors, the
        side stream alone for CUDA ones) and the returned :class:`Staging` says when they end.
        """
        plan = self._plan_for(specs, values)
        srcs = [values[k] for k in plan.sources]
        buf = self._buffer
        staging = Staging(srcs if overlap else [])
        if plan.on_cuda:
            staging.event = self._copy_cuda(plan, srcs, overlap)
        elif overlap and srcs:
            threading.Thread(target=staging.run, args=(lambda: _copy_cpu(plan, srcs),),
                             name="solosave-stage", daemon=True).start()
        else:
            _copy_cpu(plan, srcs)
        items = plan.items + tuple(StagedItem(s, -1, serialize_bytes(s.fqn, values[s.fqn])) for s in plan.others)
        return StagedSave(buf.name if buf else None, buf.size if buf else 0, items), staging

    def _copy_cuda(self, plan: _Plan, srcs: list[Any], overlap: bool) -> Any:
        if not srcs:
            return None
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream()
        current = torch.cuda.current_stream()
        self._side_stream.wait_stream(current)
        with torch.cuda.stream(self._side_stream), torch.no_grad():
            for dst, src in zip(plan.views, srcs):
                dst.copy_(src, non_blocking=src.is_cuda)
                if overlap and src.is_cuda:
                    src.record_stream(self._side_stream)  # its memory is not reused before the copy
            event = torch.cuda.Event()
            event.record(self._side_stream)
        if not overlap:
            current.wait_event(event)
        return event

    def buffer_delivered(self) -> None:
        """The worker has mapped the current buffer (a save using it finished)."""
        if self._buffer is not None:
            self._buffer.forget_path()

    def close(self) -> None:
        if self._buffer is not None:
            self._buffer.close()
        self._buffer = None
        self._layout = None
        self._offsets = {}
        self._plan = None


def _copy_cpu(plan: _Plan, srcs: list[Any]) -> None:
    if not srcs:
        return
    with torch.no_grad():
        if plan.all_cpu and _foreach_copy is not None:
            _foreach_copy(plan.views, srcs)
            return
        for dst, src in zip(plan.views, srcs):
            dst.copy_(src if src.device.type == "cpu" else src.cpu())


_foreach_copy = getattr(torch, "_foreach_copy_", None)


class Staging:
    """When a save's tensors are staged (trainer side).

    Blocking staging: done when ``stage()`` returns (CPU), or when ``event`` (CUDA) completes.
    Overlapped staging: the copies run on after ``stage()``; :meth:`wait` blocks until they are
    done (CPU) or makes the current CUDA stream wait for them (nothing blocks), and checks that
    no staged tensor was changed in place before that (its version counter): such a save would
    hold later values, so it fails instead (``error``).
    """

    def __init__(self, sources: list[Any]) -> None:
        self.event: Any = None
        self.sources = sources
        self._versions = [t._version for t in sources]
        self._done = threading.Event()
        if not sources:
            self._done.set()
        self.error: BaseException | None = None
        self._checked = False

    def run(self, copy: Any) -> None:
        """CPU overlap: run ``copy`` (in the staging thread), check, and mark done."""
        try:
            copy()
            self.check()
        except BaseException as e:  # noqa: BLE001 - reported by the save's handle
            self.error = e
        finally:
            self._done.set()

    def check(self) -> None:
        """Raise if a staged tensor changed in place since ``save()`` (overlap mode only)."""
        if not self._checked:
            self._checked = True
            if any(t._version != v for t, v in zip(self.sources, self._versions)):
                self.error = StagingRaceError(
                    "a tensor of this save was changed in place before its staging completed, so "
                    "the checkpoint would hold later values; call handle.wait_staged() before "
                    "optimizer.step() (or use the default blocking staging)")
            self.sources = []
        if self.error is not None:
            raise self.error

    def wait(self, timeout: float) -> None:
        """Overlap mode: block until the CPU copies are done (bounded), or order the current
        CUDA stream after the copies; raise the staging's error, if any."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
            self.check()
        elif not self._done.wait(timeout):
            raise SaveTimeoutError(f"staging did not finish within {timeout:g} s")
        if self.error is not None:
            raise self.error

    def synchronize(self, timeout: float = 600.0) -> None:
        """Background (submit thread): wait (at most ``timeout`` seconds) until the copies are
        done, then check them."""
        deadline = time.monotonic() + timeout
        if self.event is not None:
            while not self.event.query():  # polled, so that the wait is bounded
                if time.monotonic() > deadline:
                    raise SaveTimeoutError(f"the staging copies did not finish within {timeout:g} s")
                time.sleep(0.0005)
            self.check()
        else:
            if not self._done.wait(timeout):
                raise SaveTimeoutError(f"the staging copies did not finish within {timeout:g} s")
            if self.error is not None:
                raise self.error

    @property
    def immediate(self) -> bool:
        """Nothing to wait for: the copies are done and checked."""
        return self.event is None and self._done.is_set() and self.error is None and not self.sources
