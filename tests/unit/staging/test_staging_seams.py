"""Staging's CUDA paths on a machine without a GPU, through the runtime seam (``staging/device.py``):
a recording fake (``testing/fake_device.py``) stands in for ``torch.cuda``, CPU tensors play the
device tensors. Each test is named ``test_seam_*``: it checks the calls staging makes, not a GPU
(``tools/device_check.py`` checks those on a real one).

* D2: a copy runs on the current stream of its *source's* device, so each source device gets
  its own side stream and event, and the trainer's streams wait for each;
* D3: a failed ``cudaHostRegister`` leaves CUDA's per-thread last error set: registration runs
  in a short-lived thread of its own, so the training thread's next kernel does not raise;
* the buffer is registered with the portable flag, on the trainer's device, and unregistered
  only after the copies into it are done;
* the thread that waits for the copies (the checkpointer's submit thread) first sets the
  trainer's device, instead of making a context on device 0;
* a source with its conjugate or negative bit is resolved before its asynchronous copy.
"""

from __future__ import annotations

import logging
import threading

import torch

from solosave._src.plan.local_plan import plan_local
from solosave._src.staging.buffer import BufferReader
from solosave._src.staging.staging import Stager
from solosave._src.testing.fake_device import FakeRuntime


def _staged_values(stager: Stager, staged) -> dict:
    reader = BufferReader()
    try:
        stager.hand_to(reader)
        return {it.spec.fqn: reader.tensor(staged, it).clone() for it in staged.items if it.payload is None}
    finally:
        reader.close()


def _placed(rt: FakeRuntime, devices: dict[str, int | None]) -> dict:
    sd = {}
    for i, (k, d) in enumerate(devices.items()):
        t = torch.arange(64, dtype=torch.float32) + 100 * i
        sd[k] = rt.place(t, d) if d is not None else t
    return sd


def _stage(rt: FakeRuntime, sd: dict, overlap: bool):
    plan = plan_local(sd)
    for k, v in sd.items():  # plan_local detaches: the detached tensors are the sources
        d = rt.device_of(v)
        if d is not None:
            rt.place(plan.values[k], d)
    stager = Stager(runtime=rt)
    staged, staging = stager.stage(plan.specs, plan.values, overlap=overlap)
    return stager, staged, staging


def _index(log, entry) -> int:
    return log.index(entry)


def test_seam_d2_each_source_device_has_its_own_side_stream_and_event():
    rt = FakeRuntime(current=0)
    sd = _placed(rt, {"a": 0, "b": 1, "c": None, "d": 1})
    stager, staged, staging = _stage(rt, sd, overlap=False)
    try:
        copies = rt.calls("copy")
        assert sorted((c[1], c[2].split(".")[0]) for c in copies) == [(0, "side0"), (1, "side1"), (1, "side1")]
        for dev in (0, 1):
            side = next(c[2] for c in copies if c[1] == dev)
            waited = _index(rt.log, ("wait_stream", side, f"current{dev}", "MainThread"))
            assert waited < min(i for i, c in enumerate(rt.log) if c[0] == "copy" and c[1] == dev)
            event = next(c[1] for c in rt.calls("record") if c[2] == side)
            recorded = _index(rt.log, ("record", event, side, "MainThread"))
            assert recorded > max(i for i, c in enumerate(rt.log) if c[0] == "copy" and c[1] == dev)
            assert ("wait_event", f"current{dev}", event, "MainThread") in rt.log  # blocking mode
        staging.synchronize(5)
        assert {c[1] for c in rt.calls("query")} == {c[1] for c in rt.calls("record")}
        got = _staged_values(stager, staged)
        assert all(torch.equal(got[k], sd[k]) for k in sd)
    finally:
        stager.close()


def test_seam_d2_overlapped_copies_mark_each_source_on_its_own_side_stream():
    rt = FakeRuntime(current=0)
    sd = _placed(rt, {"a": 0, "b": 1})
    stager, _, staging = _stage(rt, sd, overlap=True)
    try:
        assert sorted((c[1], c[2].split(".")[0]) for c in rt.calls("record_stream")) == [(0, "side0"), (1, "side1")]
        assert not rt.calls("wait_event")  # overlap: the trainer's streams do not wait yet
        staging.wait(5)
        events = {c[2]: c[1] for c in rt.calls("record")}
        waits = {(c[1], c[2]) for c in rt.calls("wait_event")}
        assert waits == {(f"current{s.split('.')[0][-1]}", e) for s, e in events.items()}
    finally:
        stager.close()


