"""Local planning of DCP checkpointable objects (several chunks of one key on one rank), of
``io.BytesIO`` values and of values saved whole; the structure cache and staging of them."""

import io

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from solosave._src.load.load import SafeLoadPlanner
from solosave._src.plan.local_plan import ItemKind, WholeValue, checkpointable_items, plan_local, serialize_bytes
from solosave._src.plan.structure import StructureCache
from solosave._src.staging.staging import Stager
from solosave._src.testing.checkpointable import ChunkedTensor, row_chunks


def _sd(seed=0):
    full = torch.arange(24.0).view(6, 4) + seed
    return {"w": row_chunks(full, [(0, 2), (4, 6)]), "b": torch.ones(3) * seed, "blob": io.BytesIO(b"ab"),
            "raw": WholeValue([{"a": torch.ones(2)}, 3])}


def test_each_chunk_is_an_item_at_its_global_offsets():
    plan = plan_local(_sd())
    w = [s for s in plan.specs if s.fqn == "w"]
    assert [(s.offsets, s.sizes, s.global_size, s.dtype, s.nbytes) for s in w] == [
        ((0, 0), (2, 4), (6, 4), "float32", 32), ((4, 0), (2, 4), (6, 4), "float32", 32)]
    assert torch.equal(plan.values[("w", (4, 0))], torch.arange(16.0, 24.0).view(2, 4))
    assert "w" not in plan.values  # the chunks, never the object, are staged
    kinds = {s.fqn: s.kind for s in plan.specs}
    assert kinds["blob"] is ItemKind.BYTES and kinds["raw"] is ItemKind.BYTES


def test_bytesio_is_pickled_whole_as_dcp_does_and_a_whole_value_is_one_record():
    loaded = torch.load(io.BytesIO(serialize_bytes("blob", io.BytesIO(b"\x00ab"))), weights_only=False)
    assert isinstance(loaded, io.BytesIO) and loaded.getvalue() == b"\x00ab"
    whole = torch.load(io.BytesIO(serialize_bytes("raw", WholeValue([{"a": torch.ones(2)}, 3]))))
    assert whole[1] == 3 and torch.equal(whole[0]["a"], torch.ones(2))
    with pytest.raises(TypeError, match=r"state_dict\['raw'\].*cannot be serialized"):
        serialize_bytes("raw", WholeValue([lambda: 1]))


def test_solosave_load_reads_a_bytesio_record_with_weights_only():
    planner = SafeLoadPlanner(flatten_state_dict=False)
    planner.state_dict = {}
    item = ReadItem(LoadItemType.BYTE_IO, MetadataIndex("blob"), torch.Size([0]), MetadataIndex("blob"),
                    torch.Size([0]), torch.Size([0]))
    planner.load_bytes(item, io.BytesIO(serialize_bytes("blob", io.BytesIO(b"xyz"))))
    assert planner.state_dict["blob"].getvalue() == b"xyz"


def test_structure_cache_reuses_specs_and_takes_fresh_chunks():
    cache = StructureCache()
    first = cache.plan(_sd(0))
    second = cache.plan(_sd(5))
    assert cache.hits == 1 and second.specs is first.specs
    assert torch.equal(second.values[("w", (0, 0))], torch.arange(8.0).view(2, 4) + 5)
    assert "w" not in second.values
    moved = _sd(5)
    moved["w"] = row_chunks(torch.zeros(6, 4), [(0, 2), (2, 4)])  # other chunks: planned again
    third = cache.plan(moved)
    assert cache.hits == 1 and ("w", (2, 0)) in third.values


def test_staging_copies_every_chunk():
    plan = plan_local(_sd(1))
    stager = Stager()
    try:
        staged, _ = stager.stage(plan.specs, plan.values)
        views = {it.spec.key: v for it, v in zip(staged.items, stager._plan.views)}
        assert torch.equal(views[("w", (4, 0))], torch.arange(16.0, 24.0).view(2, 4) + 1)
        payloads = {it.spec.fqn: it.payload for it in staged.items if it.payload is not None}
        assert torch.load(io.BytesIO(payloads["raw"]))[1] == 3
    finally:
        stager.close()


class _Broken(ChunkedTensor):
    """A checkpointable object whose shard disagrees with its write item (set by ``mode``)."""

    mode = ""

    def __create_write_items__(self, fqn, obj):
        items = super().__create_write_items__(fqn, obj)
        if self.mode == "duplicate":
            return items + items
        if self.mode == "bytes":
            items[0].__dict__["tensor_data"] = None  # the frozen dataclass, as a BYTE_IO item has it
        return items

    def __get_tensor_shard__(self, index):
        shard = super().__get_tensor_shard__(index)
        return {"shape": shard[:1], "dtype": shard.double(), "subclass": self}.get(self.mode, shard)


@pytest.mark.parametrize("mode, needle", [
    ("duplicate", "listed once"), ("bytes", "carries no tensor"), ("shape", "has shape [1, 4]"),
    ("dtype", "is torch.float64"), ("subclass", "must return a plain tensor"),
])
def test_bad_checkpointable_objects_are_named(mode, needle):
    bad = _Broken((6, 4), [((0, 0), torch.zeros(2, 4))])
    bad.mode = mode
    with pytest.raises(TypeError, match=r"state_dict\['x.y'\]") as e:
        plan_local({"x": {"y": bad}})
    assert needle in str(e.value)


def test_chunk_outside_the_global_size_is_refused():
    with pytest.raises(TypeError, match="does not lie inside its global size"):
        checkpointable_items("w", ChunkedTensor((2, 4), [((1, 0), torch.zeros(2, 4))]))


def test_megatron_checkpointable_tensors_are_planned():
    mapping = pytest.importorskip("megatron.core.dist_checkpointing.mapping", reason="megatron-core not installed")
    from megatron.core.dist_checkpointing.strategies.checkpointable import (
        CheckpointableShardedTensor,
        LocalShardsContainer,
    )

    def shard(offset):
        return CheckpointableShardedTensor.from_sh_ten(mapping.ShardedTensor.from_rank_offsets(
            "w", torch.full((2, 4), float(offset)), (0, offset, 3)))

    plan = plan_local({"one": shard(1), "many": LocalShardsContainer([shard(0), shard(2)])})
    assert [(s.fqn, s.offsets, s.global_size) for s in plan.specs] == [
        ("many", (0, 0), (6, 4)), ("many", (4, 0), (6, 4)), ("one", (2, 0), (6, 4))]
    assert torch.equal(plan.values[("many", (4, 0))], torch.full((2, 4), 2.0))
