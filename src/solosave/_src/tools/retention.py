"""Retention: old checkpoints are deleted on one background thread, never in the training loop.

Deleting a large checkpoint can take seconds to minutes on a parallel filesystem; done inline on
the coordinator it would stall every rank at their next collective. Who calls what (the
coordinator only; no collective, no torch)::

    pruner = Pruner(select)      # CheckpointManager.__init__: no thread yet
    pruner.request()             # after each publication: never blocks; starts the thread once
    pruner.wait(timeout)         # CheckpointManager.wait_for_pruning: bounded
    pruner.close(timeout)        # CheckpointManager.finish: bounded; the thread then exits

``select()`` runs on the pruner's thread and returns the directories to delete *now* (it reads
the save directory there, so the listing is never done in the loop either); requests that arrive
during a pass coalesce into one more pass. ``remover(path)`` deletes one directory; whatever it
raises is logged and that directory skipped, to be tried again at the next pass: a deletion never
raises into training. The thread is a daemon: a process that exits while it deletes leaves a
partial checkpoint behind (``.metadata`` goes first), never a published one with missing files.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from solosave._src.storage.registry import storage_for
from solosave._src.write.publish import unpublish

log = logging.getLogger("solosave")


def remove_checkpoint(path: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """Delete a checkpoint directory (or URL prefix), ``.metadata`` first: a crash midway leaves
    a partial checkpoint (ignored by loaders), never a published one with missing data files.
    Raises ``OSError`` when something cannot be deleted; a directory already gone is not an error."""
    storage = storage_for(path, storage_options)
    unpublish(storage, path)
    storage.remove_tree(path)


class Pruner:
    """Runs ``select()`` and deletes what it returns with ``remover``, on one daemon thread
    started by the first :meth:`request`."""

    def __init__(self, select: Callable[[], list[str]],
                 remover: Callable[[str], None] = remove_checkpoint) -> None:
        self._select = select
        self._remover = remover
        self._cond = threading.Condition()
        self._requested = False  # a pass is due
        self._busy = False  # a pass is running
        self._closing = False
        self._thread: threading.Thread | None = None

    def request(self) -> None:
        """Ask for a pass (coalesced with one already due); returns at once."""
        with self._cond:
            if self._closing:
                return
            self._requested = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="solosave-prune", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until no pass is due or running; ``False`` if ``timeout`` ran out first."""
        with self._cond:
            return self._cond.wait_for(lambda: not (self._requested or self._busy), timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Refuse new requests, wait (bounded) for the passes due, and let the thread exit.
        ``False`` if ``timeout`` ran out first: the pass then finishes in the background."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        return self.wait(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._requested or self._closing)
                if not self._requested:
                    return
                self._requested = False
                self._busy = True
            try:
                self._pass()
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _pass(self) -> None:
        try:
            paths = self._select()
        except Exception as e:  # noqa: BLE001 - listing failed (say, the directory is unreadable): try next time
            log.warning("solosave: could not list old checkpoints to prune: %s", e)
            return
        for path in paths:
            try:
                self._remover(path)
            except Exception as e:  # noqa: BLE001 - a failed deletion must never reach training: logged, skipped
                log.warning("solosave: could not delete old checkpoint %s (skipped; tried again at the "
                            "next prune): %s", path, e)
