"""The background half of a save: write, coordinate, publish (worker process or thread).

One :class:`Engine` per rank runs one :class:`SaveJob` at a time and returns a
:class:`JobOutcome`. All ranks' engines run the same sequence of collectives for a save, chosen
from values every rank shares (the job's mode, which every trainer picks from outcomes that every
rank received, and the values the collectives return). Per mode:

``COLLECTIVE`` (first save, or no reuse possible)
    gather local plans -> coordinator builds the global plan and ``Metadata`` -> scatter each
    rank's assignment -> write -> gather write results -> coordinator publishes ``.metadata`` ->
    broadcast the outcome (and, in create mode, the metadata now prepared).
``CACHED`` (``assume_constant_structure`` after two identical global plans)
    write the cached assignment -> gather write results -> publish -> broadcast the outcome.
``REUSE`` (prepared metadata)
    write in the prepared layout -> local layout guard -> **one 8-byte all_reduce** of the
    status (failed / drifted / ok) and of the save's identity (see :func:`encode_status`) -> if
    every rank is ok, the coordinator publishes the prepared metadata with this checkpoint's
    ``storage_meta``. On "failed" every rank all-gathers the errors (failure path only); on
    "drifted" with ``"raise"`` every rank all-gathers the drifts; with ``"fallback"`` every rank
    runs the collective path for this save and the prepared metadata is refreshed.

Failures of the channel itself (a peer's worker or process died, a collective timed out) and
ranks found *out of step* (the ranks' engines are running different saves, because a ``save()``
raised on some ranks only) publish nothing and leave the engine **broken**: every later job
fails at once, without a collective, with the reason, because a channel in that state can pair
one save's collectives with another's. The checkpointer must be closed and recreated on every
rank.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import os
import time
import traceback
from array import array
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from ._coordinate import Channel, CollectiveCall
from ._layout import (
    PlacedItem,
    PlanValidationError,
    assign_writers,
    bucket_items,
    build_metadata,
    build_state_dict_metadata,
    check_layout,
    check_results_cover,
    file_name,
    plan_from_columns,
)
from ._plan import ItemKey, ItemSpec, pack_specs, unpack_specs
from ._prepared import PreparedMetadata, prepared_fingerprint, write_prepared_file
from ._publish import MetadataTemplate, publish_metadata, unpublish
from ._safe_pickle import safe_loads
from ._stage import SegmentReader, StagedItem, StagedSave
from ._write import FileWriter, Record, WriteResult, bytes_slot

STATUS_FAILED, STATUS_DRIFT, STATUS_OK = 0, 1, 2

# The reuse status word (one int64, reduced with bitwise AND): bits 0-1 the status as a
# thermometer code (so AND is MIN), bits 2-31 a 30-bit identity of the save, bits 32-61 its
# complement. If every rank ran the same save, the AND gives back the identity and its exact
# complement; if any two ranks differ in any identity bit, that bit is 0 in both halves, which
# every rank sees (the reduced value is the same everywhere).
_STATUS_CODE = {STATUS_FAILED: 0b00, STATUS_DRIFT: 0b01, STATUS_OK: 0b11}
_CODE_STATUS = {v: k for k, v in _STATUS_CODE.items()}
_ID_BITS = 30
_ID_MASK = (1 << _ID_BITS) - 1


def save_identity(job: SaveJob) -> int:
    """A 30-bit identity of one save, equal on every rank that runs it (sequence number and
    directory, which every rank passes alike)."""
    digest = hashlib.blake2b(f"{job.seq}\0{job.directory}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _ID_MASK


def encode_status(status: int, identity: int) -> int:
    return _STATUS_CODE[status] | (identity << 2) | ((~identity & _ID_MASK) << (2 + _ID_BITS))


def decode_status(word: int, identity: int) -> int | None:
    """The agreed status, or ``None`` if the ranks were not all running save ``identity``."""
    ident = (word >> 2) & _ID_MASK
    complement = (word >> (2 + _ID_BITS)) & _ID_MASK
    code = word & 0b11
    if ident != identity or complement != (~identity & _ID_MASK) or code not in _CODE_STATUS:
        return None
    return _CODE_STATUS[code]


class Mode(str, enum.Enum):
    COLLECTIVE = "collective"
    CACHED = "cached"
    REUSE = "reuse"


@dataclass(frozen=True)
class SaveJob:
    """Everything the background needs for one save (picklable; sent to the worker)."""

    seq: int
    directory: str
    mode: Mode
    staged: StagedSave
    #: Every item this rank holds (for the global plan on the collective path).
    held: tuple[ItemSpec, ...]
    structure_hash: str
    planner_data: dict
    #: REUSE: this rank's files in the prepared metadata, items in offset order.
    layout: tuple[tuple[str, tuple[PlacedItem, ...]], ...] = ()
    #: REUSE/CACHED: why this rank cannot write the known layout (found while planning).
    local_drift: tuple[str, ...] = ()
    #: REUSE: the prepared metadata, sent once per token; later jobs send only the token.
    prepared_token: int = 0
    prepared: PreparedMetadata | None = None
    #: Path of the prepared file to create (create mode) or refresh (fallback); may be None.
    prepared_path: str | None = None
    create_prepared: bool = False
    on_layout_drift: str = "fallback"
    submitted_at: float = 0.0


@dataclass(frozen=True)
class JobOutcome:
    """What the background reports for one save (identical ``ok``/``failures`` on every rank)."""

    seq: int
    ok: bool
    mode: str
    bytes_written: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    collectives: tuple[CollectiveCall, ...] = ()
    failures: dict[int, str] = field(default_factory=dict)
    drifts: dict[int, list[str]] = field(default_factory=dict)
    error_kind: str | None = None  # "failed" | "drift" | "coordination"
    #: Keys this rank wrote (the trainer stages only these while the structure is known).
    written_keys: frozenset[ItemKey] | None = None
    cache_validated: bool = False
    #: Create mode / fallback: the complete metadata now prepared (every rank receives it).
    prepared_metadata: Metadata | None = None
    published: bool | None = None
    warnings: tuple[str, ...] = ()
    finished_at: float = 0.0


class _CoordinationError(Exception):
    pass


class _OutOfStep(Exception):
    """The ranks' engines are not running the same save."""


