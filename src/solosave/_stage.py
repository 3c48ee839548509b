"""Step 2 of a save: staging (calling thread, every rank, no collective).

Values are copied into host memory owned by solosave before ``save()`` returns, so the caller
may change its tensors right away (snapshot semantics). Tensors go into **one shared-memory
segment per staging layout** (the list of items this rank stages, with their sizes), allocated
once and reused by every save of the same structure; each tensor is a view at an aligned offset,
so the worker process needs one segment, not one file descriptor per tensor. Non-tensor values
are serialized with ``torch.save`` and travel inside the job message.

CUDA tensors: the segment is registered as pinned memory (``cudaHostRegister``), the copies run
on a side stream that first waits for the current stream, and the current stream then waits for
the copies' event, so later kernels (the next optimizer step) cannot overwrite a tensor before it
is copied; the background dispatcher synchronizes the event before the worker reads the buffer.

Owner: :class:`Stager` lives in the trainer process; :func:`attach_segment` is its worker-side
counterpart.
"""

from __future__ import annotations

import gc
import os
import sys
import uuid
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import torch

from ._plan import ItemKind, ItemSpec, dtype_from_name, serialize_bytes

#: Alignment of every tensor inside a staging segment (bytes).
ALIGN = 64
#: Prefix of every shared-memory segment solosave creates (``/dev/shm/<prefix>...`` on Linux).
SEGMENT_PREFIX = "solosave_"


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True, slots=True)
class StagedItem:
    """One staged item as the worker sees it: the spec plus where its bytes are."""

    spec: ItemSpec
    #: Offset in the segment (tensors) or ``-1`` (BYTES items).
    offset: int = -1
    #: Serialized payload of a BYTES item; ``None`` for tensors.
    payload: bytes | None = None


@dataclass(frozen=True, slots=True)
class StagedSave:
    """What ``save()`` hands to the background: the staged items and their segment."""

    segment: str | None
    segment_size: int
    items: tuple[StagedItem, ...]
    #: CUDA event to synchronize before the segment may be read (``None`` on CPU).
    cuda_event: Any = None


class _Segment:
    def __init__(self, size: int, pinned: bool) -> None:
        self.size = max(size, 1)
        self.shm = shared_memory.SharedMemory(
            create=True, size=self.size, name=f"{SEGMENT_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:12]}")
        self.base = torch.frombuffer(self.shm.buf, dtype=torch.uint8, count=self.size)
        self.pinned = False
        if pinned:
            cudart = torch.cuda.cudart()
            rc = cudart.cudaHostRegister(self.base.data_ptr(), self.size, 0)
            if int(rc) != 0:
                raise RuntimeError(f"cudaHostRegister of the staging segment failed (code {rc})")
            self.pinned = True

    def view(self, offset: int, spec: ItemSpec) -> torch.Tensor:
        dtype = dtype_from_name(spec.dtype or "")
        if spec.nbytes == 0:
            return torch.empty(spec.sizes or (), dtype=dtype)
        return self.base[offset:offset + spec.nbytes].view(dtype).view(spec.sizes or ())

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.base.data_ptr())
            self.pinned = False
        self.base = None  # type: ignore[assignment]
        _close_shm(self.shm, unlink=True)


def _close_shm(shm: shared_memory.SharedMemory, unlink: bool) -> None:
    try:
        shm.close()
    except BufferError:  # views still alive somewhere: collect them, then retry
        gc.collect()
        try:
            shm.close()
        except BufferError:
            pass
    if unlink:
        try:
            shm.unlink()
        except FileNotFoundError:
            pass


