"""solosave: asynchronous DCP checkpoints whose steady-state saves need no gathers.

Public API (everything else is private and may change)::

    AsyncCheckpointer, SaveHandle, SaveResult, PhaseTimings, CollectiveCall
    load, PreparedMetadata, Fingerprint, load_prepared_metadata, save_prepared_metadata
    FileWriter, verify_checkpoint, VerifyReport
    SolosaveError, CheckpointError, LayoutDriftError, WorkerDiedError, CheckpointExistsError,
    CorruptCheckpointError, PreparedMetadataError, UnsafeMetadataError, FingerprintMismatchError, SaveTimeoutError
"""

from ._checkpointer import AsyncCheckpointer, PhaseTimings, SaveHandle, SaveResult
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
    UnsafeMetadataError,
    WorkerDiedError,
)
from ._load import load
from ._prepared import Fingerprint, PreparedMetadata, load_prepared_metadata, save_prepared_metadata
from ._verify import VerifyReport, verify_checkpoint
from ._write import FileWriter

__version__ = "0.1.0"

__all__ = [
    "AsyncCheckpointer",
    "CheckpointError",
    "CheckpointExistsError",
    "CollectiveCall",
    "CorruptCheckpointError",
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
    "UnsafeMetadataError",
    "VerifyReport",
    "WorkerDiedError",
    "load",
    "load_prepared_metadata",
    "save_prepared_metadata",
    "verify_checkpoint",
    "__version__",
]
