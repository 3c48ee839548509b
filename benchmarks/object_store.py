"""The object-store benchmark (``python -m benchmarks --only s3``): saves to ``s3://`` side by side.

One launch of W=2 local ranks (``benchmarks/ranks.run_ranks``, gloo on 127.0.0.1, CPU tensors)
against an S3-compatible server started here on 127.0.0.1 (moto's server mode, from PyPI:
``pip install 'moto[server]'``; the ranks reach it through the standard AWS variables). Every
rank holds ``per_rank_mib`` MiB of its own fp32 tensors (``tensors`` per rank). Per method, after
a barrier, the time until every rank is done (the slowest rank):

``raw``        each rank uploads the same number of bytes, prepared beforehand as one buffer, with
               s3fs's own concurrent multipart upload (``pipe_file``, the part size and concurrency
               solosave uses): the bytes a save must move, nothing else (the limit)
``solosave``   ``AsyncCheckpointer`` with a prepared file on the store (the first save creates it
               and is reported apart; the others are reuse saves): ``save()`` -> ``wait()``
               returned, i.e. ``.metadata`` published
``dcp_async``  stock ``torch.distributed.checkpoint.async_save`` with its fsspec writer
               (``FsspecWriter``, thread executor): the call -> its future's result (the first
               save reported apart)

``block`` is the time inside ``save()`` / ``async_save()``. The methods take turns save by save;
each checkpoint is deleted (outside the timed window) before the next, so the in-memory server
does not grow. Reported: medians of the steady saves and MB/s over both ranks' bytes. Every
saved checkpoint of the last round is loaded back and compared bit for bit (outside the timing).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

from solosave._src.testing.s3_server import s3_server

from .ranks import environ, run_ranks

Json = dict[str, Any]
MiB = 1 << 20
WORLD_SIZE = 2
METHODS = ("raw", "solosave", "dcp_async")
LABELS = {"raw": "raw multipart upload", "solosave": "solosave (reuse)", "dcp_async": "DCP async_save + FsspecWriter"}
PART = 16 * MiB
CONCURRENCY = 8


# ---------------------------------------------------------------------------------------------
# Rank-side code (spawned processes; module-level so that it pickles)
# ---------------------------------------------------------------------------------------------

def _timed(fn: Any) -> tuple[float, float, Any]:
    """``(block s, total s, result)`` of ``fn() -> (finish callable)``, after a barrier."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    finish = fn()
    t1 = time.perf_counter()
    out = finish()
    return t1 - t0, time.perf_counter() - t0, out


def rank_s3(rank: int, world_size: int, cfg: Json) -> Json:
    import fsspec
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    import solosave

    torch.set_num_threads(1)
    fs = fsspec.filesystem("s3")
    root = f"s3://{cfg['bucket']}"
    n = cfg["per_rank_mib"] * MiB // 4 // cfg["tensors"]
    g = torch.Generator().manual_seed(rank)
    sd = {f"t{rank}_{i}": torch.rand(n, generator=g) for i in range(cfg["tensors"])}
    raw = b"".join(t.numpy().tobytes() for t in sd.values())  # prepared before any timing
    times: Json = {m: [] for m in METHODS}
    first: Json = {}
    phases: list[Json] = []
    writer = solosave.FileWriter(part_size=PART, upload_concurrency=CONCURRENCY)
    ckpt = solosave.AsyncCheckpointer(writer=writer, prepared_metadata=f"{root}/prepared.metadata",
                                      create_prepared_metadata=True, timeout=cfg["timeout"])

    def upload_raw(i: int) -> Any:
        return lambda: fs.pipe_file(f"{root}/raw/{i}/{rank}", raw, chunksize=PART, max_concurrency=CONCURRENCY)

    methods = {  # each starts a save and returns what finishes it
        "raw": upload_raw,
        "solosave": lambda i: ckpt.save(sd, f"{root}/solosave/{i}").wait,
        "dcp_async": lambda i: dcp.async_save(sd, storage_writer=FsspecWriter(f"{root}/dcp_async/{i}")).result,
    }
    try:
        for i in range(cfg["saves"] + 1):
            for m in METHODS:
                block, total, result = _timed(lambda m=m, i=i: methods[m](i))
                if m == "solosave":
                    first.setdefault("solosave_mode", result.mode)
                    if i:
                        phases.append({k: getattr(result.timings, k) for k in ("write", "coordinate", "publish")})
                (times[m] if i else first.setdefault(m, [])).append((block, total))
                dist.barrier()
                if i < cfg["saves"]:  # keep the last round for the check below
                    if rank == 0:
                        fs.rm(f"{root}/{m}/{i}", recursive=True)
                    dist.barrier()
    finally:
        ckpt.close()
    last = cfg["saves"]
    got = {k: torch.zeros_like(v) for k, v in sd.items()}
    solosave.load(got, f"{root}/solosave/{last}")
    exact = all(torch.equal(got[k], v) for k, v in sd.items())
    got = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(got, storage_reader=FsspecReader(f"{root}/dcp_async/{last}"))
    exact = exact and all(torch.equal(got[k], v) for k, v in sd.items())
    return {"rank": rank, "times": times, "first": first, "exact": exact, "bytes": len(raw), "phases": phases}


