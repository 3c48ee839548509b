"""Multi-process tests of prepared-metadata create/reuse, the layout guard and the cache."""

from collections import Counter

import pytest

from tests.multiproc import rank_fns
from tests.multiproc.test_checkpointer import _counted
from tests.support import run_ranks

pytestmark = pytest.mark.timeout(300)

ONE_ALL_REDUCE = {"all_reduce": {"count": 1, "bytes": 8}}


@pytest.mark.parametrize("ws, workers", [(4, 2)])  # ws=2: tests/unit/engine/test_engine.py, test_train.py
def test_create_then_reuse_roundtrip(tmp_path, ws, workers):
    out = run_ranks(rank_fns.create_then_reuse, ws, str(tmp_path), workers)
    for modes, colls, ckpt_id, fresh_save_id, same_layout, _ in out:
        assert modes == ["create", "reuse", "reuse"]
        assert set(colls[0]) == {"gather_object", "scatter_object_list", "broadcast_object_list"}
        assert colls[0]["gather_object"]["count"] == 2 and colls[0]["broadcast_object_list"]["count"] == 1
        assert colls[1] == colls[2] == ONE_ALL_REDUCE
        assert ckpt_id == str(tmp_path / "c2")  # storage_meta names this checkpoint, not c0
        assert fresh_save_id and same_layout
    full = out[0][5]
    # the reuse checkpoint loads at another world size through stock DCP
    other = 2 if ws == 4 else 4
    loaded = run_ranks(rank_fns.load_dt_at, other, str(tmp_path), "c2")
    assert loaded[0] == full


def test_second_job_reuses_from_first_save(tmp_path):
    assert run_ranks(rank_fns.create_only, 2, str(tmp_path)) == ["create", "create"]
    res = run_ranks(rank_fns.second_job, 2, str(tmp_path))  # new processes, the file only
    for mode, colls in res:
        assert mode == "reuse" and colls == ONE_ALL_REDUCE


def test_drift_fallback_publishes_and_refreshes(tmp_path):
    out = run_ranks(rank_fns.drift, 2, str(tmp_path), "fallback")
    for o in out:
        assert o["mode"] == "reuse+fallback"
        assert o["metadata"] and o["refreshed"]
        assert o["warnings"] and "meta.sched" in o["warnings"][0]
        assert o["collectives"]["all_reduce"]["count"] == 1 and "gather_object" in o["collectives"]
        assert o["after"] == ("reuse", ONE_ALL_REDUCE)  # the refreshed layout is reused



def test_prepared_file_of_another_world_size_rejected_at_start(tmp_path):
    run_ranks(rank_fns.create_only, 2, str(tmp_path))
    msgs = run_ranks(rank_fns.mismatched_world, 4, str(tmp_path))
    assert all(m and "world_size differs: prepared for 2 ranks, this run has 4" in m for m in msgs)


def test_reuse_counts_one_all_reduce_in_every_process(tmp_path, monkeypatch):
    saves = 4
    per_rank, observed = _counted(tmp_path, monkeypatch, "reuse", saves)
    for rank_saves in per_rank:
        assert [s["mode"] for s in rank_saves] == ["create"] + ["reuse"] * (saves - 1)
        assert all(s["calling"] == {} for s in rank_saves)
        for s in rank_saves[1:]:
            assert s["reported"] == ONE_ALL_REDUCE
    # what torch.distributed saw in the workers: the create save's 4 collectives per rank, then
    # exactly one all_reduce per rank per reuse save
    assert observed["worker"] == Counter({"gather_object": 4, "scatter_object_list": 2,
                                          "broadcast_object_list": 2, "all_reduce": 2 * (saves - 1)})
    # the trainers: only the set-up all_reduce and broadcast (and the test's barriers)
    assert observed["trainer"]["all_reduce"] == 2 and observed["trainer"]["broadcast_object_list"] == 2
    assert set(observed["trainer"]) <= {"broadcast_object_list", "all_reduce", "barrier"}


def test_constant_structure_reuses_in_memory_after_the_first_save(tmp_path):
    saves = 4
    per_rank = run_ranks(rank_fns.count_saves, 2, str(tmp_path), "constant", saves,
                         env={"SOLOSAVE_TEST_COLLECTIVE_LOG": str(tmp_path)})
    for rank_saves in per_rank:
        assert [s["mode"] for s in rank_saves] == ["create"] + ["reuse"] * (saves - 1)
        for s in rank_saves[1:]:
            assert s["reported"] == ONE_ALL_REDUCE
    assert not (tmp_path / "prepared.metadata").exists()  # in memory only
