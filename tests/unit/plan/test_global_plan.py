"""Tests of ``solosave._src.plan.global_plan`` (in one process, no collectives): the columnar planner
decides exactly what the per-item oracle (``tests/unit/plan/oracle.py``) decides, and words its errors."""

import pickle
from array import array

import pytest

from solosave._src.coordination.packing import narrow, pack_specs, written_columns
from solosave._src.coordination.protocol import ItemKind, ItemSpec, PlanRequest, save_identity
from solosave._src.core.errors import PlanValidationError
from solosave._src.plan.global_plan import global_plan
from tests.unit.plan.oracle import oracle_plan


def _requests(per_rank_specs, staged=None, prewritten=None):
    out = []
    for r, specs in enumerate(per_rank_specs):
        positions = None
        if staged is not None:
            keys = {s.key for s in staged[r]}
            positions = narrow(array("q", [i for i, s in enumerate(specs) if s.key in keys]))
        out.append(PlanRequest(save_identity(1, "d"), pack_specs(specs), positions,
                               {s.fqn: (s.fqn,) for s in specs},
                               written_columns([s.key for s in specs], prewritten[r]) if prewritten else None, []))
    return out


def _scenario(world):
    """1-D sharded tensors with empty trailing chunks, a 2-D grid, replicated tensors of
    several sizes, a 0-d tensor and bytes items."""
    ranks = []
    for r in range(world):
        specs = []
        for name, rows, cols in (("emb", 10, 6), ("w", world + 3, 4), ("tiny", 2, 3)):
            chunk = -(-rows // world)
            start = min(r * chunk, rows)
            size = max(0, min(chunk, rows - start))
            specs.append(ItemSpec(name, ItemKind.TENSOR, (start, 0), (size, cols), (rows, cols), "float32",
                                  4 * size * cols))
        gr, gc = divmod(r, 2) if world % 2 == 0 else (r, 0)
        gcols = 2 if world % 2 == 0 else 1
        specs.append(ItemSpec("grid", ItemKind.TENSOR, (gr, gc), (1, 1), (world // gcols, gcols), "bfloat16", 2))
        for i, n in enumerate((64, 64, 8, 1000)):
            specs.append(ItemSpec(f"rep{i}", ItemKind.TENSOR, (0,), (n,), (n,), "float32", 4 * n))
        specs.append(ItemSpec("scalar", ItemKind.TENSOR, (), (), (), "int64", 8))
        specs += [ItemSpec("opt.step", ItemKind.BYTES), ItemSpec(f"rank{r}.extra", ItemKind.BYTES)]
        ranks.append(sorted(specs, key=lambda s: s.fqn))
    return ranks


@pytest.mark.parametrize("world", [1, 2, 3, 8, 40])
def test_columnar_plan_equals_oracle(world):
    ranks = _scenario(world)
    reqs = _requests(ranks)
    plan = global_plan(reqs)
    sdm, writes = oracle_plan(reqs)
    assert plan.writes == writes
    assert list(plan.state_dict_metadata) == list(sdm)
    assert pickle.dumps(plan.state_dict_metadata, protocol=2) == pickle.dumps(sdm, protocol=2)
    written = [ranks[r][i].key for r, w in enumerate(plan.writes) for i in w]
    assert len(written) == len(set(written)) == len({s.key for specs in ranks for s in specs})
    assert not plan.skip_write
    # replicated tensors are spread over the ranks that hold them
    if world > 1:
        assert len({r for r, w in enumerate(plan.writes) for i in w if ranks[r][i].fqn.startswith("rep")}) > 1


def test_partial_staging_and_a_fallback_keeps_prewritten_writers():
    ranks = _scenario(4)
    staged = [[s for s in specs if not (s.fqn.startswith("rep") and r % 2)] for r, specs in enumerate(ranks)]
    reqs = _requests(ranks, staged)
    plan = global_plan(reqs)
    assert (plan.state_dict_metadata.keys(), plan.writes) == (oracle_plan(reqs)[0].keys(), oracle_plan(reqs)[1])
    # a reuse fallback: rank 2 already wrote every replicated item; the plan keeps it as writer
    pre = [[] for _ in range(4)]
    pre[2] = [(s.key, "__2_0.distcp", 0, 1) for s in staged[2] if s.fqn.startswith("rep")]
    reqs = _requests(ranks, staged, pre)
    plan = global_plan(reqs)
    assert plan.writes == oracle_plan(reqs)[1]
    assert {ranks[2][i].fqn for i in plan.writes[2] if ranks[2][i].fqn.startswith("rep")} == \
        {"rep0", "rep1", "rep2", "rep3"}
    assert not plan.skip_write  # the other ranks' pre-written files do not match their assignment


def test_skip_write_when_every_rank_prewrote_its_assignment():
    ranks = _scenario(2)
    first = global_plan(_requests(ranks))
    pre = [[(ranks[r][i].key, f"__{r}_0.distcp", 0, 1) for i in w] for r, w in enumerate(first.writes)]
    again = global_plan(_requests(ranks, None, pre))
    assert again.skip_write and again.writes == first.writes


@pytest.mark.parametrize("break_it, needle", [
    (lambda rs: rs[1].__setitem__(0, ItemSpec("emb", ItemKind.TENSOR, (5, 0), (5, 6), (10, 7), "float32", 1)),
     "'emb' has size [10, 6] float32 on one rank and [10, 7] float32 on another"),
    (lambda rs: rs[1].__setitem__(0, ItemSpec("emb", ItemKind.BYTES)),
     "'emb' is a tensor on some ranks and a non-tensor on others"),
    (lambda rs: rs[1].__setitem__(0, ItemSpec("emb", ItemKind.TENSOR, (4, 0), (6, 6), (10, 6), "float32", 1)),
     "'emb': chunks at [0, 0] and [4, 0] overlap"),
    (lambda rs: rs[1].__setitem__(0, ItemSpec("emb", ItemKind.TENSOR, (6, 0), (4, 6), (10, 6), "float32", 1)),
     "'emb': chunks cover 54 of 60 elements (a gap)"),
    (lambda rs: rs[0].__setitem__(0, ItemSpec("emb", ItemKind.TENSOR, (0, 0), (5, 6), (10, 6), "float16", 1)),
     "'emb' has size [10, 6] float16 on one rank and [10, 6] float32 on another"),
    (lambda rs: rs[1].__setitem__(0, ItemSpec("emb", ItemKind.TENSOR, (9, 0), (5, 6), (10, 6), "float32", 1)),
     "'emb': chunk at [9, 0] of size [5, 6] lies outside the tensor of size [10, 6]"),
    (lambda rs: rs[1].__setitem__(0, ItemSpec("emb", ItemKind.TENSOR, (-5, 0), (5, 6), (10, 6), "float32", 1)),
     "'emb': chunk at [-5, 0] of size [5, 6] lies outside"),
    (lambda rs: rs[1].append(ItemSpec("emb", ItemKind.TENSOR, (0, 0), (4, 6), (10, 6), "float32", 1)),
     "'emb': the chunk at [0, 0] has size [5, 6] on one rank and [4, 6] on another"),
])
def test_errors_name_the_item_and_agree_with_the_oracle(break_it, needle):
    ranks = [[s for s in specs if s.fqn == "emb"] + [s for s in specs if s.fqn != "emb"] for specs in _scenario(2)]
    break_it(ranks)
    reqs = _requests(ranks)
    with pytest.raises(PlanValidationError) as got:
        global_plan(reqs)
    assert needle in str(got.value), str(got.value)
    assert "do not form one checkpoint" in str(got.value)
    with pytest.raises(PlanValidationError):
        oracle_plan(reqs)


def test_nobody_staged_names_the_items_and_says_what_happens_next():
    ranks = _scenario(2)
    staged = [[s for s in specs if s.fqn != "rep1"] for specs in ranks]
    with pytest.raises(PlanValidationError, match=r"1 item\(s\) were staged by no rank \(rep1\).*next save"):
        global_plan(_requests(ranks, staged))


def test_mixed_integer_widths_and_an_empty_plan():
    ranks = [[ItemSpec("a", ItemKind.TENSOR, (0,), (60,), (120,), "float32", 240)],
             [ItemSpec("a", ItemKind.TENSOR, (60,), (60,), (120,), "float32", 240),
              ItemSpec("big", ItemKind.TENSOR, (0,), (1 << 33,), (1 << 33,), "int8", 1 << 33)]]
    reqs = _requests(ranks)
    assert {reqs[0].specs.numbers.typecode, reqs[1].specs.numbers.typecode} == {"b", "q"}
    assert global_plan(reqs).writes == oracle_plan(reqs)[1] == [[0], [0, 1]]
    empty = global_plan(_requests([[], []]))
    assert empty.state_dict_metadata == {} and empty.writes == [[], []]
