"""Fault injection for the reliability suite: faulty writers, rank functions and a runner that
tolerates ranks dying (module-level: spawned trainers and workers import it).

Every fault is injected by a test fixture (a ``FileWriter`` subclass, a signal, a patch inside
the worker process installed by that writer); solosave itself has no fault switches.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist

import solosave
from solosave._src.testing.introspect import worker_pid
from tests.support import equal as _equal
from tests.support import fresh as _fresh
from tests.support import zeros_like as _zeros

#: Bound for a checkpointer's first save, which includes starting the worker processes (slow
#: on a loaded 2-core machine); fault detection itself is bounded by the tests' ``timeout``.
SETUP_WAIT = 120.0

# -- state dicts ------------------------------------------------------------------------------


def sd_at(rank: int, step: int) -> dict:
    """A small training state whose values depend on ``step`` (same structure at every step)."""
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "model": {"w": torch.randn(96, 64, generator=g), "b": torch.randn(64, generator=g),
                  "h": torch.randn(32, 32, generator=g).to(torch.bfloat16)},
        "opt": {"m": torch.randn(96, 64, generator=g)},
        "step": step, "tag": f"step-{step:06d}",
        f"rank{rank}": torch.full((8,), float(rank * 100000 + step)),
    }


def set_step(sd: dict, rank: int, step: int) -> None:
    """Change every value in place to those of ``step`` (what a training step does)."""
    new = sd_at(rank, step)
    for group in ("model", "opt"):
        for k, t in sd[group].items():
            t.copy_(new[group][k])
    sd["step"], sd["tag"] = new["step"], new["tag"]
    sd[f"rank{rank}"].copy_(new[f"rank{rank}"])


def full_at(ws: int, step: int) -> dict:
    """Every key of a checkpoint saved at world size ``ws`` (for a one-process load)."""
    out = sd_at(0, step)
    for r in range(1, ws):
        out[f"rank{r}"] = sd_at(r, step)[f"rank{r}"]
    return out


def check_loads(path: str, ws: int, step: int, extra: dict | None = None) -> None:
    """One process, no process group: solosave.load and stock DCP load both read ``path`` and
    return exactly the values of ``step`` (plus ``extra`` items)."""
    import torch.distributed.checkpoint as dcp

    want = dict(full_at(ws, step), **(extra or {}))
    got = _zeros(want)
    solosave.load(got, path)
    if not _equal(got, want):
        raise AssertionError(f"{path}: solosave.load returned values other than step {step}'s")
    got2 = _zeros(want)
    dcp.load(got2, checkpoint_id=path, no_dist=True)
    if not _equal(got2, want):
        raise AssertionError(f"{path}: stock dcp.load returned values other than step {step}'s")


def loaders_refuse(path: str, ws: int) -> tuple[str, str]:
    """Both loaders refuse an unpublished checkpoint; returns their error types."""
    import torch.distributed.checkpoint as dcp

    out = []
    for load in (lambda sd: solosave.load(sd, path),
                 lambda sd: dcp.load(sd, checkpoint_id=path, no_dist=True)):
        try:
            load(_zeros(full_at(ws, 0)))
        except (Exception, BaseException) as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            if isinstance(e, KeyboardInterrupt):
                raise
            out.append(type(e).__name__)
        else:
            raise AssertionError(f"{path}: a loader read a checkpoint that has no .metadata")
    assert out[0] == "PreparedMetadataError", f"solosave.load raised {out[0]}, not its own error"
    return out[0], out[1]


# -- faulty writers (test fixtures) ------------------------------------------------------------


class FaultWriter(solosave.FileWriter):
    """Writes normally, except on rank ``rank`` for the checkpoint directory named ``target``:

    * ``"eio"`` / ``"enospc"``: write half of the file's records, then raise that ``OSError``;
    * ``"block"``: write half of the records, create ``marker``, then sleep ``block_s``
      (the test kills the worker meanwhile: a kill in the middle of writing);
    * ``"publish_block"`` (rank 0, the coordinator): write normally, but patch the worker's
      commit primitive so that the rename of ``publish_dst`` blocks after its temporary file
      is written and fsynced (the test kills the worker there);
    * ``"publish_block_after"``: the same, but the rename is done first, then it blocks (the
      test kills the worker after publication, before its receipt);
    * ``"delay"``: create ``marker`` (if given), then sleep ``block_s`` before writing normally.

    ``delay_s`` slows every file write down (for back-pressure tests).
    """

    def __init__(self, rank: int, target: str | None, action: str, marker: str | None = None,
                 block_s: float = 60.0, delay_s: float = 0.0, publish_dst: str | None = None) -> None:
        super().__init__()
        self.rank, self.target, self.action = rank, target, action
        self.marker, self.block_s, self.delay_s, self.publish_dst = marker, block_s, delay_s, publish_dst

    def write_file(self, directory, relative_path, records):
        if self.delay_s:
            time.sleep(self.delay_s)
        hit = (os.path.basename(directory) == self.target
               and relative_path.startswith(f"__{self.rank}_"))
        if not hit:
            return super().write_file(directory, relative_path, records)
        if self.action in ("publish_block", "publish_block_after"):
            _install_blocking_replace(self.publish_dst or "", self.marker or "", self.block_s,
                                      after=self.action == "publish_block_after")
            return super().write_file(directory, relative_path, records)
        if self.action == "delay":
            _touch(self.marker)
            time.sleep(self.block_s)
            return super().write_file(directory, relative_path, records)
        super().write_file(directory, relative_path, records[: max(len(records) // 2, 1)])
        if self.action == "eio":
            raise OSError(errno.EIO, "injected I/O error", relative_path)
        if self.action == "enospc":
            raise OSError(errno.ENOSPC, "No space left on device (injected)", relative_path)
        if self.action == "block":
            _touch(self.marker)
            time.sleep(self.block_s)
            raise OSError(errno.EIO, "blocked writer woke up (the test should have killed it)")
        raise ValueError(f"unknown action {self.action!r}")


def _touch(path: str | None, text: str = "") -> None:
    if path:
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)


class _BlockingOs:
    """Stands in for ``os`` inside ``solosave._src.storage.local`` of one worker process: ``replace`` onto
    ``dst`` signals ``marker`` and blocks (the temporary file is complete and fsynced by then);
    with ``after``, it renames first, then signals and blocks."""

    def __init__(self, real: Any, dst: str, marker: str, block_s: float, after: bool = False) -> None:
        self._real, self._dst, self._marker, self._block_s, self._after = real, dst, marker, block_s, after

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def replace(self, src: Any, dst: Any) -> None:
        if os.fspath(dst) != self._dst:
            return self._real.replace(src, dst)
        if self._after:
            self._real.replace(src, dst)
        _touch(self._marker, os.fspath(src))
        time.sleep(self._block_s)
        if not self._after:
            self._real.replace(src, dst)


def _install_blocking_replace(dst: str, marker: str, block_s: float, after: bool = False) -> None:
    import solosave._src.storage.local as local  # where RenameCommit (temp file, fsync, rename) lives

    if not isinstance(local.os, _BlockingOs):
        local.os = _BlockingOs(os, dst, marker, block_s, after)


def wait_for_file(path: str, timeout: float = 30.0) -> float:
    t0 = time.monotonic()
    while not os.path.exists(path):
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{path} did not appear within {timeout} s")
        time.sleep(0.01)
    return time.monotonic() - t0


# -- process and resource accounting ---------------------------------------------------------


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("State:"):
                    return not line.split()[1].startswith("Z")
    except FileNotFoundError:
        return False
    return False


def children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid and fields[0] != "Z":
                    out.append(int(d))
            except (FileNotFoundError, ProcessLookupError, IndexError):
                pass
    return out


def shm_segments() -> list[str]:
    """Named solosave segments in /dev/shm (there should never be any: buffers are unlinked as
    soon as they are created)."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("solosave_"))


