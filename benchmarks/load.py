"""The load benchmark (``python -m benchmarks --only load``): resuming, stock DCP beside solosave.

For each case (``CASES``: few large tensors, many small ones, and many small DTensor shards as
FSDP2 holds them) one launch of ``world_size`` local ranks (``benchmarks/ranks.run_ranks``, gloo
on 127.0.0.1, CPU tensors): every rank holds its own fp32 tensors ``t{rank}_{i}``
(``count / world_size`` of ``item_kib`` KiB; in the DTensor case ``t{i}``, ``Shard(0)`` over the
ranks, a shard of ``item_kib`` KiB per rank, loaded at the sharding it was saved with), they are saved
once with ``solosave.AsyncCheckpointer(workers=1)``, then every rank loads them back into
preallocated tensors (zeroed before each load, pages already mapped) with each method, the
page cache warm:

``raw``                every rank reads its own data files sequentially (16 MiB ``preadv``s) into
                       one preallocated buffer as large as they are: the bytes a load must move,
                       each to its own memory, nothing else
``dcp``                ``torch.distributed.checkpoint.load`` (stock ``FileSystemReader``)
``solosave``           ``solosave.load`` (its read path, :mod:`solosave._src.load.read_path`)
``solosave_dcp_read``  ``solosave.load`` with DCP's own ``read_data`` (``fast_read = False``):
                       the read path before issue 14

Repetition 0 warms the page cache and the code paths and is not kept; the methods' order
rotates between repetitions. Per repetition and method the time is the slowest rank's (they
start together after a barrier); reported: the median over repetitions and the range. Every
load is checked bit for bit against the saved tensors (outside the timed window).
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from .ranks import fsdp_shards, local_part

Json = dict[str, Any]
MiB = 1 << 20
#: ``(name, tensors (shards) over all ranks, KiB per tensor (shard), DTensor shards)``.
CASES = (("64 x 4 MiB", 64, 4096, False), ("4096 x 32 KiB", 4096, 32, False),
         ("4096 x 32 KiB DTensor shards", 4096, 32, True))
METHODS = ("raw", "dcp", "solosave", "solosave_dcp_read")
LABELS = {"raw": "raw sequential read", "dcp": "stock DCP load", "solosave": "solosave.load",
          "solosave_dcp_read": "solosave.load, DCP read_data"}
#: The goals of issue 14: solosave / stock DCP, and solosave / raw read (large tensors).
GOALS = {"64 x 4 MiB": {"dcp": 0.8, "raw": 1.25}, "4096 x 32 KiB": {"dcp": 0.33}}


# ---------------------------------------------------------------------------------------------
# Rank-side code (runs in processes spawned by run_ranks; module-level so that it pickles)
# ---------------------------------------------------------------------------------------------

def _raw_read(files: list[str], buf: Any) -> None:
    import ctypes

    address = buf.data_ptr()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            pos, size = 0, os.fstat(fd).st_size
            while pos < size:
                n = min(16 * MiB, size - pos)
                got = os.preadv(fd, [(ctypes.c_char * n).from_address(address)], pos)
                if got <= 0:
                    break
                pos += got
                address += got
        finally:
            os.close(fd)


def _methods(sd: dict[str, Any], path: str, files: list[str]) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp

    import solosave
    from solosave._src.load.load import SafeFileSystemReader

    buf = torch.zeros(sum(os.path.getsize(f) for f in files), dtype=torch.uint8)  # pages mapped before timing

    def dcp_read() -> None:
        SafeFileSystemReader.fast_read = False
        try:
            solosave.load(sd, path)
        finally:
            SafeFileSystemReader.fast_read = True

    return {"raw": lambda: _raw_read(files, buf), "dcp": lambda: dcp.load(sd, checkpoint_id=path),
            "solosave": lambda: solosave.load(sd, path), "solosave_dcp_read": dcp_read}


def rank_load(rank: int, world_size: int, case: Json, cfg: Json) -> Json:
    """Save this rank's tensors once, then time every method ``1 + cfg["reps"]`` times."""
    import torch
    import torch.distributed as dist

    import solosave

    torch.set_num_threads(1)
    per_rank = case["count"] // world_size
    g = torch.Generator().manual_seed(2000 + rank)
    saved = {f"t{rank}_{i}": torch.rand(case["item_kib"] * 256, generator=g) for i in range(per_rank)}
    if case.get("dtensor"):
        saved = fsdp_shards(list(saved.values()), world_size)
    path = os.path.join(cfg["data_dir"], "ckpt")
    with solosave.AsyncCheckpointer(workers=1) as ckpt:
        ckpt.save(saved, path).wait(timeout=cfg["timeout"])
    dist.barrier()
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.startswith(f"__{rank}_") and f.endswith(".distcp"))
    sd = {k: torch.zeros_like(v) for k, v in saved.items()}
    methods = _methods(sd, path, files)
    times: dict[str, list[float]] = {m: [] for m in cfg["methods"]}
    exact = True
    for rep in range(1 + cfg["reps"]):
        order = cfg["methods"][rep % len(cfg["methods"]):] + cfg["methods"][:rep % len(cfg["methods"])]
        for m in order:
            for t in sd.values():
                t.zero_()
            dist.barrier()
            t0 = time.perf_counter()
            methods[m]()
            dt = time.perf_counter() - t0
            if rep:
                times[m].append(dt)
            if m != "raw":
                exact = exact and all(torch.equal(local_part(sd[k]), local_part(v)) for k, v in saved.items())
    return {"rank": rank, "times": times, "exact": exact, "bytes": sum(os.path.getsize(f) for f in files)}


