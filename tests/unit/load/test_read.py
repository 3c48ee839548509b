"""solosave's read path (``load/read_path``, ``formats/record_reader``): records decoded without unpickling them, every
dtype and saved view bit for bit, the general path for other record forms, crafted records refused."""

import io
import math
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

import solosave
from solosave import CorruptCheckpointError
from solosave._src.formats.record_reader import RecordCache, parse_tensor_record
from solosave._src.load import load as _load
from solosave._src.load import read_path as _read
from solosave._src.load.load import SafeFileSystemReader, SafeLoadPlanner
from tests.support import dcp_save_local, publish_with_index, zeros_like

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn,
          torch.uint16]


def _bits(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _value(dtype, shape, seed):
    """Random bit patterns (NaNs and infinities included); bools 0/1."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _state(n):
    sd = {"meta": {"step": 7, "name": "abc", "lrs": [0.1, 0.2]}}
    for i, dt in enumerate(DTYPES):
        sd[f"v{i}"] = _value(dt, (n,), i)
        sd[f"m{i}"] = _value(dt, (3, 4), 100 + i)
        sd[f"s{i}"] = _value(dt, (), 200 + i)
        sd[f"e{i}"] = _value(dt, (0, 3), 300 + i)
        sd[f"t{i}"] = _value(dt, (40, 60), 400 + i).t()  # saved with transposed strides
    return sd


def _zeros(sd):
    return zeros_like(sd)  # keeps strides: the transposed ones are non-contiguous targets


@pytest.mark.parametrize("n,tiny_spans", [(5, False), (5, True), (140_000, False)],
                         ids=["spans", "one-record-spans", "direct"])
def test_every_dtype_and_shape_loads_bit_exact(tmp_path, monkeypatch, n, tiny_spans):
    if tiny_spans:  # every record its own span, some longer than the span buffer
        monkeypatch.setattr(_read, "SPAN_BYTES", 1024)
        monkeypatch.setattr(_read, "GAP_MAX", 0)
    sd = _state(n)
    ck = str(tmp_path / "ck")
    dcp_save_local(sd, checkpoint_id=ck)  # stock DCP's writer
    stock, ours, via_load = _zeros(sd), _zeros(sd), _zeros(sd)
    dcp.load(stock, checkpoint_id=ck, no_dist=True)
    reader = SafeFileSystemReader(ck)
    dcp.load(ours, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    solosave.load(via_load, ck)
    for k, v in sd.items():
        if k == "meta":
            assert ours[k] == via_load[k] == stock[k] == v
            continue
        assert _same(ours[k], v) and _same(stock[k], v) and _same(via_load[k], v), k
    st = reader.last_read_stats
    assert st.general == 0 and st.byte_items == 3 and st.converted >= len(DTYPES)  # transposed targets
    assert (st.direct if n > 5 else st.copied) >= len(DTYPES)
    if n > 5:
        assert st.reads < 4 * len(sd) * 2  # few reads per record, not one per byte range


# -- records of any saved view, read through read_items with a minimal planner -------------------

class _Planner:
    """The planner calls read_items makes: resolve_tensor / commit_tensor / load_bytes."""

    def __init__(self, targets):
        self.targets = targets
        self.committed = []

    def resolve_tensor(self, item):
        t = self.targets[item.dest_index.fqn]
        for d, (o, n) in enumerate(zip(item.dest_offsets, item.lengths)):
            t = t.narrow(d, o, n)
        return t

    def commit_tensor(self, item, tensor):
        self.committed.append(item.dest_index.fqn)


def _saved(t, **kw):
    b = io.BytesIO()
    torch.save(t, b, **kw)
    return b.getvalue()


def _file(path, records):
    """Write ``{fqn: record bytes}`` one after another; their storage_data."""
    storage = {}
    with open(path, "wb") as f:
        f.write(b"\0" * 13)  # records need not start aligned
        for fqn, data in records.items():
            storage[MetadataIndex(fqn)] = _StorageInfo("__0_0.distcp", f.tell(), len(data))
            f.write(data)
    return storage


def _item(fqn, offsets, lengths):
    return ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(fqn), dest_offsets=torch.Size([0] * len(lengths)),
                    storage_index=MetadataIndex(fqn), storage_offsets=torch.Size(offsets), lengths=torch.Size(lengths))


def _views():
    base = torch.arange(100.0).reshape(10, 10)
    big = torch.arange(300_000, dtype=torch.int32).reshape(3000, 100)
    return {"rows": base[2:5], "cols": base[:, 3:7], "t": base.t(), "step2": base[::2], "row": base[3],
            "expanded": torch.arange(5.0).expand(4, 5), "big_rows": big[1000:2000], "big_cols": big[:, 10:90],
            "big_t": big.t()}


def _part(shape, part):
    """``(offsets, lengths)`` of the whole tensor, of a run of rows, or of an inner block."""
    if part == "whole" or not shape:
        return [0] * len(shape), list(shape)
    if part == "rows":
        return [1] + [0] * (len(shape) - 1), [max(1, (shape[0] - 1) // 2)] + list(shape[1:])
    offsets = [min(1, s - 1) for s in shape]
    return offsets, [max(1, (s - o) // 2) for s, o in zip(shape, offsets)]


@pytest.mark.parametrize("part", ["whole", "rows", "chunk"])
def test_saved_views_decode_like_torch_load(tmp_path, part):
    views = _views()
    storage = _file(tmp_path / "__0_0.distcp", {k: _saved(v) for k, v in views.items()})
    items, want = [], {}
    for k, v in views.items():
        offsets, lengths = _part(v.shape, part)
        items.append(_item(k, offsets, lengths))
        want[k] = v[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
    targets = {k: torch.full(w.shape, -1, dtype=w.dtype) for k, w in want.items()}
    planner = _Planner(targets)
    stats = _read.read_items(tmp_path, items, storage, planner)
    for k, w in want.items():
        assert torch.equal(targets[k], w), k
    assert sorted(planner.committed) == sorted(want) and stats.general == 0
    assert stats.converted >= 3 and stats.copied >= 1  # strided views; small contiguous ones
    assert stats.direct >= (0 if part == "chunk" else 1)  # big_rows: at an offset in its storage


def test_other_record_forms_take_the_general_path(tmp_path):
    legacy = torch.arange(12.0).reshape(3, 4)
    param = torch.nn.Parameter(torch.arange(6.0))
    storage = _file(tmp_path / "__0_0.distcp", {"legacy": _saved(legacy, _use_new_zipfile_serialization=False),
                                                 "param": _saved(param)})
    targets = {"legacy": torch.zeros(2, 4), "param": torch.zeros(6)}
    items = [_item("legacy", [1, 0], [2, 4]), _item("param", [0], [6])]
    stats = _read.read_items(tmp_path, items, storage, _Planner(targets))
    assert stats.general == 2
    assert torch.equal(targets["legacy"], legacy[1:]) and torch.equal(targets["param"], param.detach())
    whole = torch.zeros(3, 4)  # a whole read of such a record takes the same path
    planner = _Planner({})
    stats = _read.read_items(tmp_path, [], {}, planner, [(_read.WholeRead("legacy", whole),
                                                          storage[MetadataIndex("legacy")])])
    assert stats.general == 1 and torch.equal(whole, legacy) and planner.committed == []


def test_records_of_equal_size_and_different_dtype_share_no_layout():
    cache = RecordCache()
    layouts = []
    for t in (torch.arange(8, dtype=torch.float32), torch.arange(8, dtype=torch.int32), torch.ones(2, 4)):
        rec = memoryview(_saved(t))
        layouts.append(parse_tensor_record(lambda off, n, rec=rec: rec[off:off + n], len(rec), cache))
    assert [(lay.dtype, lay.size) for lay in layouts] == [
        (torch.float32, (8,)), (torch.int32, (8,)), (torch.float32, (2, 4))]
    assert len(cache.templates) == 1  # one zip structure for the three


def test_a_record_like_the_last_one_decodes_quickly_and_any_other_byte_is_noticed():
    def parse(rec, cache):
        view = memoryview(bytes(rec))
        return parse_tensor_record(lambda off, n: view[off:off + n], len(view), cache)

    first, second = _saved(torch.rand(8192)), _saved(torch.rand(8192))  # other payload and CRCs
    cache = RecordCache()
    layout = parse(first, cache)
    assert layout is not None and len(cache.quick) == 1
    cache.templates.clear()  # the next decode can only come from the quick comparison
    assert parse(second, cache) is layout
    comment = bytearray(second)
    comment[-2] = 1  # the end-of-directory record now announces a comment: not a plain record
    assert parse(comment, cache) is None
    shape = bytearray(second)
    at = shape.find(b"data.pkl") + len(b"data.pkl") + 1
    shape[at:at + 1] = b"\xff"  # a byte after data.pkl's name in its local header: decoded in full again
    assert parse(shape, cache) is not layout


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def _zip_record(pkl, data=b"\0" * 16, order=b"little"):
    b = io.BytesIO()
    with zipfile.ZipFile(b, "w") as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", order)
        z.writestr("archive/data/0", data)
        z.writestr("archive/version", "3\n")
    return b.getvalue()


def test_a_tensor_record_that_would_run_code_is_refused(tmp_path, case_log):
    import pickle

    marker = tmp_path / "pwned"
    storage = _file(tmp_path / "__0_0.distcp", {"w": _zip_record(pickle.dumps(Evil(str(marker)), protocol=2))})
    with pytest.raises(solosave.UnsafeMetadataError, match="refusing to load the tensor record of 'w'"):
        _read.read_items(tmp_path, [_item("w", [0], [4])], storage, _Planner({"w": torch.zeros(4)}))
    assert not marker.exists()
    case_log("a tensor record whose data.pkl runs a shell command when unpickled",
             "solosave.load's read path raises UnsafeMetadataError naming the key; the command did not run")


def test_records_that_lie_about_their_storage_take_the_general_path():
    cache = RecordCache()
    for rec in (_zip_record(_pickled_spec(numel=4), data=b"\0" * 8),  # storage too short
                _zip_record(_pickled_spec(numel=4), data=b"\0" * 16, order=b"big"),
                b"PK" + b"\0" * 40, b""):
        view = memoryview(rec)
        assert parse_tensor_record(lambda off, n, v=view: v[off:off + n], len(rec), cache) is None


def _pickled_spec(numel):
    """The data.pkl torch writes for a float32 tensor of ``numel`` elements."""
    with zipfile.ZipFile(io.BytesIO(_saved(torch.zeros(numel)))) as z:
        return z.read("archive/data.pkl")


def test_a_size_mismatch_names_the_key(tmp_path):
    storage = _file(tmp_path / "__0_0.distcp", {"w": _saved(torch.arange(6.0))})
    planner = _Planner({"w": torch.zeros(5)})
    planner.resolve_tensor = lambda item: planner.targets["w"]  # a planner that does not narrow
    with pytest.raises(ValueError, match="'w' at \\[0\\] has size \\[6\\] in the checkpoint but \\[5\\]"):
        _read.read_items(tmp_path, [_item("w", [0], [6])], storage, planner)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_targets_load_through_a_pinned_buffer(tmp_path):
    sd = {"a": torch.randn(70_000), "b": torch.randn(3, 5).to(torch.bfloat16)}
    dcp_save_local(sd, checkpoint_id=str(tmp_path / "ck"))
    target = {k: torch.zeros_like(v, device="cuda") for k, v in sd.items()}
    solosave.load(target, tmp_path / "ck")
    assert all(_same(target[k].cpu(), v) for k, v in sd.items())


def test_targets_written_in_place_are_marked_modified(tmp_path):
    dcp_save_local({"w": torch.randn(70_000), "s": torch.randn(4)}, checkpoint_id=str(tmp_path / "ck"))
    sd = {"w": torch.zeros(70_000), "s": torch.zeros(4)}
    before = {k: v._version for k, v in sd.items()}
    solosave.load(sd, tmp_path / "ck")
    assert all(sd[k]._version > before[k] for k in sd)  # autograd sees the in-place write


def _spy_reads(monkeypatch):
    """Record what each ``read_items`` call of ``solosave.load`` got, and its stats."""
    calls = []

    def spy(directory, items, storage_data, planner, whole=(), cooperation=None):
        stats = _read.read_items(directory, items, storage_data, planner, whole, cooperation)
        calls.append({"items": [(i.storage_index.fqn, i.type) for i in items], "whole": [w.fqn for w, _ in whole],
                      "stats": stats})
        return stats

    monkeypatch.setattr(_load, "read_items", spy)
    return calls


def test_a_record_of_another_shape_than_its_index_says_is_refused(tmp_path):
    import pickle

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    ck = tmp_path / "ck"
    dcp_save_local({"w": torch.randn(6, 4)}, checkpoint_id=str(ck))
    md = pickle.loads((ck / ".metadata").read_bytes())
    tmd = md.state_dict_metadata["w"]
    tmd.size = torch.Size([5, 4])  # crafted: the record holds 6 x 4
    tmd.chunks = [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([5, 4]))]
    publish_with_index(ck, md)
    with pytest.raises(CorruptCheckpointError, match=r"'w' holds a tensor of size \[6, 4\].*index says \[5, 4\]"):
        solosave.load({"w": torch.zeros(5, 4)}, ck)


@pytest.mark.parametrize("how", ["one-read", "batches", "short-reads"])
def test_direct_chunks_are_read_in_few_preadvs(tmp_path, monkeypatch, how):
    sd = {f"w{i}": torch.randn(40_000 + i) for i in range(10)}  # 160 KB records: read directly
    ck = str(tmp_path / "ck")
    dcp_save_local(sd, checkpoint_id=ck)
    publish_with_index(ck)
    if how == "batches":
        monkeypatch.setattr(_read, "IOV_BATCH", 3)  # two chunks (and the gap between) per preadv
    if how == "short-reads":
        real = _read.os.preadv
        monkeypatch.setattr(_read.os, "preadv", lambda fd, bufs, off: min(real(fd, bufs, off), 5000))
    calls = _spy_reads(monkeypatch)
    got = {k: torch.zeros_like(v) for k, v in sd.items()}
    solosave.load(got, ck)
    assert all(torch.equal(got[k], v) for k, v in sd.items())
    st = calls[-1]["stats"]
    assert st.direct == 10 and st.files == 1
    heads_and_tails = 2 * 10
    if how == "one-read":
        assert st.reads == heads_and_tails + 1
    elif how == "batches":
        assert st.reads == heads_and_tails + 5
    else:  # the batch came back short: every chunk read on its own, in pieces
        assert st.reads > heads_and_tails + 10


def test_only_bounded_scratch_buffers_are_pinned_for_cuda_targets():
    """torch's pinned-memory allocator keeps what it handed out for the rest of the process: a
    record larger than PINNED_SCRATCH_MAX bound for a CUDA tensor goes through pageable memory,
    and a host target never asks CUDA anything."""
    asked = []

    def available():
        asked.append(1)
        return True

    limit = _read.PINNED_SCRATCH_MAX
    assert _read.pin_scratch("cuda", limit, available) is True
    assert _read.pin_scratch("cuda", limit + 1, available) is False
    assert _read.pin_scratch("cpu", 16, available) is False
    assert len(asked) == 1
