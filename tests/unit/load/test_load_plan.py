"""Whole reads (``load/whole_reads``): plain tensors of a checkpoint with a load index, read without
DCP's planner; everything else, and every planner that plans, resolves or commits on its own,
exactly as stock DCP loads it."""

import inspect

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan

import solosave
from solosave._src.load.load import SafeLoadPlanner
from tests.support import dcp_save_local, publish_with_index, zeros_like
from tests.unit.load.test_read import DTYPES, _same, _spy_reads, _state

NO_DIST = {"no_dist": True} if "no_dist" in inspect.signature(dcp.load).parameters else {}


@pytest.mark.parametrize("n", [5, 140_000], ids=["spans", "direct"])
def test_an_indexed_checkpoint_reads_its_plain_tensors_whole_and_bit_exact(tmp_path, monkeypatch, n):
    sd = _state(n)
    sd["nested"] = {"p": torch.nn.Parameter(torch.randn(7, 3)), "list": [torch.arange(4)]}
    ck = str(tmp_path / "ck")
    dcp_save_local(sd, checkpoint_id=ck)
    publish_with_index(ck)  # as a solosave save publishes it
    got = zeros_like(sd)
    got["nested"]["p"] = torch.nn.Parameter(torch.zeros(7, 3))
    got["m0"] = torch.zeros(3, 4, dtype=torch.float64)  # another dtype: converted, as DCP does
    versions = {k: v._version for k, v in got.items() if isinstance(v, torch.Tensor)}
    calls = _spy_reads(monkeypatch)
    solosave.load(got, ck)
    for k, v in sd.items():
        if k == "m0":
            assert torch.equal(got[k], v.double()), k
        elif k == "nested":
            assert _same(got[k]["p"].detach(), v["p"].detach()) and got[k]["p"].requires_grad
            assert _same(got[k]["list"][0], v["list"][0])
        elif k == "meta":
            assert got[k] == v
        else:
            assert _same(got[k], v), k
    assert all(got[k]._version > versions[k] for k in versions if got[k].numel())  # autograd sees the write
    (call,) = calls
    tensors = {k for k, v in sd.items() if isinstance(v, torch.Tensor)} | {"nested.p", "nested.list.0"}
    assert set(call["whole"]) == tensors and len(call["whole"]) == len(tensors)
    assert call["items"] and all(t == LoadItemType.BYTE_IO for _, t in call["items"])  # DCP planned the rest
    st = call["stats"]
    assert st.converted >= len(DTYPES) + 1 and st.general == 0  # transposed targets, m0
    if n > 5:
        assert st.direct >= len(DTYPES)


def test_whole_reads_keep_dcps_errors_and_custom_planners(tmp_path, monkeypatch):
    ck = str(tmp_path / "ck")
    sd = {"w": torch.randn(6, 4), "b": torch.randn(4)}
    dcp_save_local(sd, checkpoint_id=ck)
    publish_with_index(ck)
    calls = _spy_reads(monkeypatch)
    with pytest.raises(ValueError, match="Size mismatch between saved"):
        solosave.load({"w": torch.zeros(5, 4), "b": torch.zeros(4)}, ck)
    with pytest.raises(RuntimeError, match="Missing key in checkpoint state_dict: extra"):
        solosave.load({"w": torch.zeros(6, 4), "extra": torch.zeros(2)}, ck)

    class Shifting(SafeLoadPlanner):  # resolves tensors itself: every item goes through it
        def resolve_tensor(self, read_item):
            self.resolved = getattr(self, "resolved", 0) + 1
            return super().resolve_tensor(read_item)

    planner, got = Shifting(), {"w": torch.zeros(6, 4), "b": torch.zeros(4)}
    calls.clear()
    solosave.load(got, ck, planner=planner)
    assert torch.equal(got["w"], sd["w"]) and torch.equal(got["b"], sd["b"])
    assert calls[-1]["whole"] == [] and planner.resolved == 2


@pytest.mark.parametrize("planner", [SafeLoadPlanner, DefaultLoadPlanner])
def test_an_unflattened_planner_gets_its_non_tensor_values(tmp_path, planner):
    ck = str(tmp_path)
    sd = {"w": torch.randn(6, 4), "step": 7, "name": "abc"}
    dcp_save_local(sd, checkpoint_id=ck)
    publish_with_index(ck)
    got = {"w": torch.zeros(6, 4), "step": 0, "name": ""}
    solosave.load(got, ck, planner=planner(flatten_state_dict=False, flatten_sharded_tensors=False))
    assert torch.equal(got["w"], sd["w"]) and got["step"] == 7 and got["name"] == "abc"


class _Staging(SafeLoadPlanner):
    """Fills one reused buffer per item and copies it out in commit_tensor (DCP's contract:
    resolve, fill, commit, item by item)."""

    buf = None

    def resolve_tensor(self, read_item):
        dest = super().resolve_tensor(read_item)
        if self.buf is None or self.buf.numel() < dest.numel():
            self.buf = torch.empty(dest.numel(), dtype=dest.dtype)
        return self.buf[:dest.numel()].view(dest.shape)

    def commit_tensor(self, read_item, tensor):
        super().resolve_tensor(read_item).copy_(tensor)


