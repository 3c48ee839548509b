"""The exception tree of solosave.

Every exception solosave raises on purpose derives from :class:`SolosaveError`, which derives
from :class:`Exception` (unlike DCP's ``CheckpointException``, ``except Exception`` catches it)::

    SolosaveError
    ├── CheckpointError            a save failed; raised by ``SaveHandle.wait()`` on every rank
    │   ├── LayoutDriftError       reuse save whose layout no longer matches the prepared metadata
    │   └── WorkerDiedError        the background worker process of a rank exited
    ├── CheckpointExistsError      destination already holds a complete checkpoint (also
    │                              FileExistsError and DCP's CheckpointException: see below)
    ├── CorruptCheckpointError     a published checkpoint's data files do not hold what .metadata says
    ├── PreparedMetadataError      a prepared-metadata file is unreadable, unsafe or mismatched (also ValueError)
    │   ├── UnsafeMetadataError    the pickle would import something outside the allowlist
    │   └── FingerprintMismatchError  world size / workers / structure differ from this run
    ├── SaveTimeoutError           a bounded wait ran out (also TimeoutError)
    └── StagingRaceError           overlapped staging: a tensor changed before its copy was done

Bad arguments raise plain :class:`ValueError` / :class:`TypeError` with a message that names the
problem and the fix.

Internal exceptions, raised and handled inside solosave (at the end of this module)::

    OptionError (ValueError)       an option's bad value; the message names options as fields or flags
    ChannelError                   a collective failed: the channel is broken (the engine's outcome says so)
    OutOfStep                      the ranks' engines are not running the same save
    PlanValidationError (ValueError)  the ranks' items do not form a consistent global checkpoint
    IndexUnusable (SolosaveError)  the load index cannot be used; the load reads .metadata instead
    └── IndexStale                 the index belongs to another .metadata

(``engine/reuse.py``'s ``ReceiptLost``, a ``ChannelError`` that also says whether ``.metadata`` was
seen published, stays beside the only code that raises and handles it.)

:class:`CheckpointExistsError` is also a ``torch.distributed.checkpoint.api.CheckpointException``,
so code written for ``dcp.save`` (``except CheckpointException``) catches solosave's refusal to
save over a checkpoint. That class derives from ``BaseException`` only; ours still derives from
``Exception`` first (the method resolution order is SolosaveError, FileExistsError, OSError,
Exception, CheckpointException, BaseException), so ``except Exception`` catches it too, and
``str()`` is our one-line message, not DCP's per-rank traceback listing. No other solosave error
is a ``CheckpointException``: a handler for DCP's failures that re-raises a ``BaseException``
would otherwise see solosave's ordinary errors change class.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException


class SolosaveError(Exception):
    """Base class of every error solosave raises on purpose."""


class CheckpointError(SolosaveError):
    """A save failed; no ``.metadata`` was published for it.

    ``failures`` maps each failing rank to a description of its error. Every rank of the
    save raises this from ``SaveHandle.wait()``, with the same ``failures``.
    """

    def __init__(self, message: str, failures: Mapping[int, str] | None = None) -> None:
        self.failures: dict[int, str] = dict(failures or {})
        self.message = message
        super().__init__(message)

    def __str__(self) -> str:
        if not self.failures:
            return self.message
        lines = [self.message]
        for rank in sorted(self.failures):
            lines.append(f"  rank {rank}: {self.failures[rank]}")
        return "\n".join(lines)


class LayoutDriftError(CheckpointError):
    """A reuse save found that the written layout differs from the prepared metadata.

    Raised on every rank when ``on_layout_drift="raise"``. ``drifts`` maps each rank to the
    items that drifted there (human-readable, one entry per item).
    """

    def __init__(self, message: str, drifts: Mapping[int, Sequence[str]]) -> None:
        self.drifts: dict[int, list[str]] = {r: list(v) for r, v in drifts.items()}
        super().__init__(
            message,
            {r: "; ".join(v[:10]) + (f" (+{len(v) - 10} more)" if len(v) > 10 else "")
             for r, v in self.drifts.items() if v},
        )


class WorkerDiedError(CheckpointError):
    """The background worker process of this rank exited unexpectedly."""


class CheckpointExistsError(SolosaveError, FileExistsError, CheckpointException):
    """The destination already holds a complete checkpoint and ``overwrite`` was not given.

    Raised by ``save()`` on each rank that finds the checkpoint, before anything is written. Also
    a ``FileExistsError`` and a DCP ``CheckpointException`` (see the module docstring), whose
    ``failures`` is empty here: no rank failed, the save was refused."""

    #: The words of DCP's own error (``FileSystemWriter`` with ``overwrite=False``), which code
    #: written for DCP matches; every message starts with them.
    DCP_TEXT = "Checkpoint already exists"

    def __init__(self, message: str) -> None:
        if not message.startswith(self.DCP_TEXT):
            message = f"{self.DCP_TEXT}: {message}"
        FileExistsError.__init__(self, message)  # args (message,): str() and pickling as an OSError's
        self._failures: dict = {}


class CorruptCheckpointError(SolosaveError):
    """A published checkpoint's data files are missing, truncated or fail their checksums.

    A data file is missing, shorter than ``.metadata`` says, or fails its recorded checksums
    (raised by :func:`solosave.load` before any value is read, and reported by
    ``solosave verify``). ``problems`` lists each finding."""

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.problems = list(problems)

    def __reduce__(self) -> tuple:  # DCP gathers exceptions between ranks: keep ``problems``
        return (type(self), (str(self), self.problems))


class PreparedMetadataError(SolosaveError, ValueError):
    """A prepared-metadata (or ``.metadata``) file cannot be used."""


class UnsafeMetadataError(PreparedMetadataError):
    """The file's pickle names a global outside solosave's allowlist; nothing was executed."""


class FingerprintMismatchError(PreparedMetadataError):
    """The prepared metadata was made for another world size, ``workers`` or structure."""


class SaveTimeoutError(SolosaveError, TimeoutError):
    """A bounded wait ran out of time."""


class StagingRaceError(SolosaveError):
    """A staged tensor was changed in place before its copy finished (``overlap_staging``).

    With ``overlap_staging``, a staged tensor was changed in place (e.g. by ``optimizer.step()``)
    before ``SaveHandle.wait_staged()``; that save fails on every rank."""


def describe(e: BaseException) -> str:
    """``Type: message at file:line`` of an exception: one line, for messages sent to every rank."""
    tb = traceback.extract_tb(e.__traceback__)
    where = f" at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno}" if tb else ""
    return f"{type(e).__name__}: {e}{where}"


# -- Internal exceptions: raised and handled inside solosave (an OptionError reaches the user as
# the ValueError it is) ----------------------------------------------------------------------------

class PlanValidationError(ValueError):
    """The ranks' items do not form a consistent global checkpoint."""


