"""One rank of the multi-host test: ``python multihost_fns.py`` with RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT and GLOO_SOCKET_IFNAME set (run inside a network namespace, one per
simulated host). Prints one JSON line with what it saw."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time

import torch
import torch.distributed as dist

import solosave


def state(rank: int, step: int, big: bool = False) -> dict:
    g = torch.Generator().manual_seed(step)
    sd = {"model": {"w": torch.randn(64, 32, generator=g)}, "step": step,
          f"rank{rank}": torch.full((4,), float(rank * 100 + step))}
    if big:  # 64 MiB per rank: the write lasts long enough to be interrupted
        sd[f"big{rank}"] = torch.full((16 << 20,), float(step))
    return sd


def peer_copies(root: str, phase: str) -> dict:
    """Peer copies: ``{root}/fast`` is this host's own directory (a bind mount per host). Phase
    ``peer-save`` saves steps 1-3 with two tiers and peer copies (keep_last 2); ``peer-restore``
    restores the newest step (the test has wiped one host's fast tier and the durable tier)."""
    from solosave.integrations import CheckpointManager

    rank = dist.get_rank()
    fast, durable = f"{root}/fast", f"{root}/durable"
    from tests.multiproc.tier_fns import PeerWriter

    # the peer copy of step 2 fails on rank 2, which cannot write rank 0's file
    writer = PeerWriter(fast, "iter_0000002", 0, fail=rank == 2)
    ck = solosave.AsyncCheckpointer(assume_constant_structure=True, durable_root=durable, peer_copy=True,
                                    timeout=60, writer=writer, durable_every_save=True)  # each save's copies
    manager = CheckpointManager(fast, ck, keep_last=2)
    out: dict = {"rank": rank, "ranks_per_host": ck.peer_ranks_per_host}
    if phase == "peer-save":
        for step in (1, 2, 3):
            manager.save(step, state(rank, step))
        manager.finish(120)
        out["copies"] = [[d.step, d.result.ok, d.result.peer_ok, d.result.peer_error,
                          sorted(c.kind for c in d.result.collectives)] for d in manager.durable_done]
        return out
    got = {"model": {"w": torch.zeros(64, 32)}, "step": 0, f"rank{rank}": torch.zeros(4)}
    point = manager.restore(got)
    want = state(rank, point[0]) if point else {}
    out["point"] = point
    out["exact"] = bool(point) and torch.equal(got["model"]["w"], want["model"]["w"]) and torch.equal(
        got[f"rank{rank}"], want[f"rank{rank}"]) and got["step"] == want["step"]
    manager.finish(60)
    # the same through solosave.load: host 0 loses the step again (its first rank removes it)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(f"{fast}/iter_0000003")
    dist.barrier()
    again = {"model": {"w": torch.zeros(64, 32)}, "step": 0, f"rank{rank}": torch.zeros(4)}
    out["load_path"] = solosave.load(again, f"{fast}/iter_0000003", durable_root=durable, ranks_per_host=2)
    out["load_exact"] = torch.equal(again["model"]["w"], want["model"]["w"]) and torch.equal(
        again[f"rank{rank}"], want[f"rank{rank}"])
    return out


def main() -> None:
    root, phase = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    if phase.startswith("peer-"):
        out = peer_copies(root, phase)
        print(json.dumps(out), flush=True)
        dist.destroy_process_group()
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {"rank": rank}
    ck = solosave.AsyncCheckpointer(prepared_metadata=f"{root}/prep.md", create_prepared_metadata=True,
                                    timeout=20)
    big = phase == "kill"
    for i in (0, 1):
        r = ck.save(state(rank, i, big), f"{root}/{phase}{i}").wait(120)
        out[f"c{i}"] = [r.mode, r.published, sorted(r.collectives("all"))]
    if phase == "kill":
        dist.barrier()
        h = ck.save(state(rank, 2, big), f"{root}/{phase}2")
        if rank >= world // 2:  # the second host's ranks die in the middle of the save
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        try:
            h.wait(60)
            out["c2"] = "published"
        except solosave.SolosaveError as e:
            out["c2"] = f"{type(e).__name__} after {time.monotonic() - t0:.1f} s: {str(e).splitlines()[0]}"
        ck.close(10)
        print(json.dumps(out), flush=True)
        os._exit(0)  # the peers are gone: no orderly teardown of the process group
    ck.close()
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
