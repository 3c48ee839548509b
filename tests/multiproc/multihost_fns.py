"""One rank of the multi-host test: ``python multihost_fns.py`` with RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT and GLOO_SOCKET_IFNAME set (run inside a network namespace, one per
simulated host). Prints one JSON line with what it saw."""

from __future__ import annotations

import json
import os
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


def main() -> None:
    root, phase = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
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
