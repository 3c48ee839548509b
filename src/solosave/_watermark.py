"""Between staging and writing: how far the trainer's copy into the staging buffer has got.

A save whose tensors the calling thread copies on the CPU (the default, blocking staging) is
handed to the worker *before* the copies start (``SaveJob.progressive``). The trainer then copies
the tensors in buffer order, in groups of about ``_stage.GROUP_BYTES``, and after each group
tells the worker how far it got: a :class:`~solosave._protocol.StageProgress`, sent over the
pipe to the worker process, or handed to the worker thread. The worker writes a record as soon
as its bytes lie below that mark, so the disk starts while the trainer still copies and the copy
is no longer on the path to publication (issue 13). ``save()`` still returns only once every
copy is done.

Ordering: the trainer writes the buffer, then sends the message; the worker receives the
message, then reads the bytes. The pipe's system calls (the condition's lock, in-process) order
the two.

Owner: :class:`Watermark` lives on the worker side, one per progressive job. The transport makes
it when the job arrives and feeds it the job's progress messages (the worker process's inbox
thread, or the trainer thread for the worker thread); the writer threads and the CRC thread wait
on it (``FileWriter.write_files(..., staged=...)``), and the engine checks that the copy ended
well before it reports its status (:meth:`Watermark.wait_done`).
"""

from __future__ import annotations

import threading
import time

from ._errors import SaveTimeoutError
from ._protocol import StageProgress


class StagingFailed(RuntimeError):
    """The trainer's copy into the staging buffer failed or was abandoned (the save fails on
    every rank, naming this rank and the reason)."""


class Watermark:
    """The staged part of one progressive save's buffer, as the worker sees it.

    ``timeout``: the longest one wait lasts (seconds); a trainer that stops sending progress
    makes the wait raise :class:`~solosave.SaveTimeoutError`."""

    def __init__(self, seq: int, timeout: float) -> None:
        self.seq = seq
        self.timeout = timeout
        self._staged = 0
        self._done = False
        self._error: str | None = None
        self._cond = threading.Condition()

    @property
    def done(self) -> bool:
        return self._done

    def update(self, progress: StageProgress) -> None:
        """Take the trainer's progress (messages of other saves are ignored)."""
        if progress.seq != self.seq:
            return
        with self._cond:
            if self._done:
                return
            self._staged = max(self._staged, progress.staged)
            if progress.error is not None:
                self._error = progress.error
            self._done = progress.done or progress.error is not None
            self._cond.notify_all()

    def abandon(self, why: str) -> None:
        """No more progress will come (the trainer closed the pipe or stopped the worker)."""
        self.update(StageProgress(self.seq, 0, True, why))

    def wait(self, end: int) -> None:
        """Return once the buffer's bytes ``[0, end)`` are staged; raise :class:`StagingFailed`
        if the copy failed first, :class:`~solosave.SaveTimeoutError` after ``timeout``."""
        if self._staged >= end:  # bytes below the mark were copied: no lock needed to trust it
            return
        self._wait_for(lambda: self._staged >= end, f"byte {end} of the staging buffer to be copied")

    def wait_done(self) -> None:
        """Return once the whole copy ended well; raise as :meth:`wait` does."""
        self._wait_for(lambda: False, "the staging copy to end")

    def _wait_for(self, reached: object, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while True:
                if self._error is not None:
                    raise StagingFailed(f"staging failed on this rank: {self._error}")
                if self._done or reached():  # type: ignore[operator]
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SaveTimeoutError(f"save {self.seq}: waited {self.timeout:g} s for {what}; the "
                                           "trainer sent no progress (is its process stuck?)")
                self._cond.wait(left)
