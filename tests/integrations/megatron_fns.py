"""Rank functions of tests/integrations/test_megatron.py, with the real megatron-core 0.16.1 on
gloo ranks: a GPT-like sharded state dict saved through ``dist_checkpointing.save`` and
Megatron's ``AsyncCallsQueue`` by solosave's strategy, loaded by Megatron's stock strategy.

Megatron's ``dist_checkpointing`` calls ``torch.cuda.synchronize`` and
``torch.cuda.current_device`` unconditionally; :func:`cpu_megatron` replaces them with CPU
no-ops in these test processes only (never in the library)."""

from __future__ import annotations

import argparse
import os
import random
import signal
import time
from collections import Counter
from contextlib import contextmanager

import torch
import torch.distributed as dist

from solosave._src.testing.introspect import worker_pid
from tests.faults.fault_fns import FaultWriter
from tests.support import fresh, wait_until

VOCAB, HIDDEN, LAYERS = 16, 8, 2
COLLECTIVES = ("all_reduce", "barrier", "all_gather_object", "gather_object", "broadcast_object_list",
               "scatter_object_list", "all_gather", "broadcast", "reduce", "gather")


def cpu_megatron() -> None:
    """Megatron's two CUDA calls on its save path, as CPU no-ops (this test process only)."""
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


class DistCounter:
    """Counts the torch.distributed collectives this process calls (Megatron's own: the trainer
    process runs no collective of solosave's on a steady save)."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        for name in COLLECTIVES:
            original = getattr(dist, name)

            def counted(*args, _name=name, _original=original, **kwargs):
                self.calls[_name] += 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)

    @contextmanager
    def window(self, into: dict):
        before = Counter(self.calls)
        try:
            yield
        finally:
            into.update({k: v for k, v in (self.calls - before).items() if v})


def gpt_state_dict(rank: int, ws: int, tp: int, seed: int | None, extra_key: bool = False) -> dict:
    """A GPT-like sharded state dict at tensor parallel size ``tp`` and data parallel size
    ``ws // tp`` (rank = dp_rank * tp + tp_rank): embedding and output TP-sharded, replicated
    over DP; per-layer weights stacked on a prepended layer axis (several shards of one key per
    rank); layer norms replicated over TP and DP; Adam moments sharded over TP and DP (a
    distributed optimizer); the RNG state as a ShardedObject of the (only) pipeline stage;
    plain values (Megatron's common state). ``seed=None``: zeros, a load target."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    dp = ws // tp
    tp_rank, dp_rank = rank % tp, rank // tp

    def full(name, *shape):
        if seed is None:
            return torch.zeros(*shape)
        g = torch.Generator().manual_seed(seed * 1000 + sum(map(ord, name)))
        return torch.randn(*shape, generator=g)

    def tp_sharded(key, t, axis=0, replica=True):
        n = t.shape[axis] // tp
        local = t.narrow(axis, tp_rank * n, n).clone()
        return ShardedTensor.from_rank_offsets(key, local, (axis, tp_rank, tp),
                                               replica_id=(0, 0, dp_rank) if replica else 0)

    def moments(key, t):  # rows split over tp * dp: no replicas
        parts = tp * dp
        n = t.shape[0] // parts
        part = tp_rank * dp + dp_rank
        return ShardedTensor.from_rank_offsets(key, t[part * n:(part + 1) * n].clone(), (0, part, parts))

    emb, out = full("emb", VOCAB, HIDDEN), full("out", VOCAB, HIDDEN)
    sd: dict = {
        "model": {
            "embedding.word_embeddings.weight": tp_sharded("embedding.word_embeddings.weight", emb),
            "output_layer.weight": tp_sharded("output_layer.weight", out),
            "decoder.final_layernorm.weight": ShardedTensor.from_rank_offsets(
                "decoder.final_layernorm.weight", full("fln", HIDDEN), replica_id=(0, tp_rank, dp_rank)),
        },
        "optimizer": {
            "exp_avg.embedding": moments("optimizer.exp_avg.embedding.word_embeddings.weight", full("m1", VOCAB, HIDDEN)),
            "exp_avg_sq.embedding": moments("optimizer.exp_avg_sq.embedding.word_embeddings.weight",
                                            full("m2", VOCAB, HIDDEN).abs()),
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "step": 0 if seed is None else seed}],
        },
        "rng_state": ShardedObject("rng_state", [{"random": random.Random(seed or 0).getstate(),
                                                  "torch": full("rng", 4).to(torch.uint8)}],
                                   (1,), (0,), replica_id=rank),  # one per pipeline stage (here one)
        "iteration": 0 if seed is None else seed,
        "checkpoint_version": 3.0,
    }
    qkv, ln = full("qkv", LAYERS, 3 * HIDDEN, HIDDEN), full("ln", LAYERS, HIDDEN)
    layers = {}
    for layer in range(LAYERS):
        n = 3 * HIDDEN // tp
        layers[f"{layer}.self_attention.linear_qkv.weight"] = ShardedTensor.from_rank_offsets(
            "decoder.layers.self_attention.linear_qkv.weight", qkv[layer, tp_rank * n:(tp_rank + 1) * n].clone(),
            (0, layer, LAYERS), (1, tp_rank, tp), replica_id=(0, 0, dp_rank), prepend_axis_num=1)
        layers[f"{layer}.input_layernorm.weight"] = ShardedTensor.from_rank_offsets(
            "decoder.layers.input_layernorm.weight", ln[layer].clone(), (0, layer, LAYERS),
            replica_id=(0, tp_rank, dp_rank), prepend_axis_num=1)
    sd["model"]["decoder.layers"] = layers
    if extra_key:
        sd["model"]["extra.bias"] = tp_sharded("extra.bias", full("extra", VOCAB))
    return sd


