"""The collective path of a save (background, every rank): first saves, saves without prepared
metadata, and the fallback of a reuse save whose layout drifted.

Who calls what, in order (every rank runs :func:`run_collective` for the same job):

1. every rank: :func:`plan_request` -> ``gather_object`` (``PlanRequest``) to the coordinator;
2. coordinator: :func:`decide` (lock-step check, per-rank errors, ``_global_plan.global_plan``)
   -> ``scatter_object`` (one ``PlanDecision`` per rank); an ``ERROR`` decision ends the save
   on every rank here, an ``OUT_OF_STEP`` one breaks every engine;
3. every rank: :func:`write_assigned` -> ``gather_object`` (``WriteReport``);
4. coordinator: :func:`finish` (``Metadata`` from the results, the prepared file when this save
   makes or refreshes it, the load index, ``.metadata`` published last) -> ``broadcast_object``
   (``FinishNotice``, with the metadata now prepared, so every rank can reuse it).
"""

from __future__ import annotations

import os
import uuid
from array import array
from typing import TYPE_CHECKING

import torch

from solosave._src.coordination.channel import OutOfStep
from solosave._src.coordination.packing import narrow, pack_specs, written_columns
from solosave._src.coordination.protocol import (
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
from solosave._src.core.errors import describe
from solosave._src.core.gc_pause import gc_paused
from solosave._src.formats.dcp import file_name
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
from solosave._src.save.writer import bytes_slot
from solosave._src.storage.sources import BytesSource

if TYPE_CHECKING:  # the engine calls this module; it is only named here
    from solosave._src.save.engine import Engine


def run_collective(engine: Engine, job: SaveJob, timings: dict[str, float],
                   prewritten: list[WriteResult] | None = None, drifts: list[str] | tuple = ()) -> JobOutcome:
    """Run the collective path of ``job`` on this rank (see the module docstring). ``prewritten``
    and ``drifts``: a reuse fallback's results already written and why the layout drifted."""
    ch = engine.channel
    request = plan_request(job, prewritten, drifts)
    requests = ch.gather_object(request)
    decisions, plan = decide(job, requests, ch.coordinator) if ch.is_coordinator else (None, None)
    mine: PlanDecision = ch.scatter_object(decisions)
    kind = SaveKind.FALLBACK if job.mode is Mode.REUSE else (
        SaveKind.CREATE if job.make_prepared else SaveKind.COLLECTIVE)
    if mine.verdict is Verdict.OUT_OF_STEP:
        raise OutOfStep(mine.message)
    if mine.verdict is Verdict.ERROR:
        return JobOutcome(job.seq, False, kind, ErrorKind.FAILED, failures=dict(mine.failures))
    report = write_assigned(engine, job, mine, request.prewritten, timings)
    reports = ch.gather_object(report)
    notice = None
    if ch.is_coordinator:
        notice = finish(engine, job, plan, reports, timings)  # type: ignore[arg-type]
    notice = ch.broadcast_object(notice)
    ok = not notice.failures
    warnings: tuple[str, ...] = ()
    if ok and kind is SaveKind.FALLBACK:
        warnings = ("layout drift: the prepared metadata no longer matches; this save took the "
                    "collective path and the prepared metadata was refreshed. Drifted: "
                    + "; ".join(f"rank {r}: {', '.join(d[:5])}" for r, d in sorted(mine.drifts.items()) if d),)
    written = 0 if mine.skip_write or not ok else report.bytes_written
    return JobOutcome(job.seq, ok, kind, None if ok else ErrorKind.FAILED, bytes_written=written,
                      failures=dict(notice.failures), drifts=dict(mine.drifts) if kind is SaveKind.FALLBACK else {},
                      prepared_metadata=notice.prepared, published=notice.published, warnings=warnings)


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


def write_assigned(engine: Engine, job: SaveJob, mine: PlanDecision, kept: WrittenColumns | None,
                   timings: dict[str, float]) -> WriteReport:
    """Write the items the coordinator assigned to this rank, or, when every rank's pre-written
    files fit the plan (``skip_write``), report them: ``kept``, as this rank's plan request sent
    them."""
    if mine.skip_write and kept is not None:  # skip_write: every request carried its files
        return WriteReport(kept, None)
    try:
        staged = {it.spec.key: it for it in job.staged.items}
        positions = range(len(job.held)) if mine.writes is None else mine.writes
        specs = [staged[job.held[i].key].spec for i in positions]
        files, pad = [], {}
        for n, bucket in enumerate(bucket_items(specs, engine.workers)):
            files.append((file_name(engine.rank, n), [staged[s.key] for s in bucket]))
            pad.update({s.key: bytes_slot(len(staged[s.key].payload)) for s in bucket
                        if staged[s.key].payload is not None})
        rows = engine.write(job, files, pad, timings)
        return WriteReport(written_columns([s.key for s in job.held], rows), None)
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        return WriteReport(None, describe(e))


def finish(engine: Engine, job: SaveJob, plan: GlobalPlan, reports: list[WriteReport],
           timings: dict[str, float]) -> FinishNotice:
    """Coordinator: check every rank wrote, build ``Metadata``, persist the prepared file when
    this save makes or refreshes it, publish ``.metadata`` last."""
    failures = {r: rep.error for r, rep in enumerate(reports) if rep.error is not None}
    if failures:
        return FinishNotice(failures, None, False)
    try:
        sdm = plan.state_dict_metadata
        save_id = str(uuid.uuid4())
        engine.made_template = prepared = None
        with gc_paused():  # columns, not objects: see _results and _metadata_pickle
            table = plan.chunks  # every report has its columns: the failures returned above
            results = placed_columns(table, plan.held_chunks, plan.held_counts,
                                     [rep.columns for rep in reports])  # type: ignore[misc]
            template = metadata_template(sdm, plan.planner_data, table, results)
            data = template.render_parts(os.fspath(job.directory), save_id)
            index_body = body_from_columns(sdm, plan.planner_data, table, results)
            blob = None
            if job.make_prepared or job.mode is Mode.REUSE:
                # What every rank reuses: the layout of exactly the bytes about to be published
                # (same save_id), so the coordinator's next reuse save adopts this template.
                engine.made_template = (save_id, template, index_body)
                blob = prepared_from_columns(sdm, table, results, template, (os.fspath(job.directory), save_id),
                                             {"world_size": engine.world_size, "workers": engine.workers,
                                              "torch_version": torch.__version__}, index_body)
        if blob is not None:
            prepared = _persist_prepared(engine, blob)
        engine.write_index(job, lambda: (index_body, template), save_id, timings)
        engine.publish(job, data, timings)
        return FinishNotice({}, prepared, True)
    except Exception as e:  # noqa: BLE001 - reported to every rank
        return FinishNotice({engine.rank: f"publishing failed: {describe(e)}"}, None, False)


def _persist_prepared(engine: Engine, blob: bytes) -> PreparedMetadata:
    """Write the prepared file (create mode, refresh after a drift), never into a checkpoint.
    Returns what every rank receives: a reference to that file (each rank reads its own section
    from it), or, when it is not written, the prepared metadata itself (in memory)."""
    path, options = engine.settings.prepared_path, engine.settings.storage_options
    in_memory = PreparedMetadata(SectionReader(BytesSource(blob, "created in memory")))
    if not path:
        return in_memory
    try:
        why = prepared_target_problem(path, options)
        if why is not None:
            engine.warnings.append(f"the prepared metadata came from checkpoint {path}, which is never "
                                   f"written into ({why}); the refreshed prepared metadata is kept in memory")
            return in_memory
        write_prepared_bytes(path, blob, storage_options=options)
        written = open_sectioned(path, options)
        if written is None:
            raise OSError("the file written cannot be read back")
        return written
    except Exception as e:  # noqa: BLE001 - the checkpoint itself is fine
        engine.warnings.append(f"could not persist the prepared metadata to {path}: {describe(e)}; "
                               "it is kept in memory")
        return in_memory
