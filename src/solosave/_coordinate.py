"""Step 4 of a save: coordination. **Every collective solosave performs goes through here.**

A :class:`Channel` wraps one process group (a gloo group owned by the background side, or the
user's group for the one-time setup broadcast) and counts each call by kind and payload bytes in
a :class:`CollectiveCounter`, so ``SaveResult`` can report exactly what a save cost and tests can
compare it with what ``torch.distributed`` saw. Objects are pickled here, once, so the payload
counted is the payload sent. Status tensors are 1-element ``int64`` CPU tensors (gloo).

Which ranks call what: every method is collective over the channel's group; all ranks of the
group must call the same methods in the same order (the engine keeps them in lock-step by deciding
the next step from values every rank received).
"""

from __future__ import annotations

import pickle
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class CollectiveCall:
    """One collective: its kind (``torch.distributed`` name), payload bytes this rank sent or
    contributed, the thread it ran in and how long it took."""

    kind: str
    payload_bytes: int
    thread: str
    seconds: float


class CollectiveCounter:
    """An append-only, thread-safe log of collectives (one per channel owner)."""

    def __init__(self) -> None:
        self._calls: list[CollectiveCall] = []
        self._lock = threading.Lock()

    def record(self, call: CollectiveCall) -> None:
        with self._lock:
            self._calls.append(call)

    def mark(self) -> int:
        with self._lock:
            return len(self._calls)

    def since(self, mark: int) -> list[CollectiveCall]:
        with self._lock:
            return list(self._calls[mark:])


def _dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


class Channel:
    """Collectives over ``group`` with rank ``coordinator`` (group rank) as the root."""

    def __init__(self, group: Any, counter: CollectiveCounter | None = None, coordinator: int = 0) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.coordinator = coordinator
        self._root = dist.get_global_rank(group, coordinator) if group is not None else coordinator
        self.counter = counter or CollectiveCounter()

    @property
    def is_coordinator(self) -> bool:
        return self.rank == self.coordinator

    def _record(self, kind: str, nbytes: int, t0: float) -> None:
        self.counter.record(CollectiveCall(kind, nbytes, threading.current_thread().name,
                                           time.perf_counter() - t0))

    def gather_object(self, obj: Any) -> list[Any] | None:
        """Gather ``obj`` from every rank to the coordinator (others get ``None``)."""
        data = _dumps(obj)
        t0 = time.perf_counter()
        out: list[Any] | None = [None] * self.world_size if self.is_coordinator else None
        dist.gather_object(data, out, dst=self._root, group=self.group)
        self._record("gather_object", len(data), t0)
        return [pickle.loads(b) for b in out] if out is not None else None

    def scatter_object(self, objs: list[Any] | None) -> Any:
        """The coordinator sends ``objs[r]`` to rank ``r``; returns this rank's object."""
        datas = [_dumps(o) for o in objs] if self.is_coordinator and objs is not None else None
        sent = sum(len(d) for d in datas) if datas else 0
        t0 = time.perf_counter()
        out: list[Any] = [None]
        dist.scatter_object_list(out, datas, src=self._root, group=self.group)
        self._record("scatter_object_list", sent if self.is_coordinator else len(out[0]), t0)
        return pickle.loads(out[0])

    def broadcast_object(self, obj: Any = None) -> Any:
        """The coordinator's ``obj`` reaches every rank."""
        data = _dumps(obj) if self.is_coordinator else None
        t0 = time.perf_counter()
        box = [data]
        dist.broadcast_object_list(box, src=self._root, group=self.group,
                                   device=torch.device("cpu") if _is_gloo(self.group) else None)
        self._record("broadcast_object_list", len(box[0]), t0)
        return pickle.loads(box[0])

    def all_gather_object(self, obj: Any) -> list[Any]:
        data = _dumps(obj)
        t0 = time.perf_counter()
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, data, group=self.group)
        self._record("all_gather_object", len(data), t0)
        return [pickle.loads(b) for b in out]

    def all_reduce_and(self, value: int) -> int:
        """One ``all_reduce(BAND)`` of one int64 element (8 bytes): the reuse status word."""
        t = torch.tensor([value], dtype=torch.int64)
        t0 = time.perf_counter()
        dist.all_reduce(t, op=dist.ReduceOp.BAND, group=self.group)
        self._record("all_reduce", t.numel() * t.element_size(), t0)
        return int(t.item())


def _is_gloo(group: Any) -> bool:
    try:
        return dist.get_backend(group) == "gloo"
    except Exception:  # noqa: BLE001 - unknown backend: let torch pick the device
        return False


# ---------------------------------------------------------------------------------------------
# Setting up the background channel (once per checkpointer, at construction, every rank)
# ---------------------------------------------------------------------------------------------

def share_store_address(group: Any, counter: CollectiveCounter, timeout_s: float) -> tuple[Any, tuple[str, int, str]]:
    """Group rank 0 serves a fresh ``TCPStore``; its address reaches every rank through one
    ``broadcast_object_list`` on ``group`` (counted). Returns ``(store_or_None, (host, port,
    prefix))``; the store object must live as long as the workers use it (rank 0 keeps it)."""
    import datetime
    import os
    import socket
    import uuid

    ch = Channel(group, counter)
    store = None
    addr = None
    if ch.is_coordinator:
        host = os.environ.get("SOLOSAVE_STORE_HOST") or os.environ.get("MASTER_ADDR") or socket.gethostname()
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        addr = (host, store.port, f"solosave/{uuid.uuid4().hex}/")
    addr = ch.broadcast_object(addr)
    return store, addr


def new_gloo_group(group: Any, counter: CollectiveCounter, timeout_s: float) -> Any:
    """A gloo group over the same ranks as ``group`` (thread mode). Collective over the *world*
    group (``torch.distributed.new_group``'s rule): every rank of the job must call it."""
    import datetime

    t0 = time.perf_counter()
    ranks = dist.get_process_group_ranks(group) if group is not None else None
    g = dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    counter.record(CollectiveCall("new_group", 0, threading.current_thread().name, time.perf_counter() - t0))
    return g
