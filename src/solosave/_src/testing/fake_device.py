"""A recording stand-in for the CUDA runtime (``staging/device.py``'s ``DeviceRuntime``), for tests
of the staging's device paths on a machine without a GPU.

CPU tensors play the device tensors: :meth:`FakeRuntime.place` says on which device index a
tensor "lives". Streams and events are plain objects; every call is appended to ``log`` as a
tuple naming the thread it was made in, so that a test can check the order of the calls, the
stream each copy was issued on and which thread set which device. Events complete only when the
test says so (:meth:`FakeRuntime.complete`), unless ``auto_complete``.

Two behaviours of the real runtime are modelled because staging must cope with them:

* ``cudaHostRegister`` can fail (``register_error``); like CUDA's, the fake then keeps the error
  as the *calling thread's* last error (``last_error``), which CUDA reports at that thread's
  next kernel launch;
* an asynchronous device-to-host copy of a tensor with its conjugate or negative bit set is
  fixed up on the host before the bytes land (torch's copy), so the fake's :meth:`copy` refuses
  such a source: staging must resolve those bits first.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch


def _thread() -> str:
    return threading.current_thread().name


class FakeStream:
    def __init__(self, rt: FakeRuntime, name: str, device: int) -> None:
        self.rt, self.name, self.device = rt, name, device

    def wait_stream(self, other: FakeStream) -> None:
        self.rt.log.append(("wait_stream", self.name, other.name, _thread()))

    def wait_event(self, event: FakeEvent) -> None:
        self.rt.log.append(("wait_event", self.name, event.name, _thread()))

    def __repr__(self) -> str:
        return self.name


class FakeEvent:
    def __init__(self, rt: FakeRuntime, name: str) -> None:
        self.rt, self.name = rt, name
        self.stream: FakeStream | None = None
        self.done = rt.auto_complete

    def record(self, stream: FakeStream) -> None:
        self.stream = stream
        self.rt.log.append(("record", self.name, stream.name, _thread()))

    def query(self) -> bool:
        self.rt.log.append(("query", self.name, self.done, _thread()))
        return self.done


class FakeRuntime:
    """See the module docstring. ``current`` is the current device of every thread that did not
    call :meth:`set_device` (a new CUDA thread starts on device 0)."""

    def __init__(self, current: int = 0, auto_complete: bool = True, register_error: int = 0) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.auto_complete = auto_complete
        self.register_error = register_error
        self._default = current
        self._tls = threading.local()
        self._placed: dict[int, int] = {}
        self._current_streams: dict[int, FakeStream] = {}
        self.events: list[FakeEvent] = []
        self.streams: list[FakeStream] = []
        self.last_error: dict[str, int] = {}  # thread name -> its sticky error code
        self.registered: set[int] = set()

    # -- the test's side ---------------------------------------------------------------------
    def place(self, t: torch.Tensor, device: int) -> torch.Tensor:
        self._placed[id(t)] = device
        return t

    def complete(self) -> None:
        for e in self.events:
            e.done = True

    def calls(self, kind: str) -> list[tuple[Any, ...]]:
        return [c for c in self.log if c[0] == kind]

    # -- DeviceRuntime ---------------------------------------------------------------------------
    def device_of(self, t: torch.Tensor) -> int | None:
        return self._placed.get(id(t))

    def current_device(self) -> int:
        return getattr(self._tls, "device", self._default)

    def set_device(self, index: int) -> None:
        self._tls.device = index
        self.log.append(("set_device", index, _thread()))

    def current_stream(self, index: int) -> FakeStream:
        if index not in self._current_streams:
            self._current_streams[index] = FakeStream(self, f"current{index}", index)
        s = getattr(self._tls, "stream", None)
        return s if s is not None and s.device == index else self._current_streams[index]

    def new_stream(self, index: int) -> FakeStream:
        s = FakeStream(self, f"side{index}.{len(self.streams)}", index)
        self.streams.append(s)
        self.log.append(("new_stream", s.name, _thread()))
        return s

    def new_event(self) -> FakeEvent:
        e = FakeEvent(self, f"event{len(self.events)}")
        self.events.append(e)
        return e

    @contextlib.contextmanager
    def use_stream(self, stream: FakeStream) -> Iterator[None]:
        prev_stream = getattr(self._tls, "stream", None)
        with self.use_device(stream.device):
            self._tls.stream = stream
            try:
                yield
            finally:
                self._tls.stream = prev_stream

    @contextlib.contextmanager
    def use_device(self, index: int) -> Iterator[None]:
        prev = self.current_device()
        self._tls.device = index
        try:
            yield
        finally:
            self._tls.device = prev

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if src.is_conj() or src.is_neg():
            raise AssertionError("an asynchronous copy of a tensor with its conj/neg bit set: "
                                 "torch would fix it up on the host before the bytes land")
        device = self.device_of(src)
        # torch runs a device-to-host copy on the current stream of the *source's* device
        stream = self.current_stream(device) if device is not None else None
        self.log.append(("copy", device, getattr(stream, "name", None), _thread()))
        dst.copy_(src)

    def record_stream(self, t: torch.Tensor, stream: FakeStream) -> None:
        self.log.append(("record_stream", self.device_of(t), stream.name, _thread()))

    def host_register(self, ptr: int, size: int, flags: int) -> int:
        self.log.append(("host_register", flags, self.current_device(), _thread()))
        if self.register_error:
            self.last_error[_thread()] = self.register_error
            return self.register_error
        self.registered.add(ptr)
        return 0

    def host_unregister(self, ptr: int) -> int:
        self.log.append(("host_unregister", self.current_device(), _thread()))
        if ptr not in self.registered:
            self.last_error[_thread()] = 713  # cudaErrorHostMemoryNotRegistered
            return 713
        self.registered.discard(ptr)
        return 0