# ---------------------------------------------------------------------------------------------
# Driver, aggregation, table and plot (parent process)
# ---------------------------------------------------------------------------------------------

def summarize(per_rank: list[Json], methods: list[str], name: str) -> Json:
    """Slowest rank per repetition, then median and range over repetitions; the ratios."""
    total = sum(r["bytes"] for r in per_rank)
    out: Json = {"bytes_total": total, "exact": all(r["exact"] for r in per_rank), "methods": {}}
    for m in methods:
        reps = [max(r["times"][m][i] for r in per_rank) for i in range(len(per_rank[0]["times"][m]))]
        med = statistics.median(reps)
        out["methods"][m] = {"median_ms": med * 1e3, "min_ms": min(reps) * 1e3, "max_ms": max(reps) * 1e3,
                             "reps_ms": [t * 1e3 for t in reps], "MBps": total / med / 1e6}
    meds = {m: v["median_ms"] for m, v in out["methods"].items()}
    out["ratios"] = {f"{a}_over_{b}": meds[a] / meds[b] for a in meds for b in ("dcp", "raw")
                     if b in meds and a != b}
    out["goals"] = {f"solosave_over_{b}": {"goal": g, "met": out["ratios"].get(f"solosave_over_{b}", 1e9) <= g}
                    for b, g in GOALS.get(name, {}).items() if "solosave" in meds}
    return out


def run_load_bench(cfg: Json, out_dir: Path, progress: Any) -> Json:
    """Every case on ``cfg["world_size"]`` ranks; returns the ``load`` report section."""
    from . import load as rank_fns  # by module name, so that the rank function pickles
    from .ranks import run_ranks

    report: Json = {"config": cfg, "cases": {}}
    for name, count, kib, dtensor in CASES:
        progress.step(f"load {name}")
        data_dir = out_dir / "data" / "load"
        shutil.rmtree(data_dir, ignore_errors=True)
        data_dir.mkdir(parents=True)
        case = {"name": name, "count": count, "item_kib": kib, "dtensor": dtensor}
        ccfg = {**cfg, "data_dir": str(data_dir)}
        try:
            per_rank = run_ranks(rank_fns.rank_load, cfg["world_size"], case, ccfg, timeout=cfg["timeout"])
            report["cases"][name] = summarize(per_rank, cfg["methods"], name)
        except AssertionError as e:
            report["cases"][name] = {"error": str(e)}
            progress.note(f"[load {name}] FAILED:\n{e}")
        finally:
            shutil.rmtree(data_dir, ignore_errors=True)
    return report


