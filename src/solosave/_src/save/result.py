"""What a finished save reports: :class:`SaveResult` (with :class:`PhaseTimings`), or the
:class:`~solosave.CheckpointError` its handle raises - built from the background's
:class:`~solosave._src.coordination.protocol.JobOutcome`, the same on every rank."""

from __future__ import annotations

from dataclasses import dataclass

from solosave._src.coordination.channel import CollectiveCall
from solosave._src.coordination.protocol import ErrorKind, JobOutcome
from solosave._src.core.errors import CheckpointError, LayoutDriftError
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

    def collectives(self, where: str = "all") -> dict[str, dict[str, int]]:
        """``{kind: {"count": n, "bytes": payload}}`` for ``where`` in
        ``"all"``, ``"calling_thread"``, ``"background"``."""
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


def result_of(outcome: JobOutcome, path: str, rank: int, started: Started) -> SaveResult:
    """The :class:`SaveResult` of a successful save on this rank."""
    tm = outcome.timings
    return SaveResult(
        path=path, rank=rank, mode=outcome.kind.value, bytes_written=outcome.bytes_written,
        timings=PhaseTimings(started.plan_s, started.stage_s, tm.get("write", 0.0), tm.get("coordinate", 0.0),
                             tm.get("publish", 0.0), started.block_s, max(outcome.finished_at - started.at, 0.0)),
        collectives_calling_thread=started.calling, collectives_background=outcome.collectives,
        published=outcome.published, warnings=outcome.warnings)


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