def staging_mappings(pid: int | str = "self") -> list[str]:
    """The staging buffers process ``pid`` maps (unlinked files: named in its memory map)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return sorted({line.split("/")[-1].split()[0] for line in f if "/solosave_" in line})
    except (FileNotFoundError, ProcessLookupError):
        return []


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _error(e: BaseException, t0: float) -> dict:
    return {"type": type(e).__name__, "msg": str(e), "after_s": round(time.monotonic() - t0, 2),
            "is_checkpoint_error": isinstance(e, solosave.CheckpointError),
            "failures": sorted(getattr(e, "failures", {}) or {})}


def _wait(handle: Any, timeout: float) -> dict:
    t0 = time.monotonic()
    try:
        r = handle.wait(timeout)
    except Exception as e:  # noqa: BLE001 - the error is what the test inspects
        return _error(e, t0)
    return {"type": None, "mode": r.mode, "published": r.published, "after_s": round(time.monotonic() - t0, 2)}


def _reuse_ck(root: str, timeout: float, writer: Any = None, **kw: Any) -> solosave.AsyncCheckpointer:
    return solosave.AsyncCheckpointer(prepared_metadata=f"{root}/prep.md", create_prepared_metadata=True,
                                      timeout=timeout, writer=writer, **kw)


def _recover(rank: int, root: str, sd: dict, step: int, name: str, timeout: float) -> dict:
    """Recovery after a fault: a new checkpointer on every rank, one save, waited for."""
    t0 = time.monotonic()
    with _reuse_ck(root, timeout) as ck:
        set_step(sd, rank, step)
        out = _wait(ck.save(sd, f"{root}/{name}"), SETUP_WAIT)
    out["recover_s"] = round(time.monotonic() - t0, 2)
    return out


def recover_job(rank: int, ws: int, root: str, timeout: float) -> dict:
    """A restarted job (new processes) after a rank died: reuse the prepared file and save c2."""
    return _recover(rank, root, sd_at(rank, 0), 2, "c2", timeout)


# -- rank functions: faults --------------------------------------------------------------------


def worker_killed_mid_write(rank: int, ws: int, root: str, victim: int, timeout: float) -> dict:
    """c0 (create) and c1 (reuse) succeed; during c2's write the victim's worker is SIGKILLed
    after writing half of its file; then every rank recreates its checkpointer and saves c3."""
    _fresh(root)
    marker = f"{root}/marker"
    sd = sd_at(rank, 0)
    out: dict = {}
    ck = _reuse_ck(root, timeout, FaultWriter(victim, "c2", "block", marker))
    ck.save(sd, f"{root}/c0").wait(SETUP_WAIT)
    set_step(sd, rank, 1)
    ck.save(sd, f"{root}/c1").wait(timeout)
    set_step(sd, rank, 2)
    h = ck.save(sd, f"{root}/c2")
    t0 = time.monotonic()
    if rank == victim:
        wait_for_file(marker)
        os.kill(worker_pid(ck), signal.SIGKILL)
    out["c2"] = _wait(h, timeout)
    out["c2"]["after_s"] = round(time.monotonic() - t0, 2)
    t1 = time.monotonic()
    ck.close(timeout)
    out["close_s"] = round(time.monotonic() - t1, 2)
    out["worker_alive_after_close"] = alive(worker_pid(ck))
    dist.barrier()
    out["c3"] = _recover(rank, root, sd, 3, "c3", timeout)
    return out


def write_error_once(rank: int, ws: int, root: str, action: str, reuse: bool, timeout: float) -> dict:
    """c0 succeeds; c1 fails on rank ws-1 with ``action`` (EIO/ENOSPC after half a file); c2,
    with the same checkpointer (the process survived), must succeed."""
    _fresh(root)
    victim = ws - 1
    sd = sd_at(rank, 0)
    w = FaultWriter(victim, "c1", action)
    kw = dict(prepared_metadata=f"{root}/prep.md", create_prepared_metadata=True) if reuse else {}
    out: dict = {}
    with solosave.AsyncCheckpointer(timeout=timeout, writer=w, **kw) as ck:
        out["c0"] = _wait(ck.save(sd, f"{root}/c0"), SETUP_WAIT)
        set_step(sd, rank, 1)
        out["c1"] = _wait(ck.save(sd, f"{root}/c1"), timeout)
        set_step(sd, rank, 2)
        out["c2"] = _wait(ck.save(sd, f"{root}/c2"), timeout)
    return out


def coordinator_killed_at_publish(rank: int, ws: int, root: str, what: str, timeout: float) -> dict:
    """The coordinator's worker is SIGKILLed with the temporary file complete and before the
    rename: ``what="metadata"``: of c1's ``.metadata`` (reuse save); ``what="prepared"``: of the
    prepared file's refresh (c1 drifts: a list outgrows its slot; the fallback path refreshes)."""
    _fresh(root)
    marker = f"{root}/marker"
    prep = f"{root}/prep.md"
    dst = f"{root}/c1/.metadata" if what == "metadata" else prep
    sd = sd_at(rank, 0)
    sd["sched"] = [0.5] * 4
    w = FaultWriter(0, "c1", "publish_block", marker, publish_dst=dst)
    out: dict = {}
    ck = _reuse_ck(root, timeout, w)
    ck.save(sd, f"{root}/c0").wait(SETUP_WAIT)
    dist.barrier()
    out["prep_before"] = open(prep, "rb").read() if rank == 0 else None
    set_step(sd, rank, 1)
    if what == "prepared":
        sd["sched"] = [0.5] * 3000  # outgrows its slot: layout drift -> fallback -> refresh
    h = ck.save(sd, f"{root}/c1")
    t0 = time.monotonic()
    if rank == 0:
        wait_for_file(marker)
        out["tmp_file"] = open(marker).read()
        out["tmp_exists_at_kill"] = os.path.exists(out["tmp_file"])
        os.kill(worker_pid(ck), signal.SIGKILL)
    out["c1"] = _wait(h, timeout)
    out["c1"]["after_s"] = round(time.monotonic() - t0, 2)
    ck.close(timeout)
    dist.barrier()
    out["prep_after"] = open(prep, "rb").read() if rank == 0 and os.path.exists(prep) else None
    out["c2"] = _recover(rank, root, sd, 2, "c2", timeout)
    return out