def test_seam_the_buffer_is_unregistered_only_after_the_copies_are_done():
    rt = FakeRuntime(current=0, auto_complete=False)
    sd = _placed(rt, {"a": 0, "b": 0})
    stager, _, staging = _stage(rt, sd, overlap=True)
    stager.close()  # e.g. close(timeout=...) gave up while the copies still run
    assert not rt.calls("host_unregister")
    rt.complete()
    staging.synchronize(5)  # the submit thread sees the copies end
    assert len(rt.calls("host_unregister")) == 1
    last_done = max(i for i, c in enumerate(rt.log) if c[0] == "query" and c[2] is True)
    assert rt.log.index(rt.calls("host_unregister")[0]) > last_done


def test_seam_d3_a_failed_registration_leaves_no_error_in_the_training_thread(caplog):
    rt = FakeRuntime(current=0, register_error=712)  # cudaErrorHostMemoryAlreadyRegistered
    sd = _placed(rt, {"a": 0})
    with caplog.at_level(logging.WARNING, logger="solosave"):
        stager, staged, staging = _stage(rt, sd, overlap=False)
    try:
        assert rt.calls("host_register")
        assert rt.last_error.get("MainThread", 0) == 0, rt.last_error  # the next kernel would raise
        assert "unpinned" in caplog.text
        staging.synchronize(5)
        assert torch.equal(_staged_values(stager, staged)["a"], sd["a"])  # staged all the same
    finally:
        stager.close()
    assert not rt.calls("host_unregister")  # nothing was registered


def test_seam_the_buffer_is_registered_portable_on_the_trainers_device():
    rt = FakeRuntime(current=1)
    stager, _, staging = _stage(rt, _placed(rt, {"a": 1}), overlap=False)
    staging.synchronize(5)
    stager.close()
    (reg,) = rt.calls("host_register")
    assert reg[1] == 1 and reg[2] == 1  # cudaHostRegisterPortable, on device 1 (not device 0)
    (unreg,) = rt.calls("host_unregister")
    assert unreg[1] == 1


def test_seam_the_thread_that_waits_for_the_copies_sets_the_trainers_device_first():
    rt = FakeRuntime(current=1)
    stager, _, staging = _stage(rt, _placed(rt, {"a": 1}), overlap=False)
    try:
        t = threading.Thread(target=staging.synchronize, args=(5,), name="solosave-submit-test")
        t.start()
        t.join(10)
        mine = [c for c in rt.log if c[-1] == "solosave-submit-test"]
        assert mine and mine[0] == ("set_device", 1, "solosave-submit-test"), mine
        assert any(c[0] == "query" for c in mine)
    finally:
        stager.close()


def test_seam_conj_and_neg_sources_are_resolved_before_the_asynchronous_copy():
    rt = FakeRuntime(current=0)
    z = torch.complex(torch.arange(8.0), torch.arange(8.0) + 1)
    sd = {"z": rt.place(z.conj(), 0), "n": rt.place(torch.arange(8.0)._neg_view(), 0)}
    assert sd["z"].is_conj() and sd["n"].is_neg()
    stager, staged, staging = _stage(rt, sd, overlap=False)
    try:
        staging.synchronize(5)
        got = _staged_values(stager, staged)
        assert torch.equal(got["z"], z.conj().resolve_conj()) and torch.equal(got["n"], -torch.arange(8.0))
    finally:
        stager.close()


def test_seam_an_optimizer_step_orders_itself_after_overlapped_copies():
    """D1 on the CUDA path: an optimizer step right after an overlapped ``save()`` (no
    ``wait_staged()``) first makes the current stream wait for the copies' event; its own
    in-place update then is not a staging race."""
    rt = FakeRuntime(current=0)
    p = torch.nn.Parameter(torch.arange(64, dtype=torch.float32))
    p.grad = torch.ones(64)
    stager, _, staging = _stage(rt, {"p": rt.place(p, 0)}, overlap=True)
    try:
        (event,) = [c[1] for c in rt.calls("record")]
        assert ("wait_event", "current0", event, "MainThread") not in rt.log
        torch.optim.SGD([p], lr=1.0, foreach=True).step()
        assert ("wait_event", "current0", event, "MainThread") in rt.log  # the step pre-hook
        staging.wait(5)  # no StagingRaceError: the update came after the copies
        staging.synchronize(5)
    finally:
        stager.close()
