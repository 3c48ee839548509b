"""Rank functions of tests/multiproc/test_tiers.py (module-level: the ranks and their workers
import them): two tiers, a fast directory and a durable root, on local paths."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

import solosave
from solosave._src.testing.introspect import worker_pid
from tests.support import assert_equal, wait_until, zeros_like
from tests.support import fresh as _fresh


def state(rank: int, step: int) -> dict:
    """About 0.5 MiB per rank, every kind of item: a rank's own tensors, a replicated one, bytes."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"own": {f"r{rank}": torch.randn(256, 256, generator=g)}, "shared": torch.arange(64.0) + step,
            "step": step, "name": f"run-{step}"}


class TierWriter(solosave.FileWriter):
    """Writes normally, except for the durable copy (a path under ``durable``) of the checkpoint
    named ``target``, on rank ``rank``:

    * ``"gate"``: wait (bounded) until the file ``gate`` exists before copying;
    * ``"fail"``: the copy's write past its first 1000 bytes fails (an ``OSError``);
    * ``"block"``: create ``marker``, then sleep (the test kills the worker meanwhile).

    Every action applies to data files only (not ``.metadata``, which the coordinator commits)."""

    def __init__(self, durable: str, target: str | None = None, rank: int | None = None, action: str = "",
                 gate: str | None = None, marker: str | None = None) -> None:
        super().__init__()
        self.durable, self.target, self.rank, self.action = durable, target, rank, action
        self.gate, self.marker = gate, marker

    def open(self, path: str):  # noqa: ANN201 - a DataFile
        out = super().open(path)
        hit = (path.startswith(self.durable) and os.path.basename(os.path.dirname(path)) == self.target
               and (self.rank is None or os.path.basename(path).startswith(f"__{self.rank}_")))
        if not hit:
            return out
        if self.action == "gate":
            if not wait_until(lambda: os.path.exists(self.gate), timeout=60):
                raise TimeoutError("the test never opened the gate")
        elif self.action == "block":
            with open(self.marker + ".tmp", "w"):
                pass
            os.replace(self.marker + ".tmp", self.marker)
            time.sleep(120)
        elif self.action == "fail":
            write = out.write

            def failing(b):
                if out.tell() + len(b) > 1000:
                    raise OSError(5, "injected: the durable storage failed mid-copy")
                return write(b)

            out.write = failing
        return out


def _copies_equal(fast: str, durable: str) -> bool:
    """The durable copy holds the fast copy's data files byte for byte."""
    for name in sorted(os.listdir(fast)):
        if name.endswith(".distcp"):
            with open(os.path.join(fast, name), "rb") as a, open(os.path.join(durable, name), "rb") as b:
                if a.read() != b.read():
                    return False
    return True


def _loads(sd: dict, path: str, **kw) -> bool:
    got = zeros_like(sd)
    solosave.load(got, path, **kw)
    assert_equal(sd, got)
    return True


