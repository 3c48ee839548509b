"""Benchmark: solosave's asynchronous saves next to ``torch.distributed.checkpoint.async_save``.

What is measured, in one run, for every world size (``--world-sizes``, default 2 and 4):

* A state dict of ``--total-mib`` MiB (default 256) made of ``--count`` fp32 tensors (default 64,
  i.e. 4 MiB each), spread over the ranks: rank ``r`` holds its own keys ``t{r}_{i}``, so each
  rank writes ``total / world_size`` bytes and the whole checkpoint holds ``total`` bytes.
* Four modes, each in fresh processes (``tests/dist_harness.run_ranks``, gloo on 127.0.0.1):

  ``dcp_async``
      ``torch.distributed.checkpoint.async_save(sd, checkpoint_id=dir)`` (thread executor, the
      default) and ``future.result()``. *block* is the time spent inside ``async_save``,
      *to_published* the time from entering it to ``result()`` returning. Collectives are
      counted by wrapping the ``torch.distributed`` collectives (on ``torch.distributed`` and on
      ``torch.distributed.distributed_c10d``; DCP's ``_DistWrapper`` calls them as
      ``torch.distributed.<name>``), per thread (the calling thread or another one).
  ``solosave_collective``
      ``solosave.AsyncCheckpointer()``: every save gathers plans (no prepared metadata).
  ``solosave_cache``
      ``AsyncCheckpointer(assume_constant_structure=True)``: gathers stop once the structure
      is known (the first two saves take the collective path).
  ``solosave_create_reuse``
      ``AsyncCheckpointer(prepared_metadata=<dir>/prepared.metadata,
      create_prepared_metadata=True)``: the first save creates the prepared metadata, every
      later save reuses it (one 8-byte ``all_reduce``).

  For solosave the figures come from ``SaveResult`` (``timings.block``,
  ``timings.to_published``, ``bytes_written``, ``collectives(...)``); the same wrappers as for
  DCP also watch the calling thread, as a cross-check of "no collective in ``save()``".
* ``--saves`` consecutive saves per mode (default 8); the first ``--warmup`` (default 2) are
  reported separately (solosave's first save also waits for the worker process to start:
  ``AsyncCheckpointer()`` returns before its worker is ready). Before each save all ranks meet at a barrier; after it every rank waits
  for its save, rank 0 deletes the checkpoint, and every tensor is changed (``add_(1)``) to
  emulate a training step. Nothing of this is inside the timed window.
* Physical limits, measured in the same run with every rank busy at once: a copy of each rank's
  tensors into preallocated memory (``copy_``, median of 3) and a sequential write of the same
  bytes to a file in the output directory followed by ``fsync`` (median of 2); each after one
  untimed repetition (the first write to a fresh file system is much slower than the rest).

Figures per save: block and to_published are the maximum over ranks; write throughput is the
bytes of all ranks divided by that maximum to_published; collective counts and payload bytes are
per rank (maximum over ranks), for the calling thread and in total. The table shows medians over
the steady-state saves (after the warm-up), the warm-up saves themselves, and the ratios
solosave block / memcpy, solosave write throughput / raw write, DCP block / solosave block and
DCP to_published / solosave to_published. Every per-save, per-rank figure goes to the JSON file.

Run it (from the repository root)::

    .venv/bin/python benchmarks/bench_save.py            # or: make bench
    .venv/bin/python benchmarks/bench_save.py --quick    # smoke run: 64 MiB, 4 saves, world 2

Checkpoints are written under ``--out`` (default ``bench-out/``) and deleted as soon as they
have been measured; only the JSON report (default ``bench-out/bench_save.json``) is left.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import pickle
import platform
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCH_DIR = Path(__file__).resolve().parent
for _p in (REPO / "tests", BENCH_DIR):  # tests/dist_harness.py; this file as module "bench_save"
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

MODES = ("dcp_async", "solosave_collective", "solosave_cache", "solosave_create_reuse")
SOLOSAVE_MODES = MODES[1:]
#: The collectives wrapped in the rank processes (names on ``torch.distributed``).
COLLECTIVES = ("gather_object", "scatter_object_list", "broadcast_object_list", "all_gather_object",
               "all_reduce", "broadcast", "barrier", "all_gather")
MiB = 1 << 20

Json = dict[str, Any]


# ---------------------------------------------------------------------------------------------
# Counting torch.distributed collectives (inside a rank process)
# ---------------------------------------------------------------------------------------------

def _pickled_len(obj: Any) -> int:
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _tensor_bytes(t: Any) -> int:
    return int(t.numel() * t.element_size()) if t is not None else 0


class CollectiveSpy:
    """Wraps the ``torch.distributed`` collectives of this process and logs each outermost call:
    its kind, the payload this rank contributed (the convention of ``solosave.SaveResult``:
    pickled object bytes for object collectives, tensor bytes otherwise; the root of a scatter
    counts what it sends, every rank of a broadcast counts the object) and its thread.

    Nested calls (``all_gather_object`` runs ``all_gather`` internally) are not counted twice.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, str]] = []
        self._lock = threading.Lock()
        self._local = threading.local()
        self._originals: list[tuple[Any, str, Any]] = []

    def install(self) -> None:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        for module in (dist, c10d):
            for name in COLLECTIVES:
                original = getattr(module, name)
                self._originals.append((module, name, original))
                setattr(module, name, self._wrap(name, original))

    def uninstall(self) -> None:
        for module, name, original in reversed(self._originals):
            setattr(module, name, original)
        self._originals.clear()

    def mark(self) -> int:
        with self._lock:
            return len(self.calls)

    def since(self, mark: int) -> list[tuple[str, int, str]]:
        with self._lock:
            return list(self.calls[mark:])

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._local, "inside", False):
                return fn(*args, **kwargs)
            self._local.inside = True
            try:
                out = fn(*args, **kwargs)
            finally:
                self._local.inside = False
            try:
                payload = _payload(name, signature.bind(*args, **kwargs).arguments)
            except Exception:  # noqa: BLE001 - counting must never break the call
                payload = -1
            where = "calling_thread" if threading.current_thread() is threading.main_thread() else "background"
            with self._lock:
                self.calls.append((name, payload, where))
            return out

        return wrapper


