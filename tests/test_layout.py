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

    chunks = _dim0_chunks(11008, 4096, 512)
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


# -- the columnar global plan decides exactly what the per-item functions decide -------------

def _engine(world):
    from benchmarks.scale import _fake_engine

    return _fake_engine(world, 1)


def _gathered(per_rank_specs, staged=None, prewritten=None):
    from solosave._engine import plan_payload

    out = []
    for r, specs in enumerate(per_rank_specs):
        keys = [s.key for s in (staged[r] if staged else specs)]
        out.append(plan_payload(specs, keys, {s.fqn: (s.fqn,) for s in specs},
                                prewritten[r] if prewritten else None, [], 1))
    return out


def _per_item(gathered):
    from solosave._plan import unpack_specs

    return [(("specs", [s.compact() for s in unpack_specs(g[0])]),) + tuple(g[1:]) for g in gathered]


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
        grows = world // gcols
        specs.append(ItemSpec("grid", ItemKind.TENSOR, (gr, gc), (1, 1), (grows, gcols), "bfloat16", 2))
        for i, n in enumerate((64, 64, 8, 1000)):
            specs.append(ItemSpec(f"rep{i}", ItemKind.TENSOR, (0,), (n,), (n,), "float32", 4 * n))
        specs.append(ItemSpec("scalar", ItemKind.TENSOR, (), (), (), "int64", 8))
        specs += [ItemSpec("opt.step", ItemKind.BYTES), ItemSpec(f"rank{r}.extra", ItemKind.BYTES)]
        ranks.append(sorted(specs, key=lambda s: s.fqn))
    return ranks


@pytest.mark.parametrize("world", [1, 2, 3, 8, 40])
def test_columnar_global_plan_equals_per_item(world):
    import pickle

    from solosave._layout import plan_from_columns

    ranks = _scenario(world)
    gathered = _gathered(ranks)
    assert plan_from_columns([g[0] for g in gathered], [g[1] for g in gathered]) is not None  # the fast path
    fast, slow = _engine(world), _engine(world)
    a = fast._global_plan(gathered)
    b = slow._global_plan(_per_item(gathered))
    assert a[0][0] == "ok", a[0]
    assert a == b
    assert pickle.dumps(fast.cache.state_dict_metadata, protocol=2) == \
        pickle.dumps(slow.cache.state_dict_metadata, protocol=2)
    assert list(fast.cache.state_dict_metadata) == list(slow.cache.state_dict_metadata)
    # every item written exactly once; replicated ones spread
    written = [ranks[r][i].key for r, d in enumerate(a) for i in d[1]]
    assert len(written) == len(set(written)) == len({s.key for specs in ranks for s in specs})
    # the same plan again: validated on both paths
    assert fast._global_plan(gathered)[0][3] and slow._global_plan(_per_item(gathered))[0][3]


def test_columnar_global_plan_partial_staging_and_prewritten():
    ranks = _scenario(4)
    staged = [[s for s in specs if not (s.fqn.startswith("rep") and r % 2)] for r, specs in enumerate(ranks)]
    g = _gathered(ranks, staged)
    assert _engine(4)._global_plan(g) == _engine(4)._global_plan(_per_item(g))
    pre = [[(s.key, f"__{r}_0.distcp", 0, 1) for s in specs] for r, specs in enumerate(staged)]
    g = _gathered(ranks, staged, pre)  # a reuse fallback: the per-item path decides
    assert _engine(4)._global_plan(g)[0][0] == "ok"


@pytest.mark.parametrize("break_it, needle", [
    (lambda rs: rs[1].__setitem__(0, ItemSpec("emb", ItemKind.TENSOR, (5, 0), (5, 6), (10, 7), "float32", 1)), "emb"),
    (lambda rs: rs[1].__setitem__(0, ItemSpec("emb", ItemKind.BYTES)), "emb"),
    (lambda rs: rs[1].__setitem__(0, ItemSpec("emb", ItemKind.TENSOR, (4, 0), (6, 6), (10, 6), "float32", 1)), "emb"),
    (lambda rs: rs[1].__setitem__(0, ItemSpec("emb", ItemKind.TENSOR, (6, 0), (4, 6), (10, 6), "float32", 1)), "emb"),
    (lambda rs: rs[0].__setitem__(0, ItemSpec("emb", ItemKind.TENSOR, (0, 0), (5, 6), (10, 6), "float16", 1)), "emb"),
    (lambda rs: rs[1].__setitem__(0, ItemSpec("emb", ItemKind.TENSOR, (9, 0), (5, 6), (10, 6), "float32", 1)), "emb"),
    (lambda rs: rs[1].__setitem__(0, ItemSpec("emb", ItemKind.TENSOR, (-5, 0), (5, 6), (10, 6), "float32", 1)), "emb"),
])
def test_columnar_global_plan_errors_as_per_item(break_it, needle):
    ranks = [[s for s in specs if s.fqn == "emb"] + [s for s in specs if s.fqn != "emb"] for specs in _scenario(2)]
    break_it(ranks)
    g = _gathered(ranks)
    a, b = _engine(2)._global_plan(g), _engine(2)._global_plan(_per_item(g))
    assert a == b
    assert a[0][0] == "error" and needle in a[0][1]


def test_columnar_global_plan_nobody_staged():
    ranks = _scenario(2)
    staged = [[s for s in specs if s.fqn != "rep1"] for specs in ranks]
    g = _gathered(ranks, staged)
    a, b = _engine(2)._global_plan(g), _engine(2)._global_plan(_per_item(g))
    assert a == b and a[0][0] == "error" and "staged by no rank" in a[0][1]


def test_columnar_global_plan_mixed_integer_widths():
    from solosave._layout import plan_from_columns

    ranks = [[ItemSpec("a", ItemKind.TENSOR, (0,), (60,), (120,), "float32", 240)],
             [ItemSpec("a", ItemKind.TENSOR, (60,), (60,), (120,), "float32", 240),
              ItemSpec("big", ItemKind.TENSOR, (0,), (1 << 33,), (1 << 33,), "int8", 1 << 33)]]
    g = _gathered(ranks)
    assert {g[0][0][7].typecode, g[1][0][7].typecode} == {"b", "q"}
    assert plan_from_columns([x[0] for x in g], [x[1] for x in g]) is not None
    assert _engine(2)._global_plan(g) == _engine(2)._global_plan(_per_item(g))