def copy_and_count(rank: int, ws: int, root: str, timeout: float) -> dict:
    """Create then reuse saves with a durable root: the fast result comes first (a copy held at a
    gate does not delay the next save's publication), then the copies; collectives counted."""
    _fresh(root)
    fast, durable, gate = f"{root}/fast", f"{root}/durable", f"{root}/gate"
    writer = TierWriter(durable, "iter_1", None, "gate", gate=gate)
    out: dict = {"fast": [], "durable": [], "modes": []}
    with solosave.AsyncCheckpointer(prepared_metadata=f"{root}/p.md", create_prepared_metadata=True,
                                    durable_root=durable, timeout=timeout, writer=writer) as ck:
        results = []
        for step in range(3):
            r = ck.save(state(rank, step), f"{fast}/iter_{step}").wait(timeout)
            results.append(r)
            if step == 0:  # copied before the next save is published: none of the three is coalesced
                r.durable.wait(timeout)
            out["modes"].append(r.mode)
            out["fast"].append(r.collectives())
            if step == 2:  # iter_2 published on the fast tier while iter_1's copy waits at its gate
                out["pending_while_next_published"] = not results[1].durable.done()
        dist.barrier()
        if rank == 0:
            open(gate, "w").close()
        for r in results:
            d = r.durable.wait(timeout)
            out["durable"].append({"ok": d.ok, "path": d.path, "calls": [(c.kind, c.payload_bytes) for c in d.collectives],
                                   "error": d.error})
    dist.barrier()
    out["equal"] = all(_copies_equal(f"{fast}/iter_{s}", f"{durable}/iter_{s}") for s in range(3))
    out["fast_loads"] = _loads(state(rank, 2), f"{fast}/iter_2")
    out["durable_loads"] = _loads(state(rank, 2), f"{durable}/iter_2")
    from solosave._src.index.reader import LoadIndex

    idx = LoadIndex.open(f"{durable}/iter_2")  # re-pointed: it belongs to the durable .metadata
    out["index_ok"] = idx is not None
    if idx is not None:
        idx.close()
    md = solosave.load_prepared_metadata(f"{durable}/iter_2").metadata
    out["checkpoint_id"] = md.storage_meta.checkpoint_id
    return out


def failed_copy(rank: int, ws: int, root: str, timeout: float, persistent: bool) -> dict:
    """The durable copy of iter_1 fails on rank 1: reported on every rank, the fast copy stays
    published and loads, nothing is published on the durable tier; iter_2's copy succeeds.
    ``persistent``: a worker process per rank, else a thread of the trainer."""
    _fresh(root)
    fast, durable = f"{root}/fast", f"{root}/durable"
    writer = TierWriter(durable, "iter_1", 1, "fail")
    out: dict = {}
    with solosave.AsyncCheckpointer(assume_constant_structure=True, durable_root=durable, timeout=timeout,
                                    writer=writer, persistent_worker=persistent, durable_retries=1) as ck:
        for step in range(3):
            r = ck.save(state(rank, step), f"{fast}/iter_{step}").wait(timeout)
            d = r.durable.wait(timeout)
            out[step] = {"mode": r.mode, "published": r.published, "ok": d.ok, "failures": sorted(d.failures),
                         "error": d.error, "calls": [c.kind for c in d.collectives], "attempts": d.attempts}
    dist.barrier()
    out["fast_1_loads"] = _loads(state(rank, 1), f"{fast}/iter_1")
    out["durable_1_published"] = os.path.exists(f"{durable}/iter_1/.metadata")
    out["durable_2_loads"] = _loads(state(rank, 2), f"{durable}/iter_2")
    return out


def killed_mid_copy(rank: int, ws: int, root: str, victim: int, timeout: float) -> dict:
    """iter_0 is copied; during iter_1's copy the victim's worker is SIGKILLed (its copy blocked
    after it started). Then every rank recreates its checkpointer and saves iter_2."""
    _fresh(root)
    fast, durable, marker = f"{root}/fast", f"{root}/durable", f"{root}/marker"
    writer = TierWriter(durable, "iter_1", victim, "block", marker=marker)
    out: dict = {}
    ck = solosave.AsyncCheckpointer(assume_constant_structure=True, durable_root=durable, timeout=timeout,
                                    writer=writer)
    r0 = ck.save(state(rank, 0), f"{fast}/iter_0").wait(timeout)
    out["copy_0"] = r0.durable.wait(timeout).ok
    r1 = ck.save(state(rank, 1), f"{fast}/iter_1").wait(timeout)  # published on the fast tier
    out["fast_1"] = r1.published
    t0 = time.monotonic()
    if rank == victim:
        if not wait_until(lambda: os.path.exists(marker), timeout=60):
            raise AssertionError("the victim's copy never started")
        os.kill(worker_pid(ck), signal.SIGKILL)
    d1 = r1.durable.wait(timeout + 10)
    out["copy_1"] = {"ok": d1.ok, "error": d1.error, "after_s": round(time.monotonic() - t0, 2)}
    ck.close(timeout)
    dist.barrier()
    out["durable_1_published"] = os.path.exists(f"{durable}/iter_1/.metadata")
    out["fast_1_loads"] = _loads(state(rank, 1), f"{fast}/iter_1")
    with solosave.AsyncCheckpointer(assume_constant_structure=True, durable_root=durable, timeout=timeout) as ck2:
        r2 = ck2.save(state(rank, 2), f"{fast}/iter_2").wait(timeout)
        d2 = r2.durable.wait(timeout)
    out["copy_2"] = {"ok": d2.ok, "error": d2.error}
    dist.barrier()
    out["durable_2_loads"] = _loads(state(rank, 2), f"{durable}/iter_2")
    return out


