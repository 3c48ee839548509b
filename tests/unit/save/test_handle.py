"""Tests of ``solosave._src.save.handle``: a handle is two futures and a pump, usable without a
checkpointer (the pump here is a test double that completes the future on its n-th call)."""

import time
from concurrent.futures import Future

import pytest

import solosave
from solosave._src.coordination.protocol import ErrorKind, JobOutcome, SaveKind
from solosave._src.save.handle import SaveHandle, complete
from solosave._src.save.result import Started

STARTED = Started(at=100.0, plan_s=0.1, stage_s=0.2, block_s=0.3, calling=())


class Pump:
    """Completes ``published`` with ``outcome`` on call number ``after`` (never, if ``None``)."""

    def __init__(self, published, outcome, after=None):
        self.published, self.outcome, self.after = published, outcome, after
        self.calls = []

    def __call__(self, timeout):
        self.calls.append(timeout)
        if self.after is not None and len(self.calls) >= self.after and not self.published.done():
            complete(self.published, self.outcome, "/ck/a", 1, STARTED)


def handle(outcome, after=None, staged=None, timeout=5.0):
    published = Future()
    pump = Pump(published, outcome, after)
    return SaveHandle("/ck/a", 7, 1, published, pump, timeout, staged), pump


OK = JobOutcome(7, True, SaveKind.REUSE, bytes_written=42, timings={"write": 1.0, "publish": 0.5},
                published=True, warnings=("index not written",), finished_at=102.0)
FAILED = JobOutcome(7, False, SaveKind.REUSE, ErrorKind.FAILED, failures={0: "OSError: disk full"})


def test_done_only_looks_and_wait_returns_the_result():
    h, pump = handle(OK, after=3)
    assert not h.done() and not h.done()
    assert pump.calls == [0.0, 0.0]  # done() never waits
    with pytest.warns(RuntimeWarning, match="index not written"):
        assert h.done()
    assert not h.reported
    r = h.wait()
    assert h.reported and len(pump.calls) == 3  # already complete: no more pumping
    assert (r.path, r.rank, r.mode, r.bytes_written, r.published) == ("/ck/a", 1, "reuse", 42, True)
    assert (r.timings.plan, r.timings.stage, r.timings.write, r.timings.block) == (0.1, 0.2, 1.0, 0.3)
    assert r.timings.to_published == pytest.approx(2.0) and r.warnings == ("index not written",)


def test_wait_raises_the_saves_error_every_time():
    h, _ = handle(FAILED, after=1)
    for _ in range(2):
        with pytest.raises(solosave.CheckpointError, match=r"save to /ck/a failed on rank\(s\) \[0\]") as e:
            h.wait()
        assert e.value.failures == {0: "OSError: disk full"}
    assert h.reported


def test_wait_is_bounded_and_names_the_save_and_rank():
    h, pump = handle(OK, after=None)
    t0 = time.monotonic()
    with pytest.raises(solosave.SaveTimeoutError, match="save to /ck/a did not finish within 0 s on rank 1"):
        h.wait(0.3)
    assert time.monotonic() - t0 < 5 and pump.calls and max(pump.calls) <= 0.3
    assert not h.reported and not h.done()


def test_wait_staged_waits_on_the_staged_future_with_the_default_timeout():
    class Staged:
        def __init__(self):
            self.waits = []

        def wait(self, timeout):
            self.waits.append(timeout)

    staged = Staged()
    h, _ = handle(OK, staged=staged, timeout=9.0)
    h.wait_staged()
    h.wait_staged(2.0)
    assert staged.waits == [9.0, 2.0]
    handle(OK)[0].wait_staged()  # no staged future: returns at once
