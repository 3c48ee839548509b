"""Rank functions of tests/faults/test_faults_round4.py (module-level: the ranks and their workers
import them): retention with two tiers, a load index on S3, Lightning's top-k with a save that
fails on one rank, torchtitan's keep_latest_k under a SIGKILL at a random moment."""

from __future__ import annotations

import errno
import os
import re
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

import solosave
from tests.support import assert_equal, zeros_like
from tests.support import fresh as _fresh

_STEP = re.compile(r"iter_(\d+)$")


def _step_of(path: str) -> int:
    m = _STEP.search(os.path.normpath(path))
    assert m, path
    return int(m.group(1))


# -- 1. retention with two tiers -------------------------------------------------------------------
def tier_state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(31 * step + rank)
    return {"own": {f"r{rank}": torch.randn(128, 64, generator=g)}, "shared": torch.arange(32.0) + step,
            "step": step}


class DurableFaults(solosave.FileWriter):
    """Writes normally, except a durable copy's data file (a path under ``durable``):

    * ``fail_from``: the copies of steps >= it fail at once with ENOSPC (the durable tier filled up);
    * ``hold``: the copy of step ``s`` waits (at most ``hold`` s) until the fast tier published step
      ``s + 1`` and then until its own fast source is gone or ``hold`` s more passed: the slow
      durable tier of a busy job, with the fast tier's retention given every chance to run."""

    def __init__(self, fast: str, durable: str, fail_from: int | None = None, hold: float = 0.0) -> None:
        super().__init__()
        self.fast, self.durable, self.fail_from, self.hold = fast, durable, fail_from, hold

    def open(self, path: str):  # noqa: ANN201 - a DataFile
        if os.path.normpath(path).startswith(os.path.normpath(self.durable) + os.sep):
            step = _step_of(os.path.dirname(path))
            if self.fail_from is not None and step >= self.fail_from:
                raise OSError(errno.ENOSPC, "No space left on device (injected: the durable tier is full)", path)
            if self.hold:
                src = os.path.join(os.path.normpath(self.fast), f"iter_{step:07d}")
                nxt = os.path.join(os.path.normpath(self.fast), f"iter_{step + 1:07d}", ".metadata")
                deadline = time.monotonic() + self.hold
                while not os.path.exists(nxt) and time.monotonic() < deadline:
                    time.sleep(0.02)
                deadline = time.monotonic() + self.hold
                while os.path.exists(os.path.join(src, ".metadata")) and time.monotonic() < deadline:
                    time.sleep(0.02)
        return super().open(path)


def _published(root: str) -> list[int]:
    from solosave.integrations import published_checkpoints

    return [s for s, _ in published_checkpoints(root)]


def durable_copies_fail_while_retention_runs(rank: int, ws: int, root: str, timeout: float) -> dict:
    """keep_last=1 on the fast tier, durable_keep_last=1: steps 1..5 saved (async, polled each
    step); the durable tier fills up from step 3 on. Every deletion (either tier) is recorded
    with both tiers' published steps at that moment; then the fast tier is lost and the job
    restores from what is left, bit for bit."""
    import shutil

    from solosave._src.tools.retention import remove_checkpoint
    from solosave.integrations import CheckpointManager, find_restore_point

    _fresh(root)
    fast, durable = f"{root}/fast", f"{root}/durable"
    deletions: list[dict] = []

    def spy(path: str) -> None:
        tier = "durable" if os.path.normpath(path).startswith(os.path.normpath(durable)) else "fast"
        deletions.append({"tier": tier, "step": _step_of(path), "fast": _published(fast),
                          "durable": _published(durable), "copying": sorted(_step_of(p) for p in m._copying)})
        remove_checkpoint(path)

    ck = solosave.AsyncCheckpointer(assume_constant_structure=True, durable_root=durable, timeout=timeout,
                                    writer=DurableFaults(fast, durable, fail_from=3))
    m = CheckpointManager(fast, ck, keep_last=1, durable_keep_last=1, remover=spy)
    try:
        for step in range(1, 6):
            m.save(step, tier_state(rank, step))
            m.poll()
            time.sleep(0.2)  # training: the copies and the deletions run meanwhile
            m.poll()
        m.finish(timeout)
    except BaseException:
        ck.close(timeout)
        raise
    out: dict[str, Any] = {"deletions": deletions, "fast": _published(fast), "durable": _published(durable),
                           "copies": [(d.step, d.result.ok, d.result.error) for d in m.durable_done],
                           "failures": [d.step for d in m.failures]}
    dist.barrier()
    point = find_restore_point(fast, durable)
    out["point"] = None if point is None else point[0]
    got = zeros_like(tier_state(rank, point[0]))
    solosave.load(got, point[1])
    assert_equal(tier_state(rank, point[0]), got)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(fast)  # the fast tier's host is gone
    dist.barrier()
    point = find_restore_point(fast, durable)
    out["point_fast_lost"] = None if point is None else point[0]
    if point is not None:
        got = zeros_like(tier_state(rank, point[0]))
        solosave.load(got, point[1])
        assert_equal(tier_state(rank, point[0]), got)
    return out


