"""Where the background runs: a persistent worker process per rank, or a thread.

Both transports have the same surface, used only by the trainer-side checkpointer:
``share_buffer(name, fd)`` (a new staging buffer's descriptor, before the first job naming it),
``submit(job)`` (hands the job over; the worker is idle then, as the checkpointer has already
collected the previous outcome), ``poll(timeout) -> JobOutcome | DurableOutcome | None``
(bounded; raises :class:`WorkerDiedError` if the worker is gone; a ``DurableOutcome`` comes from
the engine's copier thread, two tiers), ``close(timeout)`` (never raises).

The worker process (a fresh interpreter: ``python -m solosave._src.worker.entry``) receives a
:class:`~solosave._src.coordination.protocol.WorkerSetup`, joins the rendezvous ``TCPStore`` that the
coordinator's trainer serves, forms its own gloo process group under a ``PrefixStore`` (the
channel), builds an :class:`~solosave._src.engine.engine.Engine` and then runs jobs until told to stop. It
is reused by every save of the checkpointer. It never initialises CUDA (no CUDA object reaches
it). Its lifetime is tied to its trainer's:

* it runs in its own session, with ``SIGINT`` and ``SIGTERM`` ignored: Ctrl-C or a scheduler's
  ``SIGTERM`` is the trainer's to handle (a final save from the handler still works);
* it exits within a second of its trainer's death at any moment, start-up included: the kernel
  sends it ``SIGKILL`` when its parent dies (``PR_SET_PDEATHSIG``) and a watchdog thread
  compares its parent with the trainer's pid, passed on its command line.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import logging
import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing import reduction
from multiprocessing.connection import Connection

from solosave._src.coordination.channel import DistChannel
from solosave._src.coordination.protocol import (
    BufferHandoff,
    ErrorKind,
    JobOutcome,
    SaveJob,
    WorkerEvent,
    WorkerMessage,
    WorkerSetup,
    compact_job,
    expand_job,
)
from solosave._src.core.errors import WorkerDiedError
from solosave._src.engine.engine import Engine
from solosave._src.worker.zygote import ZYGOTE_ENV, ForkedWorker, ZygoteLost, fork_worker, pid_alive

log = logging.getLogger("solosave")
_POLL = 0.05
_PR_SET_PDEATHSIG = 1


def signal_on_parent_death(signum: int) -> None:
    """Have the kernel send ``signum`` to this process when its parent exits
    (``PR_SET_PDEATHSIG``; Linux only, elsewhere nothing). Call it, then check the parent is
    still the one expected: it may have died before."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the callers' own checks alone
        pass


def tie_to_trainer(trainer_pid: int, interval: float = 0.2, forked: bool = False) -> None:
    """End this process when the trainer ``trainer_pid`` is gone (see the module docstring).
    ``forked``: a zygote's child (``worker/zygote.py``), whose parent is the zygote: it ends with
    the zygote (whose connection told the trainer it is gone) and watches the trainer's pid."""
    signal_on_parent_death(signal.SIGKILL)  # elsewhere than Linux: the watchdog alone

    def trainer_alive() -> bool:
        return pid_alive(trainer_pid) if forked else os.getppid() == trainer_pid

    if not trainer_alive():  # the trainer died before the lines above took effect
        os._exit(3)

    def watch() -> None:
        while trainer_alive():
            time.sleep(interval)
        os._exit(3)

    threading.Thread(target=watch, name="solosave-trainer-watch", daemon=True).start()


