"""Worker processes forked from a zygote that imported torch once: fast worker starts.

A persistent worker is normally a fresh interpreter (``worker/host.py``, ``ProcessTransport``)
that imports torch and DCP before it can save: about 3 s of CPU per worker on a small machine,
paid again by every checkpointer a process creates (a test suite, a job that recreates its
checkpointer after a failure). A **zygote** is one such interpreter that imported them once,
never initialises anything else and forks a worker per request, in milliseconds.

Who does what:

* the owner starts it: ``python -m solosave._src.worker.entry --zygote SOCKET OWNER_PID``
  (:func:`start_zygote`), and sets ``SOLOSAVE_WORKER_ZYGOTE=SOCKET`` for the trainers that should
  use it; it exits when ``OWNER_PID`` is gone. Its workers live in its namespaces (network,
  mounts) and start from its environment, so it must run where the trainers run;
* a trainer's ``ProcessTransport`` connects (:func:`fork_worker`), sends its end of the worker
  pipe (``SCM_RIGHTS``), its pid, ``sys.path`` and environment; the zygote forks, the child
  takes over the path and environment, starts a session of its own and runs ``worker_main``;
  the zygote answers with the child's pid and keeps the connection: when the child exits it
  sends its exit code there (it reaps its children), which :class:`ForkedWorker` reads, so the
  trainer sees a zygote's worker as it sees a child of its own (``poll``, ``wait``, ``kill``).

Only the user that runs the zygote may connect (``SO_PEERCRED``); the socket is created with mode
0600. The zygote stays single-threaded, so forking it is safe.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback
from typing import Any

#: The environment variable naming a zygote's socket (set by whoever started it).
ZYGOTE_ENV = "SOLOSAVE_WORKER_ZYGOTE"
_HEADER = struct.Struct("<I")


class ZygoteLost(Exception):
    """The zygote took the worker's pipe and did not answer: a fresh worker on the same pipe
    could meet a late fork there, so the checkpointer cannot start."""


class ForkedWorker:
    """A worker forked by a zygote, with the part of ``subprocess.Popen`` that the transport uses."""

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self._sock = sock
        self.pid = pid
        self.returncode: int | None = None
        try:  # signals go to this process, never to a later one that reuses its pid
            self._pidfd: int | None = os.pidfd_open(pid)
        except (OSError, AttributeError):
            self._pidfd = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._sock], [], [], 0)[0]:
            self._read_exit()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._sock], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
            self._read_exit()
        return self.returncode  # type: ignore[return-value]

    def kill(self) -> None:
        if self.returncode is not None:
            return
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _read_exit(self) -> None:
        data = self._sock.recv(16)
        # no answer: the zygote is gone; its workers are reaped by init, their codes unknown
        self.returncode = int(data) if data.strip(b"-").isdigit() else -1
        self._sock.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


def fork_worker(address: str, fd: int, trainer_pid: int, timeout: float = 30.0) -> ForkedWorker:
    """Ask the zygote at ``address`` for a worker on pipe end ``fd`` (see the module docstring).
    Raises ``OSError`` if it cannot be reached or refuses."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(address)
        _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != os.getuid():  # the pipe and the environment go to this user's zygote only
            raise OSError(f"the process listening at {address} belongs to another user (uid {uid})")
        env = dict(os.environ)
        env.pop(ZYGOTE_ENV, None)  # the worker starts no worker of its own
        request = pickle.dumps({"trainer_pid": trainer_pid, "sys_path": list(sys.path), "env": env})
        socket.send_fds(sock, [_HEADER.pack(len(request)) + request], [fd])
        try:
            answer = _recv_line(sock)
        except OSError as e:  # the pipe was handed over: a worker may still appear on it
            raise ZygoteLost(f"the worker zygote at {address} did not answer: {e}") from e
        if not answer.isdigit():
            raise OSError(f"the worker zygote at {address} refused: {answer.decode(errors='replace')}")
        sock.settimeout(None)
        return ForkedWorker(sock, int(answer))
    except BaseException:
        sock.close()
        raise


