"""The trainer side of a save sequence: plan, choose the mode, stage, number the jobs, and learn
from their outcomes (calling thread, every rank, no collective, no processes).

:class:`SaveSession` is what ``AsyncCheckpointer.save()`` runs before it hands a job to the
worker, and what it feeds each outcome back to. It holds the state every rank keeps alike (so
every rank picks the same mode for the same save): the sequence number, the prepared metadata in
use and its token. Tests drive it directly, with engines on in-process channels.
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from solosave._src.coordination.protocol import ItemSpec, JobOutcome, Mode, SaveJob, SaveKind, StagedSave
from solosave._src.plan.local_plan import LocalPlan
from solosave._src.plan.structure import StructureCache
from solosave._src.prepared.prepared import PreparedMetadata
from solosave._src.save.options import CheckpointerOptions
from solosave._src.staging.staging import Stager, Staging
from solosave._src.storage.registry import backend_for
from solosave._src.tiers.paths import durable_copy_of


@dataclass(frozen=True, slots=True)
class BuiltJob:
    """A job ready for the worker once its staging completes, and how long planning and
    staging took (in the calling thread)."""

    job: SaveJob
    staging: Staging
    plan_s: float
    stage_s: float


class SaveSession:
    """Builds the save jobs of one checkpointer on one rank (see the module docstring)."""

    def __init__(self, rank: int, world_size: int, options: CheckpointerOptions,
                 prepared: PreparedMetadata | None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.options = options
        self.prepared = prepared
        self.token = 1 if prepared is not None else 0
        self._sent_token = 0
        self.seq = 0
        #: Shared by every rank of the checkpointer (the address of its store, agreed at set-up):
        #: with the save's number, it names each save's ``save_id`` alike on every rank.
        self.run_id = ""
        self.stager = Stager(options.staging_dir, timeout=float(options.timeout))
        self.structure = StructureCache()
        #: (specs, token, stage-everything) -> (reuse plan, specs to stage, held tuple): the
        #: reuse planning of the last structure, redone only when one of them changes.
        self._reuse_cache: tuple[Any, ...] | None = None
        #: After a failed fallback: stage every owned item, so the collective path can assign
        #: any of them (an item whose prepared writer lost it is then written by another holder).
        self._stage_everything = False

    @property
    def mode(self) -> Mode:
        return Mode.REUSE if self.prepared is not None else Mode.COLLECTIVE

    def build(self, state_dict: Mapping[str, Any], directory: str, overwrite: bool = False) -> BuiltJob:
        """Plan and stage ``state_dict`` for a save to ``directory`` and number the job. Raises
        for bad input before anything is numbered or staged; see :meth:`abort`. ``overwrite``:
        the save may replace a published checkpoint (its durable copy too, with two tiers)."""
        t0 = time.perf_counter()
        plan = self.structure.plan(state_dict)
        reuse, to_stage, held = self._plans(plan)
        t1 = time.perf_counter()
        overlap = self.options.overlap_staging
        staged, staging = self.stager.stage(to_stage, plan.values, overlap=overlap,
                                            watch=plan.dtensors if overlap else None)
        t2 = time.perf_counter()
        job = self._job(directory, plan, staged, reuse, held)
        if self.options.durable_root:
            job = dataclasses.replace(job, durable=durable_copy_of(directory, self.options.durable_root),
                                      overwrite=overwrite)
        return BuiltJob(job, staging, t1 - t0, t2 - t1)

    def _plans(self, plan: LocalPlan) -> tuple[Any, list[ItemSpec], tuple[ItemSpec, ...]]:
        """The reuse plan, the specs to stage and the held specs of ``plan``'s structure (the
        same objects for every save of an unchanged structure and prepared metadata)."""
        key = (plan.specs, self.token, self._stage_everything)
        c = self._reuse_cache
        if c is not None and c[0] is key[0] and c[1:3] == key[1:]:
            return c[3]
        reuse, to_stage = None, plan.owned
        if self.prepared is not None:
            reuse, to_stage = self.prepared.plan_reuse(plan, self.rank)
            if self._stage_everything or self.options.stage_replicas:
                to_stage = plan.owned
        out = (reuse, to_stage, tuple(plan.specs))
        self._reuse_cache = (*key, out)
        return out

    def _job(self, directory: str, plan: LocalPlan, staged: StagedSave, reuse: Any,
             held: tuple[ItemSpec, ...]) -> SaveJob:
        self.seq += 1
        send = None
        if self.mode is Mode.REUSE and self._sent_token != self.token:
            send, self._sent_token = self.prepared, self.token
        return SaveJob(seq=self.seq, directory=directory, mode=self.mode, staged=staged, save_id=self._save_id(),
                       held=held, planner_data=plan.planner_data, reuse=reuse,
                       creates_prepared=self.options.creates_prepared and self.prepared is None,
                       prepared_token=self.token, prepared=send, submitted_at=time.time())

    @staticmethod
    def fail_staged(job: SaveJob, error: BaseException) -> SaveJob:
        """``job`` turned into one that fails this save on every rank (its staging failed on
        this rank after ``save()`` returned), keeping its number."""
        return dataclasses.replace(job, staged=StagedSave(None, 0, ()), held=(), reuse=None,
                                   abort=f"staging failed on this rank: {type(error).__name__}: {error}")

    def abort(self, directory: str, error: BaseException) -> SaveJob:
        """The job of a save whose ``save()`` raised on this rank: it takes this save's number
        and fails it on every rank, naming this rank's error, instead of leaving the other ranks
        waiting for a job that never comes."""
        self.seq += 1
        return SaveJob(seq=self.seq, directory=directory, mode=self.mode, staged=StagedSave(None, 0, ()),
                       save_id=self._save_id(),
                       creates_prepared=self.options.creates_prepared and self.prepared is None,
                       prepared_token=self.token, abort=f"save() raised on this rank: "
                       f"{type(error).__name__}: {error}", submitted_at=time.time())

    def _save_id(self) -> str:
        return str(uuid.uuid5(uuid.NAMESPACE_URL, f"solosave:{self.run_id}:{self.seq}")) if self.run_id else ""

    def absorb(self, outcome: JobOutcome) -> None:
        """Learn from a finished save (every rank receives the same ``ok`` and metadata)."""
        if outcome.ok:
            self._stage_everything = False
            if outcome.prepared_metadata is not None:
                # a reference to the prepared file (or, in memory, the sections themselves): this
                # rank reads only its own section, at its next reuse plan
                self.prepared = outcome.prepared_metadata
                self.token += 1
        elif outcome.kind is SaveKind.FALLBACK:
            self._stage_everything = True

    def close(self) -> None:
        self.stager.close()


def normalize_directory(path: Any) -> str:
    """The directory string every rank derives alike from the ``path`` it was given (its storage
    backend's :meth:`~solosave._src.storage.base.Storage.normalize`: a URL as itself, without
    trailing slashes, never through ``pathlib``). Never raises: an aborted save uses it too."""
    if isinstance(path, (str, os.PathLike)):
        try:
            return backend_for(path).normalize(path)
        except (ImportError, ValueError):  # no usable backend (save() reports why): the path as given
            return os.fspath(path)
    return repr(path)
