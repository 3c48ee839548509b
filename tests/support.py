"""Shared test support: run a function on N local ranks (spawned processes, gloo on 127.0.0.1,
bounded in time) and the state-dict helpers every rank function uses.

* ``run_ranks(fn, world_size, *args, timeout=...)`` returns ``[fn(rank, world_size, *args)]`` in
  rank order, or raises ``AssertionError`` with every failing rank's traceback;
* ``run_ranks_tolerant(...)`` lets ranks die or fail: ``{rank: ("ok", value) | ("err",
  traceback) | ("died", exitcode) | ("hung", None)}``.

Both kill every process still alive at ``timeout``: no orphan survives a test. Their rendezvous
port, and any other port a test needs, comes from ``free_port()``: this pytest process's own
slice of ports (one per xdist worker, below the kernel's ephemeral range).
"""

from __future__ import annotations

import os
import queue
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from solosave._src.testing.ports import PortRange


def _child(fn: Callable, rank: int, world_size: int, port: int, args: tuple, out: Any, env: dict) -> None:
    os.environ.update(env)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1"})
    import torch.distributed as dist

    torch.set_num_threads(1)  # as torchrun's OMP_NUM_THREADS=1 (the forkserver imported torch first)
    code = 0
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size)
        out.put((rank, "ok", fn(rank, world_size, *args)))
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


_PORTS: PortRange | None = None


def free_port() -> int:
    """A TCP port on 127.0.0.1 for a test's ranks or server, free now and handed out by no other
    test of this run: taken in turn from this pytest process's slice (``PYTEST_XDIST_WORKER`` =
    ``gw<i>`` of ``PYTEST_XDIST_WORKER_COUNT``; the whole range when pytest runs alone)."""
    global _PORTS  # one slice per pytest process, like the forkserver below
    if _PORTS is None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "")
        index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
        count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) if worker else 1
        _PORTS = PortRange(index, count)
    return _PORTS.take()


_CTX: Any = None


def _context() -> Any:
    """A forkserver context whose server has already imported torch and solosave: each rank
    starts as a fork of it instead of a fresh interpreter (torch's import costs seconds of CPU
    per process on this machine, and the suite starts hundreds of ranks). The ranks' own worker
    processes are still fresh interpreters, as in production."""
    global _CTX  # one forkserver per test session
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.checkpoint",
                                     "solosave", "tests.support"])
    return _CTX


def run_ranks_tolerant(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0,
                       env: dict | None = None, fresh: bool = False) -> dict[int, tuple[str, Any]]:
    """Run ``fn`` on ``world_size`` ranks; a rank may die or fail (see the module docstring).
    ``fresh``: each rank a fresh interpreter (``spawn``), e.g. for a ``sitecustomize`` to apply,
    and so is its worker (the suite's worker zygote is not used: tests/conftest.py)."""
    ctx = mp.get_context("spawn") if fresh else _context()
    if fresh:  # fresh interpreters all the way: the workers too (not forks of the suite's zygote)
        env = {**(env or {}), "SOLOSAVE_WORKER_ZYGOTE": ""}
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, args, out, env or {}))
             for r in range(world_size)]
    for p in procs:
        p.start()
    res: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(res) < world_size and time.monotonic() < deadline:
            try:
                rank, kind, val = out.get(timeout=0.5)
                res[rank] = (kind, val)
                continue
            except queue.Empty:
                pass
            for r, p in enumerate(procs):
                if r not in res and p.exitcode is not None:
                    _drain(out, res, grace=0.5)  # a last message may still be in flight
                    if r not in res:
                        res[r] = ("died", p.exitcode)
    finally:
        for p in procs:
            p.join(timeout=max(deadline - time.monotonic(), 0.1))
        for r, p in enumerate(procs):
            if p.is_alive():
                res.setdefault(r, ("hung", None))
                p.kill()
                p.join(5)
            res.setdefault(r, ("died", p.exitcode))  # exited after the last poll, no message
    return res


