"""The torch.distributed call counter that the Lightning tests and benchmark rely on to show that
a save calls no collective in the training thread: it must see the calls it is meant to see."""

import threading

import torch
import torch.distributed as dist

from solosave._src.testing.dist_calls import DistCalls


def test_counts_the_main_threads_calls_inside_the_block_only():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    real = {name: getattr(dist, name) for name in ("barrier", "all_reduce")}
    try:
        calls = DistCalls(tuple(real))
        dist.barrier()  # outside any block: not counted
        with calls.counting() as seen:
            dist.barrier()
            dist.all_reduce(torch.ones(1))
            dist.all_reduce(torch.ones(1))
            t = threading.Thread(target=dist.barrier)  # another thread: not counted
            t.start()
            t.join()
        assert dict(seen) == {"barrier": 1, "all_reduce": 2}
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
        dist.destroy_process_group()
