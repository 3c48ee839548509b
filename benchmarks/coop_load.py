"""The cooperative-load benchmark (``python -m benchmarks --only load``, or ``--only coop`` alone):
W = 4 local ranks (gloo on 127.0.0.1, CPU tensors) load a checkpoint saved at W = 2, as

``replicated 2x2``  2 replicas x 2 shards (a 2-d mesh, ``[Replicate(), Shard(0)]``): every saved
                    chunk is needed by two ranks;
``resharded 2->4``  a 1-d mesh of 4 (``Shard(0)``): every saved chunk feeds two ranks, half each;

each from local files (page cache warm; and cold: every data file's cached pages dropped with
``posix_fadvise(DONTNEED)`` before each load, so that reads come from the disk) and from the S3
test server (moto on 127.0.0.1, ``s3fs``). Methods, per repetition (the slowest rank's time):

``raw``             one process (rank 0; the others wait) reads every data file once, whole,
                    into memory: the unique bytes, nothing else
``deliver``         every rank sends a quarter of the unique bytes to another rank and receives as
                    much (``isend``/``irecv`` over the job's gloo group): the network part of a
                    cooperative load of this checkpoint
``dcp``             stock ``dcp.load`` (``FileSystemReader``; ``FsspecReader`` on S3)
``solosave``        ``solosave.load`` (the default: cooperative on S3; on local files only across
                    hosts, so not here, one host)
``solosave_coop``   ``solosave.load(..., cooperative=True)`` (between any ranks)
``solosave_alone``  ``solosave.load(..., cooperative=False)``

Then the **replica sweep**: ``SWEEP_WS`` = 8 ranks load a checkpoint saved by one rank as R = 1, 2,
4 and 8 replicas (a mesh of R x 8/R; R = 1: eight shards) from local files, once per method
(stock ``dcp.load``, solosave with ``cooperative=True``, without): the bytes the job reads over
the checkpoint's, and the slowest rank's time.

Bytes read from storage per load, summed over ranks: for solosave, counted by wrapping
``os.preadv``/``os.pread`` in each rank (bytes returned for ``.distcp`` descriptors; local
files), independently of the library, and the library's own ``LoadResult.bytes_read`` (every
storage); for stock DCP on local files, the growth of ``rchar`` in ``/proc/self/io`` during the
load (every byte its reads returned: its plan gathers add a few KiB). Every load is checked bit
for bit against the saved tensors, outside the timed window. Repetition 0 warms up and is not
kept; the methods' order rotates between repetitions.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

Json = dict[str, Any]
MiB = 1 << 20
CASES = (("replicated 2x2", 2), ("resharded 2->4", 1))
STORAGES = ("local, warm cache", "local, cold cache", "s3 (moto)")
METHODS = ("raw", "deliver", "dcp", "solosave", "solosave_coop", "solosave_alone")
LABELS = {"raw": "raw read of unique bytes (1 proc)", "deliver": "gloo delivery of 1/4 per rank",
          "dcp": "stock dcp.load", "solosave": "solosave.load (default)",
          "solosave_coop": "solosave.load, cooperative=True", "solosave_alone": "solosave.load, cooperative=False"}
#: The goals of issue 41 (local files, W = 4): solosave / (raw + deliver) and solosave / dcp.
GOALS = {"raw_plus_deliver": 1.15, "dcp": 0.5}
LOAD_WS = 4
#: The replica sweep: this many ranks load a checkpoint saved by one, as R = 1, 2, 4, 8 replicas.
SWEEP_WS = 8


# ---------------------------------------------------------------------------------------------
# Rank-side code (runs in processes spawned by run_ranks; module-level so that it pickles)
# ---------------------------------------------------------------------------------------------

def _values(total_mib: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(41)
    n = 8
    rows = total_mib * MiB // n // (1024 * 4)
    return {f"w{i}": torch.rand(rows, 1024, generator=g) for i in range(n)}


def sharded_state(ws: int, vals: dict[str, Any], replicas: int = 1) -> dict[str, Any]:
    """``vals`` as DTensors over ``ws`` ranks: ``Shard(0)`` over a 1-d mesh (``replicas`` = 1), or
    ``replicas`` x shards over a 2-d mesh (``[Replicate(), Shard(0)]``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if replicas == 1:
        mesh, placements = init_device_mesh("cpu", (ws,)), [Shard(0)]
    else:
        mesh = init_device_mesh("cpu", (replicas, ws // replicas), mesh_dim_names=("dp", "shard"))
        placements = [Replicate(), Shard(0)]
    return {k: distribute_tensor(v, mesh, placements) for k, v in vals.items()}


def rank_save(rank: int, ws: int, path: str, total_mib: int) -> None:
    import solosave

    with solosave.AsyncCheckpointer(worker="thread") as ckpt:
        ckpt.save(sharded_state(ws, _values(total_mib), 1), path).wait(timeout=300)


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _drop_cache(files: list[str]) -> None:
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def rank_load(rank: int, ws: int, case: Json, cfg: Json) -> Json:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import solosave
    from benchmarks.ranks import counting_distcp_reads

    torch.set_num_threads(1)
    path, url = case["path"], case.get("url")
    target = url or path
    want = _values(cfg["total_mib"])
    sd = sharded_state(ws, {k: torch.zeros_like(v) for k, v in want.items()}, case["replicas"])
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".distcp"))
    unique = sum(os.path.getsize(f) for f in files)
    share = torch.ones(unique // ws, dtype=torch.uint8)
    inbox = torch.empty_like(share)
    raw_buf = torch.empty(unique, dtype=torch.uint8) if rank == 0 else None
    fs = None
    if url:
        import fsspec

        fs = fsspec.filesystem("s3")

    def raw() -> None:
        if rank != 0:
            return
        at = 0
        for f in files:
            name = os.path.basename(f)
            data = fs.cat_file(f"{url}/{name}") if fs is not None else None
            if data is not None:
                raw_buf[at:at + len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                at += len(data)
                continue
            with open(f, "rb", buffering=0) as fh:
                at += fh.readinto(memoryview(raw_buf.numpy())[at:])

    def deliver() -> None:
        peer = (rank + ws // 2) % ws
        works = [dist.isend(share, peer), dist.irecv(inbox, peer)]
        for w in works:
            w.wait()

    def stock() -> None:
        if url:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            dcp.load(sd, storage_reader=FsspecReader(url))
        else:
            dcp.load(sd, checkpoint_id=path)

    results: dict[str, Any] = {}

    def coop(flag: bool | None, key: str) -> None:
        results[key] = solosave.load(sd, target, cooperative=flag)

    methods = {"raw": raw, "deliver": deliver, "dcp": stock, "solosave": lambda: coop(None, "solosave"),
               "solosave_coop": lambda: coop(True, "solosave_coop"),
               "solosave_alone": lambda: coop(False, "solosave_alone")}
    times: dict[str, list[float]] = {m: [] for m in cfg["methods"]}
    read: dict[str, list[int]] = {m: [] for m in cfg["methods"]}
    lib: dict[str, list[Json]] = {m: [] for m in ("solosave", "solosave_coop", "solosave_alone")}
    exact = True
    for rep in range(1 + cfg["reps"]):
        order = cfg["methods"][rep % len(cfg["methods"]):] + cfg["methods"][:rep % len(cfg["methods"])]
        for m in order:
            for t in sd.values():
                t.to_local().zero_()
            if case["cold"] and rank == 0:
                _drop_cache(files)
            dist.barrier()
            before = _rchar()
            with counting_distcp_reads() as counted:
                t0 = time.perf_counter()
                methods[m]()
                dt = time.perf_counter() - t0
            grew = _rchar() - before
            if rep:
                times[m].append(dt)
                local = not url
                read[m].append(counted[0] if m.startswith("solosave") and local else grew if m == "dcp" and local else -1)
                if m in lib:
                    lib[m].append(results[m].as_dict())
            if m in ("dcp", *lib):
                exact = exact and all(torch.equal(sd[k].full_tensor(), v) for k, v in want.items())
    return {"rank": rank, "times": times, "read": read, "lib": lib, "exact": exact, "unique": unique}


def rank_sweep(rank: int, ws: int, path: str, replicas: int, total_mib: int) -> Json:
    """One load per method of the checkpoint at ``path`` (saved at W = 1) by ``ws`` ranks as
    ``replicas`` x ``ws / replicas`` shards: bytes of ``.distcp`` files read by this rank
    (os.preadv/os.pread for solosave, /proc/self/io rchar for stock DCP) and the time."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import solosave
    from benchmarks.ranks import counting_distcp_reads

    torch.set_num_threads(1)
    want = _values(total_mib)
    sd = sharded_state(ws, {k: torch.zeros_like(v) for k, v in want.items()}, replicas)
    out: Json = {}
    solosave.load(sd, path, cooperative=False)  # warm-up (imports, first reads): not timed
    for m in ("dcp", "solosave_coop", "solosave_alone"):
        for t in sd.values():
            t.to_local().zero_()
        dist.barrier()
        before = _rchar()
        with counting_distcp_reads() as counted:
            t0 = time.perf_counter()
            if m == "dcp":
                dcp.load(sd, checkpoint_id=path)
            else:
                solosave.load(sd, path, cooperative=m == "solosave_coop")
            dt = time.perf_counter() - t0
        read = _rchar() - before if m == "dcp" else counted[0]
        exact = all(torch.equal(sd[k].full_tensor(), v) for k, v in want.items())
        out[m] = {"read": read, "seconds": dt, "exact": exact}
    return out


def run_replica_sweep(cfg: Json, out_dir: Path, progress: Any) -> Json:
    """W = 8 ranks load a checkpoint saved by one rank as R = 1, 2, 4, 8 replicas: the bytes
    the job reads from the data files over the checkpoint's, per method."""
    from benchmarks import coop_load as rank_fns
    from benchmarks.ranks import run_ranks

    data = out_dir / "data" / "coop-sweep"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    path = str(data / "ckpt")
    rows: Json = {}
    try:
        run_ranks(rank_fns.rank_save, 1, path, cfg["sweep_mib"], timeout=cfg["timeout"])
        unique = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".distcp"))
        for r in (1, 2, 4, 8):
            progress.step(f"coop sweep R={r}")
            per_rank = run_ranks(rank_fns.rank_sweep, SWEEP_WS, path, r, cfg["sweep_mib"], timeout=cfg["timeout"])
            rows[str(r)] = {m: {"read_over_unique": sum(p[m]["read"] for p in per_rank) / unique,
                                "seconds": max(p[m]["seconds"] for p in per_rank),
                                "exact": all(p[m]["exact"] for p in per_rank)}
                            for m in ("dcp", "solosave_coop", "solosave_alone")}
    finally:
        shutil.rmtree(data, ignore_errors=True)
    return {"world_size": SWEEP_WS, "total_mib": cfg["sweep_mib"], "unique_bytes": unique, "replicas": rows}


# ---------------------------------------------------------------------------------------------
# Driver, aggregation, table and plot (parent process)
# ---------------------------------------------------------------------------------------------

def summarize(per_rank: list[Json], methods: list[str]) -> Json:
    unique = per_rank[0]["unique"]
    out: Json = {"unique_bytes": unique, "exact": all(r["exact"] for r in per_rank), "methods": {}}
    for m in methods:
        n = len(per_rank[0]["times"][m])
        reps = [max(r["times"][m][i] for r in per_rank) for i in range(n)]
        med = statistics.median(reps)
        counted = [sum(r["read"][m][i] for r in per_rank) for i in range(n)]
        entry: Json = {"median_ms": med * 1e3, "min_ms": min(reps) * 1e3, "max_ms": max(reps) * 1e3,
                       "reps_ms": [t * 1e3 for t in reps]}
        if all(c >= 0 for c in counted) and m in ("dcp", "solosave", "solosave_coop", "solosave_alone"):
            entry["read_over_unique"] = statistics.median(counted) / unique
        if m in per_rank[0]["lib"]:
            entry["lib_read_over_unique"] = statistics.median(
                sum(r["lib"][m][i]["bytes_read"] for r in per_rank) for i in range(n)) / unique
            entry["received_over_unique"] = statistics.median(
                sum(r["lib"][m][i]["bytes_received"] for r in per_rank) for i in range(n)) / unique
        out["methods"][m] = entry
    meds = {m: v["median_ms"] for m, v in out["methods"].items()}
    r: Json = {}
    for m in ("solosave", "solosave_coop"):
        if m not in meds:
            continue
        if "dcp" in meds:
            r[f"{m}_over_dcp"] = meds[m] / meds["dcp"]
        if "raw" in meds and "deliver" in meds:
            r[f"{m}_over_raw_plus_deliver"] = meds[m] / (meds["raw"] + meds["deliver"])
        if "solosave_alone" in meds:
            r[f"{m}_over_alone"] = meds[m] / meds["solosave_alone"]
    out["ratios"] = r
    return out


def run_coop_bench(cfg: Json, out_dir: Path, progress: Any) -> Json:
    """Save once at W = 2, then every case and storage at W = 4; returns the ``coop`` section."""
    from benchmarks import coop_load as rank_fns  # by module name, so that the rank functions pickle
    from benchmarks.ranks import environ, run_ranks

    report: Json = {"config": cfg, "cases": {}}
    data = out_dir / "data" / "coop"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    path = str(data / "ckpt")
    try:
        run_ranks(rank_fns.rank_save, 2, path, cfg["total_mib"], timeout=cfg["timeout"])
        for storage in cfg["storages"]:
            for name, replicas in CASES:
                progress.step(f"coop {name}, {storage}")
                case = {"path": path, "replicas": replicas, "cold": storage == "local, cold cache"}
                try:
                    if storage.startswith("s3"):
                        per_rank = _on_s3(path, case, cfg, rank_fns, run_ranks, environ)
                    else:
                        per_rank = run_ranks(rank_fns.rank_load, LOAD_WS, case, cfg, timeout=cfg["timeout"])
                    report["cases"][f"{name} | {storage}"] = summarize(per_rank, cfg["methods"])
                except (AssertionError, RuntimeError, ImportError) as e:
                    report["cases"][f"{name} | {storage}"] = {"error": str(e)}
                    progress.note(f"[coop {name}, {storage}] FAILED:\n{e}")
        try:
            report["sweep"] = run_replica_sweep(cfg, out_dir, progress)
        except AssertionError as e:
            report["sweep"] = {"error": str(e)}
            progress.note(f"[coop sweep] FAILED:\n{e}")
    finally:
        shutil.rmtree(data, ignore_errors=True)
    return report


def _on_s3(path: str, case: Json, cfg: Json, rank_fns: Any, run_ranks: Any, environ: Any) -> list[Json]:
    import fsspec

    from solosave._src.testing.s3_server import s3_server

    with s3_server() as (_, env), environ(env):
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        fs.mkdir("bench")
        for f in os.listdir(path):
            fs.put_file(os.path.join(path, f), f"bench/ckpt/{f}")
        s3cfg = {**cfg, "reps": max(1, cfg["reps"] // 2)}
        return run_ranks(rank_fns.rank_load, LOAD_WS, {**case, "url": "s3://bench/ckpt"}, s3cfg,
                         timeout=cfg["timeout"])


def print_coop(coop: Json) -> None:
    cfg = coop["config"]
    print()
    print(f"=== cooperative load: a {cfg['total_mib']} MiB checkpoint saved at W=2, loaded at W={LOAD_WS} local "
          f"ranks; median of {cfg['reps']} repetitions (slowest rank), range in brackets ===")
    head = f"{'case | storage':<40} {'method':<35} {'median ms':>9} {'range ms':>13} {'read/unique':>11}"
    print(head)
    print("-" * len(head))
    for name, c in coop["cases"].items():
        if "error" in c:
            print(f"{name:<40} FAILED: {c['error'].strip().splitlines()[-1]}")
            continue
        for m in (m for m in METHODS if m in c["methods"]):
            v = c["methods"][m]
            ru = v.get("read_over_unique", v.get("lib_read_over_unique"))
            rus = f"{ru:.2f}x" if ru is not None else ""
            print(f"{name:<40} {LABELS[m]:<35} {v['median_ms']:>9.1f} {v['min_ms']:>6.0f}-{v['max_ms']:<6.0f} {rus:>11}")
        ratios = ", ".join(f"{k} {v:.2f}x" for k, v in c["ratios"].items())
        print(f"{'':<40} bit-exact: {'yes' if c['exact'] else 'NO'}; {ratios}")
    sweep = coop.get("sweep")
    if sweep and "error" not in sweep:
        print()
        print(f"=== replicas: W={sweep['world_size']} ranks load a {sweep['total_mib']} MiB checkpoint saved by one "
              "rank as R replicas; bytes read from the data files / the checkpoint's, and the slowest rank's time ===")
        print(f"{'R':>3} {'stock dcp.load':>24} {'solosave, cooperative':>24} {'solosave, alone':>24}")
        for r, row in sweep["replicas"].items():
            cells = [f"{row[m]['read_over_unique']:.2f}x {row[m]['seconds'] * 1e3:6.0f} ms"
                     + ("" if row[m]["exact"] else " NOT EXACT") for m in ("dcp", "solosave_coop", "solosave_alone")]
            print(f"{r:>3} {cells[0]:>24} {cells[1]:>24} {cells[2]:>24}")
    elif sweep:
        print(f"replica sweep FAILED: {sweep['error'].strip().splitlines()[-1]}")


def plot_coop(coop: Json, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [n for n, c in coop["cases"].items() if "error" not in c]
    if not cases:
        return []
    fig, axes = plt.subplots(1, len(cases), figsize=(4.6 * len(cases), 3.4), squeeze=False)
    colors = {"raw": "#7f7f7f", "deliver": "#bcbd22", "dcp": "#ff7f0e", "solosave": "#1f77b4",
              "solosave_coop": "#2ca02c", "solosave_alone": "#aec7e8"}
    for ax, name in zip(axes[0], cases):
        ms = coop["cases"][name]["methods"]
        meth = [m for m in METHODS if m in ms]
        med = [ms[m]["median_ms"] for m in meth]
        ax.barh(range(len(meth)), med, color=[colors[m] for m in meth])
        for i, m in enumerate(meth):
            ru = ms[m].get("read_over_unique", ms[m].get("lib_read_over_unique"))
            ax.text(med[i], i, f" {med[i]:.0f} ms" + (f", reads {ru:.2f}x" if ru is not None else ""),
                    va="center", fontsize=6)
        ax.set_xlim(0, max(med) * 1.6)
        ax.set_yticks(list(range(len(meth))), [LABELS[m] for m in meth], fontsize=6)
        ax.invert_yaxis()
        ax.set_xlabel("ms per load (median)", fontsize=7)
        ax.set_title(name, fontsize=7)
    fig.tight_layout()
    path = out / "coop_load.png"
    fig.savefig(path, dpi=70)
    plt.close(fig)
    return [path]