def _in_order(load: Json) -> list[tuple[str, Json]]:
    """The report's cases in ``CASES`` order (the JSON report sorts its keys)."""
    return [(name, load["cases"][name]) for name, *_ in CASES if name in load["cases"]]


def print_load(load: Json) -> None:
    cfg = load["config"]
    print()
    print(f"=== load: W={cfg['world_size']} local ranks, page cache warm, checkpoints written by solosave; "
          f"median of {cfg['reps']} repetitions (slowest rank), range in brackets ===")
    head = f"{'case':<29} {'method':<29} {'median ms':>9} {'range ms':>15} {'MB/s':>6} {'/ DCP':>6} {'/ raw':>6}"
    print(head)
    print("-" * len(head))
    for name, c in _in_order(load):
        if "error" in c:
            print(f"{name:<29} FAILED: {c['error'].strip().splitlines()[-1]}")
            continue
        for m in (m for m in METHODS if m in c["methods"]):
            v, r = c["methods"][m], c["ratios"]
            dcp = f"{r[m + '_over_dcp']:.2f}x" if m + "_over_dcp" in r else ""
            raw = f"{r[m + '_over_raw']:.2f}x" if m + "_over_raw" in r else ""
            rng = f"{v['min_ms']:.0f}-{v['max_ms']:.0f}"
            print(f"{name:<29} {LABELS[m]:<29} {v['median_ms']:>9.1f} {rng:>15} {v['MBps']:>6.0f} {dcp:>6} {raw:>6}")
        goals = ", ".join(f"{k} <= {g['goal']}: {'met' if g['met'] else 'NOT met'}" for k, g in c["goals"].items())
        print(f"{'':<29} bit-exact: {'yes' if c['exact'] else 'NO'}; goals: {goals or 'none'}")


def plot_load(load: Json, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [n for n, c in _in_order(load) if "error" not in c]
    if not cases:
        return []
    fig, axes = plt.subplots(1, len(cases), figsize=(5.5 * len(cases), 3.6), squeeze=False)
    for ax, name in zip(axes[0], cases):
        ms = load["cases"][name]["methods"]
        meth = [m for m in METHODS if m in ms]
        med = [ms[m]["median_ms"] for m in meth]
        err = [[med[i] - ms[m]["min_ms"] for i, m in enumerate(meth)],
               [ms[m]["max_ms"] - med[i] for i, m in enumerate(meth)]]
        colors = {"raw": "#7f7f7f", "dcp": "#ff7f0e", "solosave": "#1f77b4", "solosave_dcp_read": "#aec7e8"}
        ax.barh(range(len(meth)), med, xerr=err, color=[colors[m] for m in meth], capsize=3)
        ratios = load["cases"][name]["ratios"]
        for i, m in enumerate(meth):
            note = f"{med[i]:.0f} ms" + (f" ({ratios[m + '_over_dcp']:.2f}x DCP)" if m + "_over_dcp" in ratios else "")
            ax.text(ms[m]["max_ms"], i, " " + note, va="center", fontsize=7)
        ax.set_xlim(0, max(v["max_ms"] for v in ms.values()) * 1.45)
        ax.set_yticks(list(range(len(meth))), [LABELS[m] for m in meth], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("ms per load (median, range over repetitions)")
        ax.set_title(f"{name}, W={load['config']['world_size']}, warm page cache")
    fig.tight_layout()
    path = out / "load_time.png"
    fig.savefig(path, dpi=70)
    plt.close(fig)
    return [path]
