"""A save in flight: :class:`SaveHandle`, returned by ``AsyncCheckpointer.save()``.

Like DCP's ``AsyncSaveResponse`` the handle holds two futures, and a pump:

* *staged* (:class:`StagedFuture`): ``wait(timeout)`` returns once this save's tensors may change
  (with ``overlap_staging``: once its copies are done); the save's ``Staging`` is one;
* *published*: a ``concurrent.futures.Future`` of the save's :class:`~solosave.SaveResult`, or of
  its :class:`~solosave.CheckpointError`, the same on every rank;
* the *pump* (:data:`Pump`): takes at most one outcome from the worker, waiting at most the
  seconds it is given, and completes the published future of that save.

The checkpointer makes the futures and the pump, and completes the published future
(:func:`complete`, on the calling thread, from inside the pump or when ``close()`` abandons the
save); the handle only waits on them. Calling thread, every rank: ``done()`` never blocks;
``wait(timeout)`` is bounded (:func:`wait_published`); ``wait_staged()`` matters with
``overlap_staging`` only. None of them calls a collective.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

from solosave._src.coordination.protocol import JobOutcome
from solosave._src.core.errors import SaveTimeoutError
from solosave._src.save.result import DurableCopy, SaveResult, Started, error_of, result_of

#: ``pump(timeout)``: take at most one outcome from the worker (waiting at most ``timeout``
#: seconds; ``0``: only look) and complete the published future of its save.
Pump = Callable[[float], None]


class StagedFuture(Protocol):
    """When a save's tensors may change: ``wait(timeout)`` blocks at most ``timeout`` seconds
    (or orders the current CUDA stream after the copies) and raises the staging's error."""

    def wait(self, timeout: float) -> None: ...


def complete(published: Future[SaveResult], outcome: JobOutcome, path: str, rank: int, started: Started,
             durable: DurableCopy | None = None, save_id: str = "", lag: tuple[int, float] = (0, 0.0)) -> None:
    """The checkpointer, once per save: complete ``published`` from the save's outcome (its
    :class:`SaveResult`, whose warnings are issued now, or its error); ``durable``: the copy to
    the durable tier that the outcome queued."""
    if not outcome.ok:
        published.set_exception(error_of(outcome, path))
        return
    published.set_result(result_of(outcome, path, rank, started, durable, save_id, lag))
    for w in outcome.warnings:
        warnings.warn(w, RuntimeWarning, stacklevel=3)


def wait_published(published: Future[SaveResult], pump: Pump, timeout: float, path: str, rank: int) -> None:
    """Pump until ``published`` is done, at most ``timeout`` seconds; raises
    :class:`~solosave.SaveTimeoutError` (naming ``path`` and ``rank``) if it is not."""
    deadline = time.monotonic() + timeout
    while not published.done():
        left = deadline - time.monotonic()
        if left <= 0:
            raise SaveTimeoutError(
                f"save to {path} did not finish within {timeout:.0f} s on rank {rank}; "
                "another rank may be slow, stuck or dead (its error, if any, is on that rank). "
                "Raise `timeout` if saves are legitimately slow.")
        pump(min(left, 1.0))


class SaveHandle:
    """A save in flight. ``done()`` never blocks and never calls a collective.

    Made by ``AsyncCheckpointer.save()``: ``path`` and ``seq`` name the save, ``rank`` this rank;
    ``published``, ``staged`` and ``pump`` are described in the module docstring; ``timeout`` is
    the default of :meth:`wait` and :meth:`wait_staged`.
    """

    def __init__(self, path: str, seq: int, rank: int, published: Future[SaveResult], pump: Pump,
                 timeout: float, staged: StagedFuture | None = None, reported: bool = False) -> None:
        self.path = path
        self.seq = seq
        self._rank = rank
        self._published = published
        self._pump = pump
        self._timeout = timeout
        self._staged = staged
        #: The user saw this save's result or error (or never had a handle: an aborted save).
        self.reported = reported

    def wait_staged(self, timeout: float | None = None) -> None:
        """Return once the saved tensors may change again (``overlap_staging``).

        With ``overlap_staging``: return once this save's tensors are copied (CPU tensors),
        or once the current CUDA stream is ordered after the copies (nothing blocks): the
        saved tensors may change from then on. Call it before ``optimizer.step()``. Raises
        :class:`~solosave.StagingRaceError` if a saved tensor changed in place before (the save
        then fails on every rank). Without ``overlap_staging`` it returns at once."""
        if self._staged is not None:
            self._staged.wait(self._timeout if timeout is None else timeout)

    def done(self) -> bool:
        if not self._published.done():
            self._pump(0.0)
        return self._published.done()

    def wait(self, timeout: float | None = None) -> SaveResult:
        """Wait for this save to finish and return its result.

        Waits at most ``timeout`` seconds (default: the checkpointer's ``timeout``) and returns
        the :class:`SaveResult`, or raises the save's error (the same on every rank)."""
        wait_published(self._published, self._pump, self._timeout if timeout is None else timeout,
                       self.path, self._rank)
        self.reported = True
        return self._published.result()