def _payload(name: str, a: dict[str, Any]) -> int:
    if name == "gather_object":
        return _pickled_len(a["obj"])
    if name == "all_gather_object":
        return _pickled_len(a["obj"])
    if name == "scatter_object_list":
        sent = a.get("scatter_object_input_list")
        if sent is not None:
            return sum(_pickled_len(o) for o in sent)
        return _pickled_len(a["scatter_object_output_list"][0])
    if name == "broadcast_object_list":
        return sum(_pickled_len(o) for o in a["object_list"])
    if name in ("all_reduce", "broadcast", "all_gather"):
        return _tensor_bytes(a.get("tensor"))
    return 0


def summarize_calls(calls: Sequence[tuple[str, int, str]], where: str = "all") -> dict[str, dict[str, int]]:
    """``{kind: {"count": n, "bytes": b}}`` like ``SaveResult.collectives(where)``."""
    out: dict[str, dict[str, int]] = {}
    for kind, nbytes, thread in calls:
        if where != "all" and thread != where:
            continue
        d = out.setdefault(kind, {"count": 0, "bytes": 0})
        d["count"] += 1
        d["bytes"] += max(nbytes, 0)
    return out


# ---------------------------------------------------------------------------------------------
# Rank-side code (runs in processes spawned by run_ranks; module-level so that it pickles)
# ---------------------------------------------------------------------------------------------

def _rank_state(rank: int, world_size: int, cfg: Json) -> dict[str, Any]:
    import torch

    per_rank = cfg["count"] // world_size
    numel = cfg["total_mib"] * MiB // cfg["count"] // 4
    g = torch.Generator().manual_seed(1000 + rank)
    return {f"t{rank}_{i}": torch.rand(numel, generator=g, dtype=torch.float32) for i in range(per_rank)}


