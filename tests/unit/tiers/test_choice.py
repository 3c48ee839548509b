"""Two tiers, on one process: what "complete here" means, and which copy is chosen."""

import os
import shutil

import pytest
import torch

import solosave
from solosave._src.tiers.choice import choose_copy, choose_restore_point, complete_here
from solosave._src.tiers.paths import durable_copy_of
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


def _copy(src, dst):
    """The durable copy of ``src``: the same files (the same ``save_id``)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, dst)


def test_complete_here_needs_every_file_as_long_as_its_records(tmp_path):
    d = tmp_path / "iter_1"
    _ckpt(d, 1)
    data = next(n for n in os.listdir(d) if n.endswith(".distcp"))
    os.truncate(d / data, os.path.getsize(d / data) - 1)
    assert not complete_here(d)  # truncated: shorter than its last record's end (the index says)
    os.truncate(d / data, 0)
    assert not complete_here(d)


def test_the_identity_is_the_save_id_with_or_without_an_index(tmp_path):
    from solosave._src.tiers.choice import identity_here

    d = tmp_path / "iter_1"
    _ckpt(d, 1)
    with_index = identity_here(d)
    os.remove(d / ".solosave-index")
    assert with_index is not None and identity_here(d) == with_index
    assert identity_here(tmp_path / "nothing") is None


def test_a_fast_copy_of_another_checkpoint_is_not_taken(tmp_path):
    """Another job's checkpoint under the same name on the fast tier (another save_id than the
    published durable copy's): the durable copy is loaded."""
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    _ckpt(fast / "iter_1", 7)  # the other job's
    _ckpt(durable / "iter_1", 1)
    assert choose_copy(fast / "iter_1", durable) == str(durable / "iter_1")
    assert choose_restore_point([(1, str(fast / "iter_1"), str(durable / "iter_1"))]) == (1, str(durable / "iter_1"))
    sd = {"w": torch.zeros(4, 4)}
    assert solosave.load(sd, fast / "iter_1", durable_root=durable) == str(durable / "iter_1")
    assert torch.equal(sd["w"], torch.ones(4, 4))


def test_the_fast_copy_when_complete_else_the_durable_one(tmp_path):
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    _ckpt(fast / "iter_1", 1)
    _copy(fast / "iter_1", durable / "iter_1")
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
        _copy(fast / f"iter_{s}", durable / f"iter_{s}")
    os.remove(fast / "iter_3" / ".metadata")  # a partial fast copy, never copied: not restorable
    os.remove(fast / "iter_2" / ".metadata")
    cands = [(s, str(fast / f"iter_{s}"), str(durable / f"iter_{s}") if s < 3 else None) for s in (1, 2, 3)]
    assert choose_restore_point(cands) == (2, str(durable / "iter_2"))
    assert choose_restore_point([(1, str(fast / "iter_1"), str(durable / "iter_1"))]) == (1, str(fast / "iter_1"))
    assert choose_restore_point([]) is None


def test_ranks_that_load_different_checkpoints_are_told(monkeypatch):
    from solosave._src.tiers import choice as tiers

    monkeypatch.setattr(tiers, "_agree", lambda *a: None)  # what a mismatched word decodes to
    with pytest.raises(ValueError, match="the ranks load different checkpoints"):
        choose_copy("/x/iter_1", "/y")
