"""The engine's protocol without processes: W threads, each a rank with its own SaveSession and
Engine, joined by in-process channels (``solosave._src.testing.local_channel.local_channels``). Milliseconds
per case instead of seconds of process start-up."""

import os
import threading
import time
from collections import defaultdict

import pytest
import torch

from solosave._src.coordination.protocol import EngineSettings, ErrorKind, SaveKind
from solosave._src.engine.engine import Engine
from solosave._src.save.options import CheckpointerOptions
from solosave._src.save.session import SaveSession
from solosave._src.testing.introspect import job_for
from solosave._src.testing.local_channel import local_channels
from solosave._src.write.writer import FileWriter

pytestmark = pytest.mark.timeout(60)


class FailingWriter(FileWriter):
    """Fails every file write of ``rank`` while ``failing`` is set (a test fixture)."""

    def __init__(self, rank, failing=True):
        super().__init__(fsync=False)
        self.rank, self.failing = rank, failing

    def write_file(self, directory, relative_path, records):
        if self.failing and relative_path.startswith(f"__{self.rank}_"):
            raise OSError(5, "injected I/O error", relative_path)
        return super().write_file(directory, relative_path, records)


class Ranks:
    """W ranks in threads: ``ranks.save(fn, path)`` runs ``fn(rank) -> state dict`` on every rank
    and returns every rank's outcome (rank order)."""

    def __init__(self, world, tmp_path, writer=None, **options):
        self.world = world
        self.tmp = tmp_path
        opts = CheckpointerOptions(persistent_worker=False, **options)
        channels = local_channels(world, timeout=10)
        settings = EngineSettings(opts.workers, opts.on_layout_drift, opts.prepared_path)
        self.engines = [Engine(ch, settings, writer or FileWriter(fsync=False)) for ch in channels]
        self.sessions = [SaveSession(r, world, opts, None) for r in range(world)]

    def save(self, state_of, name, abort_on=(), skip_seq_on=()):
        out = [None] * self.world

        def rank(r):
            s = self.sessions[r]
            path = str(self.tmp / name)
            if r in skip_seq_on:
                s.seq += 1  # this rank's save() "timed out" earlier: it is one save early
            if r in abort_on:
                job = s.abort(path, TypeError(f"a value only rank {r} holds cannot be saved"))
            else:
                job = job_for(s, self.engines[r].io.reader, state_of(r), path)
            out[r] = self.engines[r].run(job)
            s.absorb(out[r])

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert all(o is not None for o in out), "a rank did not finish"
        return out

    def close(self):
        for s in self.sessions:
            s.close()
        for e in self.engines:
            e.close()


def state(r, grow=False, lose=None):
    sd = {"w": torch.arange(64, dtype=torch.float32) + r * 0, "b": torch.ones(4),
          f"mine{r}": torch.full((3,), float(r)), "meta": {"step": 3, "sched": list(range(5000 if grow else 3))}}
    if lose is not None and r == lose:
        del sd["w"]
    return sd


def kinds(outs):
    return [o.kind for o in outs]


def counts(o):
    out = {}
    for c in o.collectives:
        out.setdefault(c.kind, [0, 0])
        out[c.kind][0] += 1
        out[c.kind][1] += c.payload_bytes
    return out


