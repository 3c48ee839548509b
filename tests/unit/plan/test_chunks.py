"""Tests of ``solosave._src.plan.chunks``: chunk tiling, at scale, errors naming the tensor."""

import time

import pytest

from solosave._src.coordination.protocol import ItemKind, ItemSpec
from solosave._src.plan.chunks import validate_chunks
from solosave._src.plan.layout import PlanValidationError
from tests.unit.plan.oracle import build_state_dict_metadata


def t(fqn, n, offsets=(0,), size=None):
    size = size or (n // 4,)
    return ItemSpec(fqn, ItemKind.TENSOR, offsets, (n // 4,), size, "float32", n)


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


def test_oracle_metadata_rejects_inconsistent_ranks():
    with pytest.raises(PlanValidationError, match="x"):
        build_state_dict_metadata([t("x", 16, size=(4,)), t("x", 16, offsets=(4,), size=(8,))])


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


def _best_of(fn, n=3):
    """The least CPU time of ``n`` calls, in this thread: time other processes take (tests run
    side by side under pytest-xdist) is not counted."""
    times = []
    for _ in range(n):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return min(times)


def test_empty_trailing_chunks_are_valid_and_the_sweep_is_not_quadratic():
    chunks = _dim0_chunks(11008, 4096, 512)
    assert validate_chunks("up", (11008, 4096), chunks) == []  # 501 non-empty, 11 empty chunks
    # the exact sweep on a wide tensor (dim 1 largest) grows like n log n, not n^2: 8x the
    # chunks costs well under 64x (a ratio measured in one run, not a wall-clock bound)
    from solosave._src.plan.chunks import sweep_chunks

    small, big = _dim0_chunks(4096, 11008, 512), _dim0_chunks(32768, 11008, 4096)
    assert sweep_chunks("down", (4096, 11008), small) == []
    assert sweep_chunks("down", (32768, 11008), big) == []
    ratio = _best_of(lambda: sweep_chunks("down", (32768, 11008), big)) / \
        _best_of(lambda: sweep_chunks("down", (4096, 11008), small))
    assert ratio < 32, ratio


def test_grid_sharding_with_overlap_found():
    chunks = [((i * 4, j * 4), (4, 4)) for i in range(8) for j in range(8)]
    assert validate_chunks("g", (32, 32), chunks) == []
    chunks[-1] = ((27, 28), (4, 4))
    errs = validate_chunks("g", (32, 32), chunks)
    assert any("overlap" in e for e in errs)


