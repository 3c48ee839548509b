"""The checkpoint overhead benchmark (``python -m benchmarks --only overhead``): step time of a
compute-bound training loop with a save every 1, 10 or 100 steps, solosave against stock DCP.

One launch of W=2 local ranks (``benchmarks/ranks.run_ranks``, gloo on 127.0.0.1), each with one
compute thread (``torch.set_num_threads(1)``) and ``per_rank_mib`` MiB of fp32 state. A step:
``matmuls`` products of two 512 x 512 matrices (compute), an ``all_reduce`` of 1 MiB (the
gradients' collective, which keeps the ranks in step), and ``add_(1)`` on one of the state's
tensors in turn (the state changes every step). Configurations, in turns on the same ranks:

``none``               no checkpointing (the baseline)
``solosave/N``         a save every N steps through ``CheckpointManager`` with the recommended
                       configuration for frequent saves: the fast tier in host memory
                       (``/dev/shm``), ``overlap_staging=True`` (the copies run during the next
                       step; the loop calls ``wait_staged()`` before it changes the state),
                       ``assume_constant_structure=True``, a worker process, ``keep_last=2``
``dcp/N``              stock ``torch.distributed.checkpoint.async_save`` every N steps into the
                       same tier, the previous save's future waited for first (as its docs do),
                       on a gloo group of its own (its thread's collectives never meet the
                       step's), the same retention

for N in ``intervals``. Each configuration first makes one untimed save (a worker's start and
the first save's plans are paid once per job), then runs ``steps[N]`` steps after ``warmup``
steps; the
figures are the slowest rank's mean and median step time, and the mean over ``none``'s (the
mean carries the saves' cost, the median the steps without one), and for solosave the median
phases of its saves on rank 0 (``SaveResult.timings``). Nothing here is a GPU: the
copies compete with the compute thread for the same two cores, which is the worst case.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from .ranks import run_ranks

Json = dict[str, Any]
MiB = 1 << 20
WORLD_SIZE = 2


def _rank(rank: int, ws: int, root: str, cfg: Json) -> Json:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import solosave
    from solosave.integrations import CheckpointManager

    torch.set_num_threads(1)
    n = cfg["per_rank_mib"] * MiB // 4 // cfg["tensors"]
    state = {f"p{i}": torch.full((n,), float(rank)) for i in range(cfg["tensors"])}
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    grad = torch.zeros(MiB // 4)

    def step(i: int) -> None:
        for _ in range(cfg["matmuls"]):
            torch.mm(a, b)
        dist.all_reduce(grad)
        state[f"p{i % cfg['tensors']}"].add_(1)

    dcp_group = dist.new_group(backend="gloo")  # DCP's own collectives run on its thread: not beside the step's
    out: Json = {}
    for name in cfg["configs"]:
        kind, _, every = name.partition("/")
        interval = int(every) if every else 0
        steps = cfg["steps"][str(interval)] if interval else cfg["steps"]["none"]
        tier = f"{root}/{kind}-{interval}"
        manager = handle = future = None
        if kind == "solosave":
            ck = solosave.AsyncCheckpointer(assume_constant_structure=True, overlap_staging=True, timeout=300)
            manager = CheckpointManager(tier, ck, keep_last=2)
        if interval:  # one untimed save first: the worker's start, DCP's first plans (once per job)
            if manager is not None:
                manager.save(0, state)
                manager.wait(300)
            else:
                dcp.async_save(state, checkpoint_id=f"{tier}/iter_{0:07d}", process_group=dcp_group).result()
        times: list[float] = []
        dist.barrier()
        for i in range(cfg["warmup"] + steps):
            t0 = time.perf_counter()
            if handle is not None:  # overlapped staging: the copies end before the state changes
                handle.wait_staged()
                handle = None
            step(i)
            if interval and (i + 1) % interval == 0:
                if manager is not None:
                    manager.poll()
                    handle = manager.save(i + 1, state)
                else:
                    if future is not None:
                        future.result()
                    future = dcp.async_save(state, checkpoint_id=f"{tier}/iter_{i + 1:07d}", process_group=dcp_group)
                    old = f"{tier}/iter_{i + 1 - 2 * interval:07d}"
                    if rank == 0 and i + 1 > 2 * interval:
                        shutil.rmtree(old, ignore_errors=True)
            if i >= cfg["warmup"]:
                times.append(time.perf_counter() - t0)
        if manager is not None:
            manager.wait(300)
            timed = [d.result.timings for d in manager.done[1:] if d.result is not None]  # not the untimed one
            out[f"{name}:phases"] = {k: statistics.median(getattr(t, k) for t in timed)
                                     for k in ("block", "stage", "write", "publish", "to_published")} if timed else {}
            manager.finish(300)
        if future is not None:
            future.result()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(tier, ignore_errors=True)
        out[name] = times
        if rank == 0:
            print(f"overhead: {name}: {len(times)} steps, mean {statistics.fmean(times) * 1e3:.1f} ms", flush=True)
    return out


def run_overhead_bench(cfg: Json, out: Path, progress: Any = None) -> Json:
    """Run the benchmark (see the module docstring)."""
    base = Path(cfg.get("fast_dir") or ("/dev/shm" if Path("/dev/shm").is_dir() else out))
    root = base / f"overhead-bench-{os.getpid()}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    configs = ["none"] + [f"{k}/{n}" for n in cfg["intervals"] for k in ("solosave", "dcp")]
    cfg = {**cfg, "configs": configs}
    try:
        ranks = run_ranks(_rank, WORLD_SIZE, str(root), cfg, timeout=cfg["timeout"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if progress is not None:
        progress.step("overhead")
    figures: Json = {}
    phases = {name: ranks[0].get(f"{name}:phases", {}) for name in configs if name.startswith("solosave")}
    for name in configs:
        means = [statistics.fmean(r[name]) for r in ranks]
        medians = [statistics.median(r[name]) for r in ranks]
        figures[name] = {"mean_s": max(means), "median_s": max(medians), "steps": len(ranks[0][name])}
    base_mean = figures["none"]["mean_s"]
    for f in figures.values():
        f["mean_ratio"] = f["mean_s"] / base_mean
    return {"config": {k: v for k, v in cfg.items() if k != "configs"}, "fast_dir": str(base), "figures": figures,
            "solosave_phases_s": phases}


def print_overhead(r: Json) -> None:
    c = r["config"]
    print(f"\n=== checkpoint overhead: W={WORLD_SIZE}, one compute thread per rank, {c['per_rank_mib']} MiB of "
          f"state per rank, fast tier in {r['fast_dir']}; slowest rank")
    print(f"  {'configuration':16s} {'steps':>6s} {'mean ms':>9s} {'median ms':>10s} {'mean / none':>12s}")
    for name, f in r["figures"].items():
        print(f"  {name:16s} {f['steps']:6d} {f['mean_s'] * 1e3:9.1f} {f['median_s'] * 1e3:10.1f} "
              f"{f['mean_ratio']:11.2f}x")
    for name, ph in r.get("solosave_phases_s", {}).items():
        if ph:
            print(f"  {name}: median per save (rank 0): " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in ph.items()))


def plot_overhead(r: Json, plots: Path) -> list:
    """No plot: a small table."""
    return []