def _drain(out: Any, res: dict, grace: float) -> None:
    deadline = time.monotonic() + grace
    while True:
        try:
            rank, kind, val = out.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            return
        res[rank] = (kind, val)


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0,
              env: dict | None = None, fresh: bool = False) -> list[Any]:
    """Run ``fn`` on ``world_size`` ranks; every rank must return normally."""
    res = run_ranks_tolerant(fn, world_size, *args, timeout=timeout, env=env, fresh=fresh)
    bad = {r: v for r, v in res.items() if v[0] != "ok"}
    if bad:
        raise AssertionError("\n".join(f"--- rank {r} ({kind}) ---\n{val}" for r, (kind, val) in sorted(bad.items())))
    return [res[r][1] for r in range(world_size)]


# -- state dicts -------------------------------------------------------------------------------

def zeros_like(sd: Any) -> Any:
    """A state dict of the same structure with zeros (tensors) and empty values (the rest)."""
    if isinstance(sd, dict):
        return {k: zeros_like(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [zeros_like(v) for v in sd]
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    return type(sd)() if isinstance(sd, (int, float, str)) else None


def assert_equal(a: Any, b: Any, path: str = "") -> None:
    """Exactly the same structure and values (tensors bit for bit); names the first difference."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (path, set(a) ^ set(b) if isinstance(b, dict) else b)
        for k in a:
            assert_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{path}.{i}")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), path
    else:
        assert a == b, (path, a, b)


def equal(a: Any, b: Any) -> bool:
    try:
        assert_equal(a, b)
    except AssertionError:
        return False
    return True


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` passes; returns its last value (a
    deadline instead of a sleep: fast when things are fast, bounded when they are not)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return predicate()
        time.sleep(interval)
    return True


def fresh(root: str) -> None:
    """Rank 0 empties ``root``; every rank waits for it (a barrier)."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
    dist.barrier()


_TMPFS_OK: bool | None = None


def can_mount_private_tmpfs() -> bool:
    """Whether this process may make a private mount namespace with a small tmpfs (root with
    CAP_SYS_ADMIN and ``unshare``): probed once, by doing it."""
    global _TMPFS_OK  # a fact about this machine, probed once per session
    if _TMPFS_OK is None:
        import subprocess
        import tempfile

        _TMPFS_OK = False
        if os.geteuid() == 0 and shutil.which("unshare"):
            with tempfile.TemporaryDirectory() as d:
                try:
                    r = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {d}"],
                                       capture_output=True, timeout=30)
                    _TMPFS_OK = r.returncode == 0
                except (OSError, subprocess.SubprocessError):
                    _TMPFS_OK = False
    return _TMPFS_OK


def dcp_save_local(state_dict: Any, **kwargs: Any) -> None:
    """Stock ``dcp.save`` in one process without a process group (``no_dist=True`` where this
    torch has the flag; older ones, e.g. 2.6, infer it)."""
    import inspect

    import torch.distributed.checkpoint as dcp

    if "no_dist" in inspect.signature(dcp.save).parameters:
        kwargs["no_dist"] = True
    dcp.save(state_dict, **kwargs)


def publish_with_index(directory: Any, md: Any = None) -> str:
    """Write ``md`` (default: the ``.metadata`` already there) as ``.metadata`` with its load
    index beside it, as a solosave save publishes them; returns the save_id."""
    import pickle
    import uuid

    from solosave._src.formats.dcp import INDEX_FILE, METADATA_FILE
    from solosave._src.formats.metadata_template import MetadataTemplate
    from solosave._src.index.writer import body_from_metadata, render

    if md is None:
        with open(os.path.join(directory, METADATA_FILE), "rb") as f:
            md = pickle.load(f)
    template, save_id = MetadataTemplate(md), str(uuid.uuid4())
    with open(os.path.join(directory, INDEX_FILE), "wb") as f:
        f.write(render(body_from_metadata(md), template, str(directory), save_id))
    with open(os.path.join(directory, METADATA_FILE), "wb") as f:
        f.write(template.render(str(directory), save_id))
    return save_id
