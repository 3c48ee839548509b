"""The byte readers of ``formats/`` on crafted input (the findings of ``tests/faults/test_fuzz.py``,
each pinned here): the ``.metadata`` unpickler allocates nothing a number in the file asks for,
an unpickled ``Metadata`` of the wrong shape is refused with one clear error, and the record
decoder answers "not plain" instead of raising."""

from __future__ import annotations

import io
import pickle
import random
import struct
import tracemalloc

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import solosave
from solosave._src.formats.metadata_check import metadata_problem
from solosave._src.formats.record_reader import RecordCache, TensorLayout, parse_tensor_record
from solosave._src.formats.safe_pickle import safe_loads

try:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
except ImportError:  # pragma: no cover
    from torch.distributed.checkpoint._storage_utils import _StorageInfo


def _u32(n: int) -> bytes:
    return struct.pack("<I", n)


def _u64(n: int) -> bytes:
    return struct.pack("<Q", n)


CLAIMS = {  # one opcode whose argument asks for far more than the pickle holds
    "BINBYTES 2 GiB": b"\x80\x04B" + _u32(2**31 - 1) + b"abc.",
    "BINBYTES8 1 TiB": b"\x80\x04\x8e" + _u64(2**40) + b"abc.",
    "BYTEARRAY8 8 EiB": b"\x80\x05\x96" + _u64(2**63 - 1) + b"abc.",
    "BINUNICODE8 huge": b"\x80\x04\x8d" + _u64(2**63 - 1) + b"abc.",
    "LONG4 2 GiB": b"\x80\x02\x8b" + _u32(2**31 - 1) + b"abc.",
    "LONG_BINPUT memo index 2**31": b"\x80\x02K\x01r" + _u32(2**31) + b".",
    "PUT memo index 10**12": b"\x80\x02K\x01p1000000000000\n.",
    "bytes(16 MiB) through REDUCE": b"\x80\x02cbuiltins\nbytes\nJ\x00\x00\x00\x01\x85R.",
    "_reconstructor of bytes": b"\x80\x02ccopyreg\n_reconstructor\ncbuiltins\nbytes\ncbuiltins\nbytes\n"
                               b"J\x00\x00\x00\x01\x87R.",
}


@pytest.mark.parametrize("name", list(CLAIMS))
def test_the_metadata_unpickler_allocates_nothing_a_number_in_the_file_asks_for(name):
    tracemalloc.start()
    try:
        with pytest.raises(solosave.PreparedMetadataError, match="truncated or corrupt"):
            safe_loads(CLAIMS[name], what="crafted")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{name}: {peak} bytes"


