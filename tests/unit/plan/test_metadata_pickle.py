"""Tests of ``solosave._src.plan.columns`` and ``solosave._src.plan.metadata_pickle``: the write results as
columns, the ``.metadata`` pickle written from them (equal, once unpickled by stock ``pickle``
or the allowlist, to the ``Metadata`` that ``build_metadata`` makes), and the prepared file
built from the same columns."""

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from solosave._src.core.errors import PlanValidationError
from solosave._src.formats.metadata_template import MetadataTemplate
from solosave._src.formats.safe_pickle import safe_loads
from solosave._src.plan.columns import ChunkTable
from solosave._src.plan.metadata_pickle import metadata_template
from solosave._src.prepared.buckets import column_buckets, key_bucket
from solosave._src.prepared.convert import prepared_from_columns
from solosave._src.prepared.sections import SectionReader
from solosave._src.storage.sources import BytesSource
from tests.unit.plan.oracle import build_metadata, prepared_from_results, result_columns
from tests.unit.plan.test_global_plan import _requests, _scenario


def _chunk(offsets, sizes):
    return ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))


def _small():
    big = 3 << 33  # needs the 8-byte integer form
    sdm = {
        "a": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4, 3]),
                                   [_chunk((0, 0), (2, 3)), _chunk((2, 0), (2, 3))]),
        "b": BytesStorageMetadata(),
        "s": TensorStorageMetadata(TensorProperties(dtype=torch.int64), torch.Size([]), [_chunk((), ())]),
        "vé": TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size([big + 10]),
                                    [_chunk((0,), (big,)), _chunk((big,), (10,))]),
    }
    by_rank = [[(("a", (0, 0)), "__0_0.distcp", 0, 10), (("b", None), "__0_0.distcp", 10, 5),
                (("vé", (big,)), "__0_0.distcp", 15, big)],
               [(("a", (2, 0)), "__1_0.distcp", 0, 10), (("s", ()), "__1_0.distcp", 10, 7),
                (("vé", (0,)), "__1_0.distcp", 17, 9)],
               []]
    return sdm, by_rank, {"a": ("a",), "b": ("b",), "vé": ("vé",)}


def _expected(sdm, by_rank, planner_data, checkpoint_id="/ck", save_id="sid"):
    md = build_metadata(sdm, [row for rows in by_rank for row in rows], planner_data)
    md.storage_meta = StorageMeta(checkpoint_id, save_id)
    return md


def test_metadata_from_columns_unpickles_equal_to_build_metadata():
    sdm, by_rank, pd = _small()
    table = ChunkTable.from_metadata(sdm)
    template = metadata_template(sdm, pd, table, result_columns(table, sdm, by_rank))
    data = template.render("/ck", "sid")
    want = _expected(sdm, by_rank, pd)
    for loads in (pickle.loads, safe_loads):
        got = loads(data)
        assert got == want
        assert got.storage_data == want.storage_data  # every key and _StorageInfo
        assert {i.index for i in got.storage_data} == {i.index for i in want.storage_data}  # index hints
        assert list(got.state_dict_metadata) == list(want.state_dict_metadata)
    # the template round-trips through its parts (as a prepared file stores it)
    assert MetadataTemplate.from_parts(template.parts).render("/x", "y") == template.render("/x", "y")


@pytest.mark.parametrize("world", [1, 3, 8])
def test_plan_columns_give_the_same_pickle_and_stock_dcp_reads_it(world, tmp_path):
    from solosave._src.plan.global_plan import global_plan

    ranks = _scenario(world)
    plan = global_plan(_requests(ranks))
    sdm = plan.state_dict_metadata
    by_rank = [[(ranks[r][i].key, f"__{r}_0.distcp", 10 * j, 10) for j, i in enumerate(w)]
               for r, w in enumerate(plan.writes)]
    derived = ChunkTable.from_metadata(sdm)
    assert plan.chunks.names == derived.names and plan.chunks.bounds == derived.bounds
    for table in (plan.chunks, derived):
        res = result_columns(table, sdm, by_rank)
        data = metadata_template(sdm, plan.planner_data, table, res).render(str(tmp_path), "sid")
        assert pickle.loads(data) == _expected(sdm, by_rank, plan.planner_data, str(tmp_path))
    (tmp_path / ".metadata").write_bytes(data)
    got = dcp.FileSystemReader(tmp_path).read_metadata()  # stock DCP's reader
    got.storage_meta.load_id = None  # set by the reader
    assert got == _expected(sdm, by_rank, plan.planner_data, str(tmp_path))


@pytest.mark.parametrize("change, needle", [
    (lambda rows: rows[0].pop(0), "a@[0, 0] was not written"),
    (lambda rows: rows[1].append(rows[1][0]), "written 2 times"),
    (lambda rows: rows[1].append((("zz", (0,)), "__1_0.distcp", 0, 1)), "zz was written but is not in the plan"),
    (lambda rows: rows[1].append((("a", (1, 0)), "__1_0.distcp", 0, 1)), "a was written but is not in the plan"),
    (lambda rows: rows[1].append((("a", (1,)), "__1_0.distcp", 0, 1)), "a was written but is not in the plan"),
])
def test_results_that_do_not_cover_the_plan_are_named(change, needle):
    sdm, by_rank, _ = _small()
    change(by_rank)
    with pytest.raises(PlanValidationError, match="do not cover the plan") as e:
        result_columns(ChunkTable.from_metadata(sdm), sdm, by_rank)
    assert needle in str(e.value)


