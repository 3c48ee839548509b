"""Tests of ``solosave._write``: padding of BYTES records, write errors that say what happened."""

import io
import os
import subprocess
import sys
import types

import pytest
import torch

from solosave._write import bytes_slot, padded_payload
from support import can_mount_private_tmpfs


def test_a_value_of_a_class_the_worker_cannot_import_keeps_its_padded_slot():
    # a class of the trainer's main script: importable where it is saved, not in the worker
    script = types.ModuleType("a_training_script")
    exec("class Schedule:\n    def __init__(self, n):\n        self.history = list(range(n))\n", script.__dict__)
    sys.modules["a_training_script"] = script
    try:
        buf = io.BytesIO()
        torch.save({"sched": script.Schedule(10), "step": 3}, buf)
    finally:
        del sys.modules["a_training_script"]
    payload = buf.getvalue()
    padded = padded_payload(payload, bytes_slot(len(payload)))
    assert padded is not None and len(padded) == bytes_slot(len(payload))
    assert padded.startswith(payload) and not padded[len(payload):].strip(b"\0")


def test_padding_beyond_the_payload_size_is_refused():
    buf = io.BytesIO()
    torch.save(3, buf)
    payload = buf.getvalue()
    assert padded_payload(payload, 3 * len(payload)) is None
    assert padded_payload(payload, len(payload)) == payload


@pytest.mark.skipif(not can_mount_private_tmpfs(), reason="needs root and unshare for a private 1 MiB tmpfs")
def test_a_full_disk_is_no_space_left_on_device_naming_the_item(tmp_path):
    # torch's zip writer reports a full disk as "inline_container.cc ... unexpected pos"
    code = ("import torch\nfrom solosave._write import FileWriter, Record\n"
            f"FileWriter().write_file({str(tmp_path)!r}, '__0_0.distcp', "
            "[Record(('model.w', (0,)), tensor=torch.ones(1 << 20))])\n")
    r = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {tmp_path} && "
                        f"{sys.executable} -c \"$CODE\""], env=dict(os.environ, CODE=code),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("OSError: [Errno 28] No space left on device while writing 'model.w'"), r.stderr


# -- progressive saves: records wait for their bytes (``_watermark.py``) ------------------------

def _staged_records(buf: bytearray, count: int, each: int) -> tuple[list, list[bytes]]:
    """``count`` float32 records over ``buf`` (as the worker's reader makes them: each tensor's
    storage is exactly its bytes) and the bytes each must hold once staged."""
    from solosave._write import Record

    recs, want = [], []
    for i in range(count):
        off = i * each
        recs.append(Record((f"t{i}", (0,)), tensor=torch.frombuffer(buf, dtype=torch.float32, count=each // 4,
                                                                  offset=off), staged_end=off + each))
        want.append(torch.full((each // 4,), float(i + 1)).numpy().tobytes())
    return recs, want


def _copier(buf: bytearray, want: list[bytes], each: int, mark, group: int, fail_after: int | None = None):
    """The trainer's copy in a thread: fill ``group`` records, then report them; garbage (0xFF)
    stays in every byte not yet reported, so a record read early is written wrong."""
    import threading
    import time

    from solosave._protocol import StageProgress

    def run() -> None:
        for start in range(0, len(want), group):
            if fail_after is not None and start >= fail_after:
                mark.update(StageProgress(mark.seq, 0, True, "save() raised on this rank: RuntimeError: copy"))
                return
            time.sleep(0.003)  # the writer would run ahead of an unreported copy here
            for i in range(start, min(start + group, len(want))):
                buf[i * each:(i + 1) * each] = want[i]
            mark.update(StageProgress(mark.seq, min(start + group, len(want)) * each))
        mark.update(StageProgress(mark.seq, len(buf), True))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["batched", "batched+checksums", "one-by-one"])
def test_a_progressive_write_reads_each_record_only_once_it_is_staged(tmp_path, how):
    from solosave._watermark import Watermark
    from solosave._write import FileWriter, Record

    class OneByOne(FileWriter):
        def write_record(self, stream, record: Record, crc=None) -> None:
            super().write_record(stream, record, crc)

    def writer() -> FileWriter:
        if how == "one-by-one":
            return OneByOne(fsync=False)
        return FileWriter(fsync=False, checksums=how.endswith("checksums"))

    count, each = 24, 8192
    buf = bytearray(b"\xff" * (count * each))
    recs, want = _staged_records(buf, count, each)
    mark = Watermark(seq=1, timeout=20)
    copier = _copier(buf, want, each, mark, group=5)
    (tmp_path / "p").mkdir()
    got = writer().write_files(str(tmp_path / "p"), [("__0_0.distcp", recs)], staged=mark)
    copier.join(10)
    (tmp_path / "s").mkdir()  # the same records written once everything is staged
    ref = writer().write_files(str(tmp_path / "s"), [("__0_0.distcp", recs)])
    assert got == ref
    assert (tmp_path / "p" / "__0_0.distcp").read_bytes() == (tmp_path / "s" / "__0_0.distcp").read_bytes()
    data = (tmp_path / "p" / "__0_0.distcp").read_bytes()
    for i, (_, _, off, n) in enumerate(got):
        t = torch.load(io.BytesIO(data[off:off + n]), weights_only=True)
        assert t.numpy().tobytes() == want[i], f"record {i} holds bytes of before its copy"
    if how.endswith("checksums"):
        assert (tmp_path / "p" / "__0_0.distcp.crc32").read_bytes() == (tmp_path / "s" / "__0_0.distcp.crc32").read_bytes()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checksums", [False, True], ids=["plain", "checksums"])
def test_a_copy_that_fails_midway_fails_the_write_naming_it(tmp_path, checksums):
    from solosave._watermark import StagingFailed, Watermark
    from solosave._write import FileWriter

    count, each = 24, 8192
    buf = bytearray(b"\xff" * (count * each))
    recs, want = _staged_records(buf, count, each)
    mark = Watermark(seq=4, timeout=20)
    copier = _copier(buf, want, each, mark, group=5, fail_after=10)
    with pytest.raises(StagingFailed, match="staging failed on this rank: save\\(\\) raised on this rank: RuntimeError: copy"):
        FileWriter(fsync=False, checksums=checksums).write_files(str(tmp_path), [("__0_0.distcp", recs)], staged=mark)
    copier.join(10)
