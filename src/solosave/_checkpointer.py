"""The public saver: :class:`AsyncCheckpointer`, :class:`SaveHandle`, :class:`SaveResult`.

Who calls what, in which order (every rank of ``process_group``):

1. ``AsyncCheckpointer(...)`` - collective once: rank 0 shares a store address (one broadcast)
   and each rank starts its worker, which forms the background gloo channel.
2. ``save(state_dict, path)`` - **no collective**: waits for the previous save of this
   checkpointer (bounded), plans locally, stages into host buffers, hands the job to the worker
   and returns a :class:`SaveHandle`. Every rank must call ``save`` for every checkpoint, in the
   same order.
3. ``handle.done()`` - non-blocking, no collective; ``handle.wait(timeout)`` - bounded, returns a
   :class:`SaveResult` or raises :class:`~solosave.CheckpointError` (the same on every rank).
4. ``close()`` (or leaving the ``with`` block) - waits for the save in flight (bounded), stops
   the worker and frees the staging memory; no processes, segments or files are left behind.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata

from ._coordinate import Channel, CollectiveCall, CollectiveCounter, new_gloo_group, share_store_address
from ._engine import Engine, JobOutcome, Mode, SaveJob
from ._errors import (
    CheckpointError,
    CheckpointExistsError,
    LayoutDriftError,
    PreparedMetadataError,
    SaveTimeoutError,
    WorkerDiedError,
)
from ._options import CheckpointerOptions
from ._plan import ItemSpec, LocalPlan, plan_local
from ._prepared import PreparedMetadata, load_prepared_metadata
from ._publish import METADATA_FILE
from ._stage import Stager
from ._worker import ChannelSpec, ProcessTransport, ThreadTransport
from ._write import FileWriter

log = logging.getLogger("solosave")


@dataclass(frozen=True, slots=True)
class PhaseTimings:
    """Seconds per phase of one save, on this rank."""

    plan: float
    stage: float
    write: float
    coordinate: float
    publish: float
    #: Time the caller spent inside ``save()`` (the training loop's stall).
    block: float
    #: From entering ``save()`` to the background finishing (published, on the coordinator).
    to_published: float


@dataclass(frozen=True, slots=True)
class SaveResult:
    """The outcome of one save on this rank."""

    path: str
    rank: int
    #: "collective", "create", "cached", "reuse" or "reuse+fallback".
    mode: str
    bytes_written: int
    timings: PhaseTimings
    collectives_calling_thread: tuple[CollectiveCall, ...]
    collectives_background: tuple[CollectiveCall, ...]
    #: Coordinator: whether it published ``.metadata``; other ranks: ``None``.
    published: bool | None
    warnings: tuple[str, ...] = ()

    def collectives(self, where: str = "all") -> dict[str, dict[str, int]]:
        """``{kind: {"count": n, "bytes": payload}}`` for ``where`` in
        ``"all"``, ``"calling_thread"``, ``"background"``."""
        calls = {"all": self.collectives_calling_thread + self.collectives_background,
                 "calling_thread": self.collectives_calling_thread,
                 "background": self.collectives_background}[where]
        out: dict[str, dict[str, int]] = {}
        for c in calls:
            d = out.setdefault(c.kind, {"count": 0, "bytes": 0})
            d["count"] += 1
            d["bytes"] += c.payload_bytes
        return out


class SaveHandle:
    """A save in flight. ``done()`` never blocks and never calls a collective."""

    def __init__(self, owner: AsyncCheckpointer, job: SaveJob, t_start: float, t_plan: float,
                 t_stage: float, t_block: float, calling: tuple[CollectiveCall, ...]) -> None:
        self._owner = owner
        self._job = job
        self.path = job.directory
        self.seq = job.seq
        self._t = (t_start, t_plan, t_stage, t_block)
        self._calling = calling
        self._outcome: JobOutcome | None = None
        self._result: SaveResult | None = None
        self._error: BaseException | None = None
        self.reported = False

    def _set(self, outcome: JobOutcome) -> None:
        self._outcome = outcome
        t_start, t_plan, t_stage, t_block = self._t
        tm = outcome.timings
        if outcome.ok:
            self._result = SaveResult(
                path=self.path, rank=self._owner.rank, mode=outcome.mode,
                bytes_written=outcome.bytes_written,
                timings=PhaseTimings(t_plan, t_stage, tm.get("write", 0.0), tm.get("coordinate", 0.0),
                                     tm.get("publish", 0.0), t_block,
                                     max(outcome.finished_at - t_start, 0.0)),
                collectives_calling_thread=self._calling,
                collectives_background=outcome.collectives,
                published=outcome.published, warnings=outcome.warnings)
            for w in outcome.warnings:
                warnings.warn(w, RuntimeWarning, stacklevel=3)
        elif outcome.error_kind == "drift":
            self._error = LayoutDriftError(
                f"save to {self.path} stopped: the layout drifted from the prepared metadata on "
                f"rank(s) {sorted(outcome.drifts)}; nothing was published (on_layout_drift='raise'). "
                "Recreate the prepared metadata or use on_layout_drift='fallback'.", outcome.drifts)
        else:
            self._error = CheckpointError(
                f"save to {self.path} failed on rank(s) {sorted(outcome.failures)}; no "
                f"{METADATA_FILE} was published (the previous checkpoint is untouched)",
                outcome.failures)

    def done(self) -> bool:
        if self._outcome is None:
            self._owner._pump(0.0)
        return self._outcome is not None

    def wait(self, timeout: float | None = None) -> SaveResult:
        """Wait (at most ``timeout`` seconds; default: the checkpointer's ``timeout``) and
        return the :class:`SaveResult`, or raise the save's error (the same on every rank)."""
        if self._outcome is None:
            self._owner._wait_for(self, self._owner.options.timeout if timeout is None else timeout)
        self.reported = True
        if self._error is not None:
            raise self._error
        assert self._result is not None  # noqa: S101
        return self._result


class AsyncCheckpointer:
    """Asynchronous DCP-format saves with a persistent worker per rank.

    Args:
        process_group: the ranks that save together (default: the world group). Works with gloo
            and NCCL; the background uses its own gloo channel, never this group's stream.
        workers: files (and writer threads) per rank.
        persistent_worker: one spawned worker process per rank, reused by every save (default);
            ``False`` runs the background in a thread of this process (needs every rank of the
            *world* to construct the checkpointer, for ``new_group``).
        prepared_metadata: reuse mode - a prepared-metadata path, ``Metadata`` or
            :class:`PreparedMetadata`; every save then needs one 8-byte ``all_reduce``.
        create_prepared_metadata: the first save creates the ``prepared_metadata`` file if it
            does not exist (collective path once), then every save reuses it.
        assume_constant_structure: without prepared metadata, stop gathering plans once two
            consecutive saves had the same global plan (write results are still gathered).
        on_layout_drift: ``"fallback"`` (default) or ``"raise"``, for a reuse save whose written
            layout no longer matches the prepared metadata.
        timeout: seconds; bounds every wait, the worker's start and each collective.
        writer: a :class:`~solosave.FileWriter` (subclass) that writes the files.
        checksums: record a CRC32 of every record in a sidecar next to each data file
            (``__{rank}_{n}.distcp.crc32``), checked by ``solosave verify``; off by default
            (it costs one CRC pass over the bytes, in the background). Same as
            ``writer=FileWriter(checksums=True)``.
    """

    def __init__(self, process_group: Any = None, workers: int = 1, persistent_worker: bool = True,
                 prepared_metadata: Any = None, create_prepared_metadata: bool = False,
                 assume_constant_structure: bool = False, on_layout_drift: str = "fallback",
                 timeout: float = 600.0, writer: FileWriter | None = None,
                 checksums: bool = False) -> None:
        self.options = CheckpointerOptions(
            workers=workers, persistent_worker=persistent_worker,
            prepared_metadata=prepared_metadata, create_prepared_metadata=create_prepared_metadata,
            assume_constant_structure=assume_constant_structure, on_layout_drift=on_layout_drift,
            timeout=timeout)
        if writer is not None and not isinstance(writer, FileWriter):
            raise TypeError(f"writer must be a solosave.FileWriter, got {type(writer).__name__}")
        if persistent_worker and writer is not None and type(writer).__module__ == "__main__":
            raise ValueError(
                f"writer class {type(writer).__name__} is defined in the main script, which the "
                "worker process does not import; define it in an importable module, or pass "
                "persistent_worker=False")
        if checksums:
            if writer is None:
                writer = FileWriter(checksums=True)
            elif not writer.checksums:
                raise ValueError("checksums=True with a writer whose checksums are off: construct "
                                 "the writer with checksums=True (FileWriter(checksums=True)) instead")
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("torch.distributed is not initialised: call "
                             "torch.distributed.init_process_group(...) before creating an "
                             "AsyncCheckpointer (for a single process: world_size=1, backend='gloo')")
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self._prepared: PreparedMetadata | None = self._initial_prepared()
        self._token = 1 if self._prepared is not None else 0
        self._sent_token = 0
        self._setup_counter = CollectiveCounter()
        self._stager = Stager()
        self._seq = 0
        self._inflight: SaveHandle | None = None
        self._closed = False
        self._store = None
        self._group = None
        self._written: frozenset | None = None
        self._known_hash: str | None = None
        self._cache_validated = False
        if persistent_worker:
            self._store, (host, port, prefix) = share_store_address(
                process_group, self._setup_counter, timeout)
            spec = ChannelSpec(host, port, prefix, self.rank, self.world_size, float(timeout))
            self._transport: ProcessTransport | ThreadTransport = ProcessTransport(spec, workers, writer)
        else:
            self._group = new_gloo_group(process_group, self._setup_counter, timeout)
            self._transport = ThreadTransport(Engine(Channel(self._group, CollectiveCounter()), workers, writer))

    # -- prepared metadata ----------------------------------------------------------------
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
            if not os.path.exists(pm):
                if o.create_prepared_metadata:
                    return None
                raise PreparedMetadataError(
                    f"prepared metadata file {os.fspath(pm)!r} does not exist; pass "
                    "create_prepared_metadata=True to create it on the first save, or run "
                    "`solosave prepare --from <checkpoint> --out <file>`")
            prepared = load_prepared_metadata(pm)
        prepared.check_compatible(self.world_size, o.workers)
        return prepared

    @property
    def prepared(self) -> PreparedMetadata | None:
        """The prepared metadata in use (``None`` until created in create mode)."""
        return self._prepared

    @property
    def worker_pid(self) -> int:
        return self._transport.pid

    # -- saving ---------------------------------------------------------------------------
    def save(self, state_dict: dict[str, Any], path: str | os.PathLike, *,
             overwrite: bool = False) -> SaveHandle:
        """Start saving ``state_dict`` to directory ``path``; returns once it is staged.

        Waits first (at most ``timeout``) for this checkpointer's previous save: one save is in
        flight at a time, so two saves never interleave and staging memory stays bounded. Every
        rank must call ``save`` with the same ``path``. No collective is called here.
        """
        if self._closed:
            raise ValueError("this AsyncCheckpointer is closed; create a new one")
        t_start = time.time()
        p0 = time.perf_counter()
        mark = self._setup_counter.mark()
        if self._inflight is not None:
            self._wait_for(self._inflight, self.options.timeout)
        directory = self._check_destination(path, overwrite)
        t0 = time.perf_counter()
        plan = plan_local(state_dict)
        mode, to_stage, layout, drift = self._choose(plan)
        t1 = time.perf_counter()
        staged = self._stager.stage(to_stage, plan.values)
        t2 = time.perf_counter()
        self._seq += 1
        send_prepared = None
        if mode is Mode.REUSE and self._sent_token != self._token:
            send_prepared = self._prepared
            self._sent_token = self._token
        job = SaveJob(
            seq=self._seq, directory=directory, mode=mode, staged=staged, held=tuple(plan.specs),
            structure_hash=plan.structure_hash, planner_data=plan.planner_data, layout=layout,
            local_drift=tuple(drift), prepared_token=self._token, prepared=send_prepared,
            prepared_path=self.options.prepared_path,
            create_prepared=self.options.create_prepared_metadata and self._prepared is None,
            on_layout_drift=self.options.on_layout_drift, submitted_at=time.time())
        self._transport.submit(job)
        calling = tuple(self._setup_counter.since(mark))
        handle = SaveHandle(self, job, t_start, t1 - t0, t2 - t1, time.perf_counter() - p0, calling)
        self._inflight = handle
        return handle

    def _check_destination(self, path: str | os.PathLike, overwrite: bool) -> str:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        p = Path(path)
        if p.exists() and not p.is_dir():
            raise ValueError(f"destination {os.fspath(p)!r} exists and is not a directory")
        if (p / METADATA_FILE).exists() and not overwrite:
            raise CheckpointExistsError(
                f"destination {os.fspath(p)!r} already holds a complete checkpoint; choose a new "
                "directory or pass overwrite=True (its .metadata is removed before any data is written)")
        try:
            p.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot create checkpoint directory {os.fspath(p)!r}: {e.strerror}; "
                             "choose a writable location") from e
        if not os.access(p, os.W_OK | os.X_OK):
            raise ValueError(f"checkpoint directory {os.fspath(p)!r} is not writable; choose a "
                             "writable location or fix its permissions")
        return os.fspath(p)

    def _choose(self, plan: LocalPlan) -> tuple[Mode, list[ItemSpec], tuple, list[str]]:
        """Pick the mode (identical on every rank: it depends only on shared outcomes) and what
        to stage (this rank's writes when the structure is known; all it owns otherwise)."""
        owned = [s for s in plan.specs if s.owner]
        if self._prepared is not None:
            pm = self._prepared
            layout = pm.rank_files(self.rank)
            drift: list[str] = []
            sizes = pm.chunk_sizes
            for _, items in layout:
                for p in items:
                    s = plan.by_key.get(p.key)
                    if s is None:
                        drift.append(f"{p.key[0]}: prepared on this rank but not in its state dict")
                    elif s.offsets is not None and sizes.get(p.key) != s.sizes:
                        drift.append(f"{s.fqn}: chunk size {list(s.sizes or ())} differs from the prepared one")
            for s in plan.specs:
                msg = pm.spec_matches(s)
                if msg:
                    drift.append(msg)
            if drift:
                return Mode.REUSE, owned, layout, drift
            return Mode.REUSE, [plan.by_key[p.key] for _, items in layout for p in items], layout, []
        if self._cache_validated:
            if plan.structure_hash == self._known_hash and self._written is not None:
                return Mode.CACHED, [s for s in plan.specs if s.key in self._written], (), []
            return Mode.CACHED, owned, (), ["the structure of this rank's state dict changed"]
        return Mode.COLLECTIVE, owned, (), []

    # -- completion -------------------------------------------------------------------------
    def _pump(self, timeout: float) -> None:
        """Take at most one outcome from the worker (bounded) and attach it to its handle."""
        h = self._inflight
        if h is None or h._outcome is not None:
            return
        outcome = self._transport.poll(timeout)
        if outcome is None:
            return
        if outcome.seq != h.seq:  # pragma: no cover - one save in flight
            raise RuntimeError(f"internal: outcome for save {outcome.seq}, expected {h.seq}")
        self._absorb(outcome)
        h._set(outcome)

    def _absorb(self, outcome: JobOutcome) -> None:
        if outcome.ok:
            self._written = outcome.written_keys
            self._known_hash = self._inflight._job.structure_hash if self._inflight else None
            self._cache_validated = (self.options.assume_constant_structure and self._prepared is None
                                     and outcome.cache_validated)
            if outcome.prepared_metadata is not None:
                self._prepared = PreparedMetadata.from_metadata(
                    outcome.prepared_metadata, self.world_size, self.options.workers,
                    source=self.options.prepared_path or "created in memory")
                self._token += 1
                self._cache_validated = False
        else:
            self._cache_validated = False
            self._written = None

    def _wait_for(self, handle: SaveHandle, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while handle._outcome is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SaveTimeoutError(
                    f"save to {handle.path} did not finish within {timeout:.0f} s on rank {self.rank}; "
                    "another rank may be slow, stuck or dead (its error, if any, is on that rank). "
                    "Raise `timeout` if saves are legitimately slow.")
            self._pump(min(left, 1.0))

    def wait_all(self, timeout: float | None = None) -> list[SaveResult]:
        """Wait for the save in flight; return its result or raise its error."""
        h = self._inflight
        if h is None:
            return []
        return [h.wait(timeout)]

    def close(self, timeout: float | None = None) -> None:
        """Finish or abandon the save in flight (bounded), stop the worker, free memory.

        Every rank should call it. It first waits, at most ``timeout`` seconds (default: the
        checkpointer's ``timeout``), for the save in flight: normally that save **finishes**
        and is published, and its handle reports the result. If it does not finish in time (a
        stuck write, a peer that does not answer) the save is **abandoned**: the worker is
        stopped (asked, then terminated), nothing more of it is written, and its handle's
        ``wait()`` raises :class:`~solosave.CheckpointError` saying so; since ``.metadata`` is
        published last and atomically, the checkpoint is then either complete (the save got
        that far) or has no ``.metadata``; the previous checkpoints are untouched. ``close()``
        itself never raises for a failed or abandoned save (it logs a warning), takes at most
        about ``2 * min(timeout, 30) + 5`` seconds beyond the save's wait, and leaves no worker
        process or shared-memory segment behind. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        t = self.options.timeout if timeout is None else timeout
        h = self._inflight
        try:
            if h is not None and h._outcome is None:
                try:
                    self._wait_for(h, t)
                except WorkerDiedError:
                    pass  # the handle reports it (see below)
                except Exception as e:  # noqa: BLE001 - close never raises for a failed save
                    log.warning("solosave: closing with an unfinished save to %s: %s", h.path, e)
            if h is not None and h._error is not None and not h.reported:
                log.warning("solosave: save to %s failed and was never waited for: %s", h.path, h._error)
        finally:
            try:
                self._transport.close(min(t, 30.0))
            finally:
                self._stager.close()
                if self._group is not None:
                    try:
                        dist.destroy_process_group(self._group)
                    except Exception:  # noqa: BLE001,S110
                        pass
                self._store = None
                if h is not None and h._outcome is None:  # abandoned: settle its handle
                    late = [o for o in self._transport.leftover if o.seq == h.seq]
                    published = os.path.exists(os.path.join(h.path, METADATA_FILE))
                    h._set(late[0] if late else JobOutcome(
                        h.seq, False, h._job.mode.value, error_kind="failed", failures={
                            self.rank: f"abandoned by close(): the save did not finish within {t:g} s "
                            "and this rank's worker was stopped; " + (
                                f"{METADATA_FILE} exists (the coordinator published it before it was "
                                "stopped)" if published else f"no {METADATA_FILE} was published")}))

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

