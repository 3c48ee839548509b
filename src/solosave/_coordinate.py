"""Step 4 of a save: coordination. **Every collective solosave performs goes through here.**

A :class:`Channel` is a group of ranks that runs collectives together. Two implementations:

* :class:`DistChannel` wraps one ``torch.distributed`` process group (a gloo group owned by the
  background side, or the user's group for the one-time set-up collectives and the loader);
* :class:`LocalChannel` connects W threads of one process (:func:`local_channels`): the same
  protocol, run in milliseconds, for tests and for the scale simulation.

Both count each call by kind and payload bytes in a :class:`CollectiveCounter`, so
``SaveResult`` reports exactly what a save cost and tests compare it with what
``torch.distributed`` saw. Objects are pickled here, once, so the payload counted is the payload
sent. Status words are 1-element ``int64`` CPU tensors (gloo). A collective that fails (a peer
died, a timeout) raises :class:`ChannelError`, and nothing else does: callers tell a broken
channel from their own errors by that type.

Which ranks call what: every method is collective over the channel's group; all ranks of the
group must call the same methods in the same order (the engine keeps them in lock-step by
deciding the next step from values every rank received).
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class ChannelError(Exception):
    """A collective failed on this rank: another rank's process or worker died, or did not
    answer within the timeout. The channel cannot be used any more."""


class OutOfStep(Exception):
    """The ranks' engines are not running the same save (found in a collective's result)."""


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

    # -- publication receipts (reuse saves; not collectives: one store key per save) -----------
    def post_receipt(self, seq: int, error: str | None) -> None:
        """Coordinator: save ``seq`` was published (``error`` None) or its publication failed."""
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
        data = _dumps(obj)
        t0 = time.perf_counter()
        out: list[Any] | None = [None] * self.world_size if self.is_coordinator else None
        self._run("gather_object", lambda: dist.gather_object(data, out, dst=self._root, group=self.group))
        self._record("gather_object", len(data), t0)
        return [pickle.loads(b) for b in out] if out is not None else None

    def scatter_object(self, objs: list[Any] | None) -> Any:
        datas = [_dumps(o) for o in objs] if self.is_coordinator and objs is not None else None
        sent = sum(len(d) for d in datas) if datas else 0
        t0 = time.perf_counter()
        out: list[Any] = [None]
        self._run("scatter_object_list",
                  lambda: dist.scatter_object_list(out, datas, src=self._root, group=self.group))
        self._record("scatter_object_list", sent if self.is_coordinator else len(out[0]), t0)
        return pickle.loads(out[0])

    def broadcast_object(self, obj: Any = None) -> Any:
        data = _dumps(obj) if self.is_coordinator else None
        t0 = time.perf_counter()
        box = [data]
        device = torch.device("cpu") if _is_gloo(self.group) else None
        self._run("broadcast_object_list",
                  lambda: dist.broadcast_object_list(box, src=self._root, group=self.group, device=device))
        self._record("broadcast_object_list", len(box[0]), t0)
        return pickle.loads(box[0])

    def all_gather_object(self, obj: Any) -> list[Any]:
        data = _dumps(obj)
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

    def post_receipt(self, seq: int, error: str | None) -> None:
        store = self._need_store()
        self._run("store.set", lambda: store.set(_receipt_key(seq), _encode_receipt(error)))
        if seq > 1:  # every rank has read the previous receipt: it met us in this save's all_reduce
            self._run("store.delete_key", lambda: store.delete_key(_receipt_key(seq - 1)))

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
        got = self._exchange("gather_object", _dumps(obj))
        return [pickle.loads(b) for b in got] if self.is_coordinator else None

    def scatter_object(self, objs: list[Any] | None) -> Any:
        data = _dumps([_dumps(o) for o in objs] if self.is_coordinator and objs is not None else None)
        got = self._exchange("scatter_object_list", data)
        return pickle.loads(pickle.loads(got[self.coordinator])[self.rank])

    def broadcast_object(self, obj: Any = None) -> Any:
        got = self._exchange("broadcast_object_list", _dumps(obj) if self.is_coordinator else b"")
        return pickle.loads(got[self.coordinator])

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [pickle.loads(b) for b in self._exchange("all_gather_object", _dumps(obj))]

    def all_reduce_and(self, value: int) -> int:
        got = self._exchange("all_reduce", value.to_bytes(8, "little", signed=True))
        out = -1
        for b in got:
            out &= int.from_bytes(b, "little", signed=True)
        return out

    def post_receipt(self, seq: int, error: str | None) -> None:
        self._hub.post(seq, error)

    def wait_receipt(self, seq: int, timeout: float) -> str | None:
        return self._run("receipt", lambda: self._hub.wait_for(seq, timeout))


def local_channels(world_size: int, timeout: float = 30.0) -> list[LocalChannel]:
    """W channels joined in this process: rank ``r`` uses ``channels[r]`` from its own thread.
    A rank that does not show up within ``timeout`` makes every waiting rank raise
    :class:`ChannelError` (as a dead peer does over gloo)."""
    hub = _Hub(world_size, timeout)
    return [LocalChannel(hub, r) for r in range(world_size)]


# ---------------------------------------------------------------------------------------------
# Setting up the background channel (once per checkpointer, at construction, every rank)
# ---------------------------------------------------------------------------------------------

def share_store_address(group: Any, counter: CollectiveCounter, timeout_s: float) -> tuple[Any, tuple[str, int, str]]:
    """Group rank 0 serves a fresh ``TCPStore``, listening only on the address of the training
    store (``MASTER_ADDR``; ``SOLOSAVE_STORE_HOST`` overrides it); its address reaches every rank
    through one ``broadcast_object_list`` on ``group`` (counted). Returns ``(server_or_None,
    (host, port, prefix))``; the server (the store and its socket) must live as long as the
    workers use it (rank 0 keeps it)."""
    ch = DistChannel(group, counter)
    store = None
    addr = None
    if ch.is_coordinator:
        host = os.environ.get("SOLOSAVE_STORE_HOST") or os.environ.get("MASTER_ADDR") or socket.gethostname()
        listener = _listen(host)
        port = listener.getsockname()[1]
        kw = {"is_master": True, "wait_for_workers": False, "master_listen_fd": listener.fileno(),
              "timeout": datetime.timedelta(seconds=timeout_s)}
        try:
            server = dist.TCPStore(host, port, **kw)
        except NotImplementedError:  # torch < 2.7: libuv's store takes no listen fd; the legacy one does
            server = dist.TCPStore(host, port, use_libuv=False, **kw)
        store = (server, listener)  # the server serves on the listener's socket: keep both
        addr = (host, port, f"solosave/{uuid.uuid4().hex}/")
    addr = ch.broadcast_object(addr)
    return store, addr


def _listen(host: str) -> socket.socket:
    """A listening TCP socket bound to ``host``'s address (not every interface)."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    s = socket.socket(family, kind, proto)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(sockaddr[:2] if family == socket.AF_INET else sockaddr)
    s.listen(1024)
    return s


def new_gloo_group(group: Any, counter: CollectiveCounter, timeout_s: float) -> Any:
    """A gloo group over the same ranks as ``group`` (thread mode). Collective over the *world*
    group (``torch.distributed.new_group``'s rule): every rank of the job must call it."""
    t0 = time.perf_counter()
    ranks = dist.get_process_group_ranks(group) if group is not None else None
    g = dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    counter.record(CollectiveCall("new_group", 0, threading.current_thread().name, time.perf_counter() - t0))
    return g
