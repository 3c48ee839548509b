"""Tensor records from frames (``formats/record_writer.py``): byte-identical to ``torch.save``, loadable by
``torch.load``, valid zips; the cases a frame cannot serve go through ``torch.save``."""

from __future__ import annotations

import errno
import io
import json
import os
import zipfile
import zlib

import numpy as np
import pytest
import torch

from solosave._src.formats.record_writer import FrameCache, build_frame, raw_bytes, record_crc
from solosave._src.storage.writeback import writev_all
from solosave._src.write.writer import FileWriter, Record

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8,
          torch.int32, torch.int64, torch.bool, torch.complex64]
SHAPES = [(), (1,), (7,), (3, 5), (2, 3, 4), (1 << 18,), (5, 1, 0 + 3)]


def _value(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((str(dtype), shape)) % 1000)
    return (torch.randn(shape, generator=g) * 50).to(dtype)


def _torch_save(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def _framed(t: torch.Tensor) -> bytes:
    frame = FrameCache().get(t)
    assert frame is not None
    data = raw_bytes(t)
    return frame.prefix + bytes(data) + frame.suffix_with(record_crc(data))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_a_framed_record_is_byte_identical_to_torch_save(dtype, shape):
    t = _value(dtype, shape)
    mine = _framed(t)
    assert mine == _torch_save(t)
    back = torch.load(io.BytesIO(mine), weights_only=True)
    assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)
    assert zipfile.ZipFile(io.BytesIO(mine)).testzip() is None  # every CRC32 right


def test_the_frame_of_one_shape_serves_every_value_of_it():
    cache = FrameCache()
    a, b = torch.randn(64, 3), torch.randn(64, 3)
    assert cache.get(a) is cache.get(b)
    assert _framed(b) == _torch_save(b)


@pytest.mark.parametrize("make", [
    lambda: torch.arange(20.0)[5:9],              # a view: torch.save writes the whole storage
    lambda: torch.arange(12.0).reshape(3, 4).t(),  # non-contiguous
    lambda: torch.empty(0),                        # no bytes
], ids=["view", "transposed", "empty"])
def test_tensors_a_frame_cannot_serve_go_through_torch_save(make, tmp_path):
    t = make()
    assert FrameCache().get(t) is None
    results = FileWriter(fsync=False).write_file(str(tmp_path), "f", [Record(("k", None), tensor=t)])
    data = (tmp_path / "f").read_bytes()
    assert data == _torch_save(t) and results[0][3] == len(data)


def test_the_writer_writes_framed_records_with_crcs_computed_ahead(tmp_path):
    ts = [_value(torch.float32, (1000,)), _value(torch.bfloat16, (3, 7)), _value(torch.int64, (5,))]
    recs = [Record((f"t{i}", None), tensor=t) for i, t in enumerate(ts)] + [Record(("b", None), payload=b"xyz")]
    results = FileWriter(fsync=False, checksums=True).write_file(str(tmp_path), "f", recs)
    data = (tmp_path / "f").read_bytes()
    for (key, _, off, length), t in zip(results, ts):
        assert data[off:off + length] == _torch_save(t), key
    assert data[results[-1][2]:] == b"xyz"


def test_build_frame_refuses_an_empty_tensor():
    assert build_frame(torch.float32, (0, 3)) is None


def test_the_suffixes_of_many_records_built_at_once_match_torch_save():
    """``suffixes_with`` builds every suffix of a batch with array operations (the writer's
    path); each row must be the suffix ``torch.save`` writes for that tensor's bytes."""
    ts = [_value(torch.float32, (33, 5)) + i for i in range(40)] + [torch.zeros(33, 5), torch.full((33, 5), -1.0)]
    cache = FrameCache()
    frame = cache.get(ts[0])
    crcs = np.array([record_crc(raw_bytes(t)) for t in ts], np.uint32)
    rows = frame.suffixes_with(crcs)
    assert rows.shape == (len(ts), len(frame.suffix))
    for t, row, crc in zip(ts, rows, crcs):
        assert frame.prefix + bytes(raw_bytes(t)) + row.tobytes() == _torch_save(t)
        assert row.tobytes() == frame.suffix_with(int(crc))  # the per-record path agrees


