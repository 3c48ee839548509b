"""The save benchmark: every mode on real local ranks, with the physical limits of the machine.

For each world size, each mode runs in fresh processes (``benchmarks/ranks.run_ranks``, gloo on
127.0.0.1, CPU tensors, bounded by ``--timeout``). Every rank holds its own keys ``t{rank}_{i}`` (``count / world_size``
fp32 tensors of ``total_mib / count`` MiB), so the checkpoint holds ``total_mib`` MiB whatever the
world size. Per save: a barrier, the timed save (the window), a barrier, rank 0 deletes the
checkpoint, every tensor changes (``add_(1)``, a training step); only the save is timed.

Modes (``MODES``):

``dcp_save``                  ``torch.distributed.checkpoint.save`` (synchronous: block = to_published)
``dcp_async_thread``          ``async_save`` with the thread executor (the default)
``dcp_async_thread_plancache``    the same with ``DefaultSavePlanner(enable_plan_caching=True)``
``dcp_async_process``         ``async_save(async_checkpointer_type=AsyncCheckpointerType.PROCESS)``
``dcp_async_process_plancache``   the same with plan caching
``dcp_async_nocoll``          ``async_save(use_collectives=False)``: **writes no global .metadata**
                              (one ``__{rank}.metadata`` per rank, a different format)
``solosave_collective``       ``solosave.AsyncCheckpointer()``: every save takes the collective path
                              (gather plans, scatter decisions, gather results, broadcast)
``solosave_constant``         ``AsyncCheckpointer(assume_constant_structure=True)``: the first save is
                              collective and its metadata is kept in memory as the prepared
                              metadata; every later save is a reuse save (one 8-byte all_reduce)
``solosave_create_reuse``     ``AsyncCheckpointer(prepared_metadata=FILE, create_prepared_metadata=True)``:
                              the same, with the prepared metadata also written to FILE
``solosave_create_reuse_zlib`` the same with ``SOLOSAVE_CRC32=zlib``: the records' CRC32 by
                              zlib instead of ISA-L (``solosave._src.core.checksum``; ``--only limits``)

Per save and rank: *block* is the time inside the save call (``dcp.save``, ``async_save``,
``AsyncCheckpointer.save``); *to_published* is from entering it until the checkpoint is complete
(``future.result()`` returned; for solosave ``SaveResult.timings.to_published``, when its
coordinator renamed ``.metadata`` into place, taken on the coordinator). Collectives come from
the log written by ``benchmarks/wrap_dist/sitecustomize.py`` in every process of the run (workers
and daemons included): a call belongs to a save if it started on that rank inside the save's
window. Limits: every rank at once copies its bytes into preallocated memory (``copy_``) and
writes them sequentially to one file followed by ``fsync``; one untimed repetition first.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from .ranks import fsdp_shards, local_part

REPO = Path(__file__).resolve().parent.parent
WRAP_DIR = Path(__file__).resolve().parent / "wrap_dist"
MiB = 1 << 20

DCP_MODES = ("dcp_save", "dcp_async_thread", "dcp_async_thread_plancache", "dcp_async_process",
             "dcp_async_process_plancache", "dcp_async_nocoll")
SOLOSAVE_MODES = ("solosave_collective", "solosave_constant", "solosave_create_reuse")
#: Run on request only (not in MODES): solosave_create_reuse with zlib's CRC32.
EXTRA_MODES = ("solosave_create_reuse_zlib",)
#: Environment of a mode's rank processes (set before they start: their workers read it at import).
MODE_ENV = {"solosave_create_reuse_zlib": {"SOLOSAVE_CRC32": "zlib"}}
MODES = DCP_MODES + SOLOSAVE_MODES
#: Short labels for tables and plots.
LABELS = {
    "dcp_save": "DCP save", "dcp_async_thread": "DCP async (thread)",
    "dcp_async_thread_plancache": "DCP async (thread, plan cache)",
    "dcp_async_process": "DCP async (process)",
    "dcp_async_process_plancache": "DCP async (process, plan cache)",
    "dcp_async_nocoll": "DCP async no-collectives*",
    "solosave_collective": "solosave collective",
    "solosave_constant": "solosave constant structure (in-memory prepared)",
    "solosave_create_reuse": "solosave create+reuse",
    "solosave_create_reuse_zlib": "solosave create+reuse, zlib CRC32",
}

Json = dict[str, Any]


# ---------------------------------------------------------------------------------------------
# Rank-side code (runs in processes spawned by run_ranks; module-level so that it pickles)
# ---------------------------------------------------------------------------------------------

def _rank_state(rank: int, world_size: int, cfg: Json) -> dict[str, Any]:
    """This rank's tensors: its own (``t{rank}_{i}``), or with ``cfg["dtensor"]`` the local
    shards of FSDP-style ``DTensor``s (``t{i}``, ``Shard(0)`` over every rank, as FSDP2 holds
    its parameters), each shard the size a plain tensor would have."""
    import torch

    per_rank = cfg["count"] // world_size
    numel = cfg["total_mib"] * MiB // cfg["count"] // 4
    g = torch.Generator().manual_seed(1000 + rank)
    own = {f"t{rank}_{i}": torch.rand(numel, generator=g, dtype=torch.float32) for i in range(per_rank)}
    return fsdp_shards(list(own.values()), world_size) if cfg.get("dtensor") else own


def _nbytes(t: Any) -> int:
    t = local_part(t)
    return int(t.numel() * t.element_size())


def rank_limits(rank: int, world_size: int, cfg: Json) -> Json:
    """Every rank at once: copy its tensors into preallocated memory; write them + fsync."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    tensors = [local_part(t) for t in _rank_state(rank, world_size, cfg).values()]
    nbytes = sum(_nbytes(t) for t in tensors)
    dst = torch.zeros(nbytes, dtype=torch.uint8)  # zeroed: its pages are mapped before timing
    views, pos = [], 0
    for t in tensors:
        views.append(dst[pos:pos + _nbytes(t)].view(torch.float32))
        pos += _nbytes(t)
    memcpy: list[float] = []
    for rep in range(1 + cfg["memcpy_reps"]):  # repetition 0 warms up and is not kept
        dist.barrier()
        t0 = time.perf_counter()
        for v, t in zip(views, tensors):
            v.copy_(t)
        if rep:
            memcpy.append(time.perf_counter() - t0)
    data = memoryview(dst.numpy()).cast("B")
    path = os.path.join(cfg["data_dir"], f"raw_write_rank{rank}.bin")
    write: list[float] = []
    for rep in range(1 + cfg["write_reps"]):
        t = _raw_write(data, path)
        if rep:
            write.append(t)
    return {"rank": rank, "bytes": nbytes, "memcpy_s": memcpy, "write_s": write}


