"""DCP compatibility: what PyTorch's own DCP tests found with solosave swapped in for ``dcp.save`` /
``dcp.load`` (issue 29, item 14): ShardedTensor values, a DTensor whose placements change under
``assume_constant_structure``, and the error of a save over a published checkpoint caught as a
``CheckpointException``. The older ``TensorProperties`` in ``.metadata`` is tested in
tests/faults/test_faults_input.py. Each test logs rows for docs/reliability.md."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

import solosave
from tests.multiproc import compat_fns as C
from tests.support import run_ranks

TIMEOUT = 30.0


@pytest.mark.timeout(300)
def test_a_placement_change_under_constant_structure_falls_back_and_publishes(tmp_path, case_log):
    t0 = time.monotonic()
    sequence = ["RR", "S0S1", "S0R", "RS0", "S0R"]  # RR->S0S1, S0R->RS0, RS0->S0R lost the save before
    outs = run_ranks(C.placement_changes, 4, str(tmp_path), sequence, TIMEOUT, timeout=280)
    saves = outs[0]
    assert all(o == saves for o in outs), outs  # every rank saw the same outcomes
    modes = [m for _, _, _, m in saves]
    assert modes == ["create"] + ["reuse+fallback", "reuse"] * (len(sequence) - 1), saves
    for path, _, step, _ in saves:  # each one loads, in one process, with both loaders
        for load in (lambda t, p=path: solosave.load(t, p),
                     lambda t, p=path: dcp.load(t, checkpoint_id=p, no_dist=True)):
            target = {"w": torch.zeros(8, 8), "step": -1}
            load(target)
            assert torch.equal(target["w"], C.full_at(step)) and target["step"] == step, path
    changes = ", ".join(f"{a}->{b}" for a, b in zip(sequence, sequence[1:]))
    case_log("DTensor placements changed between saves on a 2x2 mesh (ws=4, assume_constant_structure)",
             f"every change ({changes}) is a drift: that save falls back and publishes (reuse+fallback), "
             "the next one of the same placements reuses; all 9 checkpoints load with both loaders and "
             "match (RR->S0S1, S0R->RS0 and RS0->S0R used to fail: 'staged by no rank')",
             time.monotonic() - t0)


@pytest.mark.timeout(240)
def test_sharded_tensors_save_and_load_back(tmp_path, case_log):
    t0 = time.monotonic()
    outs = run_ranks(C.sharded_tensors, 3, str(tmp_path), TIMEOUT, timeout=220)
    for rank, o in enumerate(outs):
        assert o["modes"] == ["create", "reuse"], o
        want = o["expected"]
        assert len(want) == (1 if rank < 2 else 0)  # rank 2 holds no shard
        for name in ("dcp", "solosave"):
            assert o[name] == (want, [1.0, 1.0, 1.0], 1), (rank, name, o[name])
        kind, is_exception, msg = o["exists"]
        assert kind == "CheckpointExistsError" and is_exception and "already holds" in msg, o["exists"]
        assert msg.startswith("Checkpoint already exists"), msg  # DCP's own words, which DCP code matches
    whole = {"st": torch.zeros(6, 4), "step": -1}
    solosave.load(whole, tmp_path / "c1")  # one process, as one plain tensor
    assert torch.equal(whole["st"], torch.arange(24.0).reshape(6, 4) + 100) and whole["step"] == 1
    case_log("ShardedTensor (torch.distributed._shard, rows over ranks 0-1 of 3) saved by create and reuse saves",
             "saved as its local shards at their global offsets (rank 2: none); stock dcp.load and "
             "solosave.load read it back into ShardedTensors, and solosave.load into one plain tensor in "
             "one process, bit-exact", time.monotonic() - t0)
    case_log("save() over a published checkpoint, caught with `except CheckpointException` (DCP's class)",
             "CheckpointExistsError is caught there on every rank (it is also an Exception, so "
             "`except Exception` still catches it); nothing written", None)
