"""The background half of a save: write, coordinate, publish (worker process or thread).

One :class:`Engine` per rank runs one :class:`~solosave._src.coordination.protocol.SaveJob` at a
time and returns a :class:`~solosave._src.coordination.protocol.JobOutcome`. All ranks' engines
run the same sequence of collectives for a save, chosen from values every rank shares (the job's
mode, which every trainer picks from outcomes that every rank received, and the values the
collectives return). :meth:`Engine.run` dispatches on the mode:

``COLLECTIVE`` (first save, or no prepared metadata): ``save/collective.run_collective``
    gather plan requests -> coordinator runs the global planner -> scatter each rank's decision
    -> write -> gather write reports -> coordinator publishes ``.metadata`` -> broadcast the
    outcome (and, when the save makes the prepared metadata, the metadata itself).
``REUSE`` (prepared metadata: from a file, or made in memory by an earlier save): ``save/reuse.run_reuse``
    write in the prepared layout -> local layout guard -> **one 8-byte all_reduce** of the
    status (failed / drifted / ok) and of the save's identity -> the coordinator publishes
    (on "drifted" with ``"fallback"``, the collective path for this save instead).

Both paths take what they need as arguments (the channel, the settings, the rank's
:class:`~solosave._src.engine.rank_io.RankIO`, which the engine owns) and return the outcome and
the template a save made; the engine keeps the prepared metadata in use, that template (adopted
by the next prepared metadata, so the coordinator does not read back what it just wrote) and the
broken state.

With two tiers (``durable_root``) the engine also owns the rank's
:class:`~solosave._src.tiers.durable.Copier`: once a save is published on the fast tier, its copy
to the durable tier is queued there and the save's outcome is reported at once (it names the
queued copy: ``JobOutcome.durable``); the copy's own outcome follows from the copier's thread.
Before a save writes, it waits (bounded) while a pending copy still reads the directory it is
about to rewrite (an overwrite). Copies that fall behind are coalesced by the copier (the latest
wins), so a stalled durable tier never holds up a save; with ``durable_every_save`` every save
is copied, and a save also waits while ``MAX_PENDING`` copies are pending.

Errors are told apart: a per-save failure (a write error, a bad value, a drift) fails that save
on every rank and the next save runs normally. A failed collective (:class:`ChannelError`: a
peer died or timed out), ranks found *out of step* (running different saves), or an internal
error (a bug, reported with its traceback) leave the engine **broken**: every later job fails at
once, without a collective, with the reason, because a channel in that state can pair one save's
collectives with another's. The checkpointer must then be closed and recreated on every rank.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from collections import defaultdict

from solosave._src.coordination.channel import Channel
from solosave._src.coordination.protocol import EngineSettings, ErrorKind, JobOutcome, Mode, SaveJob
from solosave._src.core.errors import ChannelError, OutOfStep
from solosave._src.engine.collective import MadeTemplate, run_collective
from solosave._src.engine.rank_io import RankIO
from solosave._src.engine.reuse import ReceiptLost, run_reuse
from solosave._src.formats.dcp import checksum_path
from solosave._src.prepared.prepared import PreparedMetadata
from solosave._src.tiers.durable import MAX_PENDING, Copier, CopyTask
from solosave._src.tiers.placement import PeerLayout
from solosave._src.write.writer import FileWriter

RECREATE = ("this checkpointer cannot coordinate any more saves: close() it and create a new "
            "AsyncCheckpointer on every rank")


class Engine:
    """Runs save jobs for one rank. Owned by a worker process or a worker thread.

    ``settings`` are the checkpointer's (sent once); ``writer`` writes the files; ``durable``:
    the channel of the durable copies (a group of its own), given when ``settings.durable_root``
    is set.
    """

    def __init__(self, channel: Channel, settings: EngineSettings, writer: FileWriter | None = None,
                 durable: Channel | None = None) -> None:
        self.channel = channel
        self.rank = channel.rank
        self.settings = settings
        writer = writer or FileWriter()
        if settings.storage_options and writer.storage_options is None:
            writer.storage_options = settings.storage_options
        #: This rank's writing: data files, and on the coordinator the load index and .metadata.
        self.io = RankIO(channel.rank, writer, settings.storage_options)
        self._prepared: tuple[int, PreparedMetadata] | None = None
        #: Coordinator: the template of the metadata it last made (create mode, fallback),
        #: adopted by the prepared metadata the trainer sends next.
        self._made: MadeTemplate | None = None
        #: Why the channel cannot be used any more, and the kind of that failure.
        self.broken: tuple[ErrorKind, str] | None = None
        #: Two tiers: this rank's durable copies (``None`` without a durable root).
        peers = (PeerLayout.of(durable.world_size, settings.peer_ranks_per_host, settings.peer_copies,
                               settings.peer_hosts_per_domain)
                 if durable is not None and settings.peer_ranks_per_host else None)
        self.copier = (Copier(durable, writer, settings.storage_options, settings.files_per_rank, peers,
                              coalesce=not settings.durable_every_save, retries=settings.durable_retries)
                       if durable is not None and settings.durable_root else None)

    def close(self, timeout: float = 5.0) -> None:
        if self.copier is not None:
            self.copier.close(timeout)
        self.io.close()

    def run(self, job: SaveJob) -> JobOutcome:
        """Run one save on this rank (every rank runs the same job; see the module doc)."""
        mark = self.channel.counter.mark()
        timings: dict[str, float] = defaultdict(float)
        if self.broken is not None:
            kind, why = self.broken
            return JobOutcome(job.seq, False, job.kind(), error_kind=kind,
                              failures={self.rank: why}, finished_at=time.time())
        if self.copier is not None and job.durable:
            job = self._wait_for_copies(job)
        try:
            if job.mode is Mode.REUSE:
                prepared = self._prepared_for(job) if job.abort is None or job.prepared is not None else None
                out, made = run_reuse(self.channel, self.settings, self.io, job, prepared, timings)
            else:
                out, made = run_collective(self.channel, self.settings, self.io, job, timings)
            if made is not None:
                self._made = made
        except OutOfStep as e:
            out = self._break(job, ErrorKind.OUT_OF_STEP, f"not published: the ranks are out of step ({e}); a "
                              "save() timed out on some ranks but not on others")
        except ReceiptLost as e:
            out = self._break(job, ErrorKind.CHANNEL, f"the background channel failed on this rank during the "
                              f"save to {job.directory}, after every rank wrote its data ({e}); {e.seen}",
                              published=e.published)
        except ChannelError as e:
            out = self._break(job, ErrorKind.CHANNEL, f"the background channel failed on this rank during the "
                              f"save to {job.directory} ({e}): another rank's process or worker died, or "
                              "did not answer within the timeout")
        except Exception as e:  # noqa: BLE001 - a bug in solosave: reported in full
            out = self._break(job, ErrorKind.INTERNAL, "internal error in solosave (please report it): "
                              + "".join(traceback.format_exception(e)).rstrip())
        calls = tuple(self.channel.counter.since(mark))
        timings["coordinate"] = sum(c.seconds for c in calls)
        out = dataclasses.replace(out, timings=dict(timings), collectives=calls, finished_at=time.time())
        if out.ok and out.published and job.durable and self.copier is not None:
            out = self._queue_copy(job, out)
        return out

    def _wait_for_copies(self, job: SaveJob) -> SaveJob:
        """Before ``job`` writes: wait (bounded) for any copy that reads ``job``'s directory and,
        with every save copied, for the backlog to drop below ``MAX_PENDING``; a save that would
        rewrite a directory still being copied fails instead (on every rank, through its job)."""
        copier = self.copier
        assert copier is not None  # noqa: S101 - checked by the caller
        timeout = self.channel.timeout
        copier.wait_until(lambda: (copier.coalesce or copier.pending() < MAX_PENDING)
                          and not copier.busy_with(job.directory), timeout)
        if job.abort is None and copier.busy_with(job.directory):
            return dataclasses.replace(job, abort=f"the durable copy of the earlier save to {job.directory} was "
                                                  f"still reading it after {timeout:g} s; it is not overwritten")
        return job

    def _queue_copy(self, job: SaveJob, out: JobOutcome) -> JobOutcome:
        """Queue the durable copy of ``job`` (published on the fast tier on every rank)."""
        files = self.io.last_files
        if self.io.writer.checksums:
            files = files + tuple(checksum_path(f) for f in files)
        assert self.copier is not None and job.durable is not None  # noqa: S101 - checked by the caller
        self.copier.submit(CopyTask(job.seq, job.directory, job.durable, files, job.overwrite, out.finished_at))
        return dataclasses.replace(out, durable=job.durable)

    def _break(self, job: SaveJob, kind: ErrorKind, why: str, published: bool | None = False) -> JobOutcome:
        self.broken = (kind, f"{why}; {RECREATE}")
        return JobOutcome(job.seq, False, job.kind(), error_kind=kind, failures={self.rank: self.broken[1]},
                          published=published)

    def _prepared_for(self, job: SaveJob) -> PreparedMetadata:
        """The prepared metadata of ``job``'s token: the one the job brings (which adopts the
        template this rank made, if it was made from it), else the one kept from an earlier job."""
        if job.prepared is not None:
            self._prepared = (job.prepared_token, job.prepared)
            made, self._made = self._made, None
            if made is not None:
                job.prepared.adopt_template(made.save_id, made.template, made.index_body)
        if self._prepared is None or self._prepared[0] != job.prepared_token:
            raise RuntimeError("internal: the worker has no prepared metadata for this token")
        return self._prepared[1]



