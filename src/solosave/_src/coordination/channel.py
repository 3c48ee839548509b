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
import functools
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from solosave._src.coordination.status import (
    SaveIdentity,
    SetupAgreement,
    Status,
    decode_flags,
    decode_setup,
    decode_status,
    encode_flags,
    encode_setup,
    encode_status,
)
from solosave._src.core.errors import ChannelError, OutOfStep


@dataclass(frozen=True, slots=True)
class CollectiveCall:
    """One collective call, as this rank recorded it.

    Its kind (``torch.distributed`` name), payload bytes this rank sent or contributed, the thread
    it ran in and how long it took."""

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


@dataclass(frozen=True)
class Agreement:
    """What :meth:`Channel.agree` settled, the same on every rank: the agreed status and, where
    it gathered them, the failing ranks' errors or the drifting ranks' drifts."""

    status: Status
    failures: dict[int, str] = field(default_factory=dict)
    drifts: dict[int, list[str]] = field(default_factory=dict)


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

    def all_reduce_sum(self, values: list[int]) -> list[int]:
        """The element-wise sum of ``values`` (int64 counters, the same length on every rank)
        over every rank: one ``all_reduce(SUM)`` (the sketch of a cooperative load,
        :mod:`solosave._src.coordination.sketch`)."""
        raise NotImplementedError

    def all_reduce_max(self, values: list[int]) -> list[int]:
        """The element-wise maximum of ``values`` (int64, the same length on every rank) over
        every rank: one ``all_reduce(MAX)`` (the preemption guard's rounds,
        :mod:`solosave._src.tools.preemption`)."""
        raise NotImplementedError

    def all_and(self, value: int) -> int:
        """The bitwise AND of ``value`` over every rank (one 8-byte ``all_reduce``)."""
        return self.all_reduce_and(int(value))

    # -- agreement: the one way ranks settle an outcome (every save, copy, repair and load) ---
    def agree(self, status: Status, ident: SaveIdentity, what: str, error: str | None = None,
              drifts: list[str] | None = None, gather_drifts: bool = False) -> Agreement:
        """Every rank, together: agree on the outcome of ``what`` (a save, a copy, a repair).

        One 8-byte ``all_reduce`` of the status word (:func:`~solosave._src.coordination.status.encode_status`:
        this rank's ``status`` and the identity ``ident`` of what it runs); ranks that ran
        different things raise :class:`OutOfStep`, every one of them, with one wording. Only when
        the agreed status is FAILED does a second collective gather every rank's ``error``
        (``None`` where it had none); only when it is DRIFT and ``gather_drifts`` are the
        ``drifts`` gathered. The result is the same on every rank."""
        agreed = decode_status(self.all_reduce_and(encode_status(status, ident)), ident)
        if agreed is None:
            raise OutOfStep(f"this rank's {what} met a different one of another rank in the status all_reduce "
                            "(the ranks are out of step)")
        if agreed is Status.FAILED:
            return Agreement(agreed, {r: e for r, e in enumerate(self.all_gather_object(error)) if e is not None})
        if agreed is Status.DRIFT and gather_drifts:
            return Agreement(agreed, drifts={r: d for r, d in enumerate(self.all_gather_object(drifts)) if d})
        return Agreement(agreed)

    def agree_flags(self, flags: int, ident: SaveIdentity) -> int | None:
        """Every rank, together: the AND of two independent flags (bits 0-1) over every rank,
        with the identity ``ident`` checked as in :meth:`agree`: ``None`` (on every rank) when
        the ranks did not all contribute a word of ``ident``. One 8-byte ``all_reduce``."""
        return decode_flags(self.all_and(encode_flags(flags, ident)), ident)

    def agree_setup(self, ok: bool, durable: bool, peers: str | None) -> SetupAgreement:
        """Every rank, together, once per ``AsyncCheckpointer``: the set-up word
        (:func:`~solosave._src.coordination.status.encode_setup`), one 8-byte agreement."""
        return decode_setup(self.all_and(encode_setup(ok, durable, peers)))

    def agree_ok(self, error: Any, known_failed: bool = False) -> dict[int, Any]:
        """Every rank, together: whether every rank succeeded (one 8-byte ``all_reduce``, skipped
        when the caller already agreed that one failed: ``known_failed``); only if one did not,
        every rank's ``error`` (``None``: none; picklable) is gathered. Returns ``{rank: error}``
        of the ranks that failed (empty: every rank succeeded), the same on every rank."""
        if not known_failed and self.all_and(int(error is None)) == 1:
            return {}
        return {r: e for r, e in enumerate(self.all_gather_object(error)) if e is not None}

    def publish_by_coordinator(self, seq: int, publish: Callable[[], str | None],
                               previous: int | None = None) -> str | None:
        """After an agreed ok: the coordinator runs ``publish()`` (returns its error, ``None`` when
        published) and posts a receipt (:meth:`post_receipt`, a store key: not a collective);
        every other rank waits for it, bounded by :attr:`timeout`. Returns the coordinator's
        error on every rank. Raises :class:`ChannelError` when the receipt could not be posted or
        never came (the caller decides what the rank can still tell)."""
        if self.is_coordinator:
            error = publish()
            self.post_receipt(seq, error, previous)
            return error
        return self.wait_receipt(seq, self.timeout)

    # -- point to point (peer copies of two tiers: file bytes between two hosts) ---------------
    def exchange(self, dst: int | None, payload: bytes | None, src: int | None, nbytes: int) -> bytes | None:
        """Send ``payload`` to group rank ``dst`` while receiving ``nbytes`` bytes from group rank
        ``src`` (either side may be absent: ``payload`` None, ``nbytes`` 0). Not collective: only
        the two ranks of a message take part, and each send is matched by the other rank's
        receive, in order. Counted as ``send`` and ``recv`` with their bytes."""
        raise NotImplementedError

    def transfers(self, tag_base: int = 0) -> Transfers:
        """Point-to-point messages of one round of a cooperative load (:class:`Transfers`): not
        collective, the ranks of the round's messages take part."""
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


