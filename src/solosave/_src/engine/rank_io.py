"""What one rank writes in a save (background: worker process or thread, every rank).

:class:`RankIO` is owned by the rank's :class:`~solosave._src.engine.engine.Engine`, which hands it to
the collective path (``engine/collective.py``) and to the reuse path (``engine/reuse.py``). It calls
no collective. Per save, in this order:

1. every rank writes its data files: :meth:`RankIO.write` (collective path: the items the
   coordinator assigned to it) or :meth:`RankIO.write_prepared` (reuse path: the layout the
   prepared metadata gives it);
2. the coordinator only: :meth:`RankIO.publish` (the load index, then ``.metadata``, last,
   atomically: :func:`~solosave._src.write.publish.commit_checkpoint`). On the reuse path the
   coordinator instead writes both aside during its data write (:meth:`RankIO.make_directory`, then
   :meth:`RankIO.begin_publication`, on a thread) and publishes that ``.metadata`` once every rank
   agreed.

Between saves it keeps the tensor records of the last save (views of the staging buffer's
mapping) and the reuse write of the last structure (:class:`ReuseProgram`): a save of an
unchanged structure looks them up instead of rebuilding them.
"""

from __future__ import annotations

import operator
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from solosave._src.coordination.protocol import ItemSpec, PlacedItem, ReusePlan, SaveJob, StagedItem, WriteResult
from solosave._src.formats.dcp import data_file_problem
from solosave._src.formats.metadata_template import MetadataTemplate
from solosave._src.index import writer as index
from solosave._src.staging.buffer import BufferReader
from solosave._src.storage.registry import storage_for
from solosave._src.write.publish import PendingPublication, begin_publication, commit_checkpoint, unpublish
from solosave._src.write.writer import FileWriter, Record

Files = list[tuple[str, list[Record]]]


@dataclass(slots=True)
class ReuseProgram:
    """What a reuse save of one structure writes, worked out once per structure instead of per
    save: each file's items as positions in the job's staged items, the slots of BYTES items,
    the placed items, the tensor records (over the reader's current mapping) and the results of
    the last write that passed the layout check (``checked``, set by the reuse path)."""

    plan: ReusePlan
    specs: tuple[ItemSpec, ...]
    files: list[tuple[str, list[int]]]
    pad: dict
    placed: list[PlacedItem]
    checked: list[WriteResult] | None = None
    tensor_records: list[list[Record | None]] | None = None
    mapping: object = None


