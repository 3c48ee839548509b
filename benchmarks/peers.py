"""The peer-copy benchmark (``python -m benchmarks --only peers``): peer copies against raw transfers.

One launch of W=2 local ranks (``benchmarks/ranks.run_ranks``, gloo on 127.0.0.1), each rank a
host of its own (``ranks_per_host=1``) with its own fast tier at the same path, ``<root>/fast``
(each rank in a mount namespace of its own with ``<root>/host<r>`` bind-mounted there: needs
root), ``<root>`` in ``/dev/shm`` where it exists, else under the output directory. The checkpoint is made once by a
real save (``per_rank_mib`` MiB of fp32 tensors per rank), then each host keeps what a fast save
leaves on a node-local tier: its own rank's data files, and ``.metadata`` and the load index on
the coordinator's host only. Then, ``reps`` times each, in turns, after a barrier, the slowest
rank's wall time of:

``peer_copy``     the peer stage of a save with K copies
                  (:func:`solosave._src.tiers.peer_copy.copy_to_peers`): K rounds of files both
                  ways, the status ``all_reduce``, the ``.metadata`` on every host
``raw_copy``      the same bytes between the same processes as plain messages: K rounds, each
                  rank sending a buffer of its files' size to its holder and receiving its
                  source's, in the same 8 MiB messages, nothing written (the limit)
``restore``       host 0 lost its fast tier; every rank runs
                  :func:`solosave._src.tiers.peer_repair.restore_from_peers`, which rebuilds
                  host 0 from host 1 (its own rank's files, and the copies it kept)
``raw_restore``   host 1 sends host 0 the bytes of those files as plain messages (the limit)

K is 1 here (two hosts hold each other's files: K = 2 needs three hosts, which two cores
cannot separate from each other's load). The durable tier is not configured at all: a restore
that needed it would fail, so ``durable_bytes_read`` is 0 by construction, and the benchmark
checks the rebuilt files byte for byte after every restore.
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
CHUNK = 8 << 20
METHODS = ("peer_copy", "raw_copy", "restore", "raw_restore")


def _rank(rank: int, ws: int, root: str, per_rank_mib: int, tensors: int, reps: int) -> Json:
    import torch
    import torch.distributed as dist

    import solosave
    from solosave._src.coordination.channel import CollectiveCounter, DistChannel
    from solosave._src.tiers.peer_copy import copy_to_peers
    from solosave._src.tiers.peer_repair import restore_from_peers
    from solosave._src.tiers.placement import PeerLayout
    from solosave._src.write.writer import FileWriter

    fast = _own_fast_tier(root, rank)
    n = per_rank_mib * MiB // 4 // tensors
    g = torch.Generator().manual_seed(rank)
    state = {f"r{rank}.t{i}": torch.randn(n, generator=g) for i in range(tensors)}
    shared = f"{root}/shared/iter_0000001"
    solosave.save(state, checkpoint_id=shared)
    dist.barrier()
    host = fast  # this rank's "host": its own directory at the shared path (a bind mount)
    mine = sorted(f for f in os.listdir(shared) if f.startswith(f"__{rank}_"))
    meta = [f for f in (".metadata", ".solosave-index") if os.path.exists(f"{shared}/{f}")] if rank == 0 else []
    nbytes = sum(os.path.getsize(f"{shared}/{f}") for f in mine)
    group = dist.new_group(backend="gloo")
    store = dist.FileStore(f"{root}/store", ws)
    ch = DistChannel(group, CollectiveCounter(), store=dist.PrefixStore("peers/", store), timeout=300)
    layout = PeerLayout.of(ws, 1, 1)
    writer = FileWriter(fsync=True)
    other = 1 - rank
    out: Json = {m: [] for m in METHODS}
    out["bytes_per_rank"] = nbytes

    def fresh() -> str:
        d = f"{host}/iter_0000001"
        _clear(host)
        os.makedirs(d)
        for f in mine + meta:
            shutil.copyfile(f"{shared}/{f}", f"{d}/{f}")
        return d

    def timed(fn: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def raw(send: int | None, recv: int | None, size: int) -> None:
        buf = bytes(min(CHUNK, size)) if size else b""
        done = 0
        while done < size:
            step = min(CHUNK, size - done)
            ch.exchange(send, buf[:step] if send is not None else None, recv, step if recv is not None else 0)
            done += step

    kept: dict[str, bytes] = {}
    for seq in range(reps):
        d = fresh()
        out["peer_copy"].append(timed(lambda s=seq, d=d: _ok(copy_to_peers(ch, s, d, tuple(mine), writer, layout))))
        if rank == 0:
            kept = {f: open(f"{d}/{f}", "rb").read() for f in os.listdir(d) if f.endswith(".distcp")}
        out["raw_copy"].append(timed(lambda: raw(other, other, nbytes)))
        if rank == 0:
            _clear(host)  # host 0 lost its fast tier
        steps = {1: "iter_0000001"} if rank == 1 else {}
        out["restore"].append(timed(lambda steps=steps: restore_from_peers(host, steps, 1, group)))
        if rank == 0:
            got = {f: open(f"{d}/{f}", "rb").read() for f in kept}
            if got != kept or not os.path.exists(f"{d}/.metadata"):
                raise AssertionError("the restore did not rebuild host 0's files byte for byte")
        lost = sum(len(b) for b in kept.values()) if rank == 0 else 0
        sizes = torch.tensor([lost])
        dist.broadcast(sizes, 0)
        total = int(sizes.item())
        out["raw_restore"].append(timed(lambda n=total: raw(0 if rank == 1 else None, 1 if rank == 0 else None, n)))
        out["restore_bytes"] = total
    dist.barrier()
    return out


def _own_fast_tier(root: str, rank: int) -> str:
    """Give this rank a fast tier of its own at ``root/fast`` (what every host sees at the same
    path): a mount namespace of its own with ``root/host<rank>`` bind-mounted there. Needs root
    (CAP_SYS_ADMIN). The peer copies name the same directory on every rank, as on real hosts."""
    import ctypes
    import subprocess

    own, fast = f"{root}/host{rank}", f"{root}/fast"
    os.makedirs(own, exist_ok=True)
    os.makedirs(fast, exist_ok=True)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS) failed: the peers benchmark needs root")
    subprocess.run(["mount", "--make-rprivate", "/"], check=True, capture_output=True, timeout=30)
    subprocess.run(["mount", "--bind", own, fast], check=True, capture_output=True, timeout=30)
    return fast


def _clear(directory: str) -> None:
    """Remove everything under ``directory`` (a mount point: it stays)."""
    for name in os.listdir(directory):
        shutil.rmtree(os.path.join(directory, name))


def _ok(failures: dict) -> None:
    if failures:
        raise AssertionError(f"the peer copy failed: {failures}")


def run_peers_bench(cfg: Json, out: Path, progress: Any = None) -> Json:
    """Run the benchmark (see the module docstring); figures per method: the slowest rank's
    median seconds, and each rank's times."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else out
    root = base / f"solosave-peers-bench-{os.getpid()}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    try:
        ranks = run_ranks(_rank, WORLD_SIZE, str(root), cfg["per_rank_mib"], cfg["tensors"], cfg["reps"],
                          timeout=cfg["timeout"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if progress is not None:
        progress.step("peers")
    slowest = {m: [max(r[m][i] for r in ranks) for i in range(cfg["reps"])] for m in METHODS}
    med = {m: statistics.median(v) for m, v in slowest.items()}
    return {"config": {**cfg, "world_size": WORLD_SIZE, "copies": 1, "fast_dir": str(base)},
            "bytes_per_rank": ranks[0]["bytes_per_rank"], "restore_bytes": ranks[1]["restore_bytes"],
            "median_s": med, "slowest_s": slowest, "durable_bytes_read": 0,
            "ratios": {"peer_copy/raw_copy": med["peer_copy"] / med["raw_copy"],
                       "restore/raw_restore": med["restore"] / med["raw_restore"]}}


def print_peers(r: Json) -> None:
    c = r["config"]
    print(f"\n=== peer copies: W={c['world_size']} (one rank per host), K={c['copies']}, "
          f"{r['bytes_per_rank'] / MiB:.0f} MiB per rank, fast tiers in {c['fast_dir']}; medians of {c['reps']} "
          "(slowest rank)")
    for m in METHODS:
        print(f"  {m:12s} {r['median_s'][m] * 1e3:9.1f} ms")
    print(f"  peer copy / raw transfer: {r['ratios']['peer_copy/raw_copy']:.2f}x; restore of a lost host / raw "
          f"transfer of its {r['restore_bytes'] / MiB:.0f} MiB: {r['ratios']['restore/raw_restore']:.2f}x; "
          f"bytes read from the durable tier: {r['durable_bytes_read']}")


def plot_peers(r: Json, plots: Path) -> list:
    """No plot: four figures."""
    return []