def slow_copies_and_fast_retention(rank: int, ws: int, root: str, fast_name: str, timeout: float) -> dict:
    """keep_last=1 on the fast tier, every step's durable copy slow (held until the fast tier
    published the next step, then until retention removed its source or 2 s passed): the fast tier
    must spare every checkpoint whose copy still reads it. ``fast_name``: the fast directory as the
    user spelled it (e.g. ``fast`` or ``.//fast``)."""
    from solosave.integrations import CheckpointManager

    _fresh(root)
    fast, durable = os.path.join(root, fast_name), f"{root}/durable"
    ck = solosave.AsyncCheckpointer(assume_constant_structure=True, durable_root=durable, timeout=timeout,
                                    writer=DurableFaults(fast, durable, hold=2.0))
    m = CheckpointManager(fast, ck, keep_last=1, async_save=False)
    try:
        for step in range(1, 4):
            m.save(step, tier_state(rank, step))
            m.poll()
        m.finish(timeout)
    except BaseException:
        ck.close(timeout)
        raise
    dist.barrier()
    out: dict[str, Any] = {"copies": [(d.step, d.result.ok, (d.result.error or "")[:300]) for d in m.durable_done],
                           "fast": _published(fast), "durable": _published(durable)}
    for step in out["durable"]:
        got = zeros_like(tier_state(rank, step))
        solosave.load(got, f"{durable}/iter_{step:07d}")
        assert_equal(tier_state(rank, step), got)
    return out


# -- 2. a load index on S3 ----------------------------------------------------------------------------
def s3_state(rank: int) -> dict:
    """A rank's state of the S3 checkpoint: replicated values, one tensor of its own, bytes."""
    g = torch.Generator().manual_seed(4242)
    return {"w": torch.randn(64, 32, generator=g), "ids": torch.arange(100, dtype=torch.int64),
            f"own{rank}": torch.full((1000,), float(rank + 1)), "step": 7, "name": "round4"}


def s3_full() -> dict:
    """Every value of the 2-rank S3 checkpoint, for a one-process load."""
    return {**s3_state(0), "own1": s3_state(1)["own1"]}


def save_to_s3(rank: int, ws: int, url: str) -> str:
    """Every rank: one save of :func:`s3_state` to ``url`` (the load index beside its .metadata)."""
    with solosave.AsyncCheckpointer(assume_constant_structure=True, timeout=60.0) as ck:
        return ck.save(s3_state(rank), url).wait().path


