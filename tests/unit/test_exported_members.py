import inspect

import torch.distributed.checkpoint as dcp

import solosave


def test_all_is_exactly_the_public_api():
    public = {n for n in dir(solosave) if not n.startswith("_")} - {"cli", "integrations", "demo", "titan", "lightning",
                                                                     "megatron"}
    assert set(solosave.__all__) - {"__version__"} == public


def test_save_calls_take_dcps_arguments():
    """solosave.save / async_save accept every argument of DCP's, of the same kind and name (the
    drop-in: a change of import); the ones solosave cannot honour raise, naming its equivalent."""
    for ours, theirs in ((solosave.save, dcp.save), (solosave.async_save, dcp.async_save)):
        mine = inspect.signature(ours).parameters
        for name, p in inspect.signature(theirs).parameters.items():
            assert name in mine and mine[name].kind == p.kind, (ours.__name__, name)


def test_exceptions_form_the_documented_tree():
    assert issubclass(solosave.SolosaveError, Exception)
    assert issubclass(solosave.LayoutDriftError, solosave.CheckpointError)
    assert issubclass(solosave.WorkerDiedError, solosave.CheckpointError)
    assert issubclass(solosave.PreparedMetadataError, ValueError)
    assert issubclass(solosave.UnsafeMetadataError, solosave.PreparedMetadataError)
    assert issubclass(solosave.FingerprintMismatchError, solosave.PreparedMetadataError)
    assert issubclass(solosave.SaveTimeoutError, TimeoutError)
    assert issubclass(solosave.CheckpointExistsError, FileExistsError)
    from torch.distributed.checkpoint.api import CheckpointException  # DCP's, a BaseException

    assert issubclass(solosave.CheckpointExistsError, CheckpointException)
    assert issubclass(solosave.CheckpointExistsError, Exception)  # still caught by `except Exception`
    assert str(solosave.CheckpointExistsError("it is there")) == "Checkpoint already exists: it is there"  # DCP's words
    assert not issubclass(solosave.CheckpointError, CheckpointException)
    assert issubclass(solosave.CorruptCheckpointError, solosave.SolosaveError)
    assert not issubclass(solosave.CorruptCheckpointError, solosave.CheckpointError)


def test_error_messages_render():
    e = solosave.CheckpointError("save failed", {1: "OSError: disk", 0: "x"})
    s = str(e)
    assert "rank 0: x" in s and "rank 1: OSError: disk" in s
    d = solosave.LayoutDriftError("drift", {2: [f"item{i}: length 1 != prepared 2" for i in range(12)]})
    s = str(d)
    assert "rank 2" in s and "item0" in s and "(+2 more)" in s
    assert d.drifts[2][11].startswith("item11")