def restore_tiers(rank: int, ws: int, root: str, timeout: float) -> dict:
    """Steps 1-3 saved with a durable root (step 3's copy fails); then every rank restores, with
    the fast tier whole, with one rank's shard missing from its own view of the fast tier (a
    node-local fast tier: rank 1 looks at a copy of it), and with the fast tier gone. Each load
    is checked bit for bit; each choice is returned, to compare across ranks."""
    import shutil

    from solosave.integrations import CheckpointManager, find_restore_point

    _fresh(root)
    fast, durable = f"{root}/fast", f"{root}/durable"
    writer = TierWriter(durable, "iter_0000003", 1, "fail")
    ck = solosave.AsyncCheckpointer(assume_constant_structure=True, durable_root=durable, timeout=timeout,
                                    writer=writer)
    manager = CheckpointManager(fast, ck)
    for step in (1, 2, 3):
        manager.save(step, state(rank, step))
    manager.finish()
    out: dict = {"copies": [(d.step, d.result.ok) for d in manager.durable_done]}
    dist.barrier()

    def restore(fast_dir: str, step: int, label: str) -> None:
        sd = zeros_like(state(rank, step))
        out[label] = {"point": find_restore_point(fast_dir, durable), "load": solosave.load(
            sd, f"{fast_dir}/iter_{step:07d}", durable_root=durable)}
        out[label]["exact"] = _loads(state(rank, step), out[label]["load"])

    restore(fast, 3, "whole")  # step 3 is on the fast tier only; complete: restored from there
    restore(fast, 2, "whole_2")
    # rank 1's own view of the fast tier misses its shard of step 3 and step 2
    mine = fast if rank == 0 else f"{root}/fast-rank1"
    if rank == 1:
        shutil.copytree(fast, mine)
        for step in (2, 3):
            os.remove(f"{mine}/iter_{step:07d}/__1_0.distcp")
    dist.barrier()
    restore(mine, 2, "one_rank_missing")
    out["one_rank_missing_3"] = find_restore_point(mine, durable)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(fast)  # the node's fast tier is gone
    dist.barrier()
    restore(fast, 2, "fast_gone")
    got = zeros_like(state(rank, 2))
    manager2 = CheckpointManager(fast, solosave.AsyncCheckpointer(durable_root=durable, timeout=timeout))
    try:
        out["manager"] = manager2.restore(got)
        assert_equal(state(rank, 2), got)
    finally:
        manager2.finish()
    return out


class PeerWriter(solosave.FileWriter):
    """Writes normally, except that opening a data file of rank ``src`` in a fast directory named
    ``target`` fails (``fail``): on the rank that receives ``src``'s peer copy, that is its write."""

    def __init__(self, fast: str, target: str, src: int, fail: bool) -> None:
        super().__init__()
        self.fast, self.target, self.src, self.fail = fast, target, src, fail

    def open(self, path: str):  # noqa: ANN201 - a DataFile
        if (self.fail and path.startswith(self.fast) and os.path.basename(os.path.dirname(path)) == self.target
                and os.path.basename(path).startswith(f"__{self.src}_")):
            raise OSError(28, "injected: no space left on the peer's fast tier")
        return super().open(path)


