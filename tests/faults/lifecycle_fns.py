"""Rank functions and trainer scripts for the lifecycle tests (module-level: spawned processes
import them). Each returns plain data for the test to check."""

from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist

import solosave
from solosave._src.testing.introspect import worker_pid
from tests.faults.fault_fns import SETUP_WAIT, sd_at, set_step, shm_segments, staging_mappings
from tests.support import fresh, wait_until, zeros_like


def _error_type(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type is what the test checks
        return type(e).__name__, str(e)
    return None, ""


def resave_same_path(rank: int, ws: int, root: str, timeout: float) -> dict:
    """Reuse saves c0, c1; then c1 again without and with overwrite, right after wait()."""
    fresh(root)
    sd = sd_at(rank, 0)
    out: dict = {}
    with solosave.AsyncCheckpointer(prepared_metadata=f"{root}/prep.md", create_prepared_metadata=True,
                                    timeout=timeout) as ck:
        ck.save(sd, f"{root}/c0").wait(SETUP_WAIT)
        set_step(sd, rank, 1)
        r1 = ck.save(sd, f"{root}/c1").wait(timeout)
        out["published_c1"] = r1.published
        set_step(sd, rank, 2)
        # at once, no barrier: every rank must see c1 published and refuse
        out["again"] = _error_type(lambda: ck.save(sd, f"{root}/c1"))
        r2 = ck.save(sd, f"{root}/c1", overwrite=True).wait(timeout)
        out["overwrite"] = (r2.mode, r2.published)
    return out


def prepared_is_a_checkpoint(rank: int, ws: int, root: str, timeout: float) -> dict:
    """A later job reuses c0's own .metadata as its prepared metadata, then its layout drifts."""
    fresh(root)
    sd = sd_at(rank, 0)
    with solosave.AsyncCheckpointer(timeout=timeout) as ck:
        ck.save(sd, f"{root}/c0").wait(SETUP_WAIT)
    dist.barrier()
    before = open(f"{root}/c0/.metadata", "rb").read()
    sd["tag"] = "x" * 5000  # a BYTES item outgrows its slot: the layout drifts
    with solosave.AsyncCheckpointer(prepared_metadata=f"{root}/c0/.metadata", timeout=timeout) as ck:
        r = ck.save(sd, f"{root}/c1").wait(SETUP_WAIT)
        r2 = ck.save(sd, f"{root}/c2").wait(timeout)
    dist.barrier()
    return {"modes": [r.mode, r2.mode], "unchanged": open(f"{root}/c0/.metadata", "rb").read() == before,
            "warnings": list(r.warnings)}


def dropped_checkpointer(rank: int, ws: int, root: str, timeout: float, persistent: bool) -> dict:
    """A checkpointer dropped without close(): its segment and worker go with it."""
    fresh(root)
    mine = f"solosave_{os.getpid()}_"

    def named() -> list[str]:
        return [s for s in shm_segments() if s.startswith(mine)]

    def make_and_drop(name: str) -> int:
        ck = solosave.AsyncCheckpointer(timeout=timeout, persistent_worker=persistent)
        ck.save(sd_at(rank, 0), f"{root}/{name}").wait(SETUP_WAIT)
        pid = worker_pid(ck)
        assert staging_mappings()  # its buffer is mapped (and has no name in /dev/shm)
        assert not named()
        del ck
        gc.collect()
        return pid

    pid = make_and_drop("a")
    gone = wait_until(lambda: not staging_mappings() and not named(), 10)
    worker_gone = (not persistent) or wait_until(lambda: not os.path.exists(f"/proc/{pid}/cmdline")
                                                 or b"_worker_entry" not in open(f"/proc/{pid}/cmdline", "rb").read(), 10)
    dist.barrier()
    return {"segment_gone": gone, "worker_gone": worker_gone}


def store_address(rank: int, ws: int, root: str) -> str | None:
    with solosave.AsyncCheckpointer(timeout=60) as ck:
        server = ck._res.store  # test-only look inside: rank 0's store and its socket
        return server[1].getsockname()[0] if server is not None else None


def load_resave(rank: int, ws: int, root: str) -> bool:
    """The checkpoint of step 2 loads with both loaders and holds step 2's values (c1 re-saved)."""
    want = sd_at(rank, 2)
    got = zeros_like(want)
    solosave.load(got, f"{root}/c1")
    return all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"]) and got["step"] == 2


# -- trainer scripts (one process, world size 1, run with `python -c`) ----------------------------

TRAINER_PREAMBLE = """
import os, sys, time, signal, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
import solosave
from solosave._src.testing.introspect import worker_pid
"""

EXIT_RIGHT_AWAY = TRAINER_PREAMBLE + """
ck = solosave.AsyncCheckpointer(timeout=900)
print("WORKER", worker_pid(ck), flush=True)
os._exit(0)   # dies without close(), a second after creating the checkpointer
"""

FINAL_SAVE_ON_SIGTERM = TRAINER_PREAMBLE + """
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
ck = solosave.AsyncCheckpointer(timeout=120)
sd = {{"w": torch.zeros(1000), "step": 0}}
ck.save(sd, {root!r} + "/c0").wait(120)
print("READY", worker_pid(ck), flush=True)
step = 0
while not stop:
    step += 1
    sd["w"].add_(1.0); sd["step"] = step
    time.sleep(0.01)
r = ck.save(sd, {root!r} + "/final").wait(120)   # the final save from the signal's aftermath
print("FINAL", r.mode, r.published, step, flush=True)
ck.close()
"""

SAVE_BIG = TRAINER_PREAMBLE + """
import logging, warnings
logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
ck = solosave.AsyncCheckpointer(timeout=300)
sd = {{"w": torch.arange(64 << 20, dtype=torch.float32)}}   # 256 MiB
r = ck.save(sd, {root!r} + "/big").wait(300)
ck.close()
out = {{"w": torch.zeros(64 << 20)}}
solosave.load(out, {root!r} + "/big")
print("LOADED", r.published, bool(torch.equal(out["w"], sd["w"])), flush=True)
"""

KILLED_AFTER_SAVE = TRAINER_PREAMBLE + """
ck = solosave.AsyncCheckpointer(timeout=120, persistent_worker={persistent})
ck.save({{"w": torch.ones(1 << 20)}}, {root!r} + "/c0").wait(120)
print("SAVED", os.getpid(), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""

JOB_KILLED_AS_A_WHOLE = TRAINER_PREAMBLE + """
ck = solosave.AsyncCheckpointer(timeout=120, persistent_worker={persistent})
h = ck.save({{"w": torch.ones(16 << 20)}}, {root!r} + "/c0")   # 64 MiB staged
maps = sum(1 for line in open("/proc/self/maps") if "solosave_" in line)
print("SAVED", os.getpid(), maps, flush=True)
time.sleep(120)   # killed here, with the rest of its process group, save in flight or not
"""


# -- overlapped staging: what a copy still writes or reads (issue 29, items 4 and 5) ----------

def _gate_copies():
    """Hold every overlapped CPU copy, before it checks or reads anything, until the returned
    event is set (test-only patch of the staging thread's body)."""
    import threading

    from solosave._src.staging import staging as _stage

    gate, real = threading.Event(), _stage._copy_pieces

    def gated(*args, **kwargs):
        gate.wait(60)
        return real(*args, **kwargs)

    _stage._copy_pieces = gated
    return gate


def close_during_overlapped_copy(rank: int, ws: int, root: str, persistent: bool) -> dict:
    """``close(timeout=0.5)`` while the overlapped copy of a save is held back: close returns,
    then the copy runs into the buffer (which must still be mapped), then the buffer goes."""
    import time

    fresh(root)
    sd = {"w": torch.arange(float(1 << 21)), "v": torch.ones(1 << 18)}
    ck = solosave.AsyncCheckpointer(overlap_staging=True, persistent_worker=persistent, timeout=30)
    ck.save(sd, f"{root}/warm").wait(SETUP_WAIT)  # the worker is up
    gate = _gate_copies()
    h = ck.save(sd, f"{root}/a")
    t0 = time.monotonic()
    ck.close(timeout=0.5)
    out = {"close_s": round(time.monotonic() - t0, 2), "mapped_after_close": len(staging_mappings())}
    gate.set()  # the copy now writes into the buffer close() let go of
    try:
        h.wait(5)
        out["a"] = "published"
    except solosave.CheckpointError as e:
        out["a"] = f"CheckpointError: {str(e)[:120]}"
    out["unmapped"] = wait_until(lambda: not staging_mappings(), 10)
    out["published"] = os.path.exists(f"{root}/a/.metadata")
    return out


def change_before_overlapped_copy(rank: int, ws: int, root: str, how: str) -> dict:
    """Stager level: a saved tensor is resized larger, has its storage freed or replaced, or is
    dropped, after ``stage()`` and before the (held back) overlapped copy runs."""
    from solosave._src.plan.local_plan import plan_local
    from solosave._src.staging.staging import Stager

    base = torch.arange(float(1 << 22)).reshape(1 << 11, 1 << 11)
    sd = {"big": base.t() if how.startswith("view") else torch.arange(float(1 << 22)), "small": torch.ones(8)}
    plan = plan_local(sd)
    gate = _gate_copies()
    stager = Stager()
    out: dict = {}
    try:
        _, staging = stager.stage(plan.specs, plan.values, overlap=True)
        if how == "grow":
            sd["big"].resize_(1 << 23)
        elif how == "free":
            sd["big"].untyped_storage().resize_(0)
        elif how == "set":
            sd["big"].set_(torch.zeros(1 << 22).untyped_storage())
        elif how == "view_grow":  # the base of the saved view (base.t()): its storage reallocated
            base.resize_(1 << 12, 1 << 12)
        elif how == "view_free":
            base.untyped_storage().resize_(0)
        elif how == "view_drop":
            plan.values.clear()
            del sd["big"], base
            gc.collect()
        elif how == "drop":
            plan.values.clear()
            del sd["big"]
            gc.collect()
        gate.set()
        try:
            staging.wait(30)
            out["error"] = None
        except Exception as e:  # noqa: BLE001 - the type is what the test checks
            out["error"] = f"{type(e).__name__}: {e}"
    finally:
        stager.close()
    return out
