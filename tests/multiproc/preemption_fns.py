"""Rank functions of tests/multiproc/test_preemption.py: a training loop with a
``PreemptionGuard`` over a ``CheckpointManager`` with two tiers; a SIGTERM reaches one rank."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist

import solosave
from solosave.integrations import CheckpointManager, PreemptionGuard, read_latest_marker
from tests.multiproc.tier_fns import state
from tests.support import assert_equal, zeros_like


def _train(rank: int, manager: CheckpointManager, guard: PreemptionGuard, steps: int, interval: int,
           before: Any) -> int | None:
    """The loop: ``before(step)``, the step's all_reduce (as gradients' keep the ranks in step), a
    save every ``interval`` steps, then the guard. Returns the step it stopped at."""
    flag = torch.zeros(1)
    for step in range(1, steps + 1):
        before(step)
        dist.all_reduce(flag)
        manager.poll()
        if step % interval == 0:
            manager.save(step, state(rank, step))
        if guard.stop_here(step, lambda s=step: state(rank, s)):
            return step
    return None


def guarded_loop(rank: int, world_size: int, root: str, victims: list[int], notice_step: int, exit_code: int | None,
                 interval: int = 5) -> dict:
    """Train up to 400 steps (each ends with an all_reduce, as gradients do), saving every
    ``interval`` steps; each rank of ``victims`` SIGTERMs itself after step ``notice_step``
    (a second SIGTERM three steps later). Returns where the guard stopped it and what it did."""
    ck = solosave.AsyncCheckpointer(assume_constant_structure=True, durable_root=f"{root}/durable", timeout=60)
    manager = CheckpointManager(f"{root}/fast", ck, keep_last=2)
    guard = PreemptionGuard(manager, interval=0.02, timeout=30, exit_code=exit_code, save_timeout=60)
    def before(step: int) -> None:
        time.sleep(0.002 * (1 + rank))  # uneven step times
        if rank in victims and step in (notice_step, notice_step + 3):
            os.kill(os.getpid(), signal.SIGTERM)

    stop = _train(rank, manager, guard, 400, interval, before)
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
    if point is not None:
        assert_equal(got, state(rank, point[0]))
    manager.finish(60)
    return {"step": None if point is None else point[0], "path": None if point is None else point[1]}


def draw(seed: int) -> dict:
    """One soak trial: who gets SIGTERM and when (a moment inside a step: mid-staging, mid-write,
    mid-publish or mid-copy of a save in flight), the save interval, and whether the scheduler's
    grace period ends (every rank SIGKILLed) a random time after the notice."""
    import random

    rng = random.Random(seed)
    return {"victims": rng.choice([[0], [1], [0, 1]]), "notice_step": rng.randint(2, 14),
            "delay": rng.uniform(0.0, 0.02), "interval": rng.choice([1, 2, 3, 5]),
            "kill_after": rng.choice([None, None, rng.uniform(0.0, 0.6)])}


def soak_job(rank: int, world_size: int, root: str, seed: int) -> dict:
    """A guarded 2-rank job with two tiers under trial ``seed`` (see :func:`draw`). Each victim
    SIGTERMs itself from a thread ``delay`` s into step ``notice_step`` (and again 0.05 s later);
    with ``kill_after``, the first victim then writes a marker and every rank SIGKILLs itself
    (the whole job) that long after the notice. Returns the step the guard stopped at."""
    import threading

    trial = draw(seed)
    marker = f"{root}/killed"
    ck = solosave.AsyncCheckpointer(assume_constant_structure=True, durable_root=f"{root}/durable", timeout=30)
    manager = CheckpointManager(f"{root}/fast", ck, keep_last=2)
    # the notice thread's second SIGTERM may come after the guard closed: a real job is exiting then
    # anyway; this one must live to report, so the handler the guard puts back ignores it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    guard = PreemptionGuard(manager, interval=0.02, timeout=20, save_timeout=30)

    def grace_end() -> None:
        while not os.path.exists(marker):
            time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGKILL)

    def notice() -> None:
        time.sleep(trial["delay"])
        os.kill(os.getpid(), signal.SIGTERM)
        if trial["kill_after"] is not None and rank == trial["victims"][0]:
            time.sleep(trial["kill_after"])
            with open(marker + f".{rank}", "w"):
                pass
            os.replace(marker + f".{rank}", marker)
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=grace_end, daemon=True).start()

    def before(step: int) -> None:
        if rank in trial["victims"] and step == trial["notice_step"]:
            threading.Thread(target=notice, daemon=True).start()
        time.sleep(0.003)

    stop = _train(rank, manager, guard, 200, trial["interval"], before)
    outcome = guard.outcome
    guard.close()  # puts SIG_IGN back (set before the guard)
    manager.finish(30)
    assert outcome is not None and outcome.published and outcome.durable, outcome
    return {"stop": stop}