def receipt_lost(rank: int, ws: int, root: str, timeout: float) -> dict:
    """c0 (create) succeeds; in c1 (reuse) the coordinator's worker renames ``.metadata`` into
    place and is SIGKILLed before it posts its publication receipt. Every rank reports what it
    knows of c1's publication; then every rank recreates its checkpointer and saves c2."""
    _fresh(root)
    marker = f"{root}/marker"
    sd = sd_at(rank, 0)
    w = FaultWriter(0, "c1", "publish_block_after", marker, publish_dst=f"{root}/c1/.metadata")
    out: dict = {}
    ck = _reuse_ck(root, timeout, w)
    ck.save(sd, f"{root}/c0").wait(SETUP_WAIT)
    set_step(sd, rank, 1)
    h = ck.save(sd, f"{root}/c1")
    t0 = time.monotonic()
    if rank == 0:
        wait_for_file(marker)
        out["published_at_kill"] = os.path.exists(f"{root}/c1/.metadata")
        os.kill(worker_pid(ck), signal.SIGKILL)
    out["c1"] = _wait(h, timeout)
    out["c1"]["after_s"] = round(time.monotonic() - t0, 2)
    ck.close(timeout)  # rank 0's store goes with it: what the other ranks were waiting on
    dist.barrier()
    out["c2"] = _recover(rank, root, sd, 2, "c2", timeout)
    return out


