"""The durable stage of two tiers without processes: the copier's protocol on W threads joined by
in-process channels, the streamed copy, and the re-pointed ``.metadata`` and load index."""

import argparse
import os
import threading
import time

import pytest
import torch

from solosave._src.coordination.protocol import EngineSettings
from solosave._src.core.errors import OptionError
from solosave._src.engine.engine import Engine
from solosave._src.formats.dcp import INDEX_FILE, METADATA_FILE
from solosave._src.formats.metadata_template import MetadataTemplate, replace_checkpoint_id
from solosave._src.index.reader import LoadIndex
from solosave._src.index.writer import body_from_metadata, render, shifted
from solosave._src.save.options import CheckpointerOptions, add_option_flags, options_from_args
from solosave._src.save.session import SaveSession
from solosave._src.storage.copy import stream_into
from solosave._src.storage.local import LocalStorage
from solosave._src.testing.introspect import job_for
from solosave._src.testing.local_channel import local_channels
from solosave._src.tiers.durable import Copier, CopyTask
from solosave._src.tiers.paths import durable_copy_of
from solosave._src.write.writer import FileWriter
from tests.support import dcp_save_local

pytestmark = pytest.mark.timeout(60)


def test_the_durable_root_option_and_its_flag():
    p = argparse.ArgumentParser()
    add_option_flags(p)
    args = p.parse_args(["--ckpt-durable-root", "s3://bucket/run"])
    assert options_from_args(args).durable_root == "s3://bucket/run"
    assert CheckpointerOptions().durable_root is None
    with pytest.raises(OptionError, match="durable_root must be a directory path or a URL"):
        CheckpointerOptions(durable_root=3)
    assert durable_copy_of("/nvme/ckpt/iter_0000100", "s3://b/run/") == "s3://b/run/iter_0000100"
    assert durable_copy_of("s3://b/x/iter_1/", "/lustre/run") == "/lustre/run/iter_1"


def _published(tmp_path, name="fast"):
    """A DCP checkpoint whose .metadata and load index were published as a solosave save does."""
    d = tmp_path / name
    dcp_save_local({"w": torch.arange(12.0).reshape(3, 4), "step": 7}, checkpoint_id=str(d))
    import pickle

    with open(d / METADATA_FILE, "rb") as f:
        md = pickle.load(f)
    template = MetadataTemplate(md)
    (d / INDEX_FILE).write_bytes(render(body_from_metadata(md), template, str(d), "the-save-id"))
    (d / METADATA_FILE).write_bytes(template.render(str(d), "the-save-id"))
    return d


def test_repointed_metadata_and_index_belong_together(tmp_path):
    fast = _published(tmp_path)
    durable = tmp_path / "a-much-longer-durable-directory-name"
    durable.mkdir()
    data = (fast / METADATA_FILE).read_bytes()
    moved = replace_checkpoint_id(data, str(fast), str(durable))
    assert moved is not None and len(moved) - len(data) == len(str(durable)) - len(str(fast))
    (durable / METADATA_FILE).write_bytes(moved)
    (durable / INDEX_FILE).write_bytes(shifted((fast / INDEX_FILE).read_bytes(), len(moved) - len(data)))
    import pickle

    md = pickle.loads(moved)
    assert md.storage_meta.checkpoint_id == str(durable) and md.storage_meta.save_id == "the-save-id"
    with LoadIndex.open(durable) as idx:  # its header matches the durable .metadata
        assert set(idx.keys) == {"w", "step"}
    (durable / INDEX_FILE).write_bytes((fast / INDEX_FILE).read_bytes())  # not shifted: stale there
    with pytest.raises(Exception, match="belongs to another"):
        LoadIndex.open(durable)
    assert replace_checkpoint_id(data, "/not/its/id", "/x") is None


class Recording:
    """A data file that records the size of every write."""

    def __init__(self):
        self.sizes = []

    def write(self, b):
        self.sizes.append(len(b))
        return len(b)


def test_stream_into_copies_in_bounded_chunks_and_stops(tmp_path):
    src = tmp_path / "f"
    src.write_bytes(os.urandom(3 * 1000 + 500))
    out = Recording()
    assert stream_into(LocalStorage(), str(src), out, chunk=1000) == 3500
    assert out.sizes == [1000, 1000, 1000, 500]
    with pytest.raises(InterruptedError, match="stopped after 0 bytes"):
        stream_into(LocalStorage(), str(src), Recording(), chunk=1000, stop=lambda: True)


