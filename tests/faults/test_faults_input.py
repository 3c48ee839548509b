"""Bad input: a clear error on every rank, nothing on disk damaged.

Covered elsewhere, not repeated here (see docs/reliability.md): a prepared file of another
world size (test_reuse.py::test_prepared_file_of_another_world_size_rejected_at_start),
fingerprint mismatches and tampering, truncated files and unsafe pickles read by
``load_prepared_metadata`` (test_prepared.py), a sparse tensor, an existing checkpoint and a
destination that is a file (test_checkpointer.py::test_bad_input_is_refused_without_damage).
These tests go through ``AsyncCheckpointer`` and ``solosave.load`` end to end.
"""

import argparse
import os
import pickle
import shutil
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

import solosave
from tests.faults import fault_fns as F
from tests.support import dcp_save_local, run_ranks

TIMEOUT = 20.0


@pytest.mark.timeout(150)
def test_bad_prepared_files_refused_and_left_alone(tmp_path, case_log):
    t0 = time.monotonic()
    outs = run_ranks(F.bad_prepared_files, 2, str(tmp_path), TIMEOUT, timeout=140)
    want = {"truncated": ("PreparedMetadataError", "truncated or corrupt"),
            "corrupt": ("PreparedMetadataError", "truncated or corrupt"),
            "unsafe": ("UnsafeMetadataError", "refusing to unpickle global posix.system"),
            "empty": ("PreparedMetadataError", "empty")}
    for o in outs:
        for name, (typ, needle) in want.items():
            for create in (False, True):
                e = o[f"{name}/create={create}"]
                assert e is not None and e["type"] == typ and needle in e["msg"], (name, create, e)
            assert o[f"{name}/unchanged"], name
        assert not o["unsafe/executed"]
        assert o["workers"]["type"] == "FingerprintMismatchError" and "workers differs" in o["workers"]["msg"]
        s = o["structure/raise"]
        assert s["type"] == "LayoutDriftError" and "layout drifted" in s["msg"], s
        assert o["structure/prep_unchanged"] and not o["structure/o1_metadata"]
    F.check_loads(str(tmp_path / "c0"), 2, 0)
    dt = time.monotonic() - t0
    o = outs[0]
    for name, (typ, needle) in want.items():
        case_log(f"prepared file {name} (create_prepared_metadata False and True)",
                 f"every rank: {typ} at construction ('{needle}'), before any save; the file "
                 "is left byte-identical (not overwritten in create mode)"
                 + ("; the payload's os.system never ran" if name == "unsafe" else ""), dt)
    case_log("prepared file made with workers=1, checkpointer workers=2",
             "every rank: FingerprintMismatchError 'workers differs' at construction", dt)
    case_log("prepared file of another model structure (same world size), on_layout_drift='raise'",
             "every rank: LayoutDriftError naming the items; no .metadata; the prepared file unchanged; "
             "the earlier checkpoint loads", dt)


@pytest.mark.timeout(150)
def test_unsupported_values_and_uncreatable_destination(tmp_path, case_log):
    t0 = time.monotonic()
    outs = run_ranks(F.bad_values, 2, str(tmp_path), TIMEOUT, timeout=140)
    needles = {"lambda": "cannot be serialized", "sparse": "to_dense", "meta_tensor": "meta device",
               "open_file": "cannot be serialized"}
    for o in outs:
        for name, needle in needles.items():
            e = o[name]
            assert e is not None and e["type"] == "TypeError" and needle in e["msg"], (name, e)
            # raised by save() itself (TypeError, not a CheckpointError from wait()): before any
            # collective and before the job reached the worker
            assert o[f"{name}/files"] in (None, []), o[f"{name}/files"]  # nothing written
        b = o["below_file"]
        assert b["type"] == "ValueError" and "cannot create checkpoint directory" in b["msg"], b
        assert o["after"]["type"] is None
    F.check_loads(str(tmp_path / "good"), 2, 0)
    dt = time.monotonic() - t0
    case_log("state dict with an unsupported value (lambda, sparse tensor, meta tensor, open file)",
             "every rank: TypeError from save() at once naming the key and the fix; nothing written; the "
             "same checkpointer's next save succeeded and loads", dt)
    case_log("destination that cannot be created (below a regular file)",
             "every rank: ValueError 'cannot create checkpoint directory ... choose a writable location'", dt)


@pytest.mark.timeout(60)
def test_read_only_destination(tmp_path, case_log):
    if os.geteuid() == 0:
        pytest.skip("running as root: chmod does not make a directory read-only for root (the "
                    "uncreatable-destination case covers the same check)")
    t0 = time.monotonic()
    outs = run_ranks(F.read_only_destination, 2, str(tmp_path), TIMEOUT, timeout=50)
    for o in outs:
        e = o["new_dir"]
        assert e["type"] == "ValueError" and "choose a writable location" in e["msg"], e
        assert o["after"]["type"] is None
    case_log("destination on a read-only path (chmod 555)",
             "every rank: ValueError naming the path and the fix; the next save succeeded",
             time.monotonic() - t0)