# -- 3. Lightning's top-k and a save that fails on one rank ----------------------------------------------
def lightning_topk_job(rank: int, ws: int, root: str) -> dict:
    """ModelCheckpoint every 2 steps, save_top_k=2 on ``step`` (max), save_last=True, solosave's
    ModelParallelStrategy: the top-k save of step 6 (the job's fifth save) fails on rank 1 only
    (EIO halfway through its file). Then, in the same process, ``fit(ckpt_path="best")`` with the
    same callback, and ``fit(ckpt_path="last")`` with a new one."""
    os.environ["LOCAL_RANK"] = str(rank)
    import lightning.pytorch as pl
    from lightning.fabric.strategies.fsdp import _is_sharded_checkpoint

    from tests.faults.fault_fns import FaultWriter
    from tests.integrations import lightning_fns as lf

    ck = f"{root}/ck"
    snaps: dict = {}
    out: dict[str, Any] = {}

    def callback() -> Any:
        return pl.callbacks.ModelCheckpoint(dirpath=ck, filename="{step}", every_n_train_steps=2, save_top_k=2,
                                            monitor="step", mode="max", save_last=True)

    class AtStart(pl.Callback):
        def on_train_start(self, trainer: Any, *args: Any) -> None:
            snaps["start"] = lf.snapshot(trainer)

    topk = callback()
    writer = FaultWriter(1, ".step=6.ckpt.solosave-5", "eio")
    t = lf.trainer(root, lf.strategy("mp", options=lf._options(), writer=writer), 8,
                   [topk, lf.snapshot_at({2, 4, 6}, snaps)])
    t0 = time.monotonic()
    try:
        t.fit(lf.module_class("mp")(), lf.loader())
        out["error"] = None
    except Exception as e:  # noqa: BLE001 - what the test inspects
        out["error"] = (type(e).__name__, str(e)[:600], t.global_step)
    out["error_after_s"] = time.monotonic() - t0
    dist.barrier()
    out["left"] = sorted(os.listdir(ck))
    out["finished"] = sorted(n for n in os.listdir(ck) if _is_sharded_checkpoint(__import__("pathlib").Path(ck, n)))
    out["best_path"] = os.path.basename(topk.best_model_path)
    out["best_k"] = sorted(os.path.basename(p) for p in topk.best_k_models)
    for label, path, cb in (("best", "best", topk), ("last", "last", callback())):
        snaps.pop("start", None)
        t = lf.trainer(root, lf.strategy("mp", options=lf._options()), 6, [cb, AtStart()])
        try:
            t.fit(lf.module_class("mp")(), lf.loader(), ckpt_path=path)
            out[label] = ("resumed", snaps["start"]["step"])
            out[f"{label}_exact"] = _same(snaps["start"], snaps[snaps["start"]["step"]])
        except Exception as e:  # noqa: BLE001 - what the test inspects
            out[label] = (type(e).__name__, str(e)[:300])
        dist.barrier()
    return out


def _same(a: dict, b: dict) -> bool:
    try:
        assert_equal(a, b)
    except AssertionError:
        return False
    return True


