"""The background half of a save: write, coordinate, publish (worker process or thread).

One :class:`Engine` per rank runs one :class:`~solosave._src.coordination.protocol.SaveJob` at a time and
returns a :class:`~solosave._src.coordination.protocol.JobOutcome`. All ranks' engines run the same sequence of
collectives for a save, chosen from values every rank shares (the job's mode, which every trainer
picks from outcomes that every rank received, and the values the collectives return). Per mode:

``COLLECTIVE`` (first save, or no prepared metadata; ``save/collective.py``)
    gather plan requests -> coordinator runs the global planner -> scatter each rank's decision
    -> write -> gather write reports -> coordinator publishes ``.metadata`` -> broadcast the
    outcome (and, when the save makes the prepared metadata, the metadata itself).
``REUSE`` (prepared metadata: from a file, or made in memory by an earlier save)
    write in the prepared layout -> local layout guard -> **one 8-byte all_reduce** of the
    status (failed / drifted / ok) and of the save's identity (``_protocol.encode_status``) ->
    if every rank is ok, the coordinator publishes the prepared metadata with this checkpoint's
    ``storage_meta`` (on a thread beside its data it wrote the load index, ``index/writer``, and
    ``.metadata``'s bytes into a temporary file, so publishing is a rename), then posts a
    receipt that the other ranks wait for (a store key, not a collective), so every rank knows
    whether the save was published. On "failed" every rank all-gathers the errors (failure
    path only); on "drifted" with ``"raise"`` every rank all-gathers the drifts; with
    ``"fallback"`` every rank runs the collective path for this save and the prepared metadata
    is refreshed.

Errors are told apart: a per-save failure (a write error, a bad value, a drift) fails that save
on every rank and the next save runs normally. A failed collective (:class:`ChannelError`: a
peer died or timed out), ranks found *out of step* (running different saves), or an internal
error (a bug, reported with its traceback) leave the engine **broken**: every later job fails at
once, without a collective, with the reason, because a channel in that state can pair one save's
collectives with another's. The checkpointer must then be closed and recreated on every rank.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import threading
import time
import traceback
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from solosave._src.coordination.channel import Channel, ChannelError, OutOfStep
from solosave._src.coordination.protocol import (
    EngineSettings,
    ErrorKind,
    ItemSpec,
    JobOutcome,
    Mode,
    PlacedItem,
    ReusePlan,
    SaveJob,
    SaveKind,
    StagedItem,
    Status,
    WriteResult,
    decode_status,
    encode_status,
)
from solosave._src.core.errors import PreparedMetadataError, describe
from solosave._src.formats.dcp import data_file_problem
from solosave._src.formats.metadata_template import MetadataTemplate
from solosave._src.index import writer as index
from solosave._src.plan.layout import check_layout
from solosave._src.prepared.prepared import PreparedMetadata
from solosave._src.save.buffer import BufferReader
from solosave._src.save.collective import run_collective
from solosave._src.save.publish import publish_metadata, stage_metadata, unpublish
from solosave._src.save.writer import FileWriter, Record
from solosave._src.storage.storage import StagedCommit, is_url, storage_for

RECREATE = ("this checkpointer cannot coordinate any more saves: close() it and create a new "
            "AsyncCheckpointer on every rank")


class Engine:
    """Runs save jobs for one rank. Owned by a worker process or a worker thread.

    ``settings`` are the checkpointer's (sent once); ``writer`` writes the files.
    """

    def __init__(self, channel: Channel, settings: EngineSettings, writer: FileWriter | None = None) -> None:
        self.channel = channel
        self.rank = channel.rank
        self.world_size = channel.world_size
        self.settings = settings
        self.writer = writer or FileWriter()
        if settings.storage_options and self.writer.storage_options is None:
            self.writer.storage_options = settings.storage_options
        self.reader = BufferReader()
        #: The record of each tensor item written by the last save, by item identity: a job of an
        #: unchanged structure brings the same items and the reader the same views, so the
        #: records are looked up, not rebuilt (building 2048 of them took 6.5 ms per save, issue 13).
        self._records: dict[int, Record] = {}
        self._prepared: tuple[int, PreparedMetadata] | None = None
        #: Coordinator: the template of the metadata it last made (create mode, fallback), with
        #: that publication's ``save_id``, adopted by the prepared metadata the trainer sends next.
        self.made_template: tuple[str, MetadataTemplate, bytes] | None = None
        self.warnings: list[str] = []
        #: Why the channel cannot be used any more, and the kind of that failure.
        self.broken: tuple[ErrorKind, str] | None = None
        #: The reuse write of the last structure (see :class:`_ReuseProgram`).
        self._reuse_program: _ReuseProgram | None = None

    @property
    def workers(self) -> int:
        return self.settings.workers

    def close(self) -> None:
        self._records = {}  # they hold views of the mapping the reader closes
        self._reuse_program = None
        self.reader.close()

    # ------------------------------------------------------------------------------------
    def run(self, job: SaveJob) -> JobOutcome:
        """Run one save on this rank (every rank runs the same job; see the module doc)."""
        mark = self.channel.counter.mark()
        timings: dict[str, float] = defaultdict(float)
        if self.broken is not None:
            kind, why = self.broken
            return JobOutcome(job.seq, False, _kind(job), error_kind=kind,
                              failures={self.rank: why}, finished_at=time.time())
        try:
            out = self._reuse(job, timings) if job.mode is Mode.REUSE else run_collective(self, job, timings)
        except OutOfStep as e:
            out = self._break(job, ErrorKind.OUT_OF_STEP, f"not published: the ranks are out of step ({e}); a "
                              "save() timed out on some ranks but not on others")
        except ChannelError as e:
            out = self._break(job, ErrorKind.CHANNEL, f"the background channel failed on this rank during the "
                              f"save to {job.directory} ({e}): another rank's process or worker died, or "
                              "did not answer within the timeout")
        except Exception as e:  # noqa: BLE001 - a bug in solosave: reported in full
            out = self._break(job, ErrorKind.INTERNAL, "internal error in solosave (please report it): "
                              + "".join(traceback.format_exception(e)).rstrip())
        calls = tuple(self.channel.counter.since(mark))
        if self.warnings:
            out = dataclasses.replace(out, warnings=out.warnings + tuple(self.warnings))
            self.warnings = []
        timings["coordinate"] = sum(c.seconds for c in calls)
        return dataclasses.replace(out, timings=dict(timings), collectives=calls, finished_at=time.time())

    def _break(self, job: SaveJob, kind: ErrorKind, why: str) -> JobOutcome:
        self.broken = (kind, f"{why}; {RECREATE}")
        return JobOutcome(job.seq, False, _kind(job), error_kind=kind, failures={self.rank: self.broken[1]})

    # -- writing ----------------------------------------------------------------------------
    def write(self, job: SaveJob, files: list[tuple[str, list[StagedItem]]], pad: dict,
              timings: dict[str, float]) -> list[WriteResult]:
        """Write this rank's files of ``job`` (``pad``: slot length per BYTES item key)."""
        t0 = time.perf_counter()
        todo = [(name, [self._record(job, it, pad) for it in items]) for name, items in files]
        kept = [it for _, items in files for it in items]
        self.reader.keep_only(kept)
        if len(self._records) > sum(it.payload is None for it in kept):
            self._records = {k: r for k, r in ((id(it), self._records.get(id(it))) for it in kept) if r is not None}
        timings["write"] += time.perf_counter() - t0
        return self._write_records(job, todo, timings)

    def _write_records(self, job: SaveJob, todo: list[tuple[str, list[Record]]],
                       timings: dict[str, float]) -> list[WriteResult]:
        """Write ``todo`` (each file's records) into ``job``'s directory: only this rank's data
        files, directly inside it (a name from a crafted prepared file never reaches the writer)."""
        for name, _ in todo:
            why = data_file_problem(name, self.rank)
            if why is not None:
                raise ValueError(f"refusing to write {why}")
        t0 = time.perf_counter()
        storage_for(job.directory, self.settings.storage_options).makedirs(job.directory)
        unpublish(job.directory, self.settings.storage_options)  # never an old .metadata next to new data
        try:
            return self.writer.write_files(job.directory, todo)
        finally:
            del todo  # the records hold views of the staging buffer
            timings["write"] += time.perf_counter() - t0

    def _record(self, job: SaveJob, it: StagedItem, pad: dict) -> Record:
        if it.payload is not None:
            return Record(it.spec.key, payload=it.payload, pad_to=pad.get(it.spec.key))
        view = self.reader.tensor(job.staged, it)
        hit = self._records.get(id(it))
        if hit is not None and hit.tensor is view:  # the reader's view of this very item
            return hit
        rec = self._records[id(it)] = Record(it.spec.key, tensor=view)
        return rec

    def write_index(self, job: SaveJob, source: Callable[[], tuple[bytes | None, MetadataTemplate]],
                    save_id: str, timings: dict[str, float]) -> None:
        """Coordinator, before :meth:`publish`: the load index of the ``.metadata`` that the
        template renders with ``save_id`` (``index/writer``; ``source()``: the index body, ``None`` for
        none, and the template). The index only speeds loads up: a failure to read its body or write it is a
        warning (loads then read ``.metadata``; an index left by an earlier save does not match
        this ``.metadata``'s ``save_id`` and is not used)."""
        if is_url(job.directory):  # URL loads read .metadata (DCP's read path)
            return
        t0 = time.perf_counter()
        try:
            body, template = source()
            if body is None:
                return
            index.write(job.directory, index.render(body, template, os.fspath(job.directory), save_id),
                        fsync=self.writer.fsync, storage_options=self.settings.storage_options)
        except Exception as e:  # noqa: BLE001 - the checkpoint is complete without it
            self.warnings.append(f"the load index of {job.directory} was not written ({describe(e)}); "
                                 "loads of this checkpoint read the whole .metadata")
        timings["publish"] += time.perf_counter() - t0

    def publish(self, job: SaveJob, data: bytes | Sequence[bytes], timings: dict[str, float]) -> None:
        """Coordinator: write ``.metadata`` last, atomically."""
        t0 = time.perf_counter()
        publish_metadata(job.directory, data, fsync=self.writer.fsync,
                         storage_options=self.settings.storage_options)
        timings["publish"] += time.perf_counter() - t0

    # -- the reuse path ---------------------------------------------------------------------
    def prepared_for(self, job: SaveJob) -> PreparedMetadata:
        if job.prepared is not None:
            self._prepared = (job.prepared_token, job.prepared)
            made, self.made_template = self.made_template, None
            if made is not None:
                job.prepared.adopt_template(*made)
        if self._prepared is None or self._prepared[0] != job.prepared_token:
            raise RuntimeError("internal: the worker has no prepared metadata for this token")
        return self._prepared[1]

    def _reuse_write(self, job: SaveJob, timings: dict[str, float]
                     ) -> tuple[Status, list[str], list | None, str | None]:
        """Write the prepared layout and check it: ``(status, drifts, results, error)``."""
        if job.abort is not None:
            return Status.FAILED, [], None, job.abort
        plan = job.reuse
        if plan is None:
            return Status.FAILED, [], None, "internal: a reuse job without a reuse plan"
        if plan.drift:
            return Status.DRIFT, list(plan.drift), None, None
        try:
            program = self._program(job, plan)
            results = self._write_records(job, program.records(job, self), timings)
        except Exception as e:  # noqa: BLE001 - becomes status FAILED on every rank
            return Status.FAILED, [], None, describe(e)
        if results == program.checked:  # what this structure wrote last time, checked then
            return Status.OK, [], results, None
        drifts = check_layout(program.placed, results)
        if not drifts:
            program.checked = results
        return (Status.DRIFT if drifts else Status.OK), drifts, results, None

    def _program(self, job: SaveJob, plan: ReusePlan) -> _ReuseProgram:
        """The reuse write of ``job``'s structure: the last one if the job brings the same plan
        and item specs (as every job of an unchanged structure does), else a new one."""
        items = job.staged.items
        p = self._reuse_program
        if (p is not None and p.plan is plan and len(p.specs) == len(items)
                and all(map(operator.is_, p.specs, [it.spec for it in items]))):
            return p
        at = {it.spec.key: i for i, it in enumerate(items)}
        placed = plan.placed()
        files = [(rel, [at[x.key] for x in xs]) for rel, xs in plan.layout]
        pad = {x.key: x.length for x in placed if items[at[x.key]].payload is not None}
        self.reader.keep_only(list(items))  # a new structure: the views and records of the last go
        self._records = {}
        self._reuse_program = p = _ReuseProgram(plan, tuple(it.spec for it in items), files, pad, placed)
        return p

    def _ahead(self, job: SaveJob, prepared: Any, save_id: str) -> _Ahead | None:
        """Coordinator of a reuse save: while this rank writes its data, a thread writes the
        load index and stages ``.metadata`` (a temporary file beside it; both are known before
        the save: the prepared body and template, this ``save_id``). :meth:`_reuse_publish`
        takes the staged file and renames it into place; any other outcome discards it."""
        if not self.channel.is_coordinator or prepared is None or job.abort is not None:
            return None

        def run(ahead: _Ahead) -> None:
            try:  # it may run before this rank's data write creates the directory
                template = prepared.template  # read back once per prepared file: see _template_drift
                storage_for(job.directory, self.settings.storage_options).makedirs(job.directory)
            except Exception:  # noqa: BLE001 - the data write or the engine meets (and reports) the same error
                return
            self.write_index(job, lambda: (prepared.index_body, template), save_id, defaultdict(float))
            try:
                data = template.render_parts(os.fspath(job.directory), save_id)
                ahead.offer(stage_metadata(job.directory, data, fsync=self.writer.fsync,
                                           storage_options=self.settings.storage_options))
            except Exception:  # noqa: BLE001,S110 - publishing writes it whole, and reports its error
                pass

        return _Ahead(run)

    def _reuse(self, job: SaveJob, timings: dict[str, float]) -> JobOutcome:
        ch = self.channel
        prepared = self.prepared_for(job) if job.abort is None or job.prepared is not None else None
        save_id = str(uuid.uuid4())
        ahead = self._ahead(job, prepared, save_id)
        try:
            return self._reuse_steps(job, prepared, save_id, ahead, timings)
        finally:
            if ahead is not None:  # bounded; a late thread discards what it staged itself
                staged = ahead.take(ch.timeout)
                if staged is not None:
                    staged.discard()

    def _reuse_steps(self, job: SaveJob, prepared: Any, save_id: str, ahead: _Ahead | None,
                     timings: dict[str, float]) -> JobOutcome:
        ch = self.channel
        status, drifts, results, err = self._reuse_write(job, timings)
        if status is Status.OK and ch.is_coordinator:
            drifts = self._template_drift(prepared)
            status = Status.DRIFT if drifts else status
        agreed = decode_status(ch.all_reduce_and(encode_status(status, job.identity)), job.identity)
        if agreed is None:
            raise OutOfStep(f"this rank's save {job.seq} to {job.directory} met a different save "
                            "of another rank in the status all_reduce")
        if agreed == Status.OK:
            staged = None
            if ahead is not None:
                t0 = time.perf_counter()
                staged = ahead.take(ch.timeout)
                timings["publish"] += time.perf_counter() - t0
            try:
                return self._reuse_publish(job, prepared, results, save_id, staged, timings)
            finally:
                if staged is not None:  # published (finish() ran) or not: never a file left behind
                    staged.discard()
        if agreed == Status.FAILED:
            reports = ch.all_gather_object(err)
            return JobOutcome(job.seq, False, SaveKind.REUSE, ErrorKind.FAILED,
                              failures={r: e for r, e in enumerate(reports) if e is not None})
        if self.settings.on_layout_drift == "raise":
            reports = ch.all_gather_object(drifts)
            return JobOutcome(job.seq, False, SaveKind.REUSE, ErrorKind.DRIFT,
                              drifts={r: d for r, d in enumerate(reports) if d})
        # results: what this rank already wrote (None if it wrote nothing); the fallback keeps it
        return run_collective(self, job, timings, prewritten=results, drifts=drifts)

    def _template_drift(self, prepared: PreparedMetadata) -> list[str]:
        """Coordinator, before the status word: publish only what reads back. The ``.metadata``
        template of a prepared file is rendered and parsed once, the first time it is used
        (:meth:`PreparedMetadata.checked_template`); one that does not read back as the ``.metadata`` the
        file describes (a damaged or crafted file that passed its other checks) is a drift of
        this save: every rank then takes the fallback, which publishes a ``.metadata`` built
        from the write results and refreshes the prepared file (or, with ``"raise"``, fails the
        save and publishes nothing). Returns the drift (empty: the template is sound)."""
        try:
            prepared.checked_template()
        except PreparedMetadataError as e:
            return [str(e)]
        return []

    def _reuse_publish(self, job: SaveJob, prepared: Any, results: list | None, save_id: str,
                       staged: StagedCommit | None, timings: dict[str, float]) -> JobOutcome:
        """Every rank wrote the prepared layout (and the coordinator the load index): the
        coordinator publishes (renames the ``.metadata`` it staged, else writes it now), the
        others wait for its receipt."""
        ch = self.channel
        error = None
        if ch.is_coordinator:
            try:
                if staged is not None:
                    t0 = time.perf_counter()
                    staged.finish()
                    timings["publish"] += time.perf_counter() - t0
                else:
                    self.publish(job, prepared.template.render_parts(os.fspath(job.directory), save_id), timings)
            except Exception as e:  # noqa: BLE001 - reported to every rank through the receipt
                error = f"publishing failed: {describe(e)}"
            ch.post_receipt(job.seq, error)
        else:
            error = ch.wait_receipt(job.seq, ch.timeout)
        ok = error is None
        return JobOutcome(job.seq, ok, SaveKind.REUSE, None if ok else ErrorKind.FAILED,
                          bytes_written=sum(r[3] for r in results or ()),
                          failures={} if ok else {ch.coordinator: error}, published=ok)


