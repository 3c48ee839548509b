"""solosave.save / async_save as a drop-in for DCP's: DCP's return types, one checkpointer per
process group kept until close(), steady saves of one 8-byte all_reduce, errors on every rank."""

import os

import pytest

from tests.multiproc import dropin_fns
from tests.support import run_ranks

pytestmark = pytest.mark.timeout(300)

ONE_ALL_REDUCE = {"all_reduce": {"count": 1, "bytes": 8}}


def test_async_save_and_save_as_a_dcp_user_would(tmp_path):
    for out in run_ranks(dropin_fns.as_dcp_user, 2, str(tmp_path)):
        assert out["modes"] == ["create", "reuse", "reuse"]
        assert out["collectives"][1] == out["collectives"][2] == ONE_ALL_REDUCE
        assert out["one_worker"] and out["mode_sync"] == "reuse"
        assert out["mode_after_close"] == "create"  # a new checkpointer after close()
    assert not os.path.exists(tmp_path / "step_0" / ".metadata.tmp")


def test_overlap_staging_returns_dcps_async_save_response(tmp_path):
    assert run_ranks(dropin_fns.overlapped_response, 2, str(tmp_path)) == [["meta.lr", "meta.name"]] * 2


def test_a_failing_rank_fails_the_future_on_every_rank(tmp_path):
    out = run_ranks(dropin_fns.failed_save_on_every_rank, 2, str(tmp_path))
    assert out[0] == "future: CheckpointError" and out[1].startswith("raised:") and "meta.bad" in out[1]
    assert not os.path.exists(tmp_path / "c" / ".metadata")


def test_each_save_returns_its_own_metadata_without_reading_it_back(tmp_path):
    """Was: the save read <checkpoint_id>/.metadata back, which another rank's next save to the
    same id may already have removed (FileNotFoundError for a published save) or replaced."""
    out = run_ranks(dropin_fns.same_id_again_and_again, 2, str(tmp_path))
    assert out[0]["ids"] == out[1]["ids"] and len(set(out[0]["ids"])) == 6  # one save_id per save, alike
    assert all(o["on_disk"] == o["ids"][-1] and o["same_entries"] for o in out)