def rank_dies(rank: int, ws: int, root: str, victim: int, when: str, timeout: float) -> dict:
    """c0 succeeds; then the victim rank's process dies (SIGKILL of the trainer, which takes
    its worker with it): ``when="between"`` before c1 is requested; ``when="all_reduce"`` while
    the other ranks wait in c1's status all_reduce (the victim's write is slow)."""
    _fresh(root)
    sd = sd_at(rank, 0)
    w = FaultWriter(victim, "c1", "delay", block_s=3.0)
    ck = _reuse_ck(root, timeout, w)
    ck.save(sd, f"{root}/c0").wait(SETUP_WAIT)
    dist.barrier()
    with open(f"{root}/worker.{rank}", "w") as f:
        f.write(str(worker_pid(ck)))
    if rank == victim and when == "between":
        os.kill(os.getpid(), signal.SIGKILL)
    set_step(sd, rank, 1)
    h = ck.save(sd, f"{root}/c1")
    _touch(f"{root}/saving.{rank}")
    if rank == victim:  # once every other rank handed its save to its worker: die mid-save
        for r in range(dist.get_world_size()):
            wait_for_file(f"{root}/saving.{r}")
        os.kill(os.getpid(), signal.SIGKILL)
    out = {"c1": _wait(h, timeout)}
    t1 = time.monotonic()
    ck.close(timeout)
    out["close_s"] = round(time.monotonic() - t1, 2)
    out["worker_alive_after_close"] = alive(worker_pid(ck))
    return out


