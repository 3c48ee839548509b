"""solosave.load: one read of .metadata per process group, the same error on every rank."""

import pytest

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
