"""Where the background runs: a persistent worker process per rank, or a thread.

Both transports have the same surface, used only by the trainer-side checkpointer:
``submit(job)`` (never blocks), ``poll(timeout) -> JobOutcome | None`` (bounded; raises
:class:`WorkerDiedError` if the worker is gone), ``close(timeout)``.

The worker process (``torch.multiprocessing`` *spawn*) joins a rendezvous ``TCPStore`` that the
coordinator's trainer serves, forms its own gloo process group under a ``PrefixStore`` (the
channel), builds an :class:`~solosave._engine.Engine` and then runs jobs until told to stop. It is
reused by every save of the checkpointer; a dead worker is detected by polling its liveness
between short queue waits, so no wait is unbounded.
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch.multiprocessing as mp

from ._coordinate import Channel, CollectiveCounter
from ._engine import Engine, JobOutcome, SaveJob
from ._errors import SaveTimeoutError, WorkerDiedError
from ._write import FileWriter

_POLL = 0.05


@dataclass(frozen=True)
class ChannelSpec:
    """How a worker process forms the channel: the store address, its prefix, rank, size."""

    host: str
    port: int
    prefix: str
    rank: int
    world_size: int
    timeout_s: float


def _worker_main(spec: ChannelSpec, workers: int, writer: FileWriter | None,
                 jobs: Any, outcomes: Any) -> None:
    """Entry point of the worker process (module-level so that *spawn* can import it)."""
    import torch.distributed as dist

    engine = None
    try:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        store = dist.TCPStore(spec.host, spec.port, is_master=False,
                              timeout=datetime.timedelta(seconds=spec.timeout_s))
        dist.init_process_group("gloo", store=dist.PrefixStore(spec.prefix, store),
                                rank=spec.rank, world_size=spec.world_size,
                                timeout=datetime.timedelta(seconds=spec.timeout_s))
        engine = Engine(Channel(None, CollectiveCounter()), workers, writer)
        outcomes.put(("ready", os.getpid()))
        while True:
            job = jobs.get()
            if job is None:
                break
            outcomes.put(("outcome", engine.run(job)))
    except BaseException as e:  # noqa: BLE001 - reported to the trainer, then exit
        try:
            outcomes.put(("fatal", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        except Exception:  # noqa: BLE001,S110
            pass
    finally:
        if engine is not None:
            engine.close()
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001,S110 - exiting anyway
            pass


class ProcessTransport:
    """A persistent spawned worker process for one rank."""

    def __init__(self, spec: ChannelSpec, workers: int, writer: FileWriter | None) -> None:
        ctx = mp.get_context("spawn")
        self._jobs = ctx.Queue()
        self._outcomes = ctx.Queue()
        self.process = ctx.Process(target=_worker_main, name=f"solosave-worker-{spec.rank}",
                                   args=(spec, workers, writer, self._jobs, self._outcomes),
                                   daemon=True)
        self.process.start()
        self.pid = self.process.pid
        self.ready = False
        self._fatal: str | None = None

    def submit(self, job: SaveJob) -> None:
        self._check_alive()
        self._jobs.put(job)

    def _check_alive(self) -> None:
        if self._fatal is not None:
            raise WorkerDiedError(f"the solosave worker process (pid {self.pid}) failed: {self._fatal}")
        if not self.process.is_alive():
            raise WorkerDiedError(
                f"the solosave worker process (pid {self.pid}) exited with code "
                f"{self.process.exitcode}; this checkpointer cannot save any more, create a new one")

    def poll(self, timeout: float) -> JobOutcome | None:
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            try:
                kind, payload = self._outcomes.get(timeout=min(_POLL, max(deadline - time.monotonic(), 0.0)) or 0.001)
            except queue.Empty:
                self._check_alive()
                if time.monotonic() >= deadline:
                    return None
                continue
            if kind == "ready":
                self.ready = True
                continue
            if kind == "fatal":
                self._fatal = str(payload)
                self._check_alive()
            return payload

    def close(self, timeout: float) -> None:
        if self.process.is_alive():
            try:
                self._jobs.put(None)
            except Exception:  # noqa: BLE001,S110
                pass
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():  # pragma: no cover - last resort
            self.process.kill()
            self.process.join(5)
        for q in (self._jobs, self._outcomes):
            q.close()
            q.join_thread()


class ThreadTransport:
    """The background in a thread of the trainer process (``persistent_worker=False``)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._jobs: queue.Queue = queue.Queue()
        self._outcomes: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="solosave-background", daemon=True)
        self._thread.start()
        self.pid = os.getpid()
        self.ready = True

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._outcomes.put(self.engine.run(job))
            except BaseException as e:  # noqa: BLE001 - keep the thread alive, report it
                self._outcomes.put(JobOutcome(job.seq, False, job.mode.value,
                                              failures={self.engine.rank: repr(e)},
                                              error_kind="failed"))

    def submit(self, job: SaveJob) -> None:
        if not self._thread.is_alive():
            raise WorkerDiedError("the solosave background thread has stopped")
        self._jobs.put(job)

    def poll(self, timeout: float) -> JobOutcome | None:
        try:
            return self._outcomes.get(timeout=max(timeout, 0.0)) if timeout > 0 else self._outcomes.get_nowait()
        except queue.Empty:
            return None

    def close(self, timeout: float) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise SaveTimeoutError(f"the solosave background thread did not stop within {timeout} s")
        self.engine.close()
