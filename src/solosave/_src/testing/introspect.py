"""Looking inside a checkpointer: for tests and device checks only (the library never imports it)."""

from __future__ import annotations

from solosave._src.save.checkpointer import AsyncCheckpointer


def worker_pid(checkpointer: AsyncCheckpointer) -> int:
    """The pid of ``checkpointer``'s worker process, read from its transport (this process's
    pid with ``persistent_worker=False``, whose worker is a thread)."""
    return checkpointer._transport.pid
