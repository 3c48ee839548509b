"""Rank functions of tests/multiproc/test_preemption.py: a training loop with a
``PreemptionGuard`` over a ``CheckpointManager`` with two tiers; a SIGTERM reaches one rank."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

import solosave
from solosave.integrations import CheckpointManager, PreemptionGuard, read_latest_marker
from tests.multiproc.tier_fns import state
from tests.support import assert_equal, zeros_like


def guarded_loop(rank: int, world_size: int, root: str, victims: list[int], notice_step: int, exit_code: int | None,
                 interval: int = 5) -> dict:
    """Train up to 400 steps (each ends with an all_reduce, as gradients do), saving every
    ``interval`` steps; each rank of ``victims`` SIGTERMs itself after step ``notice_step``
    (a second SIGTERM three steps later). Returns where the guard stopped it and what it did."""
    ck = solosave.AsyncCheckpointer(assume_constant_structure=True, durable_root=f"{root}/durable", timeout=60)
    manager = CheckpointManager(f"{root}/fast", ck, keep_last=2)
    guard = PreemptionGuard(manager, interval=0.02, timeout=30, exit_code=exit_code, save_timeout=60)
    flag = torch.zeros(1)
    stop = None
    for step in range(1, 401):
        time.sleep(0.002 * (1 + rank))  # uneven step times
        dist.all_reduce(flag)
        if rank in victims and step in (notice_step, notice_step + 3):
            os.kill(os.getpid(), signal.SIGTERM)
        manager.poll()
        if step % interval == 0:
            manager.save(step, state(rank, step))
        if guard.stop_here(step, lambda s=step: state(rank, s)):
            stop = step
            break
    outcome = guard.outcome
    guard.close()
    manager.finish(60)
    return {"stop": stop, "outcome": None if outcome is None else [outcome.step, outcome.reason, outcome.published,
                                                                   outcome.durable, outcome.error],
            "signals": guard.signals_received, "handler_back": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
            "latest": [read_latest_marker(f"{root}/fast"), read_latest_marker(f"{root}/durable")]}


def resume(rank: int, world_size: int, root: str, fast_lost: bool) -> dict:
    """A new job restores the newest checkpoint (the fast tier removed first by the test when
    ``fast_lost``) and compares it bit for bit with the state saved at that step."""
    ck = solosave.AsyncCheckpointer(assume_constant_structure=True, durable_root=f"{root}/durable", timeout=60)
    manager = CheckpointManager(f"{root}/fast", ck)
    got = zeros_like(state(rank, 0))
    point = manager.restore(got)
    assert point is not None
    assert_equal(got, state(rank, point[0]))
    manager.finish(60)
    return {"step": point[0], "path": point[1]}
