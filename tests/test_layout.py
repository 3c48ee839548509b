import pytest

from solosave._layout import (
    PlacedItem,
    PlanValidationError,
    assign_writers,
    bucket_items,
    build_state_dict_metadata,
    check_layout,
    validate_chunks,
)
from solosave._plan import ItemKind, ItemSpec


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


def test_replicated_items_are_spread_and_singles_stay():
    rep = [t(f"r{i}", 4000) for i in range(8)]
    only1 = t("mine", 40)
    out = assign_writers([rep, rep + [only1]])
    assert only1 in out[1]
    assert len(out[0]) + len(out[1]) == 9
    assert abs(sum(s.nbytes for s in out[0]) - sum(s.nbytes for s in out[1])) <= 4040
    assert assign_writers([rep, rep + [only1]]) == out  # deterministic


def test_prefer_keeps_previous_writer():
    rep = [t(f"r{i}", 4000) for i in range(4)]
    out = assign_writers([rep, rep], prefer={r.key: 1 for r in rep})
    assert out[0] == [] and len(out[1]) == 4


@pytest.mark.parametrize("chunks, needle", [
    ([((0,), (4,)), ((6,), (4,))], "gap"),
    ([((0,), (6,)), ((4,), (6,))], "overlap"),
    ([((0,), (6,)), ((6,), (6,))], "outside"),
])
def test_validate_chunks_finds_gap_overlap_out_of_bounds(chunks, needle):
    errs = validate_chunks("layer.w", (10,), chunks)
    assert errs and needle in " ".join(errs) and "layer.w" in errs[0]


def test_validate_chunks_accepts_exact_2d_tiling():
    chunks = [((i * 2, j * 3), (2, 3)) for i in range(4) for j in range(2)]
    assert validate_chunks("w", (8, 6), chunks) == []


def test_global_metadata_rejects_inconsistent_ranks():
    with pytest.raises(PlanValidationError, match="x"):
        build_state_dict_metadata([t("x", 16, size=(4,)), t("x", 16, offsets=(4,), size=(8,))])


def _layout():
    return [PlacedItem(("a", None), "__0_0.distcp", 0, 512), PlacedItem(("w", (0,)), "__0_0.distcp", 512, 100),
            PlacedItem(("v", (0,)), "__0_0.distcp", 612, 100)]


def _written():
    return [(("a", None), "__0_0.distcp", 0, 512), (("w", (0,)), "__0_0.distcp", 512, 100),
            (("v", (0,)), "__0_0.distcp", 612, 100)]


def test_layout_guard_ok():
    assert check_layout(_layout(), _written()) == []


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


# -- validation at scale: O(n log n), errors name the tensor ----------------------------------

def _dim0_chunks(rows, cols, world):
    step = -(-rows // world)
    return [((min(r * step, rows), 0), (max(0, min(step, rows - r * step)), cols)) for r in range(world)]


@pytest.mark.parametrize("case, needle", [("gap", "gap"), ("overlap", "overlap"), ("outside", "outside")])
def test_wide_dim0_sharding_errors_name_the_tensor(case, needle):
    chunks = _dim0_chunks(4096, 11008, 64)  # a "wide" tensor: dim 1 is the largest
    if case == "gap":
        del chunks[10]
    elif case == "overlap":
        (o, s) = chunks[10]
        chunks[10] = ((o[0] - 3, 0), s)
        chunks[9] = (chunks[9][0], (chunks[9][1][0], 11008))
    else:
        chunks[-1] = (chunks[-1][0], (chunks[-1][1][0] + 1, 11008))
    errs = validate_chunks("layers.3.mlp.down_proj.weight", (4096, 11008), chunks)
    assert errs, case
    assert needle in " ".join(errs)
    assert all("layers.3.mlp.down_proj.weight" in e for e in errs)


def test_global_metadata_errors_name_the_tensor():
    specs = [ItemSpec("w", ItemKind.TENSOR, (r * 2, 0), (2, 8), (8, 8), "float32", 64) for r in range(4)]
    build_state_dict_metadata(specs)  # exact tiling: fine
    with pytest.raises(PlanValidationError, match="'w': chunks cover 48 of 64 elements"):
        build_state_dict_metadata(specs[:2] + specs[3:])
    shifted = specs[:3] + [ItemSpec("w", ItemKind.TENSOR, (5, 0), (2, 8), (8, 8), "float32", 64)]
    with pytest.raises(PlanValidationError, match="'w': chunks at .* overlap"):
        build_state_dict_metadata(shifted)
    outside = specs[:3] + [ItemSpec("w", ItemKind.TENSOR, (6, 0), (2, 9), (8, 8), "float32", 64)]
    with pytest.raises(PlanValidationError, match="'w': chunk at \\[6, 0\\] of size \\[2, 9\\] lies outside"):
        build_state_dict_metadata(outside)
    clash = specs + [ItemSpec("w", ItemKind.TENSOR, (0, 0), (3, 8), (8, 8), "float32", 64)]
    with pytest.raises(PlanValidationError, match="'w': the chunk at \\[0, 0\\] has size"):
        build_state_dict_metadata(clash)


def test_empty_trailing_chunks_are_valid_and_the_sweep_is_not_quadratic():
    import time

    chunks = _dim0_chunks(11008, 4096, 512) + _dim0_chunks(4096, 11008, 16384)[:0]
    assert validate_chunks("up", (11008, 4096), chunks) == []  # 501 non-empty, 11 empty chunks
    wide = _dim0_chunks(4096, 11008, 4096)
    t0 = time.perf_counter()
    assert validate_chunks("down", (4096, 11008), wide) == []
    assert time.perf_counter() - t0 < 0.5  # was a quadratic sweep along dim 1


def test_grid_sharding_with_overlap_found():
    chunks = [((i * 4, j * 4), (4, 4)) for i in range(8) for j in range(8)]
    assert validate_chunks("g", (32, 32), chunks) == []
    chunks[-1] = ((27, 28), (4, 4))
    errs = validate_chunks("g", (32, 32), chunks)
    assert any("overlap" in e for e in errs)


def test_build_metadata_shares_keys_with_chunks():
    from solosave._layout import build_metadata

    specs = [ItemSpec("w", ItemKind.TENSOR, (r * 2,), (2,), (8,), "float32", 8) for r in range(4)]
    sdm = build_state_dict_metadata(specs)
    results = [(("w", (r * 2,)), f"__{r}_0.distcp", 0, 100) for r in range(4)]
    md = build_metadata(sdm, results, {"w": ("w",)})
    chunks = md.state_dict_metadata["w"].chunks
    for idx in md.storage_data:
        assert idx.offset is chunks[idx.index].offsets
        assert idx.fqn is next(iter(md.state_dict_metadata))
