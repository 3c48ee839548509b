"""What a finished save reports: :class:`SaveResult` (with :class:`PhaseTimings`), or the
:class:`~solosave.CheckpointError` its handle raises - built from the background's
:class:`~solosave._src.coordination.protocol.JobOutcome`, the same on every rank."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from solosave._src.coordination.channel import CollectiveCall
from solosave._src.coordination.protocol import DurableOutcome, ErrorKind, JobOutcome
from solosave._src.core.errors import CheckpointError, LayoutDriftError, SaveTimeoutError
from solosave._src.formats.dcp import METADATA_FILE


@dataclass(frozen=True, slots=True)
class PhaseTimings:
    """Seconds per phase of one save, on this rank."""

    plan: float
    stage: float
    write: float
    coordinate: float
    publish: float
    #: Time the caller spent inside ``save()`` (the training loop's stall).
    block: float
    #: From entering ``save()`` to the background finishing (published, on every rank).
    to_published: float


@dataclass(frozen=True, slots=True)
class DurableResult:
    """How one save's copy to the durable tier ended.

    The same ``ok`` and ``failures`` on every rank. A failed copy never touched the fast copy,
    which stays published."""

    path: str
    #: Whether ``<durable>/.metadata`` was published.
    ok: bool
    #: Per failing rank, what went wrong (empty when ``ok``).
    failures: dict[int, str]
    #: Bytes this rank copied (its files; on the coordinator also the index and ``.metadata``).
    bytes_copied: int
    #: Seconds from the fast publication to the end of the copy, on this rank.
    seconds: float
    #: The collectives of the durable stage (on its own channel): one 8-byte ``all_reduce``,
    #: plus an ``all_gather_object`` of the errors when a copy failed; with peer copies also
    #: the peer stage's: one more ``all_reduce`` and its ``send`` / ``recv`` messages.
    collectives: tuple[CollectiveCall, ...]
    #: Peer copies (``peer_copy``): whether every rank's files reached its peer host's fast tier
    #: (``None``: no peer copy), and per failing rank what went wrong. Run before the durable
    #: copy; independent of ``ok``.
    peer_ok: bool | None = None
    peer_failures: dict[int, str] = field(default_factory=dict)
    #: Not copied, on purpose: a newer save's copy replaced it before it started (durable
    #: copies that fall behind are coalesced, the latest wins). Not a failure; ``ok`` is False.
    superseded: bool = False
    #: How many times the copy was run (more than one: it failed and was tried again).
    attempts: int = 1

    @property
    def peer_error(self) -> str | None:
        """One line naming the ranks whose peer copy failed (``None`` when ok or not made)."""
        if self.peer_ok is not False:
            return None
        why = "; ".join(f"rank {r}: {m}" for r, m in sorted(self.peer_failures.items()))
        return f"peer copy (before the copy to {self.path}) failed on rank(s) {sorted(self.peer_failures)}: {why}"

    @property
    def error(self) -> str | None:
        """One line naming the failing ranks and what went wrong (``None`` when ``ok``)."""
        if self.ok:
            return None
        if self.superseded:
            return (f"durable copy to {self.path} skipped: a newer save's copy replaced it before it started "
                    "(copies that fall behind are coalesced; the latest wins)")
        return f"durable copy to {self.path} failed on rank(s) {sorted(self.failures)}: " + "; ".join(
            f"rank {r}: {m}" for r, m in sorted(self.failures.items()))


def durable_result_of(outcome: DurableOutcome) -> DurableResult:
    return DurableResult(outcome.path, outcome.ok, dict(outcome.failures), outcome.bytes_copied,
                         max(outcome.finished_at - outcome.started_at, 0.0), tuple(outcome.collectives),
                         outcome.peer_ok, dict(outcome.peer_failures), outcome.superseded_by is not None,
                         outcome.attempts)


class DurableCopy:
    """A save's copy to the durable tier, in flight or done (``SaveResult.durable``).

    Calling thread, every rank; no method calls a collective. ``done()`` never blocks; ``wait(timeout)``
    returns the :class:`DurableResult` (a failure is a result with ``ok=False``, not an
    exception) or raises :class:`~solosave.SaveTimeoutError` if it did not end in time. Made by
    the checkpointer, which completes ``future``; ``pump(seconds)`` takes the next message of
    the worker (see ``save/handle.py``)."""

    def __init__(self, path: str, future: Future[DurableResult], pump: Callable[[float], None],
                 timeout: float) -> None:
        self.path = path
        self._future = future
        self._pump = pump
        self._timeout = timeout

    def done(self) -> bool:
        if not self._future.done():
            self._take(0.0)
        return self._future.done()

    def wait(self, timeout: float | None = None) -> DurableResult:
        limit = self._timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while not self._future.done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise SaveTimeoutError(f"the durable copy to {self.path} did not end within {limit:.0f} s")
            self._take(min(left, 1.0))
        return self._future.result()

    def _take(self, seconds: float) -> None:
        try:
            self._pump(seconds)
        except Exception:
            if not self._future.done():  # the pump's error (a dead worker) settled this copy: its result
                raise

    def __repr__(self) -> str:
        state = "pending" if not self._future.done() else ("ok" if self._future.result().ok else "failed")
        return f"DurableCopy({self.path!r}, {state})"


@dataclass(frozen=True, slots=True)
class SaveResult:
    """The outcome of one save on this rank."""

    path: str
    rank: int
    #: "collective", "create", "reuse" or "reuse+fallback" (the values of ``SaveKind``).
    mode: str
    bytes_written: int
    timings: PhaseTimings
    collectives_calling_thread: tuple[CollectiveCall, ...]
    collectives_background: tuple[CollectiveCall, ...]
    #: Whether ``.metadata`` was published (known on every rank: a successful save is published).
    published: bool
    warnings: tuple[str, ...] = ()
    #: Two tiers: this save's copy to the durable tier (``None`` without ``durable_root``).
    durable: DurableCopy | None = None
    #: The ``save_id`` of the ``.metadata`` it published (``storage_meta.save_id``), the same on
    #: every rank: what tells this checkpoint from another one published under the same name.
    save_id: str = ""
    #: Two tiers, the durable tier's lag when this save was published: earlier saves published
    #: since the newest one that reached the durable tier (their copies pending, coalesced or
    #: failed), and seconds since the oldest of them was published (0, 0.0: up to date).
    durable_behind: int = 0
    durable_lag_s: float = 0.0

    def collectives(self, where: str = "all") -> dict[str, dict[str, int]]:
        """Count this save's collectives and their payload bytes, per kind.

        Returns ``{kind: {"count": n, "bytes": payload}}`` for ``where`` in ``"all"``,
        ``"calling_thread"``, ``"background"``."""
        calls = {"all": self.collectives_calling_thread + self.collectives_background,
                 "calling_thread": self.collectives_calling_thread,
                 "background": self.collectives_background}[where]
        out: dict[str, dict[str, int]] = {}
        for c in calls:
            d = out.setdefault(c.kind, {"count": 0, "bytes": 0})
            d["count"] += 1
            d["bytes"] += c.payload_bytes
        return out


@dataclass(frozen=True, slots=True)
class Started:
    """What ``save()`` measured on the calling thread, for the save's :class:`SaveResult`."""

    #: ``time.time()`` when ``save()`` was entered.
    at: float
    plan_s: float
    stage_s: float
    block_s: float
    calling: tuple[CollectiveCall, ...]


