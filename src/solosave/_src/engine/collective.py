"""The collective path of a save (background, every rank): first saves, saves without prepared
metadata, and the fallback of a reuse save whose layout drifted.

Who calls what, in order (every rank runs :func:`run_collective` for the same job):

1. every rank: :func:`plan_request` -> ``gather_object`` (``PlanRequest``) to the coordinator;
2. coordinator: :func:`decide` (lock-step check, per-rank errors, ``plan/global_plan``)
   -> ``scatter_object`` (one ``PlanDecision`` per rank); an ``ERROR`` decision ends the save
   on every rank here, an ``OUT_OF_STEP`` one raises :class:`OutOfStep` (the engine breaks);
3. every rank: :func:`write_assigned` (through the rank's ``RankIO``) -> ``gather_object``
   (``WriteReport``);
4. coordinator: :func:`finish` (``Metadata`` from the results, the prepared file when this save
   makes or refreshes it, the load index, ``.metadata`` published last) -> ``broadcast_object``
   (``FinishNotice``, with the metadata now prepared, so every rank can reuse it).

The path reads the engine's state only through its arguments (the channel, the settings, the
rank's ``RankIO``) and returns what it made: the outcome (with the coordinator's warnings) and,
on the coordinator, the template it published (:class:`MadeTemplate`).
"""

from __future__ import annotations

import os
import uuid
from array import array
from dataclasses import dataclass

import torch

from solosave._src.coordination.channel import Channel
from solosave._src.coordination.packing import narrow, pack_specs, written_columns
from solosave._src.coordination.protocol import (
    EngineSettings,
    ErrorKind,
    FinishNotice,
    JobOutcome,
    Mode,
    PlanDecision,
    PlanRequest,
    SaveJob,
    SaveKind,
    Verdict,
    WriteReport,
    WriteResult,
    WrittenColumns,
)
from solosave._src.coordination.status import same_save
from solosave._src.core.errors import OutOfStep, describe
from solosave._src.core.gc_pause import gc_paused
from solosave._src.engine.rank_io import RankIO
from solosave._src.formats.dcp import file_name
from solosave._src.formats.metadata_template import MetadataTemplate
from solosave._src.index.writer import body_from_columns
from solosave._src.plan.columns import placed_columns
from solosave._src.plan.global_plan import GlobalPlan, global_plan
from solosave._src.plan.layout import bucket_items
from solosave._src.plan.metadata_pickle import metadata_template
from solosave._src.prepared.convert import prepared_from_columns
from solosave._src.prepared.prepared import (
    PreparedMetadata,
    open_sectioned,
    prepared_target_problem,
    write_prepared_bytes,
)
from solosave._src.prepared.sections import SectionReader
from solosave._src.storage.sources import BytesSource
from solosave._src.write.writer import bytes_slot


@dataclass(frozen=True, slots=True)
class MadeTemplate:
    """Coordinator: the template of the ``.metadata`` a save published while making or
    refreshing the prepared metadata, with that publication's ``save_id`` and load-index body.
    The prepared metadata that the trainer sends next adopts them instead of reading them back
    (``PreparedMetadata.adopt_template``)."""

    save_id: str
    template: MetadataTemplate
    index_body: bytes


@dataclass(frozen=True, slots=True)
class Finished:
    """What :func:`finish` returns to the coordinator: the notice it broadcasts, the template it
    made (or ``None``) and its own warnings (the prepared file or the load index not written)."""

    notice: FinishNotice
    made: MadeTemplate | None = None
    warnings: tuple[str, ...] = ()


