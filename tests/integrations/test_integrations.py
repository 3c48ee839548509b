"""solosave.integrations: flags, validation, finding the newest published checkpoint, pruning."""

import argparse
import logging
import os
import threading

import pytest
import torch

from solosave import integrations as it
from solosave._src.tools.retention import remove_checkpoint
from tests.support import dcp_save_local


def parse(*argv):
    p = argparse.ArgumentParser()
    it.add_checkpoint_args(p)
    return p.parse_args([str(a) for a in argv])


def make_ckpt(save_dir, step, published=True):
    d = it.checkpoint_dir(save_dir, step)
    dcp_save_local({"step": step, "w": torch.full((2,), float(step))}, checkpoint_id=d)
    if not published:
        os.remove(os.path.join(d, ".metadata"))
    return d


def test_megatron_flag_names_and_defaults():
    a = parse("--save", "s", "--save-interval", 5, "--async-save", "--use-persistent-ckpt-worker",
              "--ckpt-metadata", "p.md", "--ckpt-metadata-create", "--ckpt-assume-constant-structure",
              "--dist-ckpt-workers", 2, "--keep-last", 3, "--keep-every", 10, "--load", "s")
    assert (a.save, a.save_interval, a.async_save, a.worker, a.prepared_metadata,
            a.create_prepared_metadata, a.assume_constant_structure, a.files_per_rank,
            a.keep_last, a.keep_every, a.load) == ("s", 5, True, "process", "p.md", True, True, 2, 3, 10, "s")
    d = parse()
    assert not d.async_save and d.files_per_rank == 1 and d.prepared_metadata is None and d.keep_every is None
    assert d.worker == "thread"  # Megatron's flags are opt-in; the API's default is "process"
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
    (["--save", "s", "--keep-last", "2", "--keep-every", "0"], "--keep-every must be >= 1"),
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
        dcp_save_local(state_dict, checkpoint_id=path)
        return FakeHandle(path)

    def close(self):
        self.closed = True


def test_manager_moves_latest_only_after_publication_and_prunes(tmp_path):
    seen = []
    m = it.CheckpointManager(tmp_path, FakeCheckpointer(fail_steps={4}), keep_last=2, on_done=seen.append)
    for step in (1, 2, 3):
        m.save(step, {"step": step})
        m.poll()
    assert m.wait_for_pruning(timeout=30)
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


def names(paths):
    return [os.path.basename(p) for p in paths]


def published_steps(save_dir):
    return [s for s, _ in it.published_checkpoints(save_dir)]


def test_prunable_never_the_newest_published_nor_newer_ones(tmp_path):
    make_ckpt(tmp_path, 0, published=False)  # an old partial: pruned
    for step in (1, 2, 3):
        make_ckpt(tmp_path, step)
    make_ckpt(tmp_path, 4, published=False)  # newer than the newest published (a save in flight): kept
    assert names(it.prunable_checkpoints(tmp_path, 1)) == ["iter_0000000", "iter_0000001", "iter_0000002"]
    assert names(it.prunable_checkpoints(tmp_path, 1, keep_every=2)) == ["iter_0000000", "iter_0000001"]
    assert names(it.prunable_checkpoints(tmp_path, 1, below=2)) == ["iter_0000000", "iter_0000001"]
    assert it.prunable_checkpoints(tmp_path, 5) == [it.checkpoint_dir(tmp_path, 0)]
    assert it.prunable_checkpoints(tmp_path, None) == [] and it.prunable_checkpoints(tmp_path / "none", 1) == []


class GatedRemover:
    """The default remover behind a gate: each deletion waits (bounded) for ``release``, so a test
    holds a deletion in progress for as long as it wants. ``inside`` is set while one waits."""

    def __init__(self):
        self.inside = threading.Event()
        self.release = threading.Event()
        self.removed = []

    def __call__(self, path):
        self.inside.set()
        try:
            if not self.release.wait(60):
                raise TimeoutError("the test never released the deletion")
        finally:
            self.inside.clear()
        remove_checkpoint(path)
        self.removed.append(os.path.basename(path))


def test_prune_runs_in_the_background_and_finish_waits_for_it(tmp_path):
    gate = GatedRemover()
    m = it.CheckpointManager(tmp_path, FakeCheckpointer(), keep_last=1, remover=gate)
    for step in (1, 2, 3):  # publishing step 2 starts deleting step 1
        m.save(step, {"step": step})
        m.poll()
    assert gate.inside.wait(30)
    # save() and poll() came back while the deletion of step 1 is held in the remover
    assert gate.inside.is_set() and os.path.isdir(it.checkpoint_dir(tmp_path, 1))
    assert not m.wait_for_pruning(timeout=0)
    gate.release.set()
    m.finish()
    assert gate.removed == ["iter_0000001", "iter_0000002"] and published_steps(tmp_path) == [3]
    assert m.checkpointer.closed