def _recv_line(sock: socket.socket) -> bytes:
    out = b""
    while not out.endswith(b"\n"):
        part = sock.recv(64)
        if not part:
            break
        out += part
    return out.strip()


def start_zygote(address: str, timeout: float = 60.0) -> subprocess.Popen:
    """Start a zygote serving ``address`` for this process's lifetime; returns once it listens."""
    proc = subprocess.Popen([sys.executable, "-m", "solosave._src.worker.entry", "--zygote", address,  # noqa: S603
                             str(os.getpid())], stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout
    while not os.path.exists(address):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise OSError(f"the worker zygote did not start listening at {address}")
        time.sleep(0.05)
    return proc


def serve(address: str, owner_pid: int, worker_main: Any) -> None:
    """The zygote's loop (see the module docstring); returns when the owner is gone.
    ``worker_main(conn, trainer_pid, forked=True)`` is what each child runs; its module (and so
    torch and DCP) is imported by the caller, once, before the loop."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = f"{address}.{os.getpid()}"
    listener.bind(tmp)
    os.chmod(tmp, 0o600)
    os.replace(tmp, address)  # the address appears once it accepts
    listener.listen(64)
    clients: dict[int, socket.socket] = {}  # child pid -> its trainer's connection
    while pid_alive(owner_pid):
        if select.select([listener], [], [], 0.05)[0]:  # short: an exit is reported within it
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            try:
                pid = _serve_one(conn, listener, worker_main)
            except Exception:  # noqa: BLE001 - one bad client never stops the zygote (its workers would die)
                pid = None
            if pid is None:
                conn.close()
            else:
                clients[pid] = conn
        _reap(clients)
    listener.close()
    for conn in clients.values():
        conn.close()


def _serve_one(conn: socket.socket, listener: socket.socket, worker_main: Any) -> int | None:
    """Fork one worker for the request on ``conn``; its pid (``None``: refused, answered)."""
    conn.settimeout(10.0)
    fds: list[int] = []
    try:
        _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != os.getuid():
            conn.sendall(b"refused: another user\n")
            return None
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 1)
        if len(fds) != 1:
            raise ValueError(f"expected the worker's pipe, got {len(fds)} descriptors")
        size = _HEADER.unpack_from(msg)[0]
        while len(msg) < _HEADER.size + size:
            more = conn.recv(_HEADER.size + size - len(msg))
            if not more:
                raise EOFError("the request ended early")
            msg += more
        request = pickle.loads(msg[_HEADER.size:])  # noqa: S301 - from a process of this user
    except Exception as e:  # noqa: BLE001 - answered, the zygote goes on
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            conn.sendall(f"refused: {type(e).__name__}: {e}\n".encode())
        return None
    pid = os.fork()
    if pid == 0:  # the worker
        code = 0
        try:
            listener.close()
            conn.close()
            os.setsid()
            os.environ.clear()
            os.environ.update(request["env"])
            sys.path[:] = request["sys_path"]
            from multiprocessing.connection import Connection

            worker_main(Connection(fds[0]), request["trainer_pid"], forked=True)
        except BaseException:  # noqa: BLE001 - the trainer sees the exit code; the reason goes to stderr
            traceback.print_exc()
            code = 1
        finally:
            sys.stderr.flush()
        os._exit(code)
    os.close(fds[0])
    try:
        conn.sendall(f"{pid}\n".encode())
    except OSError:  # the trainer is gone: so is the pipe, and the worker ends by itself
        pass
    return pid


def _reap(clients: dict[int, socket.socket]) -> None:
    """Tell each trainer whose worker exited its exit code."""
    while clients:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = clients.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(str(os.waitstatus_to_exitcode(status)).encode())
            except OSError:
                pass
            conn.close()


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a process of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True



__all__ = ["ZYGOTE_ENV", "ForkedWorker", "ZygoteLost", "fork_worker", "pid_alive", "serve", "start_zygote"]
