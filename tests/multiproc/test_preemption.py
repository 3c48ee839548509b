"""The preemption guard across processes (gloo on 127.0.0.1): a SIGTERM reaching one rank or
both, at any step, makes every rank save the same next step, publish it on both tiers, and stop;
a new job resumes there bit for bit."""

from __future__ import annotations

import shutil

import pytest

from tests.multiproc import preemption_fns
from tests.support import run_ranks, run_ranks_tolerant

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("victims,notice_step", [([1], 7), ([0, 1], 12), ([0], 10)],
                         ids=["rank1-between-saves", "both-ranks", "rank0-at-a-save-step"])
def test_a_sigterm_on_any_rank_saves_one_step_on_every_rank_then_stops(tmp_path, case_log, victims, notice_step):
    root = str(tmp_path)
    out = run_ranks(preemption_fns.guarded_loop, 2, root, victims, notice_step, None, timeout=240)
    stops = {r["stop"] for r in out}
    assert len(stops) == 1, out  # every rank at one step
    (stop,) = stops
    assert notice_step <= stop <= notice_step + 40, out  # soon after the notice (rounds every 20 ms)
    for rank, r in enumerate(out):
        step, reason, published, durable, error = r["outcome"]
        assert step == stop and published is True and durable is True and error is None, r
        assert (reason == "signal SIGTERM") == (rank in victims), r
        assert r["signals"] == (2 if rank in victims and stop >= notice_step + 3 else int(rank in victims)), r
        assert r["handler_back"], r  # close() put the default handler back
    assert out[0]["latest"] == [f"iter_{stop:07d}", f"iter_{stop:07d}"]  # both tiers point at it
    shutil.rmtree(tmp_path / "fast")  # the host is gone: the durable copy alone restores it
    for r in run_ranks(preemption_fns.resume, 2, root, True, timeout=200):
        assert r["step"] == stop and r["path"] == str(tmp_path / "durable" / f"iter_{stop:07d}"), r
    case_log(f"PreemptionGuard, 2 ranks, two tiers: SIGTERM to rank(s) {victims} after step {notice_step} "
             "(and a second one 3 steps later)",
             f"every rank saved step {stop} and stopped there; published on the fast and durable tiers, "
             "latest on both; a new job restored it bit for bit from the durable tier")


def test_exit_code_ends_every_rank_after_the_save(tmp_path):
    root = str(tmp_path)
    res = run_ranks_tolerant(preemption_fns.guarded_loop, 2, root, [1], 9, 17, timeout=240)
    # every rank ended by SystemExit(17) (the harness reports it with its traceback) after the save
    assert all(kind == "err" and val.rstrip().endswith("SystemExit: 17") for kind, val in res.values()), res
    out = run_ranks(preemption_fns.resume, 2, root, False, timeout=200)
    assert {r["step"] for r in out} == {out[0]["step"]} and out[0]["step"] >= 9


# -- the random soak: SIGTERM at random moments, perhaps SIGKILL a random time later ----------
def _soak_trial(tmp_path, seed):
    root = tmp_path / f"t{seed}"
    root.mkdir()
    trial = preemption_fns.draw(seed)
    res = run_ranks_tolerant(preemption_fns.soak_job, 2, str(root), seed, timeout=150)
    kinds = {kind for kind, _ in res.values()}
    assert kinds <= {"ok", "died"} and (kinds == {"ok"} or trial["kill_after"] is not None), (trial, res)
    stops = {val["stop"] for kind, val in res.values() if kind == "ok"}
    assert len(stops) <= 1, (trial, res)  # ranks that ended normally stopped at one step
    published = sorted(int(p.name[5:]) for p in (root / "fast").glob("iter_*") if (p / ".metadata").exists())
    out = run_ranks(preemption_fns.resume, 2, str(root), False, timeout=150)  # bit-exact, or it raises
    restored = out[0]["step"]
    assert {o["step"] for o in out} == {restored}, (trial, out)
    if kinds == {"ok"}:  # the guard's save ended on every rank: it is the one restored, never an older one
        (stop,) = stops
        assert restored == stop and stop >= trial["notice_step"], (trial, restored, stops)
    else:  # the job was killed: the newest step published on the fast tier, whole (none: nothing)
        assert restored == (published[-1] if published else None), (trial, restored, published)
    return trial, restored


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_preemption_at_random_moments_resumes_at_the_guards_step_or_the_newest_published(tmp_path, seed):
    _soak_trial(tmp_path, seed)


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_preemption_soak(tmp_path, case_log):
    """``SOLOSAVE_PREEMPT_TRIALS`` (default 200; about 5 s each here) seeded trials from
    ``SOLOSAVE_PREEMPT_SEED``."""
    import os
    import time

    n = int(os.environ.get("SOLOSAVE_PREEMPT_TRIALS", "200"))
    first = int(os.environ.get("SOLOSAVE_PREEMPT_SEED", "100"))
    t0, killed = time.monotonic(), 0
    for seed in range(first, first + n):
        trial, _ = _soak_trial(tmp_path, seed)
        killed += trial["kill_after"] is not None
        shutil.rmtree(tmp_path / f"t{seed}")
    case_log(f"preemption soak: {n} random trials (2 ranks, two tiers, SIGTERM to rank 0, 1 or both at a random "
             f"moment of a random step, a second SIGTERM; in {killed} of them every rank SIGKILLed 0-0.6 s later)",
             f"{n} of {n} passed: each resumed bit for bit at the guard's step (or, killed, the newest published "
             "step); no torn checkpoint", time.monotonic() - t0)
