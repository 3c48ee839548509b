"""Run a function on W local ranks for the save benchmark: spawned processes, gloo on 127.0.0.1.

``run_ranks(fn, world_size, *args, timeout=..., env=...)`` returns ``[fn(rank, world_size,
*args)]`` in rank order, or raises ``AssertionError`` with every failing rank's traceback. The
whole launch is bounded: past ``timeout`` seconds (or when a rank process dies without a
result), every rank process still alive is killed, so no launch leaves a process behind. Once a rank has failed, the others get
``AFTER_FAILURE_S`` more seconds (they may be waiting for it in a collective). ``fn``
must be a module-level function (it is pickled into the spawned interpreters).

``counting_distcp_reads()`` (in a rank): counts the bytes of ``.distcp`` files read with
``os.preadv``/``os.pread`` meanwhile, independently of solosave's own figures (the load
benchmark and the cooperative-load tests compare the two).
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from solosave._src.testing.ports import free_port

#: Seconds a rank process gets to exit after it reported, before it is killed.
JOIN_S = 10.0
#: Once a rank failed, seconds the others get to report (they may wait for it in a collective).
AFTER_FAILURE_S = 30.0


@contextlib.contextmanager
def environ(updates: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` with ``updates`` applied, restored afterwards (spawned ranks inherit it)."""
    old = {k: os.environ.get(k) for k in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v




def _rank_main(fn: Callable, rank: int, world_size: int, port: int, args: tuple, out: Any, env: dict) -> None:
    """One rank process: join the gloo group, run ``fn``, report ``(rank, ok, value)``, exit."""
    os.environ.update(env)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1"})
    import torch.distributed as dist

    code = 0
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        out.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put((rank, False, traceback.format_exc()))
        code = 1
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001,S110 - exiting anyway
            pass
    out.close()
    out.join_thread()  # the result reaches the pipe before os._exit stops the feeder thread
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no late gloo teardown at interpreter exit


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 600.0,
              env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks (see module doc)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, args, out, dict(env or {})),
                         name=f"bench-rank-{r}", daemon=False)
             for r in range(world_size)]
    ok: dict[int, Any] = {}
    failed: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.start()
        while len(ok) + len(failed) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                why = (f"no result {AFTER_FAILURE_S:g} s after another rank failed (killed)" if failed
                       else f"no result within {timeout} s (killed)")
                failed.update({r: why for r in range(world_size) if r not in ok and r not in failed})
                break
            try:
                rank, good, value = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                gone = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in ok and r not in failed]
                if gone:
                    time.sleep(0.5)  # a last result may still be in the pipe
                    _drain(out, ok, failed)
                    for r in gone:
                        if r not in ok and r not in failed:
                            failed[r] = f"rank process exited with code {procs[r].exitcode} and no result"
                continue
            (ok if good else failed)[rank] = value
            if failed:
                deadline = min(deadline, time.monotonic() + AFTER_FAILURE_S)
    finally:
        _reap(procs)
    if failed:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(failed.items())))
    return [ok[r] for r in range(world_size)]


def _drain(out: Any, ok: dict[int, Any], failed: dict[int, str]) -> None:
    while True:
        try:
            rank, good, value = out.get_nowait()
        except queue.Empty:
            return
        (ok if good else failed)[rank] = value


def _reap(procs: list) -> None:
    """Join every rank process (bounded); kill the ones still alive, by their own handle."""
    stop = time.monotonic() + JOIN_S
    for p in procs:
        if p.pid is not None:
            p.join(timeout=max(stop - time.monotonic(), 0.1))
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.kill()
            p.join(5)


def fsdp_shards(local: list[Any], world_size: int) -> dict[str, Any]:
    """Rank-side: ``local`` as the shards of FSDP-style DTensors (``t{i}``, ``Shard(0)`` over a
    1-D mesh of every rank), as FSDP2 holds its parameters; each rank passes its own shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    return {f"t{i}": DTensor.from_local(t, mesh, [Shard(0)], run_check=False) for i, t in enumerate(local)}


def local_part(t: Any) -> Any:
    """The bytes this rank holds of ``t``: a DTensor's local shard, or ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


__all__ = ["fsdp_shards", "free_port", "local_part", "run_ranks"]


@contextlib.contextmanager
def counting_distcp_reads() -> Any:
    """Count the bytes ``os.preadv`` / ``os.pread`` return for ``.distcp`` files (yields a
    one-element list holding the count)."""
    count = [0]
    real_preadv, real_pread = os.preadv, os.pread

    def is_data(fd: int) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}").endswith(".distcp")
        except OSError:
            return False

    def preadv(fd: int, buffers: Any, offset: int, *a: Any) -> int:
        got = real_preadv(fd, buffers, offset, *a)
        if is_data(fd):
            count[0] += got
        return got

    def pread(fd: int, n: int, offset: int) -> bytes:
        got = real_pread(fd, n, offset)
        if is_data(fd):
            count[0] += len(got)
        return got

    from unittest import mock

    with mock.patch.object(os, "preadv", preadv), mock.patch.object(os, "pread", pread):
        yield count