def _metadata(**changes) -> Metadata:
    chunk = ChunkStorageMetadata(torch.Size([0]), torch.Size([4]))
    md = Metadata({"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4]), [chunk])},
                  planner_data={"w": ("w",)},
                  storage_data={MetadataIndex("w", torch.Size([0])): _StorageInfo("__0_0.distcp", 0, 100)})
    for k, v in changes.items():
        object.__setattr__(md, k, v)
    return md


def _chunk_without_sizes() -> Metadata:
    md = _metadata()
    c = md.state_dict_metadata["w"].chunks[0]
    object.__delattr__(c, "sizes")
    return md


SHAPES = {
    "storage_data None (DCP: AssertionError)": lambda: _metadata(storage_data=None),
    "storage_data a str": lambda: _metadata(storage_data="x"),
    "a chunk without sizes (DCP: AttributeError)": _chunk_without_sizes,
    "a Metadata as a storage key (DCP: TypeError)": lambda: _metadata(
        storage_data={("w",): _StorageInfo("__0_0.distcp", 0, 1)}),
    "a class as a value (DCP: ValueError)": lambda: _metadata(state_dict_metadata={"w": int}),
    "a negative length": lambda: _metadata(storage_data={
        MetadataIndex("w", torch.Size([0])): _StorageInfo("__0_0.distcp", 0, -5)}),
    "not a Metadata": lambda: {"w": 1},
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_a_metadata_of_the_wrong_shape_is_refused_with_one_clear_error(name):
    """What every reader of a ``.metadata`` calls (loads, verify, export, inspect)."""
    from solosave._src.load.load import parse_metadata

    with pytest.raises(solosave.PreparedMetadataError, match="ckpt/.metadata: .*(not|negative|holds)"):
        parse_metadata(pickle.dumps(SHAPES[name](), protocol=4), "ckpt")
    assert parse_metadata(pickle.dumps(_metadata(), protocol=2), "ckpt") == _metadata()  # the intact one


def test_the_column_check_and_the_item_check_agree_on_plain_tuples():
    """DCP writes ``torch.Size``; a ``.metadata`` of plain tuples of ints is as good."""
    md = _metadata()
    m = md.state_dict_metadata["w"]
    object.__setattr__(m, "size", (4,))
    object.__setattr__(m.chunks[0], "offsets", (0,))
    assert metadata_problem(md) is None
    object.__setattr__(m.chunks[0], "sizes", (4.0,))
    assert "not a box" in metadata_problem(md)


def _record() -> bytes:
    buf = io.BytesIO()
    torch.save(torch.arange(12, dtype=torch.float32).reshape(3, 4), buf)
    return buf.getvalue()


def test_the_record_decoder_never_raises_on_damaged_records():
    """1,000 records, each with a few bytes changed, truncated or extended (a fixed seed): the
    decoder gives a layout or ``None`` (then ``torch.load`` decides), never an exception such as
    the ``IndexError`` a damaged zip64 field gave."""
    good = _record()
    rng = random.Random(29)
    for _ in range(1000):
        data = bytearray(good)
        for _ in range(rng.choice((1, 2, 4))):
            data[rng.randrange(len(data))] = rng.choice((0, 0xFF, 0x01, rng.randrange(256)))
        if rng.random() < 0.2:
            data = data[:rng.randrange(len(data))]
        data = bytes(data)
        out = parse_tensor_record(lambda off, n, d=data: d[off:off + n], len(data), RecordCache())
        assert out is None or isinstance(out, TensorLayout)


def test_a_zip64_field_with_fewer_values_than_its_entry_needs_is_not_plain():
    """The finding pinned: a central directory entry whose sizes are "in its zip64 extra field"
    (0xFFFFFFFF) while that field holds fewer values (``IndexError: pop from empty list``). The
    zip parser the decoder reads through refuses it with ``ValueError``: "not plain"."""
    from solosave._src.formats.torch_zip import IN_ZIP64, zip64_values

    for extra in (b"\x01\x00\x00\x00", b"\x01\x00\x08\x00" + bytes(8)):
        with pytest.raises(ValueError, match="lacks a value"):
            zip64_values(extra, IN_ZIP64, IN_ZIP64, 10)
    assert zip64_values(b"\x01\x00\x10\x00" + struct.pack("<QQ", 7, 5), IN_ZIP64, IN_ZIP64, 10) == (7, 5, 10)


def test_a_record_whose_central_directory_is_shorter_than_its_headers_is_not_plain():
    """The end records say the central directory is one byte shorter than its headers: torch.load
    refuses such a record, and so does the decoder (it once decoded it, the last entry's name
    cut short)."""
    data = bytearray(_record())
    eocd_at = len(data) - 22
    z64_at, = struct.unpack_from("<Q", data, eocd_at - 20 + 8)
    struct.pack_into("<I", data, eocd_at + 12, struct.unpack_from("<I", data, eocd_at + 12)[0] - 1)
    struct.pack_into("<Q", data, z64_at + 40, struct.unpack_from("<Q", data, z64_at + 40)[0] - 1)
    data = bytes(data)
    with pytest.raises(RuntimeError, match="zip archive"):
        torch.load(io.BytesIO(data), weights_only=True)
    assert parse_tensor_record(lambda off, n: data[off:off + n], len(data), RecordCache()) is None
    good = _record()
    assert parse_tensor_record(lambda off, n: good[off:off + n], len(good), RecordCache()) is not None
