"""Run a function on N local ranks (spawned processes, gloo on 127.0.0.1), bounded in time.

``run_ranks(fn, world_size, *args, timeout=...)`` returns ``[fn(rank, world_size, *args)]`` in
rank order, or raises ``AssertionError`` with every failing rank's traceback; on timeout every
process is killed (no orphan survives a test).
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable, rank: int, world_size: int, port: int, args: tuple, out: Any, env: dict) -> None:
    os.environ.update(env)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1"})
    import torch.distributed as dist

    code = 0
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size)
        res = fn(rank, world_size, *args)
        out.put((rank, "ok", res))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put((rank, "err", traceback.format_exc()))
        code = 1
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001,S110
            pass
    import gc

    gc.collect()
    out.close()
    out.join_thread()  # flush the result before os._exit kills the queue's feeder thread
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # end deliberately: no late gloo teardown at interpreter exit


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0,
              env: dict | None = None) -> list[Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, args, out, env or {}))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"ranks timed out after {timeout} s; finished: "
                                     f"{sorted(results)}, failed: {errors}")
            try:
                rank, kind, val = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None
                        and r not in results and r not in errors]
                if dead:
                    time.sleep(0.5)  # let a last message arrive
                    while True:
                        try:
                            rank, kind, val = out.get_nowait()
                        except queue.Empty:
                            break
                        (results if kind == "ok" else errors)[rank] = val
                    for r in dead:
                        if r not in results and r not in errors:
                            errors[r] = f"process exited with code {procs[r].exitcode}"
                continue
            (results if kind == "ok" else errors)[rank] = val
    finally:
        for p in procs:
            p.join(timeout=10)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    if errors:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items())))
    return [results[r] for r in range(world_size)]
