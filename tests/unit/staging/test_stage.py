"""Staging (``staging/staging.py``), in one process: the buffer holds the values as of the call, in the
blocking and the overlapped modes; a change before an overlapped copy is done is caught."""

from __future__ import annotations

import threading

import pytest
import torch

from solosave import SaveTimeoutError, StagingRaceError
from solosave._src.plan.local_plan import plan_local
from solosave._src.staging import staging as _stage
from solosave._src.staging.buffer import BufferReader
from solosave._src.staging.staging import Stager


def _staged_values(stager, staged) -> dict:
    reader = BufferReader()
    try:
        stager.hand_to(reader)
        return {it.spec.fqn: reader.tensor(staged, it).clone() for it in staged.items if it.payload is None}
    finally:
        reader.close()


def _sd() -> dict:
    return {"a": torch.arange(1 << 16, dtype=torch.float32), "b": torch.ones(3, 4, dtype=torch.bfloat16),
            "c": torch.arange(5), "step": 3}


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
def test_the_buffer_holds_the_values_as_of_the_call(overlap):
    sd = _sd()
    plan = plan_local(sd)
    stager = Stager()
    try:
        staged, staging = stager.stage(plan.specs, plan.values, overlap=overlap)
        staging.wait(30)  # overlap: the copies are done; blocking: returns at once
        expect = {k: v.clone() for k, v in sd.items() if isinstance(v, torch.Tensor)}
        for v in sd.values():
            if isinstance(v, torch.Tensor):
                v.add_(1)  # the next optimizer step
        got = _staged_values(stager, staged)
        assert set(got) == set(expect) and all(torch.equal(got[k], expect[k]) for k in expect)
        assert [it.payload is not None for it in staged.items].count(True) == 1  # "step"
    finally:
        stager.close()


def test_the_same_structure_reuses_its_staging_plan_and_items():
    stager = Stager()
    try:
        plan = plan_local(_sd())
        a, _ = stager.stage(plan.specs, plan.values)
        b, _ = stager.stage(plan.specs, plan.values)
        assert a.buffer == b.buffer and all(x is y for x, y in zip(a.items, b.items) if x.payload is None)
    finally:
        stager.close()


@pytest.fixture
def gated_copy(monkeypatch):
    """The overlapped CPU copy waits for ``gate`` (so a test decides what happens before it)."""
    gate = threading.Event()
    real = _stage._copy_pieces

    def copy(*args):
        gate.wait(30)
        real(*args)

    monkeypatch.setattr(_stage, "_copy_pieces", copy)
    return gate


def test_a_change_before_an_overlapped_copy_is_done_is_a_staging_race(gated_copy):
    sd = _sd()
    plan = plan_local(sd)
    stager = Stager()
    try:
        _, staging = stager.stage(plan.specs, plan.values, overlap=True)
        sd["a"].add_(1)  # optimizer.step() before wait_staged(): the copy would hold the new value
        gated_copy.set()
        with pytest.raises(StagingRaceError, match="wait_staged"):
            staging.wait(30)
        with pytest.raises(StagingRaceError):
            staging.synchronize()  # the background learns it too (and fails the save)
    finally:
        stager.close()


def test_a_change_after_the_copy_is_done_is_not_a_race():
    sd = _sd()
    plan = plan_local(sd)
    stager = Stager()
    try:
        staged, staging = stager.stage(plan.specs, plan.values, overlap=True)
        staging.wait(30)
        sd["a"].add_(1)
        staging.synchronize()  # no error: the copy had the values of the call
        assert torch.equal(_staged_values(stager, staged)["a"], sd["a"] - 1)
    finally:
        stager.close()


def test_an_overlapped_staging_that_does_not_finish_times_out(gated_copy):
    stager = Stager()
    try:
        plan = plan_local(_sd())
        _, staging = stager.stage(plan.specs, plan.values, overlap=True)
        with pytest.raises(SaveTimeoutError, match="staging did not finish"):
            staging.wait(0.2)
        with pytest.raises(SaveTimeoutError, match="staging copies did not finish"):
            staging.synchronize(0.2)  # the background's wait is bounded too
        gated_copy.set()
        staging.wait(30)
    finally:
        stager.close()


def test_a_new_staging_never_copies_into_a_buffer_an_old_copy_still_writes(gated_copy):
    """A staging whose copy outlived its wait (``synchronize`` timed out: that save failed), then
    a save of the same structure: the new copy goes into another buffer, so the old copy, when it
    finally runs, cannot change the new save's bytes."""
    sd = _sd()
    plan = plan_local(sd)
    stager = Stager()
    try:
        first, staging = stager.stage(plan.specs, plan.values, overlap=True)
        with pytest.raises(SaveTimeoutError):
            staging.synchronize(0.2)
        sd["a"].add_(7)
        expect = sd["a"].clone()
        gated_copy.set()  # from here on the copies run: the old one and the new one
        second, staging2 = stager.stage(plan.specs, plan.values, overlap=True)
        staging2.wait(30)
        assert second.buffer != first.buffer
        with pytest.raises(StagingRaceError):
            staging.wait(30)  # the old staging: "a" changed before its copy ran
        assert torch.equal(_staged_values(stager, second)["a"], expect)
    finally:
        stager.close()
