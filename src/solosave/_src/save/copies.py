"""The durable copies a rank's saves started and its worker has not reported yet (two tiers).

Trainer side, calling thread of one rank; nothing here calls a collective or touches storage.
:class:`~solosave._src.save.checkpointer.AsyncCheckpointer` registers a copy when the save it
belongs to is published on the fast tier (:meth:`PendingCopies.track`), completes it when the
worker's :class:`~solosave._src.coordination.protocol.DurableOutcome` arrives
(:meth:`PendingCopies.complete`), and, when the worker is gone or ``close()`` gives up, reports
every copy still pending as failed (:meth:`PendingCopies.fail_all`): a copy is always reported,
exactly once."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future

from solosave._src.coordination.protocol import DurableOutcome
from solosave._src.save.result import DurableCopy, DurableResult, durable_result_of

__all__ = ["PendingCopies"]


class PendingCopies:
    """This rank's durable copies not yet reported, by save number."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._pending: dict[int, tuple[str, Future[DurableResult]]] = {}
        #: Saves published since the newest one whose copy was published on the durable tier
        #: (pending, coalesced or failed): when each was tracked (``time.monotonic()``).
        self._since: dict[int, float] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def paths(self) -> list[str]:
        """The durable directories of the pending copies, oldest save first."""
        return [path for _, (path, _) in sorted(self._pending.items())]

    def lag(self) -> tuple[int, float]:
        """How far the durable tier is behind: the saves published on the fast tier since the
        newest one published on the durable tier, and seconds since the oldest of them was."""
        if not self._since:
            return 0, 0.0
        return len(self._since), time.monotonic() - min(self._since.values())

    def track(self, seq: int, path: str, pump: Callable[[float], None], timeout: float) -> DurableCopy:
        """Register save ``seq``'s copy to ``path``; returns the handle the save's result holds."""
        future: Future[DurableResult] = Future()
        self._pending[seq] = (path, future)
        self._since[seq] = time.monotonic()
        return DurableCopy(path, future, pump, timeout)

    def complete(self, outcome: DurableOutcome) -> None:
        """The worker reported the copy of save ``outcome.seq`` (unknown numbers are ignored:
        a copy already reported failed by :meth:`fail_all`)."""
        entry = self._pending.pop(outcome.seq, None)
        if outcome.ok:  # durable up to this save: the older ones are covered by it
            self._since = {seq: t for seq, t in self._since.items() if seq > outcome.seq}
        if entry is not None:
            entry[1].set_result(durable_result_of(outcome))

    def fail_all(self, why: str) -> None:
        """Report every pending copy as failed on this rank (the worker is gone, or ``close()``
        gave up on them): as far as this rank knows, their ``.metadata`` was not published on
        the durable tier (look there to be sure)."""
        pending, self._pending = self._pending, {}
        self._since.clear()
        for path, future in pending.values():
            future.set_result(DurableResult(path, False, {self.rank: why}, 0, 0.0, ()))
