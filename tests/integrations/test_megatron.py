"""solosave.megatron with the real megatron-core 0.16.1 on 2 gloo ranks: a GPT-like sharded state
dict saved through ``dist_checkpointing.save`` and Megatron's own async queue; create, then
reuse saves of one 8-byte all_reduce (Megatron's own collectives counted apart); stock
``TorchDistLoadShardedStrategy`` loads them at the same and at another data-parallel size; a new
key falls back and publishes; a worker killed mid-save fails Megatron's finalisation on every
rank and publishes nothing; a second job, configured from Megatron-LM-style flags, reuses the
prepared file through Megatron's persistent async caller."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import subprocess
import sys

import pytest

from tests.support import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
needs_megatron = pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core not installed: "
                                    "pip install 'solosave[megatron]' (.ci/run installs it)")
pytestmark = pytest.mark.timeout(600)

ONE_ALL_REDUCE = {"all_reduce": {"count": 1, "bytes": 8}}


@pytest.fixture(scope="module")
def first_job(tmp_path_factory):
    """Job 1 on 2 ranks (tensor parallel 2): create, reuse x3, drift (a new key), reuse, sync."""
    if not HAVE_MEGATRON:
        pytest.skip("megatron-core not installed")
    from tests.integrations import megatron_fns

    root = str(tmp_path_factory.mktemp("megatron"))
    return root, run_ranks(megatron_fns.save_create_reuse_drift, 2, root, timeout=500)


@needs_megatron
def test_create_then_reuse_with_one_all_reduce(first_job):
    root, per_rank = first_job
    for saves in per_rank:
        assert [s["mode"] for s in saves] == ["create", "reuse", "reuse", "reuse", "reuse+fallback", "reuse",
                                              "reuse"]
        create, steady = saves[0], saves[1:4]
        assert "gather_object" in create["solosave"]  # the collective path, once
        assert create["megatron_in_save"]["all_gather_object"] == 1  # Megatron's sharding validation
        for s in steady:
            assert s["solosave"] == ONE_ALL_REDUCE  # in solosave's worker, on its own gloo group
            assert s["megatron_in_save"] == {}  # the trainer runs no collective while saving
            # Megatron's own: one all_reduce per poll of its queue, an all_reduce(MAX) and a barrier
            assert s["megatron_after"] == {"all_reduce": s["polls"] + 1, "barrier": 1}
        sync = saves[6]
        assert sync["published"] and sync["solosave"] == ONE_ALL_REDUCE
        assert sync["megatron_in_save"] == {"barrier": 2}  # execute_sync's and metadata.json's
    with open(f"{root}/iter_4/metadata.json") as f:
        assert json.load(f)["sharded_backend"] == "torch_dist"  # what stock loading looks for
    with open(f"{root}/iter_4/.metadata", "rb") as f:
        sdm = pickle.load(f).state_dict_metadata
    qkv = sdm["decoder.layers.self_attention.linear_qkv.weight"]  # layers x TP shards, as Megatron writes them
    assert list(qkv.size) == [2, 24, 8]
    assert sorted((list(c.offsets), list(c.sizes)) for c in qkv.chunks) == [
        ([layer, row, 0], [1, 12, 8]) for layer in (0, 1) for row in (0, 12)]
    assert type(sdm["rng_state/shard_0_1"]).__name__ == "BytesStorageMetadata"


@needs_megatron
def test_stock_megatron_load_at_the_same_and_another_parallelism(first_job):
    from tests.integrations import megatron_fns

    root, _ = first_job
    assert run_ranks(megatron_fns.load_stock, 2, root, 4, 2, timeout=300) == [9, 9]  # TP 2, DP 1
    assert run_ranks(megatron_fns.load_stock, 2, root, 4, 1, timeout=300) == [9, 9]  # TP 1, DP 2


@needs_megatron
def test_new_key_falls_back_and_publishes(first_job):
    from tests.integrations import megatron_fns

    root, per_rank = first_job
    drift = per_rank[0][4]
    assert drift["mode"] == "reuse+fallback" and "gather_object" in drift["solosave"]
    assert per_rank[0][5]["solosave"] == ONE_ALL_REDUCE  # the refreshed layout is reused
    assert run_ranks(megatron_fns.load_stock, 2, root, 5, 2, True, timeout=300) == [10, 10]


@needs_megatron
@pytest.mark.slow
def test_second_job_from_megatron_flags_reuses_through_the_persistent_caller(first_job):
    from tests.integrations import megatron_fns

    root, _ = first_job
    # Megatron's persistent worker (spawned by a rank, with its environment) calls
    # torch.cuda.set_device first: CPU no-ops in it too
    env = {"PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "tests", "integrations", "megatron_cpu"),
                                          os.path.join(ROOT, "src"), ROOT, os.environ.get("PYTHONPATH", "")]),
           "SOLOSAVE_TEST_MEGATRON_CPU": "1"}
    per_rank = run_ranks(megatron_fns.second_job_persistent, 2, root, timeout=500, env=env)
    for saves in per_rank:
        assert [s["mode"] for s in saves] == ["reuse", "reuse"]  # the first save of the job too
        assert all(s["solosave"] == ONE_ALL_REDUCE for s in saves)
    assert run_ranks(megatron_fns.load_stock, 2, root, 12, 2, True, timeout=300) == [10, 10]


@needs_megatron
def test_worker_killed_mid_save_fails_finalisation_on_every_rank(tmp_path):
    from tests.integrations import megatron_fns

    out = run_ranks(megatron_fns.worker_killed_mid_save, 2, str(tmp_path), 1, timeout=500)
    for rank, o in enumerate(out):
        assert o[1] == o[2] == "ok"
        assert o[3].startswith("WorkerDiedError" if rank == 1 else "CheckpointError"), o[3]
        assert o["published"] == {1: True, 2: True, 3: False}
        assert o["metadata_json"] == {1: True, 2: True, 3: False}  # Megatron's finalisation stopped


@needs_megatron
def test_a_value_one_rank_cannot_save_fails_finalisation_on_every_rank(tmp_path):
    from tests.integrations import megatron_fns

    out = run_ranks(megatron_fns.bad_value_on_one_rank, 2, str(tmp_path), timeout=500)
    for o in out:
        assert o[1] == "create" and o["published"] == {1: True, 2: False, 3: True}
    assert out[1][2].startswith("TypeError") and "cannot be serialized" in out[1][2]
    assert out[0][2].startswith("CheckpointError") and "rank 1" in out[0][2]
    assert out[0][3] == out[1][3]  # the next save works on every rank


@needs_megatron
def test_register_lasts_past_megatrons_own_lookup():
    from megatron.core.dist_checkpointing.strategies.base import StrategyAction, get_default_strategy

    from solosave.megatron import BACKEND, SolosaveSaveStrategy, register

    strategy = SolosaveSaveStrategy(prepared_metadata="p.metadata", create_prepared_metadata=True)
    assert register(strategy) == BACKEND == ("solosave", 1)
    get_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1)  # re-registers Megatron's own
    assert get_default_strategy(StrategyAction.SAVE_SHARDED, *BACKEND) is strategy
    assert (strategy.backend, strategy.version) == ("torch_dist", 1)  # what metadata.json records
    with pytest.raises(TypeError, match="SolosaveSaveStrategy"):
        register(object())


@needs_megatron
def test_megatron_flags_build_the_strategy_and_bad_values_name_the_flag():
    import argparse

    from solosave import megatron as solosave_megatron

    parser = argparse.ArgumentParser()
    parser.add_argument("--dist-ckpt-workers", type=int, default=1)  # Megatron-LM's own
    solosave_megatron.add_arguments(parser)
    args = parser.parse_args(["--ckpt-metadata", "p.metadata", "--ckpt-metadata-create", "--dist-ckpt-workers", "2"])
    o = solosave_megatron.strategy_from_args(args).options
    assert (o.prepared_metadata, o.create_prepared_metadata, o.workers) == ("p.metadata", True, 2)
    with pytest.raises(ValueError, match="--ckpt-metadata-create needs --ckpt-metadata"):
        solosave_megatron.strategy_from_args(parser.parse_args(["--ckpt-metadata-create"]))


def test_importing_solosave_never_imports_megatron_and_the_module_says_what_to_install():
    code = ("import sys, solosave\n"
            "assert not [m for m in sys.modules if m.split('.')[0] == 'megatron'], 'megatron imported'\n"
            "sys.modules['megatron'] = None  # as if megatron-core were not installed\n"
            "try:\n    import solosave.megatron\nexcept ImportError as e:\n    print(e)\n")
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'solosave[megatron]'" in out.stdout


@needs_megatron
def test_what_the_strategy_saves_of_a_sharded_state_dict():
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    from solosave._src.plan.local_plan import WholeValue, plan_local
    from solosave.megatron import MegatronShards, dcp_state_dict

    def layer(i, data):  # a stacked layer's shard: prepended layer axis
        return ShardedTensor.from_rank_offsets("layers.w", data, (0, i, 2), (1, 0, 2), prepend_axis_num=1)

    viewed = layer(1, torch.ones(3, 4))
    viewed.data = viewed.data.view(1, 3, 4)  # as Megatron's own torch_dist strategy leaves it
    sd = {"a": layer(0, torch.zeros(3, 4)), "b": viewed,
          "replica": ShardedTensor.from_rank_offsets("norm", torch.ones(4), replica_id=(0, 1, 0)),
          "obj": ShardedObject("rng", {"seed": 7}, (1,), (0,), replica_id=0)}
    out = dcp_state_dict(sd)
    assert sorted(out) == ["layers.w", "rng/shard_0_1"]  # the non-main replica is not saved
    assert isinstance(out["layers.w"], MegatronShards)
    assert isinstance(out["rng/shard_0_1"], WholeValue) and out["rng/shard_0_1"].value == [{"seed": 7}]
    specs = plan_local(out).specs
    assert [(s.fqn, s.offsets, s.sizes, s.global_size) for s in specs if s.fqn == "layers.w"] == [
        ("layers.w", (0, 0, 0), (1, 3, 4), (2, 6, 4)), ("layers.w", (1, 0, 0), (1, 3, 4), (2, 6, 4))]
    legacy = ShardedTensor.from_rank_offsets("old", torch.ones(4))
    legacy.flattened_range = slice(0, 2)
    with pytest.raises(TypeError, match="flattened_range"):
        dcp_state_dict({"old": legacy})