def rank_limits(rank: int, world_size: int, cfg: Json) -> Json:
    """Every rank at once: copy its tensors into preallocated memory; write them + fsync."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    sd = _rank_state(rank, world_size, cfg)
    tensors = list(sd.values())
    nbytes = sum(_tensor_bytes(t) for t in tensors)
    dst = torch.zeros(nbytes, dtype=torch.uint8)  # zeroed: its pages are mapped before timing
    views, pos = [], 0
    for t in tensors:
        n = _tensor_bytes(t)
        views.append(dst[pos:pos + n].view(torch.float32))
        pos += n
    memcpy: list[float] = []
    for rep in range(1 + cfg["memcpy_reps"]):  # repetition 0 warms up and is not kept
        dist.barrier()
        t0 = time.perf_counter()
        for v, t in zip(views, tensors):
            v.copy_(t)
        if rep:
            memcpy.append(time.perf_counter() - t0)
    data = memoryview(dst.numpy()).cast("B")
    chunk = 16 * MiB
    path = os.path.join(cfg["data_dir"], f"raw_write_rank{rank}.bin")
    write: list[float] = []
    for rep in range(1 + cfg["write_reps"]):  # repetition 0 warms up and is not kept
        dist.barrier()
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            off = 0
            while off < nbytes:
                off += os.write(fd, data[off:off + chunk])
            os.fsync(fd)
        finally:
            os.close(fd)
        if rep:
            write.append(time.perf_counter() - t0)
        dist.barrier()
        os.remove(path)
    return {"rank": rank, "bytes": nbytes, "memcpy_s": memcpy, "write_s": write}


class _DcpSaver:
    def __init__(self, spy: CollectiveSpy) -> None:
        import torch.distributed.checkpoint as dcp

        self._dcp = dcp
        self._spy = spy

    def save(self, sd: dict[str, Any], path: str, rank: int, timeout: float) -> Json:
        mark = self._spy.mark()
        t0 = time.perf_counter()
        future = self._dcp.async_save(sd, checkpoint_id=path)
        t1 = time.perf_counter()
        future.result(timeout=timeout)
        t2 = time.perf_counter()
        calls = self._spy.since(mark)
        written = sum(e.stat().st_size for e in os.scandir(path)
                      if e.name.startswith(f"__{rank}_") and e.name.endswith(".distcp"))
        return {"mode": "dcp", "block_s": t1 - t0, "to_published_s": t2 - t0, "to_waited_s": t2 - t0,
                "bytes_written": written,
                "collectives_calling": summarize_calls(calls, "calling_thread"),
                "collectives_all": summarize_calls(calls, "all")}

    def close(self) -> None:
        pass


class _SolosaveSaver:
    def __init__(self, mode: str, mode_dir: str, spy: CollectiveSpy) -> None:
        import solosave

        kwargs: dict[str, Any] = {"workers": 1, "persistent_worker": True}
        if mode == "solosave_cache":
            kwargs["assume_constant_structure"] = True
        elif mode == "solosave_create_reuse":
            kwargs["prepared_metadata"] = os.path.join(mode_dir, "prepared.metadata")
            kwargs["create_prepared_metadata"] = True
        self._ckpt = solosave.AsyncCheckpointer(**kwargs)
        self._spy = spy

    def save(self, sd: dict[str, Any], path: str, rank: int, timeout: float) -> Json:
        mark = self._spy.mark()
        t0 = time.perf_counter()
        handle = self._ckpt.save(sd, path)
        result = handle.wait(timeout=timeout)
        t2 = time.perf_counter()
        spied = self._spy.since(mark)
        tm = result.timings
        return {"mode": result.mode, "block_s": tm.block, "to_published_s": tm.to_published,
                "to_waited_s": t2 - t0, "bytes_written": result.bytes_written,
                "collectives_calling": result.collectives("calling_thread"),
                "collectives_all": result.collectives("all"),
                "spied_calling_thread": summarize_calls(spied, "calling_thread"),
                "phases_s": {"plan": tm.plan, "stage": tm.stage, "write": tm.write,
                             "coordinate": tm.coordinate, "publish": tm.publish}}

    def close(self) -> None:
        self._ckpt.close()


def rank_mode(rank: int, world_size: int, mode: str, cfg: Json) -> Json:
    """Run ``cfg["saves"]`` saves of this rank's state in ``mode``; return per-save figures."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    mode_dir = os.path.join(cfg["data_dir"], mode)
    sd = _rank_state(rank, world_size, cfg)
    spy = CollectiveSpy()
    spy.install()
    t0 = time.perf_counter()
    saver: _DcpSaver | _SolosaveSaver = (_DcpSaver(spy) if mode == "dcp_async"
                                         else _SolosaveSaver(mode, mode_dir, spy))
    setup_s = time.perf_counter() - t0
    saves: list[Json] = []
    try:
        for i in range(cfg["saves"]):
            path = os.path.join(mode_dir, f"save_{i:03d}")
            dist.barrier()
            saves.append(saver.save(sd, path, rank, cfg["timeout"]))
            dist.barrier()  # every rank has waited: the checkpoint is complete
            if rank == 0:
                shutil.rmtree(path)
            with torch.no_grad():
                for t in sd.values():
                    t.add_(1)
    finally:
        saver.close()
        spy.uninstall()
    return {"rank": rank, "setup_s": setup_s, "saves": saves}