@pytest.mark.parametrize("indexed", [False, True])
def test_a_planner_that_commits_gets_each_chunk_before_the_next_is_read(tmp_path, indexed):
    ck = str(tmp_path)
    sd = {f"w{i}": torch.full((200, 200), float(i)) for i in range(4)}  # 160 KB records: direct reads
    dcp_save_local(sd, checkpoint_id=ck)
    if indexed:
        publish_with_index(ck)
    got = {k: torch.zeros(200, 200) for k in sd}
    solosave.load(got, ck, planner=_Staging())
    assert {k: float(v[0, 0]) for k, v in got.items()} == {"w0": 0.0, "w1": 1.0, "w2": 2.0, "w3": 3.0}


class _SkipFrozen(SafeLoadPlanner):
    def finish_plan(self, new_plan):
        return LoadPlan([i for i in new_plan.items if i.dest_index.fqn != "frozen"])


class _SkipFrozenGlobal(SafeLoadPlanner):
    def create_global_plan(self, global_plan):
        return [LoadPlan([i for i in p.items if i.dest_index.fqn != "frozen"]) for p in global_plan]


@pytest.mark.parametrize("planner", [_SkipFrozen, _SkipFrozenGlobal, "instance"])
def test_planners_that_drop_items_or_override_a_step_on_the_instance_plan_every_item(tmp_path, planner):
    ck = str(tmp_path)
    sd = {"frozen": torch.randn(4, 4), "w": torch.randn(4, 4)}
    dcp_save_local(sd, checkpoint_id=ck)
    publish_with_index(ck)
    results = []
    for load in (lambda got, p: dcp.load(got, checkpoint_id=ck, planner=p, **NO_DIST),
                 lambda got, p: solosave.load(got, ck, planner=p)):
        seen = []
        if planner == "instance":
            p = SafeLoadPlanner()
            resolve = p.resolve_tensor
            p.resolve_tensor = lambda item, resolve=resolve: (seen.append(item.dest_index.fqn), resolve(item))[1]
        else:
            p = planner()
        got = {"frozen": torch.zeros(4, 4), "w": torch.zeros(4, 4)}
        load(got, p)
        results.append((bool(got["frozen"].any()), torch.equal(got["w"], sd["w"]), sorted(seen)))
    assert results[0] == results[1], results  # stock DCP, then solosave
    assert results[1] == ((True, True, ["frozen", "w"]) if planner == "instance" else (False, True, []))


@pytest.mark.parametrize("order", ["large-first", "small-first"])
def test_aliased_targets_end_as_stock_dcp_leaves_them(tmp_path, order):
    base = torch.randn(300, 200)
    if order == "large-first":  # "part" is a direct read too
        saved, view = {"full": base, "part": base[:100] + 5}, (lambda t: {"full": t, "part": t[:100]})
    else:  # "part" is a small record, decoded before the direct reads of the file
        saved, view = {"full": base, "part": base[:1] + 5}, (lambda t: {"part": t[:1], "full": t})
    ck = str(tmp_path)
    dcp_save_local(saved, checkpoint_id=ck)
    publish_with_index(ck)
    ends = []
    for load in (lambda got: dcp.load(got, checkpoint_id=ck, **NO_DIST), lambda got: solosave.load(got, ck),
                 lambda got: solosave.load(got, ck, use_index=False)):
        t = torch.zeros(300, 200)
        load(view(t))
        ends.append(t.clone())
    assert torch.equal(ends[0], ends[1]) and torch.equal(ends[0], ends[2])


@pytest.mark.timeout(150)
def test_dtensor_shards_at_the_sharding_they_were_saved_with_are_read_whole(tmp_path):
    from tests.multiproc import load_fns
    from tests.support import run_ranks

    for rank, out in enumerate(run_ranks(load_fns.same_sharding_loads, 2, str(tmp_path), timeout=120)):
        assert out["solosave"] and out["dcp"], (rank, out)
        # every DTensor (rows, columns, uneven, replicated) and the plain tensor; "step" is DCP's
        assert out["whole"] == ["a", "b", "c", "d", "i", "p", "r"], (rank, out["whole"])
        # six DTensors, five geometries ("c" and "d": (600, 256), Shard(0)): one chunk list each
        assert out["chunk_lists"] == 5, (rank, out["chunk_lists"])


@pytest.mark.timeout(150)
def test_a_partial_dtensor_is_left_to_dcps_planner(tmp_path):
    from tests.multiproc import load_fns
    from tests.support import run_ranks

    for rank, out in enumerate(run_ranks(load_fns.partial_dtensor_loads, 2, str(tmp_path), timeout=120)):
        assert out["solosave/True"] is None and out["dcp/True"] is None, (rank, out)  # its key is absent
        assert out["solosave/False"] == out["dcp/False"] and "Missing key" in out["dcp/False"], (rank, out)


def test_a_chunk_named_twice_in_the_metadata_is_left_to_dcps_planner(tmp_path, monkeypatch):
    import pickle

    ck = str(tmp_path)
    sd = {"z": torch.tensor(3.5), "a": torch.arange(6.0), "b": torch.arange(6.0) + 100}
    dcp_save_local(sd, checkpoint_id=ck)
    md = pickle.loads((tmp_path / ".metadata").read_bytes())
    md.state_dict_metadata["a"].chunks.append(md.state_dict_metadata["a"].chunks[0])  # a crafted duplicate
    publish_with_index(ck, md)
    calls = _spy_reads(monkeypatch)
    got = {k: torch.zeros_like(v) for k, v in sd.items()}
    solosave.load(got, ck)
    assert all(torch.equal(got[k], v) for k, v in sd.items())
    assert sorted(calls[-1]["whole"]) == ["b", "z"]