@dataclass(slots=True)
class _ReuseProgram:
    """What a reuse save of one structure writes, worked out once per structure instead of per
    save (issue 13: 2 to 4 ms per save of 2048 items, on the way to the first byte): each file's
    items as positions in the job's staged items, the slots of BYTES items, the placed items,
    the tensor records (over the reader's current mapping) and the results of the last write
    that passed the layout check."""

    plan: ReusePlan
    specs: tuple[ItemSpec, ...]
    files: list[tuple[str, list[int]]]
    pad: dict
    placed: list[PlacedItem]
    checked: list[WriteResult] | None = None
    tensor_records: list[list[Record | None]] | None = None
    mapping: object = None

    def records(self, job: SaveJob, engine: Engine) -> list[tuple[str, list[Record]]]:
        """Each file's records for ``job``: the cached tensor records while the reader keeps
        its mapping, and new records of the BYTES items' payloads."""
        items = job.staged.items
        mapping = engine.reader.mapping(job.staged)
        if self.tensor_records is None or self.mapping is not mapping:
            self.tensor_records = [[None if items[i].payload is not None else engine._record(job, items[i], self.pad)
                                    for i in idx] for _, idx in self.files]
            self.mapping = mapping
        return [(rel, [r if r is not None else engine._record(job, items[i], self.pad) for r, i in zip(recs, idx)])
                for (rel, idx), recs in zip(self.files, self.tensor_records)]