# ---------------------------------------------------------------------------------------------
# Aggregation and report (parent process)
# ---------------------------------------------------------------------------------------------

def _total(colls: dict[str, dict[str, int]]) -> tuple[int, int]:
    return (sum(v["count"] for v in colls.values()), sum(v["bytes"] for v in colls.values()))


def aggregate_save(per_rank: list[Json]) -> Json:
    """One save seen by all ranks: max times, total bytes, per-rank collectives (max)."""
    block = max(r["block_s"] for r in per_rank)
    pub = max(r["to_published_s"] for r in per_rank)
    total_bytes = sum(r["bytes_written"] for r in per_rank)
    calling = [_total(r["collectives_calling"]) for r in per_rank]
    every = [_total(r["collectives_all"]) for r in per_rank]
    out: Json = {
        "mode": per_rank[0]["mode"],
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
    }
    if "spied_calling_thread" in per_rank[0]:
        out["spied_calling_count"] = max(_total(r["spied_calling_thread"])[0] for r in per_rank)
    return out


STEADY_KEYS = ("block_ms", "to_published_ms", "to_waited_ms", "write_MBps", "coll_calling_count",
               "coll_calling_bytes", "coll_total_count", "coll_total_bytes")


def summarize_mode(saves: list[Json], warmup: int) -> Json:
    steady = saves[warmup:] or saves
    return {
        "steady_median": {k: statistics.median(s[k] for s in steady) for k in STEADY_KEYS},
        "steady_modes": sorted({s["mode"] for s in steady}),
        "steady_kinds_rank0": steady[-1]["coll_kinds_rank0"],
        "warmup": [{k: s[k] for k in ("mode", "block_ms", "to_published_ms", "coll_total_count")}
                   for s in saves[:warmup]],
    }


def summarize_limits(per_rank: list[Json]) -> Json:
    """Per repetition the slowest rank (they ran together), then the median over repetitions."""
    total = sum(r["bytes"] for r in per_rank)
    memcpy = [max(r["memcpy_s"][i] for r in per_rank) for i in range(len(per_rank[0]["memcpy_s"]))]
    write = [max(r["write_s"][i] for r in per_rank) for i in range(len(per_rank[0]["write_s"]))]
    memcpy_ms = statistics.median(memcpy) * 1e3
    write_ms = statistics.median(write) * 1e3
    return {"bytes_per_rank": per_rank[0]["bytes"], "bytes_total": total,
            "memcpy_ms": memcpy_ms, "write_ms": write_ms,
            "memcpy_GBps_per_rank": per_rank[0]["bytes"] / memcpy_ms / 1e6,
            "write_MBps": total / write_ms * 1e3 / 1e6,
            "memcpy_reps_ms": [t * 1e3 for t in memcpy], "write_reps_ms": [t * 1e3 for t in write],
            "per_rank": per_rank}


def compute_ratios(limits: Json, modes: dict[str, Json]) -> dict[str, Json]:
    out: dict[str, Json] = {}
    dcp = modes.get("dcp_async", {}).get("summary", {}).get("steady_median")
    for m in SOLOSAVE_MODES:
        s = modes.get(m, {}).get("summary", {}).get("steady_median")
        if s is None:
            continue
        r: Json = {"block_over_memcpy": _div(s["block_ms"], limits["memcpy_ms"]),
                   "write_over_raw_write": _div(s["write_MBps"], limits["write_MBps"])}
        if dcp is not None:
            r["dcp_block_over_solosave_block"] = _div(dcp["block_ms"], s["block_ms"])
            r["dcp_to_published_over_solosave"] = _div(dcp["to_published_ms"], s["to_published_ms"])
        out[m] = r
    if dcp is not None:
        out["dcp_async"] = {"block_over_memcpy": _div(dcp["block_ms"], limits["memcpy_ms"]),
                            "write_over_raw_write": _div(dcp["write_MBps"], limits["write_MBps"])}
    return out


def _div(a: float, b: float) -> float | None:
    return a / b if b else None


def _kinds(k: dict[str, dict[str, int]]) -> str:
    return ", ".join(f"{name} x{v['count']} ({_fmt_bytes(v['bytes'])})" for name, v in sorted(k.items())) or "none"


def _fmt_bytes(n: float) -> str:
    if n >= MiB:
        return f"{n / MiB:.1f} MiB"
    if n >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{int(n)} B"