def result_of(outcome: JobOutcome, path: str, rank: int, started: Started,
              durable: DurableCopy | None = None, save_id: str = "", lag: tuple[int, float] = (0, 0.0)) -> SaveResult:
    """The :class:`SaveResult` of a successful save on this rank."""
    tm = outcome.timings
    return SaveResult(
        path=path, rank=rank, mode=outcome.kind.value, bytes_written=outcome.bytes_written,
        timings=PhaseTimings(started.plan_s, started.stage_s, tm.get("write", 0.0), tm.get("coordinate", 0.0),
                             tm.get("publish", 0.0), started.block_s, max(outcome.finished_at - started.at, 0.0)),
        collectives_calling_thread=started.calling, collectives_background=outcome.collectives,
        published=outcome.published is True, warnings=outcome.warnings, durable=durable, save_id=save_id,
        durable_behind=lag[0], durable_lag_s=lag[1])


def error_of(outcome: JobOutcome, path: str) -> CheckpointError:
    """The error every rank raises for a failed save."""
    if outcome.error_kind is ErrorKind.DRIFT:
        return LayoutDriftError(
            f"save to {path} stopped: the layout drifted from the prepared metadata on "
            f"rank(s) {sorted(outcome.drifts)}; nothing was published (on_layout_drift='raise'). "
            "Recreate the prepared metadata or use on_layout_drift='fallback'.", outcome.drifts)
    if outcome.published:
        published = f"its {METADATA_FILE} was published before the failure was known"
    elif outcome.published is None:
        published = f"this rank cannot tell whether its {METADATA_FILE} was published (look for it there)"
    else:
        published = f"no {METADATA_FILE} was published (the previous checkpoint is untouched)"
    return CheckpointError(f"save to {path} failed on rank(s) {sorted(outcome.failures)}; {published}",
                           outcome.failures)
