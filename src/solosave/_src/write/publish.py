"""Step 5 of a save: publishing ``.metadata`` (coordinator only, last, atomically).

:func:`publish_metadata` commits through the storage of the checkpoint, with the commit type
its backend chose (:mod:`solosave._src.storage.base`): locally a
:class:`~solosave._src.storage.local.RenameCommit` (a temporary file in the same directory,
flush, fsync, rename over the destination - ``os.replace`` is atomic on POSIX -, fsync the
directory), so a crash at any point leaves the old file or no file, never a truncated one; on
an object store a :class:`~solosave._src.storage.fsspec.PutCommit`, one single-object write,
which readers see whole or not at all.

:class:`MetadataTemplate` serializes a ``Metadata`` once and renders it per checkpoint with a
new ``storage_meta`` (``checkpoint_id``, ``save_id``) by splicing two strings into the pickle,
instead of re-pickling the whole object on every reuse save: publishing costs one file write.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from solosave._src.formats.dcp import METADATA_FILE
from solosave._src.storage.base import Commit
from solosave._src.storage.registry import storage_for


def unpublish(directory: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> None:
    """Remove ``.metadata`` (before overwriting a checkpoint's data files); idempotent."""
    st = storage_for(directory, storage_options)
    st.remove(st.join(directory, METADATA_FILE))


def publish_metadata(directory: str | os.PathLike, data: bytes | Sequence[bytes], fsync: bool = True,
                     storage_options: Mapping[str, Any] | None = None) -> None:
    """Write ``directory/.metadata`` atomically (see the module docstring); ``data``: its bytes,
    or pieces of them in order (:meth:`MetadataTemplate.render_parts`)."""
    st = storage_for(directory, storage_options)
    st.commit(st.join(directory, METADATA_FILE), data, fsync=fsync)


def stage_metadata(directory: str | os.PathLike, data: bytes | Sequence[bytes], fsync: bool = True,
                   storage_options: Mapping[str, Any] | None = None) -> Commit:
    """:func:`publish_metadata` in two steps (:meth:`~solosave._src.storage.base.Storage.stage_commit`):
    locally the bytes go to a temporary file now and ``finish()`` renames it to ``.metadata``
    (``discard()`` removes it); on an object store the single write waits for ``finish()``."""
    st = storage_for(directory, storage_options)
    return st.stage_commit(st.join(directory, METADATA_FILE), data, fsync=fsync)
