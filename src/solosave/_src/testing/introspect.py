"""Looking inside a checkpointer: for tests and device checks only (the library never imports it)."""

from __future__ import annotations

import os

from solosave._src.coordination.protocol import SaveJob
from solosave._src.save.checkpointer import AsyncCheckpointer
from solosave._src.save.session import SaveSession
from solosave._src.staging.buffer import BufferReader


def worker_pid(checkpointer: AsyncCheckpointer) -> int:
    """The pid of ``checkpointer``'s worker process, read from its transport (this process's
    pid with ``persistent_worker=False``, whose worker is a thread)."""
    return checkpointer._transport.pid


def job_for(session: SaveSession, reader: BufferReader, state_dict: dict, path: str) -> SaveJob:
    """``session``'s job for ``state_dict``, its staging buffer (if new) handed to ``reader``:
    what the checkpointer and its transport do, for tests that drive engines directly."""
    built = session.build(state_dict, path)
    handoff = built.staging.handoff()
    if handoff is not None:
        reader.adopt(handoff[0], os.dup(handoff[1]))
    return built.job