def peer_copy_shared_tier(rank: int, ws: int, root: str, timeout: float) -> dict:
    """4 ranks as 2 hosts of 2 (ranks_per_host=2) on one fast directory, thread mode: the peer
    stage finds the files where they are (a shared tier) and sends none; nothing is rewritten."""
    _fresh(root)
    fast, durable = f"{root}/fast", f"{root}/durable"
    out: dict = {}
    with solosave.AsyncCheckpointer(assume_constant_structure=True, durable_root=durable, peer_copy=True,
                                    ranks_per_host=2, timeout=timeout, persistent_worker=False) as ck:
        out["ranks_per_host"] = ck.peer_ranks_per_host
        for step in range(2):
            r = ck.save(state(rank, step), f"{fast}/iter_{step}").wait(timeout)
            d = r.durable.wait(timeout)
            sent = sum(c.payload_bytes for c in d.collectives if c.kind == "send")
            out[step] = {"published": r.published, "ok": d.ok, "peer_ok": d.peer_ok, "peer_error": d.peer_error,
                         "calls": sorted({c.kind for c in d.collectives}), "sent": sent}
        try:  # refused at once, on every rank: a host could keep old peer files beside the new .metadata
            ck.save(state(rank, 2), f"{fast}/iter_1", overwrite=True)
            out["overwrite"] = "accepted"
        except ValueError as e:
            out["overwrite"] = str(e)
    dist.barrier()
    out["loads"] = _loads(state(rank, 1), f"{fast}/iter_1") and _loads(state(rank, 1), f"{durable}/iter_1")
    out["equal"] = _copies_equal(f"{fast}/iter_1", f"{durable}/iter_1")
    out["leftovers"] = sorted(n for n in os.listdir(f"{fast}/iter_1") if not n.startswith(("__", ".")))
    return out


def durable_root_reaching_fast(rank: int, ws: int, root: str, timeout: float) -> dict:
    """A durable root that resolves to the fast checkpoint's own parent (a symbolic link, a
    ``..`` path): every overwrite save into the published checkpoint is refused on every rank,
    by the checkpointer and by the drop-in, and the checkpoint still loads bit-exactly."""
    _fresh(root)
    fast = f"{root}/fast"
    with solosave.AsyncCheckpointer(timeout=timeout) as ck:
        ck.save(state(rank, 1), f"{fast}/iter_1").wait(timeout)
    dist.barrier()
    if rank == 0:
        os.symlink(fast, f"{root}/link")
        os.makedirs(f"{root}/other")
    dist.barrier()
    out: dict = {"errors": []}
    for bad in (f"{root}/link", f"{root}/other/../fast", fast):
        with solosave.AsyncCheckpointer(durable_root=bad, timeout=timeout) as ck:
            try:
                ck.save(state(rank, 2), f"{fast}/iter_1", overwrite=True).wait(timeout)
            except (ValueError, solosave.CheckpointError) as e:
                out["errors"].append(str(e))
    with solosave.DcpSaver(durable_root=f"{root}/link", timeout=timeout) as saver:  # the drop-in overwrites
        try:
            saver.save(state(rank, 2), checkpoint_id=f"{fast}/iter_1")
        except (ValueError, solosave.CheckpointError) as e:
            out["errors"].append(str(e))
    dist.barrier()
    out["loads"] = _loads(state(rank, 1), f"{fast}/iter_1")
    return out


