"""Publishing a checkpoint: the one place that writes or removes ``.metadata``.

The design's central invariant - **the load index, then ``.metadata``, last; never an old
``.metadata`` beside new data** - is written here once, and every path that publishes goes
through it: the engine's reuse and collective saves (:mod:`solosave._src.engine`), the durable
copy, the peer copy and the peer repair (:mod:`solosave._src.tiers`).

* :func:`unpublish` removes ``.metadata`` before a directory's data files are written again
  (every rank that writes there, before its first byte);
* :func:`commit_checkpoint` writes the load index (if the backend keeps one and the caller has
  one) and then ``.metadata``, both by atomic commits (:class:`~solosave._src.storage.base.Commit`:
  locally a temporary file, fsync, rename, fsync of the directory; on an object store one
  single-object put), so a crash at any point leaves no ``.metadata`` or the whole new one;
* :func:`begin_publication` is the same in two steps, for the reuse path, whose coordinator
  writes the index and ``.metadata``'s bytes on a thread while the data is written and
  publishes them (:meth:`PendingPublication.finish`) only once every rank agreed.

The load index only speeds loads up: a failure to build or write it is returned as a warning
and the checkpoint is published without it (loads then read ``.metadata``; an index left by an
earlier save names another ``save_id`` and is not used). A failure to write ``.metadata``
raises: nothing is published.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from solosave._src.core.errors import describe
from solosave._src.formats.dcp import INDEX_FILE, METADATA_FILE
from solosave._src.storage.base import Commit, Storage

#: ``.metadata``'s bytes, whole or in pieces in order (``MetadataTemplate.render_parts``).
MetadataBytes = bytes | Sequence[bytes]
#: The load index: its bytes, a callable that builds them (``None``: no index), or ``None``.
IndexSource = bytes | Callable[[], "bytes | None"] | None


def unpublish(storage: Storage, directory: str) -> None:
    """Remove ``directory/.metadata`` (before its data files are written again); idempotent.
    Every rank that writes into ``directory`` calls it before its first byte, so a crash while
    writing never leaves an old ``.metadata`` that names the new, half-written files."""
    try:
        storage.remove(storage.join(directory, METADATA_FILE))
    except FileNotFoundError:
        pass


@dataclass
class PendingPublication:
    """A publication made ready by :func:`begin_publication`: the load index is written, and
    ``.metadata``'s bytes wait in ``commit``. Exactly one of :meth:`finish` (publish) and
    :meth:`discard` (never publish) takes effect; calling :meth:`discard` after :meth:`finish`
    does nothing, so ``try: finish() finally: discard()`` never leaves a temporary file."""

    commit: Commit
    #: Why the load index was not written (``None``: it was, or there was none to write).
    index_warning: str | None = None

    def finish(self) -> None:
        """Publish ``.metadata`` (atomically, last)."""
        self.commit.finish()

    def discard(self) -> None:
        """Never publish it; remove its temporary file."""
        self.commit.discard()


def begin_publication(storage: Storage, directory: str, metadata: MetadataBytes, index: IndexSource = None,
                      fsync: bool = True) -> PendingPublication:
    """Write the load index of ``directory`` (when the backend keeps load indexes and ``index``
    gives one) and write ``.metadata``'s bytes aside without publishing them. Raises if
    ``.metadata`` cannot be written aside (nothing is published); an index failure is a warning
    in the result."""
    warning = _write_index(storage, directory, index, fsync)
    commit = storage.begin_commit(storage.join(directory, METADATA_FILE), metadata, fsync=fsync)
    return PendingPublication(commit, warning)


def commit_checkpoint(storage: Storage, directory: str, metadata: MetadataBytes, index: IndexSource = None,
                      fsync: bool = True) -> str | None:
    """Publish the checkpoint in ``directory``: its load index, then ``.metadata``, last (see the
    module docstring). Returns the load index's warning, ``None`` when it was written (or there
    was none); raises when ``.metadata`` could not be written (nothing was published)."""
    pending = begin_publication(storage, directory, metadata, index, fsync)
    try:
        pending.finish()
    finally:
        pending.discard()
    return pending.index_warning


def _write_index(storage: Storage, directory: str, index: IndexSource, fsync: bool) -> str | None:
    if index is None or not storage.load_index:
        return None
    try:
        data = index() if callable(index) else index
        if data is None:
            return None
        storage.commit(storage.join(directory, INDEX_FILE), data, fsync=fsync)
    except Exception as e:  # noqa: BLE001 - the checkpoint is complete without its index
        try:  # an index an earlier attempt left (a reuse save that fell back) may name this save_id
            storage.remove(storage.join(directory, INDEX_FILE))
        except Exception:  # noqa: BLE001, S110 - none there, or unreachable: loads check it against .metadata
            pass
        return (f"the load index of {directory} was not written ({describe(e)}); "
                f"loads of this checkpoint read the whole {METADATA_FILE}")
    return None


__all__ = ["IndexSource", "MetadataBytes", "PendingPublication", "begin_publication", "commit_checkpoint", "unpublish"]
