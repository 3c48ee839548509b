"""Tests of ``solosave._src.plan.layout``: bucketing, the global Metadata from write results, the layout
guard of reuse saves."""

import pytest

from solosave._src.coordination.protocol import ItemKind, ItemSpec, PlacedItem
from solosave._src.core.errors import PlanValidationError
from solosave._src.plan.layout import bucket_items, check_layout
from tests.unit.plan.oracle import build_metadata, build_state_dict_metadata, finish_metadata


def t(fqn, n, offsets=(0,), size=None):
    size = size or (n // 4,)
    return ItemSpec(fqn, ItemKind.TENSOR, offsets, (n // 4,), size, "float32", n)


def b(fqn):
    return ItemSpec(fqn, ItemKind.BYTES)


def test_bucketing_is_deterministic_and_balanced():
    items = [t(f"t{i}", 400 * (i % 5 + 1)) for i in range(20)] + [b(f"b{i}") for i in range(5)]
    one = bucket_items(items, 3)
    two = bucket_items(list(reversed(items)), 3)
    assert one == two
    sizes = [sum(s.nbytes for s in bk) for bk in one]
    assert max(sizes) - min(sizes) <= 2000
    assert sorted(s.fqn for bk in one for s in bk) == sorted(s.fqn for s in items)
    for bk in one:  # bytes first, then tensors, each in key order
        kinds = [s.kind for s in bk]
        assert kinds == sorted(kinds, key=lambda k: k is ItemKind.TENSOR)


def test_bucketing_rejects_zero_workers():
    with pytest.raises(ValueError, match="workers"):
        bucket_items([], 0)


def _layout():
    return [PlacedItem(("a", None), "__0_0.distcp", 0, 512), PlacedItem(("w", (0,)), "__0_0.distcp", 512, 100),
            PlacedItem(("v", (0,)), "__0_0.distcp", 612, 100)]


def _written():
    return [(("a", None), "__0_0.distcp", 0, 512), (("w", (0,)), "__0_0.distcp", 512, 100),
            (("v", (0,)), "__0_0.distcp", 612, 100)]


def test_layout_guard_ok():
    assert check_layout(_layout(), _written()) == []


def test_layout_guard_ok_in_any_order():
    """The in-order comparison is only a shortcut: the same places reported in another order
    (a custom writer) are no drift either."""
    assert check_layout(_layout(), list(reversed(_written()))) == []
    assert check_layout(_layout(), [list(r) for r in _written()]) == []


def test_layout_guard_length_drift():
    w = _written()
    w[0] = (("a", None), "__0_0.distcp", 0, 1024)
    assert any("length 1024 != prepared 512" in d for d in check_layout(_layout(), w))


def test_layout_guard_offset_shift():
    w = _written()
    w[2] = (("v", (0,)), "__0_0.distcp", 700, 100)
    assert any("offset 700 != prepared 612" in d for d in check_layout(_layout(), w))


def test_layout_guard_absent_and_extra_item():
    w = _written()[:2] + [(("new", (0,)), "__0_0.distcp", 612, 100)]
    drifts = check_layout(_layout(), w)
    assert any(d.startswith("new") and "absent from the prepared" in d for d in drifts)
    assert any(d.startswith("v") and "not written" in d for d in drifts)


def test_layout_guard_last_item_removed():
    drifts = check_layout(_layout(), _written()[:-1])
    assert drifts == ["v: prepared in __0_0.distcp@612 but not written"]


def test_layout_guard_resharded_rank():
    w = [(("a", None), "__0_0.distcp", 0, 512), (("w", (5,)), "__0_0.distcp", 512, 50),
         (("v", (0,)), "__0_0.distcp", 562, 100)]
    drifts = check_layout(_layout(), w)
    assert any("w@[5]" in d for d in drifts) and any(d.startswith("w:") and "not written" in d for d in drifts)


def test_layout_guard_other_file():
    w = _written()
    w[1] = (("w", (0,)), "__0_1.distcp", 0, 100)
    assert any("prepared in __0_0.distcp" in d for d in check_layout(_layout(), w))


def test_build_metadata_shares_keys_with_chunks():
    specs = [ItemSpec("w", ItemKind.TENSOR, (r * 2,), (2,), (8,), "float32", 8) for r in range(4)]
    sdm = build_state_dict_metadata(specs)
    results = [(("w", (r * 2,)), f"__{r}_0.distcp", 0, 100) for r in range(4)]
    md = build_metadata(sdm, results, {"w": ("w",)})
    chunks = md.state_dict_metadata["w"].chunks
    for idx in md.storage_data:
        assert idx.offset is chunks[idx.index].offsets
        assert idx.fqn is next(iter(md.state_dict_metadata))


def test_results_that_do_not_cover_the_plan_are_refused():
    """The coordinator's check before it builds ``.metadata`` (``_results.placed_columns``, here its keyed reference; the
    oracle's ``finish_metadata`` refuses the same)."""
    from solosave._src.plan.columns import ChunkTable
    from tests.unit.plan.oracle import result_columns

    specs = [ItemSpec("w", ItemKind.TENSOR, (r * 2,), (2,), (8,), "float32", 8) for r in range(4)]
    sdm = build_state_dict_metadata(specs)
    results = [(("w", (r * 2,)), f"__{r}_0.distcp", 0, 100) for r in range(3)]
    twice = results + [(("w", (6,)), "__3_0.distcp", 0, 100), (("w", (6,)), "__3_0.distcp", 100, 100)]
    for rows, why in ((results, "w@\\[6\\] was not written"), (twice, "written 2 times")):
        with pytest.raises(PlanValidationError, match=why):
            result_columns(ChunkTable.from_metadata(sdm), sdm, [rows])
        with pytest.raises(PlanValidationError, match=why):
            finish_metadata(sdm, rows, {})