def _finalize_all(queue, timeout: float = 120.0) -> int:
    """Poll Megatron's queue (every rank, as a training loop does each iteration) until its
    calls are finalised; returns the number of polls."""
    polls = 0
    deadline = time.monotonic() + timeout
    while queue.get_num_unfinalized_calls():
        if time.monotonic() > deadline:
            raise TimeoutError("Megatron's async queue did not finalise in time")
        queue.maybe_finalize_async_calls(blocking=False)
        polls += 1
        time.sleep(0.02)
    return polls


def _save(strategy, queue, counter, sd, path, validate):
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)  # Megatron-LM's save_checkpoint makes the directory
    dist.barrier()
    staged, later = {}, {}
    with counter.window(staged):
        request = dist_checkpointing.save(sd, path, sharded_strategy=strategy, async_sharded_save=True,
                                          validate_access_integrity=validate)
    with counter.window(later):
        queue.schedule_async_request(request)
        polls = _finalize_all(queue)
    r = strategy.last_result
    return {"mode": r.mode, "solosave": r.collectives("all"), "megatron_in_save": staged,
            "megatron_after": later, "polls": polls}


def _save_sync(strategy, counter, sd, path):
    """A synchronous save (``async_sharded_save=False``): published when ``save`` returns."""
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    calls: dict = {}
    with counter.window(calls):
        assert dist_checkpointing.save(sd, path, sharded_strategy=strategy, validate_access_integrity=False) is None
    r = strategy.last_result
    return {"mode": r.mode, "solosave": r.collectives("all"), "megatron_in_save": calls,
            "published": os.path.exists(f"{path}/.metadata")}


def save_create_reuse_drift(rank: int, ws: int, root: str) -> list:
    """A create save, three reuse saves of new values (Megatron's sharding validation off, as
    with --ckpt-assume-constant-structure), then a save with a new key (drift: the fallback
    publishes and refreshes the prepared file), a reuse of the refreshed layout, and a
    synchronous save."""
    cpu_megatron()
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from solosave.megatron import SolosaveSaveStrategy

    fresh(root)
    counter = DistCounter()
    strategy = SolosaveSaveStrategy(prepared_metadata=f"{root}/prepared.metadata", create_prepared_metadata=True,
                                    timeout=60)
    queue = AsyncCallsQueue()
    out = []
    with _closing(queue, strategy):
        for it in (1, 2, 3, 4):
            out.append(_save(strategy, queue, counter, gpt_state_dict(rank, ws, 2, it), f"{root}/iter_{it}", it == 1))
        for it in (5, 6):
            out.append(_save(strategy, queue, counter, gpt_state_dict(rank, ws, 2, it, extra_key=True),
                             f"{root}/iter_{it}", False))
        out.append(_save_sync(strategy, counter, gpt_state_dict(rank, ws, 2, 7, extra_key=True), f"{root}/iter_7"))
    return out


def load_stock(rank: int, ws: int, root: str, it: int, tp: int, extra_key: bool = False) -> int:
    """Load ``iter_<it>`` with Megatron's stock loading (``TorchDistLoadShardedStrategy``) at
    tensor parallel size ``tp`` (so data parallel size ``ws // tp``) into zeros; every value
    must equal what this rank would hold at that parallelism (tensors bit for bit, the objects'
    data, the common state). Returns the number of tensors compared."""
    cpu_megatron()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    loaded = dist_checkpointing.load(gpt_state_dict(rank, ws, tp, None, extra_key), f"{root}/iter_{it}",
                                     sharded_strategy=TorchDistLoadShardedStrategy())
    want, got = _flat(gpt_state_dict(rank, ws, tp, it, extra_key)), _flat(loaded)
    assert sorted(want) == sorted(got), (sorted(want), sorted(got))
    tensors = 0
    for key, w in want.items():
        if isinstance(w, ShardedTensor):
            assert torch.equal(got[key], w.data), key
            tensors += 1
        elif isinstance(w, ShardedObject):
            (g,), (x,) = got[key], w.data
            assert g["random"] == x["random"] and torch.equal(g["torch"], x["torch"]), key
        else:
            assert got[key] == w, (key, got[key], w)
    return tensors


