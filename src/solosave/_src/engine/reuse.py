"""The reuse path of a save (background, every rank): the prepared metadata gives every rank its
layout, and a steady save needs one 8-byte ``all_reduce``.

Who calls what, in order (every rank runs :func:`run_reuse` for the same job):

1. coordinator: starts a thread (:class:`EarlyPublication`) that, beside its data write, writes the load
   index and writes ``.metadata`` aside in a temporary file (both are known before the save: the
   prepared body and template, this save's ``save_id``);
2. every rank: writes the prepared layout (``RankIO.write_prepared``) and checks it
   (``plan/layout.check_layout``, both directions): status ok, drifted or failed;
3. every rank: **one** ``all_reduce_and`` of the status word, which also carries the save's
   identity (``coordination/status``): ranks running different saves raise :class:`OutOfStep`;
4. agreed ok: the coordinator publishes (renames the ``.metadata`` written aside, else writes it) and
   posts a receipt that the other ranks wait for (a store key, not a collective), so every rank
   knows whether the save was published. Agreed failed: every rank all-gathers the errors
   (failure path only). Agreed drifted: with ``on_layout_drift="raise"`` every rank all-gathers
   the drifts; with ``"fallback"`` every rank runs the collective path
   (``save/collective.run_collective``) for this save, which refreshes the prepared metadata.

Like the collective path it reads the engine's state only through its arguments and returns the
outcome (with the coordinator's warnings) and the template a fallback made.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from solosave._src.coordination.channel import Channel
from solosave._src.coordination.protocol import (
    EngineSettings,
    ErrorKind,
    JobOutcome,
    SaveJob,
    SaveKind,
    Status,
    WriteResult,
)
from solosave._src.core.errors import ChannelError, PreparedMetadataError, describe
from solosave._src.engine.collective import MadeTemplate, run_collective
from solosave._src.engine.rank_io import RankIO
from solosave._src.formats.dcp import METADATA_FILE
from solosave._src.plan.layout import check_layout
from solosave._src.prepared.prepared import PreparedMetadata
from solosave._src.storage.registry import storage_for
from solosave._src.write.publish import PendingPublication


def run_reuse(channel: Channel, settings: EngineSettings, io: RankIO, job: SaveJob,
              prepared: PreparedMetadata | None, timings: dict[str, float]) -> tuple[JobOutcome, MadeTemplate | None]:
    """Run the reuse path of ``job`` on this rank (see the module docstring). ``prepared``: the
    prepared metadata of the job's token (``None`` only for a job that fails this save).
    Returns this rank's outcome and, when the save fell back to the collective path and this
    rank is the coordinator, the template it published."""
    save_id = job.save_id or str(uuid.uuid4())
    early = _start_early_publication(channel, io, job, prepared, save_id)
    made = None
    try:
        status, drifts, results, err = write_and_check(io, job, timings)
        if status is Status.OK and channel.is_coordinator:
            drifts = _template_drift(prepared)
            status = Status.DRIFT if drifts else status
        agreed = channel.agree(status, job.identity, f"save {job.seq} to {job.directory}", error=err,
                               drifts=drifts, gather_drifts=settings.on_layout_drift == "raise")
        if agreed.status is Status.OK:
            out = _publish(channel, io, job, prepared, results, save_id, early, timings)
        elif agreed.status is Status.FAILED:
            out = JobOutcome(job.seq, False, SaveKind.REUSE, ErrorKind.FAILED, failures=agreed.failures)
        elif settings.on_layout_drift == "raise":
            out = JobOutcome(job.seq, False, SaveKind.REUSE, ErrorKind.DRIFT, drifts=agreed.drifts)
        else:  # results: what this rank already wrote (None if it wrote nothing); the fallback keeps it
            out, made = run_collective(channel, settings, io, job, timings, prewritten=results, drifts=drifts)
    finally:
        if early is not None:  # bounded; a late thread discards what it wrote aside itself
            pending = early.take(channel.timeout)
            if pending is not None:
                pending.discard()
    if early is not None and early.warnings:
        out = dataclasses.replace(out, warnings=out.warnings + early.warnings)
    return out, made


def write_and_check(io: RankIO, job: SaveJob, timings: dict[str, float]
                    ) -> tuple[Status, list[str], list[WriteResult] | None, str | None]:
    """Every rank: write the prepared layout and check it: ``(status, drifts, results, error)``.
    A write that matches the last one checked for this structure is not checked again."""
    if job.abort is not None:
        return Status.FAILED, [], None, job.abort
    plan = job.reuse
    if plan is None:
        return Status.FAILED, [], None, "internal: a reuse job without a reuse plan"
    if plan.drift:
        return Status.DRIFT, list(plan.drift), None, None
    try:
        results, program = io.write_prepared(job, plan, timings)
    except Exception as e:  # noqa: BLE001 - becomes status FAILED on every rank
        return Status.FAILED, [], None, describe(e)
    if results == program.checked:  # what this structure wrote last time, checked then
        return Status.OK, [], results, None
    drifts = check_layout(program.placed, results)
    if not drifts:
        program.checked = results
    return (Status.DRIFT if drifts else Status.OK), drifts, results, None


def _publish(channel: Channel, io: RankIO, job: SaveJob, prepared: Any, results: list[WriteResult] | None,
             save_id: str, early: EarlyPublication | None, timings: dict[str, float]) -> JobOutcome:
    """Every rank wrote the prepared layout (and the coordinator the load index): the
    coordinator publishes (renames the ``.metadata`` its thread wrote aside, else writes it now) and
    posts a receipt; the other ranks wait for it (bounded)."""
    warnings: list[str] = []

    def publish() -> str | None:
        pending = None
        if early is not None:
            t0 = time.perf_counter()
            pending = early.take(channel.timeout)
            timings["publish"] += time.perf_counter() - t0
        try:
            if pending is not None:
                t0 = time.perf_counter()
                pending.finish()
                timings["publish"] += time.perf_counter() - t0
            else:
                template = prepared.template
                warning = io.publish(job, template.render_parts(os.fspath(job.directory), save_id),
                                     lambda: (prepared.index_body, template), save_id, timings)
                warnings.extend([warning] if warning is not None else [])
        except Exception as e:  # noqa: BLE001 - reported to every rank through the receipt
            return f"publishing failed: {describe(e)}"
        finally:
            if pending is not None:  # published (finish() ran) or not: never a file left behind
                pending.discard()
        return None

    ran: list[str | None] = []  # the coordinator's publish() result, once it ran

    def publish_once() -> str | None:
        ran.append(publish())
        return ran[-1]

    try:
        error = channel.publish_by_coordinator(job.seq, publish_once)
    except ChannelError as e:  # the coordinator knows; the others know once .metadata is there
        raise ReceiptLost(str(e), (ran[-1] is None) if ran else _metadata_seen(io, job)) from e
    ok = error is None
    return JobOutcome(job.seq, ok, SaveKind.REUSE, None if ok else ErrorKind.FAILED,
                      bytes_written=sum(r[3] for r in results or ()),
                      failures={} if error is None else {channel.coordinator: error}, published=ok,
                      warnings=tuple(warnings))


def _metadata_seen(io: RankIO, job: SaveJob) -> bool | None:
    """Other ranks, after the receipt was lost: ``True`` if ``job``'s ``.metadata`` exists (every
    rank removed the old one before writing, so it is this save's), else ``None``: unknown, as
    the coordinator may still publish it."""
    try:
        storage = storage_for(job.directory, io.storage_options)
        return True if storage.exists(storage.join(job.directory, METADATA_FILE)) else None
    except Exception:  # noqa: BLE001 - storage unreachable: unknown
        return None


class ReceiptLost(ChannelError):
    """A reuse save's publication receipt could not be posted (coordinator) or never came (the
    others): the channel is broken. ``published``: ``True``/``False`` where known (the coordinator
    knows; another rank knows only once ``.metadata`` is there), ``None`` where it is not."""

    def __init__(self, message: str, published: bool | None) -> None:
        super().__init__(message)
        self.published = published

    @property
    def seen(self) -> str:
        """What this rank knows of the publication, for its error message."""
        if self.published:
            return f"the save's {METADATA_FILE} is there: it was published before the receipt was lost"
        if self.published is None:
            return (f"no {METADATA_FILE} was there when this rank stopped waiting; whether the coordinator "
                    "published it later is unknown on this rank")
        return f"the coordinator could not publish {METADATA_FILE} either"

def _template_drift(prepared: PreparedMetadata | None) -> list[str]:
    """Coordinator, before the status word: publish only what reads back. The ``.metadata``
    template of a prepared file is rendered and parsed once, the first time it is used
    (:meth:`PreparedMetadata.checked_template`); one that does not read back as the ``.metadata``
    the file describes (a damaged or crafted file that passed its other checks) is a drift of
    this save: every rank then takes the fallback, which publishes a ``.metadata`` built from the
    write results and refreshes the prepared file (or, with ``"raise"``, fails the save and
    publishes nothing). Returns the drift (empty: the template is sound)."""
    if prepared is None:
        return []
    try:
        prepared.checked_template()
    except PreparedMetadataError as e:
        return [str(e)]
    return []


def _start_early_publication(channel: Channel, io: RankIO, job: SaveJob, prepared: PreparedMetadata | None,
                             save_id: str) -> EarlyPublication | None:
    """Coordinator of a reuse save: while this rank writes its data, a thread writes the load
    index and writes ``.metadata`` aside (:meth:`RankIO.begin_publication`). :func:`_publish` takes the
    file written aside and renames it into place; any other outcome discards it."""
    if not channel.is_coordinator or prepared is None or job.abort is not None:
        return None

    def run(early: EarlyPublication) -> None:
        try:  # it may run before this rank's data write creates the directory
            template = prepared.template  # read back once per prepared file: see _template_drift
            io.make_directory(job)
        except Exception:  # noqa: BLE001 - the data write or the reuse path meets (and reports) the same error
            return
        try:
            pending = io.begin_publication(job, template.render_parts(os.fspath(job.directory), save_id),
                                           lambda: (prepared.index_body, template), save_id)
        except Exception:  # noqa: BLE001 - publishing writes it whole, and reports its error
            return
        if pending.index_warning is not None:
            early.warn(pending.index_warning)
        early.offer(pending)

    return EarlyPublication(run)


class EarlyPublication:
    """The coordinator's thread beside a reuse save's data write (``run(self)``, started here),
    the ``.metadata`` it wrote aside and its warnings: :meth:`offer` and :meth:`warn` (the thread) and
    :meth:`take` (the reuse path) meet under a lock, so a commit offered after the reuse path
    stopped waiting is discarded by the thread itself, and a late warning is dropped."""

    def __init__(self, run: Callable[[EarlyPublication], None]) -> None:
        self._lock = threading.Lock()
        self._pending: PendingPublication | None = None
        self._warnings: list[str] = []
        self._taken = False
        self._deadline: float | None = None
        self.thread = threading.Thread(target=run, args=(self,), name="solosave-early-publication", daemon=True)
        self.thread.start()

    def offer(self, pending: PendingPublication) -> None:
        with self._lock:
            if not self._taken:
                self._pending = pending
                return
        pending.discard()

    def warn(self, warning: str) -> None:
        with self._lock:
            if not self._taken:
                self._warnings.append(warning)

    @property
    def warnings(self) -> tuple[str, ...]:
        """The thread's warnings offered before :meth:`take`."""
        with self._lock:
            return tuple(self._warnings)

    def take(self, timeout: float) -> PendingPublication | None:
        """Wait for the thread (every call together waits at most ``timeout`` seconds) and take
        what it wrote aside; the caller finishes or discards it. Later offers are discarded."""
        if self._deadline is None:
            self._deadline = time.monotonic() + timeout
        self.thread.join(max(self._deadline - time.monotonic(), 0.0))
        with self._lock:
            self._taken = True
            pending, self._pending = self._pending, None
            return pending
