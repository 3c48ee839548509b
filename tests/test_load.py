"""solosave.load: one read of .metadata per process group, the same error on every rank."""

import pytest
import torch

import rank_fns
from support import run_ranks


@pytest.mark.timeout(120)
def test_metadata_read_once_and_errors_agree(tmp_path):
    out = run_ranks(rank_fns.load_reads_metadata_once, 2, str(tmp_path), timeout=100)
    assert [o["reads"] for o in out] == [3, 0]  # rank 0: the checkpoint + two failed attempts
    for o in out:
        assert o["w"] == list(range(8)) and o["step"] == 7
        assert o["errors"][0].startswith("FileNotFoundError") and "ck_missing" in o["errors"][0]
        assert o["errors"][1].startswith("PreparedMetadataError") and "no .metadata" in o["errors"][1]
        assert "read by rank 0" in o["errors"][1]


# -- loading crafted checkpoints (one process) --------------------------------------------------

class Evil:
    """Unpickling it would run a shell command (what a crafted record can hide)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


class Point:
    def __init__(self, x=0, y=0):
        self.x, self.y = x, y


def test_a_record_that_would_run_code_is_refused_and_runs_nothing(tmp_path, case_log):
    import torch.distributed.checkpoint as dcp

    import solosave

    marker = tmp_path / "pwned"
    dcp.save({"x": Evil(str(marker)), "w": torch.ones(2)}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    with pytest.raises(solosave.UnsafeMetadataError, match="refusing to load the record of 'x'"):
        solosave.load({"x": None, "w": torch.zeros(2)}, tmp_path / "ck")
    assert not marker.exists()
    case_log("a .distcp record that runs a shell command when unpickled (stock DCP executes it)",
             "solosave.load raises UnsafeMetadataError naming the key; the command did not run")


def test_own_types_load_when_allowed(tmp_path):
    import torch.distributed.checkpoint as dcp

    import solosave

    dcp.save({"p": Point(3, 4)}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    with pytest.raises(solosave.UnsafeMetadataError, match="safe_globals"):
        solosave.load({"p": None}, tmp_path / "ck")
    sd = {"p": None}
    solosave.load(sd, tmp_path / "ck", safe_globals=[Point])
    assert (sd["p"].x, sd["p"].y) == (3, 4)


@pytest.mark.parametrize("where", ["../outside.distcp", "/etc/hostname", "sub/__0_0.distcp"])
def test_storage_paths_outside_the_checkpoint_are_refused(tmp_path, case_log, where):
    import pickle

    import torch.distributed.checkpoint as dcp

    import solosave

    ck = tmp_path / "ck"
    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(ck), no_dist=True)
    (tmp_path / "outside.distcp").write_bytes(b"\0" * 4096)
    md = pickle.loads((ck / ".metadata").read_bytes())
    for info in md.storage_data.values():
        info.relative_path = where
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(solosave.CorruptCheckpointError) as e:
        solosave.load({"w": torch.zeros(4)}, ck)
    assert "not a file name inside the checkpoint directory" in str(e.value)
    assert "4096" not in str(e.value)  # nothing about the named file is revealed
    report = solosave.verify_checkpoint(ck)
    assert not report.ok and any("inside the checkpoint directory" in p for p in report.problems)
    case_log(f"a .metadata naming data file {where!r}",
             "solosave.load raises CorruptCheckpointError before reading anything (no size of the "
             "named file in the message); solosave verify reports it")
