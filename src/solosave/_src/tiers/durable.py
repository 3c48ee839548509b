"""The durable stage of two tiers (background: worker process or thread, every rank).

With ``durable_root`` a save to ``.../NAME`` is published on the fast tier exactly as without it;
then the engine hands the rank's :class:`Copier` a :class:`CopyTask` and reports the fast
publication at once: the training loop never waits for the durable copy. The copier runs its
tasks one at a time, in save order, on a thread of its own, over a channel of its own (a second
gloo group: its collectives never interleave with a save's). Who calls what, per task, in order
(every rank's copier runs the same tasks: a task exists exactly for each save published on the
fast tier, which every rank knows alike):

0. every rank: **latest wins** (unless ``durable_every_save`` or peer copies: then every task
   runs, in order, and this step is skipped). A task that has not started when a newer one arrives is replaced
   by it (reported *superseded*, not failed): copies that fall behind a stalled store are
   coalesced, and the fast tier never waits for them. Which task runs next is agreed, as the
   ranks' queues differ in time: one 8-byte ``all_reduce(MAX)`` of each rank's newest task ->
   every rank runs that one (waiting, bounded, for it to arrive) and drops the older ones;
1. every rank: refuse a published ``<durable>/.metadata`` unless the save was ``overwrite``,
   remove it otherwise (never an old ``.metadata`` beside new data), then copy its own data
   files (and their checksum sidecars) from the fast tier, streamed, one thread per file
   (:func:`~solosave._src.storage.copy.stream_into` into the writer's data file: on S3 a
   concurrent multipart upload);
2. every rank: **one** 8-byte ``all_reduce`` of the status word (ok / failed, and the task's
   identity: ranks copying different saves are out of step); agreed failed, steps 1-2 run again
   on every rank, up to ``retries`` more times, after a back-off (1 s, 2 s, 4 s, ...);
3. agreed ok: the coordinator copies the load index and ``.metadata`` (their ``checkpoint_id``
   re-pointed at the durable directory), ``.metadata`` last, atomically, and posts a receipt
   (a store key, not a collective) that the other ranks wait for; agreed failed: every rank
   all-gathers the errors (failure path only) and nothing is published on the durable tier;
4. every rank posts the task's :class:`~solosave._src.coordination.protocol.DurableOutcome`
   (``post``: to the trainer), the same ``ok`` and failures on every rank.

With peer copies (``peer_copy``; fast tiers local to each host) every task first runs the peer
stage of :mod:`solosave._src.tiers.peer_copy` on the same channel (its files to the next host, one
more 8-byte ``all_reduce``); its outcome is reported beside the durable one
(``DurableOutcome.peer_ok``), and a failed peer stage does not stop the durable copy.

A failed copy never touches the fast copy, and the next task runs normally. A failed collective
(a peer's worker died or timed out) leaves the copier **broken**: later tasks fail at once,
without a collective, naming the reason (the checkpointer must be recreated, as for the engine).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from solosave._src.coordination.channel import Channel
from solosave._src.coordination.protocol import (
    DurableOutcome,
    SaveIdentity,
    Status,
    save_identity,
)
from solosave._src.core.errors import ChannelError, IndexUnusable, OutOfStep, describe
from solosave._src.formats.dcp import INDEX_FILE, METADATA_FILE, checksum_path
from solosave._src.formats.metadata_template import replace_checkpoint_id
from solosave._src.index.writer import shifted
from solosave._src.storage.copy import stream_into
from solosave._src.storage.registry import storage_for
from solosave._src.tiers.peer_copy import copy_to_peers
from solosave._src.tiers.placement import PeerLayout
from solosave._src.write.publish import commit_checkpoint, unpublish
from solosave._src.write.writer import FileWriter

#: With ``durable_every_save``: copies queued or running at once per rank; a save whose copy
#: would exceed it first waits (in the background, before its own write) for the oldest to end.
#: Coalescing (the default) keeps at most one running and the newest queued, and never waits.
MAX_PENDING = 2

log = logging.getLogger("solosave")


@dataclass(frozen=True, slots=True)
class CopyTask:
    """One save's durable copy on this rank: its fast ``source`` directory, its durable
    ``target``, the files of this rank to copy (relative names) and when it was queued."""

    seq: int
    source: str
    target: str
    files: tuple[str, ...]
    overwrite: bool = False
    queued_at: float = 0.0

    @property
    def identity(self) -> SaveIdentity:
        return save_identity(self.seq, self.target)


class Copier:
    """Runs this rank's durable copies (see the module docstring) on one daemon thread, started by
    the first :meth:`submit`. ``post(outcome)`` is called on that thread once per task (set by
    the transport before the first save; its errors are ignored: the trainer may be gone)."""

    def __init__(self, channel: Channel, writer: FileWriter, storage_options: Mapping[str, Any] | None = None,
                 files_at_once: int = 1, peers: PeerLayout | None = None, coalesce: bool = True,
                 retries: int = 0, backoff: float = 1.0) -> None:
        self.channel = channel
        #: A copy that every rank agreed failed is run again, on every rank, up to ``retries`` more
        #: times, ``backoff`` s later, then twice that, ... (steps 1-3 only: not the peer stage).
        self.retries, self.backoff = retries, backoff
        #: Latest wins (step 0 of the module docstring); ``False``: every task runs, in order.
        #: Never with peer copies: the peer stage runs in the same task, and every save's peer
        #: copy is what lets lost hosts be rebuilt without the durable tier.
        self.coalesce = coalesce and peers is None
        #: Peer copies (``peer_copies``): where each host's files go; ``None``: no peer copy (see
        #: ``tiers/peer_copy.py``).
        self.peers = peers
        self.writer = writer
        self.storage_options = storage_options
        self.files_at_once = max(files_at_once, 1)
        self.post: Callable[[DurableOutcome], None] | None = None
        self._cond = threading.Condition()
        self._queue: deque[CopyTask] = deque()
        #: Tasks replaced by a newer one while the ranks might still choose them (the one offered
        #: in a choice under way), and that one's number; reported by the copier's thread.
        self._superseded: list[tuple[CopyTask, int]] = []
        #: The task this rank offered in the choice under way (it may still be chosen).
        self._offered: int | None = None
        self._running: CopyTask | None = None
        self._closing = False
        self._thread: threading.Thread | None = None
        self._last_receipt: int | None = None
        #: Why the durable channel cannot be used any more.
        self.broken: str | None = None

    # -- the engine's side ----------------------------------------------------------------------
    def submit(self, task: CopyTask) -> None:
        now: list[CopyTask] = []
        with self._cond:
            if self._closing:
                return
            if self.coalesce:  # latest wins (step 0); reported now, unless the ranks may still choose it
                for old in self._queue:
                    if old.seq == self._offered:
                        self._superseded.append((old, task.seq))
                    else:
                        now.append(old)
                self._queue.clear()
            self._queue.append(task)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="solosave-durable", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        for old in now:  # while a stalled copy runs, so that retention may take their sources
            self._post(_superseded(old, task.seq))

    def pending(self) -> int:
        """Tasks queued or running."""
        with self._cond:
            return len(self._queue) + (self._running is not None)

    def busy_with(self, directory: str) -> bool:
        """Whether a task queued or running reads ``directory`` (a save about to rewrite it waits);
        a task replaced but not yet reported counts too (the ranks may still choose it)."""
        with self._cond:
            return any(t.source == directory
                       for t in (*self._queue, self._running, *(t for t, _ in self._superseded)) if t is not None)

    def wait_until(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait (bounded) until ``predicate()`` holds; it is checked whenever a task ends."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 1.0))
            return True

    def close(self, timeout: float) -> None:
        """Drop the tasks not started, stop the running one between two chunks (its upload is
        abandoned: nothing is published), and wait for the thread, at most ``timeout`` s."""
        with self._cond:
            self._closing = True
            self._queue.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    # -- the copier's thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._superseded or self._closing)
                if self._closing:
                    return
                dropped, self._superseded = self._superseded, []
            for old, by in dropped:
                self._post(_superseded(old, by))
            mark = self.channel.counter.mark()  # the task's collectives include the choice
            task = self._pick()
            if task is None:
                continue
            try:
                outcome = self.copy(task, mark)
            except BaseException as e:  # noqa: BLE001 - a bug: reported as this task's failure
                outcome = DurableOutcome(task.seq, False, task.target, {self.channel.rank: describe(e)},
                                         started_at=task.queued_at, finished_at=time.time())
            try:
                self._post(outcome)
            finally:
                with self._cond:
                    self._running = None
                    self._cond.notify_all()

    def _post(self, outcome: DurableOutcome) -> None:
        try:
            if self.post is not None and not self._closing:
                self.post(outcome)
        except Exception:  # noqa: BLE001, S110 - the trainer is gone: nothing to tell
            pass

    def _pick(self) -> CopyTask | None:
        """Step 0: the task every rank runs next, now running here (``None``: nothing queued
        any more, or closing). Agreed over the channel unless it is broken (then the oldest task
        runs, and fails at once)."""
        with self._cond:
            if not self._queue:
                return None
            if not self.coalesce:  # every task, in order: nothing to agree on
                first = self._running = self._queue.popleft()
                return first
            newest = self._offered = self._queue[-1].seq
        if self.broken is None:
            try:
                newest = self.channel.all_reduce_max([newest])[0]
            except ChannelError as e:
                self.broken = (f"the durable channel failed while the ranks chose the next copy ({e}): another "
                               "rank's worker died or did not answer in time; later durable copies fail at once: "
                               "close() this checkpointer and create a new AsyncCheckpointer on every rank")
        with self._cond:
            def here() -> CopyTask | None:  # queued, or replaced here meanwhile (not reported yet)
                return next((t for t in (*self._queue, *(t for t, _ in self._superseded)) if t.seq == newest), None)

            if not self._cond.wait_for(lambda: self._closing or here() is not None, self.channel.timeout):
                self.broken = self.broken or (
                    f"save {newest}'s durable copy, chosen by the ranks, never reached this rank in "
                    f"{self.channel.timeout:g} s; later durable copies fail at once")
            task = here()
            self._offered = None
            if self._closing or task is None:
                return None
            self._superseded = [(t, by) for t, by in self._superseded if t is not task]
            self._superseded += [(t, newest) for t in self._queue if t.seq < newest]
            self._queue = deque(t for t in self._queue if t.seq > newest)
            self._running = task
        return task

    def copy(self, task: CopyTask, mark: int | None = None) -> DurableOutcome:
        """Run one task on this rank (every rank runs it; see the module docstring, steps 1-4);
        its outcome counts the collectives since ``mark`` (default: from here)."""
        ch = self.channel
        mark = ch.counter.mark() if mark is None else mark
        copied, failures = 0, {}
        peer_ok, peer_failures = self._peer_step(task)
        attempts = 0
        if self.broken is not None:
            failures = {ch.rank: self.broken}
        while self.broken is None:  # the outcome is agreed: every rank tries again alike
            if attempts:
                time.sleep(self.backoff * 2 ** (attempts - 1))
            attempts += 1
            copied, failures, retryable = self._copy_and_agree(task)
            if not failures or not retryable or attempts > self.retries or self.broken is not None:
                break
            log.warning("solosave: the durable copy to %s failed (try %d of %d), trying again: %s", task.target,
                        attempts, self.retries + 1, "; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items())))
        return DurableOutcome(task.seq, not failures, task.target, failures, copied,
                              tuple(ch.counter.since(mark)), task.queued_at, time.time(), peer_ok, peer_failures,
                              attempts=max(attempts, 1))

    def _copy_and_agree(self, task: CopyTask) -> tuple[int, dict[int, str], bool]:
        """Steps 1-3 once: ``(bytes copied here, failures by rank, whether trying again may
        help)``: only an agreed failure of the copy itself is tried again (a failed publication
        is not: its receipt is the save's, posted once). A broken channel breaks the copier."""
        ch = self.channel
        copied, error = 0, None
        try:
            copied = self._copy_files(task)
        except Exception as e:  # noqa: BLE001 - becomes status FAILED on every rank
            error = f"copying to {task.target} failed: {describe(e)}"
        try:
            failures, published, agreed_failed = self._agree(task, error)
            return copied + published, failures, agreed_failed
        except (ChannelError, OutOfStep) as e:
            self.broken = (f"the durable channel failed during the copy to {task.target} ({e}): another "
                           "rank's worker died or did not answer in time; later durable copies fail at once: "
                           "close() this checkpointer and create a new AsyncCheckpointer on every rank")
            return copied, {ch.rank: self.broken}, False

    def _peer_step(self, task: CopyTask) -> tuple[bool | None, dict[int, str]]:
        """The peer copy of ``task`` (``tiers/peer_copy.py``), before its durable copy: ``(ok or None
        when there is none, failures)``. A broken channel breaks the copier."""
        if self.peers is None:
            return None, {}
        if self.broken is not None:
            return False, {self.channel.rank: self.broken}
        try:
            failures = copy_to_peers(self.channel, task.seq, task.source, task.files, self.writer, self.peers,
                                     self.storage_options, stop=lambda: self._closing)
        except Exception as e:  # noqa: BLE001 - a channel error, or a bug that left the ranks out of step
            self.broken = (f"the durable channel failed during the peer copy of {task.source} ({describe(e)}): "
                           "another rank's worker died or did not answer in time, or this rank could not "
                           "go on; later copies fail at once: close() this checkpointer and create a new "
                           "AsyncCheckpointer on every rank")
            return False, {self.channel.rank: self.broken}
        return not failures, failures

    def _agree(self, task: CopyTask, error: str | None) -> tuple[dict[int, str], int, bool]:
        """Steps 2-3: the status word, then publication (ok) or the errors (failed); the last
        value says the copy failed (agreed), not its publication."""
        ch = self.channel
        status = Status.OK if error is None else Status.FAILED
        agreed = ch.agree(status, task.identity, f"durable copy of save {task.seq}", error=error)
        if agreed.status is not Status.OK:
            return agreed.failures, 0, True
        published = 0

        def publish() -> str | None:
            nonlocal published
            try:
                published = publish_copy(task.source, task.target, self.storage_options, self.writer.fsync)
            except Exception as e:  # noqa: BLE001 - reported to every rank through the receipt
                return f"publishing the durable copy {task.target} failed: {describe(e)}"
            return None

        error = ch.publish_by_coordinator(task.seq, publish, previous=self._last_receipt)
        self._last_receipt = task.seq
        return ({} if error is None else {ch.coordinator: error}), published, False

    def _copy_files(self, task: CopyTask) -> int:
        """Step 1 on this rank; returns the bytes copied."""
        src = storage_for(task.source, self.storage_options)
        dst = storage_for(task.target, self.storage_options)
        if type(src) is type(dst) and dst.same_location(task.source, task.target):
            raise ValueError(f"the durable copy {task.target} is the fast checkpoint {task.source} itself; "
                             "nothing was copied (a copy never writes or removes its own source)")
        dst.makedirs(task.target)
        marker = dst.join(task.target, METADATA_FILE)
        if dst.exists(marker):
            if not task.overwrite:
                raise FileExistsError(f"{task.target} already holds a complete checkpoint, which a durable copy "
                                      "never replaces unless the save passed overwrite=True; remove it or save "
                                      "under another name")
            unpublish(dst, task.target)
        if not self.writer.checksums:  # a stale sidecar of a replaced copy would mislead verify
            for rel in task.files:
                dst.remove(checksum_path(dst.join(task.target, rel)))

        def one(rel: str) -> int:
            out = self.writer.open(dst.join(task.target, rel))
            try:
                n = stream_into(src, src.join(task.source, rel), out, stop=lambda: self._closing)
            except BaseException:
                out.close()  # abandoned: an upload is aborted, nothing appears
                raise
            self.writer.close(out)
            return n

        if len(task.files) <= 1 or self.files_at_once == 1:
            return sum(one(rel) for rel in task.files)
        with ThreadPoolExecutor(min(self.files_at_once, len(task.files)), thread_name_prefix="solosave-copy") as pool:
            futures = [pool.submit(one, rel) for rel in task.files]
            errors, total = [], 0
            for f in futures:
                try:
                    total += f.result()
                except Exception as e:  # noqa: BLE001 - the first is raised after every file ended
                    errors.append(e)
            if errors:
                raise errors[0]
            return total


def _superseded(task: CopyTask, by: int) -> DurableOutcome:
    """The outcome of ``task``, replaced by save ``by``'s copy before it started (step 0)."""
    return DurableOutcome(task.seq, False, task.target, started_at=task.queued_at, finished_at=time.time(),
                          superseded_by=by)


def publish_copy(source: str, target: str, storage_options: Mapping[str, Any] | None = None,
                 fsync: bool = True) -> int:
    """Coordinator, step 3: the fast copy's load index (where the durable backend keeps one) and
    ``.metadata``, their ``checkpoint_id`` re-pointed at ``target`` (the same ``save_id``), written
    to ``target`` by commits, ``.metadata`` last. Returns the bytes written."""
    src = storage_for(source, storage_options)
    dst = storage_for(target, storage_options)
    md = src.read(src.join(source, METADATA_FILE))
    moved = replace_checkpoint_id(md, source, target)
    delta = 0 if moved is None else len(moved) - len(md)
    md = md if moved is None else moved
    index = None
    if dst.load_index:
        try:
            index = shifted(src.read(src.join(source, INDEX_FILE)), delta)
        except (FileNotFoundError, IndexUnusable):  # loads there read .metadata; a stale index is not used
            index = None
    warning = commit_checkpoint(dst, target, md, index, fsync=fsync)
    if warning is not None:
        log.warning("solosave: durable copy: %s", warning)
    return len(md) + (len(index) if index is not None and warning is None else 0)


__all__ = ["MAX_PENDING", "CopyTask", "Copier", "publish_copy"]