# ---------------------------------------------------------------------------------------------
# Driver, report
# ---------------------------------------------------------------------------------------------

def run_s3_bench(cfg: Json, progress: Any) -> Json:
    """One launch at W=2 against a local server; returns the ``s3`` report section."""
    import fsspec

    progress.step(f"s3: W={WORLD_SIZE}, {cfg['per_rank_mib']} MiB per rank, {cfg['saves']} saves per method")
    with s3_server() as (_, env), environ(env):
        bucket = f"bench-{os.getpid()}"
        fsspec.filesystem("s3").mkdir(f"s3://{bucket}")
        res = run_ranks(rank_s3, WORLD_SIZE, {**cfg, "bucket": bucket}, timeout=cfg["timeout"], env=env)
    total_bytes = sum(r["bytes"] for r in res)
    methods: Json = {}
    for m in METHODS:
        per_save = [max(r["times"][m][i][1] for r in res) for i in range(cfg["saves"])]
        blocks = [max(r["times"][m][i][0] for r in res) for i in range(cfg["saves"])]
        firsts = [max(r["first"][m][0][1] for r in res)]
        med = statistics.median(per_save)
        methods[m] = {"median_s": med, "min_s": min(per_save), "max_s": max(per_save),
                      "block_median_ms": statistics.median(blocks) * 1e3, "first_s": firsts[0],
                      "mb_per_s": total_bytes / med / 1e6}
    raw = methods["raw"]["median_s"]
    for m in METHODS:
        methods[m]["over_raw"] = methods[m]["median_s"] / raw
    phases = {k: statistics.median(p[k] for r in res for p in r["phases"]) * 1e3 for k in ("write", "coordinate", "publish")}
    return {"config": cfg, "world_size": WORLD_SIZE, "bytes_total": total_bytes, "methods": methods,
            "solosave_phase_median_ms": phases,
            "first_solosave_mode": res[0]["first"].get("solosave_mode"), "exact": all(r["exact"] for r in res),
            "server": "moto (python -m moto.server) on 127.0.0.1, same machine"}


def print_s3(report: Json) -> None:
    c = report["config"]
    print(f"\n== saves to s3:// (W={report['world_size']}, {c['per_rank_mib']} MiB/rank in {c['tensors']} "
          f"tensors, {c['saves']} steady saves per method, slowest rank; {report['server']}) ==")
    print(f"{'method':<32}{'median s':>10}{'range s':>16}{'MB/s':>8}{'x raw':>7}{'block ms':>10}{'first s':>9}")
    for m, e in report["methods"].items():
        print(f"{LABELS[m]:<32}{e['median_s']:>10.2f}{e['min_s']:>8.2f}-{e['max_s']:<7.2f}{e['mb_per_s']:>8.1f}"
              f"{e['over_raw']:>7.2f}{e['block_median_ms']:>10.1f}{e['first_s']:>9.2f}")
    print("solosave's worker, median ms per steady save and rank: "
          + ", ".join(f"{k} {v:.0f}" for k, v in report["solosave_phase_median_ms"].items()))
    print(f"loaded back bit for bit (solosave.load, DCP FsspecReader): {report['exact']}; first solosave "
          f"save: {report['first_solosave_mode']}")


def plot_s3(report: Json, out_dir: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    names = list(report["methods"])
    vals = [report["methods"][m]["mb_per_s"] for m in names]
    ax.bar(range(len(names)), vals, color=["0.6", "tab:blue", "tab:orange"][:len(names)])
    ax.set_xticks(range(len(names)), [LABELS[m].replace(" + ", "\n+ ") for m in names], fontsize=8)
    ax.set_ylabel("MB/s, both ranks (higher is better)")
    c = report["config"]
    ax.set_title(f"saves to s3:// on a local server, W=2, {c['per_rank_mib']} MiB/rank", fontsize=10)
    fig.tight_layout()
    path = out_dir / "object_store.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
