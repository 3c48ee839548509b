"""Cooperative loads (solosave._src.load.cooperative): replicas and resharded ranks read each
shared byte range of the checkpoint once and deliver it to each other; bit-exact against stock
``dcp.load``; a rank that cannot read its share, or a damaged shared record, fails the load on
every rank with the reason."""

import os

import pytest
from torch.distributed.checkpoint import FileSystemReader

from tests.multiproc import coop_fns
from tests.support import run_ranks, run_ranks_tolerant


def _unique_bytes(path) -> int:
    """Bytes of every record of the checkpoint (what a load of all of it must read once)."""
    md = FileSystemReader(str(path)).read_metadata()
    return sum(int(info.length) for info in md.storage_data.values())


@pytest.mark.timeout(240)
def test_replicas_read_each_byte_once_and_load_bit_exact(tmp_path, case_log):
    path = str(tmp_path / "ck")
    run_ranks(coop_fns.save, 2, path, timeout=100)
    unique = _unique_bytes(path)
    coop = run_ranks(coop_fns.load, 4, path, 2, True, timeout=150)
    alone = run_ranks(coop_fns.load, 4, path, 2, False, timeout=150)
    auto = run_ranks(coop_fns.load, 4, path, 2, None, timeout=150)
    for out in coop + alone + auto:
        assert out["ok"] and out["same_as_stock"] and out["is_str"], out
    # the independent count (os.preadv/os.pread on .distcp files) and the library's agree
    assert sum(o["counted"] for o in coop) == unique
    assert sum(o["result"]["bytes_read"] for o in coop) == unique
    assert sum(o["result"]["bytes_received"] for o in coop) == unique  # each range reaches its other replica
    assert sum(o["result"]["bytes_sent"] for o in coop) == unique
    assert all(o["result"]["shared_ranges"] == 6 and o["result"]["rounds"] == 1 for o in coop), coop
    # every rank read some of it (the reads are spread)
    assert all(o["counted"] > 0 for o in coop), [o["counted"] for o in coop]
    # without cooperation each replica reads its shards itself: twice the checkpoint (and the
    # heads and tails of the large records that the direct read path peeks at)
    assert sum(o["counted"] for o in alone) >= 2 * unique
    assert all(o["result"]["bytes_received"] == 0 for o in alone)
    # collectives of a cooperative load: the sketch, the gather of the shared keys, one round's
    # agreement, then the load's own agreement (the index load has no .metadata broadcast)
    assert all(o["calls"] == ["all_reduce", "all_gather_object", "all_reduce", "all_reduce"] for o in coop), coop
    assert all(o["calls"] == ["all_reduce"] for o in alone), alone
    # automatic, on local files and one host: the ranks share the host's page cache, so the
    # sketch says "one host" and each rank reads its own (one more all_reduce than without)
    assert all(o["result"]["shared_ranges"] == 0 and o["calls"] == ["all_reduce", "all_reduce"] for o in auto), auto
    case_log("a checkpoint saved at W=2 loaded at W=4 as 2 replicas x 2 shards",
             f"read from storage: {sum(o['counted'] for o in coop)} bytes = the checkpoint's {unique} (1.00x), "
             f"counted by wrapping os.preadv/os.pread; {sum(o['counted'] for o in alone)} without cooperation; "
             "bit-exact and the same as stock dcp.load")


@pytest.mark.timeout(240)
def test_resharded_loads_read_each_byte_once_and_are_bit_exact(tmp_path, case_log):
    two, four = str(tmp_path / "w2"), str(tmp_path / "w4")
    run_ranks(coop_fns.save, 2, two, timeout=100)
    run_ranks(coop_fns.save, 4, four, timeout=100)
    up = run_ranks(coop_fns.load, 4, two, 1, True, timeout=150)  # each saved chunk feeds two ranks
    up_alone = run_ranks(coop_fns.load, 4, two, 1, False, timeout=150)
    down = run_ranks(coop_fns.load, 2, four, 1, True, timeout=150)  # each rank reads two whole chunks
    for out in up + up_alone + down:
        assert out["ok"] and out["same_as_stock"], out
    # the chunks of w0 (256 KiB) are split: each rank reads its half alone, straight into its
    # shard (plus the 4 KiB at each end of the record that it decodes); the smaller records of
    # w1 and e are read whole by whoever needs any part: shared, read once
    assert all(o["result"]["shared_ranges"] == 4 for o in up), up
    assert sum(o["counted"] for o in up) <= _unique_bytes(two) + 4 * 2 * 4096
    assert sum(o["counted"] for o in up_alone) > sum(o["counted"] for o in up)
    # nothing shared: the sketch proves it and no other collective of the cooperation runs
    assert all(o["result"]["shared_ranges"] == 0 and o["calls"] == ["all_reduce", "all_reduce"] for o in down), down
    case_log("resharding 2 -> 4 and 4 -> 2 ranks (rows split, rows joined)",
             "2 -> 4: large chunks split (each rank reads its part), small ones read once and delivered; "
             "4 -> 2: the sketch finds nothing "
             "shared, one extra all_reduce; both bit-exact, the same as stock dcp.load")


@pytest.mark.timeout(240)
def test_a_rank_that_cannot_read_its_share_fails_the_load_on_every_rank(tmp_path, case_log):
    path = str(tmp_path / "ck")
    run_ranks(coop_fns.save, 2, path, timeout=100)
    out = run_ranks(coop_fns.load_failing, 4, path, 2, 1, "read", timeout=150)
    assert len(set(out)) == 1, out
    assert out[0].startswith("OSError") and "injected read failure on rank 1" in out[0], out
    case_log("a cooperative load at W=4 where rank 1's storage read of its share fails",
             "every rank raises rank 1's OSError; the round's agreement stops it before any message is sent")


@pytest.mark.timeout(240)
def test_a_damaged_shared_record_is_reported_on_every_rank(tmp_path, case_log):
    path = str(tmp_path / "ck")
    run_ranks(coop_fns.save, 2, path, timeout=100)
    md = FileSystemReader(path).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == "w0" and k.offset[0] == 0)
    with open(os.path.join(path, info.relative_path), "r+b") as f:  # its zip directory: unreadable
        f.seek(info.offset + info.length - 64)
        f.write(b"\xff" * 64)
    out = run_ranks(coop_fns.load_failing, 4, path, 2, -1, "damaged", timeout=150)
    assert len(set(out)) == 1, out
    assert out[0].startswith("CorruptCheckpointError") and "'w0'" in out[0], out
    alone = run_ranks(coop_fns.load_failing, 4, path, 2, -1, "damaged/alone", timeout=150)
    assert alone == out  # as without cooperation
    case_log("a cooperative load at W=4 of a checkpoint whose shared record of w0 is damaged",
             "every rank raises CorruptCheckpointError naming 'w0'")


@pytest.mark.timeout(240)
def test_a_reader_that_dies_mid_load_fails_the_others_in_bounded_time(tmp_path, case_log):
    path = str(tmp_path / "ck")
    run_ranks(coop_fns.save, 2, path, timeout=100)
    out = run_ranks_tolerant(coop_fns.load_with_a_dying_reader, 4, path, 1, timeout=150)
    assert out[1] == ("died", 3), out
    for rank in (0, 2, 3):
        kind, text = out[rank]
        assert kind == "ok" and text != "loaded", out  # raised, did not hang
    case_log("a cooperative load at W=4 whose rank 1 exits while reading its share",
             "the other ranks raise (the peer's connection closed) instead of waiting: "
             + "; ".join(out[r][1][:80] for r in (0, 2, 3)))