def test_result_columns_keep_gather_order_and_rank():
    sdm, by_rank, _ = _small()
    table = ChunkTable.from_metadata(sdm)
    res = result_columns(table, sdm, by_rank)
    assert res.world == 3 and res.rank.tolist() == [0, 0, 0, 1, 1, 1]
    assert [res.files[f] for f in res.file.tolist()] == [row[1] for rows in by_rank for row in rows]
    assert res.length.tolist() == [row[3] for rows in by_rank for row in rows]
    assert res.uid.tolist() == [0, 2, 5, 1, 3, 4]


def test_column_buckets_equal_key_bucket():
    sdm, _, _ = _small()
    table = ChunkTable.from_metadata(sdm)
    for n in (1, 3, 7, 1000):
        want = [key_bucket((fqn, None if table.nd[f] < 0 else tuple(table.offs[u, :table.nd[f]].tolist())), n)
                for f, fqn in enumerate(table.names) for u in range(table.bounds[f], table.bounds[f + 1])]
        fids = table.fids()
        nds = torch.tensor(table.nd)[fids]
        assert column_buckets(table.names, fids, nds, table.offs, n).tolist() == want


def test_prepared_file_from_columns_has_the_sections_of_the_per_row_build():
    sdm, by_rank, pd = _small()
    table = ChunkTable.from_metadata(sdm)
    res = result_columns(table, sdm, by_rank)
    template = metadata_template(sdm, pd, table, res)
    fields = {"world_size": 3, "workers": 1, "torch_version": "x"}
    new = SectionReader(BytesSource(prepared_from_columns(sdm, table, res, template, ("/ck", "s"), fields)))
    old = SectionReader(BytesSource(prepared_from_results(sdm, by_rank, template, ("/ck", "s"), fields)))
    for key in ("world", "buckets", "max_files", "ranks_with_files", "fingerprint", "storage_meta"):
        assert new.header[key] == old.header[key], key
    assert new.structure() == old.structure()
    assert [new.rank_layout(r) for r in range(3)] == [old.rank_layout(r) for r in range(3)]
    assert [new.bucket(b) for b in range(new.buckets)] == [old.bucket(b) for b in range(old.buckets)]
    assert new.template_parts() == template.parts


def test_placed_columns_match_by_held_position_and_refuse_what_does_not_cover_the_plan():
    """The coordinator matches fresh write results to chunks by each rank's held positions
    (``WrittenColumns``); a chunk written twice or never, or a position a rank does not hold, is
    refused naming it."""
    from array import array

    from solosave._src.coordination.packing import written_columns
    from solosave._src.core.errors import PlanValidationError
    from solosave._src.plan.columns import placed_columns

    sdm = {"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4, 2]),
                                      [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 2])),
                                       ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 2]))]),
           "extra": BytesStorageMetadata()}
    table = ChunkTable.from_metadata(sdm)  # chunk ids: w@0 -> 0, w@2 -> 1, extra -> 2
    held = [[("w", (0, 0)), ("extra", None)], [("w", (2, 0)), ("extra", None)]]  # extra is replicated
    held_chunks, counts = torch.tensor([0, 2, 1, 2]), [2, 2]
    r0 = written_columns(held[0], [(("extra", None), "__0_1.distcp", 0, 9), (("w", (0, 0)), "__0_0.distcp", 0, 40)])
    r1 = written_columns(held[1], [(("w", (2, 0)), "__1_0.distcp", 0, 40)])
    res = placed_columns(table, held_chunks, counts, [r0, r1])
    assert res.uid.tolist() == [2, 0, 1] and res.rank.tolist() == [0, 0, 1]
    assert [res.files[f] for f in res.file.tolist()] == ["__0_1.distcp", "__0_0.distcp", "__1_0.distcp"]
    assert res.offset.tolist() == [0, 0, 0] and res.length.tolist() == [9, 40, 40]
    twice = written_columns(held[1], [(("w", (2, 0)), "__1_0.distcp", 0, 40), (("extra", None), "__1_0.distcp", 40, 9)])
    with pytest.raises(PlanValidationError, match="'extra' written 2 times"):
        placed_columns(table, held_chunks, counts, [r0, twice])
    with pytest.raises(PlanValidationError, match=r"'w' chunk at offsets \(2, 0\) written 0 times"):
        placed_columns(table, held_chunks, counts, [r0, written_columns(held[1], [])])
    beyond = r1._replace(positions=array("b", [2]))
    with pytest.raises(PlanValidationError, match="rank 1 reported item position 2 of 2 held items"):
        placed_columns(table, held_chunks, counts, [r0, beyond])
    with pytest.raises(ValueError, match="does not hold"):
        written_columns(held[1], [(("w", (0, 0)), "__1_0.distcp", 0, 40)])