@pytest.fixture
def ranks(tmp_path):
    made = []

    def make(world=2, **kw):
        r = Ranks(world, tmp_path, **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def test_create_then_reuse_one_all_reduce_published_everywhere(ranks):
    rk = ranks(3, assume_constant_structure=True)
    first = rk.save(state, "c0")
    assert kinds(first) == [SaveKind.CREATE] * 3 and all(o.ok and o.published for o in first)
    assert all(o.prepared_metadata is not None for o in first)
    for i in range(1, 3):
        outs = rk.save(state, f"c{i}")
        assert all(o.ok and o.published for o in outs), [o.failures for o in outs]
        assert kinds(outs) == [SaveKind.REUSE] * 3
        assert all(counts(o) == {"all_reduce": [1, 8]} for o in outs)
    assert (rk.tmp / "c2" / ".metadata").exists()


def test_drift_fallback_refreshes_and_the_next_save_reuses(ranks):
    rk = ranks(2, assume_constant_structure=True)
    rk.save(state, "c0")
    outs = rk.save(lambda r: state(r, grow=True), "c1")
    assert kinds(outs) == [SaveKind.FALLBACK] * 2 and all(o.ok and o.published for o in outs)
    assert "meta.sched" in outs[0].warnings[0] and outs[0].prepared_metadata is not None
    assert set(counts(outs[0])) == {"all_reduce", "gather_object", "scatter_object_list", "broadcast_object_list"}
    again = rk.save(lambda r: state(r, grow=True), "c2")
    assert kinds(again) == [SaveKind.REUSE] * 2 and all(o.ok for o in again)


def test_drift_raise_fails_every_rank_and_publishes_nothing(ranks):
    rk = ranks(2, assume_constant_structure=True, on_layout_drift="raise")
    rk.save(state, "c0")
    outs = rk.save(lambda r: state(r, grow=True), "c1")
    assert all(not o.ok and o.error_kind is ErrorKind.DRIFT for o in outs)
    assert outs[0].drifts == outs[1].drifts and any("meta.sched" in d for v in outs[0].drifts.values() for d in v)
    assert not (rk.tmp / "c1" / ".metadata").exists()


def test_failed_write_on_one_rank_fails_every_rank_then_recovers(ranks, tmp_path):
    rk = ranks(2, writer=FailingWriter(rank=1))
    outs = rk.save(state, "c0")
    assert all(not o.ok and o.error_kind is ErrorKind.FAILED for o in outs)
    assert all(list(o.failures) == [1] and "injected I/O error" in o.failures[1] for o in outs)
    assert not (tmp_path / "c0" / ".metadata").exists()
    assert all(e.broken is None for e in rk.engines)  # a per-save failure: the engine goes on


def test_a_save_that_raised_on_one_rank_fails_every_rank_at_once_and_the_next_works(ranks):
    rk = ranks(2, assume_constant_structure=True)
    rk.save(state, "c0")
    for mode in ("reuse", "collective"):
        if mode == "collective":
            for s in rk.sessions:
                s.prepared = None
        outs = rk.save(state, f"bad_{mode}", abort_on={1})
        assert all(not o.ok for o in outs), mode
        assert all("save() raised on this rank: TypeError" in o.failures.get(1, "") for o in outs), outs
        assert all(e.broken is None for e in rk.engines)
        ok = rk.save(state, f"after_{mode}")
        assert all(o.ok and o.published for o in ok), (mode, [o.failures for o in ok])


def test_ranks_out_of_step_break_every_engine(ranks):
    rk = ranks(2, assume_constant_structure=True)
    rk.save(state, "c0")
    outs = rk.save(state, "c1", skip_seq_on={1})
    assert all(o.error_kind is ErrorKind.OUT_OF_STEP for o in outs)
    later = rk.save(state, "c2")
    assert all(not o.ok and "close() it and create a new" in next(iter(o.failures.values())) for o in later)
    assert not (rk.tmp / "c1" / ".metadata").exists()


def test_an_internal_error_is_reported_with_its_traceback(ranks, monkeypatch):
    from solosave._src.engine import reuse

    def bug(*a, **k):
        raise KeyError("a bug")

    rk = ranks(2)
    for e in rk.engines:
        e.io.publish = bug
    outs = rk.save(state, "c0")
    # publishing errors are the coordinator's per-save failure, reported to every rank
    assert all(not o.ok and "publishing failed: KeyError" in o.failures[0] for o in outs)

    def worse_bug(placed, results):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(reuse, "check_layout", worse_bug)  # outside the reuse write's error handling
    rk = ranks(1, assume_constant_structure=True)
    rk.save(state, "d0")
    outs = rk.save(state, "d1")
    assert outs[0].error_kind is ErrorKind.INTERNAL
    assert "internal error in solosave" in outs[0].failures[0] and "Traceback" in outs[0].failures[0]
    assert "ZeroDivisionError: a bug" in outs[0].failures[0]


def test_an_empty_state_creates_and_reuses(ranks):
    rk = ranks(2, assume_constant_structure=True)
    for name in ("e0", "e1"):
        outs = rk.save(lambda r: {}, name)
        assert all(o.ok and o.published for o in outs), [o.failures for o in outs]
    assert kinds(outs) == [SaveKind.REUSE] * 2


def test_a_replicated_item_lost_by_its_writer_heals_on_the_next_save(ranks, case_log):
    rk = ranks(2, assume_constant_structure=True)
    rk.save(state, "c0")
    writer = next(r for r in range(2) if any(p.key[0] == "w" for p in rk.sessions[r].prepared.rank_files(r)[0][1]))
    outs = rk.save(lambda r: state(r, lose=writer), "c1")
    assert all(not o.ok and "staged by no rank" in " ".join(o.failures.values()) for o in outs)
    healed = rk.save(lambda r: state(r, lose=writer), "c2")
    assert all(o.ok and o.published for o in healed), [o.failures for o in healed]
    assert kinds(rk.save(lambda r: state(r, lose=writer), "c3")) == [SaveKind.REUSE] * 2
    case_log("reuse save (default staging): a replicated tensor vanished from its prepared writer",
             "that save fails on every rank ('staged by no rank'), nothing published; the next save "
             "stages everything and publishes; the one after reuses")


def test_with_stage_replicas_a_replicated_item_lost_by_its_writer_is_saved_in_the_same_save(ranks, tmp_path,
                                                                                           case_log):
    rk = ranks(2, assume_constant_structure=True, stage_replicas=True)
    rk.save(state, "c0")
    writer = next(r for r in range(2) if any(p.key[0] == "w" for p in rk.sessions[r].prepared.rank_files(r)[0][1]))
    outs = rk.save(lambda r: state(r, lose=writer), "c1")
    assert all(o.ok and o.published for o in outs), [o.failures for o in outs]
    assert kinds(outs) == [SaveKind.FALLBACK] * 2
    got = {"w": torch.zeros(64)}
    import torch.distributed.checkpoint as dcp

    dcp.load(got, checkpoint_id=str(tmp_path / "c1"), no_dist=True)
    assert torch.equal(got["w"], torch.arange(64, dtype=torch.float32))
    assert kinds(rk.save(lambda r: state(r, lose=writer), "c2")) == [SaveKind.REUSE] * 2
    case_log("reuse save, stage_replicas=True: a replicated tensor vanished from its prepared writer "
             "(another rank still holds it)", "that same save published through the fallback, the tensor "
             "written by the other holder (loads bit-exact); the next save reuses again")


def test_a_directory_name_that_is_not_utf8_saves_and_loads(ranks, tmp_path, case_log):
    import os

    import torch.distributed.checkpoint as dcp

    name = os.fsdecode(b"ckpt-\xff\xfe")  # legal on Linux; Python holds it with surrogate escapes
    rk = ranks(2, assume_constant_structure=True)
    for i in range(2):
        outs = rk.save(state, f"{name}{i}")
        assert all(o.ok and o.published for o in outs), [o.failures for o in outs]
    assert kinds(outs) == [SaveKind.REUSE] * 2
    target = {"w": torch.zeros(64), "mine1": torch.zeros(3)}
    dcp.load(target, checkpoint_id=str(tmp_path / f"{name}1"), no_dist=True)
    assert torch.equal(target["w"], torch.arange(64, dtype=torch.float32)) and target["mine1"].tolist() == [1.0] * 3
    ok = rk.save(state, "plain")  # and the checkpointer goes on
    assert all(o.ok for o in ok)
    case_log("checkpoint directory name with bytes that are not UTF-8 (b'ckpt-\\xff\\xfe')",
             "create and reuse saves publish; stock dcp.load reads it; later saves work")


def _stepped(r, step):
    sd = state(r)
    sd["meta"]["step"] = step  # a new payload, the same structure
    return sd


def test_a_steady_structure_reuses_its_write_program_and_still_sees_a_drift(ranks, tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from solosave._src.engine import reuse

    checks = []
    real = reuse.check_layout
    monkeypatch.setattr(reuse, "check_layout", lambda placed, results: checks.append(1) or real(placed, results))
    rk = ranks(2, assume_constant_structure=True)
    rk.save(state, "c0")  # create
    rk.save(state, "c1")  # the first reuse save works the program out and checks its layout
    programs, n = [e.io.reuse_program for e in rk.engines], len(checks)
    assert all(p is not None and p.checked is not None for p in programs) and n == 2
    for i in (2, 3):
        outs = rk.save(lambda r, i=i: _stepped(r, i), f"c{i}")
        assert kinds(outs) == [SaveKind.REUSE] * 2 and all(o.ok and o.published for o in outs)
    assert all(e.io.reuse_program is p for e, p in zip(rk.engines, programs))
    assert len(checks) == n  # the same layout as the last checked one: no check needed
    got = {"w": torch.zeros(64), "meta": {"step": -1, "sched": []}}
    dcp.load(got, checkpoint_id=str(tmp_path / "c3"), no_dist=True)
    assert got["meta"]["step"] == 3 and torch.equal(got["w"], torch.arange(64, dtype=torch.float32))
    outs = rk.save(lambda r: state(r, grow=True), "c4")  # a payload outgrows its slot: checked, drifted
    assert kinds(outs) == [SaveKind.FALLBACK] * 2 and all(o.ok and o.published for o in outs)
    assert len(checks) == n + 1  # "meta" (replicated) is written by one rank: its results changed


def test_reuse_publishes_the_metadata_it_staged_and_leaves_no_temporary_file(ranks, tmp_path):
    """The coordinator writes ``.metadata``'s bytes beside the data and renames them in at the
    end: a published reuse save holds exactly the prepared metadata and no temporary file; a
    failed one (another rank's write) and a drifted one publish nothing and leave nothing."""
    from torch.distributed.checkpoint import FileSystemReader

    writer = FailingWriter(rank=1, failing=False)
    rk = ranks(2, writer=writer, assume_constant_structure=True, on_layout_drift="raise")
    rk.save(state, "c0")
    written = []  # RankIO.publish writes .metadata whole: a reuse save renames the staged one
    for e in rk.engines:
        e.io.publish = lambda *a, io=e.io, **k: written.append(1) or type(io).publish(io, *a, **k)
    outs = rk.save(state, "c1")
    assert kinds(outs) == [SaveKind.REUSE] * 2 and all(o.ok and o.published for o in outs)
    assert written == []
    names = sorted(n for n in os.listdir(tmp_path / "c1") if n.startswith("."))
    assert names == [".metadata", ".solosave-index"], names
    md = FileSystemReader(str(tmp_path / "c1")).read_metadata()
    assert md.storage_meta.checkpoint_id == str(tmp_path / "c1") and len(md.storage_data) > 0
    writer.failing = True
    outs = rk.save(state, "c2")
    assert all(not o.ok and o.error_kind is ErrorKind.FAILED for o in outs)
    writer.failing = False
    outs = rk.save(lambda r: state(r, grow=True), "c3")
    assert all(not o.ok and o.error_kind is ErrorKind.DRIFT for o in outs)
    for name in ("c2", "c3"):  # neither .metadata nor its temporary file (..metadata.tmp.*)
        assert not [n for n in os.listdir(tmp_path / name) if "metadata" in n], os.listdir(tmp_path / name)
    assert all(e.io.reuse_program is not None for e in rk.engines)


def test_a_metadata_written_aside_after_the_engine_stopped_waiting_is_discarded_by_its_thread():
    from solosave._src.engine.reuse import EarlyPublication
    from solosave._src.storage.base import Commit

    log = []

    class Logged(Commit):  # a commit type that only records what was done with it
        def _write_aside(self, data):
            pass

        def _finish(self):
            log.append(f"finish {self.path}")

        def _discard(self):
            log.append(f"discard {self.path}")

    def commit(name):
        c = Logged(None, name)
        c.write_aside(b"")
        return c

    on_time = EarlyPublication(lambda early: early.offer(commit("a")))
    pending = on_time.take(10)
    assert log == [] and on_time.take(10) is None
    pending.finish()
    release = threading.Event()
    late = EarlyPublication(lambda early: release.wait(10) and early.offer(commit("b")))
    assert late.take(0.2) is None  # the engine gave up waiting
    t0 = time.monotonic()
    assert late.take(5) is None  # later waits share the first one's deadline: no second wait
    assert time.monotonic() - t0 < 1
    release.set()
    late.thread.join(10)
    assert log == ["finish a", "discard b"]


def test_the_ahead_threads_warnings_are_kept_until_the_take_and_dropped_after():
    from solosave._src.engine.reuse import EarlyPublication

    warned, release = threading.Event(), threading.Event()

    def run(early):
        early.warn("index not written")
        warned.set()
        release.wait(10)
        early.warn("too late")

    early = EarlyPublication(run)
    assert warned.wait(10)
    assert early.take(0.2) is None  # the reuse path stops waiting before the second warning
    release.set()
    early.thread.join(10)
    assert early.warnings == ("index not written",)


def _on_threads(world, fn):
    """``fn(rank)`` on ``world`` threads; every rank's return value (rank order)."""
    out = [None] * world
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, fn(r))) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(o is not None for o in out), "a rank did not finish"
    return out