def back_to_back(rank: int, ws: int, root: str, saves: int, timeout: float) -> dict:
    """``saves`` reuse saves requested back to back (each ``save()`` while the previous one is
    still writing: the writer is slow); values change between saves and right after each
    ``save()`` returns."""
    _fresh(root)
    sd = sd_at(rank, 0)
    w = FaultWriter(-1, None, "none", delay_s=0.05)
    blocks, handles, rss, segs = [], [], [], []
    with _reuse_ck(root, timeout, w) as ck:
        for i in range(saves):
            set_step(sd, rank, i)
            t0 = time.perf_counter()
            h = ck.save(sd, f"{root}/s{i:03d}")
            blocks.append(time.perf_counter() - t0)
            if i == 0:
                h.wait(SETUP_WAIT)  # the first save includes the worker's start
            handles.append(h)
            set_step(sd, rank, 10**6)  # the next "training step" overwrites the values at once
            if i in (2, saves - 1):
                rss.append((rss_kib(os.getpid()), rss_kib(worker_pid(ck))))
                segs.append(len(staging_mappings()))
        last = handles[-1].wait(timeout)
        done_before = [h.done() for h in handles]
        errors = []
        for h in handles:
            try:
                h.wait(0.0)
            except Exception as e:  # noqa: BLE001
                errors.append(str(e))
    return {"blocks": blocks, "rss": rss, "segments": segs, "done": done_before, "errors": errors,
            "last_mode": last.mode}


def close_in_flight(rank: int, ws: int, root: str, timeout: float) -> dict:
    """(a) ``close()`` right after ``save()``: the save finishes and is published;
    (b) ``close(timeout=2)`` while rank 1's write is stuck: close returns in bounded time, the
    save is abandoned (no ``.metadata``), its handle raises, the worker is gone."""
    _fresh(root)
    sd = sd_at(rank, 0)
    out: dict = {}
    ck = _reuse_ck(root, timeout)
    h = ck.save(sd, f"{root}/a")
    t0 = time.monotonic()
    ck.close(SETUP_WAIT)  # the first save includes the worker's start
    out["a_close_s"] = round(time.monotonic() - t0, 2)
    out["a"] = _wait(h, 1.0)
    dist.barrier()
    stuck = f"{root}/b.stuck"
    ck = _reuse_ck(root, timeout, FaultWriter(1, "b", "delay", marker=stuck, block_s=30.0))
    ck.save(sd, f"{root}/warm").wait(SETUP_WAIT)  # the worker is up; its next save gets stuck
    set_step(sd, rank, 1)
    h = ck.save(sd, f"{root}/b")
    wait_for_file(stuck, timeout)  # rank 1's write is stuck now (both ranks see the directory)
    t0 = time.monotonic()
    ck.close(timeout=2.0)
    out["b_close_s"] = round(time.monotonic() - t0, 2)
    out["b"] = _wait(h, 1.0)
    out["b_worker_alive"] = alive(worker_pid(ck))
    out["b_segments"] = staging_mappings() + [s for s in shm_segments() if s.startswith(f"solosave_{os.getpid()}_")]
    try:
        ck.save(sd, f"{root}/c")
        out["save_after_close"] = None
    except Exception as e:  # noqa: BLE001
        out["save_after_close"] = f"{type(e).__name__}: {e}"
    dist.barrier()
    out["c"] = _recover(rank, root, sd, 2, "c", timeout)
    return out


