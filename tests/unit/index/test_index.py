"""The load index beside ``.metadata`` (``solosave._src.index.writer``): the same entries as the
``.metadata`` it belongs to, only the chunks a rank's boxes touch, refused when stale or
damaged (the loader then reads ``.metadata``), and used by ``solosave.load`` at any world size."""

import logging
import pickle
import uuid

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from solosave._src.core.errors import IndexUnusable
from solosave._src.formats.dcp import INDEX_FILE, METADATA_FILE
from solosave._src.formats.metadata_template import MetadataTemplate
from solosave._src.index.reader import LoadIndex, wanted_of
from tests.support import dcp_save_local, publish_with_index, run_ranks

try:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
except ImportError:  # pragma: no cover
    from torch.distributed.checkpoint._storage_utils import _StorageInfo


def _state() -> dict:
    return {"w": torch.randn(6, 4, generator=torch.Generator().manual_seed(7)),
            "half": torch.arange(10, dtype=torch.float16), "n": {"k": 3, "s": "x"},
            "i": torch.tensor(7), "e": torch.zeros(0, 3), "q": torch.ones(2, dtype=torch.bool).requires_grad_(False)}


def _stock(tmp_path) -> Metadata:
    dcp_save_local(_state(), checkpoint_id=str(tmp_path))
    with open(tmp_path / METADATA_FILE, "rb") as f:
        return pickle.load(f)


def test_the_index_holds_exactly_what_metadata_holds(tmp_path):
    md = _stock(tmp_path)
    publish_with_index(tmp_path, md)
    with LoadIndex.open(tmp_path) as idx:
        got = idx.metadata_for({k: None for k in md.state_dict_metadata} | {"absent": None})
    assert got.state_dict_metadata == md.state_dict_metadata
    assert got.storage_data == md.storage_data
    assert got.planner_data == md.planner_data
    assert "absent" not in got.state_dict_metadata  # DCP's planner reports a missing key itself


def _grid(tmp_path) -> Metadata:
    """A 12x8 tensor saved as a 4x2 grid of 3x4 chunks, and a 1-d one in 4 chunks (one empty)."""
    props = TensorProperties(dtype=torch.float32)
    chunks = [ChunkStorageMetadata(torch.Size([3 * i, 4 * j]), torch.Size([3, 4])) for i in range(4) for j in range(2)]
    vec = [ChunkStorageMetadata(torch.Size([o]), torch.Size([s])) for o, s in ((0, 4), (4, 4), (8, 4), (12, 0))]
    storage = {MetadataIndex("g", c.offsets): _StorageInfo(f"__{n}_0.distcp", 100 * n, 64)
               for n, c in enumerate(chunks)}
    storage |= {MetadataIndex("v", c.offsets): _StorageInfo(f"__{n}_0.distcp", 5000 + n, 8) for n, c in enumerate(vec)}
    return Metadata({"g": TensorStorageMetadata(props, torch.Size([12, 8]), chunks),
                     "v": TensorStorageMetadata(props, torch.Size([12]), vec)}, storage_data=storage)


def test_a_lookup_returns_the_chunks_its_boxes_touch_and_reads_only_their_rows(tmp_path):
    md = _grid(tmp_path)
    publish_with_index(tmp_path, md)
    with LoadIndex.open(tmp_path) as idx:
        full = idx.bytes_read
        got = idx.metadata_for({"g": [((4, 1), (2, 2))], "v": [((0,), (3,))]})
        rows_read = idx.bytes_read - full
    assert [tuple(c.offsets) for c in got.state_dict_metadata["g"].chunks] == [(3, 0)]  # rows 4..5, cols 1..2
    assert [tuple(c.offsets) for c in got.state_dict_metadata["v"].chunks] == [(0,)]
    assert got.storage_data[MetadataIndex("g", torch.Size([3, 0]))] == md.storage_data[MetadataIndex("g", torch.Size([3, 0]))]
    assert len(got.storage_data) == 2
    with LoadIndex.open(tmp_path) as idx:  # an empty box or chunk overlaps nothing
        assert idx.metadata_for({"v": [((12,), (0,))]}).state_dict_metadata["v"].chunks == []
    with LoadIndex.open(tmp_path) as idx:
        idx.metadata_for({k: None for k in md.state_dict_metadata})
        all_rows = idx.bytes_read - full
    assert rows_read < all_rows


def test_boxes_of_a_state_dict():
    assert wanted_of({"t": torch.zeros(3, 2), "p": torch.nn.Parameter(torch.zeros(4)), "x": 5}) == {
        "t": [((0, 0), (3, 2))], "p": [((0,), (4,))], "x": None}


def _damage(tmp_path, how):
    md = _stock(tmp_path)
    publish_with_index(tmp_path, md)
    index, meta = tmp_path / INDEX_FILE, tmp_path / METADATA_FILE
    data = index.read_bytes()
    if how == "other save":  # the same metadata published again by another save: another save_id
        meta.write_bytes(MetadataTemplate(md).render(str(tmp_path), str(uuid.uuid4())))
    elif how == "no metadata":
        meta.unlink()
    elif how == "truncated":
        index.write_bytes(data[:-10])
    elif how == "directory":
        at = data.index(b'"keys"')
        index.write_bytes(data[:at] + b'"kezs"' + data[at + 6:])
    elif how == "rows":
        index.write_bytes(data[:-6] + bytes([data[-6] ^ 1]) + data[-5:])
    elif how == "directory length":  # the high bit of the u64 that opens the body: no CRC covers it
        body = data.index(b"\n", data.index(b"\n", len(b"SOLOSAVE-INDEX\n")) + 1) + 1
        index.write_bytes(data[:body + 7] + bytes([data[body + 7] ^ 0x80]) + data[body + 8:])
    elif how == "not an index":
        index.write_bytes(b"hello\n")
    return md


