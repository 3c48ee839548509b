"""solosave.integrations: flags, validation, finding the newest published checkpoint, pruning."""

import argparse
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from solosave import integrations as it


def parse(*argv):
    p = argparse.ArgumentParser()
    it.add_checkpoint_args(p)
    return p.parse_args([str(a) for a in argv])


def make_ckpt(save_dir, step, published=True):
    d = it.checkpoint_dir(save_dir, step)
    dcp.save({"step": step, "w": torch.full((2,), float(step))}, checkpoint_id=d, no_dist=True)
    if not published:
        os.remove(os.path.join(d, ".metadata"))
    return d


def test_megatron_flag_names_and_defaults():
    a = parse("--save", "s", "--save-interval", 5, "--async-save", "--use-persistent-ckpt-worker",
              "--ckpt-metadata", "p.md", "--ckpt-metadata-create", "--ckpt-assume-constant-structure",
              "--dist-ckpt-workers", 2, "--keep-last", 3, "--load", "s")
    assert (a.save, a.save_interval, a.async_save, a.persistent_worker, a.prepared_metadata,
            a.create_prepared_metadata, a.assume_constant_structure, a.workers,
            a.keep_last, a.load) == ("s", 5, True, True, "p.md", True, True, 2, 3, "s")
    d = parse()
    assert not d.async_save and d.workers == 1 and d.prepared_metadata is None
    assert not d.persistent_worker  # Megatron's flags are opt-in; the API's default is True
    assert d.on_layout_drift == "fallback" and d.timeout == 600.0
    it.validate_checkpoint_args(d)
    it.validate_checkpoint_args(parse("--save", "s", "--ckpt-metadata", "p.md"))  # no constant-structure needed


@pytest.mark.parametrize("argv, needle", [
    (["--ckpt-metadata-create"], "--ckpt-metadata-create needs --ckpt-metadata naming the file"),
    (["--ckpt-on-layout-drift", "ignore"], "invalid choice"),
    (["--ckpt-timeout", "0"], "--ckpt-timeout must be a positive number"),
    (["--save", "s", "--ckpt-metadata", "auto", "--ckpt-metadata-create"], "drop --ckpt-metadata-create"),
    (["--ckpt-metadata", "auto"], "add --save"),
    (["--save", "s", "--save-interval", "0"], "--save-interval must be >= 1"),
    (["--save-interval", "3"], "needs --save"),
    (["--save", "s", "--keep-last", "0"], "--keep-last must be >= 1"),
    (["--dist-ckpt-workers", "0"], "--dist-ckpt-workers must be >= 1"),
])
def test_bad_flag_combinations_name_the_fix(argv, needle, capsys):
    try:
        args = parse(*argv)
    except SystemExit:  # argparse refuses it itself (choices)
        assert needle in capsys.readouterr().err
        return
    with pytest.raises(ValueError, match=needle.replace("-", r"\-")):
        it.validate_checkpoint_args(args)


def test_latest_ignores_partial_and_foreign_dirs(tmp_path):
    assert it.find_latest_checkpoint(tmp_path / "none") is None
    assert it.find_latest_checkpoint(None) is None
    make_ckpt(tmp_path, 10)
    make_ckpt(tmp_path, 20)
    make_ckpt(tmp_path, 30, published=False)
    os.makedirs(tmp_path / "iter_junk")
    (tmp_path / "latest").write_text("iter_0000099\n")  # a stale marker does not hide the listing
    assert it.find_latest_checkpoint(tmp_path) == (20, it.checkpoint_dir(tmp_path, 20))
    assert [s for s, _ in it.published_checkpoints(tmp_path)] == [10, 20]


class FakeResult:
    def __init__(self, published):
        self.published = published


class FakeHandle:
    def __init__(self, path, error=None):
        self.path = path
        self._error = error

    def done(self):
        return True

    def wait(self, timeout=None):
        if self._error:
            raise self._error
        return FakeResult(True)


class FakeCheckpointer:
    """Stands in for AsyncCheckpointer: 'publishes' by writing a DCP checkpoint synchronously."""

    rank = 0

    def __init__(self, fail_steps=()):
        self.fail_steps = set(fail_steps)
        self.closed = False

    def save(self, state_dict, path, overwrite=False):
        from solosave import CheckpointError

        step = state_dict["step"]
        if step in self.fail_steps:
            os.makedirs(path, exist_ok=True)  # partial: data without .metadata
            return FakeHandle(path, CheckpointError("boom", {1: "OSError: EIO"}))
        dcp.save(state_dict, checkpoint_id=path, no_dist=True)
        return FakeHandle(path)

    def close(self):
        self.closed = True


def test_manager_moves_latest_only_after_publication_and_prunes(tmp_path):
    seen = []
    m = it.CheckpointManager(tmp_path, FakeCheckpointer(fail_steps={4}), keep_last=2, on_done=seen.append)
    for step in (1, 2, 3):
        m.save(step, {"step": step})
        m.poll()
    assert it.read_latest_marker(tmp_path) == "iter_0000003"
    assert [s for s, _ in it.published_checkpoints(tmp_path)] == [2, 3]
    m.save(4, {"step": 4})  # fails: latest stays, nothing newer is pruned, old good ones are kept
    m.finish()
    assert it.read_latest_marker(tmp_path) == "iter_0000003"
    assert [s for s, _ in it.published_checkpoints(tmp_path)] == [2, 3]
    assert [d.step for d in m.failures] == [4] and m.checkpointer.closed
    assert [d.step for d in seen] == [1, 2, 3, 4]


def test_keep_last_one_never_deletes_the_newest_good(tmp_path):
    m = it.CheckpointManager(tmp_path, FakeCheckpointer(fail_steps={3}), keep_last=1)
    for step in (1, 2, 3):
        m.save(step, {"step": step})
    m.finish()
    assert [s for s, _ in it.published_checkpoints(tmp_path)] == [2]
    assert os.path.isdir(it.checkpoint_dir(tmp_path, 3))  # the failed, newer one is left for inspection


def test_existing_checkpoint_is_not_overwritten_by_default(tmp_path):
    from solosave import CheckpointExistsError

    class Refusing(FakeCheckpointer):
        def save(self, state_dict, path, overwrite=False):
            if os.path.exists(os.path.join(path, ".metadata")) and not overwrite:
                raise CheckpointExistsError(path)
            return super().save(state_dict, path, overwrite)

    make_ckpt(tmp_path, 5)
    m = it.CheckpointManager(tmp_path, Refusing())
    with pytest.raises(CheckpointExistsError):
        m.save(5, {"step": 5})