@pytest.mark.timeout(60)
def test_checkpoint_metadata_that_would_execute_code(tmp_path, case_log):
    t0 = time.monotonic()
    ck = tmp_path / "ck"
    sd = {"w": torch.arange(6.0), "step": 3}
    dcp_save_local(sd, checkpoint_id=str(ck))
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    bad = tmp_path / "bad"
    shutil.copytree(ck, bad)
    (bad / ".metadata").write_bytes(pickle.dumps(Evil()))
    # solosave.load parses .metadata before DCP's load starts: solosave's own error, unwrapped.
    with pytest.raises(solosave.UnsafeMetadataError, match="refusing to unpickle global posix.system"):
        solosave.load({"w": torch.zeros(6), "step": 0}, bad)
    assert not marker.exists()
    tgt = {"w": torch.zeros(6), "step": 0}
    solosave.load(tgt, ck)
    assert torch.equal(tgt["w"], sd["w"]) and tgt["step"] == 3
    case_log("checkpoint whose .metadata pickle would run os.system, read by solosave.load",
             "refused before anything is resolved (solosave.UnsafeMetadataError); the command never "
             "ran; the intact checkpoint loads",
             time.monotonic() - t0)


@pytest.mark.timeout(150)
def test_a_prepared_file_one_rank_cannot_read_fails_every_rank_at_once(tmp_path, case_log):
    outs = run_ranks(F.one_rank_cannot_read_prepared, 2, str(tmp_path), 120.0, timeout=140)
    e0, e1 = outs[0]["error"], outs[1]["error"]
    assert e1 is not None and e1["type"] == "PreparedMetadataError" and "does not exist" in e1["msg"], e1
    assert e0 is not None and e0["type"] == "PreparedMetadataError" and "rank 1 could not set up" in e0["msg"], e0
    assert "does not exist" in e0["msg"]
    assert outs[0]["seconds"] < 60, outs  # not the 120 s timeout of the set-up broadcast
    case_log("prepared file readable on rank 0 only (rank 1 cannot find it)",
             f"rank 1: its own PreparedMetadataError; rank 0: PreparedMetadataError naming rank 1 after "
             f"{outs[0]['seconds']:.2f} s (timeout 120 s); no worker started", outs[0]["seconds"])


@pytest.mark.parametrize("value", [float("inf"), 9e13, float("nan")])
def test_an_unbounded_timeout_is_refused_at_validation(value, case_log):
    """torch turns a timeout into an int64 nanosecond deadline: ``inf`` or ~1e13 s once passed
    validation, then failed inside the set-up on rank 0 while the others waited in its broadcast.
    Now the options refuse it, before torch.distributed is even looked at (every rank alike)."""
    from solosave.integrations import add_checkpoint_args, validate_checkpoint_args

    with pytest.raises(ValueError, match=r"^timeout must be a positive number of seconds, at most 1e9 ") as e:
        solosave.AsyncCheckpointer(timeout=value)
    assert "\n" not in str(e.value)
    args = add_checkpoint_args(argparse.ArgumentParser()).parse_args(["--ckpt-timeout", str(value)])
    with pytest.raises(ValueError, match=r"^--ckpt-timeout must be a positive number of seconds, at most 1e9 "):
        validate_checkpoint_args(args)
    assert solosave.CheckpointerOptions(timeout=1e9).timeout == 1e9  # the limit itself is accepted
    case_log(f"AsyncCheckpointer(timeout={value!r}) and --ckpt-timeout {value!r}",
             f"refused when the options are validated, before any collective or worker: {e.value}")


def _as_written_by_old_dcp(ck) -> bytes:
    """``ck``'s .metadata as DCP of torch <= 2.1 pickled it: TensorProperties (and its memory-format
    enum) from torch.distributed._shard.sharded_tensor.metadata, no storage_meta, no version."""
    import warnings

    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as OldProperties

    md = pickle.loads((ck / ".metadata").read_bytes())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for item in md.state_dict_metadata.values():
            if hasattr(item, "properties"):
                item.properties = OldProperties(dtype=item.properties.dtype)
    del md.__dict__["storage_meta"], md.__dict__["version"]  # fields added after 2.1
    return pickle.dumps(md)


@pytest.mark.timeout(60)
def test_an_older_dcp_metadata_with_sharded_tensor_properties_loads(tmp_path, case_log):
    ck = tmp_path / "ck"
    sd = {"w": torch.arange(6.0), "b": torch.ones(2, 3, dtype=torch.bfloat16), "step": 3}
    dcp_save_local(sd, checkpoint_id=str(ck))
    old = _as_written_by_old_dcp(ck)
    assert b"torch.distributed._shard.sharded_tensor.metadata" in old and b"MEM_FORMAT_ENCODING" in old
    (ck / ".metadata").write_bytes(old)
    for load in (lambda t: solosave.load(t, ck), lambda t: dcp.load(t, checkpoint_id=str(ck), no_dist=True)):
        target = {"w": torch.zeros(6), "b": torch.zeros(2, 3, dtype=torch.bfloat16), "step": 0}
        load(target)
        assert torch.equal(target["w"], sd["w"]) and torch.equal(target["b"], sd["b"]) and target["step"] == 3
    props = solosave.load_prepared_metadata(ck).metadata.state_dict_metadata["w"].properties
    assert type(props).__module__ == "torch.distributed.checkpoint.metadata"  # read as today's class
    # an alias, not an opening: the rest of that module is still refused
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata

    (ck / ".metadata").write_bytes(pickle.dumps(ShardedTensorMetadata()))
    with pytest.raises(solosave.UnsafeMetadataError, match="sharded_tensor.metadata.ShardedTensorMetadata"):
        solosave.load({"w": torch.zeros(6)}, ck)
    case_log("a .metadata written by DCP of torch <= 2.1 (TensorProperties of torch.distributed._shard)",
             "solosave.load reads it (an allowlisted alias of today's class) and matches, as stock "
             "dcp.load does; any other global of that module is still refused (UnsafeMetadataError)")