class RankIO:
    """This rank's data files, and on the coordinator the load index and ``.metadata`` (see the
    module docstring). ``writer`` writes the files; ``storage_options`` are those of URL
    destinations."""

    def __init__(self, rank: int, writer: FileWriter, storage_options: Mapping[str, Any] | None = None) -> None:
        self.rank = rank
        self.writer = writer
        self.storage_options = storage_options
        self.reader = BufferReader()
        #: The record of each tensor item written by the last save, by item identity: a job of an
        #: unchanged structure brings the same items and the reader the same views, so the
        #: records are looked up, not rebuilt.
        self._records: dict[int, Record] = {}
        #: The reuse write of the last structure (:meth:`write_prepared`).
        self.reuse_program: ReuseProgram | None = None
        #: The data files (relative names) that hold a record of this rank's last write.
        self.last_files: tuple[str, ...] = ()

    def close(self) -> None:
        self._records = {}  # they hold views of the mapping the reader closes
        self.reuse_program = None
        self.reader.release()

    # -- data files (every rank) ----------------------------------------------------------------
    def write(self, job: SaveJob, files: list[tuple[str, list[StagedItem]]], pad: dict,
              timings: dict[str, float]) -> list[WriteResult]:
        """Collective path: write this rank's ``files`` of ``job`` (``pad``: slot length per BYTES
        item key)."""
        t0 = time.perf_counter()
        todo = [(name, [self._record(job, it, pad) for it in items]) for name, items in files]
        kept = [it for _, items in files for it in items]
        self.reader.keep_only(kept)
        if len(self._records) > sum(it.payload is None for it in kept):
            self._records = {k: r for k, r in ((id(it), self._records.get(id(it))) for it in kept) if r is not None}
        timings["write"] += time.perf_counter() - t0
        return self._write_records(job, todo, timings)

    def write_prepared(self, job: SaveJob, plan: ReusePlan,
                       timings: dict[str, float]) -> tuple[list[WriteResult], ReuseProgram]:
        """Reuse path: write ``job`` in the layout ``plan`` gives this rank. Returns the write
        results and the structure's :class:`ReuseProgram` (its placed items, to check the
        results against)."""
        program = self._program(job, plan)
        return self._write_records(job, self._program_records(job, program), timings), program

    def _write_records(self, job: SaveJob, todo: Files, timings: dict[str, float]) -> list[WriteResult]:
        """Write ``todo`` (each file's records) into ``job``'s directory: only this rank's data
        files, directly inside it (a name from a crafted prepared file never reaches the writer)."""
        for name, _ in todo:
            why = data_file_problem(name, self.rank)
            if why is not None:
                raise ValueError(f"refusing to write {why}")
        t0 = time.perf_counter()
        storage = storage_for(job.directory, self.storage_options)
        storage.makedirs(job.directory)
        unpublish(storage, os.fspath(job.directory))
        self.last_files = ()
        try:
            results = self.writer.write_files(job.directory, todo)
            self.last_files = tuple(sorted({r[1] for r in results}))
            return results
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

    def _program(self, job: SaveJob, plan: ReusePlan) -> ReuseProgram:
        """The reuse write of ``job``'s structure: the last one if the job brings the same plan
        and item specs (as every job of an unchanged structure does), else a new one."""
        items = job.staged.items
        p = self.reuse_program
        if (p is not None and p.plan is plan and len(p.specs) == len(items)
                and all(map(operator.is_, p.specs, [it.spec for it in items]))):
            return p
        at = {it.spec.key: i for i, it in enumerate(items)}
        placed = plan.placed()
        files = [(rel, [at[x.key] for x in xs]) for rel, xs in plan.layout]
        pad = {x.key: x.length for x in placed if items[at[x.key]].payload is not None}
        self.reader.keep_only(list(items))  # a new structure: the views and records of the last go
        self._records = {}
        self.reuse_program = p = ReuseProgram(plan, tuple(it.spec for it in items), files, pad, placed)
        return p

    def _program_records(self, job: SaveJob, p: ReuseProgram) -> Files:
        """Each file's records for ``job``: the program's tensor records while the reader keeps
        its mapping, and new records of the BYTES items' payloads."""
        items = job.staged.items
        mapping = self.reader.mapping(job.staged)
        if p.tensor_records is None or p.mapping is not mapping:
            p.tensor_records = [[None if items[i].payload is not None else self._record(job, items[i], p.pad)
                                 for i in idx] for _, idx in p.files]
            p.mapping = mapping
        return [(rel, [r if r is not None else self._record(job, items[i], p.pad) for r, i in zip(recs, idx)])
                for (rel, idx), recs in zip(p.files, p.tensor_records)]

    # -- the load index and .metadata (coordinator) ---------------------------------------------
    def make_directory(self, job: SaveJob) -> None:
        """Create ``job``'s directory (where it has directories)."""
        storage_for(job.directory, self.storage_options).makedirs(job.directory)

    def _index(self, job: SaveJob, source: Callable[[], tuple[bytes | None, MetadataTemplate]],
               save_id: str) -> Callable[[], bytes | None]:
        """The load index of the ``.metadata`` that the template renders with ``save_id``, built
        when written (``source()``: the index body, ``None`` for none, and the template)."""
        def build() -> bytes | None:
            body, template = source()
            return None if body is None else index.render(body, template, os.fspath(job.directory), save_id)
        return build

    def publish(self, job: SaveJob, data: bytes | Sequence[bytes],
                source: Callable[[], tuple[bytes | None, MetadataTemplate]], save_id: str,
                timings: dict[str, float]) -> str | None:
        """Coordinator: the load index, then ``.metadata``, last, atomically
        (:func:`~solosave._src.write.publish.commit_checkpoint`). Returns the index's warning
        (loads then read ``.metadata``); raises if ``.metadata`` could not be written."""
        t0 = time.perf_counter()
        try:
            return commit_checkpoint(storage_for(job.directory, self.storage_options), os.fspath(job.directory),
                                     data, self._index(job, source, save_id), fsync=self.writer.fsync)
        finally:
            timings["publish"] += time.perf_counter() - t0

    def begin_publication(self, job: SaveJob, data: Sequence[bytes],
                          source: Callable[[], tuple[bytes | None, MetadataTemplate]],
                          save_id: str) -> PendingPublication:
        """Coordinator: :meth:`publish` in two steps (the index written and ``.metadata``'s bytes
        written aside now; the caller finishes or discards the result)."""
        return begin_publication(storage_for(job.directory, self.storage_options), os.fspath(job.directory), data,
                                 self._index(job, source, save_id), fsync=self.writer.fsync)
