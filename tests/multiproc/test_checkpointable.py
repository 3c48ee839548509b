"""DCP checkpointable objects, ``io.BytesIO`` values and caller-serialized records, saved by
solosave on 2 ranks (collective, then reuse with the structure cache) and read back bit-exactly
by stock DCP and solosave.load, at the same world size and at another."""

import pytest

from tests.multiproc import checkpointable_fns
from tests.support import run_ranks

pytestmark = pytest.mark.timeout(300)


def test_checkpointable_chunks_and_bytes_roundtrip(tmp_path):
    per_rank = run_ranks(checkpointable_fns.save_create_then_reuse, 2, str(tmp_path))
    for saves in per_rank:
        assert [mode for mode, _, _ in saves] == ["create", "reuse", "reuse"]
        assert saves[1][1] == saves[2][1] == {"all_reduce": {"count": 1, "bytes": 8}}
        assert [hits for _, _, hits in saves] == [0, 1, 2]  # steady saves are checked, not planned
    # the same checkpoint at world size 1: whole, and in chunks of another size
    assert run_ranks(checkpointable_fns.load_at_one_rank, 1, str(tmp_path)) == [[[0, 0], [3, 0]]]