def _flat(sd: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def worker_killed_mid_save(rank: int, ws: int, root: str, victim: int) -> dict:
    """iter_1 (create) and iter_2 (reuse) are published; during iter_3 the victim's solosave
    worker is SIGKILLed halfway through its file; Megatron's finalisation must fail on every
    rank and nothing of iter_3 may be published."""
    cpu_megatron()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from solosave.megatron import SolosaveSaveStrategy

    fresh(root)
    marker = f"{root}/marker"
    strategy = SolosaveSaveStrategy(prepared_metadata=f"{root}/prepared.metadata", create_prepared_metadata=True,
                                    timeout=30, writer=FaultWriter(victim, "iter_3", "block", marker))
    queue = AsyncCallsQueue()
    out: dict = {}
    for it in (1, 2, 3):
        path = f"{root}/iter_{it}"
        if rank == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        request = dist_checkpointing.save(gpt_state_dict(rank, ws, 2, it), path, sharded_strategy=strategy,
                                          async_sharded_save=True, validate_access_integrity=False)
        queue.schedule_async_request(request)
        if it == 3 and rank == victim:
            assert wait_until(lambda: os.path.exists(marker), 60)
            os.kill(worker_pid(strategy.checkpointer), signal.SIGKILL)
        try:
            _finalize_all(queue)
            out[it] = "ok"
        except Exception as e:  # noqa: BLE001 - the test looks at which one
            out[it] = f"{type(e).__name__}: {e}"
    dist.barrier()
    out["published"] = {it: os.path.exists(f"{root}/iter_{it}/.metadata") for it in (1, 2, 3)}
    out["metadata_json"] = {it: os.path.exists(f"{root}/iter_{it}/metadata.json") for it in (1, 2, 3)}
    strategy.close()
    return out


def second_job_persistent(rank: int, ws: int, root: str) -> list:
    """A second job, configured as Megatron-LM is, from its flags (``--ckpt-metadata FILE``,
    Megatron-LM's own ``--dist-ckpt-workers``): its first save reuses the prepared file of the
    first job; through Megatron's persistent async caller (the request is pickled to its spawned
    worker, which runs the wait there); the queue's close ends that worker."""
    cpu_megatron()
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from solosave import megatron as solosave_megatron

    parser = argparse.ArgumentParser()
    parser.add_argument("--dist-ckpt-workers", type=int, default=1)  # Megatron-LM's own flags
    parser.add_argument("--ckpt-assume-constant-structure", action="store_true")
    solosave_megatron.add_arguments(parser)
    args = parser.parse_args(["--ckpt-metadata", f"{root}/prepared.metadata", "--ckpt-timeout", "60"])
    strategy = solosave_megatron.strategy_from_args(args)
    queue = AsyncCallsQueue(persistent=True)
    counter = DistCounter()
    with _closing(queue, strategy):
        return [_save(strategy, queue, counter, gpt_state_dict(rank, ws, 2, it, extra_key=True),
                      f"{root}/iter_{it}", False) for it in (11, 12)]


@contextmanager
def _closing(queue, strategy):
    """Close Megatron's queue and the strategy; after a failure, abort the queue instead (its
    blocking close would wait for a dead worker forever)."""
    try:
        yield
    except BaseException:
        queue.close(abort=True)
        strategy.close()
        raise
    queue.close()
    strategy.close()


def bad_value_on_one_rank(rank: int, ws: int, root: str) -> dict:
    """iter_2 holds, on rank 1 only, a ShardedObject that cannot be pickled: every rank's
    finalisation raises (rank 1 its own error, rank 0 the CheckpointError naming rank 1), nothing
    is published, and iter_3 saves normally (through the collective path, as after any failure)."""
    cpu_megatron()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from solosave.megatron import SolosaveSaveStrategy

    fresh(root)
    strategy = SolosaveSaveStrategy(prepared_metadata=f"{root}/prepared.metadata", create_prepared_metadata=True,
                                    timeout=60)
    queue = AsyncCallsQueue()
    out: dict = {}
    with _closing(queue, strategy):
        for it in (1, 2, 3):
            sd = gpt_state_dict(rank, ws, 2, it)
            if it == 2 and rank == 1:
                sd["bad"] = ShardedObject("bad", lambda: None, (2,), (rank,), replica_id=0)
            elif it == 2:
                sd["bad"] = ShardedObject("bad", 0, (2,), (rank,), replica_id=0)
            path = f"{root}/iter_{it}"
            if rank == 0:
                os.makedirs(path, exist_ok=True)
            dist.barrier()
            request = dist_checkpointing.save(sd, path, sharded_strategy=strategy, async_sharded_save=True,
                                              validate_access_integrity=False)
            queue.schedule_async_request(request)
            try:
                _finalize_all(queue)
                out[it] = strategy.last_result.mode
            except Exception as e:  # noqa: BLE001 - the test looks at which one
                out[it] = f"{type(e).__name__}: {e}"
    out["published"] = {it: os.path.exists(f"{root}/iter_{it}/.metadata") for it in (1, 2, 3)}
    return out
