"""What staging needs from the accelerator runtime, as one small protocol (trainer side only).

:class:`DeviceRuntime` is the seam between staging (``staging/staging.py``, ``staging/buffer.py``)
and ``torch.cuda``: which tensors live on a device, streams and events, the copy itself, and
the host-memory registration of ``cudart``. :class:`CudaRuntime` is the real one, used by
default; tests pass a recording fake (``_src/testing/fake_device.py``) to check on a machine
without a GPU which stream each copy is issued on, which events are recorded and waited for,
and in which thread and order the buffer is registered and unregistered.

Nothing here is ever called in the worker process: no CUDA object reaches it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

#: ``cudaHostRegisterPortable``: the registered memory counts as pinned in every CUDA context,
#: not only the current device's (DCP's ``_pin_memory_utils`` passes the same flag).
HOST_REGISTER_PORTABLE = 1


class DeviceRuntime(Protocol):
    """The accelerator operations staging uses (every method called from the trainer process)."""

    def device_of(self, t: torch.Tensor) -> int | None:
        """The device index of ``t``, or ``None`` for a host tensor."""

    def current_device(self) -> int:
        """The calling thread's current device."""

    def set_device(self, index: int) -> None:
        """Make ``index`` the calling thread's current device (a new thread starts on device 0)."""

    def current_stream(self, index: int) -> Any:
        """The current stream of device ``index`` (``wait_stream``, ``wait_event``)."""

    def new_stream(self, index: int) -> Any:
        """A new stream on device ``index``."""

    def new_event(self) -> Any:
        """A new event (``record(stream)``, ``query()``)."""

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]:
        """A context in which ``stream`` is current on its device (and its device is current)."""

    def use_device(self, index: int) -> AbstractContextManager[Any]:
        """A context in which device ``index`` is current."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)``, asynchronous on the current stream of ``src``'s device."""

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        """Mark ``t``'s memory as in use by ``stream`` (not reused before its work is done)."""

    def host_register(self, ptr: int, size: int, flags: int) -> int:
        """``cudaHostRegister``; returns the CUDA error code (0: success)."""

    def host_unregister(self, ptr: int) -> int:
        """``cudaHostUnregister``; returns the CUDA error code (0: success)."""


class CudaRuntime:
    """:class:`DeviceRuntime` over ``torch.cuda`` (the default)."""

    def device_of(self, t: torch.Tensor) -> int | None:
        return t.device.index if t.is_cuda else None

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)

    def current_stream(self, index: int) -> Any:
        return torch.cuda.current_stream(index)

    def new_stream(self, index: int) -> Any:
        return torch.cuda.Stream(device=index)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def use_device(self, index: int) -> AbstractContextManager[Any]:
        return torch.cuda.device(index)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)

    def host_register(self, ptr: int, size: int, flags: int) -> int:
        return int(torch.cuda.cudart().cudaHostRegister(ptr, size, flags))

    def host_unregister(self, ptr: int) -> int:
        return int(torch.cuda.cudart().cudaHostUnregister(ptr))