def worker_main(conn: Connection, trainer_pid: int, forked: bool = False) -> None:
    """Body of the worker process: read its set-up, form the channel, then run jobs until told
    to stop (``None``) or until the trainer is gone (end of file on the pipe). ``forked``: by a
    zygote (see :func:`tie_to_trainer`)."""
    tie_to_trainer(trainer_pid, forked=forked)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    import torch.distributed as dist

    engine = None
    try:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        setup: WorkerSetup = conn.recv()
        spec = setup.channel
        multiprocessing.current_process().name = f"solosave-worker-{spec.rank}"  # for logs
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        store = dist.TCPStore(spec.host, spec.port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=dist.PrefixStore(spec.prefix, store),
                                rank=spec.rank, world_size=spec.world_size, timeout=timeout)
        channel = DistChannel(None, store=dist.PrefixStore(spec.prefix + "receipts/", store),
                              timeout=spec.timeout_s)
        durable = None
        if setup.settings.durable_root:  # the durable copies' own group: never interleaved with a save's
            group = dist.new_group(backend="gloo", timeout=timeout)
            durable = DistChannel(group, store=dist.PrefixStore(spec.prefix + "durable-receipts/", store),
                                  timeout=spec.timeout_s)
        engine = Engine(channel, setup.settings, setup.writer, durable)
        send_lock = threading.Lock()

        def send(msg: WorkerMessage) -> None:  # the main loop and the copier's thread
            with send_lock:
                conn.send(msg)

        if engine.copier is not None:
            engine.copier.post = lambda outcome: send(WorkerMessage(WorkerEvent.DURABLE, outcome))
        # This process's heap after its imports (torch's modules: about a million objects) lives
        # as long as the process: freeze it, so that the collections a save's allocations set
        # off do not scan it (a scan of it per save showed in the profiles: CHANGELOG).
        gc.collect()
        gc.freeze()
        send(WorkerMessage(WorkerEvent.READY, os.getpid()))
        job = None
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # the trainer exited without close(): nothing left to do
                break
            if msg is None:
                break
            if isinstance(msg, BufferHandoff):  # its descriptor follows on the pipe
                engine.io.reader.adopt(msg.name, reduction.recv_handle(conn))
                continue
            job = expand_job(job, msg)
            send(WorkerMessage(WorkerEvent.OUTCOME, engine.run(job)))
    except BaseException as e:  # noqa: BLE001 - reported to the trainer, then exit
        try:
            conn.send(WorkerMessage(WorkerEvent.FATAL, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        except Exception:  # noqa: BLE001,S110 - the trainer is gone
            pass
    finally:
        if engine is not None:
            engine.close(min(setup.channel.timeout_s, 5.0))
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001,S110 - exiting anyway
            pass


def _forked(fd: int) -> ForkedWorker | None:
    """A worker forked by the zygote that ``$SOLOSAVE_WORKER_ZYGOTE`` names (``worker/zygote.py``),
    or ``None``: none is named, or it cannot be reached (logged: a fresh interpreter then)."""
    address = os.environ.get(ZYGOTE_ENV)
    if not address:
        return None
    try:
        return fork_worker(address, fd, os.getpid())
    except ZygoteLost as e:  # the pipe was handed over: no second worker on it
        raise WorkerDiedError(f"{ZYGOTE_ENV}={address}: {e}") from e
    except OSError as e:
        log.warning("solosave: %s=%s: %s; starting the worker as a fresh interpreter", ZYGOTE_ENV, address, e)
        return None


class ProcessTransport:
    """A persistent worker process for one rank.

    The worker is a fresh interpreter running ``python -m solosave._src.worker.entry <fd> <pid>``
    (or, with ``$SOLOSAVE_WORKER_ZYGOTE`` set, a fork of that zygote: ``worker/zygote.py``),
    connected to the trainer by a duplex pipe (one end passed as file descriptor ``fd``). Unlike
    a ``multiprocessing`` *spawn* child it does not re-import the trainer's main script, so a
    training script without an ``if __name__ == "__main__":`` guard works; it sees the trainer's
    ``sys.path`` (appended to ``PYTHONPATH``) and environment.
    """

    def __init__(self, setup: WorkerSetup) -> None:
        ours, theirs = multiprocessing.Pipe(duplex=True)
        env = dict(os.environ)
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        paths += [p for p in sys.path if p and p not in paths]  # the trainer's imports resolve alike
        env["PYTHONPATH"] = os.pathsep.join(paths)
        try:
            self.process = _forked(theirs.fileno()) or subprocess.Popen(  # noqa: S603 - our own interpreter
                [sys.executable, "-m", "solosave._src.worker.entry", str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),), env=env, close_fds=True, start_new_session=True)
        finally:
            theirs.close()
        self._conn = ours
        self._send_lock = threading.Lock()
        self.pid = self.process.pid
        self.ready = False
        self._fatal: str | None = None
        #: Outcomes read by ``close()`` after the trainer stopped waiting.
        self.leftover: list[JobOutcome] = []
        self._last: SaveJob | None = None
        self._conn.send(setup)

    def submit(self, job: SaveJob) -> None:
        """Send ``job`` (as a :class:`JobDelta` when it has the last job's structure)."""
        self._check_alive()
        try:
            with self._send_lock:
                self._conn.send(compact_job(self._last, job))
                self._last = job
        except OSError as e:  # broken pipe: the worker is gone
            self._settle()
            raise WorkerDiedError(f"the solosave worker process (pid {self.pid}) is unreachable: {e}") from e

    def share_buffer(self, name: str, fd: int) -> None:
        """Give the worker staging buffer ``name`` (descriptor ``fd``, duplicated into it),
        before the first job that names it."""
        self._check_alive()
        try:
            with self._send_lock:
                self._conn.send(BufferHandoff(name))
                reduction.send_handle(self._conn, fd, self.pid)
        except OSError as e:  # broken pipe: the worker is gone
            self._settle()
            raise WorkerDiedError(f"the solosave worker process (pid {self.pid}) is unreachable: {e}") from e

    def _settle(self) -> None:
        """The pipe broke: give the worker's exit a moment to be known (a zygote's worker is
        reaped by the zygote, which then tells us), then raise with its exit code if it exited."""
        try:
            self.process.wait(1.0)
        except subprocess.TimeoutExpired:
            pass
        self._check_alive()

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
                self._settle()  # let it finish exiting, to report its exit code
                raise WorkerDiedError(f"the solosave worker process (pid {self.pid}) closed its pipe") from None
            if msg is None:
                self._check_alive()
                if time.monotonic() >= deadline:
                    return None
                continue
            if msg.event is WorkerEvent.READY:
                self.ready = True
                continue
            if msg.event is WorkerEvent.FATAL:
                self._fatal = str(msg.payload)
                self._check_alive()
            return msg.payload  # a JobOutcome, or a DurableOutcome (two tiers)

    def close(self, timeout: float) -> None:
        """Stop the worker (asked, then terminated, then killed); never raises."""
        try:
            self._stop(timeout)
        except Exception as e:  # noqa: BLE001 - close never raises
            log.warning("solosave: stopping the worker process %d: %s", self.pid, e)
        try:  # an outcome that arrived while the worker was stopping (see AsyncCheckpointer.close)
            while self._conn.poll(0):
                msg = self._conn.recv()
                if msg.event in (WorkerEvent.OUTCOME, WorkerEvent.DURABLE):
                    self.leftover.append(msg.payload)
        except (EOFError, OSError):
            pass
        self._conn.close()

    def _stop(self, timeout: float) -> None:
        if self.process.poll() is None:
            try:
                with self._send_lock:
                    self._conn.send(None)
            except OSError:
                pass
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        if self.process.poll() is None:  # SIGTERM is ignored by the worker (signals are the trainer's)
            self.process.kill()
            self.process.wait(5)


class ThreadTransport:
    """The background in a thread of the trainer process (``persistent_worker=False``)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._jobs: queue.Queue = queue.Queue()
        self._outcomes: queue.Queue = queue.Queue()  # JobOutcome, or DurableOutcome (the copier's thread)
        if engine.copier is not None:
            engine.copier.post = self._outcomes.put
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
                self._outcomes.put(JobOutcome(job.seq, False, job.kind(), ErrorKind.INTERNAL,
                                              failures={self.engine.rank: traceback.format_exc() or repr(e)}))

    def share_buffer(self, name: str, fd: int) -> None:
        """Give the engine's reader staging buffer ``name`` (a duplicate of ``fd``); the engine
        is idle (its last outcome was collected before this save was staged)."""
        if not self._thread.is_alive():
            raise WorkerDiedError("the solosave background thread has stopped")
        self.engine.io.reader.adopt(name, os.dup(fd))

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
        """Stop the thread (bounded); never raises. A thread stuck in a collective is left to
        end with the process (it is a daemon thread): logged."""
        self._jobs.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("solosave: the background thread did not stop within %.0f s; it ends with "
                        "the process", timeout)
            return
        self.engine.close(min(timeout, 5.0))
