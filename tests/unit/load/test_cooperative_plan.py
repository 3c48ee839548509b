"""The plan of a cooperative load (solosave._src.load.cooperative, coordination/sketch.py):
who reads each shared range, the rounds, and the sketch that proves nothing is shared."""

import random

from solosave._src.coordination.sketch import (
    BUCKETS,
    any_shared,
    bucket_of,
    candidates,
    failed_ranks,
    hosts_differ,
    sketch_of,
)
from solosave._src.load.cooperative import assign_readers, plan_rounds


def _sum(*sketches):
    return [sum(col) for col in zip(*sketches)]


def test_the_sketch_finds_every_shared_key_and_proves_when_none_is():
    rng = random.Random(3)
    keys = [(f"__{r}_0.distcp", rng.randrange(1 << 30), rng.randrange(1, 1 << 20), 0) for r in range(200)]
    # four ranks, disjoint keys: no bucket can show two ranks unless two keys collide
    parts = [keys[i::4] for i in range(4)]
    summed = _sum(*(sketch_of(p) for p in parts))
    buckets = [bucket_of(k) for k in keys]
    assert any_shared(summed) == (len(set(buckets)) < len(buckets))
    # a key two ranks need is always a candidate on both (no false negative)
    shared = keys[7]
    parts[1] = [*parts[1], shared]
    summed = _sum(*(sketch_of(p) for p in parts))
    assert any_shared(summed)
    assert shared in candidates(parts[1], summed) and shared in candidates(parts[3], summed)
    # a key twice on one rank counts once; a failed rank is counted apart
    assert sketch_of([shared, shared])[bucket_of(shared)] == 1
    assert failed_ranks(_sum(sketch_of(None), sketch_of([]))) == 1 and len(sketch_of([])) == BUCKETS + 3


def test_the_sketch_tells_one_host_from_several():
    assert not hosts_differ(_sum(*(sketch_of([], "node-a") for _ in range(8))), 8)
    assert hosts_differ(_sum(*(sketch_of([], f"node-{r // 4}") for r in range(8))), 8)
    assert hosts_differ(_sum(sketch_of([], "a"), sketch_of([], "b")), 2)


def test_readers_spread_over_hosts_first_then_ranks():
    # two hosts of two ranks; every range needed by one rank on each host (replicas across hosts)
    keys = [("f", i * 100, 100, 0) for i in range(8)]
    needs = [("a", keys[0::2]), ("a", keys[1::2]), ("b", keys[0::2]), ("b", keys[1::2])]
    plan = assign_readers(needs)
    assert set(plan) == set(keys)
    per_rank = [sum(k[2] for k, (r, _) in plan.items() if r == rank) for rank in range(4)]
    assert per_rank == [200, 200, 200, 200], per_rank
    for k, (reader, receivers) in plan.items():
        assert reader not in receivers and sorted((reader, *receivers)) in ([0, 2], [1, 3])
    # a range only one rank needs is not shared; a rank's unshared bytes count against it
    plan = assign_readers([("a", [("f", 0, 10, 0), ("g", 0, 5, 0)]), ("a", [("f", 0, 10, 0)])], unshared=[100, 0])
    assert plan == {("f", 0, 10, 0): (1, (0,))}


def test_rounds_bound_what_a_rank_reads_or_receives():
    keys = [("f", i, 40, 0) for i in range(10)] + [("g", 0, 500, 0)]
    plan = {k: (i % 2, (2,)) for i, k in enumerate(keys)}
    rounds = plan_rounds(plan, window=100)
    assert sorted(k for r in rounds for k in r) == sorted(keys)
    for r in rounds:
        for rank in range(3):
            got = [k[2] for k in r if plan[k][0] == rank or rank in plan[k][1]]
            assert sum(got) <= 100 or len(got) == 1, (r, rank)  # a larger range alone
    assert plan_rounds({}) == []
