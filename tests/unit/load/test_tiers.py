"""Two tiers, on one process: what "complete here" means, and which copy is chosen."""

import os
import shutil

import pytest
import torch

import solosave
from solosave._src.load.tiers import choose_copy, choose_restore_point, complete_here, durable_copy_of
from tests.support import dcp_save_local, publish_with_index


def _ckpt(path, value):
    dcp_save_local({"w": torch.full((4, 4), float(value))}, checkpoint_id=str(path))
    publish_with_index(path)


def test_complete_here_needs_metadata_and_every_file_the_index_names(tmp_path):
    d = tmp_path / "iter_1"
    _ckpt(d, 1)
    assert complete_here(d)
    data = next(n for n in os.listdir(d) if n.endswith(".distcp"))
    os.rename(d / data, tmp_path / "moved")
    assert not complete_here(d)  # a data file the index names is missing
    os.rename(tmp_path / "moved", d / data)
    os.remove(d / ".solosave-index")
    assert complete_here(d)  # no index: .metadata decides
    os.remove(d / ".metadata")
    assert not complete_here(d) and not complete_here(tmp_path / "nothing")


def test_the_fast_copy_when_complete_else_the_durable_one(tmp_path):
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    _ckpt(fast / "iter_1", 1)
    _ckpt(durable / "iter_1", 1)
    assert durable_copy_of(fast / "iter_1", durable) == str(durable / "iter_1")
    assert choose_copy(fast / "iter_1", durable) == str(fast / "iter_1")
    shutil.rmtree(fast)
    assert choose_copy(fast / "iter_1", durable) == str(durable / "iter_1")
    sd = {"w": torch.zeros(4, 4)}
    assert solosave.load(sd, fast / "iter_1", durable_root=durable) == str(durable / "iter_1")
    assert torch.equal(sd["w"], torch.ones(4, 4))


def test_the_newest_restorable_step_wins(tmp_path):
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    for s in (1, 2, 3):
        _ckpt(fast / f"iter_{s}", s)
    for s in (1, 2):
        _ckpt(durable / f"iter_{s}", s)
    os.remove(fast / "iter_3" / ".metadata")  # a partial fast copy, never copied: not restorable
    os.remove(fast / "iter_2" / ".metadata")
    cands = [(s, str(fast / f"iter_{s}"), str(durable / f"iter_{s}") if s < 3 else None) for s in (1, 2, 3)]
    assert choose_restore_point(cands) == (2, str(durable / "iter_2"))
    assert choose_restore_point([(1, str(fast / "iter_1"), str(durable / "iter_1"))]) == (1, str(fast / "iter_1"))
    assert choose_restore_point([]) is None


def test_ranks_that_load_different_checkpoints_are_told(monkeypatch):
    from solosave._src.load import tiers

    monkeypatch.setattr(tiers, "_agree", lambda *a: None)  # what a mismatched word decodes to
    with pytest.raises(ValueError, match="the ranks load different checkpoints"):
        choose_copy("/x/iter_1", "/y")
