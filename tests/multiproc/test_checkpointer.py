"""Multi-process tests of the core saver (gloo on 127.0.0.1, world sizes 2 and 4)."""

import glob
import os
import pickle
from collections import Counter

import pytest

from tests.multiproc import rank_fns
from tests.support import run_ranks

pytestmark = pytest.mark.timeout(240)
HERE = os.path.dirname(__file__)


@pytest.mark.parametrize("persistent", [True, False])
def test_roundtrip_every_kind_of_item(tmp_path, persistent):
    out = run_ranks(rank_fns.roundtrip_all_kinds, 2, str(tmp_path), persistent)
    assert all(mode == "collective" for _, mode in out)
    assert all(n > 0 for n, _ in out)  # replicated state is spread: every rank wrote something
    if persistent:
        _check_replicated_items_written_once(tmp_path)


def _check_replicated_items_written_once(tmp_path):
    with open(tmp_path / "c1" / ".metadata", "rb") as f:
        md = pickle.load(f)
    # each item appears once in storage_data; the 2 replicas of a plain tensor are not both written
    keys = [k.fqn for k in md.storage_data]
    assert keys.count("base.model.w") == 1
    spans = sorted((v.relative_path, v.offset, v.offset + v.length) for v in md.storage_data.values())
    for (f1, _, e1), (f2, s2, _) in zip(spans, spans[1:]):
        assert f1 != f2 or s2 >= e1  # no overlapping records
    total = sum(os.path.getsize(p) for p in glob.glob(str(tmp_path / "c1" / "*.distcp")))
    assert total == sum(v.length for v in md.storage_data.values())


def test_save_at_4_load_at_2_and_stock_reader(tmp_path):
    files = run_ranks(rank_fns.reshard_save, 4, str(tmp_path), 3)
    assert files[0] == [".metadata", ".solosave-index"] + [f"__{r}_{n}.distcp" for r in range(4) for n in range(2)]
    assert run_ranks(rank_fns.reshard_load, 2, str(tmp_path), 3) == [True, True]


def test_snapshot_semantics_worker_reuse_and_layout_determinism(tmp_path):
    out = run_ranks(rank_fns.snapshot_and_worker_reuse, 2, str(tmp_path))
    for pids, alive, same_layout in out:
        assert len(set(pids)) == 1 and pids[0] != os.getpid()
        assert alive == [True]
        assert same_layout
    assert out[0][0][0] != out[1][0][0]



def test_bad_input_is_refused_without_damage(tmp_path):
    out = run_ranks(rank_fns.bad_input, 2, str(tmp_path))
    for e in out:
        assert "already holds a complete checkpoint" in e["exists"] and "overwrite=True" in e["exists"]
        assert "to_dense" in e["sparse"]
        assert "not a directory" in e["notdir"]
        assert "longer than 255 bytes" in e["long"]
        assert e["overwritten"] == [3.0, 3.0]


def _counted(tmp_path, monkeypatch, mode, saves, ws=2):
    log = tmp_path / "log"
    log.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.path.join(HERE, "wrap_dist") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("SOLOSAVE_TEST_COLLECTIVE_LOG", str(log))
    # fresh interpreters: the counting sitecustomize applies to the trainers too
    per_rank = run_ranks(rank_fns.count_saves, ws, str(tmp_path / "ck"), mode, saves, fresh=True)
    observed = {"worker": Counter(), "trainer": Counter()}
    threads = Counter()
    for p in glob.glob(str(log / "*.log")):
        for line in open(p):
            proc, thread, kind = line.rstrip("\n").split("\t")
            role = "worker" if proc.startswith("solosave-worker") else "trainer"
            observed[role][kind] += 1
            threads[(role, thread)] += 1
    return per_rank, observed


def test_collective_counts_match_torch_distributed(tmp_path, monkeypatch):
    saves = 3
    per_rank, observed = _counted(tmp_path, monkeypatch, "collective", saves)
    reported = Counter()
    for rank_saves in per_rank:
        for s in rank_saves:
            assert s["calling"] == {}
            for kind, d in s["reported"].items():
                reported[kind] += d["count"]
    # every collective the workers performed is one solosave reported, and vice versa
    assert observed["worker"] == reported
    assert reported == Counter({"gather_object": 2 * 2 * saves, "scatter_object_list": 2 * saves,
                                "broadcast_object_list": 2 * saves})
    # trainers: at set-up one 8-byte all_reduce (every rank could read its prepared metadata) and
    # one broadcast each, and the test's own barriers; nothing per save from solosave
    assert observed["trainer"]["broadcast_object_list"] == 2 and observed["trainer"]["all_reduce"] == 2
    assert set(observed["trainer"]) <= {"broadcast_object_list", "all_reduce", "barrier"}


def test_seam_d1_a_foreach_optimizer_step_on_dtensors_cannot_tear_an_overlapped_save(tmp_path, case_log):
    out = run_ranks(rank_fns.dtensor_foreach_step_during_overlapped_staging, 1, str(tmp_path))[0]
    assert out["stepped"] is True
    assert out["a_holds_the_call"] is True  # the optimizer's step pre-hook waited for the copy
    assert out["b_race"] is not None and "wait_staged" in out["b_race"], out
    assert out["b_published"] is False
    case_log("overlap_staging with DTensor state: SGD(foreach=True).step() right after save(), no "
             "wait_staged(), the copy held back 0.5 s (D1)",
             "the optimizer's step pre-hook waited for the copy: the checkpoint holds the values of the "
             "call; an in-place add_ on the DTensor before wait_staged() is a StagingRaceError, the save "
             "publishes nothing")


def test_thread_mode_on_a_subgroup_under_a_device_bound_world_is_refused(tmp_path):
    out = run_ranks(rank_fns.thread_mode_subgroup_under_a_bound_device, 2, str(tmp_path))
    assert "worker='process'" in out[0] and "device_id" in out[0], out[0]


def test_overlapped_staging_keeps_the_values_of_the_call_and_fails_a_raced_save(tmp_path, case_log):
    out = run_ranks(rank_fns.overlap_staging, 2, str(tmp_path))
    for r in out:
        assert r["modes"] == ["create", "reuse", "reuse"]
        assert "staging failed on this rank" in r["failed"] and "rank 1" in r["failed"], r["failed"]
        assert r["published"] is False and r["after"] == "reuse"
    assert "wait_staged" in out[1]["race"] and "race" not in out[0]
    case_log("overlap_staging: rank 1 changes a saved tensor in place before wait_staged() and "
             "before its copy is done", "StagingRaceError from wait_staged() on rank 1; the save fails on "
             "both ranks naming rank 1, no .metadata; the next save reuses and publishes")


@pytest.mark.parametrize("persistent", [True, False])
def test_a_failed_hand_over_is_raised_and_never_waited_for(tmp_path, persistent):
    """A save whose job never reached the worker (its hand-over raised) raises from ``save()``;
    the next save and ``close()`` do not wait the checkpointer's timeout (120 s) for it."""
    (out,) = run_ranks(rank_fns.submit_fails, 1, str(tmp_path), persistent, timeout=200)
    assert out["raised"] == "hand-over refused"
    assert out["next_save_mode"] == "collective"
    assert out["next_save_s"] < 60 and out["close_s"] < 60, out