class _Ahead:
    """The coordinator's thread beside a reuse save's data write (``run(self)``, started here),
    and the ``.metadata`` it staged: :meth:`offer` (the thread) and :meth:`take` (the engine)
    meet under a lock, so a commit offered after the engine stopped waiting is discarded by the
    thread itself."""

    def __init__(self, run: Callable[[_Ahead], None]) -> None:
        self._lock = threading.Lock()
        self._staged: StagedCommit | None = None
        self._taken = False
        self._deadline: float | None = None
        self.thread = threading.Thread(target=run, args=(self,), name="solosave-ahead", daemon=True)
        self.thread.start()

    def offer(self, staged: StagedCommit) -> None:
        with self._lock:
            if not self._taken:
                self._staged = staged
                return
        staged.discard()

    def take(self, timeout: float) -> StagedCommit | None:
        """Wait for the thread (every call together waits at most ``timeout`` seconds) and take
        what it staged; the caller finishes or discards it. Later offers are discarded."""
        if self._deadline is None:
            self._deadline = time.monotonic() + timeout
        self.thread.join(max(self._deadline - time.monotonic(), 0.0))
        with self._lock:
            self._taken = True
            staged, self._staged = self._staged, None
            return staged


def _kind(job: SaveJob) -> SaveKind:
    if job.mode is Mode.REUSE:
        return SaveKind.REUSE
    return SaveKind.CREATE if job.make_prepared else SaveKind.COLLECTIVE
