"""Two tiers (issue 33): every save is published on the fast tier as before, then copied to the
durable root in the background and published there once every rank's copy succeeded; a failed
or killed copy never unpublishes the fast copy and the next copy succeeds (gloo on 127.0.0.1)."""

import time

import pytest

from tests.multiproc import tier_fns
from tests.support import run_ranks, run_ranks_tolerant

pytestmark = pytest.mark.timeout(240)
TIMEOUT = 30.0


def test_copies_follow_publication_and_add_one_all_reduce(tmp_path):
    out = run_ranks(tier_fns.copy_and_count, 2, str(tmp_path), TIMEOUT, timeout=200)
    for o in out:
        assert o["modes"] == ["create", "reuse", "reuse"]
        # the fast part of a steady save is unchanged: one 8-byte all_reduce
        assert o["fast"][1] == o["fast"][2] == {"all_reduce": {"count": 1, "bytes": 8}}
        # the durable stage adds two 8-byte all_reduces (on its own channel) per copy: the choice
        # of the copy (copies that fall behind are coalesced) and its status word
        assert [d["calls"] for d in o["durable"]] == [[("all_reduce", 8), ("all_reduce", 8)]] * 3
        assert all(d["ok"] and d["error"] is None for d in o["durable"])
        assert [d["path"] for d in o["durable"]] == [str(tmp_path / "durable" / f"iter_{s}") for s in range(3)]
        assert o["pending_while_next_published"]  # the next save's publication did not wait for the copy
        assert o["equal"] and o["fast_loads"] and o["durable_loads"] and o["index_ok"]
        assert o["checkpoint_id"] == str(tmp_path / "durable" / "iter_2")


@pytest.mark.parametrize("persistent", [True, False])
def test_a_failed_copy_is_reported_on_every_rank_and_the_next_copy_succeeds(tmp_path, persistent):
    out = run_ranks(tier_fns.failed_copy, 2, str(tmp_path), TIMEOUT, persistent, timeout=200)
    for o in out:
        assert all(o[s]["published"] for s in range(3))  # the fast tier: every save published
        assert o[0]["ok"] and o[2]["ok"] and not o[1]["ok"], (o[0]["error"], o[1]["error"], o[2]["error"])
        assert o[1]["failures"] == [1] and "injected: the durable storage failed" in o[1]["error"]
        # the choice of the copy, then per try (one retry) its status word; the errors travel on failure only
        assert o[1]["calls"] == ["all_reduce"] + ["all_reduce", "all_gather_object"] * 2 and o[1]["attempts"] == 2
        assert o["fast_1_loads"] and not o["durable_1_published"] and o["durable_2_loads"]
    assert out[0][1]["error"] == out[1][1]["error"]


def test_worker_killed_mid_copy_leaves_the_fast_copy_and_the_next_copy_succeeds(tmp_path, case_log):
    victim = 1
    t0 = time.monotonic()
    res = run_ranks_tolerant(tier_fns.killed_mid_copy, 2, str(tmp_path), victim, TIMEOUT, timeout=220)
    bad = {r: v for r, v in res.items() if v[0] != "ok"}
    assert not bad, bad
    out = {r: v[1] for r, v in res.items()}
    for r, o in out.items():
        assert o["copy_0"] and o["fast_1"] and o["fast_1_loads"]
        assert not o["copy_1"]["ok"] and o["copy_1"]["after_s"] < TIMEOUT + 10, o["copy_1"]
        assert not o["durable_1_published"]
        assert o["copy_2"] == {"ok": True, "error": None} and o["durable_2_loads"]
    assert "worker died" in out[victim]["copy_1"]["error"]
    assert "durable channel failed" in out[0]["copy_1"]["error"]
    case_log("two tiers: worker SIGKILLed mid-copy to the durable tier (ws=2, rank 1)",
             f"the fast copy stays published and loads; no durable .metadata; every rank's copy result "
             f"failed within {max(o['copy_1']['after_s'] for o in out.values())} s; after recreating the "
             "checkpointers the next save's durable copy succeeds and loads", time.monotonic() - t0)


def test_every_rank_restores_from_the_same_tier_bit_exactly(tmp_path):
    out = run_ranks(tier_fns.restore_tiers, 2, str(tmp_path), TIMEOUT, timeout=220)
    fast, durable = str(tmp_path / "fast"), str(tmp_path / "durable")
    for o in out:
        assert o["copies"] == [(1, True), (2, True), (3, False)]
        # the newest step is on the fast tier only: restored from there
        assert o["whole"] == {"point": (3, f"{fast}/iter_0000003"), "load": f"{fast}/iter_0000003", "exact": True}
        assert o["whole_2"]["load"] == f"{fast}/iter_0000002" and o["whole_2"]["exact"]
        # one rank misses its shard on its fast tier: every rank reads the durable copy
        assert o["one_rank_missing"]["load"] == f"{durable}/iter_0000002" and o["one_rank_missing"]["exact"]
        assert o["one_rank_missing"]["point"] == (2, f"{durable}/iter_0000002")
        # step 3 is complete nowhere for every rank: the newest restorable is step 2, from durable
        assert o["one_rank_missing_3"] == (2, f"{durable}/iter_0000002")
        assert o["fast_gone"] == {"point": (2, f"{durable}/iter_0000002"), "load": f"{durable}/iter_0000002",
                                  "exact": True}
        assert o["manager"] == (2, f"{durable}/iter_0000002")
    assert out[0] == out[1]