def _x(v: float | None) -> str:
    return f"{v:.2f}x" if v is not None else "n/a"


def print_world(ws: int, cfg: Json, entry: Json) -> None:
    per_rank_mib = cfg["total_mib"] / ws
    print()
    print(f"=== world size {ws}: {cfg['total_mib']} MiB total, {per_rank_mib:g} MiB/rank "
          f"({cfg['count'] // ws} x {cfg['total_mib'] / cfg['count']:g} MiB fp32 tensors per rank); "
          f"{cfg['saves']} saves, first {cfg['warmup']} warm-up; medians of the rest ===")
    head = (f"{'mode':<22} {'path':<10} {'block ms':>9} {'to_pub ms':>10} {'MB/s':>7} "
            f"{'coll(call)':>10} {'coll(total)':>11} {'payload':>10}   warm-up block / to_pub ms")
    print(head)
    print("-" * len(head))
    for m in MODES:
        me = entry["modes"].get(m)
        if me is None:
            continue
        if "error" in me:
            print(f"{m:<22} FAILED: {me['error'].splitlines()[-1] if me['error'] else ''}")
            continue
        s = me["summary"]["steady_median"]
        path = "/".join(me["summary"]["steady_modes"])
        warm = "; ".join(f"{w['block_ms']:.0f} / {w['to_published_ms']:.0f} ({w['mode']})"
                         for w in me["summary"]["warmup"])
        print(f"{m:<22} {path:<10} {s['block_ms']:>9.1f} {s['to_published_ms']:>10.1f} "
              f"{s['write_MBps']:>7.0f} {s['coll_calling_count']:>10.0f} {s['coll_total_count']:>11.0f} "
              f"{_fmt_bytes(s['coll_total_bytes']):>10}   {warm}")
    lim = entry.get("limits")
    if lim and "error" not in lim:
        print(f"limits (all ranks at once): memcpy {lim['memcpy_ms']:.1f} ms per rank "
              f"({lim['memcpy_GBps_per_rank']:.2f} GB/s per rank); write+fsync {lim['write_ms']:.0f} ms "
              f"({lim['write_MBps']:.0f} MB/s all ranks)")
    elif lim:
        print(f"limits FAILED: {lim['error'].splitlines()[-1]}")
    print("collectives per steady save (rank 0):")
    for m in MODES:
        me = entry["modes"].get(m)
        if me and "summary" in me:
            print(f"  {m:<22} {_kinds(me['summary']['steady_kinds_rank0'])}")
    if entry.get("ratios"):
        print("ratios (steady medians):")
        for m, r in entry["ratios"].items():
            parts = [f"block/memcpy {_x(r.get('block_over_memcpy'))}",
                     f"write/raw write {_x(r.get('write_over_raw_write'))}"]
            if "dcp_block_over_solosave_block" in r:
                parts.append(f"dcp block/this {_x(r['dcp_block_over_solosave_block'])}")
                parts.append(f"dcp to_pub/this {_x(r['dcp_to_published_over_solosave'])}")
            print(f"  {m:<22} " + "  ".join(parts))


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--total-mib", type=int, default=256, help="state size over all ranks (default 256)")
    p.add_argument("--count", type=int, default=64, help="fp32 tensors over all ranks (default 64)")
    p.add_argument("--world-sizes", default="2,4", help="comma-separated (default 2,4)")
    p.add_argument("--saves", type=int, default=8, help="consecutive saves per mode (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="first saves reported separately (default 2)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--out", default="bench-out", help="scratch + report directory (default bench-out)")
    p.add_argument("--json", default=None, help="report path (default <out>/bench_save.json)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch (default 600)")
    p.add_argument("--quick", action="store_true", help="smoke run: 64 MiB, 16 tensors, 4 saves, world 2")
    return p


def _launch(fn: Callable[..., Json], ws: int, *args: Any, timeout: float) -> list[Json]:
    from dist_harness import run_ranks

    return run_ranks(fn, ws, *args, timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        args.total_mib, args.count, args.saves, args.world_sizes = 64, 16, 4, "2"
    world_sizes = [int(w) for w in args.world_sizes.split(",") if w]
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"unknown mode(s) {bad}; choose from {MODES}")
    for ws in world_sizes:
        if args.count % ws:
            raise SystemExit(f"--count {args.count} is not divisible by world size {ws}")
    if (args.total_mib * MiB) % (args.count * 4):
        raise SystemExit("--total-mib * MiB must be a multiple of 4 * --count")

    # This file is imported under its module name so that the rank functions pickle by
    # reference (run_ranks spawns fresh interpreters that import "bench_save").
    import bench_save as ranks

    out = Path(args.out).resolve()
    json_path = Path(args.json).resolve() if args.json else out / "bench_save.json"
    data_root = out / "data"
    import torch

    cfg: Json = {"total_mib": args.total_mib, "count": args.count, "saves": args.saves,
                 "warmup": min(args.warmup, args.saves), "timeout": args.timeout,
                 "memcpy_reps": 3, "write_reps": 2}
    report: Json = {"config": {**cfg, "world_sizes": world_sizes, "modes": modes},
                    "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                "python": platform.python_version(), "torch": torch.__version__,
                                "loadavg_start": os.getloadavg()},
                    "world_sizes": {}}
    t_all = time.perf_counter()
    failed = False
    for ws in world_sizes:
        entry: Json = {"limits": None, "modes": {}, "ratios": {}}
        report["world_sizes"][str(ws)] = entry
        wcfg = {**cfg, "data_dir": str(data_root / f"ws{ws}")}
        shutil.rmtree(wcfg["data_dir"], ignore_errors=True)
        os.makedirs(wcfg["data_dir"])
        t0 = time.perf_counter()
        try:
            entry["limits"] = summarize_limits(_launch(ranks.rank_limits, ws, wcfg, timeout=args.timeout))
            lim = entry["limits"]
            print(f"[world {ws}] limits: memcpy {lim['memcpy_ms']:.1f} ms/rank, write+fsync "
                  f"{lim['write_ms']:.0f} ms ({time.perf_counter() - t0:.1f} s)", flush=True)
        except AssertionError as e:
            failed = True
            entry["limits"] = {"error": str(e)}
            print(f"[world {ws}] limits FAILED:\n{e}", flush=True)
        for m in modes:
            t0 = time.perf_counter()
            mode_dir = os.path.join(wcfg["data_dir"], m)
            shutil.rmtree(mode_dir, ignore_errors=True)
            os.makedirs(mode_dir)
            try:
                per_rank = _launch(ranks.rank_mode, ws, m, wcfg, timeout=args.timeout)
            except AssertionError as e:
                failed = True
                entry["modes"][m] = {"error": str(e)}
                print(f"[world {ws}] {m}: FAILED after {time.perf_counter() - t0:.1f} s:\n{e}", flush=True)
                continue
            finally:
                shutil.rmtree(mode_dir, ignore_errors=True)
            saves = [aggregate_save([r["saves"][i] for r in per_rank]) for i in range(cfg["saves"])]
            summary = summarize_mode(saves, cfg["warmup"])
            entry["modes"][m] = {"saves": saves, "summary": summary, "wall_s": time.perf_counter() - t0,
                                 "setup_ms": max(r["setup_s"] for r in per_rank) * 1e3}
            s = summary["steady_median"]
            print(f"[world {ws}] {m}: {cfg['saves']} saves in {time.perf_counter() - t0:.1f} s "
                  f"(setup {entry['modes'][m]['setup_ms']:.0f} ms); median block {s['block_ms']:.1f} ms, "
                  f"to_published {s['to_published_ms']:.0f} ms", flush=True)
            spied = [x.get("spied_calling_count", 0) for x in saves]
            if m != "dcp_async" and any(c != x["coll_calling_count"] for c, x in zip(spied, saves)):
                print(f"[world {ws}] {m}: WARNING: torch.distributed saw {spied} collectives in the "
                      f"calling thread, SaveResult reports {[x['coll_calling_count'] for x in saves]}")
        if entry["limits"] and "error" not in entry["limits"]:
            entry["ratios"] = compute_ratios(entry["limits"], entry["modes"])
        shutil.rmtree(wcfg["data_dir"], ignore_errors=True)
    shutil.rmtree(data_root, ignore_errors=True)
    report["wall_s"] = time.perf_counter() - t_all
    report["machine"]["loadavg_end"] = os.getloadavg()

    for ws in world_sizes:
        print_world(ws, cfg, report["world_sizes"][str(ws)])
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1, sort_keys=True))
    print(f"\nwall time {report['wall_s']:.1f} s; load average (1 min) {report['machine']['loadavg_start'][0]:.2f} "
          f"at start, {report['machine']['loadavg_end'][0]:.2f} at end; per-save figures in {json_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