def run_collective(channel: Channel, settings: EngineSettings, io: RankIO, job: SaveJob, timings: dict[str, float],
                   prewritten: list[WriteResult] | None = None, drifts: list[str] | tuple = (),
                   ) -> tuple[JobOutcome, MadeTemplate | None]:
    """Run the collective path of ``job`` on this rank (see the module docstring). ``prewritten``
    and ``drifts``: a reuse fallback's results already written and why the layout drifted.
    Returns this rank's outcome and, on the coordinator of a save that made or refreshed the
    prepared metadata, the template it published."""
    request = plan_request(job, prewritten, drifts)
    requests = channel.gather_object(request)
    # the coordinator alone gets the requests (the others get None)
    decisions, plan = decide(job, requests, channel.coordinator) if requests is not None else (None, None)
    mine: PlanDecision = channel.scatter_object(decisions)
    kind = job.kind(fell_back=True)
    if mine.verdict is Verdict.OUT_OF_STEP:
        raise OutOfStep(mine.message)
    if mine.verdict is Verdict.ERROR:
        return JobOutcome(job.seq, False, kind, ErrorKind.FAILED, failures=dict(mine.failures)), None
    report = write_assigned(job, mine, request.prewritten, settings.files_per_rank, io, timings)
    reports = channel.gather_object(report)
    done = finish(job, plan, reports, settings, io, timings) if channel.is_coordinator else None  # type: ignore[arg-type]
    notice: FinishNotice = channel.broadcast_object(done.notice if done is not None else None)
    ok = not notice.failures
    warnings: tuple[str, ...] = ()
    if ok and kind is SaveKind.FALLBACK:
        warnings = ("layout drift: the prepared metadata no longer matches; this save took the "
                    "collective path and the prepared metadata was refreshed. Drifted: "
                    + "; ".join(f"rank {r}: {', '.join(d[:5])}" for r, d in sorted(mine.drifts.items()) if d),)
    written = 0 if mine.skip_write or not ok else report.bytes_written
    out = JobOutcome(job.seq, ok, kind, None if ok else ErrorKind.FAILED, bytes_written=written,
                     failures=dict(notice.failures), drifts=dict(mine.drifts) if kind is SaveKind.FALLBACK else {},
                     prepared_metadata=notice.prepared, published=notice.published,
                     warnings=warnings + (done.warnings if done is not None else ()))
    return out, done.made if done is not None else None


def plan_request(job: SaveJob, prewritten: list[WriteResult] | None, drifts: list[str] | tuple) -> PlanRequest:
    """This rank's part of the planning gather. A rank that cannot take part (its ``save()``
    raised, or its items cannot be described) still sends a request, carrying its error."""
    empty = pack_specs([])
    if job.abort is not None:
        return PlanRequest(job.identity, empty, None, {}, None, [], job.abort)
    try:
        held = list(job.held)
        staged = {it.spec.key for it in job.staged.items}
        positions = None
        if len(staged) != len(held) or any(s.key not in staged for s in held):
            pos = {s.key: i for i, s in enumerate(held)}
            positions = narrow(array("q", sorted(pos[k] for k in staged)))
        kept = written_columns([s.key for s in held], prewritten) if prewritten is not None else None
        return PlanRequest(job.identity, pack_specs(held), positions, job.planner_data, kept, list(drifts))
    except Exception as e:  # noqa: BLE001 - reported to every rank by the coordinator
        return PlanRequest(job.identity, empty, None, {}, None, [], f"planning failed: {describe(e)}")


def decide(job: SaveJob, requests: list[PlanRequest], coordinator: int) -> tuple[list[PlanDecision], GlobalPlan | None]:
    """Coordinator: one decision per rank, and the global plan when every rank may go on."""
    world = len(requests)
    if not same_save([r.identity for r in requests]):
        msg = (f"the coordinator's save {job.seq} to {job.directory} met a different save of "
               "another rank in the planning gather")
        return [PlanDecision(Verdict.OUT_OF_STEP, message=msg)] * world, None
    errors = {r: req.error for r, req in enumerate(requests) if req.error is not None}
    if errors:
        return [PlanDecision(Verdict.ERROR, failures=errors)] * world, None
    try:
        plan = global_plan(requests)
    except Exception as e:  # noqa: BLE001 - every rank gets the coordinator's error
        why = str(e) if isinstance(e, ValueError) else describe(e)
        return [PlanDecision(Verdict.ERROR, failures={coordinator: f"global planning failed: {why}"})] * world, None
    every = [len(req.specs.fqns) for req in requests]
    writes = [None if w == list(range(every[r])) else w for r, w in enumerate(plan.writes)]
    return [PlanDecision(Verdict.OK, writes[r], plan.skip_write, plan.drifts) for r in range(world)], plan