class Stager:
    """Copies the items a rank writes into reusable host buffers (trainer side).

    ``stage()`` is called from the calling thread only, one save at a time (the checkpointer
    guarantees that the previous save's worker no longer reads the buffer). Keeps the segment of
    the most recent staging layout; a new structure allocates a new segment and frees the old
    one. ``close()`` unlinks every segment.
    """

    def __init__(self) -> None:
        self._layout: tuple | None = None
        self._offsets: dict = {}
        self._segment: _Segment | None = None
        self._side_stream: Any = None

    def _ensure(self, tensors: list[ItemSpec], pinned: bool) -> _Segment | None:
        layout = tuple((s.key, s.nbytes, s.dtype, s.sizes) for s in tensors) + (pinned,)
        if layout == self._layout and self._segment is not None:
            return self._segment
        self.close()
        if not tensors:
            self._layout = layout
            return None
        offsets = {}
        pos = 0
        for s in tensors:
            offsets[s.key] = pos
            pos += _align(s.nbytes)
        self._segment = _Segment(pos, pinned)
        self._offsets = offsets
        self._layout = layout
        return self._segment

    def stage(self, specs: list[ItemSpec], values: dict[str, Any]) -> StagedSave:
        """Copy ``specs``' values (looked up by fqn in ``values``) into host memory."""
        tensors = [s for s in specs if s.kind is ItemKind.TENSOR]
        on_cuda = any(values[s.fqn].is_cuda for s in tensors)
        seg = self._ensure(tensors, pinned=on_cuda)
        items: list[StagedItem] = []
        event = None
        if on_cuda:
            event = self._copy_cuda(seg, tensors, values)
        for s in specs:
            if s.kind is ItemKind.BYTES:
                items.append(StagedItem(s, -1, serialize_bytes(s.fqn, values[s.fqn])))
                continue
            assert seg is not None  # noqa: S101 - tensors imply a segment
            off = self._offsets[s.key]
            if not on_cuda:
                src = values[s.fqn]
                if src.device.type != "cpu":
                    src = src.cpu()
                seg.view(off, s).copy_(src)
            items.append(StagedItem(s, off))
        return StagedSave(seg.shm.name if seg else None, seg.size if seg else 0, tuple(items), event)

    def _copy_cuda(self, seg: _Segment | None, tensors: list[ItemSpec], values: dict[str, Any]) -> Any:
        assert seg is not None  # noqa: S101
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream()
        current = torch.cuda.current_stream()
        self._side_stream.wait_stream(current)
        with torch.cuda.stream(self._side_stream):
            for s in tensors:
                src = values[s.fqn]
                seg.view(self._offsets[s.key], s).copy_(src, non_blocking=src.is_cuda)
            event = torch.cuda.Event()
            event.record(self._side_stream)
        current.wait_event(event)
        return event

    def close(self) -> None:
        if self._segment is not None:
            self._segment.close()
        self._segment = None
        self._layout = None
        self._offsets = {}


class SegmentReader:
    """Worker-side view of the trainer's segments (attach once, keep while it is current)."""

    def __init__(self) -> None:
        self._name: str | None = None
        self._shm: shared_memory.SharedMemory | None = None
        self._base: torch.Tensor | None = None

    def tensor(self, staged: StagedSave, item: StagedItem) -> torch.Tensor:
        """A tensor over exactly this item's bytes (its storage is the item, nothing more)."""
        spec = item.spec
        dtype = dtype_from_name(spec.dtype or "")
        if spec.nbytes == 0:
            return torch.empty(spec.sizes or (), dtype=dtype)
        if staged.segment != self._name:
            self.close()
            self._shm = _attach(staged.segment or "")
            self._name = staged.segment
        assert self._shm is not None  # noqa: S101
        flat = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=spec.nbytes, offset=item.offset)
        return flat.view(dtype).view(spec.sizes or ())

    def close(self) -> None:
        if self._shm is not None:
            _close_shm(self._shm, unlink=False)
        self._shm = None
        self._name = None


def _attach(name: str) -> shared_memory.SharedMemory:
    """Attach to a trainer's segment without taking ownership: the trainer (or, if it dies, its
    resource tracker) unlinks it. The worker is its own interpreter with its own tracker, which
    must not unlink - or warn about - segments it merely reads."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, create=False, track=False)
    shm = shared_memory.SharedMemory(name=name, create=False)
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm
