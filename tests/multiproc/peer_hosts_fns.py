"""One rank of the many-host peer-copy test: ``python peer_hosts_fns.py ROOT PHASE COPIES RANKS_PER_HOST``
with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and GLOO_SOCKET_IFNAME set, inside its host's
network namespace, with ``ROOT/fast`` this host's own directory. Prints one JSON line."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import solosave


def state(rank: int, step: int) -> dict:
    """A replicated model (written once, by one rank: other hosts' ranks read it) and per-rank values."""
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)}, "step": step,
            f"rank{rank}": torch.full((1024,), float(rank * 100 + step))}


def blank(rank: int) -> dict:
    return {"model": {"w": torch.zeros(256, 64), "b": torch.zeros(64)}, "step": 0, f"rank{rank}": torch.zeros(1024)}


def exact(got: dict, want: dict, rank: int) -> bool:
    return (torch.equal(got["model"]["w"], want["model"]["w"]) and torch.equal(got["model"]["b"], want["model"]["b"])
            and torch.equal(got[f"rank{rank}"], want[f"rank{rank}"]) and got["step"] == want["step"])


def main() -> None:
    root, phase, copies, per_host = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("gloo")
    from solosave.integrations import CheckpointManager

    rank = dist.get_rank()
    fast, durable = f"{root}/fast", f"{root}/durable"
    ck = solosave.AsyncCheckpointer(assume_constant_structure=True, durable_root=durable, peer_copies=copies,
                                    durable_every_save=True,  # each save's copies (none coalesced)
                                    ranks_per_host=per_host, timeout=60)
    manager = CheckpointManager(fast, ck, keep_last=2)
    out: dict = {"rank": rank, "layout": ck.peer_layout.describe()}
    if phase == "save":
        for step in (1, 2):
            manager.save(step, state(rank, step))
        manager.finish(120)
        out["copies"] = [[d.step, d.result.ok, d.result.peer_ok, d.result.peer_error,
                          sorted(c.kind for c in d.result.collectives if c.kind not in ("send", "recv"))]
                         for d in manager.durable_done]
    else:
        got = blank(rank)
        point = manager.restore(got)
        out["point"] = point
        out["exact"] = bool(point) and exact(got, state(rank, point[0]), rank)
    manager.finish(60)
    ck.close()
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main()
