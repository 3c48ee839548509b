"""solosave: asynchronous DCP checkpoints whose steady-state saves need no gathers.

Public API (everything else is private and may change)::

    AsyncCheckpointer, CheckpointerOptions, SaveHandle, SaveResult, PhaseTimings, CollectiveCall
    load, PreparedMetadata, Fingerprint, load_prepared_metadata, save_prepared_metadata
    FileWriter, verify_checkpoint, VerifyReport, export, ExportReport
    SolosaveError, CheckpointError, LayoutDriftError, WorkerDiedError, CheckpointExistsError,
    CorruptCheckpointError, PreparedMetadataError, UnsafeMetadataError, FingerprintMismatchError, SaveTimeoutError,
    StagingRaceError
"""

from ._checkpointer import AsyncCheckpointer, SaveHandle
from ._coordinate import CollectiveCall
from ._errors import (
    CheckpointError,
    CheckpointExistsError,
    CorruptCheckpointError,
    FingerprintMismatchError,
    LayoutDriftError,
    PreparedMetadataError,
    SaveTimeoutError,
    SolosaveError,
    StagingRaceError,
    UnsafeMetadataError,
    WorkerDiedError,
)
from ._export import ExportReport, export
from ._load import load
from ._options import CheckpointerOptions
from ._prepared import Fingerprint, PreparedMetadata, load_prepared_metadata, save_prepared_metadata
from ._result import PhaseTimings, SaveResult
from ._verify import VerifyReport, verify_checkpoint
from ._write import FileWriter

__version__ = "0.1.0"

__all__ = [
    "AsyncCheckpointer",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointerOptions",
    "CollectiveCall",
    "CorruptCheckpointError",
    "ExportReport",
    "FileWriter",
    "Fingerprint",
    "FingerprintMismatchError",
    "LayoutDriftError",
    "PhaseTimings",
    "PreparedMetadata",
    "PreparedMetadataError",
    "SaveHandle",
    "SaveResult",
    "SaveTimeoutError",
    "SolosaveError",
    "StagingRaceError",
    "UnsafeMetadataError",
    "VerifyReport",
    "WorkerDiedError",
    "export",
    "load",
    "load_prepared_metadata",
    "save_prepared_metadata",
    "verify_checkpoint",
    "__version__",
]
