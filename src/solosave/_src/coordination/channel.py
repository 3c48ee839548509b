"""Step 4 of a save: coordination. **Every collective solosave performs goes through here.**

A :class:`Channel` is a group of ranks that runs collectives together. Two implementations:

* :class:`DistChannel` wraps one ``torch.distributed`` process group (a gloo group owned by the
  background side, or the user's group for the one-time set-up collectives and the loader);
* :class:`LocalChannel` connects W threads of one process (:func:`local_channels`): the same
  protocol, run in milliseconds, for tests and for the scale simulation.

Both count each call by kind and payload bytes in a :class:`CollectiveCounter`, so
``SaveResult`` reports exactly what a save cost and tests compare it with what
``torch.distributed`` saw. The point-to-point messages of the peer copies
(:meth:`Channel.exchange`, counted as ``send`` / ``recv``) go through here too. Objects are
pickled here, once, so the payload counted is the payload sent. Status words are 1-element
``int64`` CPU tensors (gloo). A collective that fails (a peer died, a timeout) raises
:class:`ChannelError`, and nothing else does: callers tell a broken channel from their own
errors by that type.

Which ranks call what: every method is collective over the channel's group (except
:meth:`Channel.exchange`, between two ranks, and the store's values); all ranks of the
group must call the same methods in the same order (the engine keeps them in lock-step by
deciding the next step from values every rank received).
"""

from __future__ import annotations

import datetime
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from solosave._src.core.errors import ChannelError


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


def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


