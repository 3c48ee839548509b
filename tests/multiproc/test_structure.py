"""The structure cache (``plan/structure.py``): an unchanged structure reuses its plan; any change
in keys, dtype, shape, device, layout or type plans again, with every check of planning."""

from __future__ import annotations

import pytest
import torch

from solosave._src.plan.local_plan import flatten_state_dict, plan_local
from solosave._src.plan.structure import StructureCache, walk


def _sd(n: int = 4) -> dict:
    return {"model": {f"l{i}.w": torch.randn(3, 2) for i in range(n)},
            "optim": {"state": {0: {"exp_avg": torch.zeros(3)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
            "nested": [torch.arange(3), "tail"], "step": 7}


def test_walk_gives_flatten_state_dicts_keys_and_values():
    sd = _sd()
    keys, values = walk(sd)
    flat, _ = flatten_state_dict(sd)
    assert keys == list(flat) and all(a is b for a, b in zip(values, flat.values()))


def test_an_unchanged_structure_reuses_the_plan_with_new_values():
    cache = StructureCache()
    first = cache.plan(_sd())
    second_sd = _sd()
    second = cache.plan(second_sd)
    assert cache.hits == 1 and second.specs is first.specs and second.by_key is first.by_key
    assert second.values["model.l0.w"] is second_sd["model"]["l0.w"]
    assert second.values["step"] == 7
    assert [s.fqn for s in second.specs] == [s.fqn for s in plan_local(second_sd).specs]


@pytest.mark.parametrize("change", [
    lambda sd: sd["model"].update({"l0.w": torch.randn(3, 2, dtype=torch.float64)}),
    lambda sd: sd["model"].update({"l0.w": torch.randn(4, 2)}),
    lambda sd: sd["model"].pop("l1.w"),
    lambda sd: sd.update({"extra": torch.ones(1)}),
    lambda sd: sd.update({"step": "seven"}),
    lambda sd: sd["model"].update({"l0.w": torch.randn(3, 2).to_sparse()}),
], ids=["dtype", "shape", "key removed", "key added", "type", "layout"])
def test_any_structural_change_plans_again(change):
    cache = StructureCache()
    first = cache.plan(_sd())
    sd = _sd()
    change(sd)
    if isinstance(sd["model"].get("l0.w"), torch.Tensor) and sd["model"]["l0.w"].is_sparse:
        with pytest.raises(TypeError, match="layout"):
            cache.plan(sd)
        return
    again = cache.plan(sd)
    assert cache.hits == 0 and again.specs is not first.specs
    assert [(s.fqn, s.dtype, s.sizes) for s in again.specs] == [(s.fqn, s.dtype, s.sizes) for s in plan_local(sd).specs]


def test_a_refused_value_is_refused_on_every_save():
    class Sub(torch.Tensor):
        pass

    cache = StructureCache()
    sd = {"x": torch.ones(2).as_subclass(Sub)}
    for _ in range(2):
        with pytest.raises(TypeError, match="subclass"):
            cache.plan(sd)


def test_stateful_top_level_values_are_taken_at_each_call():
    class Counter:
        def __init__(self) -> None:
            self.n = 0

        def state_dict(self) -> dict:
            return {"n": self.n, "t": torch.full((2,), float(self.n))}

        def load_state_dict(self, sd: dict) -> None:
            self.n = sd["n"]

    c = Counter()
    cache = StructureCache()
    cache.plan({"c": c})
    c.n = 5
    plan = cache.plan({"c": c})
    assert cache.hits == 1 and plan.values["c.n"] == 5 and plan.values["c.t"].tolist() == [5.0, 5.0]


@pytest.mark.timeout(120)
def test_dtensor_leaves_hit_the_cache_and_stage_their_local_shards():
    from tests.multiproc import rank_fns
    from tests.support import run_ranks

    for out in run_ranks(rank_fns.structure_of_dtensors, 2, timeout=100):
        assert out == {"hit": True, "same_bytes": True, "same_storage": True, "not_dtensor": True,
                       "placement_miss": True, "shape_miss": True, "dtype_miss": True,
                       "equal_spec_hit": True, "fallback": True}, out
