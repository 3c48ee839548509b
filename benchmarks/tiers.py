"""The two-tier benchmark (``python -m benchmarks --only tiers``): a fast tier against a durable one.

One launch of W=2 local ranks (``benchmarks/ranks.run_ranks``, gloo on 127.0.0.1, CPU tensors).
The durable tier is an S3-compatible server started here on 127.0.0.1 (moto's server mode:
``pip install 'moto[server]' s3fs``); the fast tier is a local directory (``--tiers-fast-dir``,
default ``/dev/shm`` where it exists: host memory, else ``<out>/fast``: the local disk). Every
rank holds ``per_rank_mib`` MiB of its own fp32 tensors (``tensors`` per rank). Both
checkpointers run with ``assume_constant_structure`` (the first save is reported apart; the
others are reuse saves). Per save, after a barrier, the slowest rank's time from ``save()`` to:

``durable_only``  ``wait()`` returned for a save straight to ``s3://`` (published there): what a
                  save costs without a fast tier
``fast``          ``wait()`` returned for a save with ``durable_root``: published on the fast tier,
                  when the training loop may count on the checkpoint
``to_durable``    the same save's ``durable.wait()`` returned: published on the durable tier too

Restores (``reps`` times each, after the saves; medians of the slowest rank):

``restore_fast``     ``solosave.load(..., durable_root=)`` with the fast tier complete (the tier
                     agreement, then a local load through the load index)
``restore_durable``  the same call with the fast tier gone (rank 0 renamed it away before): the
                     agreement, then a load from ``s3://`` (ranged reads, the load index)
``raw_download``     each rank downloads its own data file's bytes from the server with
                     concurrent ranged GETs (the reader's concurrency and span size): the bytes a
                     durable restore must move, nothing else (the limit)

Every restore is compared bit for bit with the saved state (outside the timing). The methods
take turns save by save; older checkpoints are deleted outside the timed windows.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from solosave._src.testing.s3_server import s3_server

from .ranks import environ, run_ranks

Json = dict[str, Any]
MiB = 1 << 20
WORLD_SIZE = 2
SAVES = ("durable_only", "fast", "to_durable")
RESTORES = ("restore_fast", "restore_durable", "raw_download")
LABELS = {"durable_only": "durable only (save to s3://)", "fast": "two tiers: published on the fast tier",
          "to_durable": "two tiers: published on s3:// too", "restore_fast": "restore from the fast tier",
          "restore_durable": "restore from s3:// (fast tier gone)", "raw_download": "raw download from s3://"}


# ---------------------------------------------------------------------------------------------
# Rank-side code (spawned processes; module-level so that it pickles)
# ---------------------------------------------------------------------------------------------

def _barrier_then(fn: Any) -> tuple[float, Any]:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _raw_download(path: str, size: int) -> None:
    """``size`` bytes of ``path`` with concurrent ranged GETs, as the reader requests them."""
    from concurrent.futures import ThreadPoolExecutor

    import fsspec

    from solosave._src.load.range_read import CONCURRENCY, SPAN_BYTES

    fs = fsspec.filesystem("s3")
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        list(pool.map(lambda at: fs.cat_file(path, start=at, end=min(at + SPAN_BYTES, size)),
                      range(0, size, SPAN_BYTES)))


def _saves(rank: int, cfg: Json, sd: dict, root: str, fast: str) -> tuple[Json, Json]:
    import fsspec
    import torch.distributed as dist

    import solosave

    fs = fsspec.filesystem("s3")
    times: Json = {m: [] for m in SAVES}
    first: Json = {}
    only = solosave.AsyncCheckpointer(assume_constant_structure=True, timeout=cfg["timeout"])
    tiers = solosave.AsyncCheckpointer(assume_constant_structure=True, durable_root=f"{root}/tiers",
                                       timeout=cfg["timeout"])
    try:
        for i in range(cfg["saves"] + 1):
            d_only, _ = _barrier_then(lambda i=i: only.save(sd, f"{root}/only/iter_{i:07d}").wait())
            t0 = time.perf_counter()
            result = tiers.save(sd, f"{fast}/iter_{i:07d}").wait()
            d_fast = time.perf_counter() - t0
            copied = result.durable.wait(cfg["timeout"])
            d_durable = time.perf_counter() - t0
            if not copied.ok:
                raise RuntimeError(copied.error)
            for m, d in zip(SAVES, (d_only, d_fast, d_durable)):
                (times[m] if i else first.setdefault(m, [])).append(d)
            dist.barrier()
            if i < cfg["saves"] and rank == 0:  # the last round stays, for the restores
                fs.rm(f"{root}/only/iter_{i:07d}", recursive=True)
                fs.rm(f"{root}/tiers/iter_{i:07d}", recursive=True)
                shutil.rmtree(f"{fast}/iter_{i:07d}")
            dist.barrier()
    finally:
        only.close()
        tiers.close()
    return times, first


def _restores(rank: int, cfg: Json, sd: dict, root: str, fast: str) -> tuple[Json, bool]:
    import fsspec
    import torch
    import torch.distributed as dist

    import solosave

    fs = fsspec.filesystem("s3")
    last = f"iter_{cfg['saves']:07d}"
    times: Json = {m: [] for m in RESTORES}
    exact = True
    mine = f"{root}/tiers/{last}/__{rank}_0.distcp"
    fs.invalidate_cache()
    size = fs.size(mine)

    def restore(expect: str) -> None:
        nonlocal exact
        got = {k: torch.zeros_like(v) for k, v in sd.items()}
        d, where = _barrier_then(lambda: solosave.load(got, f"{fast}/{last}", durable_root=f"{root}/tiers"))
        exact = exact and where.startswith(expect) and all(torch.equal(got[k], v) for k, v in sd.items())
        times["restore_fast" if expect == fast else "restore_durable"].append(d)

    for _ in range(cfg["reps"]):
        restore(fast)
    dist.barrier()
    if rank == 0:
        os.rename(fast, fast + ".gone")
    dist.barrier()
    for _ in range(cfg["reps"]):
        restore(f"{root}/tiers")
        d, _ = _barrier_then(lambda: _raw_download(mine, size))
        times["raw_download"].append(d)
    dist.barrier()
    if rank == 0:
        os.rename(fast + ".gone", fast)
    return times, exact


def rank_tiers(rank: int, world_size: int, cfg: Json) -> Json:
    import torch

    torch.set_num_threads(1)
    n = cfg["per_rank_mib"] * MiB // 4 // cfg["tensors"]
    g = torch.Generator().manual_seed(rank)
    sd = {f"t{rank}_{i}": torch.rand(n, generator=g) for i in range(cfg["tensors"])}
    root, fast = f"s3://{cfg['bucket']}", cfg["fast"]
    saves, first = _saves(rank, cfg, sd, root, fast)
    restores, exact = _restores(rank, cfg, sd, root, fast)
    return {"rank": rank, "saves": saves, "first": first, "restores": restores, "exact": exact,
            "bytes": sum(v.numel() * 4 for v in sd.values())}


# ---------------------------------------------------------------------------------------------
# Driver, report
# ---------------------------------------------------------------------------------------------

def fast_dir(choice: str | None, out: Path) -> Path:
    """The fast tier's directory: ``choice``, else ``/dev/shm`` (host memory) where it exists,
    else ``<out>/fast`` (the local disk)."""
    if choice:
        return Path(choice) / f"solosave-tiers-{os.getpid()}"
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return Path("/dev/shm") / f"solosave-tiers-{os.getpid()}"
    return out / "fast"


def run_tiers_bench(cfg: Json, out: Path, progress: Any) -> Json:
    """One launch at W=2 against a local server; returns the ``tiers`` report section."""
    import fsspec

    fast = fast_dir(cfg.get("fast_dir"), out)
    progress.step(f"tiers: W={WORLD_SIZE}, {cfg['per_rank_mib']} MiB per rank, {cfg['saves']} saves, fast tier {fast}")
    shutil.rmtree(fast, ignore_errors=True)
    fast.mkdir(parents=True)
    try:
        with s3_server() as (_, env), environ(env):
            bucket = f"tiers-{os.getpid()}"
            fsspec.filesystem("s3").mkdir(f"s3://{bucket}")
            res = run_ranks(rank_tiers, WORLD_SIZE, {**cfg, "bucket": bucket, "fast": str(fast)},
                            timeout=cfg["timeout"], env=env)
    finally:
        shutil.rmtree(fast, ignore_errors=True)
    total = sum(r["bytes"] for r in res)
    methods: Json = {}
    for m in SAVES:
        per = [max(r["saves"][m][i] for r in res) for i in range(cfg["saves"])]
        methods[m] = {"median_s": statistics.median(per), "min_s": min(per), "max_s": max(per),
                      "first_s": max(r["first"][m][0] for r in res), "mb_per_s": total / statistics.median(per) / 1e6}
    for m in RESTORES:
        per = [max(r["restores"][m][i] for r in res) for i in range(cfg["reps"])]
        methods[m] = {"median_s": statistics.median(per), "min_s": min(per), "max_s": max(per),
                      "mb_per_s": total / statistics.median(per) / 1e6}
    ratios = {"fast_over_durable_only": methods["fast"]["median_s"] / methods["durable_only"]["median_s"],
              "to_durable_over_durable_only": methods["to_durable"]["median_s"] / methods["durable_only"]["median_s"],
              "restore_durable_over_raw": methods["restore_durable"]["median_s"] / methods["raw_download"]["median_s"],
              "restore_fast_over_durable": methods["restore_fast"]["median_s"] / methods["restore_durable"]["median_s"]}
    return {"config": {k: v for k, v in cfg.items() if k != "timeout"}, "world_size": WORLD_SIZE,
            "fast_dir": str(fast), "bytes_total": total, "methods": methods, "ratios": ratios,
            "exact": all(r["exact"] for r in res), "server": "moto (python -m moto.server) on 127.0.0.1, same machine"}


def print_tiers(report: Json) -> None:
    c = report["config"]
    print(f"\n== two tiers (W={report['world_size']}, {c['per_rank_mib']} MiB/rank in {c['tensors']} tensors; "
          f"fast tier {report['fast_dir']}, durable tier s3:// on {report['server']}; {c['saves']} steady saves, "
          f"{c['reps']} restores; slowest rank) ==")
    print(f"{'':<42}{'median s':>10}{'range s':>16}{'MB/s':>8}{'first s':>9}")
    for m, e in report["methods"].items():
        first = f"{e['first_s']:>9.2f}" if "first_s" in e else ""
        print(f"{LABELS[m]:<42}{e['median_s']:>10.3f}{e['min_s']:>8.3f}-{e['max_s']:<7.3f}{e['mb_per_s']:>8.1f}{first}")
    r = report["ratios"]
    print(f"published on the fast tier / durable-only save: {r['fast_over_durable_only']:.2f}x; published on "
          f"s3:// too / durable-only save: {r['to_durable_over_durable_only']:.2f}x")
    print(f"restore from s3:// / raw download of the same bytes: {r['restore_durable_over_raw']:.2f}x; restore "
          f"from the fast tier / from s3://: {r['restore_fast_over_durable']:.2f}x; bit for bit: {report['exact']}")


def plot_tiers(report: Json, out_dir: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    colors = {"durable_only": "0.6", "fast": "tab:blue", "to_durable": "tab:orange", "restore_fast": "tab:blue",
              "restore_durable": "tab:orange", "raw_download": "0.6"}
    for ax, names, title in ((a, SAVES, "saves: seconds until published"), (b, RESTORES, "restores: seconds")):
        vals = [report["methods"][m]["median_s"] for m in names]
        ax.bar(range(len(names)), vals, color=[colors[m] for m in names])
        ax.set_xticks(range(len(names)), [LABELS[m].replace(": ", ":\n").replace(" (", "\n(") for m in names],
                      fontsize=7)
        ax.set_ylabel("median s, slowest rank (lower is better)")
        ax.set_title(title, fontsize=10)
    c = report["config"]
    fig.suptitle(f"two tiers: fast {report['fast_dir']}, durable s3:// on a local server; W=2, "
                 f"{c['per_rank_mib']} MiB/rank", fontsize=9)
    fig.tight_layout()
    path = out_dir / "tiers.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