def test_peer_copy_on_a_shared_fast_tier_sends_no_file(tmp_path):
    out = run_ranks(tier_fns.peer_copy_shared_tier, 4, str(tmp_path), TIMEOUT, timeout=220)
    for o in out:
        assert o["ranks_per_host"] == 2
        for s in (0, 1):
            assert o[s]["published"] and o[s]["ok"] and o[s]["peer_ok"] and o[s]["peer_error"] is None, o[s]
            assert o[s]["calls"] == ["all_reduce", "recv", "send"], o[s]
            assert o[s]["sent"] < 1000, o[s]  # the flag, the header and the trailer: no file's bytes
        assert o["loads"] and o["equal"] and o["leftovers"] == []
        assert "not with peer copies" in o["overwrite"], o["overwrite"]


def test_a_durable_root_that_reaches_the_fast_checkpoint_is_refused(tmp_path, case_log):
    """Was data loss: the copy removed the fast .metadata and truncated each data file it read."""
    t0 = time.monotonic()
    out = run_ranks(tier_fns.durable_root_reaching_fast, 2, str(tmp_path), TIMEOUT, timeout=200)
    for o in out:
        assert len(o["errors"]) == 4 and all("would be the checkpoint itself" in e for e in o["errors"]), o["errors"]
        assert o["loads"]
    case_log("two tiers: durable_root reaching the fast checkpoint (a symlink, a '..' path, the parent itself, "
             "and through the DCP drop-in) with overwrite=True",
             "refused on every rank before anything is written ('would be the checkpoint itself'); the fast "
             "checkpoint still loads bit for bit", time.monotonic() - t0)


def test_a_stale_or_damaged_fast_copy_is_never_mixed_in_the_durable_copy_is_read(tmp_path, case_log):
    """Was: ranks agreed on the step and name only, so one rank restored another job's step 10
    from its fast tier; and a truncated fast copy was chosen, failing the load, though a
    complete durable copy existed."""
    t0 = time.monotonic()
    out = run_ranks(tier_fns.stale_and_damaged_fast_copies, 2, str(tmp_path), TIMEOUT, timeout=200)
    want = str(tmp_path / "durable" / "iter_0000010")
    for o in out:
        for label in ("other_job_on_one_host", "truncated", "truncated_no_index"):
            assert o[label]["load"] == want, (label, o[label])
        assert o["other_job_on_one_host"]["point"] == (10, want)
        assert o["truncated"]["point"] == (10, want)
    case_log("two tiers: one host's fast tier holds another job's iter_0000010; a fast copy with a truncated "
             "data file (with and without its load index)",
             "every rank restores this job's step 10 from the durable copy, bit for bit (identity agreed by "
             "save_id; sizes checked against the index; a load error falls back on every rank)",
             time.monotonic() - t0)


def test_a_stalled_durable_store_never_holds_up_a_save_and_the_newest_copy_follows(tmp_path, case_log):
    """Was: with two copies pending, the next save waited for the oldest (a stalled store
    throttled the fast tier). Now copies that fall behind are coalesced, the latest wins."""
    saves = 6
    out = run_ranks(tier_fns.stalled_durable_tier, 2, str(tmp_path), TIMEOUT, saves, timeout=200)
    for o in out:
        assert o["gate_shut_after_saves"]  # every save published while the store was stalled
        # the fast tier does not fill up meanwhile: the copy still running (step 1) and keep_last=2
        assert o["fast_while_stalled"] == ["iter_0000001", f"iter_{saves - 1:07d}", f"iter_{saves:07d}"], o
        assert o["behind"] == list(range(saves)), o["behind"]  # the lag, reported: saves not yet durable
        assert all(a <= b for a, b in zip(o["lag_s"][1:], o["lag_s"][2:])) and o["lag_s"][-1] > 0
        steps = [s for s, _, _ in o["copies"]]
        assert steps == list(range(1, saves + 1)), o["copies"]  # each save's copy reported once, in order
        copied = [s for s, ok, _ in o["copies"] if ok]
        assert copied[0] == 1 and copied[-1] == saves and len(copied) <= 3, o["copies"]  # 1, perhaps 2, the newest
        assert all(sup for s, ok, sup in o["copies"] if not ok) and not o["failures"]  # coalesced, not failed
        assert o["latest"] == f"iter_{saves:07d}" and o["newest_loads"]
    assert out[0]["copies"] == out[1]["copies"]
    case_log(f"two tiers, W=2: the durable store stalls (the first copy waits at a gate) during {saves} saves",
             f"all {saves} saves published on the fast tier while it was stalled (none waited), lag reported "
             f"{out[0]['behind']} saves behind; once it answered, copies {[s for s, ok, _ in out[0]['copies'] if ok]} "
             "ran (the others coalesced), the durable latest points at the newest, which loads bit for bit")


@pytest.mark.parametrize("case", ["durable_root", "durable_every_save", "durable_retries"])
def test_two_tier_settings_that_differ_between_ranks_are_refused_on_every_rank(tmp_path, case):
    out = run_ranks(tier_fns.mismatched_setup, 2, str(tmp_path), case, timeout=120)
    assert out[0] == out[1] and case.split("_")[0] in out[0] and "every rank" in out[0], out
    assert case in out[0] or case == "durable_root", out
