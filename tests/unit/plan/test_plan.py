import pytest
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict as dcp_flatten

from solosave._src.plan.local_plan import ItemKind, flatten_state_dict, plan_local, serialize_bytes


def _sd():
    return {
        "model": {"w": torch.ones(2, 3), "b": torch.zeros(3)},
        "opt": {"state": {0: {"exp_avg": torch.ones(3), "step": 4}},
                "param_groups": [{"lr": 0.1, "params": [0, 1]}]},
        "lst": [torch.ones(1), 3, "x"],
        "plain_list": [1, 2, 3],
        "tup": (1, torch.ones(1)),
        "empty": {},
        "step": 7,
    }


def test_flatten_matches_dcp():
    ours, our_map = flatten_state_dict(_sd())
    theirs, their_map = dcp_flatten(_sd())
    assert list(ours) == list(theirs)
    assert our_map == their_map


def test_plan_local_kinds_and_hash_ignores_values():
    p1 = plan_local(_sd())
    kinds = {s.fqn: s.kind for s in p1.specs}
    assert kinds["model.w"] is ItemKind.TENSOR and kinds["step"] is ItemKind.BYTES
    assert kinds["plain_list"] is ItemKind.BYTES and kinds["lst.0"] is ItemKind.TENSOR
    sd = _sd()
    sd["model"]["w"].mul_(3)
    sd["step"] = 123456789
    assert plan_local(sd).structure_hash == p1.structure_hash
    sd["model"]["w"] = torch.ones(3, 3)
    assert plan_local(sd).structure_hash != p1.structure_hash
    w = p1.by_key[("model.w", (0, 0))]
    assert w.nbytes == 24 and w.global_size == (2, 3) and w.dtype == "float32"


@pytest.mark.parametrize("bad, needle", [
    (torch.ones(2).to_sparse(), "to_dense"),
    (torch.empty(2, device="meta"), "meta device"),
    (torch.nn.Linear(2, 2), "state_dict()"),
    (torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.quint8), "dequantize()"),
])
def test_unsupported_values_are_named(bad, needle):
    with pytest.raises(TypeError, match="x.y") as e:
        plan_local({"x": {"y": bad}})
    assert needle in str(e.value)


def test_unpicklable_value_error_names_key():
    with pytest.raises(TypeError, match=r"state_dict\['k'\].*cannot be serialized"):
        serialize_bytes("k", lambda: 1)


def test_state_dict_must_be_a_mapping():
    with pytest.raises(TypeError, match="must be a dict"):
        plan_local([torch.ones(1)])


def test_top_level_stateful_objects_are_saved_as_their_state_dict():
    class Loader:  # a dataloader-like Stateful object
        def __init__(self):
            self.pos = 7

        def state_dict(self):
            return {"pos": self.pos}

        def load_state_dict(self, sd):
            self.pos = sd["pos"]

    model = torch.nn.Linear(2, 3)
    plan = plan_local({"model": model, "loader": Loader(), "step": 1})
    assert sorted(s.fqn for s in plan.specs) == ["loader.pos", "model.bias", "model.weight", "step"]
    assert torch.equal(plan.values["model.weight"], model.weight.detach())
    assert plan.planner_data["loader.pos"] == ("loader", "pos")
