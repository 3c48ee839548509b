"""The preemption guard's agreement (tools/preemption.py), rank threads over in-process channels:
every rank stops at one step, no rank passes it unaware, and no wait is unbounded."""

from __future__ import annotations

import random
import threading
import time

import pytest

from solosave._src.core.errors import ChannelError
from solosave._src.testing.local_channel import local_channels
from solosave._src.tools.preemption import StopAgreement

pytestmark = pytest.mark.timeout(120)


def _run_ranks(world, body, timeout=60.0):
    """``body(rank, channel)`` on one thread per rank; returns their results (raises the first error)."""
    channels = local_channels(world, timeout=timeout)
    results, errors = [None] * world, []

    def one(r):
        try:
            results[r] = body(r, channels[r])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
    assert not any(t.is_alive() for t in threads), "a rank thread hung"
    if errors:
        raise errors[0]
    return results


class _SlowRounds:
    """A channel whose rounds take 0-30 ms (a loaded network): loops pass boundaries while a
    decision is under way, which is what the agreement must survive."""

    def __init__(self, ch, seed):
        self._ch, self._rng = ch, random.Random(seed)
        self.world_size, self.rank, self.counter = ch.world_size, ch.rank, ch.counter

    def all_reduce_max(self, values):
        time.sleep(self._rng.uniform(0, 0.03))
        return self._ch.all_reduce_max(values)


def _lockstep_loop(agreement, rank, barrier, notice_at, seed, steps=400):
    """A training loop whose ranks meet at every step (as gradients' all_reduce makes them), with
    uneven step times; rank ``rank`` gets a notice at step ``notice_at.get(rank)``. Returns the
    steps at which ``stop_here`` said stop (the first ends the loop)."""
    rng = random.Random(seed * 100 + rank)
    for step in range(1, steps + 1):
        time.sleep(rng.uniform(0, 0.004))
        if notice_at.get(rank) == step:
            agreement.request(f"test notice on rank {rank}")
        if agreement.stop_here(step):
            return step
        barrier.wait(30)  # the step's collective: no rank runs ahead by more than one step
    return None


@pytest.mark.parametrize("seed", range(12))
def test_every_rank_stops_at_the_same_step_whoever_gets_the_notice(seed):
    world = 2 + seed % 3
    rng = random.Random(seed)
    notice_at = {r: rng.randint(5, 60) for r in rng.sample(range(world), rng.randint(1, world))}
    barrier = threading.Barrier(world)

    def body(rank, ch):
        agreement = StopAgreement(_SlowRounds(ch, seed * 10 + rank), interval=0.01, timeout=30)
        try:
            return _lockstep_loop(agreement, rank, barrier, notice_at, seed), agreement.stop_step, ch.counter
        finally:
            agreement.close(10)

    got = _run_ranks(world, body)
    stops = {s for s, _, _ in got}
    assert len(stops) == 1 and None not in stops, got  # one step, on every rank
    (stop,) = stops
    assert all(agreed == stop for _, agreed, _ in got)
    assert stop >= min(notice_at.values())  # never before the notice...
    assert stop <= min(notice_at.values()) + 100  # ...and soon after it (rounds every 10-40 ms)
    for _, _, counter in got:  # only 24-byte all_reduces on the agreement's channel
        assert {(c.kind, c.payload_bytes) for c in counter.since(0)} == {("all_reduce", 24)}


def _stop_on(notice_step, trigger, **per_rank):
    """Two lockstep ranks; ``trigger()`` runs on rank 0 at ``notice_step``; ``per_rank[name]``:
    the agreement's keyword ``name`` for each rank. Returns each rank's (stop step, reason)."""
    barrier = threading.Barrier(2)

    def body(rank, ch):
        a = StopAgreement(ch, interval=0.01, timeout=30, **{k: v[rank] for k, v in per_rank.items()})
        try:
            for step in range(1, 2000):
                if step == notice_step and rank == 0:
                    trigger()
                if a.stop_here(step):
                    return step, a.reason
                barrier.wait(30)
                time.sleep(0.001)
        finally:
            a.close(10)

    return _run_ranks(2, body)


def test_a_notice_file_and_a_callable_are_notices(tmp_path):
    notice = tmp_path / "preempt"
    (s0, why0), (s1, why1) = _stop_on(20, lambda: notice.write_text(""), notice_file=[notice, None])
    assert s0 == s1 and s0 >= 20 and "notice file" in why0 and why1 is None
    flag = threading.Event()
    (s0, why0), (s1, why1) = _stop_on(7, flag.set, requested=[None, flag.is_set])
    assert s0 == s1 and s0 >= 7 and why0 is None and why1 == "requested by the callable"


def test_without_a_notice_nothing_stops_and_close_ends_every_watcher():
    barrier = threading.Barrier(3)

    def body(rank, ch):
        a = StopAgreement(ch, interval=0.005, timeout=30)
        for step in range(1, 50):
            assert not a.stop_here(step)
            barrier.wait(30)
        if rank == 1:  # one rank closes first: every watcher ends after that round
            a.close(10)
        a._thread.join(10)
        assert not a._thread.is_alive()
        a.close(1)
        return a.stop_step

    assert _run_ranks(3, body) == [None, None, None]


def test_alone_a_notice_stops_at_the_next_boundary():
    a = StopAgreement(None)
    assert not a.stop_here(1)
    a.request("alone")
    assert a.stop_here(2) and a.stop_here(3) and a.stop_step == 2 and a.reason == "alone"


def test_a_rank_gone_during_the_decision_fails_the_waiting_loop_within_its_timeout():
    """Rank 1's watcher never runs its rounds (a rank gone): rank 0's notice cannot be agreed,
    and rank 0's loop, once the decision is pending, raises instead of waiting forever."""
    channels = local_channels(2, timeout=1.0)
    a = StopAgreement(channels[0], interval=0.01, timeout=3)
    a.request("test")
    t0 = time.monotonic()
    with pytest.raises(ChannelError):
        for step in range(1, 10_000):
            a.stop_here(step)
            time.sleep(0.01)
    assert time.monotonic() - t0 < 10
    a.close(5)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="positive"):
        StopAgreement(None, interval=0)
