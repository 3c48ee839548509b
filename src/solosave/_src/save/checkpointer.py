"""The public saver: :class:`AsyncCheckpointer` (its handles: ``save/handle.SaveHandle``).

Who calls what, in which order (every rank of ``process_group``):

1. ``AsyncCheckpointer(...)`` - collective once: rank 0 shares a store address (one broadcast)
   and each rank starts its worker, which forms the background gloo channel.
2. ``save(state_dict, path)`` - **no collective**: waits for the previous save of this
   checkpointer (bounded), plans locally, stages into host buffers, hands the job to the worker
   and returns a :class:`SaveHandle`. Every rank must call ``save`` for every checkpoint, in the
   same order. If it raises on some ranks only (bad input on one rank), the save still fails on
   every rank at once, naming that rank and its error (the raising rank hands the worker a job
   that fails the save).
3. ``handle.done()`` - non-blocking, no collective; ``handle.wait(timeout)`` - bounded, returns a
   :class:`SaveResult` or raises :class:`~solosave.CheckpointError` (the same on every rank).
   The handle waits on a future that this checkpointer completes when its worker reports the
   save's outcome (``_pump``, the handle's pump; see ``save/handle.py``).
4. ``close()`` (or leaving the ``with`` block) - waits for the save in flight (bounded), and
   with two tiers for the durable copies still running (bounded), stops the worker and frees the
   staging memory; no processes, segments or files are left behind. A checkpointer dropped
   without ``close()`` is closed when it is garbage-collected.

Two tiers (``durable_root``): a save's :class:`SaveResult` arrives when it is published on the
fast tier, as without them; its ``durable`` field (:class:`~solosave._src.save.result.DurableCopy`)
completes later, when the worker reports the copy's outcome (the same pump: a handle's
``wait()`` or ``durable.wait()`` takes whichever message comes next and completes its future).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata

from solosave._src.coordination.channel import CollectiveCounter, DistChannel
from solosave._src.coordination.protocol import (
    ChannelSpec,
    DurableOutcome,
    EngineSettings,
    ErrorKind,
    JobOutcome,
    SaveJob,
    SaveKind,
    WorkerSetup,
)
from solosave._src.coordination.rendezvous import (
    linger_until_closed,
    new_gloo_group,
    report_closed,
    share_store_address,
)
from solosave._src.core.errors import CheckpointExistsError, PreparedMetadataError, WorkerDiedError
from solosave._src.core.gc_pause import gc_paused
from solosave._src.engine.engine import Engine
from solosave._src.formats.dcp import METADATA_FILE
from solosave._src.prepared.prepared import PreparedMetadata, load_prepared_metadata
from solosave._src.save.copies import PendingCopies
from solosave._src.save.handle import SaveHandle, complete, wait_published
from solosave._src.save.options import CheckpointerOptions, peer_layout
from solosave._src.save.result import SaveResult, Started
from solosave._src.save.session import SaveSession, normalize_directory
from solosave._src.staging.staging import Staging
from solosave._src.storage.registry import storage_for
from solosave._src.tiers.paths import durable_target_problem
from solosave._src.tiers.placement import PeerLayout
from solosave._src.worker.host import ProcessTransport, ThreadTransport
from solosave._src.write.writer import FileWriter

log = logging.getLogger("solosave")


class _Resources:
    """What a checkpointer must release however it ends (see ``weakref.finalize`` below)."""

    def __init__(self) -> None:
        self.transport: ProcessTransport | ThreadTransport | None = None
        self.session: SaveSession | None = None
        self.groups: list[Any] = []
        #: Group rank 0: the store it serves for the background (receipts); every rank: its
        #: address, and how many other ranks use it.
        self.store: Any = None
        self.address: tuple[str, int, str] | None = None
        self.others = 0

    def release(self, timeout: float) -> None:
        """Stop the background, free the staging, then (group rank 0) keep the store up, at
        most ``min(timeout, 10)`` s, until every other rank has stopped its own: each reports so
        here, last."""
        try:
            if self.transport is not None:
                self.transport.close(timeout)
        finally:
            try:
                if self.session is not None:
                    self.session.close()
                self._hand_over_store(timeout)
            finally:
                for group in self.groups:
                    try:
                        dist.destroy_process_group(group)
                    except Exception:  # noqa: BLE001,S110 - already gone with the default group
                        pass
                self.store = None

    def _hand_over_store(self, timeout: float) -> None:
        if self.address is None:
            return
        if self.store is None:
            report_closed(self.address)
        elif not linger_until_closed(self.store, self.address, self.others, min(timeout, 10.0)):
            log.warning("solosave: closing although not every other rank has closed its checkpointer "
                        "within %g s (one may have died); a rank still waiting for this rank's word on its "
                        "last save or durable copy will report it as failed or unknown", min(timeout, 10.0))


@dataclass(frozen=True, slots=True)
class _InFlight:
    """The checkpointer's side of its save in flight: the handle it returned, the future that
    handle waits on (completed here) and what ``save()`` measured, for the result."""

    handle: SaveHandle
    published: Future[SaveResult]
    started: Started
    save_id: str = ""


class AsyncCheckpointer:
    """Asynchronous DCP-format saves with a persistent worker per rank.

    Args:
        process_group: the ranks that save together (default: the world group). Works with gloo
            and NCCL; the background uses its own gloo channel, never this group's stream.
        writer: a :class:`~solosave.FileWriter` (subclass) that writes the files.
        options: a :class:`~solosave.CheckpointerOptions`, or its fields as keywords:
            ``workers``, ``persistent_worker``, ``prepared_metadata``, ``create_prepared_metadata``,
            ``assume_constant_structure``, ``on_layout_drift``, ``timeout``, ``checksums``,
            ``staging_dir`` (each documented on ``CheckpointerOptions``).
    """

    def __init__(self, process_group: Any = None, *, writer: FileWriter | None = None,
                 options: CheckpointerOptions | None = None, **kwargs: Any) -> None:
        if options is not None and kwargs:
            raise TypeError("pass either options=CheckpointerOptions(...) or its fields as keywords, not both")
        self.options = options if options is not None else CheckpointerOptions(**kwargs)
        writer = _check_writer(writer, self.options)
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("torch.distributed is not initialised: call "
                             "torch.distributed.init_process_group(...) before creating an "
                             "AsyncCheckpointer (for a single process: world_size=1, backend='gloo')")
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        _check_thread_mode_group(self.options, self.world_size)
        self._setup_counter = CollectiveCounter()
        self._inflight: _InFlight | None = None
        self._copies = PendingCopies(self.rank)  # two tiers: the durable copies not yet reported
        self._closed = False
        self._submit_error: BaseException | None = None
        self._known_buckets: set[str] = set()  # URL destinations whose bucket was seen to exist
        self._res = _Resources()
        self._peers: PeerLayout | None = None
        self._res.session = SaveSession(self.rank, self.world_size, self.options, self._agreed_prepared())
        self._finalizer = weakref.finalize(self, self._res.release, 5.0)
        self._start_background(writer)

    def _start_background(self, writer: FileWriter | None) -> None:
        o = self.options
        peers = self._peers
        settings = EngineSettings(o.files_per_rank, o.on_layout_drift, o.prepared_path, o.storage_options,
                                  o.durable_root, self.peer_ranks_per_host, peers.copies if peers else 1,
                                  peers.placement.hosts_per_domain if peers else 1, o.durable_every_save,
                                  o.durable_retries)
        self._res.store, (host, port, prefix) = share_store_address(self.process_group, self._setup_counter, o.timeout)
        self._res.address, self._res.others = (host, port, prefix), self.world_size - 1
        self._session.run_id = prefix  # fresh per checkpointer (a uuid4), the same on every rank
        if o.worker == "process":
            spec = ChannelSpec(host, port, prefix, self.rank, self.world_size, float(o.timeout))
            self._res.transport = ProcessTransport(WorkerSetup(spec, settings, writer, os.getpid()))
            return
        import datetime

        group = new_gloo_group(self.process_group, self._setup_counter, o.timeout)
        self._res.groups.append(group)
        client = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=o.timeout))
        receipts = dist.PrefixStore(prefix + "receipts/", client)
        channel = DistChannel(group, CollectiveCounter(), store=receipts, timeout=o.timeout)
        durable = None
        if o.durable_root:  # the durable copies' own group (see tiers/durable.py)
            group = new_gloo_group(self.process_group, self._setup_counter, o.timeout)
            self._res.groups.append(group)
            durable = DistChannel(group, CollectiveCounter(), timeout=o.timeout,
                                  store=dist.PrefixStore(prefix + "durable-receipts/", client))
        self._res.transport = ThreadTransport(Engine(channel, settings, writer, durable))

    @property
    def peer_ranks_per_host(self) -> int:
        """Peer copies (``peer_copies``): the ranks per host the saves use (0: no peer copy)."""
        return 0 if self._peers is None else self._peers.ranks_per_host

    @property
    def peer_layout(self) -> PeerLayout | None:
        """Peer copies (``peer_copies``): where each host's files go (``None``: no peer copy)."""
        return self._peers

    # -- prepared metadata ----------------------------------------------------------------
    def _agreed_prepared(self) -> PreparedMetadata | None:
        """:meth:`_initial_prepared` on every rank, then one 8-byte ``all_reduce`` (counted):
        when it failed on some ranks only (say, one rank's section of the prepared file is
        damaged, or one rank cannot read the file), every rank raises now, naming that rank,
        instead of the others waiting for it in the set-up broadcast until the timeout. The same
        word says whether every rank, or none, has a ``durable_root`` (the workers of some ranks
        only would wait for the others' durable channel until the timeout), and whether every
        rank has the same peer copies' ``ranks_per_host`` (a ring that differs between ranks
        would pair the wrong ranks)."""
        try:
            self._peers = peer_layout(self.options, self.world_size)
            prepared, error = self._initial_prepared(), None
        except Exception as e:  # noqa: BLE001 - raised below, after every rank knows
            prepared, error = None, e
        ch = DistChannel(self.process_group, self._setup_counter)
        peers = None if self._peers is None else json.dumps(self._peers.describe(), sort_keys=True)
        if self.options.durable_root:  # how copies are queued: the copiers' collectives depend on it
            peers = json.dumps({"peers": peers, "durable_every_save": bool(self.options.durable_every_save),
                                "durable_retries": self.options.durable_retries})
        agreed = ch.agree_setup(error is None, bool(self.options.durable_root), peers)
        if agreed.ok:  # every rank set up: a mismatch is seen by every rank alike
            if not agreed.same_durable:
                raise ValueError("durable_root is set on some ranks only: pass the same durable_root (or none) "
                                 "to the AsyncCheckpointer of every rank")
            if not agreed.same_peers:
                raise ValueError("peer_copies, ranks_per_host, hosts_per_domain, durable_every_save or durable_retries "
                                 "differs between ranks: pass the same to the AsyncCheckpointer of every rank "
                                 "(LOCAL_WORLD_SIZE must be the same on every host)")
            return prepared
        reports = ch.agree_ok(None if error is None else f"{type(error).__name__}: {error}", known_failed=True)
        if error is not None:
            raise error
        rank, why = min(reports.items())
        raise PreparedMetadataError(f"rank {rank} could not set up its AsyncCheckpointer: {why} (every rank "
                                    "must be able to read the prepared metadata; no rank started a worker)")

    def _initial_prepared(self) -> PreparedMetadata | None:
        o = self.options
        pm = o.prepared_metadata
        if pm is None:
            return None
        if isinstance(pm, PreparedMetadata):
            prepared = pm
        elif isinstance(pm, Metadata):
            prepared = PreparedMetadata.from_metadata(pm, source="prepared_metadata object")
        else:
            st = storage_for(pm, o.storage_options)
            if not st.exists(st.normalize(pm)):
                if o.create_prepared_metadata:
                    return None
                raise PreparedMetadataError(
                    f"prepared metadata file {os.fspath(pm)!r} does not exist; pass "
                    "create_prepared_metadata=True to create it on the first save, or run "
                    "`solosave prepare --from <checkpoint> --out <file>`")
            prepared = load_prepared_metadata(pm, storage_options=o.storage_options)
        prepared.check_compatible(self.world_size, o.files_per_rank)
        prepared.rank_files(self.rank)  # this rank's section, read and checked now (not at the first save)
        return prepared

    @property
    def prepared(self) -> PreparedMetadata | None:
        """The prepared metadata in use (``None`` until the first save makes it)."""
        return self._session.prepared

    @property
    def _session(self) -> SaveSession:
        assert self._res.session is not None  # noqa: S101 - set in __init__
        return self._res.session

    @property
    def _transport(self) -> ProcessTransport | ThreadTransport:
        assert self._res.transport is not None  # noqa: S101 - set in __init__
        return self._res.transport

    # -- saving ---------------------------------------------------------------------------
    def save(self, state_dict: dict[str, Any], path: str | os.PathLike, *,
             overwrite: bool = False) -> SaveHandle:
        """Start saving ``state_dict`` to directory ``path``; returns once it is staged.

        Waits first (at most ``timeout``) for this checkpointer's previous save: one save is in
        flight at a time, so two saves never interleave and staging memory stays bounded. Every
        rank must call ``save`` with the same ``path``. No collective is called here. Values with
        ``state_dict()``/``load_state_dict()`` at the top level are saved as their state dict.
        """
        if self._closed:
            raise ValueError("this AsyncCheckpointer is closed; create a new one")
        t_start = time.time()
        p0 = time.perf_counter()
        mark = self._setup_counter.mark()
        if self._inflight is not None:
            self._wait_for(self._inflight, self.options.timeout)
        try:
            directory = self._check_destination(path, overwrite)
            # No collection of the trainer's heap inside the stall: a save allocates a few small
            # objects per item, enough to set off a generation-2 pass over the whole heap.
            # Reference counting frees them; the collector resumes afterwards.
            with gc_paused():
                built = self._session.build(state_dict, directory, overwrite)
        except Exception as e:
            abort = self._session.abort(normalize_directory(path), e)
            # no handle of this save reaches the user: it is reported by raising here
            self._inflight = self._track(abort, Started(t_start, 0.0, 0.0, 0.0, ()), None, reported=True)
            try:
                self._submit(abort, None)
            except WorkerDiedError:  # nothing to fail: the next save reports the dead worker
                self._inflight = None
            raise
        started = Started(t_start, built.plan_s, built.stage_s, time.perf_counter() - p0,
                          tuple(self._setup_counter.since(mark)))
        self._inflight = self._track(built.job, started, built.staging)
        try:
            self._submit(built.job, built.staging)
        except BaseException as e:
            # The worker never got this job: nothing will complete its future, so close() and
            # the next save() must not wait for it.
            self._inflight.published.set_exception(e)
            self._inflight = None
            raise
        return self._inflight.handle

    def _track(self, job: SaveJob, started: Started, staging: Staging | None, reported: bool = False) -> _InFlight:
        """The save in flight of ``job``: a published future, completed by :meth:`_pump`, and
        the handle that waits on it."""
        published: Future[SaveResult] = Future()
        handle = SaveHandle(job.directory, job.seq, self.rank, published, self._pump, self.options.timeout,
                            staging, reported)
        return _InFlight(handle, published, started, job.save_id)

    def _submit(self, job: SaveJob, staging: Staging | None) -> None:
        """Hand ``job`` to the worker (first, once per new staging buffer, the buffer's
        descriptor); when its copies are still running (CUDA, overlapped staging), from a thread
        that first waits for them (its device set to the trainer's), so the training thread goes
        on and no CUDA object reaches the worker. A staging that failed (e.g. a tensor changed
        before its copy) or timed out fails the save on every rank instead."""
        handoff = staging.handoff() if staging is not None else None
        if handoff is not None:  # a new staging buffer: its descriptor goes first
            self._transport.share_buffer(*handoff)
        if staging is None or staging.immediate:
            self._transport.submit(job)
            return
        timeout = self.options.timeout

        def after_copies() -> None:
            try:
                try:
                    staging.synchronize(timeout)
                    todo = job
                except Exception as e:  # noqa: BLE001 - the save fails on every rank, naming it
                    todo = SaveSession.fail_staged(job, e)
                self._transport.submit(todo)
            except BaseException as e:  # noqa: BLE001 - reported by the handle
                self._submit_error = e
            finally:
                staging.settle(max(timeout, 60.0))  # copies that outlived the timeout: their buffer goes after them

        threading.Thread(target=after_copies, name="solosave-submit", daemon=True).start()

    def _check_destination(self, path: str | os.PathLike, overwrite: bool) -> str:
        """This rank's checks of ``path`` before staging (no collective), through its storage
        (see :mod:`solosave._src.storage.base` for the calls); returns the normalized directory,
        the same string an aborted save would use."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        storage = storage_for(path, self.options.storage_options)
        directory = storage.normalize(path)
        storage.check_destination(directory)
        if not overwrite and storage.exists(storage.join(directory, METADATA_FILE)):  # wrong credentials fail here
            raise CheckpointExistsError(
                f"destination {directory!r} already holds a complete checkpoint; choose a new "
                "directory or pass overwrite=True (its .metadata is removed before any data is written)")
        storage.prepare_destination(directory, self._known_buckets)
        root = self.options.durable_root
        if overwrite and self._peers is not None:
            raise ValueError(f"save(..., overwrite=True) to {directory!r}: not with peer copies (a host would keep "
                             "the earlier save's peer files beside the new .metadata until the new ones arrive); "
                             "save under a new name")
        problem = None if root is None else durable_target_problem(directory, root, self.options.storage_options)
        if problem is not None:
            raise ValueError(problem)
        return directory

    # -- completion -------------------------------------------------------------------------
    def _pump(self, timeout: float) -> None:
        """The handles' pump: take at most one message from the worker (waiting at most
        ``timeout`` seconds) and complete the future it answers: the save in flight's, or a
        durable copy's (two tiers)."""
        f = self._inflight if self._inflight is not None and not self._inflight.published.done() else None
        if f is None and not self._copies:
            return
        outcome: JobOutcome | DurableOutcome | None
        if f is not None and self._submit_error is not None:
            e, self._submit_error = self._submit_error, None
            outcome = JobOutcome(f.handle.seq, False, SaveKind.COLLECTIVE, ErrorKind.FAILED,
                                 failures={self.rank: f"staging on the device failed: {type(e).__name__}: {e}"})
        else:
            try:
                outcome = self._transport.poll(timeout)
            except WorkerDiedError as e:
                self._copies.fail_all(f"the worker died before the copy was published ({e})")
                raise
        if outcome is None:
            return
        if isinstance(outcome, DurableOutcome):
            self._copies.complete(outcome)
            return
        if f is None or outcome.seq != f.handle.seq:
            raise RuntimeError(f"internal: outcome for save {outcome.seq}, expected "
                               f"{f.handle.seq if f is not None else 'none'}")
        self._session.absorb(outcome)
        durable = None
        lag = self._copies.lag()  # earlier saves not yet on the durable tier
        if outcome.ok and outcome.durable:
            durable = self._copies.track(outcome.seq, outcome.durable, self._pump, self.options.timeout)
        complete(f.published, outcome, f.handle.path, self.rank, f.started, durable, f.save_id, lag)

    def _wait_for_copies(self, timeout: float) -> None:
        """Pump (bounded) until every durable copy is reported; never raises."""
        deadline = time.monotonic() + timeout
        try:
            while self._copies and time.monotonic() < deadline:
                self._pump(min(max(deadline - time.monotonic(), 0.0), 1.0))
        except Exception as e:  # noqa: BLE001 - close never raises; the copies are reported failed below
            log.warning("solosave: waiting for the durable copies: %s", e)

    def _wait_for(self, f: _InFlight, timeout: float) -> None:
        """Wait (bounded) for the save in flight to finish, without reporting it to the user."""
        wait_published(f.published, self._pump, timeout, f.handle.path, self.rank)

    def close(self, timeout: float | None = None) -> None:
        """Finish or abandon the save in flight (bounded), stop the worker, free memory.

        Every rank should call it. It first waits, at most ``timeout`` seconds (default: the
        checkpointer's ``timeout``), for the save in flight: normally that save **finishes**
        and is published, and its handle reports the result. If it does not finish in time (a
        stuck write, a peer that does not answer) the save is **abandoned**: the worker is
        stopped, nothing more of it is written, and its handle's ``wait()`` raises
        :class:`~solosave.CheckpointError` saying so; since ``.metadata`` is published last and
        atomically, the checkpoint is then either complete or has no ``.metadata``; the previous
        checkpoints are untouched. ``close()`` itself never raises (it logs a warning), takes at
        most about ``min(timeout, 30) + 10`` seconds beyond the save's wait, and leaves no worker
        process or staging buffer behind. Idempotent. Rank 0 serves the store from which the
        other ranks read whether their saves were published: its ``close()`` returns once every
        other rank has closed too (each tells it, last), or after ``min(timeout, 10)`` more
        seconds.

        With two tiers it then waits, within the same ``timeout``, for the durable copies still
        running (the last save's above all); a copy that has not ended by then is abandoned (its
        upload aborted, nothing published on the durable tier) and its ``durable.wait()``
        returns a failed :class:`~solosave._src.save.result.DurableResult` saying so.
        """
        if self._closed:
            return
        self._closed = True
        t = self.options.timeout if timeout is None else timeout
        deadline = time.monotonic() + t
        f = self._inflight
        try:
            if f is not None and not f.published.done():
                try:
                    self._wait_for(f, t)
                except Exception as e:  # noqa: BLE001 - close never raises for a failed save
                    if not isinstance(e, WorkerDiedError):
                        log.warning("solosave: closing with an unfinished save to %s: %s", f.handle.path, e)
            error = f.published.exception() if f is not None and f.published.done() else None
            if f is not None and error is not None and not f.handle.reported:
                log.warning("solosave: save to %s failed and was never waited for: %s", f.handle.path, error)
            self._wait_for_copies(max(deadline - time.monotonic(), 0.0))
        finally:
            self._finalizer.detach()
            try:
                self._res.release(min(t, 30.0))
            except Exception as e:  # noqa: BLE001 - close never raises
                log.warning("solosave: releasing the checkpointer's resources: %s", e)
            if f is not None and not f.published.done():
                self._settle_abandoned(f, t)
            self._settle_copies(t)

    def _settle_copies(self, t: float) -> None:
        """After the worker stopped: the copies it reported last, then the rest as abandoned."""
        for late in [o for o in self._transport.leftover if isinstance(o, DurableOutcome)]:
            self._copies.complete(late)
        if self._copies:
            log.warning("solosave: close() abandoned %d durable cop%s still running after %g s: %s",
                        len(self._copies), "y" if len(self._copies) == 1 else "ies", t,
                        ", ".join(self._copies.paths()))
        self._copies.fail_all(f"abandoned by close(): the copy did not end within {t:g} s and this rank's "
                           "worker was stopped")

    def _settle_abandoned(self, f: _InFlight, t: float) -> None:
        seq, path = f.handle.seq, f.handle.path
        late = [o for o in self._transport.leftover if isinstance(o, JobOutcome) and o.seq == seq]
        try:
            st = storage_for(path, self.options.storage_options)
            published = st.exists(st.join(path, METADATA_FILE))
        except Exception:  # noqa: BLE001 - storage unreachable: reported as not published
            published = False
        complete(f.published, late[0] if late else JobOutcome(
            seq, False, SaveKind.COLLECTIVE, ErrorKind.FAILED, published=published, failures={
                self.rank: f"abandoned by close(): the save did not finish within {t:g} s "
                "and this rank's worker was stopped; " + (
                    f"{METADATA_FILE} exists (the coordinator published it before it was "
                    "stopped)" if published else f"no {METADATA_FILE} was published")}), path, self.rank, f.started)

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _check_thread_mode_group(options: CheckpointerOptions, group_size: int) -> None:
    """Thread mode makes its gloo group with ``torch.distributed.new_group``. When the default
    group is bound to a device (``init_process_group(..., device_id=...)``, eager NCCL) and the
    checkpointer's group leaves some ranks out, torch has every rank outside it join an NCCL
    communicator split (``_new_process_group_helper``: ``perform_nocolor_split``) that the ranks
    inside a gloo group never join: those ranks would hang. Refused at once, on every rank of
    the group alike (they all see the same sizes)."""
    if options.worker == "process" or group_size == dist.get_world_size():
        return
    if getattr(dist.group.WORLD, "bound_device_id", None) is not None:
        raise ValueError("worker='thread' with a process_group smaller than the world, under a "
                         "default group bound to a device (init_process_group(device_id=...)), would hang "
                         "in torch's new_group on the other ranks; use worker='process' (the default)")


def _check_writer(writer: FileWriter | None, options: CheckpointerOptions) -> FileWriter | None:
    if writer is not None and not isinstance(writer, FileWriter):
        raise TypeError(f"writer must be a solosave.FileWriter, got {type(writer).__name__}")
    if options.worker == "process" and writer is not None and type(writer).__module__ == "__main__":
        raise ValueError(
            f"writer class {type(writer).__name__} is defined in the main script, which the "
            "worker process does not import; define it in an importable module, or pass "
            "worker='thread'")
    if options.checksums:
        if writer is None:
            return FileWriter(checksums=True)
        if not writer.checksums:
            raise ValueError("checksums=True with a writer whose checksums are off: construct "
                             "the writer with checksums=True (FileWriter(checksums=True)) instead")
    return writer