class FailingCopyWriter(FileWriter):
    """Fails the durable copy of ``rank``'s files (the copier opens them through the writer)."""

    def __init__(self, rank):
        super().__init__(fsync=False)
        self.rank = rank

    def open(self, path):
        if "durable" in path and os.path.basename(path).startswith(f"__{self.rank}_"):
            raise OSError(28, "No space left on device (injected)", path)
        return super().open(path)


def _run_copies(copiers, tasks):
    out = [None] * len(copiers)

    def rank(r):
        out[r] = copiers[r].copy(tasks[r])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(copiers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(o is not None for o in out), "a rank did not finish"
    return out


def _fake_fast(tmp_path, world):
    fast = _published(tmp_path, "fast")
    for r in range(world):  # each rank's own file (the copier copies whatever files it is given)
        (fast / f"__{r}_0.distcp").write_bytes(bytes([r]) * (1000 + r))
    return fast


def test_copier_publishes_only_after_every_rank_copied(tmp_path):
    world = 3
    fast = _fake_fast(tmp_path, world)
    target = str(tmp_path / "durable" / "fast")
    tasks = [CopyTask(1, str(fast), target, (f"__{r}_0.distcp",)) for r in range(world)]
    copiers = [Copier(ch, FileWriter(fsync=False)) for ch in local_channels(world)]
    outs = _run_copies(copiers, tasks)
    assert all(o.ok and not o.failures for o in outs)
    assert [[c.kind for c in o.collectives] for o in outs] == [["all_reduce"]] * world
    for r in range(world):
        assert (tmp_path / "durable" / "fast" / f"__{r}_0.distcp").read_bytes() == bytes([r]) * (1000 + r)
    import pickle

    md = pickle.loads((tmp_path / "durable" / "fast" / METADATA_FILE).read_bytes())
    assert md.storage_meta.checkpoint_id == target
    assert LoadIndex.open(target) is not None


def test_a_failed_copy_publishes_nothing_and_every_rank_learns_why(tmp_path):
    world = 3
    fast = _fake_fast(tmp_path, world)
    target = str(tmp_path / "durable" / "fast")
    tasks = [CopyTask(4, str(fast), target, (f"__{r}_0.distcp",)) for r in range(world)]
    copiers = [Copier(ch, FailingCopyWriter(2)) for ch in local_channels(world)]
    outs = _run_copies(copiers, tasks)
    assert not any(o.ok for o in outs) and all(sorted(o.failures) == [2] for o in outs)
    assert "No space left on device (injected)" in outs[0].failures[2]
    assert [c.kind for c in outs[1].collectives] == ["all_reduce", "all_gather_object"]
    assert not os.path.exists(os.path.join(target, METADATA_FILE))
    # the copiers are fine: the next task (without the fault) publishes
    for c in copiers:
        c.writer = FileWriter(fsync=False)
    assert all(o.ok for o in _run_copies(copiers, [CopyTask(5, str(fast), target, t.files) for t in tasks]))
    assert os.path.exists(os.path.join(target, METADATA_FILE))


def test_a_published_durable_copy_is_replaced_only_with_overwrite(tmp_path):
    world = 2
    fast = _fake_fast(tmp_path, world)
    target = str(tmp_path / "durable" / "fast")
    files = [(f"__{r}_0.distcp",) for r in range(world)]
    copiers = [Copier(ch, FileWriter(fsync=False)) for ch in local_channels(world)]
    assert all(o.ok for o in _run_copies(copiers, [CopyTask(1, str(fast), target, f) for f in files]))
    outs = _run_copies(copiers, [CopyTask(2, str(fast), target, f) for f in files])
    assert not any(o.ok for o in outs) and "already holds a complete checkpoint" in outs[0].failures[0]
    assert os.path.exists(os.path.join(target, METADATA_FILE))  # the published copy is untouched
    outs = _run_copies(copiers, [CopyTask(3, str(fast), target, f, overwrite=True) for f in files])
    assert all(o.ok for o in outs)


def test_a_dead_peer_breaks_the_copier_and_later_copies_fail_at_once(tmp_path):
    world = 2
    fast = _fake_fast(tmp_path, world)
    target = str(tmp_path / "durable" / "fast")
    channels = local_channels(world, timeout=1.0)
    copier = Copier(channels[0], FileWriter(fsync=False))
    out = copier.copy(CopyTask(1, str(fast), target, ("__0_0.distcp",)))  # rank 1 never shows up
    assert not out.ok and "durable channel failed" in out.failures[0] and copier.broken
    t0 = time.monotonic()
    again = copier.copy(CopyTask(2, str(fast), target, ("__0_0.distcp",)))
    assert not again.ok and again.failures == out.failures and not again.collectives
    assert time.monotonic() - t0 < 0.5


def test_the_engine_queues_a_copy_per_published_save_and_reports_it(tmp_path):
    """Two engines on threads: each published save names its durable copy at once; the copies'
    outcomes arrive later through ``post``, in save order, two 8-byte all_reduces each."""
    world = 2
    opts = CheckpointerOptions(persistent_worker=False, assume_constant_structure=True,
                               durable_root=str(tmp_path / "durable"))
    settings = EngineSettings(1, "fallback", None, None, opts.durable_root)
    mains, durables = local_channels(world), local_channels(world)
    engines = [Engine(mains[r], settings, FileWriter(fsync=False), durables[r]) for r in range(world)]
    sessions = [SaveSession(r, world, opts, None) for r in range(world)]
    posted = [[] for _ in range(world)]
    for r, e in enumerate(engines):
        e.copier.post = posted[r].append
    outs = [[None] * world for _ in range(2)]

    def rank(r):
        for i in range(2):
            sd = {"w": torch.arange(16.0) + i, f"r{r}": torch.full((4,), float(r))}
            job = job_for(sessions[r], engines[r].io.reader, sd, str(tmp_path / "fast" / f"iter_{i}"))
            outs[i][r] = engines[r].run(job)
            sessions[r].absorb(outs[i][r])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        for i in range(2):
            assert all(o.ok and o.durable == str(tmp_path / "durable" / f"iter_{i}") for o in outs[i])
        deadline = time.monotonic() + 20
        while any(len(p) < 2 for p in posted) and time.monotonic() < deadline:
            time.sleep(0.05)
        for p in posted:  # copy 1 ran, or (its copier still busy when save 2 came) was coalesced into 2
            assert [o.seq for o in p] == [1, 2] and p[1].ok and (p[0].ok or p[0].superseded_by == 2)
            # each copy: the choice of the task, then the status word
            assert all([c.kind for c in o.collectives] == ["all_reduce", "all_reduce"] for o in p if o.ok)
        assert [o.ok for o in posted[0]] == [o.ok for o in posted[1]]
        assert os.path.exists(tmp_path / "durable" / "iter_1" / METADATA_FILE)
    finally:
        for s in sessions:
            s.close()
        for e in engines:
            e.close()


class GatedWriter(FileWriter):
    """Blocks the durable copy of ``name`` until ``gate`` is set (a stalled store)."""

    def __init__(self, name, gate):
        super().__init__(fsync=False)
        self.name, self.gate = name, gate

    def open(self, path):
        if f"/durable/{self.name}/" in path:
            assert self.gate.wait(30)
        return super().open(path)


@pytest.mark.parametrize("seed", range(6))
def test_copies_that_fall_behind_are_coalesced_the_same_on_every_rank(tmp_path, seed):
    """Copy 1 stalls; saves 2..6 are published meanwhile, reaching each rank at its own moments
    (some after the stall ends): every rank copies the same tasks (1 and the newest it was
    agreed on), reports each other one superseded exactly once, and the choice costs one 8-byte
    all_reduce; no rank goes out of step."""
    import random

    world = 2
    rng = random.Random(seed)
    fast = _fake_fast(tmp_path, world)
    gate = threading.Event()
    channels = local_channels(world, timeout=20)
    copiers = [Copier(ch, GatedWriter("s1", gate)) for ch in channels]
    posted = [[] for _ in range(world)]
    for r, c in enumerate(copiers):
        c.post = posted[r].append
    tasks = {s: str(tmp_path / "durable" / f"s{s}") for s in range(1, 7)}

    def rank(r):
        copiers[r].submit(CopyTask(1, str(fast), tasks[1], (f"__{r}_0.distcp",)))
        for s in range(2, 7):
            time.sleep(rng.uniform(0, 0.05))
            if r == 0 and s == 4:
                gate.set()  # the store answers again while later saves still arrive
            copiers[r].submit(CopyTask(s, str(fast), tasks[s], (f"__{r}_0.distcp",)))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    deadline = time.monotonic() + 30
    while any(sorted(o.seq for o in p) != list(range(1, 7)) for p in posted) and time.monotonic() < deadline:
        time.sleep(0.05)
    for c in copiers:
        c.close(5)
    for p in posted:
        assert sorted(o.seq for o in p) == list(range(1, 7)), [(o.seq, o.ok) for o in p]  # each once
    copied = [{o.seq for o in p if o.ok} for p in posted]
    skipped = [{o.seq for o in p if o.superseded_by is not None} for p in posted]
    assert copied[0] == copied[1] and skipped[0] == skipped[1]  # the same choice on every rank
    # the newest is always copied; something was coalesced (2 on rank 0, which had it queued behind
    # the stalled copy 1 when 3 came; or 1 itself, if save 2 reached a copier before it offered 1)
    assert 6 in copied[0] and copied[0] | skipped[0] == set(range(1, 7)) and skipped[0], (copied, skipped)
    assert all(not o.failures for p in posted for o in p)
    for s in range(1, 7):
        assert os.path.exists(os.path.join(tasks[s], METADATA_FILE)) == (s in copied[0])
    for o in (o for p in posted for o in p if o.ok):  # the choice, then the status word
        assert [(c.kind, c.payload_bytes) for c in o.collectives] == [("all_reduce", 8), ("all_reduce", 8)]


def test_every_save_is_copied_in_order_when_asked(tmp_path):
    world = 2
    fast = _fake_fast(tmp_path, world)
    gate = threading.Event()
    copiers = [Copier(ch, GatedWriter("s1", gate), coalesce=False) for ch in local_channels(world, timeout=20)]
    posted = [[] for _ in range(world)]
    for r, c in enumerate(copiers):
        c.post = posted[r].append
        for s in range(1, 5):
            c.submit(CopyTask(s, str(fast), str(tmp_path / "durable" / f"s{s}"), (f"__{r}_0.distcp",)))
    gate.set()
    deadline = time.monotonic() + 30
    while any(len(p) < 4 for p in posted) and time.monotonic() < deadline:
        time.sleep(0.05)
    for c in copiers:
        c.close(5)
    for p in posted:
        assert [(o.seq, o.ok) for o in p] == [(1, True), (2, True), (3, True), (4, True)]
        assert all([c.kind for c in o.collectives] == ["all_reduce"] for o in p)


class FailingTimesWriter(FileWriter):
    """Fails rank ``rank``'s durable copy the first ``times`` times it is opened."""

    def __init__(self, rank, times):
        super().__init__(fsync=False)
        self.rank, self.left = rank, times

    def open(self, path):
        if "durable" in path and os.path.basename(path).startswith(f"__{self.rank}_") and self.left > 0:
            self.left -= 1
            raise OSError(5, "Input/output error (injected)", path)
        return super().open(path)


@pytest.mark.parametrize("fails,ok", [(1, True), (2, True), (3, False)])
def test_a_failed_copy_is_tried_again_on_every_rank_with_a_back_off(tmp_path, fails, ok):
    world = 2
    fast = _fake_fast(tmp_path, world)
    target = str(tmp_path / "durable" / "fast")
    tasks = [CopyTask(1, str(fast), target, (f"__{r}_0.distcp",)) for r in range(world)]
    copiers = [Copier(ch, FailingTimesWriter(1, fails), retries=2, backoff=0.01) for ch in local_channels(world)]
    outs = _run_copies(copiers, tasks)
    assert [o.ok for o in outs] == [ok] * world and [o.attempts for o in outs] == [min(fails + 1, 3)] * world
    assert os.path.exists(os.path.join(target, METADATA_FILE)) == ok
    # each try: the status word, and the errors' gather when it failed
    kinds = ["all_reduce", "all_gather_object"] * min(fails, 3) + (["all_reduce"] if ok else [])
    assert all([c.kind for c in o.collectives] == kinds for o in outs)
    if not ok:
        assert "Input/output error (injected)" in outs[0].failures[1]
