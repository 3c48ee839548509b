"""Tests of ``solosave._src.coordination.protocol``: columnar specs round-trip, the reuse status word."""

import itertools
import pickle
import random

import pytest

from solosave._src.coordination.packing import pack_specs
from solosave._src.coordination.protocol import (
    ItemKind,
    ItemSpec,
    PlanRequest,
    Status,
    decode_status,
    encode_status,
    save_identity,
)
from tests.unit.plan.oracle import unpack_specs


def test_pack_specs_roundtrip_and_narrow_columns():
    specs = [ItemSpec("a", ItemKind.TENSOR, (0, 4), (4, 4), (8, 8), "float32", 64),
             ItemSpec("b", ItemKind.BYTES),
             ItemSpec("c", ItemKind.TENSOR, (), (), (), "bfloat16", 2),
             ItemSpec("d", ItemKind.TENSOR, (1 << 40,), (3,), ((1 << 40) + 3,), "int64", (1 << 33))]
    packed = pack_specs(specs)
    assert unpack_specs(packed) == specs
    assert packed.kinds == bytes([0, 1, 0, 0]) and packed.dtype_table == ["float32", None, "bfloat16", "int64"]
    assert packed.numbers.typecode == "q" and pack_specs(specs[:3]).numbers.typecode == "b"
    assert unpack_specs(pack_specs([])) == []
    # a message survives pickling as its own named type
    req = PlanRequest(save_identity(3, "/d"), packed, None, {}, None, [])
    back = pickle.loads(pickle.dumps(req))
    assert back == req and type(back.specs).__name__ == "PackedSpecs"


def test_irregular_specs_are_an_internal_error():
    with pytest.raises(ValueError, match="internal"):
        pack_specs([ItemSpec("e", ItemKind.TENSOR, (0,), (2, 2), (4, 4), "float32", 16)])


def test_status_word_agrees_like_min_and_exposes_mixed_saves():
    """AND of the ranks' words is MIN of their statuses when they run the same save, and every
    rank sees it when any rank runs another save."""
    rng = random.Random(0)
    for _ in range(100):
        seq, d = rng.getrandbits(20), f"/ckpt/{rng.getrandbits(32)}"
        ident = save_identity(seq, d)
        for combo in itertools.product(Status, repeat=3):
            word = encode_status(combo[0], ident) & encode_status(combo[1], ident) & encode_status(combo[2], ident)
            assert decode_status(word, ident) == min(combo)
        for other in (save_identity(seq + 1, d), save_identity(seq, d + "x")):
            if other == ident:
                continue
            for s1, s2 in itertools.product(Status, repeat=2):
                word = encode_status(s1, ident) & encode_status(s2, other)
                assert decode_status(word, ident) is None and decode_status(word, other) is None


def test_an_aborted_save_is_a_wildcard_on_the_directory_only():
    ident, wild = save_identity(7, "/ckpt/a"), save_identity(7, None)
    word = encode_status(Status.OK, ident) & encode_status(Status.FAILED, wild)
    assert decode_status(word, ident) == Status.FAILED and decode_status(word, wild) == Status.FAILED
    both_wild = encode_status(Status.FAILED, wild) & encode_status(Status.FAILED, wild)
    assert decode_status(both_wild, wild) == Status.FAILED
    # two different directories are still seen, by the wildcard rank too
    word = encode_status(Status.OK, ident) & encode_status(Status.OK, save_identity(7, "/ckpt/b")) \
        & encode_status(Status.FAILED, wild)
    assert decode_status(word, ident) is None and decode_status(word, wild) is None
    # another sequence number is never hidden by a wildcard
    assert decode_status(encode_status(Status.OK, ident) & encode_status(Status.FAILED, save_identity(8, None)),
                         ident) is None
    # a directory that is not valid UTF-8 (a byte escaped by the file-system encoding) works
    odd = save_identity(1, b"/ckpt/\xff".decode("utf-8", "surrogateescape"))
    assert decode_status(encode_status(Status.OK, odd), odd) == Status.OK


def test_same_save_as_the_planning_gather_checks_it():
    from solosave._src.coordination.status import same_save

    a, b = save_identity(3, "/c/a"), save_identity(3, "/c/b")
    assert same_save([a, a, save_identity(3, None)])
    assert not same_save([a, b]) and not same_save([a, b, save_identity(3, None)])
    assert not same_save([a, save_identity(4, "/c/a")]) and not same_save([a, save_identity(4, None)])


def _job(seq, items, held, reuse, planner_data, directory="d"):
    from solosave._src.coordination.protocol import Mode, SaveJob, StagedSave

    return SaveJob(seq=seq, directory=f"{directory}{seq}", mode=Mode.REUSE,
                   staged=StagedSave("shm:x", 4096, items), held=held, planner_data=planner_data, reuse=reuse)


def test_a_job_of_an_unchanged_structure_travels_as_a_small_delta():
    from solosave._src.coordination.protocol import (
        ItemKind,
        ItemSpec,
        JobDelta,
        ReusePlan,
        StagedItem,
        compact_job,
        expand_job,
    )

    specs = [ItemSpec(f"t{i}", ItemKind.TENSOR, (0,), (8,), (8,), "float32", 32) for i in range(200)]
    bspec = ItemSpec("step", ItemKind.BYTES)
    tensors = tuple(StagedItem(s, 64 * i) for i, s in enumerate(specs))
    held, reuse, pdata = tuple(specs) + (bspec,), ReusePlan(()), {"step": ("step",)}
    first = _job(1, tensors + (StagedItem(bspec, -1, b"one"),), held, reuse, pdata)
    second = _job(2, tensors + (StagedItem(bspec, -1, b"two"),), held, reuse, pdata)
    assert compact_job(None, first) is first
    delta = compact_job(first, second)
    assert isinstance(delta, JobDelta) and delta.payloads == ((200, b"two"),)
    assert len(pickle.dumps(delta)) * 10 < len(pickle.dumps(second))
    back = expand_job(pickle.loads(pickle.dumps(first)), pickle.loads(pickle.dumps(delta)))
    assert back.seq == 2 and back.directory == "d2" and back.staged.items[-1].payload == b"two"
    assert [it.spec.fqn for it in back.staged.items] == [it.spec.fqn for it in second.staged.items]
    assert len(back.held) == len(held) and back.planner_data == pdata


def test_a_changed_structure_or_an_abort_travels_whole():
    from solosave._src.coordination.protocol import ItemKind, ItemSpec, ReusePlan, StagedItem, compact_job

    s = ItemSpec("t", ItemKind.TENSOR, (0,), (8,), (8,), "float32", 32)
    items, held, reuse, pdata = (StagedItem(s, 0),), (s,), ReusePlan(()), {}
    first = _job(1, items, held, reuse, pdata)
    whole = _job(2, items, (s,), reuse, pdata)
    assert compact_job(first, whole) is whole
    other = _job(2, (StagedItem(s, 64),), held, reuse, pdata)
    assert compact_job(first, other) is other
    import dataclasses

    aborted = dataclasses.replace(_job(2, items, held, reuse, pdata), abort="boom")
    assert compact_job(first, aborted) is aborted