def test_writev_all_resumes_after_short_writes(tmp_path, monkeypatch):
    """A ``writev`` that writes less than asked (a signal, a pipe, a full quota) is resumed
    where it stopped, across piece boundaries."""
    real = os.writev
    sizes = iter([5, 1, 700, 3, 10**9] * 100)

    def short(fd, bufs):
        joined = b"".join(bytes(b) for b in bufs)
        return real(fd, [joined[:next(sizes)]])

    pieces = [b"head", memoryview(bytes(range(256)) * 3).cast("B"), np.arange(50, dtype=np.uint8), b"", b"tail"]
    want = b"".join(bytes(p) for p in pieces)
    monkeypatch.setattr(os, "writev", short)
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        writev_all(fd, pieces)
    finally:
        os.close(fd)
    assert path.read_bytes() == want


def test_the_writer_builds_many_suffixes_at_once_and_few_one_by_one(tmp_path):
    """A batch with 100 records of one shape (their suffixes built at once) and a few of
    other shapes (one by one), interleaved: every record is ``torch.save``'s."""
    ts = []
    for i in range(100):
        ts.append(_value(torch.float32, (64,)) + i)
        if i % 30 == 0:
            ts.append(_value(torch.int64, (3, i + 1)))
    recs = [Record((f"t{i}", None), tensor=t) for i, t in enumerate(ts)]
    results = FileWriter(fsync=False).write_file(str(tmp_path), "f", recs)
    data = (tmp_path / "f").read_bytes()
    assert len(results) == len(ts)
    for (key, _, off, length), t in zip(results, ts):
        assert data[off:off + length] == _torch_save(t), key


def test_the_writer_with_checksums_across_batches_payloads_and_torch_save_records(tmp_path):
    """A file of several ``writev`` batches mixing framed tensors (64+ of one shape: suffixes
    built at once), padded payloads and records no frame fits (an empty tensor, a view: through
    ``torch.save``, between batches): every record is ``torch.save``'s (payloads as given, zero
    padded), and the sidecar holds each record's CRC32, in order (the file is not read back:
    it is opened write-only)."""
    recs, want = [], []
    for i in range(70):
        t = _value(torch.float32, (16,)) + i
        recs.append(Record((f"s{i}", None), tensor=t))
        want.append(_torch_save(t))
        if i == 10:
            recs.append(Record(("empty", None), tensor=torch.empty(0)))
            want.append(_torch_save(torch.empty(0)))
        if i == 20:
            recs.append(Record(("bytes", None), payload=b"abc" * 100, pad_to=400))
            want.append(None)
    for i in range(3):  # 3 x 4 MiB: more than one 8 MiB batch
        big = _value(torch.float32, (1 << 20,)) + i
        recs.append(Record((f"big{i}", None), tensor=big))
        want.append(_torch_save(big))
    view = torch.arange(40.0)[3:9]
    recs.append(Record(("view", None), tensor=view))
    want.append(_torch_save(view))
    results = FileWriter(fsync=False, checksums=True).write_file(str(tmp_path), "f", recs)
    data = (tmp_path / "f").read_bytes()
    sidecar = json.loads((tmp_path / "f.crc32").read_bytes())["records"]
    assert len(results) == len(recs) == len(sidecar)
    for (key, _, off, length), w, side in zip(results, want, sidecar):
        chunk = data[off:off + length]
        if w is not None:
            assert chunk == w, key
        else:
            assert chunk[:300] == b"abc" * 100 and set(chunk[300:]) <= {0}, key
        assert (side["offset"], side["length"], side["crc32"]) == (off, length, zlib.crc32(chunk)), key
    assert results[-1][2] + results[-1][3] == len(data)


def test_a_failed_torch_save_record_is_named_in_the_error(tmp_path, monkeypatch):
    """An error inside a record that goes through ``torch.save`` names that record, not the
    file's last one."""
    real_save = torch.save

    def failing_save(obj, f, *args, **kwargs):  # only the empty tensor's record fails
        if isinstance(obj, torch.Tensor) and obj.numel() == 0:
            raise OSError(errno.EIO, "injected")
        return real_save(obj, f, *args, **kwargs)

    recs = [Record(("a", None), tensor=torch.ones(3)), Record(("empty", None), tensor=torch.empty(0)),
            Record(("b", None), tensor=torch.ones(5))]
    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="'empty'") as info:
        FileWriter(fsync=False).write_file(str(tmp_path), "f", recs)
    assert "'b'" not in str(info.value)
