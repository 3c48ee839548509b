"""Rank functions of tests/multiproc/test_zygote.py."""

from __future__ import annotations

import os
import signal
import time

import torch

import solosave
from solosave._src.testing.introspect import worker_pid


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def who_starts_the_worker(rank: int, ws: int, root: str) -> dict:
    """Save once; report the worker's parent, then SIGKILL the worker and report the error."""
    with solosave.AsyncCheckpointer(timeout=30) as ck:
        r = ck.save({"w": torch.arange(8.0)}, f"{root}/a").wait(30)
        pid = worker_pid(ck)
        out = {"published": r.published, "parent_is_trainer": _ppid(pid) == os.getpid(), "pid": pid}
        os.kill(pid, signal.SIGKILL)
        try:
            ck.save({"w": torch.arange(8.0)}, f"{root}/b").wait(30)
            out["after_kill"] = "published"
        except solosave.SolosaveError as e:
            out["after_kill"] = str(e)
    got = {"w": torch.zeros(8)}
    solosave.load(got, f"{root}/a")
    out["loads"] = torch.equal(got["w"], torch.arange(8.0))
    return out


def trainer_dies(rank: int, ws: int, root: str) -> int:
    """Start a checkpointer, write its worker's pid, and die without closing it."""
    ck = solosave.AsyncCheckpointer(timeout=30)
    ck.save({"w": torch.arange(8.0)}, f"{root}/a").wait(30)
    with open(f"{root}/pid", "w") as f:
        f.write(str(worker_pid(ck)))
    time.sleep(0.2)
    os._exit(0)
