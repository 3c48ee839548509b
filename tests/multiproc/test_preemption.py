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