class ChannelError(Exception):
    """A collective failed on this rank: another rank's process or worker died, or did not
    answer within the timeout. The channel cannot be used any more."""


class OutOfStep(Exception):
    """The ranks' engines are not running the same save (found in a collective's result)."""


class FailedElsewhere(SolosaveError):
    """Another rank of a cooperative load could not read its share for the others: this rank
    stopped too. :func:`solosave.load` then raises the failing rank's own error on every
    rank; this one is only what a rank holds before the errors are gathered."""


class IndexUnusable(SolosaveError):
    """The index cannot be used for this load (stale, foreign, truncated, corrupt or crafted);
    the message says why. The loader then reads ``.metadata``, as stock DCP does."""


class IndexStale(IndexUnusable):
    """The index belongs to another ``.metadata`` (another save wrote into the directory since),
    or the ``.metadata`` is gone: harmless, it is not used."""


class OptionError(ValueError):
    """An option has a bad value. ``template`` names options as ``{field}``: the message shows
    the field names (the API) or, through :func:`options_from_args`, the flags."""

    def __init__(self, template: str) -> None:
        self.template = template
        super().__init__(self.render(lambda name: name))

    def render(self, name_of: Any) -> str:
        """The message with every ``{field}`` replaced by ``name_of(field)``."""
        return self.template.format_map(_Names(name_of))


class _Names(dict):
    def __init__(self, name_of: Any) -> None:
        super().__init__()
        self.name_of = name_of

    def __missing__(self, key: str) -> str:
        return self.name_of(key)
