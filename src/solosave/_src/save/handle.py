"""A save in flight: :class:`SaveHandle`, returned by ``AsyncCheckpointer.save()``.

Calling thread, every rank: ``done()`` never blocks; ``wait(timeout)`` is bounded and returns the
:class:`~solosave.SaveResult` or raises the save's :class:`~solosave.CheckpointError`, the same on
every rank; ``wait_staged()`` matters with ``overlap_staging`` only. Neither calls a collective:
the handle's checkpointer takes the outcome from its worker (``_pump``) and hands it here
(``_set``).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from solosave._src.coordination.channel import CollectiveCall
from solosave._src.coordination.protocol import JobOutcome, SaveJob
from solosave._src.save.result import PhaseTimings, SaveResult, error_of
from solosave._src.save.staging import Staging

if TYPE_CHECKING:
    from solosave._src.save.checkpointer import AsyncCheckpointer


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
        #: The user saw this save's result or error (or never had a handle: an aborted save).
        self.reported = job.abort is not None
        self._staging: Staging | None = None

    def wait_staged(self, timeout: float | None = None) -> None:
        """With ``overlap_staging``: return once this save's tensors are copied (CPU tensors),
        or once the current CUDA stream is ordered after the copies (nothing blocks): the
        saved tensors may change from then on. Call it before ``optimizer.step()``. Raises
        :class:`~solosave.StagingRaceError` if a saved tensor changed in place before (the save
        then fails on every rank). Without ``overlap_staging`` it returns at once."""
        if self._staging is not None:
            self._staging.wait(self._owner.options.timeout if timeout is None else timeout)

    def _set(self, outcome: JobOutcome) -> None:
        self._outcome = outcome
        t_start, t_plan, t_stage, t_block = self._t
        tm = outcome.timings
        if not outcome.ok:
            self._error = error_of(outcome, self.path)
            return
        self._result = SaveResult(
            path=self.path, rank=self._owner.rank, mode=outcome.kind.value, bytes_written=outcome.bytes_written,
            timings=PhaseTimings(t_plan, t_stage, tm.get("write", 0.0), tm.get("coordinate", 0.0),
                                 tm.get("publish", 0.0), t_block, max(outcome.finished_at - t_start, 0.0)),
            collectives_calling_thread=self._calling, collectives_background=outcome.collectives,
            published=outcome.published, warnings=outcome.warnings)
        for w in outcome.warnings:
            warnings.warn(w, RuntimeWarning, stacklevel=3)

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
        if self._result is None:
            raise RuntimeError("internal: a finished save without result or error")
        return self._result
