"""Rank functions of the randomized fault soak (tests/faults/test_soak_faults.py).

One trial: a 2-rank job saves steps 1..STEPS with two tiers (a fast directory and a durable
root) while one fault, drawn from the trial's seed, strikes: a rank or a worker SIGKILLed at a
random moment of a random save, an I/O error (EIO, ENOSPC) at a random write on the fast or the
durable tier, or, after the job, a data file of the newest fast copy truncated or removed. Then
a new job restores (``find_restore_point`` + ``solosave.load`` with the durable root) and checks
the values bit for bit against the step it restored. Every draw is a function of the seed, the
same on every rank.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

import solosave
from solosave._src.testing.introspect import worker_pid
from tests.support import assert_equal, zeros_like

STEPS = 4
FAULTS = ("none", "kill_rank", "kill_worker", "eio_fast", "enospc_fast", "eio_durable", "enospc_durable",
          "truncate_fast", "remove_fast")


def draw(seed: int) -> dict:
    """The trial of ``seed``: its fault, victim rank, step and moment (the same on every rank)."""
    rng = random.Random(seed)
    return {"fault": FAULTS[seed] if 0 <= seed < len(FAULTS) else rng.choice(FAULTS),
            "victim": rng.randrange(2), "step": rng.randint(1, STEPS), "delay": rng.uniform(0.0, 0.3),
            "write": rng.randrange(3)}


def state(rank: int, step: int) -> dict:
    """A rank's state at ``step``: replicated values (the same on every rank, as DDP's), and a
    tensor of its own."""
    g, mine = torch.Generator().manual_seed(7919 * step), torch.Generator().manual_seed(7919 * step + 1 + rank)
    return {"model": {"w": torch.randn(128, 128, generator=g), f"own{rank}": torch.randn(4096, generator=mine)},
            "shared": torch.arange(256.0) + step, "step": step}


class SoakWriter(solosave.FileWriter):
    """Writes normally, except the trial's I/O error: on the victim rank, at its ``write``-th
    data file of the victim step's copy on the drawn tier, half the records, then the error."""

    def __init__(self, trial: dict, durable: str) -> None:
        super().__init__()
        self.trial, self.durable, self.seen = trial, durable, 0

    def write_file(self, directory, relative_path, records):
        t = self.trial
        tier = "durable" if t["fault"].endswith("_durable") else "fast"
        on_tier = os.path.dirname(os.fspath(directory)) == self.durable if tier == "durable" else \
            os.path.dirname(os.fspath(directory)) != self.durable
        hit = (t["fault"].split("_")[0] in ("eio", "enospc") and on_tier
               and os.path.basename(os.fspath(directory)) == f"iter_{t['step']:07d}"
               and relative_path.startswith(f"__{t['victim']}_"))
        if not hit:
            return super().write_file(directory, relative_path, records)
        super().write_file(directory, relative_path, records[: max(len(records) // 2, 1)])
        code = errno.EIO if t["fault"].startswith("eio") else errno.ENOSPC
        raise OSError(code, f"injected {errno.errorcode[code]} (soak)", relative_path)


def job(rank: int, ws: int, root: str, seed: int) -> dict:
    """Phase 1: the saves, under the trial's fault. Returns the steps this rank saw published on
    the fast tier, and on the durable tier."""
    t = draw(seed)
    fast, durable = f"{root}/fast", f"{root}/durable"
    out: dict[str, Any] = {"fast": [], "durable": [], "error": None}
    ck = solosave.AsyncCheckpointer(assume_constant_structure=True, durable_root=durable, timeout=30.0,
                                    writer=SoakWriter(t, durable))
    try:
        os.makedirs(f"{root}/pids", exist_ok=True)
        with open(f"{root}/pids/{rank}", "w") as f:
            f.write(str(worker_pid(ck)))
        for step in range(1, STEPS + 1):
            if step == t["step"] and rank == t["victim"] and t["fault"] in ("kill_rank", "kill_worker"):
                pid = os.getpid() if t["fault"] == "kill_rank" else worker_pid(ck)
                threading.Timer(t["delay"], os.kill, (pid, signal.SIGKILL)).start()
            try:
                r = ck.save(state(rank, step), f"{fast}/iter_{step:07d}").wait()
            except solosave.CheckpointError as e:
                if t["fault"] in ("kill_rank", "kill_worker"):
                    raise  # a rank or its worker is gone: this checkpointer is done
                out["error"] = f"{type(e).__name__}: {str(e)[:200]}"  # an I/O error: training goes on
                continue
            out["fast"].append(step)
            d = r.durable.wait() if r.durable is not None else None
            if d is not None and d.ok:
                out["durable"].append(step)
            if step == t["step"] and t["fault"] in ("kill_rank", "kill_worker"):
                time.sleep(t["delay"] + 0.2)  # the kill lands during or after this save
    except Exception as e:  # noqa: BLE001 - a fault's error: the trial checks what was published
        out["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    finally:
        ck.close(timeout=30.0)
    return out


def restore(rank: int, ws: int, root: str) -> dict:
    """Phase 2: a new job restores and checks the values bit for bit."""
    from solosave.integrations import find_restore_point

    fast, durable = f"{root}/fast", f"{root}/durable"
    point = find_restore_point(fast, durable)
    if point is None:
        return {"point": None}
    step, path = point
    got = zeros_like(state(rank, step))
    loaded = solosave.load(got, f"{fast}/iter_{step:07d}", durable_root=durable)
    assert_equal(state(rank, step), got)
    dist.barrier()
    return {"point": step, "path": path, "loaded": loaded}
