"""ring_pass (coordination/transfer.py) between in-process ranks: files arrive whole or not at
all, a rank that cannot read or write its side stays in step, a bad header breaks the channel."""

from __future__ import annotations

import json
import os
import threading

import pytest

from solosave._src.coordination.transfer import Outgoing, ring_pass
from solosave._src.core.errors import ChannelError
from solosave._src.storage.local import LocalDataFile, LocalStorage, RenamedDataFile
from solosave._src.testing.local_channel import local_channels

ST = LocalStorage()


def _run_ranks(fns, timeout=10.0):
    """Run ``fns[r](channel r)`` on one thread per rank; returns results (or exceptions) by rank."""
    chans = local_channels(len(fns), timeout=timeout)
    out: list = [None] * len(fns)

    def go(r):
        try:
            out[r] = fns[r](chans[r])
        except Exception as e:  # noqa: BLE001 - returned to the test
            out[r] = e

    threads = [threading.Thread(target=go, args=(r,)) for r in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    assert not any(t.is_alive() for t in threads)
    return out, chans


def _file(path, data):
    """An Outgoing for a new file at ``path`` holding ``data``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return Outgoing(path.name, ST, str(path))


def _sink_into(directory):
    return lambda name, size: RenamedDataFile(os.path.join(directory, name), lambda p: LocalDataFile(p, fsync=False), fsync=False)


def test_files_cross_both_ways_whole_in_chunks(tmp_path):
    src0, src1, dst0, dst1 = (tmp_path / n for n in ("s0", "s1", "d0", "d1"))
    for d in (src0, src1, dst0, dst1):
        d.mkdir()
    big = os.urandom(10_000)
    (src0 / "__0_0.distcp").write_bytes(big)
    (src0 / "__0_0.distcp.crc32").write_bytes(b"")
    (src1 / "__1_0.distcp").write_bytes(b"x" * 7)
    out0 = [Outgoing("__0_0.distcp", ST, str(src0 / "__0_0.distcp")),
            Outgoing("__0_0.distcp.crc32", ST, str(src0 / "__0_0.distcp.crc32")),
            _file(tmp_path / "md" / ".metadata", b"md" * 3000)]
    out1 = [Outgoing("__1_0.distcp", ST, str(src1 / "__1_0.distcp"))]
    res, chans = _run_ranks([lambda ch: ring_pass(ch, 1, 1, out0, _sink_into(dst0), chunk=1024),
                             lambda ch: ring_pass(ch, 0, 0, out1, _sink_into(dst1), chunk=1024)])
    assert res[0].error is None and res[1].error is None, res
    assert res[1].received == ["__0_0.distcp", "__0_0.distcp.crc32", ".metadata"]
    assert (dst1 / "__0_0.distcp").read_bytes() == big and (dst1 / ".metadata").read_bytes() == b"md" * 3000
    assert (dst1 / "__0_0.distcp.crc32").read_bytes() == b""
    assert (dst0 / "__1_0.distcp").read_bytes() == b"x" * 7 and res[0].received == ["__1_0.distcp"]
    assert res[0].sent_bytes == 16_000 and res[1].received_bytes == 16_000
    sends = [c for c in chans[0].counter.since(0) if c.kind == "send"]
    assert sum(c.payload_bytes for c in sends) > 16_000 and max(c.payload_bytes for c in sends) <= 1024 + 64
    assert sorted(os.listdir(dst1)) == [".metadata", "__0_0.distcp", "__0_0.distcp.crc32"]


class _ShortStorage(LocalStorage):
    """Announces more bytes than the file holds: the read ends early (a file shrunk meanwhile)."""

    def size(self, path):
        return super().size(path) + 5000


def test_a_file_that_cannot_be_read_is_padded_reported_and_never_committed(tmp_path):
    (tmp_path / "s").mkdir(), (tmp_path / "d").mkdir(), (tmp_path / "e").mkdir()
    (tmp_path / "s" / "__0_0.distcp").write_bytes(b"a" * 3000)
    bad = [Outgoing("__0_0.distcp", _ShortStorage(), str(tmp_path / "s" / "__0_0.distcp"))]

    def sender(ch):
        first = ring_pass(ch, 1, 1, bad, _sink_into(tmp_path / "e"), chunk=1024)
        again = ring_pass(ch, 1, 1, [_file(tmp_path / "s2" / "__0_1.distcp", b"ok")], _sink_into(tmp_path / "e"))
        return first, again

    def receiver(ch):
        return (ring_pass(ch, 0, 0, [], _sink_into(tmp_path / "d"), chunk=1024),
                ring_pass(ch, 0, 0, [], _sink_into(tmp_path / "d")))

    (s1, s2), (r1, r2) = _run_ranks([sender, receiver])[0]
    assert "ended after 3000 of 8000 bytes" in s1.error
    assert r1.error == "rank 0 could not read all of the files it sent" and r1.received == []
    assert s1.sent_bytes == 8000  # padded to the size announced: both ranks stayed in step
    assert r2.error is None and r2.received == ["__0_1.distcp"] and s2.error is None
    assert sorted(os.listdir(tmp_path / "d")) == ["__0_1.distcp"]  # no partial file, no .incoming


def test_a_file_that_cannot_be_written_is_abandoned_and_the_ranks_stay_in_step(tmp_path):
    (tmp_path / "d").mkdir()

    class Failing:
        def __init__(self, *a):
            self.inner = RenamedDataFile(str(tmp_path / "d" / "__0_0.distcp"), lambda p: LocalDataFile(p, False), False)

        def write(self, data):
            raise OSError(28, "injected: disk full")

        def commit(self):
            self.inner.commit()

        def close(self):
            self.inner.close()

    out = [_file(tmp_path / "s" / "__0_0.distcp", b"z" * 5000)]
    res, _ = _run_ranks([lambda ch: (ring_pass(ch, 1, 1, out, None, chunk=1000),
                                     ring_pass(ch, 1, 1, [], None)),
                         lambda ch: (ring_pass(ch, 0, 0, [], Failing, chunk=1000),
                                     ring_pass(ch, 0, 0, [], None))])
    (s1, s2), (r1, r2) = res
    assert s1.error is None and s2.error is None and r2.error is None
    assert "writing __0_0.distcp failed" in r1.error and "injected: disk full" in r1.error
    assert r1.received == [] and os.listdir(tmp_path / "d") == []


def test_a_header_naming_a_path_breaks_the_channel(tmp_path):
    evil = [Outgoing("../../etc/passwd", ST, str(_file(tmp_path / "s" / "x", b"root").path))]
    res, _ = _run_ranks([lambda ch: ring_pass(ch, 1, 1, evil, None),
                         lambda ch: ring_pass(ch, 0, 0, [], _sink_into(tmp_path / "d"))], timeout=2.0)
    assert isinstance(res[1], ChannelError) and "'../../etc/passwd'" in str(res[1])
    assert isinstance(res[0], ChannelError)  # the sender is not left waiting forever
    assert sorted(os.listdir(tmp_path)) == ["s"] and os.listdir(tmp_path / "s") == ["x"]  # nothing written
    assert not (tmp_path.parent / "etc" / "passwd").exists()  # where the name pointed from tmp_path/d


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "__12_3.distcp.crc32", ".solosave-index"])
def test_checkpoint_file_names_pass_the_header_check(name):
    from solosave._src.coordination.transfer import PEER_FILE

    assert PEER_FILE.match(name)
    assert not PEER_FILE.match("sub/" + name) and not PEER_FILE.match(name + ".tmp")


def test_a_header_announcing_more_than_the_receiver_can_hold_is_refused_naming_the_peer(tmp_path, case_log):
    """Was: a header announcing a 2**50-byte file made the receiver build its whole receive plan
    (one entry per chunk) and die with MemoryError before any byte arrived."""

    def evil(ch):  # rank 0 sends a header announcing a file of 2**50 bytes, then stops
        header = json.dumps({"files": [["__0_0.distcp", 1 << 50]], "error": None}).encode()
        theirs = int.from_bytes(ch.exchange(1, len(header).to_bytes(8, "little"), 1, 8), "little")
        ch.exchange(1, header, 1, theirs)
        return "sent"

    res, _ = _run_ranks([evil, lambda ch: ring_pass(ch, 0, 0, [], _sink_into(tmp_path / "d"), max_bytes=1 << 30)],
                        timeout=2.0)
    assert isinstance(res[1], ChannelError) and "rank 0 announced 1125899906842624 bytes" in str(res[1]), res[1]
    assert not (tmp_path / "d").exists()  # nothing opened
    case_log("peer copy: a crafted header announcing a file of 2**50 bytes",
             "refused at once, naming the peer (more than this rank can hold); nothing opened; no MemoryError")


def test_the_receive_plan_is_computed_per_chunk():
    from solosave._src.coordination.transfer import _ChunkPlan

    plan = _ChunkPlan([10, 0, 3, 1 << 50], 4)
    assert len(plan) == 3 + 0 + 1 + (1 << 48)  # a count, not a list: no memory per chunk
    assert [plan[i] for i in range(4)] == [(0, 4), (0, 4), (0, 2), (2, 3)]
    assert plan[4] == (3, 4) and plan[len(plan) - 1] == (3, 4)


def test_files_larger_than_the_free_space_are_dropped_in_step(tmp_path):
    """No room for what a peer sends (a full disk, not an attack): nothing is written, the pass
    ends on both ranks with the error, and the channel stays usable."""
    src = [_file(tmp_path / "s" / "__0_0.distcp", os.urandom(1000))]
    out, _ = _run_ranks([lambda ch: (ring_pass(ch, 1, 1, src, None, chunk=256), ch.all_and(1)),
                         lambda ch: (ring_pass(ch, 0, 0, [], _sink_into(tmp_path / "d"), chunk=256, max_bytes=100),
                                     ch.all_and(1))])
    (sent, and0), (got, and1) = out
    assert sent.error is None and sent.sent_bytes == 1000
    assert "more than this rank can hold (100 bytes free)" in got.error and got.received == []
    assert not (tmp_path / "d").exists()
    assert and0 == and1 == 1  # the same channel goes on working