def write_assigned(job: SaveJob, mine: PlanDecision, kept: WrittenColumns | None, workers: int, io: RankIO,
                   timings: dict[str, float]) -> WriteReport:
    """Write the items the coordinator assigned to this rank (in ``workers`` files, through
    ``io``), or, when every rank's pre-written files fit the plan (``skip_write``), report them:
    ``kept``, as this rank's plan request sent them."""
    if mine.skip_write and kept is not None:  # skip_write: every request carried its files
        return WriteReport(kept, None)
    try:
        staged = {it.spec.key: it for it in job.staged.items}
        positions = range(len(job.held)) if mine.writes is None else mine.writes
        specs = [staged[job.held[i].key].spec for i in positions]
        files, pad = [], {}
        for n, bucket in enumerate(bucket_items(specs, workers)):
            files.append((file_name(io.rank, n), [staged[s.key] for s in bucket]))
            for s in bucket:
                payload = staged[s.key].payload
                if payload is not None:
                    pad[s.key] = bytes_slot(len(payload))
        rows = io.write(job, files, pad, timings)
        return WriteReport(written_columns([s.key for s in job.held], rows), None)
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        return WriteReport(None, describe(e))


def finish(job: SaveJob, plan: GlobalPlan, reports: list[WriteReport], settings: EngineSettings, io: RankIO,
           timings: dict[str, float]) -> Finished:
    """Coordinator: check every rank wrote, build ``Metadata``, persist the prepared file when
    this save makes or refreshes it, write the load index, publish ``.metadata`` last (through
    ``io``). ``reports``: one per rank. Calls no collective."""
    failures = {r: rep.error for r, rep in enumerate(reports) if rep.error is not None}
    if failures:
        return Finished(FinishNotice(failures, None, False))
    warnings: list[str] = []
    try:
        sdm = plan.state_dict_metadata
        save_id = job.save_id or str(uuid.uuid4())
        made = prepared = None
        with gc_paused():  # columns, not objects: see plan/columns and plan/metadata_pickle
            table = plan.chunks  # every report has its columns: the failures returned above
            results = placed_columns(table, plan.held_chunks, plan.held_counts,
                                     [rep.columns for rep in reports])  # type: ignore[misc]
            template = metadata_template(sdm, plan.planner_data, table, results)
            data = template.render_parts(os.fspath(job.directory), save_id)
            index_body = body_from_columns(sdm, plan.planner_data, table, results)
            blob = None
            if job.creates_prepared or job.mode is Mode.REUSE:
                # What every rank reuses: the layout of exactly the bytes about to be published
                # (same save_id), so the coordinator's next reuse save adopts this template.
                made = MadeTemplate(save_id, template, index_body)
                blob = prepared_from_columns(sdm, table, results, template, (os.fspath(job.directory), save_id),
                                             {"world_size": len(reports), "workers": settings.files_per_rank,
                                              "torch_version": torch.__version__}, index_body)
        if blob is not None:
            prepared = _persist_prepared(blob, settings, warnings)
        index_warning = io.publish(job, data, lambda: (index_body, template), save_id, timings)
        if index_warning is not None:
            warnings.append(index_warning)
        return Finished(FinishNotice({}, prepared, True), made, tuple(warnings))
    except Exception as e:  # noqa: BLE001 - reported to every rank
        return Finished(FinishNotice({io.rank: f"publishing failed: {describe(e)}"}, None, False),
                        warnings=tuple(warnings))


def _persist_prepared(blob: bytes, settings: EngineSettings, warnings: list[str]) -> PreparedMetadata:
    """Write the prepared file (create mode, refresh after a drift), never into a checkpoint.
    Returns what every rank receives: a reference to that file (each rank reads its own section
    from it), or, when it is not written, the prepared metadata itself (in memory), and then
    adds to ``warnings`` why."""
    path, options = settings.prepared_path, settings.storage_options
    in_memory = PreparedMetadata(SectionReader(BytesSource(blob, "created in memory")))
    if not path:
        return in_memory
    try:
        why = prepared_target_problem(path, options)
        if why is not None:
            warnings.append(f"the prepared metadata came from checkpoint {path}, which is never "
                            f"written into ({why}); the refreshed prepared metadata is kept in memory")
            return in_memory
        write_prepared_bytes(path, blob, storage_options=options)
        written = open_sectioned(path, options)
        if written is None:
            raise OSError("the file written cannot be read back")
        return written
    except Exception as e:  # noqa: BLE001 - the checkpoint itself is fine
        warnings.append(f"could not persist the prepared metadata to {path}: {describe(e)}; "
                        "it is kept in memory")
        return in_memory