class Channel:
    """Collectives over a group with group rank ``coordinator`` as the root (see module doc)."""

    rank: int
    world_size: int
    coordinator: int = 0
    counter: CollectiveCounter
    #: Seconds a rank waits for the others (bounds receipts; collectives have their own).
    timeout: float = 600.0

    @property
    def is_coordinator(self) -> bool:
        return self.rank == self.coordinator

    def _record(self, kind: str, nbytes: int, t0: float) -> None:
        self.counter.record(CollectiveCall(kind, nbytes, threading.current_thread().name,
                                           time.perf_counter() - t0))

    def _run(self, kind: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - any failure of a collective breaks the channel
            raise ChannelError(f"{kind} failed: {type(e).__name__}: {e}") from e

    def gather_object(self, obj: Any) -> list[Any] | None:
        """Gather ``obj`` from every rank to the coordinator (others get ``None``)."""
        raise NotImplementedError

    def scatter_object(self, objs: list[Any] | None) -> Any:
        """The coordinator sends ``objs[r]`` to rank ``r``; returns this rank's object."""
        raise NotImplementedError

    def broadcast_object(self, obj: Any = None) -> Any:
        """The coordinator's ``obj`` reaches every rank."""
        raise NotImplementedError

    def all_gather_object(self, obj: Any) -> list[Any]:
        raise NotImplementedError

    def all_reduce_and(self, value: int) -> int:
        """One ``all_reduce(BAND)`` of one int64 element (8 bytes): the reuse status word."""
        raise NotImplementedError

    # -- point to point (peer copies of two tiers: file bytes between two hosts) ---------------
    def exchange(self, dst: int | None, payload: bytes | None, src: int | None, nbytes: int) -> bytes | None:
        """Send ``payload`` to group rank ``dst`` while receiving ``nbytes`` bytes from group rank
        ``src`` (either side may be absent: ``payload`` None, ``nbytes`` 0). Not collective: only
        the two ranks of a message take part, and each send is matched by the other rank's
        receive, in order. Counted as ``send`` and ``recv`` with their bytes."""
        raise NotImplementedError

    # -- shared values (a store key, not a collective: posted once, read by some ranks) ----------
    def post_value(self, key: str, data: bytes) -> None:
        """Coordinator: make ``data`` readable under ``key`` until :meth:`drop_value`."""
        raise NotImplementedError

    def read_value(self, key: str, timeout: float) -> bytes:
        """Wait (bounded) for ``key`` and return its value; :class:`ChannelError` if none in time."""
        raise NotImplementedError

    def drop_value(self, key: str) -> None:
        raise NotImplementedError

    # -- publication receipts (reuse saves; not collectives: one store key per save) -----------
    def post_receipt(self, seq: int, error: str | None, previous: int | None = None) -> None:
        """Coordinator: save ``seq`` was published (``error`` None) or its publication failed.
        ``previous``: the last receipt posted before (default ``seq - 1``), which every rank has
        read by now and is removed."""
        raise NotImplementedError

    def wait_receipt(self, seq: int, timeout: float) -> str | None:
        """Other ranks: wait (bounded) for the coordinator's receipt of save ``seq``; returns
        its error (None: published). Raises :class:`ChannelError` if none arrives in time."""
        raise NotImplementedError


def _receipt_key(seq: int) -> str:
    return f"published/{seq}"


def _encode_receipt(error: str | None) -> bytes:
    return b"+" if error is None else b"-" + error.encode("utf-8", "backslashreplace")


def _decode_receipt(data: bytes) -> str | None:
    return None if data == b"+" else data[1:].decode("utf-8", "replace")


class DistChannel(Channel):
    """A :class:`Channel` over a ``torch.distributed`` process group (``None``: the world)."""

    def __init__(self, group: Any, counter: CollectiveCounter | None = None, coordinator: int = 0,
                 store: Any = None, timeout: float = 600.0) -> None:
        self.group = group
        self.timeout = timeout
        #: A ``torch.distributed`` store private to this channel, for publication receipts.
        self.store = store
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.coordinator = coordinator
        self._root = dist.get_global_rank(group, coordinator) if group is not None else coordinator
        self.counter = counter or CollectiveCounter()

    def gather_object(self, obj: Any) -> list[Any] | None:
        data = dumps(obj)
        t0 = time.perf_counter()
        out: list[Any] | None = [None] * self.world_size if self.is_coordinator else None
        self._run("gather_object", lambda: dist.gather_object(data, out, dst=self._root, group=self.group))
        self._record("gather_object", len(data), t0)
        return [pickle.loads(b) for b in out] if out is not None else None

    def scatter_object(self, objs: list[Any] | None) -> Any:
        datas = [dumps(o) for o in objs] if self.is_coordinator and objs is not None else None
        sent = sum(len(d) for d in datas) if datas else 0
        t0 = time.perf_counter()
        out: list[Any] = [None]
        self._run("scatter_object_list",
                  lambda: dist.scatter_object_list(out, datas, src=self._root, group=self.group))
        self._record("scatter_object_list", sent if self.is_coordinator else len(out[0]), t0)
        return pickle.loads(out[0])

    def broadcast_object(self, obj: Any = None) -> Any:
        data = dumps(obj) if self.is_coordinator else None
        t0 = time.perf_counter()
        box = [data]
        device = torch.device("cpu") if _is_gloo(self.group) else None
        self._run("broadcast_object_list",
                  lambda: dist.broadcast_object_list(box, src=self._root, group=self.group, device=device))
        self._record("broadcast_object_list", len(box[0]), t0)
        return pickle.loads(box[0])

    def all_gather_object(self, obj: Any) -> list[Any]:
        data = dumps(obj)
        t0 = time.perf_counter()
        out: list[Any] = [None] * self.world_size
        self._run("all_gather_object", lambda: dist.all_gather_object(out, data, group=self.group))
        self._record("all_gather_object", len(data), t0)
        return [pickle.loads(b) for b in out]

    def all_reduce_and(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        t0 = time.perf_counter()
        self._run("all_reduce", lambda: dist.all_reduce(t, op=dist.ReduceOp.BAND, group=self.group))
        self._record("all_reduce", t.numel() * t.element_size(), t0)
        return int(t.item())

    def all_and(self, value: int) -> int:
        """The bitwise AND of ``value`` over every rank: one 8-byte ``all_reduce`` on gloo, an
        ``all_gather_object`` of one int on other backends (no device tensor needed)."""
        if _is_gloo(self.group):
            return self.all_reduce_and(int(value))
        out = -1
        for v in self.all_gather_object(int(value)):
            out &= int(v)
        return out

    def all_true(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank (:meth:`all_and` of one bit)."""
        return self.all_and(int(bool(flag))) == 1

    def exchange(self, dst: int | None, payload: bytes | None, src: int | None, nbytes: int) -> bytes | None:
        t0 = time.perf_counter()
        works = []
        if payload:
            out = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            works.append(self._run("send", lambda: dist.isend(out, self._global(dst), group=self.group)))
        inbox = None
        if nbytes > 0:
            inbox = torch.empty(nbytes, dtype=torch.uint8)
            works.append(self._run("recv", lambda: dist.irecv(inbox, self._global(src), group=self.group)))
        limit = datetime.timedelta(seconds=self.timeout)
        for work in works:
            if not self._run("wait", lambda w=work: w.wait(limit)):
                raise ChannelError(f"a peer transfer did not complete within {self.timeout:g} s")
        seconds = time.perf_counter() - t0
        if payload:
            self.counter.record(CollectiveCall("send", len(payload), threading.current_thread().name, seconds))
        if inbox is None:
            return None
        self.counter.record(CollectiveCall("recv", nbytes, threading.current_thread().name, seconds))
        return inbox.numpy().tobytes()

    def _global(self, rank: int | None) -> int:
        if rank is None:
            raise ValueError("internal: a peer transfer without a peer")
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def post_value(self, key: str, data: bytes) -> None:
        store = self._need_store()
        self._run("store.set", lambda: store.set(f"value/{key}", data))

    def read_value(self, key: str, timeout: float) -> bytes:
        store = self._need_store()
        self._run("store.wait", lambda: store.wait([f"value/{key}"], datetime.timedelta(seconds=timeout)))
        return self._run("store.get", lambda: store.get(f"value/{key}"))

    def drop_value(self, key: str) -> None:
        store = self._need_store()
        self._run("store.delete_key", lambda: store.delete_key(f"value/{key}"))

    def post_receipt(self, seq: int, error: str | None, previous: int | None = None) -> None:
        store = self._need_store()
        self._run("store.set", lambda: store.set(_receipt_key(seq), _encode_receipt(error)))
        last = seq - 1 if previous is None else previous
        if last >= 1:  # every rank has read the previous receipt: it met us in this save's all_reduce
            self._run("store.delete_key", lambda: store.delete_key(_receipt_key(last)))

    def wait_receipt(self, seq: int, timeout: float) -> str | None:
        store = self._need_store()
        key = _receipt_key(seq)
        self._run("store.wait", lambda: store.wait([key], datetime.timedelta(seconds=timeout)))
        return _decode_receipt(self._run("store.get", lambda: store.get(key)))

    def _need_store(self) -> Any:
        if self.store is None:
            raise ChannelError("internal: this channel has no store for publication receipts")
        return self.store


def _is_gloo(group: Any) -> bool:
    try:
        return dist.get_backend(group) == "gloo"
    except Exception:  # noqa: BLE001 - unknown backend: let torch pick the device
        return False


# ---------------------------------------------------------------------------------------------
# In-process channels (W threads): the same protocol without processes
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Setting up the background channel (once per checkpointer, at construction, every rank)
# ---------------------------------------------------------------------------------------------


