"""An in-process channel: W threads of one process run the background protocol (tests, the scale simulation)."""

from __future__ import annotations

import collections
import pickle
import threading
import time
from typing import Any

from solosave._src.coordination.channel import Channel, CollectiveCounter, dumps
from solosave._src.core.errors import ChannelError


class _Hub:
    """The meeting point of W :class:`LocalChannel` s: one exchange at a time, in lock-step."""

    def __init__(self, world_size: int, timeout: float) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self._cond = threading.Condition()
        self._round = 0
        self._slots: dict[int, tuple[str, bytes]] = {}
        self._done: dict[int, list[tuple[str, bytes]]] = {}
        self._left: dict[int, int] = {}
        self.broken: str | None = None
        self.receipts: dict[int, str | None] = {}
        #: Point-to-point messages not yet received, per (sender, receiver), in order.
        self._mail: dict[tuple[int, int], collections.deque[bytes]] = {}

    def post(self, seq: int, error: str | None) -> None:
        with self._cond:
            self.receipts[seq] = error
            self._cond.notify_all()

    def wait_for(self, seq: int, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while seq not in self.receipts:
                left = deadline - time.monotonic()
                if self.broken or left <= 0:
                    raise TimeoutError(self.broken or f"no publication receipt for save {seq} in {timeout} s")
                self._cond.wait(min(left, 0.5))
            return self.receipts[seq]

    def exchange(self, rank: int, kind: str, data: bytes) -> list[tuple[str, bytes]]:
        """Every rank deposits ``(kind, data)``; each gets every rank's deposit (rank order)."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            rnd = self._round
            self._slots[rank] = (kind, data)
            if len(self._slots) == self.world_size:
                self._done[rnd], self._slots = [self._slots[r] for r in range(self.world_size)], {}
                self._left[rnd] = self.world_size
                self._round += 1
                self._cond.notify_all()
            while rnd not in self._done:
                left = deadline - time.monotonic()
                if self.broken or left <= 0:
                    self.broken = self.broken or f"rank {rank} waited {self.timeout} s in {kind}"
                    self._cond.notify_all()
                    raise TimeoutError(self.broken)
                self._cond.wait(min(left, 0.5))
            out = self._done[rnd]
            self._left[rnd] -= 1
            if not self._left[rnd]:
                del self._done[rnd], self._left[rnd]
        return out

    def send(self, src: int, dst: int, data: bytes) -> None:
        with self._cond:
            self._mail.setdefault((src, dst), collections.deque()).append(data)
            self._cond.notify_all()

    def recv(self, src: int, dst: int, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._mail.get((src, dst)):
                left = deadline - time.monotonic()
                if self.broken or left <= 0:
                    raise TimeoutError(self.broken or f"rank {dst} received nothing from rank {src} in {timeout} s")
                self._cond.wait(min(left, 0.5))
            return self._mail[(src, dst)].popleft()

    def abort(self, why: str) -> None:
        with self._cond:
            self.broken = why
            self._cond.notify_all()


class LocalChannel(Channel):
    """One rank of an in-process group (see :func:`local_channels`). Payloads are pickled, as
    over a process group, so no object is shared between ranks and the bytes counted match."""

    def __init__(self, hub: _Hub, rank: int) -> None:
        self._hub = hub
        self.rank = rank
        self.world_size = hub.world_size
        self.timeout = hub.timeout
        self.counter = CollectiveCounter()

    def _exchange(self, kind: str, data: bytes) -> list[bytes]:
        t0 = time.perf_counter()
        got = self._run(kind, lambda: self._hub.exchange(self.rank, kind, data))
        if any(k != kind for k, _ in got):
            self._hub.abort(f"ranks called different collectives: {sorted({k for k, _ in got})}")
            raise ChannelError(f"{kind} met {[k for k, _ in got]} on the other ranks")
        self._record(kind, len(data), t0)
        return [d for _, d in got]

    def gather_object(self, obj: Any) -> list[Any] | None:
        got = self._exchange("gather_object", dumps(obj))
        return [pickle.loads(b) for b in got] if self.is_coordinator else None

    def scatter_object(self, objs: list[Any] | None) -> Any:
        data = dumps([dumps(o) for o in objs] if self.is_coordinator and objs is not None else None)
        got = self._exchange("scatter_object_list", data)
        return pickle.loads(pickle.loads(got[self.coordinator])[self.rank])

    def broadcast_object(self, obj: Any = None) -> Any:
        got = self._exchange("broadcast_object_list", dumps(obj) if self.is_coordinator else b"")
        return pickle.loads(got[self.coordinator])

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [pickle.loads(b) for b in self._exchange("all_gather_object", dumps(obj))]

    def all_reduce_and(self, value: int) -> int:
        got = self._exchange("all_reduce", value.to_bytes(8, "little", signed=True))
        out = -1
        for b in got:
            out &= int.from_bytes(b, "little", signed=True)
        return out

    def all_reduce_sum(self, values: list[int]) -> list[int]:
        return [sum(col) for col in zip(*self._ints(values))]

    def all_reduce_max(self, values: list[int]) -> list[int]:
        return [max(col) for col in zip(*self._ints(values))]

    def _ints(self, values: list[int]) -> list[list[int]]:
        got = self._exchange("all_reduce", b"".join(v.to_bytes(8, "little", signed=True) for v in values))
        if len({len(b) for b in got}) != 1:
            raise ChannelError(f"all_reduce met lists of different lengths: {sorted({len(b) // 8 for b in got})}")
        return [[int.from_bytes(b[i:i + 8], "little", signed=True) for i in range(0, len(b), 8)] for b in got]

    def post_receipt(self, seq: int, error: str | None, previous: int | None = None) -> None:
        self._hub.post(seq, error)

    def wait_receipt(self, seq: int, timeout: float) -> str | None:
        return self._run("receipt", lambda: self._hub.wait_for(seq, timeout))

    def exchange(self, dst: int | None, payload: bytes | None, src: int | None, nbytes: int) -> bytes | None:
        t0 = time.perf_counter()
        if payload:
            self._hub.send(self.rank, dst, bytes(payload))  # type: ignore[arg-type]
            self._record("send", len(payload), t0)
        if nbytes <= 0:
            return None
        data = self._run("recv", lambda: self._hub.recv(src, self.rank, self.timeout))  # type: ignore[arg-type]
        if len(data) != nbytes:
            self._hub.abort(f"rank {self.rank} expected {nbytes} bytes from rank {src}, got {len(data)}")
            raise ChannelError(f"recv expected {nbytes} bytes from rank {src}, got {len(data)}")
        self._record("recv", nbytes, t0)
        return data



def local_channels(world_size: int, timeout: float = 30.0) -> list[LocalChannel]:
    """W channels joined in this process: rank ``r`` uses ``channels[r]`` from its own thread.
    A rank that does not show up within ``timeout`` makes every waiting rank raise
    :class:`ChannelError` (as a dead peer does over gloo)."""
    hub = _Hub(world_size, timeout)
    return [LocalChannel(hub, r) for r in range(world_size)]


