"""solosave: asynchronous DCP checkpoints whose steady-state saves need no gathers.

Public API (everything else is private and may change)::

    AsyncCheckpointer, CheckpointerOptions, SaveHandle, SaveResult, PhaseTimings, CollectiveCall,
    DurableCopy, DurableResult
    save, async_save, DcpSaver, default_saver     (DCP's save calls, by solosave)
    load, LoadResult, PreparedMetadata, Fingerprint, load_prepared_metadata, save_prepared_metadata
    FileWriter, verify_checkpoint, VerifyReport, export, ExportReport
    SolosaveError, CheckpointError, LayoutDriftError, WorkerDiedError, CheckpointExistsError,
    CorruptCheckpointError, PreparedMetadataError, UnsafeMetadataError, FingerprintMismatchError, SaveTimeoutError,
    StagingRaceError
"""

from solosave._src.coordination.channel import CollectiveCall
from solosave._src.core.errors import (
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
from solosave._src.load.load import load
from solosave._src.load.result import LoadResult
from solosave._src.prepared.prepared import (
    Fingerprint,
    PreparedMetadata,
    load_prepared_metadata,
    save_prepared_metadata,
)
from solosave._src.save.checkpointer import AsyncCheckpointer, SaveHandle
from solosave._src.save.dcp_saver import DcpSaver, async_save, default_saver, save
from solosave._src.save.options import CheckpointerOptions
from solosave._src.save.result import DurableCopy, DurableResult, PhaseTimings, SaveResult
from solosave._src.tools.export import ExportReport, export
from solosave._src.tools.verify import VerifyReport, verify_checkpoint
from solosave._src.write.writer import FileWriter

__version__ = "0.3.0.dev0"

__all__ = [
    "AsyncCheckpointer",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointerOptions",
    "CollectiveCall",
    "CorruptCheckpointError",
    "DurableCopy",
    "DurableResult",
    "DcpSaver",
    "ExportReport",
    "FileWriter",
    "Fingerprint",
    "FingerprintMismatchError",
    "LayoutDriftError",
    "LoadResult",
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
    "async_save",
    "default_saver",
    "export",
    "load",
    "load_prepared_metadata",
    "save",
    "save_prepared_metadata",
    "verify_checkpoint",
    "__version__",
]
