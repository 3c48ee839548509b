"""Where the background runs: a persistent worker process per rank, or a thread.

Both transports have the same surface, used only by the trainer-side checkpointer:
``submit(job)`` (hands the job over; the worker is idle then, as the checkpointer has already
collected the previous outcome), ``poll(timeout) -> JobOutcome | None`` (bounded; raises
:class:`WorkerDiedError` if the worker is gone), ``close(timeout)``.

The worker process (a fresh interpreter: ``python -m solosave._worker_entry``) joins a
rendezvous ``TCPStore`` that the coordinator's trainer serves, forms its own gloo process group
under a ``PrefixStore`` (the channel), builds an :class:`~solosave._engine.Engine` and then runs
jobs until told to stop. It is reused by every save of the checkpointer; a dead worker is
detected by polling its liveness between short waits on the pipe, so no wait is unbounded.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

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


def _worker_main(conn: Connection) -> None:
    """Body of the worker process: read its set-up, form the channel, then run jobs until told
    to stop (``None``) or until the trainer is gone (end of file on the pipe)."""
    import torch.distributed as dist

    engine = None
    _exit_with_trainer(os.getppid())
    try:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        spec, workers, writer = conn.recv()
        multiprocessing.current_process().name = f"solosave-worker-{spec.rank}"  # for logs
        store = dist.TCPStore(spec.host, spec.port, is_master=False,
                              timeout=datetime.timedelta(seconds=spec.timeout_s))
        dist.init_process_group("gloo", store=dist.PrefixStore(spec.prefix, store),
                                rank=spec.rank, world_size=spec.world_size,
                                timeout=datetime.timedelta(seconds=spec.timeout_s))
        engine = Engine(Channel(None, CollectiveCounter()), workers, writer)
        conn.send(("ready", os.getpid()))
        while True:
            try:
                job = conn.recv()
            except EOFError:  # the trainer exited without close(): nothing left to do
                break
            if job is None:
                break
            conn.send(("outcome", engine.run(job)))
    except BaseException as e:  # noqa: BLE001 - reported to the trainer, then exit
        try:
            conn.send(("fatal", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
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


def _exit_with_trainer(trainer_pid: int, interval: float = 0.2) -> None:
    """End this worker process at once when its trainer is gone, even in the middle of a job
    (an end of file on the pipe is only seen between jobs): a dead rank's worker must not go on
    writing, or keep its peers waiting in a collective until their timeout. The files it left
    are never published (``.metadata`` is written last, by a live coordinator)."""
    def watch() -> None:
        while os.getppid() == trainer_pid:
            time.sleep(interval)
        os._exit(3)

    threading.Thread(target=watch, name="solosave-trainer-watch", daemon=True).start()


class ProcessTransport:
    """A persistent worker process for one rank.

    The worker is a fresh interpreter running ``python -m solosave._worker_entry <fd>``, connected to
    the trainer by a duplex pipe (one end passed as file descriptor ``fd``). Unlike a
    ``multiprocessing`` *spawn* child it does not re-import the trainer's main script, so a
    training script without an ``if __name__ == "__main__":`` guard works; it sees the trainer's
    ``sys.path`` (appended to ``PYTHONPATH``) and environment. Messages are pickled objects: the
    set-up ``(spec, workers, writer)``, then jobs (``None`` stops it); the worker answers
    ``("ready", pid)``, ``("outcome", JobOutcome)`` or ``("fatal", text)``.
    """

    def __init__(self, spec: ChannelSpec, workers: int, writer: FileWriter | None) -> None:
        ours, theirs = multiprocessing.Pipe(duplex=True)
        env = dict(os.environ)
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        paths += [p for p in sys.path if p and p not in paths]  # the trainer's imports resolve alike
        env["PYTHONPATH"] = os.pathsep.join(paths)
        try:
            self.process = subprocess.Popen(  # noqa: S603 - our own interpreter and module
                [sys.executable, "-m", "solosave._worker_entry", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), env=env, close_fds=True)
        finally:
            theirs.close()
        self._conn = ours
        self.pid = self.process.pid
        self.ready = False
        self._fatal: str | None = None
        #: Outcomes read by ``close()`` after the trainer stopped waiting.
        self.leftover: list[JobOutcome] = []
        self._conn.send((spec, workers, writer))

    def submit(self, job: SaveJob) -> None:
        self._check_alive()
        try:
            self._conn.send(job)
        except OSError as e:  # broken pipe: the worker is gone
            self._check_alive()
            raise WorkerDiedError(f"the solosave worker process (pid {self.pid}) is unreachable: {e}") from e

    def _check_alive(self) -> None:
        if self._fatal is not None:
            raise WorkerDiedError(f"the solosave worker process (pid {self.pid}) failed: {self._fatal}")
        code = self.process.poll()
        if code is not None:
            raise WorkerDiedError(
                f"the solosave worker process (pid {self.pid}) exited with code {code}; this "
                "checkpointer cannot save any more, create a new one")

    def poll(self, timeout: float) -> JobOutcome | None:
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            try:
                ready = self._conn.poll(min(_POLL, max(deadline - time.monotonic(), 0.0)))
                msg = self._conn.recv() if ready else None
            except (EOFError, OSError):
                try:
                    self.process.wait(1.0)  # let it finish exiting, to report its exit code
                except subprocess.TimeoutExpired:
                    pass
                self._check_alive()
                raise WorkerDiedError(f"the solosave worker process (pid {self.pid}) closed its pipe") from None
            if msg is None:
                self._check_alive()
                if time.monotonic() >= deadline:
                    return None
                continue
            kind, payload = msg
            if kind == "ready":
                self.ready = True
                continue
            if kind == "fatal":
                self._fatal = str(payload)
                self._check_alive()
            return payload

    def close(self, timeout: float) -> None:
        if self.process.poll() is None:
            try:
                self._conn.send(None)
            except OSError:
                pass
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:  # pragma: no cover - last resort
                self.process.kill()
                self.process.wait(5)
        try:  # an outcome that arrived while the worker was stopping (see AsyncCheckpointer.close)
            while self._conn.poll(0):
                kind, payload = self._conn.recv()
                if kind == "outcome":
                    self.leftover.append(payload)
        except (EOFError, OSError):
            pass
        self._conn.close()


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
        #: Outcomes that arrived after close() gave up (process transport only; none here).
        self.leftover: list[JobOutcome] = []

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