def out_of_step(rank: int, ws: int, root: str, timeout: float) -> dict:
    """Rank 1's ``save()`` of c1 raises (a value it alone holds cannot be serialized), so it
    never hands c1 to its worker; the other ranks did. Both carry on with c2, c3: no save may be
    published from files of different saves; recreating the checkpointer recovers."""
    _fresh(root)
    sd = sd_at(rank, 0)
    out: dict = {"steps": {}}
    ck = _reuse_ck(root, timeout)
    ck.save(sd, f"{root}/c0").wait(SETUP_WAIT)
    for i in (1, 2, 3):
        set_step(sd, rank, i)
        bad = dict(sd, extra=(lambda x: x)) if (rank == 1 and i == 1) else sd
        t0 = time.monotonic()
        try:
            h = ck.save(bad, f"{root}/c{i}")
        except Exception as e:  # noqa: BLE001
            out["steps"][i] = {"save": _error(e, t0)}
            continue
        out["steps"][i] = {"wait": _wait(h, timeout)}
    ck.close(timeout)
    dist.barrier()
    out["c4"] = _recover(rank, root, sd, 4, "c4", timeout)
    return out


# -- rank functions: bad input -------------------------------------------------------------------


def bad_prepared_files(rank: int, ws: int, root: str, timeout: float) -> dict:
    """A good prepared file is made (c0); then copies of it that are wrong in one way each are
    given to a new checkpointer. Returns, per case, the error and whether any file changed."""
    import pickle

    _fresh(root)
    sd = sd_at(rank, 0)
    with _reuse_ck(root, timeout) as ck:
        ck.save(sd, f"{root}/c0").wait(SETUP_WAIT)
    good = open(f"{root}/prep.md", "rb").read()
    marker = f"{root}/pwned"
    cases: dict = {}

    class _Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    variants = {
        "truncated": good[: len(good) // 2],
        "corrupt": good[: len(good) // 2] + bytes(b ^ 0x5A for b in good[len(good) // 2:]),
        # a format-1 file (still accepted) whose metadata pickle would run a command
        "unsafe": b"SOLOSAVE-PREPARED\n1\n" + json.dumps({"world_size": ws, "workers": 1, "structure_hash": "x"}
                                                          ).encode() + b"\n" + pickle.dumps(_Evil(), protocol=2),
        "empty": b"",
    }
    if rank == 0:
        for name, data in variants.items():
            with open(f"{root}/{name}.md", "wb") as f:
                f.write(data)
    dist.barrier()
    for name in variants:
        path = f"{root}/{name}.md"
        t0 = time.monotonic()
        for create in (False, True):
            try:
                solosave.AsyncCheckpointer(prepared_metadata=path, create_prepared_metadata=create,
                                           timeout=timeout).close()
                cases[f"{name}/create={create}"] = None
            except Exception as e:  # noqa: BLE001
                cases[f"{name}/create={create}"] = _error(e, t0)
        cases[f"{name}/unchanged"] = open(path, "rb").read() == variants[name]
    cases["unsafe/executed"] = os.path.exists(marker)
    # another workers count
    t0 = time.monotonic()
    try:
        solosave.AsyncCheckpointer(prepared_metadata=f"{root}/prep.md", workers=2, timeout=timeout).close()
        cases["workers"] = None
    except Exception as e:  # noqa: BLE001
        cases["workers"] = _error(e, t0)
    # another structure (another model at the same world size and workers): drift, raise
    other = {"model": {"w": torch.ones(7, 3)}, "step": 1}
    t0 = time.monotonic()
    with solosave.AsyncCheckpointer(prepared_metadata=f"{root}/prep.md", on_layout_drift="raise",
                                    timeout=timeout) as ck:
        cases["structure/raise"] = _wait(ck.save(other, f"{root}/o1"), SETUP_WAIT)
    dist.barrier()
    cases["structure/prep_unchanged"] = open(f"{root}/prep.md", "rb").read() == good
    cases["structure/o1_metadata"] = os.path.exists(f"{root}/o1/.metadata")
    return cases


def bad_values(rank: int, ws: int, root: str, timeout: float) -> dict:
    """Unsupported values on every rank: ``save()`` raises at once, nothing is handed to the
    workers, and the same checkpointer then saves normally. And a destination that cannot be
    created (below a regular file)."""
    _fresh(root)
    sd = sd_at(rank, 0)
    out: dict = {}
    bads = {"lambda": lambda x: x, "sparse": torch.ones(3).to_sparse(),
            "meta_tensor": torch.empty(3, device="meta"), "open_file": open(os.devnull)}
    with _reuse_ck(root, timeout) as ck:
        for name, v in bads.items():
            t0 = time.monotonic()
            try:
                ck.save(dict(sd, bad=v), f"{root}/{name}")
                out[name] = None
            except Exception as e:  # noqa: BLE001
                out[name] = _error(e, t0)
            out[f"{name}/files"] = sorted(os.listdir(f"{root}/{name}")) if os.path.isdir(f"{root}/{name}") else None
        bads["open_file"].close()
        if rank == 0:
            open(f"{root}/plainfile", "w").close()
        dist.barrier()
        t0 = time.monotonic()
        try:
            ck.save(sd, f"{root}/plainfile/sub")
            out["below_file"] = None
        except Exception as e:  # noqa: BLE001
            out["below_file"] = _error(e, t0)
        out["after"] = _wait(ck.save(sd, f"{root}/good"), SETUP_WAIT)
    return out


def read_only_destination(rank: int, ws: int, root: str, timeout: float) -> dict:
    _fresh(root)
    sd = sd_at(rank, 0)
    ro = f"{root}/ro"
    if rank == 0:
        os.makedirs(ro)
        os.chmod(ro, 0o555)
    dist.barrier()
    out: dict = {}
    with _reuse_ck(root, timeout) as ck:
        t0 = time.monotonic()
        try:
            ck.save(sd, f"{ro}/c0")
            out["new_dir"] = None
        except Exception as e:  # noqa: BLE001
            out["new_dir"] = _error(e, t0)
        out["after"] = _wait(ck.save(sd, f"{root}/c0"), SETUP_WAIT)
    dist.barrier()
    if rank == 0:
        os.chmod(ro, 0o755)
    return out


# -- soak ---------------------------------------------------------------------------------------


def soak(rank: int, ws: int, root: str, saves: int, timeout: float) -> dict:
    """``saves`` reuse saves with new values each; RSS, fds and children before and after."""
    _fresh(root)
    sd = sd_at(rank, 0)
    me = os.getpid()
    fds0 = open_fds()
    kids0 = children(me)
    with _reuse_ck(root, timeout) as ck:
        ck.save(sd, f"{root}/s0000").wait(SETUP_WAIT)
        modes = {}
        t0 = time.monotonic()
        start = None
        for i in range(1, saves + 1):
            set_step(sd, rank, i)
            r = ck.save(sd, f"{root}/s{i:04d}").wait(timeout)
            modes[r.mode] = modes.get(r.mode, 0) + 1
            if i == 10:
                start = {"trainer_rss_kib": rss_kib(me), "worker_rss_kib": rss_kib(worker_pid(ck)),
                         "fds": open_fds()}
        elapsed = time.monotonic() - t0
        end = {"trainer_rss_kib": rss_kib(me), "worker_rss_kib": rss_kib(worker_pid(ck)), "fds": open_fds()}
        wpid = worker_pid(ck)
        kids_during = children(me)
    dist.barrier()
    return {"modes": modes, "seconds": elapsed, "start": start, "end": end, "fds_before": fds0,
            "fds_after_close": open_fds(), "children_before": kids0, "children_during": kids_during,
            "children_after": children(me), "worker_alive_after_close": alive(wpid), "worker_pid": wpid}


def mixed_soak(rank: int, ws: int, root: str, steps: int, timeout: float) -> dict:
    """Saves to new paths, same-path saves with and without overwrite, layout drifts and dropped
    checkpointers, in a seeded random order (the same on every rank); after every step every
    published checkpoint this run made still loads with both loaders and holds what was saved."""
    import gc
    import random

    _fresh(root)
    rng = random.Random(12345)
    sd = sd_at(rank, 0)
    me = os.getpid()
    fds0, kids0 = open_fds(), children(me)
    expect: dict[str, tuple[int, str]] = {}
    counts: dict[str, int] = {}
    ck = _reuse_ck(root, timeout)
    last = f"{root}/s0000"
    ck.save(sd, last).wait(SETUP_WAIT)
    expect[last] = (0, sd["tag"])
    for i in range(1, steps + 1):
        action = rng.choice(["new", "new", "same", "overwrite", "drift", "drop"])
        counts[action] = counts.get(action, 0) + 1
        set_step(sd, rank, i)
        if action == "drift":
            sd["tag"] = f"step-{i:06d}-" + "x" * rng.choice([10, 3000, 9000])
        if action == "drop":
            del ck  # dropped without close(): its finalizer stops the worker and frees the segment
            gc.collect()
            ck = _reuse_ck(root, timeout)
        if action == "same":
            try:
                ck.save(sd, last)
                raise AssertionError(f"step {i}: a re-save without overwrite was accepted")
            except solosave.CheckpointExistsError:
                pass
        else:
            path = last if action == "overwrite" else f"{root}/s{i:04d}"
            r = ck.save(sd, path, overwrite=action == "overwrite").wait(timeout)
            assert r.published, (i, action)
            expect[path], last = (i, sd["tag"]), path
        dist.barrier()
        for path, (step, tag) in expect.items():
            check_loads(path, ws, step, extra={"tag": tag})
        dist.barrier()  # no rank overwrites a checkpoint another rank is still reading
    ck.close()
    del ck
    gc.collect()
    dist.barrier()
    return {"counts": counts, "checkpoints": len(expect), "fds_before": fds0, "fds_after": open_fds(),
            "children_before": kids0, "children_after": children(me)}


def one_rank_cannot_read_prepared(rank: int, ws: int, root: str, timeout: float) -> dict:
    """A good prepared file is made; then rank 1 alone is given a file it cannot read (a path
    that does not exist there). Every rank must fail at construction, long before ``timeout``."""
    _fresh(root)
    with _reuse_ck(root, timeout) as ck:
        ck.save(sd_at(rank, 0), f"{root}/c0").wait(SETUP_WAIT)
    dist.barrier()
    path = f"{root}/prep.md" if rank == 0 else f"{root}/missing-on-this-host.md"
    t0 = time.monotonic()
    try:
        solosave.AsyncCheckpointer(prepared_metadata=path, timeout=timeout).close()
        return {"error": None}
    except Exception as e:  # noqa: BLE001
        return {"error": _error(e, t0), "seconds": time.monotonic() - t0}