_RECREATE = ("this checkpointer cannot coordinate any more saves: close() it and create a new "
             "AsyncCheckpointer on every rank")


@dataclass
class _Cache:
    """Engine-side state for ``assume_constant_structure`` (owned by one Engine)."""

    last_global_hash: str | None = None
    validated: bool = False
    state_dict_metadata: dict | None = None
    planner_data: dict | None = None
    files: list[tuple[str, list[ItemSpec]]] = field(default_factory=list)


def _describe(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    where = f" at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno}" if tb else ""
    return f"{type(e).__name__}: {e}{where}"


class Engine:
    """Runs save jobs for one rank. Owned by a worker process or a worker thread."""

    def __init__(self, channel: Channel, workers: int, writer: FileWriter | None = None) -> None:
        self.channel = channel
        self.rank = channel.rank
        self.world_size = channel.world_size
        self.workers = workers
        self.writer = writer or FileWriter()
        self.reader = SegmentReader()
        self.cache = _Cache()
        self._prepared: tuple[int, PreparedMetadata] | None = None
        #: Coordinator: the template of the metadata it last prepared (create mode, fallback),
        #: with that publication's ``save_id``, for the prepared metadata the trainer sends next.
        self._made_template: tuple[str, MetadataTemplate] | None = None
        self._warnings: list[str] = []
        #: Why the channel cannot be used any more (a collective failed, ranks out of step).
        self.broken: str | None = None

    def close(self) -> None:
        self.reader.close()

    # ------------------------------------------------------------------------------------
    def run(self, job: SaveJob) -> JobOutcome:
        mark = self.channel.counter.mark()
        timings: dict[str, float] = defaultdict(float)
        if self.broken is not None:
            return JobOutcome(job.seq, False, job.mode.value, failures={self.rank: self.broken},
                              error_kind="coordination", finished_at=time.time())
        if job.staged.cuda_event is not None:  # pragma: no cover - CUDA only
            job.staged.cuda_event.synchronize()
        try:
            if job.mode is Mode.REUSE:
                out = self._reuse(job, timings)
            elif job.mode is Mode.CACHED:
                out = self._cached(job, timings)
            else:
                out = self._collective(job, timings)
        except _OutOfStep as e:
            self.cache = _Cache()
            self.broken = (f"not published: the ranks are out of step ({e}); a save() raised on "
                           f"some ranks but not on others, or timed out on some; {_RECREATE}")
            out = JobOutcome(job.seq, False, job.mode.value, failures={self.rank: self.broken},
                             error_kind="coordination")
        except Exception as e:  # noqa: BLE001 - a collective failed (peer died, timeout)
            self.cache = _Cache()
            self.broken = (f"the background channel failed on this rank during the save to "
                           f"{job.directory} ({_describe(e)}): another rank's process or worker "
                           f"died, or did not answer within the timeout; {_RECREATE}")
            out = JobOutcome(job.seq, False, job.mode.value, failures={self.rank: self.broken},
                             error_kind="coordination")
        calls = tuple(self.channel.counter.since(mark))
        if self._warnings:
            out = _replace(out, warnings=out.warnings + tuple(self._warnings))
            self._warnings = []
        timings["coordinate"] = sum(c.seconds for c in calls)
        return _replace(out, timings=dict(timings), collectives=calls, finished_at=time.time())

    # -- writing ----------------------------------------------------------------------------
    def _records(self, job: SaveJob, items: list[StagedItem], pad: dict[ItemKey, int]) -> list[Record]:
        recs = []
        for it in items:
            if it.payload is not None:
                recs.append(Record(it.spec.key, payload=it.payload, pad_to=pad.get(it.spec.key)))
            else:
                recs.append(Record(it.spec.key, tensor=self.reader.tensor(job.staged, it)))
        return recs

    def _write(self, job: SaveJob, files: list[tuple[str, list[StagedItem]]],
               pad: dict[ItemKey, int], timings: dict[str, float]) -> list[WriteResult]:
        t0 = time.perf_counter()
        os.makedirs(job.directory, exist_ok=True)
        unpublish(job.directory)  # never leave an old .metadata next to new data files
        todo = [(name, self._records(job, items, pad)) for name, items in files]
        try:
            return self.writer.write_files(job.directory, todo)
        finally:
            del todo
            timings["write"] += time.perf_counter() - t0

    def _bucketed(self, staged: dict[ItemKey, StagedItem], specs: list[ItemSpec]
                  ) -> tuple[list[tuple[str, list[StagedItem]]], dict[ItemKey, int]]:
        files = []
        pad = {}
        for n, bucket in enumerate(bucket_items(specs, self.workers)):
            files.append((file_name(self.rank, n), [staged[s.key] for s in bucket]))
            for s in bucket:
                it = staged[s.key]
                if it.payload is not None:
                    pad[s.key] = bytes_slot(len(it.payload))
        return files, pad

    # -- publishing (coordinator) --------------------------------------------------------------
    def _publish(self, job: SaveJob, data: bytes, timings: dict[str, float]) -> None:
        t0 = time.perf_counter()
        publish_metadata(job.directory, data, fsync=self.writer.fsync)
        timings["publish"] += time.perf_counter() - t0

    # -- the collective path ----------------------------------------------------------------
    def _collective(self, job: SaveJob, timings: dict[str, float],
                    prewritten: list[WriteResult] | None = None, drifts: tuple[str, ...] = (),
                    fallback: bool = False) -> JobOutcome:
        ch = self.channel
        staged = {it.spec.key: it for it in job.staged.items}
        staged_keys = list(staged)
        local = plan_payload(job.held, staged_keys, job.planner_data, prewritten, drifts, save_identity(job))
        gathered = ch.gather_object(local)
        decisions: list[Any] | None = None
        if ch.is_coordinator:
            assert gathered is not None  # noqa: S101
            decisions = _same_save(gathered, 5, job) or self._global_plan(gathered)
        mine = ch.scatter_object(decisions)
        if mine[0] == "out_of_step":
            raise _OutOfStep(mine[1])
        if mine[0] == "error":
            return JobOutcome(job.seq, False, "collective", failures={ch.coordinator: mine[1]},
                              error_kind="failed")
        _, writes, skip_write, validated, all_drifts = mine
        keys = [staged_keys[i] for i in writes]
        results: list[WriteResult] | None = None
        err = None
        files: list[tuple[str, list[StagedItem]]] = []
        if skip_write:
            results = prewritten
        else:
            try:
                files, pad = self._bucketed(staged, [staged[k].spec for k in keys])
                results = self._write(job, files, pad, timings)
            except Exception as e:  # noqa: BLE001 - reported to every rank below
                err = _describe(e)
        gathered2 = ch.gather_object((results, err))
        message = None
        if ch.is_coordinator:
            assert gathered2 is not None  # noqa: S101
            message = self._finish_collective(job, gathered2, timings)
        failures, prepared_md, published = ch.broadcast_object(message)
        ok = not failures
        written = frozenset(k for k, *_ in (results or ())) if ok else None
        if ok:
            self.cache.files = [(name, [i.spec for i in items]) for name, items in files]
            self.cache.validated = validated
        else:
            self.cache = _Cache()
        warnings = ()
        if fallback and ok:
            warnings = ("layout drift: the prepared metadata no longer matches; this save took the "
                        "collective path and the prepared metadata was refreshed. Drifted: "
                        + "; ".join(f"rank {r}: {', '.join(d[:5])}" for r, d in sorted(all_drifts.items()) if d),)
        return JobOutcome(
            job.seq, ok, "reuse+fallback" if fallback else ("create" if job.create_prepared else "collective"),
            bytes_written=_bytes(results) if ok and not skip_write else 0,
            failures=failures, error_kind=None if ok else "failed", written_keys=written,
            cache_validated=validated and ok, prepared_metadata=prepared_md,
            published=published if ch.is_coordinator else None, warnings=warnings,
            drifts=all_drifts if fallback else {})

    def _global_plan(self, gathered: list[Any]) -> list[Any]:
        """Coordinator: merge the ranks' plans (the tuples of :func:`plan_payload`), assign
        writers, decide whether to write. Returns one decision per rank: ``("ok", writes,
        skip_write, validated, drifts)`` with ``writes`` the positions, in the rank's staged
        list, of the items it writes; or ``("error", message)``.

        The common case runs on the columnar payloads (:func:`plan_from_columns`); anything it
        does not decide (an invalid plan, pre-written results of a reuse fallback, per-item
        payloads) runs the per-item functions, which decide the same and word the errors."""
        try:
            plan = None
            if all(g[0][0] == "cols" and isinstance(g[1], array) and g[3] is None for g in gathered):
                plan = plan_from_columns([g[0] for g in gathered], [g[1] for g in gathered])
            if plan is not None:
                sdm, writes, skip, ghash = plan.state_dict_metadata, plan.writes, False, plan.assignment_hash
            else:
                sdm, writes, skip, ghash = self._global_plan_items(gathered)
            validated = ghash == self.cache.last_global_hash
            self.cache.last_global_hash = ghash
            self.cache.state_dict_metadata = sdm
            planner_data: dict = {}
            for g in gathered:
                planner_data.update(g[2])
            self.cache.planner_data = planner_data
            drifts = {r: list(g[4]) for r, g in enumerate(gathered) if g[4]}
            return [("ok", writes[r], skip, validated, drifts) for r in range(len(gathered))]
        except Exception as e:  # noqa: BLE001 - every rank gets the coordinator's error
            self.cache = _Cache()
            return [("error", f"global planning failed: {_describe(e)}")] * len(gathered)

    @staticmethod
    def _global_plan_items(gathered: list[Any]) -> tuple[dict, list[list[int]], bool, str]:
        """The global plan with one :class:`ItemSpec` per item (see :meth:`_global_plan`):
        ``(state_dict_metadata, writes, skip_write, assignment hash)``; raises on an invalid
        plan."""
        held = [unpack_specs(g[0]) for g in gathered]
        staged_lists = [[_key(held[r][i].key) for i in g[1]] if isinstance(g[1], array) else [_key(k) for k in g[1]]
                        for r, g in enumerate(gathered)]
        staged_keys = [set(keys) for keys in staged_lists]
        by_key: dict[ItemKey, ItemSpec] = {}
        for specs in held:
            for s in specs:
                by_key.setdefault(s.key, s)
        sdm = build_state_dict_metadata(s for specs in held for s in specs)
        nobody = set(by_key) - set().union(*staged_keys)
        if nobody:
            names = ", ".join(sorted(k[0] for k in nobody)[:10])
            raise PlanValidationError(
                f"{len(nobody)} item(s) were staged by no rank ({names}): the structure "
                "changed on some ranks but not others; the next save re-plans from scratch")
        staged_specs = [[by_key[k] for k in keys] for keys in staged_keys]
        prefer = {}
        for r, g in enumerate(gathered):
            for k, *_ in g[3] or ():
                prefer.setdefault(_key(k), r)
        assigned = assign_writers(staged_specs, prefer)
        skip = all(g[3] is not None for g in gathered) and all(
            {_key(k) for k, *_ in g[3]} == {s.key for s in assigned[r]}
            for r, g in enumerate(gathered))
        ghash = hashlib.sha256(repr(
            [sorted((s.key, s.sizes, s.global_size, s.dtype, int(s.kind)) for s in a) for a in assigned]
        ).encode()).hexdigest()
        writes = []
        for r, keys in enumerate(staged_lists):
            pos = {k: j for j, k in enumerate(keys)}
            writes.append(sorted(pos[s.key] for s in assigned[r]))
        return sdm, writes, skip, ghash

    def _finish_collective(self, job: SaveJob, gathered: list[Any], timings: dict[str, float]) -> tuple:
        """Coordinator: check every rank wrote, build ``Metadata``, publish it last."""
        failures = {r: err for r, (res, err) in enumerate(gathered) if err is not None}
        if failures:
            return failures, None, False
        sdm = self.cache.state_dict_metadata
        results = [tuple(r) for res, _ in gathered for r in res]
        try:
            problems = check_results_cover(sdm, results)
            if problems:
                raise PlanValidationError("write results do not cover the plan: " + "; ".join(problems[:10]))
            md = build_metadata(sdm, [(_key(k), rel, off, ln) for k, rel, off, ln in results],
                                self.cache.planner_data)
            template = MetadataTemplate(md)
            data = template.render(os.fspath(job.directory))
            prepared_md = None
            self._made_template = None
            if job.create_prepared or job.mode is Mode.REUSE:
                # The prepared metadata is exactly the bytes about to be published, read back.
                prepared_md = safe_loads(data, what="published .metadata")
                if prepared_md.storage_meta is not None and prepared_md.storage_meta.save_id:
                    # Its save_id (a fresh uuid) identifies it when the trainers send it back
                    # as the prepared metadata of the next saves: the template built here is
                    # then reused, not rebuilt on the first reuse save (see _prepared_for).
                    self._made_template = (prepared_md.storage_meta.save_id, template)
                if job.prepared_path:
                    try:
                        # `data` is the protocol-2 pickle of prepared_md: stored as is.
                        write_prepared_file(job.prepared_path,
                                            prepared_fingerprint(prepared_md, self.world_size, self.workers),
                                            data)
                    except Exception as e:  # noqa: BLE001 - the checkpoint itself is fine
                        self._warnings.append(f"could not persist the prepared metadata to "
                                              f"{job.prepared_path}: {_describe(e)}; it is kept in memory")
            self._publish(job, data, timings)
            return {}, prepared_md, True
        except Exception as e:  # noqa: BLE001 - reported to every rank
            return {self.rank: f"publishing failed: {_describe(e)}"}, None, False

    # -- the cached path --------------------------------------------------------------------
    def _cached(self, job: SaveJob, timings: dict[str, float]) -> JobOutcome:
        ch = self.channel
        staged = {it.spec.key: it for it in job.staged.items}
        results: list[WriteResult] | None = None
        err = None
        # Changed: the trainer saw its structure change, or did not stage a cached item.
        changed = bool(job.local_drift) or any(s.key not in staged for _, specs in self.cache.files for s in specs)
        if not changed:
            try:
                files = [(name, [staged[s.key] for s in specs]) for name, specs in self.cache.files]
                pad = {k: bytes_slot(len(it.payload)) for k, it in staged.items() if it.payload is not None}
                results = self._write(job, files, pad, timings)
            except Exception as e:  # noqa: BLE001
                err = _describe(e)
        gathered = ch.gather_object((job.structure_hash, results, err, changed, save_identity(job)))
        message = None
        if ch.is_coordinator:
            assert gathered is not None  # noqa: S101
            out_of_step = _same_save(gathered, 4, job)
            if out_of_step:
                message = ("out_of_step", out_of_step[0][1])
            elif any(g[3] for g in gathered):
                message = ("replan", {})
            else:
                fin = self._finish_collective(job, [(g[1], g[2]) for g in gathered], timings)
                message = ("done", fin)
        kind, payload = ch.broadcast_object(message)
        if kind == "out_of_step":
            raise _OutOfStep(payload)
        if kind == "replan":
            return self._collective(job, timings)
        failures, _, published = payload
        ok = not failures
        if not ok:
            self.cache = _Cache()
        return JobOutcome(job.seq, ok, "cached", bytes_written=_bytes(results) if ok else 0,
                          failures=failures, error_kind=None if ok else "failed",
                          written_keys=frozenset(k for k, *_ in results or ()) if ok else None,
                          cache_validated=ok, published=published if ch.is_coordinator else None)

    # -- the reuse path ---------------------------------------------------------------------
    def _prepared_for(self, job: SaveJob) -> PreparedMetadata:
        if job.prepared is not None:
            self._prepared = (job.prepared_token, job.prepared)
            made, self._made_template = self._made_template, None
            if made is not None:
                job.prepared.adopt_template(*made)
        if self._prepared is None or self._prepared[0] != job.prepared_token:
            raise RuntimeError("internal: the worker has no prepared metadata for this token")
        return self._prepared[1]

    def _reuse(self, job: SaveJob, timings: dict[str, float]) -> JobOutcome:
        ch = self.channel
        prepared = self._prepared_for(job)
        status, drifts, results, err = STATUS_OK, list(job.local_drift), None, None
        if drifts:
            status = STATUS_DRIFT
        else:
            staged = {it.spec.key: it for it in job.staged.items}
            try:
                files = [(rel, [staged[p.key] for p in items]) for rel, items in job.layout]
                pad = {p.key: p.length for _, items in job.layout for p in items
                       if staged[p.key].payload is not None}
                results = self._write(job, files, pad, timings)
                drifts = check_layout([p for _, items in job.layout for p in items], results)
                status = STATUS_DRIFT if drifts else STATUS_OK
            except Exception as e:  # noqa: BLE001 - becomes status 0 on every rank
                status, err = STATUS_FAILED, _describe(e)
        identity = save_identity(job)
        agreed = decode_status(ch.all_reduce_and(encode_status(status, identity)), identity)
        if agreed is None:
            raise _OutOfStep(f"this rank's save {job.seq} to {job.directory} met a different save "
                             "of another rank in the status all_reduce")
        if agreed == STATUS_OK:
            published = None
            failures: dict[int, str] = {}
            if ch.is_coordinator:
                try:
                    self._publish(job, prepared.template.render(os.fspath(job.directory)), timings)
                    published = True
                except Exception as e:  # noqa: BLE001 - only the coordinator can know
                    failures, published = {self.rank: f"publishing failed: {_describe(e)}"}, False
            return JobOutcome(job.seq, not failures, "reuse", bytes_written=_bytes(results),
                              failures=failures, error_kind="failed" if failures else None,
                              written_keys=frozenset(k for k, *_ in results or ()),
                              published=published)
        if agreed == STATUS_FAILED:
            reports = ch.all_gather_object(err)
            failures = {r: e for r, e in enumerate(reports) if e is not None}
            return JobOutcome(job.seq, False, "reuse", failures=failures, error_kind="failed")
        if job.on_layout_drift == "raise":
            reports = ch.all_gather_object(drifts)
            return JobOutcome(job.seq, False, "reuse", error_kind="drift",
                              drifts={r: d for r, d in enumerate(reports) if d})
        prewritten = results if status != STATUS_FAILED and not job.local_drift else None
        return self._collective(job, timings, prewritten=prewritten, drifts=tuple(drifts), fallback=True)


def plan_payload(held: Any, staged_keys: list[ItemKey], planner_data: dict,
                 prewritten: list[WriteResult] | None, drifts: Any, identity: int) -> tuple:
    """What every rank sends in the planning gather of the collective path: its items in
    columnar form (:func:`~solosave._plan.pack_specs`), the items it staged (an ``array('q')``
    of positions in ``held``, or the list of keys when one is not in ``held``), the flatten
    mapping, the results it already wrote (reuse fallback), its drifts and the save identity."""
    held = list(held)
    pos = {s.key: i for i, s in enumerate(held)}
    try:
        staged: Any = array("q", [pos[k] for k in staged_keys])
    except KeyError:
        staged = list(staged_keys)
    return (pack_specs(held), staged, planner_data, prewritten, list(drifts), identity)


def _same_save(gathered: list[Any], at: int, job: SaveJob) -> list[Any] | None:
    """Coordinator: ``None`` if every rank's gathered tuple carries this save's identity at
    index ``at``; else an "out of step" decision for every rank."""
    mine = save_identity(job)
    if all(len(g) > at and g[at] == mine for g in gathered):
        return None
    return [("out_of_step", f"the coordinator's save {job.seq} to {job.directory} met a "
             "different save of another rank in the planning gather")] * len(gathered)


def _key(k: Any) -> ItemKey:
    fqn, offsets = k
    return (fqn, tuple(offsets) if offsets is not None else None)


def _bytes(results: list[WriteResult] | None) -> int:
    return sum(r[3] for r in results or ())


def _replace(out: JobOutcome, **kw: Any) -> JobOutcome:
    return dataclasses.replace(out, **kw)


__all__ = ["Engine", "JobOutcome", "Mode", "SaveJob", "plan_payload"]