@pytest.mark.parametrize("how", ["other save", "no metadata", "truncated", "directory", "rows", "not an index",
                                 "directory length"])
def test_a_stale_or_damaged_index_is_refused(tmp_path, how, case_log, caplog):
    import solosave

    md = _damage(tmp_path, how)
    with pytest.raises(IndexUnusable) as e, LoadIndex.open(tmp_path) as idx:
        idx.metadata_for({k: None for k in md.state_dict_metadata})
    if how == "no metadata":
        case_log(f"load index: {how}", f"refused ({type(e.value).__name__}); the checkpoint is not published")
        return
    got = {"w": torch.zeros(6, 4), "half": torch.zeros(10, dtype=torch.float16), "n": {"k": 0, "s": ""},
           "i": torch.tensor(0), "e": torch.zeros(0, 3), "q": torch.zeros(2, dtype=torch.bool)}
    with caplog.at_level(logging.WARNING, logger="solosave._src.load.load"):
        solosave.load(got, tmp_path)  # the intact .metadata is read instead
    want = _state()
    assert all(torch.equal(got[k], want[k]) for k in ("w", "half", "i", "e", "q")) and got["n"] == want["n"]
    assert "not using the load index" in caplog.text
    case_log(f"load index: {how}", f"refused ({type(e.value).__name__}); solosave.load warns, reads .metadata "
             "and loads every value exactly")


def test_no_index_is_none(tmp_path):
    _stock(tmp_path)
    assert LoadIndex.open(tmp_path) is None


def test_solosave_load_reads_metadata_when_the_index_is_stale(tmp_path, caplog, case_log):
    import solosave

    md = _stock(tmp_path)
    publish_with_index(tmp_path, md)
    new = {"w": torch.full((6, 4), 2.0), "half": torch.arange(10, dtype=torch.float16) * 3, "n": {"k": 4, "s": "y"},
           "i": torch.tensor(8), "e": torch.zeros(0, 3), "q": torch.zeros(2, dtype=torch.bool)}
    dcp_save_local(new, checkpoint_id=str(tmp_path))  # stock DCP saves over it; our index stays behind
    got = {"w": torch.zeros(6, 4), "half": torch.zeros(10, dtype=torch.float16), "n": {"k": 0, "s": ""},
           "i": torch.tensor(0), "e": torch.zeros(0, 3), "q": torch.ones(2, dtype=torch.bool)}
    with caplog.at_level(logging.WARNING, logger="solosave._src.load.load"):
        solosave.load(got, tmp_path)
    assert torch.equal(got["w"], new["w"]) and torch.equal(got["half"], new["half"]) and got["n"] == new["n"]
    assert "not using the load index" in caplog.text and "another .metadata" in caplog.text
    case_log("stock DCP saves into a solosave checkpoint; its load index stays behind",
             "solosave.load warns, ignores the stale index and loads the new values from .metadata")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("ws", [1, 2])
def test_solosave_load_uses_only_the_index_of_create_and_reuse_saves(tmp_path, ws, case_log):
    from tests.multiproc import load_fns

    for rank, out in enumerate(run_ranks(load_fns.index_loads, ws, str(tmp_path), timeout=150)):
        assert out["kinds"] == ["create", "reuse"], out
        for name in ("c0", "c1"):
            ok, calls = out[f"{name}/True"]
            assert ok, (rank, name)
            assert calls == ["all_reduce"], calls  # agree on the result and that every rank used it
            ok, calls = out[f"{name}/False"]
            assert ok and calls == ["broadcast", "all_reduce"], calls
        ok, calls = out["mixed"]
        assert ok and calls == ["all_reduce", "broadcast", "all_reduce"], (rank, calls)
        ok, calls = out["mixed/cooperative"]
        assert ok and calls[-1] == "all_reduce" and "broadcast" in calls, (rank, calls)
    case_log(f"W={ws}: create and reuse saves, loaded along other dimensions",
             ".metadata never parsed; one 8-byte all_reduce, no broadcast; bit-exact")
    case_log(f"W={ws}: the last rank cannot use the load index, the others can",
             "the others load through it; every rank then takes the .metadata broadcast, only the last "
             "rank loads from it; bit-exact")



def test_a_chunk_listed_twice_gives_both_of_its_rows_its_storage(tmp_path):
    """A crafted metadata that lists one chunk twice has one ``storage_data`` entry for both:
    each of the two rows in the index holds it (loads leave such a key to DCP's planner; no row
    may point at offset 0, length 0)."""
    import dataclasses

    import numpy as np

    md = _grid(tmp_path)
    g = md.state_dict_metadata["g"]
    twice = dataclasses.replace(g, chunks=[*g.chunks, g.chunks[0]])
    publish_with_index(tmp_path, dataclasses.replace(md, state_dict_metadata={**md.state_dict_metadata, "g": twice}))
    with LoadIndex.open(tmp_path) as idx:
        e = idx.keys["g"]
        offs, _ = idx.geometry(int(e[1]))
        rows = idx._rows(int(e[1]), np.arange(len(offs)))
        got = [(tuple(offs[i].tolist()), int(rows[i][int(e[2])]["offset"]), int(rows[i][int(e[2])]["length"]))
               for i in range(len(offs))]
    want = md.storage_data[MetadataIndex("g", torch.Size([0, 0]))]
    assert [r for r in got if r[0] == (0, 0)] == [((0, 0), want.offset, want.length)] * 2
    assert all(length == 64 for _, _, length in got)
