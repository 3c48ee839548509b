"""The randomized fault soak: trials of a 2-rank job with two tiers under one random fault each,
then a restore (see tests/faults/soak_fns.py). After every trial: every rank restores the same
step, bit for bit, from a copy that was published; a step published on both tiers by every rank
is never lost (the restore is at least as new); no worker process, staging buffer or temporary
file of a published checkpoint is left; the trial ends within its bound.

``make test`` runs one trial per fault (seeds 0..8); ``make test-slow`` runs
``SOLOSAVE_SOAK_TRIALS`` (default 500) seeded trials; ``SOLOSAVE_SOAK_SEED`` moves the seeds.
"""

from __future__ import annotations

import os
import random
import time

import pytest

from tests.faults import soak_fns as S
from tests.support import run_ranks, run_ranks_tolerant

BOUND_S = 150.0  # one trial, both phases (a hang is a failure)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _damage(root: str, trial: dict) -> None:
    """The after-the-job faults: a data file of the newest published fast copy truncated or removed."""
    fast = f"{root}/fast"
    published = sorted(n for n in os.listdir(fast) if os.path.exists(f"{fast}/{n}/.metadata")) \
        if os.path.isdir(fast) else []
    if not published:
        return
    newest = f"{fast}/{published[-1]}"
    data = sorted(n for n in os.listdir(newest) if n.endswith(".distcp"))
    victim = f"{newest}/{data[trial['write'] % len(data)]}"
    if trial["fault"] == "truncate_fast":
        os.truncate(victim, os.path.getsize(victim) // 2)
    else:
        os.remove(victim)


def run_trial(root: str, seed: int) -> dict:
    trial = S.draw(seed)
    t0 = time.monotonic()
    before_shm = {n for n in os.listdir("/dev/shm") if n.startswith("solosave")} if os.path.isdir("/dev/shm") else set()
    res = run_ranks_tolerant(S.job, 2, root, seed, timeout=BOUND_S)
    assert all(kind in ("ok", "died") for kind, _ in res.values()), (trial, res)
    assert all(kind == "ok" for r, (kind, _) in res.items() if not (trial["fault"] == "kill_rank"
                                                                   and r == trial["victim"])), (trial, res)
    pids = [int(open(f"{root}/pids/{r}").read()) for r in range(2) if os.path.exists(f"{root}/pids/{r}")]
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), (trial, "a worker process outlived its job")
    if trial["fault"] in ("truncate_fast", "remove_fast"):
        _damage(root, trial)
    out = run_ranks(S.restore, 2, root, timeout=BOUND_S)
    assert out[0]["point"] == out[1]["point"], (trial, out)  # every rank restores the same step
    done = [v for kind, v in res.values() if kind == "ok"]
    on_both = set.intersection(*(set(v["fast"]) & set(v["durable"]) for v in done)) if done else set()
    if trial["fault"] != "kill_rank" and on_both:  # a step every rank saw published on both tiers
        assert out[0]["point"] is not None and out[0]["point"] >= max(on_both), (trial, res, out)
    for o in out:
        if o["point"] is not None:
            assert os.path.exists(os.path.join(o["loaded"], ".metadata")), (trial, o)  # published
            assert not [n for n in os.listdir(o["loaded"]) if n.endswith(".tmp") or ".tmp." in n], (trial, o)
    after_shm = {n for n in os.listdir("/dev/shm") if n.startswith("solosave")} if os.path.isdir("/dev/shm") else set()
    assert after_shm <= before_shm, (trial, "a staging buffer was left in /dev/shm", after_shm - before_shm)
    assert time.monotonic() - t0 < 2 * BOUND_S
    seen = sorted({v["error"].split(":")[0] for kind, v in res.values() if kind == "ok" and v["error"]}
                  | {f"rank {r} died" for r, (kind, _) in res.items() if kind == "died"})
    return {"trial": trial, "point": out[0]["point"], "seen": seen,
            "published": sorted(set.intersection(*(set(v["fast"]) for v in done))) if done else []}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed", range(len(S.FAULTS)))
def test_one_trial_per_fault(tmp_path, seed, case_log):
    t0 = time.monotonic()
    got = run_trial(str(tmp_path), seed)
    case_log(f"fault soak: {got['trial']['fault']} (seed {seed}: rank {got['trial']['victim']}, "
             f"step {got['trial']['step']})",
             f"job saw {', '.join(got['seen']) or 'no error'}; published on the fast tier: {got['published']}; "
             f"restored step {got['point']} bit for bit on every rank; nothing left behind", time.monotonic() - t0)


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_randomized_fault_soak(tmp_path, case_log):
    trials = int(os.environ.get("SOLOSAVE_SOAK_TRIALS", "500"))
    base = int(os.environ.get("SOLOSAVE_SOAK_SEED", str(random.randrange(1 << 30))))
    t0 = time.monotonic()
    faults: dict[str, int] = {}
    for k in range(trials):
        root = str(tmp_path / f"t{k}")
        got = run_trial(root, len(S.FAULTS) + base + k)  # seeds past the fixed ones: random faults
        faults[got["trial"]["fault"]] = faults.get(got["trial"]["fault"], 0) + 1
    case_log(f"fault soak: {trials} random trials (seeds {base + len(S.FAULTS)}..)",
             f"{trials} of {trials} passed; faults drawn: {dict(sorted(faults.items()))}", time.monotonic() - t0)