def stale_and_damaged_fast_copies(rank: int, ws: int, root: str, timeout: float) -> dict:
    """Step 10 of this job on both tiers; rank 1's view of the fast tier holds another job's
    step 10 (same name and model, other values): every rank restores this job's, from the
    durable tier. Then the fast copy is damaged: a truncated data file (seen through the load
    index's file ends), and a truncated one in a copy without its index (found only while
    loading): every rank loads the durable copy instead. Each load is checked bit for bit."""
    import shutil

    from solosave.integrations import CheckpointManager, find_restore_point

    _fresh(root)
    fast, durable, old = f"{root}/fast", f"{root}/durable", f"{root}/old"
    with solosave.AsyncCheckpointer(timeout=timeout) as ck:  # the other job: step 10, other values
        ck.save(state(rank, 99), f"{old}/iter_0000010").wait(timeout)
    manager = CheckpointManager(fast, solosave.AsyncCheckpointer(durable_root=durable, timeout=timeout))
    manager.save(10, state(rank, 10))
    manager.finish()
    dist.barrier()
    out: dict = {}

    def restore(fast_dir: str, label: str) -> None:
        sd = zeros_like(state(rank, 10))
        out[label] = {"point": find_restore_point(fast_dir, durable),
                      "load": solosave.load(sd, f"{fast_dir}/iter_0000010", durable_root=durable)}
        assert_equal(state(rank, 10), sd)

    restore(fast if rank == 0 else old, "other_job_on_one_host")
    if rank == 0:
        shutil.copytree(fast, f"{root}/cut")
        shutil.copytree(fast, f"{root}/cut-noindex")
        os.remove(f"{root}/cut-noindex/iter_0000010/.solosave-index")
        for d in ("cut", "cut-noindex"):
            os.truncate(f"{root}/{d}/iter_0000010/__1_0.distcp", 100)
    dist.barrier()
    restore(f"{root}/cut", "truncated")
    restore(f"{root}/cut-noindex", "truncated_no_index")
    return out


def stalled_durable_tier(rank: int, ws: int, root: str, timeout: float, saves: int) -> dict:
    """The durable store stalls (step 1's copy waits at a gate) while ``saves`` saves are made
    through a ``CheckpointManager``: every save must publish on the fast tier while the gate is
    still shut; then the gate opens and the copies catch up."""
    from solosave.integrations import CheckpointManager, read_latest_marker

    _fresh(root)
    fast, durable, gate = f"{root}/fast", f"{root}/durable", f"{root}/gate"
    writer = TierWriter(durable, "iter_0000001", None, "gate", gate=gate)
    ck = solosave.AsyncCheckpointer(assume_constant_structure=True, durable_root=durable, timeout=timeout,
                                    writer=writer)
    manager = CheckpointManager(fast, ck, keep_last=2)
    results = []
    for step in range(1, saves + 1):
        manager.save(step, state(rank, step))
        results.append(manager.wait(timeout)[-1].result)
    out: dict = {"gate_shut_after_saves": not os.path.exists(gate),
                 "behind": [r.durable_behind for r in results], "lag_s": [r.durable_lag_s for r in results]}

    def listed() -> list[str]:
        manager.poll()  # collects the coalesced copies' reports: their sources may go
        manager.wait_for_pruning(timeout)
        return sorted(n for n in os.listdir(fast) if n.startswith("iter_"))

    wait_until(lambda: len(listed()) <= 3, timeout=20)  # bounded: the assertion says what was left
    out["fast_while_stalled"] = listed()
    dist.barrier()
    if rank == 0:
        open(gate, "w").close()
    manager.wait_for_copies(timeout)
    out["copies"] = [(d.step, d.result.ok, d.result.superseded) for d in manager.durable_done]
    out["failures"] = [d.step for d in manager.durable_failures]
    dist.barrier()  # rank 0 moved the durable latest when it collected the copies
    out["latest"] = read_latest_marker(durable)
    manager.finish(timeout)
    out["newest_loads"] = _loads(state(rank, saves), f"{durable}/iter_{saves:07d}")
    return out


def mismatched_setup(rank: int, ws: int, root: str, case: str) -> str:
    """Rank 0 and rank 1 construct their checkpointers with different two-tier settings: every
    rank must refuse, with the same message (their copiers' collectives would not pair)."""
    kwargs: dict = {"durable_root": f"{root}/durable"}
    if case == "durable_root" and rank == 1:
        kwargs = {}
    if case == "durable_every_save" and rank == 0:
        kwargs["durable_every_save"] = True
    if case == "durable_retries" and rank == 1:
        kwargs["durable_retries"] = 0
    try:
        solosave.AsyncCheckpointer(assume_constant_structure=True, timeout=30, **kwargs).close()
    except ValueError as e:
        return str(e)
    return "accepted"