def test_finish_bounds_its_wait_for_deletions(tmp_path, caplog):
    gate = GatedRemover()
    m = it.CheckpointManager(tmp_path, FakeCheckpointer(), keep_last=1, remover=gate)
    for step in (1, 2, 3):
        m.save(step, {"step": step})
    assert gate.inside.wait(30)
    with caplog.at_level(logging.WARNING, logger="solosave"):
        m.finish(timeout=0.2)  # the deletion is still held: finish returns, says so
    assert m.checkpointer.closed and "still being deleted" in caplog.text
    gate.release.set()
    assert m.wait_for_pruning(timeout=30) and published_steps(tmp_path) == [3]


def test_failed_deletion_is_logged_and_skipped(tmp_path, caplog):
    def remover(path):
        if path.endswith("iter_0000001"):
            raise PermissionError(13, "Permission denied", path)
        remove_checkpoint(path)

    m = it.CheckpointManager(tmp_path, FakeCheckpointer(), keep_last=1, remover=remover)
    with caplog.at_level(logging.WARNING, logger="solosave"):
        for step in (1, 2, 3, 4):
            m.save(step, {"step": step})
            m.poll()
        m.finish()
    assert published_steps(tmp_path) == [1, 4]  # 1 could not be deleted; 2 and 3 were, training went on
    assert "could not delete old checkpoint" in caplog.text and "Permission denied" in caplog.text
    assert "iter_0000001" in caplog.text and not m.failures


def test_keep_every_keeps_archival_checkpoints(tmp_path):
    m = it.CheckpointManager(tmp_path, FakeCheckpointer(fail_steps={8}), keep_last=2, keep_every=4)
    for step in range(1, 11):
        m.save(step, {"step": step})
        m.poll()
    m.finish()
    assert published_steps(tmp_path) == [4, 9, 10]
    assert not os.path.exists(it.checkpoint_dir(tmp_path, 8))  # a failed save at a multiple is no archive
    with pytest.raises(ValueError, match="keep_every must be >= 1"):
        it.CheckpointManager(tmp_path, FakeCheckpointer(), keep_last=1, keep_every=0)


# -- two tiers -----------------------------------------------------------------------------------

class FakeCopy:
    """A durable copy that ends when the test says so (``finish``), copying the fast checkpoint."""

    def __init__(self, fast, durable, fail=False):
        self.fast, self.path, self.fail, self.ended = fast, durable, fail, False

    def finish(self):
        import shutil

        from solosave._src.save.result import DurableResult

        if not self.fail:
            shutil.copytree(self.fast, self.path)
        self.result = DurableResult(self.path, not self.fail, {1: "boom"} if self.fail else {}, 0, 0.0, ())
        self.ended = True

    def done(self):
        return self.ended

    def wait(self, timeout=None):
        if not self.ended:
            self.finish()
        return self.result


class TieredCheckpointer(FakeCheckpointer):
    def __init__(self, durable_root, fail_copies=()):
        super().__init__()
        self.options = type("Options", (), {"durable_root": str(durable_root), "storage_options": None})()
        self.fail_copies = set(fail_copies)
        self.copies = {}

    def save(self, state_dict, path, overwrite=False):
        handle = super().save(state_dict, path, overwrite)
        copy = self.copies[state_dict["step"]] = FakeCopy(
            path, os.path.join(self.options.durable_root, os.path.basename(path)), state_dict["step"] in self.fail_copies)
        result = FakeResult(True)
        result.durable = copy
        handle.wait = lambda timeout=None: result
        return handle


def test_two_tiers_keep_their_own_latest_and_retention(tmp_path):
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    ck = TieredCheckpointer(durable, fail_copies={5})
    ended = []
    m = it.CheckpointManager(fast, ck, keep_last=1, keep_every=3, durable_keep_last=2, on_durable=ended.append)
    for step in (1, 2, 3, 4):
        m.save(step, {"step": step})
        m.poll()
    assert m.wait_for_pruning(30)
    # no copy ended yet: the fast tier keeps every checkpoint a copy still reads
    assert published_steps(fast) == [1, 2, 3, 4] and published_steps(durable) == []
    for step in (1, 2, 3):
        ck.copies[step].finish()
    m.poll()
    assert m.wait_for_pruning(30)
    assert [d.step for d in ended] == [1, 2, 3] and it.read_latest_marker(durable) == "iter_0000003"
    assert published_steps(fast) == [4]  # keep_last=1; keep_every applies to the durable tier only
    assert published_steps(durable) == [2, 3]  # durable_keep_last=2, 3 also archival
    m.save(5, {"step": 5})  # its copy fails: the fast copy stays the newest, durable latest stays
    m.save(6, {"step": 6})
    m.finish()
    assert [d.step for d in m.durable_failures] == [5] and "rank(s) [1]" in m.durable_failures[0].result.error
    assert it.read_latest_marker(fast) == "iter_0000006" and it.read_latest_marker(durable) == "iter_0000006"
    assert published_steps(durable) == [3, 4, 6] and published_steps(fast) == [6]
    with pytest.raises(ValueError, match="durable_keep_last must be >= 1"):
        it.CheckpointManager(fast, ck, durable_keep_last=0)