def _raw_write(data: memoryview, path: str) -> float:
    """Every rank at once: write ``data`` sequentially to a new file + ``fsync``; the seconds."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        off = 0
        while off < len(data):
            off += os.write(fd, data[off:off + 16 * MiB])
        os.fsync(fd)
    finally:
        os.close(fd)
    took = time.perf_counter() - t0
    dist.barrier()
    os.remove(path)
    return took


class _DcpSaver:
    """One of the stock DCP modes; ``close`` stops the process executor's daemon, if any."""

    def __init__(self, mode: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self._dcp = dcp
        self._sync = mode == "dcp_save"
        self._plancache = mode.endswith("_plancache")
        self._kwargs: Json = {}
        if mode.startswith("dcp_async_process"):
            self._kwargs["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
        if mode == "dcp_async_nocoll":
            self._kwargs["use_collectives"] = False

    def save(self, sd: dict[str, Any], path: str, rank: int, timeout: float) -> Json:
        from torch.distributed.checkpoint import DefaultSavePlanner

        planner = DefaultSavePlanner(enable_plan_caching=True) if self._plancache else None
        t0 = time.perf_counter()
        if self._sync:
            self._dcp.save(sd, checkpoint_id=path, planner=planner)
            t1 = t2 = time.perf_counter()
        else:
            future = self._dcp.async_save(sd, checkpoint_id=path, planner=planner, **self._kwargs)
            t1 = time.perf_counter()
            future.result(timeout=timeout)
            t2 = time.perf_counter()
        written = sum(e.stat().st_size for e in os.scandir(path)
                      if e.name.startswith(f"__{rank}_") and e.name.endswith(".distcp"))
        return {"path_kind": "dcp", "block_s": t1 - t0, "to_published_s": t2 - t0,
                "to_waited_s": t2 - t0, "bytes_written": written}

    def close(self) -> None:
        try:
            from torch.distributed.checkpoint import _async_process_executor as ape
        except ImportError:  # pragma: no cover - older torch
            return
        proc = getattr(ape, "_CHECKPOINT_PROCESS", None)
        if proc is not None:
            proc.__del__()  # sends TERMINATE, joins (5 s), then SIGTERM
            ape._CHECKPOINT_PROCESS = None


class _SolosaveSaver:
    def __init__(self, mode: str, mode_dir: str) -> None:
        import solosave

        kwargs: Json = {"workers": 1, "persistent_worker": True}
        if mode == "solosave_constant":
            kwargs["assume_constant_structure"] = True
        elif mode in ("solosave_create_reuse", "solosave_create_reuse_zlib"):
            kwargs["prepared_metadata"] = os.path.join(mode_dir, "prepared.metadata")
            kwargs["create_prepared_metadata"] = True
        self._ckpt = solosave.AsyncCheckpointer(**kwargs)

    def save(self, sd: dict[str, Any], path: str, rank: int, timeout: float) -> Json:
        t0 = time.perf_counter()
        result = self._ckpt.save(sd, path).wait(timeout=timeout)
        t2 = time.perf_counter()
        tm = result.timings
        return {"path_kind": result.mode, "block_s": tm.block, "to_published_s": tm.to_published,
                "to_waited_s": t2 - t0, "bytes_written": result.bytes_written,
                "saveresult_collectives": result.collectives("all"),
                "phases_s": {"plan": tm.plan, "stage": tm.stage, "write": tm.write,
                             "coordinate": tm.coordinate, "publish": tm.publish}}

    def close(self) -> None:
        self._ckpt.close()


def rank_mode(rank: int, world_size: int, mode: str, cfg: Json) -> Json:
    """Run ``cfg["saves"]`` saves of this rank's state in ``mode``; return per-save figures and
    each save's wall-clock window (to attribute the logged collectives)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["SOLOSAVE_BENCH_TRAINER_PID"] = str(os.getpid())
    mode_dir = os.path.join(cfg["data_dir"], mode)
    sd = _rank_state(rank, world_size, cfg)
    t0 = time.perf_counter()
    saver = _DcpSaver(mode) if mode in DCP_MODES else _SolosaveSaver(mode, mode_dir)
    setup_s = time.perf_counter() - t0
    saves: list[Json] = []
    raw = None
    if cfg.get("interleave_raw"):  # the same bytes, written raw after every save (see _raw_write)
        raw = memoryview(torch.cat([local_part(t).detach().reshape(-1).view(torch.uint8)
                                    for t in sd.values()]).numpy()).cast("B")
    try:
        for i in range(cfg["saves"]):
            path = os.path.join(mode_dir, f"save_{i:03d}")
            dist.barrier()
            w0 = time.time()
            s = saver.save(sd, path, rank, cfg["timeout"])
            s["window"] = (w0, time.time())
            saves.append(s)
            dist.barrier()  # every rank has waited: the checkpoint is complete
            if rank == 0:
                shutil.rmtree(path)
            if raw is not None:
                s["raw_write_s"] = _raw_write(raw, os.path.join(cfg["data_dir"], f"raw_after_rank{rank}.bin"))
            with torch.no_grad():
                for t in sd.values():
                    t.add_(1)
    finally:
        saver.close()
    return {"rank": rank, "setup_s": setup_s, "saves": saves}


# ---------------------------------------------------------------------------------------------
# The collective log (parent process)
# ---------------------------------------------------------------------------------------------

def read_collective_log(log_dir: str) -> list[tuple[float, int, str, str, int]]:
    """``(start, rank, where, kind, payload)`` for every logged call of a launch."""
    calls = []
    for name in os.listdir(log_dir):
        with open(os.path.join(log_dir, name)) as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) != 7 or not parts[2].isdigit():
                    continue
                calls.append((float(parts[0]), int(parts[2]), parts[4], parts[5], int(parts[6])))
    return sorted(calls)


def attribute_calls(calls: list[tuple[float, int, str, str, int]], per_rank: list[Json]) -> None:
    """Attach to every save of every rank the calls that rank's processes started in its window:
    ``collectives_calling`` / ``collectives_all`` as ``{kind: {"count", "bytes"}}``."""
    by_rank: dict[int, list[tuple[float, str, str, int]]] = defaultdict(list)
    for start, rank, where, kind, nbytes in calls:
        by_rank[rank].append((start, where, kind, nbytes))
    for r in per_rank:
        mine = by_rank.get(r["rank"], [])
        for s in r["saves"]:
            lo, hi = s["window"]
            calling: dict[str, dict[str, int]] = {}
            every: dict[str, dict[str, int]] = {}
            for start, where, kind, nbytes in mine:
                if lo <= start <= hi:
                    for d, keep in ((every, True), (calling, where == "calling")):
                        if keep:
                            e = d.setdefault(kind, {"count": 0, "bytes": 0})
                            e["count"] += 1
                            e["bytes"] += max(nbytes, 0)
            s["collectives_calling"] = calling
            s["collectives_all"] = every


# ---------------------------------------------------------------------------------------------
# Aggregation (parent process)
# ---------------------------------------------------------------------------------------------

def _total(colls: dict[str, dict[str, int]]) -> tuple[int, int]:
    return sum(v["count"] for v in colls.values()), sum(v["bytes"] for v in colls.values())


def aggregate_save(per_rank: list[Json]) -> Json:
    """One save seen by all ranks: slowest rank's times, all ranks' bytes, per-rank collectives
    (the maximum over ranks: the coordinator's, which sends or receives the most)."""
    block = max(r["block_s"] for r in per_rank)
    pub = max(r["to_published_s"] for r in per_rank)
    total_bytes = sum(r["bytes_written"] for r in per_rank)
    calling = [_total(r["collectives_calling"]) for r in per_rank]
    every = [_total(r["collectives_all"]) for r in per_rank]
    return {
        "path_kind": per_rank[0]["path_kind"],
        "block_ms": block * 1e3,
        "to_published_ms": pub * 1e3,
        "to_waited_ms": max(r["to_waited_s"] for r in per_rank) * 1e3,
        "bytes_written": total_bytes,
        "write_MBps": total_bytes / pub / 1e6 if pub > 0 else 0.0,
        "coll_calling_count": max(c for c, _ in calling),
        "coll_calling_bytes": max(b for _, b in calling),
        "coll_total_count": max(c for c, _ in every),
        "coll_total_bytes": max(b for _, b in every),
        "coll_kinds_rank0": per_rank[0]["collectives_all"],
        "per_rank": per_rank,
        **({"raw_write_ms": max(r["raw_write_s"] for r in per_rank) * 1e3} if "raw_write_s" in per_rank[0] else {}),
    }


STEADY_KEYS = ("block_ms", "to_published_ms", "to_waited_ms", "write_MBps", "coll_calling_count",
               "coll_calling_bytes", "coll_total_count", "coll_total_bytes")


def summarize_mode(saves: list[Json], warmup: int) -> Json:
    steady = saves[warmup:] or saves
    return {
        "steady_median": {k: statistics.median(s[k] for s in steady) for k in STEADY_KEYS + ("raw_write_ms",)
                          if k in steady[0]},
        "steady_paths": sorted({s["path_kind"] for s in steady}),
        "steady_kinds_rank0": steady[-1]["coll_kinds_rank0"],
        "warmup": [{k: s[k] for k in ("path_kind", "block_ms", "to_published_ms", "coll_total_count")}
                   for s in saves[:warmup]],
    }


def summarize_limits(per_rank: list[Json]) -> Json:
    """Per repetition the slowest rank (they ran together), then the median over repetitions."""
    total = sum(r["bytes"] for r in per_rank)
    reps = range(len(per_rank[0]["memcpy_s"]))
    memcpy = [max(r["memcpy_s"][i] for r in per_rank) for i in reps]
    write = [max(r["write_s"][i] for r in per_rank) for i in range(len(per_rank[0]["write_s"]))]
    memcpy_ms = statistics.median(memcpy) * 1e3
    write_ms = statistics.median(write) * 1e3
    return {"bytes_per_rank": per_rank[0]["bytes"], "bytes_total": total,
            "memcpy_ms": memcpy_ms, "write_ms": write_ms,
            "memcpy_GBps_per_rank": per_rank[0]["bytes"] / memcpy_ms / 1e6,
            "write_MBps": total / write_ms * 1e3 / 1e6,
            "memcpy_reps_ms": [t * 1e3 for t in memcpy], "write_reps_ms": [t * 1e3 for t in write]}


def compute_ratios(limits: Json, modes: dict[str, Json]) -> dict[str, Json]:
    """block / memcpy and write throughput / raw write for every mode; for solosave's modes also
    the best DCP async mode's block and to_published over solosave's."""
    out: dict[str, Json] = {}
    meds = {m: e["summary"]["steady_median"] for m, e in modes.items() if "summary" in e}
    ref = meds.get("dcp_async_thread")
    for m, s in meds.items():
        r: Json = {"block_over_memcpy": _div(s["block_ms"], limits["memcpy_ms"]),
                   "write_over_raw_write": _div(s["write_MBps"], limits["write_MBps"])}
        if m in SOLOSAVE_MODES and ref is not None:
            r["dcp_async_block_over_this"] = _div(ref["block_ms"], s["block_ms"])
            r["dcp_async_to_published_over_this"] = _div(ref["to_published_ms"], s["to_published_ms"])
        out[m] = r
    return out


def _div(a: float, b: float) -> float | None:
    return a / b if b else None


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------

def _launch(fn: Any, ws: int, *args: Any, timeout: float, log_dir: str | None = None,
            extra_env: dict[str, str] | None = None) -> list[Json]:
    from .ranks import environ, run_ranks

    env = dict(extra_env or {})
    if log_dir is not None:
        env["SOLOSAVE_BENCH_COLLECTIVE_LOG"] = log_dir
    # The children are spawned interpreters: PYTHONPATH (for sitecustomize) must be in *this*
    # process's environment when they start, not only in what the rank process sets later.
    path = os.pathsep.join(p for p in (str(WRAP_DIR), str(REPO), os.environ.get("PYTHONPATH")) if p)
    with environ({"PYTHONPATH": path, **env}):
        return run_ranks(fn, ws, *args, timeout=timeout, env=env)


def run_save_bench(cfg: Json, out_dir: Path, progress: Any) -> Json:
    """Run the limits and every mode for every world size; returns the ``save`` report section."""
    from . import save_modes as rank_fns  # by module name, so that the rank functions pickle

    data_root = out_dir / "data"
    report: Json = {"config": cfg, "world_sizes": {}}
    for ws in cfg["world_sizes"]:
        entry: Json = {"limits": None, "modes": {}, "ratios": {}}
        report["world_sizes"][str(ws)] = entry
        wcfg = {**cfg, "data_dir": str(data_root / f"ws{ws}")}
        shutil.rmtree(wcfg["data_dir"], ignore_errors=True)
        os.makedirs(wcfg["data_dir"])
        progress.step(f"ws={ws} limits")
        try:
            entry["limits"] = summarize_limits(_launch(rank_fns.rank_limits, ws, wcfg, timeout=cfg["timeout"]))
        except AssertionError as e:
            entry["limits"] = {"error": str(e)}
            progress.note(f"[world {ws}] limits FAILED:\n{e}")
        for m in cfg["modes"]:
            progress.step(f"ws={ws} {m}")
            t0 = time.perf_counter()
            mode_dir = os.path.join(wcfg["data_dir"], m)
            log_dir = os.path.join(wcfg["data_dir"], f"log_{m}")
            for d in (mode_dir, log_dir):
                shutil.rmtree(d, ignore_errors=True)
                os.makedirs(d)
            try:
                per_rank = _launch(rank_fns.rank_mode, ws, m, wcfg, timeout=cfg["timeout"], log_dir=log_dir,
                                   extra_env=MODE_ENV.get(m))
            except AssertionError as e:
                entry["modes"][m] = {"error": str(e)}
                progress.note(f"[world {ws}] {m}: FAILED after {time.perf_counter() - t0:.1f} s:\n{e}")
                continue
            finally:
                shutil.rmtree(mode_dir, ignore_errors=True)
            attribute_calls(read_collective_log(log_dir), per_rank)
            shutil.rmtree(log_dir, ignore_errors=True)
            saves = [aggregate_save([r["saves"][i] for r in per_rank]) for i in range(cfg["saves"])]
            entry["modes"][m] = {"saves": saves, "summary": summarize_mode(saves, cfg["warmup"]),
                                 "wall_s": time.perf_counter() - t0,
                                 "setup_ms": max(r["setup_s"] for r in per_rank) * 1e3}
        if entry["limits"] and "error" not in entry["limits"]:
            entry["ratios"] = compute_ratios(entry["limits"], entry["modes"])
        shutil.rmtree(wcfg["data_dir"], ignore_errors=True)
    shutil.rmtree(data_root, ignore_errors=True)
    return report
