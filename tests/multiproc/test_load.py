"""solosave.load: one read of .metadata per process group, the same error on every rank."""

import pytest
import torch

from tests.multiproc import rank_fns
from tests.support import dcp_save_local, run_ranks


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

    import solosave

    marker = tmp_path / "pwned"
    dcp_save_local({"x": Evil(str(marker)), "w": torch.ones(2)}, checkpoint_id=str(tmp_path / "ck"))
    with pytest.raises(solosave.UnsafeMetadataError, match="refusing to load the record of 'x'"):
        solosave.load({"x": None, "w": torch.zeros(2)}, tmp_path / "ck")
    assert not marker.exists()
    case_log("a .distcp record that runs a shell command when unpickled (stock DCP executes it)",
             "solosave.load raises UnsafeMetadataError naming the key; the command did not run")


def test_own_types_load_when_allowed(tmp_path):

    import solosave

    dcp_save_local({"p": Point(3, 4)}, checkpoint_id=str(tmp_path / "ck"))
    with pytest.raises(solosave.UnsafeMetadataError, match="safe_globals"):
        solosave.load({"p": None}, tmp_path / "ck")
    sd = {"p": None}
    solosave.load(sd, tmp_path / "ck", safe_globals=[Point])
    assert (sd["p"].x, sd["p"].y) == (3, 4)


@pytest.mark.parametrize("where", ["../outside.distcp", "/etc/hostname", "sub/__0_0.distcp"])
def test_storage_paths_outside_the_checkpoint_are_refused(tmp_path, case_log, where):
    import pickle

    import solosave

    ck = tmp_path / "ck"
    dcp_save_local({"w": torch.arange(4.0)}, checkpoint_id=str(ck))
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


# -- the read path across world sizes (issue 14) ---------------------------------------------------

@pytest.mark.timeout(240)
def test_resharded_loads_are_bit_exact_at_every_world_size(tmp_path, case_log):
    import solosave
    from tests.multiproc import load_fns

    run_ranks(load_fns.save_sharded, 2, str(tmp_path), timeout=100)
    for rank, r in enumerate(run_ranks(load_fns.load_resharded, 3, str(tmp_path), timeout=100)):
        for how, ok in r.items():
            assert all(ok.values()), (rank, how, ok)
    want = load_fns.full_tensors()
    for src in ("solo", "stock"):  # W=1: one process, no process group
        sd = {k: torch.zeros_like(v) for k, v in want.items()} | {"step": 0}
        solosave.load(sd, tmp_path / src)
        assert all(torch.equal(sd[k], v) for k, v in want.items()) and sd["step"] == 41, src
    case_log("DTensor shards saved at W=2 (solosave and stock DCP), loaded at W=3 along other "
             "dimensions and at W=1 in one process", "solosave.load and stock DCP load them bit for bit")


@pytest.mark.timeout(120)
def test_an_error_on_one_rank_is_raised_on_every_rank(tmp_path):
    from tests.multiproc import load_fns

    out = run_ranks(load_fns.errors_agree, 2, str(tmp_path), timeout=100)
    assert out[0] == out[1], out
    shape, truncated = out[0]
    assert shape.startswith("ValueError") and "Size mismatch" in shape
    assert truncated.startswith("CorruptCheckpointError") and "__1_0.distcp" in truncated


@pytest.mark.timeout(120)
def test_a_planner_with_its_own_global_step_gets_dcps_collective_load(tmp_path):
    from tests.multiproc import load_fns

    out = run_ranks(load_fns.custom_planner_loads, 2, str(tmp_path), timeout=100)
    assert out == [{"calls": [2], "ok": True}, {"calls": [], "ok": True}]  # on rank 0, with both plans