# -- 4. torchtitan's keep_latest_k and a SIGKILL at a random moment --------------------------------------
def _atomic_save(obj: Any, path: str) -> None:
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def _append(path: str, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")


def check_titan_folder(rank: int, root: str) -> dict:
    """Every rank, no save: what a job killed at any moment left in ``<root>/ckpt``. Every
    directory with a ``.metadata`` loads bit for bit (the state the job had at that step, from its
    snapshot), one without is neither found nor loadable, the newest published one is at least the
    newest the jobs saw published, and every deletion left a newer published checkpoint."""
    from solosave.integrations import find_latest_checkpoint, published_checkpoints
    from tests.integrations.test_titan import build, snapshot

    folder = f"{root}/ckpt"
    names = sorted(n for n in os.listdir(folder) if n.startswith("iter_")) if os.path.isdir(folder) else []
    published = [s for s, _ in published_checkpoints(folder)]
    partial = [int(n[5:]) for n in names if int(n[5:]) not in published]
    out: dict[str, Any] = {"published": published, "partial": partial}
    latest = find_latest_checkpoint(folder)
    out["latest"] = None if latest is None else latest[0]
    seen: list[int] = []
    for r in range(dist.get_world_size()):
        if os.path.exists(f"{root}/published-{r}.log"):
            with open(f"{root}/published-{r}.log") as f:
                seen += [int(x) for x in f.read().split()]
    out["seen_published"] = max(seen, default=None)
    deletions: list[list[Any]] = []
    if os.path.exists(f"{root}/deletions.log"):
        with open(f"{root}/deletions.log") as f:
            deletions = [eval(line) for line in f if line.strip()]  # noqa: S307 - our own log of lists of ints
    out["bad_deletions"] = [d for d in deletions if not d[1] or max(d[1]) <= d[0]]
    out["deletions"] = len(deletions)
    out["exact"] = []
    for step in published:
        job = build(root, load_only=True, load_step=step)
        assert job.manager.load(step=step) is True
        want = torch.load(f"{root}/snap/{step}-{rank}.pt", weights_only=True)
        assert_equal(want, snapshot(job))
        out["exact"].append(step)
    out["partial_refused"] = []
    for step in partial:
        job = build(root, load_only=True, load_step=step)
        try:
            job.manager.load(step=step)
        except FileNotFoundError:
            out["partial_refused"].append(step)
    return out


def titan_killed_job(rank: int, ws: int, root: str, seed: int) -> dict:
    """Checks what the previous job left (:func:`check_titan_folder`), then resumes from the newest
    published checkpoint and trains, saving every step asynchronously with keep_latest_k=2, until
    the whole job is SIGKILLed at a moment drawn from ``seed`` (every rank kills itself then; its
    worker dies with it). Each step's state is snapshotted before its save; each save the job
    sees published is logged; each deletion is logged with the steps published at that moment."""
    import json
    import random

    from solosave._src.tools.retention import remove_checkpoint
    from solosave.integrations import published_checkpoints
    from tests.integrations.test_titan import build, snapshot

    before = check_titan_folder(rank, root)
    with open(f"{root}/check-{seed}-{rank}.json", "w") as f:
        json.dump(before, f)
    dist.barrier()
    if seed < 0:
        return {"before": before}
    os.makedirs(f"{root}/snap", exist_ok=True)
    job = build(root, async_mode="async", interval=1, keep_latest_k=2, timeout=30.0)
    resumed = job.manager.load(step=-1)
    manager = job.manager.manager

    def remover(path: str) -> None:  # rank 0's pruning thread
        _append(f"{root}/deletions.log", repr([_step_of(path), [s for s, _ in published_checkpoints(
            f"{root}/ckpt")]]))
        remove_checkpoint(path)

    manager._pruner._remover = remover
    delay = random.Random(seed).uniform(0.3, 1.5)
    dist.barrier()
    # the kill is armed once this job saw a save published (a loaded machine may take longer than
    # the delay for the first one), then comes at the drawn moment, mid-save or between saves
    armed = False
    logged = 0
    import torch.nn.functional as F

    while True:  # until the kill
        job.train_state.n += 1
        g = torch.Generator().manual_seed(1000 + job.data.n)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        job.data.n += 1
        job.optimizers.zero_grad()
        F.mse_loss(job.model(x), y).backward()
        for p in job.model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= ws
        job.manager.maybe_wait_for_staging()
        job.optimizers.step()
        job.lr_schedulers.step()
        step = job.train_state.n
        _atomic_save(snapshot(job), f"{root}/snap/{step}-{rank}.pt")
        job.manager.save(step)
        done = manager.done
        for d in done[logged:]:
            if d.error is None:
                _append(f"{root}/published-{rank}.log", str(d.step))
        logged = len(done)
        if not armed:  # every rank has seen a publication: both timers start together
            seen = torch.tensor([int(any(d.error is None for d in done))])
            dist.all_reduce(seen, op=dist.ReduceOp.MIN)
            if seen.item():
                dist.barrier()
                threading.Timer(delay, os.kill, (os.getpid(), 9)).start()
                armed = True
        if step > 5000:
            return {"before": before, "resumed": resumed, "not_killed": True}
