"""What :func:`solosave.load` did on this rank: :class:`LoadResult`.

It is the path loaded from (a ``str``: existing callers that compare or open it keep working)
carrying this rank's counts: bytes of records read from storage (the shared ranges this rank
read for the others included; ``.metadata`` and the load index not included), bytes received
from and sent to other ranks by a cooperative load (:mod:`solosave._src.load.cooperative`), data
files opened, and seconds per phase. Each rank has its own; they are not gathered (a load
costs no collective for them). :meth:`LoadResult.summary` is the one line ``solosave train
--load`` prints.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LoadResult"]


class LoadResult(str):
    """The path loaded from, with this rank's counts (see the module docstring).

    ``bytes_read``: record bytes read from storage by this rank; ``bytes_received`` /
    ``bytes_sent``: delivered to / by this rank over the process group; ``files_opened``: data
    files this rank opened; ``shared_ranges``: ranges needed by two or more ranks, read once for
    all of them (the whole job's count; 0: no cooperation happened); ``rounds``: rounds of the
    cooperative exchange; ``seconds``: ``total`` (this call), ``read`` (this rank's own reads and
    decoding), ``shared_read``, ``exchange`` and ``shared_decode`` (the cooperative part);
    ``rank``: this rank in the load's group."""

    path: str
    rank: int
    bytes_read: int
    bytes_received: int
    bytes_sent: int
    files_opened: int
    shared_ranges: int
    rounds: int
    seconds: dict[str, float]

    def __new__(cls, path: str, **counts: Any) -> LoadResult:
        self = super().__new__(cls, path)
        self.path = str(path)
        self.rank = int(counts.pop("rank", 0))
        for name in ("bytes_read", "bytes_received", "bytes_sent", "files_opened", "shared_ranges", "rounds"):
            setattr(self, name, int(counts.pop(name, 0)))
        self.seconds = dict(counts.pop("seconds", {}))
        if counts:
            raise TypeError(f"LoadResult: unknown counts {sorted(counts)}")
        return self

    def __reduce__(self) -> Any:
        return (_rebuild, (self.path, self.as_dict()))

    def as_dict(self) -> dict[str, Any]:
        """The counts as a dict (JSON-ready), the path included."""
        return {"path": self.path, "rank": self.rank, "bytes_read": self.bytes_read,
                "bytes_received": self.bytes_received, "bytes_sent": self.bytes_sent,
                "files_opened": self.files_opened, "shared_ranges": self.shared_ranges, "rounds": self.rounds,
                "seconds": dict(self.seconds)}

    def summary(self) -> str:
        """One line: what this rank read, received and sent, and how long it took."""
        mib = 1 << 20
        coop = (f", received {self.bytes_received / mib:.1f} MiB and sent {self.bytes_sent / mib:.1f} MiB "
                f"({self.shared_ranges} shared ranges, {self.rounds} rounds)") if self.shared_ranges else ""
        return (f"rank {self.rank} loaded {self.path} in {self.seconds.get('total', 0.0):.2f} s: read "
                f"{self.bytes_read / mib:.1f} MiB from {self.files_opened} files{coop}")


def _rebuild(path: str, counts: dict[str, Any]) -> LoadResult:
    counts = dict(counts)
    counts.pop("path", None)
    return LoadResult(path, **counts)