def test_the_paths_take_their_state_as_arguments_and_return_what_they_made(tmp_path):
    """No engine: the collective and reuse paths run on a channel, the settings and each rank's
    ``RankIO``, and return the outcome and the template the coordinator made (adopted by the
    prepared metadata of the next save, which is how the engine uses it)."""
    from torch.distributed.checkpoint import FileSystemReader

    from solosave._src.engine.collective import run_collective
    from solosave._src.engine.rank_io import RankIO
    from solosave._src.engine.reuse import run_reuse

    world = 2
    opts = CheckpointerOptions(persistent_worker=False, assume_constant_structure=True)
    settings = EngineSettings(opts.workers, opts.on_layout_drift, opts.prepared_path)
    channels = local_channels(world, timeout=10)
    ios = [RankIO(r, FileWriter(fsync=False)) for r in range(world)]
    sessions = [SaveSession(r, world, opts, None) for r in range(world)]
    try:
        def create(r):
            job = job_for(sessions[r], ios[r].reader, state(r), str(tmp_path / "c0"))
            return run_collective(channels[r], settings, ios[r], job, defaultdict(float))

        created = _on_threads(world, create)
        assert all(o.ok and o.published and o.kind is SaveKind.CREATE for o, _ in created)
        made = [m for _, m in created]
        assert made[1] is None and made[0] is not None  # the coordinator made it
        published = FileSystemReader(str(tmp_path / "c0")).read_metadata().storage_meta.save_id
        assert made[0].save_id == published
        for s, (o, _) in zip(sessions, created):
            s.absorb(o)

        def reuse(r):
            job = job_for(sessions[r], ios[r].reader, state(r), str(tmp_path / "c1"))
            if r == 0:
                assert job.prepared.adopt_template(made[0].save_id, made[0].template, made[0].index_body)
            mark = channels[r].counter.mark()
            out, m = run_reuse(channels[r], settings, ios[r], job, job.prepared, defaultdict(float))
            return out, m, [c.kind for c in channels[r].counter.since(mark)]

        reused = _on_threads(world, reuse)
        assert all(o.ok and o.published and o.kind is SaveKind.REUSE and m is None for o, m, _ in reused)
        assert all(calls == ["all_reduce"] for _, _, calls in reused)
        assert (tmp_path / "c1" / ".metadata").exists()
    finally:
        for s in sessions:
            s.close()
        for io in ios:
            io.close()


def test_the_coordinators_warnings_come_back_in_its_outcome(ranks, tmp_path):
    """A prepared file that cannot be written (here: the path is a checkpoint directory) is a
    warning of the coordinator's outcome; the save itself publishes."""
    ckpt = tmp_path / "old_ckpt"
    ckpt.mkdir()
    rk = ranks(2, prepared_metadata=str(ckpt), create_prepared_metadata=True)
    outs = rk.save(state, "c0")
    assert all(o.ok and o.published for o in outs), [o.failures for o in outs]
    assert any("is never written into" in w for w in outs[0].warnings), outs[0].warnings
    assert outs[1].warnings == ()
