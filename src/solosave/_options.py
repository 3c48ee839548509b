"""Checkpointer options: one frozen dataclass, validated once at construction."""

from __future__ import annotations

import os
from dataclasses import dataclass
from torch.distributed.checkpoint.metadata import Metadata

from ._prepared import PreparedMetadata

DRIFT_POLICIES = ("fallback", "raise")


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointerOptions:
    """Options of :class:`~solosave.AsyncCheckpointer` (see its docstring for each)."""

    workers: int = 1
    """Writer threads per rank = data files per rank (``__{rank}_{0..workers-1}.distcp``)."""
    persistent_worker: bool = True
    """One spawned process per rank, reused across saves; ``False``: a thread in this process."""
    prepared_metadata: str | os.PathLike | Metadata | PreparedMetadata | None = None
    """Reuse mode: a prepared file path (or a ``Metadata`` / ``PreparedMetadata`` object)."""
    create_prepared_metadata: bool = False
    """The first save creates ``prepared_metadata`` (a path) if it is absent, then reuses it."""
    assume_constant_structure: bool = False
    """Without prepared metadata: skip the planning gather once two saves had the same plan."""
    on_layout_drift: str = "fallback"
    """``"fallback"``: a drifted reuse save takes the collective path; ``"raise"``: it fails."""
    timeout: float = 600.0
    """Seconds: bound of every wait (worker start, a save's completion, collectives)."""

    def __post_init__(self) -> None:
        if not isinstance(self.workers, int) or isinstance(self.workers, bool) or self.workers < 1:
            raise ValueError(f"workers must be an int >= 1 (files per rank), got {self.workers!r}")
        if self.on_layout_drift not in DRIFT_POLICIES:
            raise ValueError(f"on_layout_drift must be one of {DRIFT_POLICIES}, got {self.on_layout_drift!r}")
        if not (isinstance(self.timeout, (int, float)) and self.timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout!r}")
        pm = self.prepared_metadata
        if pm is not None and not isinstance(pm, (str, os.PathLike, Metadata, PreparedMetadata)):
            raise TypeError("prepared_metadata must be a path, a torch.distributed.checkpoint "
                            f"Metadata or a solosave.PreparedMetadata, got {type(pm).__name__}")
        if self.create_prepared_metadata:
            if pm is None:
                raise ValueError("create_prepared_metadata=True needs prepared_metadata=<path> "
                                 "naming the file to create (e.g. prepared_metadata='prepared.metadata')")
            if isinstance(pm, (Metadata, PreparedMetadata)):
                raise ValueError("create_prepared_metadata=True needs a file path, not a Metadata "
                                 "object: pass the path to create, or drop create_prepared_metadata "
                                 "to reuse the object as it is")

    @property
    def prepared_path(self) -> str | None:
        pm = self.prepared_metadata
        return os.fspath(pm) if isinstance(pm, (str, os.PathLike)) else None