class Transfers:
    """The messages of one round of a cooperative load, from this rank's side: every send
    (:meth:`send`) and receive (:meth:`recv`) is listed first, then :meth:`start` posts them all
    at once (``batch_isend_irecv``: on NCCL, sends and receives between the same two ranks must
    be posted together, or each waits for the other), then each receive is waited for as it is
    needed (:meth:`wait_recv`), then :meth:`finish`. Message ``i`` from rank ``a`` to rank ``b``
    is matched by ``b``'s receive ``i`` from ``a``: the order in which both sides list them; each
    message's tag is ``tag_base`` + that order, so that a message of another round or load cannot
    be taken for one of this round. Each wait is bounded by the channel's timeout
    (:class:`ChannelError` past it). Counted as ``send`` and ``recv`` with their bytes."""

    def recv(self, src: int, into: torch.Tensor) -> int:
        """List a receive of ``into.numel()`` bytes from group rank ``src``; returns its handle."""
        raise NotImplementedError

    def send(self, dst: int, data: torch.Tensor) -> None:
        """List a send of ``data`` (1-D uint8 CPU, not changed until :meth:`finish`) to ``dst``."""
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def wait_recv(self, handle: int) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """Wait for every message (sends included)."""
        raise NotImplementedError


class _DistTransfers(Transfers):
    def __init__(self, ch: DistChannel, tag_base: int) -> None:
        self.ch, self.tag_base = ch, tag_base
        self.staged = _device_of(ch.group)  # NCCL moves device tensors only: stage through the GPU
        self.limit = datetime.timedelta(seconds=ch.timeout)
        self.counts: dict[tuple[str, int], int] = {}
        self.ops: list[Any] = []
        self.works: list[Any] = []
        self.recvs: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # op index, into, box
        self.done: set[int] = set()
        self.waited: set[int] = set()  # indices into works
        self.on_device: dict[int, torch.Tensor] = {}  # one staged copy per buffer sent
        self.sent = self.received = 0
        self.t0 = time.perf_counter()

    def _tag(self, way: str, rank: int) -> int:
        n = self.counts[(way, rank)] = self.counts.get((way, rank), -1) + 1
        return self.tag_base + n

    def recv(self, src: int, into: torch.Tensor) -> int:
        box = into if self.staged is None else torch.empty_like(into, device=self.staged)
        self.ops.append(dist.P2POp(dist.irecv, box, self.ch._global(src), self.ch.group, self._tag("r", src)))
        self.recvs.append((len(self.ops) - 1, into, box))
        self.received += into.numel()
        return len(self.recvs) - 1

    def send(self, dst: int, data: torch.Tensor) -> None:
        out = data
        if self.staged is not None:
            if id(data) not in self.on_device:
                self.on_device[id(data)] = data.to(self.staged)
            out = self.on_device[id(data)]
        self.ops.append(dist.P2POp(dist.isend, out, self.ch._global(dst), self.ch.group, self._tag("s", dst)))
        self.sent += data.numel()

    def start(self) -> None:
        if self.ops:
            self.works = list(self.ch._run("batch_isend_irecv", functools.partial(dist.batch_isend_irecv, self.ops)))

    def _work_of(self, op: int) -> list[int]:
        """The works to wait for before op ``op`` is complete: its own where the backend returns
        one per op (gloo), else every work (a coalesced batch, NCCL: one work for all)."""
        return [op] if len(self.works) == len(self.ops) else list(range(len(self.works)))

    def _wait(self, index: int) -> None:
        # each work is waited for once: on gloo, a second wait of a receive waits for another one
        if index in self.waited:
            return
        self.waited.add(index)
        if not self.ch._run("wait", functools.partial(self.works[index].wait, self.limit)):
            raise ChannelError(f"a transfer of a cooperative load did not complete within {self.ch.timeout:g} s "
                               "(a peer stopped or is slower than that): the load fails on this rank")

    def wait_recv(self, handle: int) -> None:
        if handle in self.done:
            return
        op, into, box = self.recvs[handle]
        for index in self._work_of(op):
            self._wait(index)
        if box is not into:
            into.copy_(box)
        self.done.add(handle)

    def finish(self) -> None:
        for i in range(len(self.recvs)):
            self.wait_recv(i)
        for index in range(len(self.works)):
            self._wait(index)
        seconds, thread = time.perf_counter() - self.t0, threading.current_thread().name
        if self.sent:
            self.ch.counter.record(CollectiveCall("send", self.sent, thread, seconds))
        if self.received:
            self.ch.counter.record(CollectiveCall("recv", self.received, thread, seconds))


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
        box: list[Any] = [data]
        device = torch.device("cpu") if _is_gloo(self.group) else None
        self._run("broadcast_object_list",
                  lambda: dist.broadcast_object_list(box, src=self._root, group=self.group, device=device))
        received: bytes = box[0]
        self._record("broadcast_object_list", len(received), t0)
        return pickle.loads(received)

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

    def all_reduce_sum(self, values: list[int]) -> list[int]:
        return self._all_reduce_ints(values, dist.ReduceOp.SUM)

    def all_reduce_max(self, values: list[int]) -> list[int]:
        return self._all_reduce_ints(values, dist.ReduceOp.MAX)

    def _all_reduce_ints(self, values: list[int], op: Any) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64)
        staged = _device_of(self.group)
        box = t if staged is None else t.to(staged)
        t0 = time.perf_counter()
        self._run("all_reduce", lambda: dist.all_reduce(box, op=op, group=self.group))
        self._record("all_reduce", t.numel() * t.element_size(), t0)
        return box.cpu().tolist()

    def all_and(self, value: int) -> int:
        """The bitwise AND of ``value`` over every rank: one 8-byte ``all_reduce`` on gloo, an
        ``all_gather_object`` of one int on other backends (no device tensor needed)."""
        if _is_gloo(self.group):
            return self.all_reduce_and(int(value))
        out = -1
        for v in self.all_gather_object(int(value)):
            out &= int(v)
        return out

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
            if not self._run("wait", functools.partial(work.wait, limit)):
                raise ChannelError(f"a peer transfer did not complete within {self.timeout:g} s")
        seconds = time.perf_counter() - t0
        if payload:
            self.counter.record(CollectiveCall("send", len(payload), threading.current_thread().name, seconds))
        if inbox is None:
            return None
        self.counter.record(CollectiveCall("recv", nbytes, threading.current_thread().name, seconds))
        return inbox.numpy().tobytes()

    def transfers(self, tag_base: int = 0) -> Transfers:
        return _DistTransfers(self, tag_base)

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


def _device_of(group: Any) -> torch.device | None:
    """Where a transfer's tensors must be for ``group``'s backend: ``None`` (CPU, as given) for
    gloo, this process's current CUDA device for NCCL."""
    try:
        backend = dist.get_backend(group)
    except Exception:  # noqa: BLE001 - unknown backend: send CPU tensors
        return None
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return None


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


