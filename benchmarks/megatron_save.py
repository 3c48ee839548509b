"""The Megatron benchmark (``python -m benchmarks --only megatron``): megatron-core's own
``torch_dist`` async save strategy against solosave's, on the same sharded state dict.

One launch of W=2 local ranks (``benchmarks/ranks.run_ranks``, gloo on 127.0.0.1, CPU tensors;
needs megatron-core 0.16 and psutil: ``pip install 'solosave[megatron]'``). Megatron's save path
calls ``torch.cuda.synchronize`` and ``torch.cuda.current_device`` unconditionally: the rank
processes here replace them with CPU no-ops (this benchmark's processes only).

The state dict is GPT-like at tensor parallel size 2: per-layer weights stacked on a prepended
layer axis (several shards of one key per rank), TP-sharded embedding and output layer, layer
norms replicated over TP, Adam moments sharded over the ranks, the RNG state as a ShardedObject;
``total_mib`` MiB of fp32 over both ranks. Both strategies save it through
``dist_checkpointing.save(..., async_sharded_save=True)`` and Megatron's ``AsyncCallsQueue``
(its default, forking caller), as Megatron-LM does with ``--async-save``:

``megatron``  ``TorchDistSaveShardedStrategy`` with Megatron's cached plans
              (``use_cached_ckpt_structure``, what ``--ckpt-assume-constant-structure`` sets),
              one file per rank
``solosave``  ``solosave.megatron.SolosaveSaveStrategy`` with a prepared file (the first save
              creates it), one file per rank

The first save of each (sharding validation on, as Megatron-LM's first save) is reported apart;
the steady ones run with ``validate_access_integrity=False``. The methods take turns save by
save; each checkpoint is deleted (outside the timed window) before the next. Per save, after a
barrier, on the slowest rank:

* ``stall``: ``dist_checkpointing.save`` plus ``schedule_async_request``, the training loop's wait;
* ``published``: from the start until Megatron's queue has finalised the save (its files and
  ``.metadata`` complete, ``metadata.json`` written), polling the queue every ``poll_ms``, as a
  training loop polls it once per iteration;
* collectives: every ``torch.distributed`` call of the trainer process, split into those inside
  the stall, the queue's polls (one ``all_reduce`` each) and the rest (finalisation); for
  solosave also the ones of its worker (from its ``SaveResult``).

The last checkpoint of each strategy is loaded back with stock ``TorchDistLoadShardedStrategy``
and compared bit for bit (outside the timing).
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

from .ranks import run_ranks

Json = dict[str, Any]
MiB = 1 << 20
WORLD_SIZE = 2
TP = 2
METHODS = ("megatron", "solosave")
LABELS = {"megatron": "megatron-core torch_dist (cached plans)", "solosave": "solosave strategy (prepared)"}
_COLLECTIVES = ("all_reduce", "barrier", "all_gather_object", "gather_object", "broadcast_object_list",
                "scatter_object_list", "all_gather", "broadcast", "reduce", "gather", "scatter")


# ---------------------------------------------------------------------------------------------
# Rank-side code (spawned processes; module-level so that it pickles)
# ---------------------------------------------------------------------------------------------

def _cpu_megatron() -> None:
    import torch

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


class _Calls:
    """Counts this process's torch.distributed calls, by name, in named phases."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.total: Counter = Counter()
        for name in _COLLECTIVES:
            original = getattr(dist, name)

            def counted(*a: Any, _n: str = name, _f: Any = original, **k: Any) -> Any:
                self.total[_n] += 1
                return _f(*a, **k)

            setattr(dist, name, counted)

    def since(self, mark: Counter) -> dict[str, int]:
        return {k: v for k, v in (self.total - mark).items() if v}


def gpt_sharded_state_dict(rank: int, hidden: int, layers: int, seed: int) -> dict:
    """The benchmark's sharded state dict (see the module docstring) on ``rank`` of W=2, TP=2."""
    import random

    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    g = torch.Generator().manual_seed(seed * 7919 + rank)
    vocab = 4 * hidden

    def tp_rows(key: str, rows: int, cols: int, replica: Any = (0, 0, 0)) -> Any:
        n = rows // TP
        return ShardedTensor.from_rank_offsets(key, torch.randn(n, cols, generator=g), (0, rank, TP),
                                               replica_id=replica)

    sd: dict = {"embedding.word_embeddings.weight": tp_rows("embedding.word_embeddings.weight", vocab, hidden),
                "output_layer.weight": tp_rows("output_layer.weight", vocab, hidden),
                "decoder.final_layernorm.weight": ShardedTensor.from_rank_offsets(
                    "decoder.final_layernorm.weight", torch.ones(hidden), replica_id=(0, rank, 0))}
    for name, rows, cols in (("self_attention.linear_qkv.weight", 3 * hidden, hidden),
                             ("mlp.linear_fc1.weight", 4 * hidden, hidden),
                             ("mlp.linear_fc2.weight", hidden, 4 * hidden)):
        for layer in range(layers):
            n = rows // TP
            w = torch.randn(n, cols, generator=g)
            sd[f"decoder.layers.{layer}.{name}"] = ShardedTensor.from_rank_offsets(
                f"decoder.layers.{name}", w, (0, layer, layers), (1, rank, TP), prepend_axis_num=1)
            for moment in ("exp_avg", "exp_avg_sq"):
                sd[f"optimizer.{moment}.{layer}.{name}"] = ShardedTensor.from_rank_offsets(
                    f"optimizer.{moment}.decoder.layers.{name}", torch.randn(n, cols, generator=g).abs(),
                    (0, layer, layers), (1, rank, TP), prepend_axis_num=1)
    for layer in range(layers):
        sd[f"decoder.layers.{layer}.input_layernorm.weight"] = ShardedTensor.from_rank_offsets(
            "decoder.layers.input_layernorm.weight", torch.ones(hidden), (0, layer, layers),
            replica_id=(0, rank, 0), prepend_axis_num=1)
    sd["rng_state"] = ShardedObject("rng_state", [{"random": random.Random(seed).getstate()}], (1,), (0,),
                                    replica_id=rank)
    sd["iteration"] = seed
    return sd


def _strategy(method: str, root: str, timeout: float) -> Any:
    if method == "megatron":
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

        return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1, cached_metadata=True)
    from solosave.megatron import SolosaveSaveStrategy

    return SolosaveSaveStrategy(prepared_metadata=f"{root}/prepared.metadata", create_prepared_metadata=True,
                                timeout=timeout)


def _one_save(strategy: Any, queue: Any, calls: _Calls, sd: dict, path: str, validate: bool,
              poll_s: float, timeout: float) -> Json:
    """One timed save (every rank); returns this rank's times and collectives."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    mark = Counter(calls.total)
    t0 = time.perf_counter()
    request = dist_checkpointing.save(sd, path, sharded_strategy=strategy, async_sharded_save=True,
                                      validate_access_integrity=validate)
    queue.schedule_async_request(request)
    stall = time.perf_counter() - t0
    in_stall = calls.since(mark)
    mark = Counter(calls.total)
    polls = 0
    deadline = time.monotonic() + timeout
    while queue.get_num_unfinalized_calls():
        if time.monotonic() > deadline:
            raise TimeoutError(f"save to {path} not finalised within {timeout:g} s")
        time.sleep(poll_s)
        queue.maybe_finalize_async_calls(blocking=False)
        polls += 1
    published = time.perf_counter() - t0
    after = calls.since(mark)
    after["all_reduce"] = after.get("all_reduce", 0) - polls  # the queue's one per poll, apart
    worker: Json = {}
    result = getattr(strategy, "last_result", None)
    if result is not None:
        worker = {k: v["count"] for k, v in result.collectives("all").items()}
    return {"stall_s": stall, "published_s": published, "polls": polls, "in_stall": in_stall,
            "finalize": {k: v for k, v in after.items() if v}, "worker": worker,
            "mode": getattr(result, "mode", None)}


def _end_children() -> None:
    """Stop the processes this rank started through multiprocessing: Megatron's writer keeps a
    ``Manager`` server process that would outlive the rank (which ends with ``os._exit``)."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.terminate()
        child.join(5)


def rank_megatron(rank: int, world_size: int, cfg: Json) -> Json:
    import torch

    torch.set_num_threads(1)
    _cpu_megatron()
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    calls = _Calls()
    strategies = {m: _strategy(m, f"{cfg['root']}/{m}", cfg["timeout"]) for m in METHODS}
    queue = AsyncCallsQueue()
    saves: Json = {m: [] for m in METHODS}
    nbytes = 0
    try:
        for i in range(cfg["saves"] + 1):
            for m in METHODS:
                # a fresh state dict per save, as Megatron-LM builds one (its own strategy views
                # the data of stacked layers in place)
                sd = gpt_sharded_state_dict(rank, cfg["hidden"], cfg["layers"], i)
                nbytes = sum(v.data.numel() * 4 for v in sd.values() if hasattr(v, "local_shape"))
                path = f"{cfg['root']}/{m}/iter_{i}"
                saves[m].append(_one_save(strategies[m], queue, calls, sd, path, i == 0, cfg["poll_s"],
                                          cfg["timeout"]))
                dist.barrier()
                if i < cfg["saves"] and rank == 0:
                    shutil.rmtree(path, ignore_errors=True)
                dist.barrier()
    finally:
        queue.close()
        strategies["solosave"].close()
        _end_children()
    exact = {}
    for m in METHODS:
        target = gpt_sharded_state_dict(rank, cfg["hidden"], cfg["layers"], cfg["saves"])
        for v in target.values():
            if hasattr(v, "local_shape"):
                v.data.zero_()
        got = dist_checkpointing.load(target, f"{cfg['root']}/{m}/iter_{cfg['saves']}",
                                      sharded_strategy=TorchDistLoadShardedStrategy())
        want = gpt_sharded_state_dict(rank, cfg["hidden"], cfg["layers"], cfg["saves"])
        exact[m] = all(torch.equal(got[k], v.data) for k, v in want.items() if hasattr(v, "local_shape"))
    return {"rank": rank, "saves": saves, "exact": exact, "bytes": nbytes}


# ---------------------------------------------------------------------------------------------
# Driver, report
# ---------------------------------------------------------------------------------------------

def _size(total_mib: int) -> tuple[int, int]:
    """``(hidden, layers)`` of a model of about ``total_mib`` MiB of fp32 over both ranks (the
    weights and the two Adam moments of 4 layers, plus embedding and output)."""
    layers = 4
    per_hidden2 = (3 * layers * 12 + 2 * 4 * 2) * 4  # bytes per hidden^2 over both ranks
    hidden = max(16, int((total_mib * MiB / per_hidden2) ** 0.5) // 16 * 16)
    return hidden, layers


def run_megatron_bench(cfg: Json, out: Path, progress: Any) -> Json:
    """One launch at W=2; returns the ``megatron`` report section."""
    hidden, layers = _size(cfg["total_mib"])
    root = out / "megatron"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    progress.step(f"megatron: W={WORLD_SIZE}, TP={TP}, hidden {hidden}, {layers} layers, {cfg['saves']} saves each")
    res = run_ranks(rank_megatron, WORLD_SIZE, {**cfg, "root": str(root), "hidden": hidden, "layers": layers},
                    timeout=cfg["timeout"])
    shutil.rmtree(root, ignore_errors=True)
    methods: Json = {}
    for m in METHODS:
        def slowest(key: str, i: int, m: str = m) -> float:
            return max(r["saves"][m][i][key] for r in res)

        steady = range(1, cfg["saves"] + 1)
        s0 = res[0]["saves"][m]
        methods[m] = {
            "first_stall_ms": slowest("stall_s", 0) * 1e3, "first_published_s": slowest("published_s", 0),
            "stall_median_ms": statistics.median(slowest("stall_s", i) for i in steady) * 1e3,
            "stall_max_ms": max(slowest("stall_s", i) for i in steady) * 1e3,
            "published_median_ms": statistics.median(slowest("published_s", i) for i in steady) * 1e3,
            "polls_median": statistics.median(s0[i]["polls"] for i in steady),
            "steady": {k: s0[cfg["saves"]][k] for k in ("in_stall", "finalize", "worker", "mode")},
            "first": {k: s0[0][k] for k in ("in_stall", "finalize", "worker", "mode")},
        }
    return {"config": {**cfg, "hidden": hidden, "layers": layers, "world_size": WORLD_SIZE, "tp": TP},
            "bytes_total": sum(r["bytes"] for r in res), "methods": methods,
            "exact": {m: all(r["exact"][m] for r in res) for m in METHODS}}


def _calls(d: Json) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(d.items())) or "none"


def print_megatron(report: Json) -> None:
    c = report["config"]
    print(f"\n== Megatron dist_checkpointing async saves (W={c['world_size']}, TP={c['tp']}, "
          f"{report['bytes_total'] / MiB:.0f} MiB over both ranks, {c['saves']} steady saves each, slowest rank, "
          f"queue polled every {c['poll_s'] * 1e3:.0f} ms) ==")
    print(f"{'strategy':<42}{'stall med ms':>13}{'stall max ms':>13}{'published med ms':>17}"
          f"{'first stall ms':>15}{'first pub s':>12}")
    for m, e in report["methods"].items():
        print(f"{LABELS[m]:<42}{e['stall_median_ms']:>13.1f}{e['stall_max_ms']:>13.1f}{e['published_median_ms']:>17.1f}"
              f"{e['first_stall_ms']:>15.1f}{e['first_published_s']:>12.2f}")
    print("collectives per steady save (trainer: in the stall / at finalisation, besides the queue's one "
          "all_reduce per poll; solosave's worker):")
    for m, e in report["methods"].items():
        s = e["steady"]
        print(f"  {m:<9} stall: {_calls(s['in_stall'])}; finalisation: {_calls(s['finalize'])}; "
              f"worker: {_calls(s['worker'])}; polls (median) {e['polls_median']:g}")
    print(f"loaded back bit for bit by TorchDistLoadShardedStrategy: {report['exact']}")


def plot_megatron(report: Json, out_dir: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4))
    names = list(report["methods"])
    colors = ["tab:orange", "tab:blue"][:len(names)]
    for ax, key, label in ((axes[0], "stall_median_ms", "stall, ms"), (axes[1], "published_median_ms",
                                                                          "to published, ms")):
        ax.bar(range(len(names)), [report["methods"][m][key] for m in names], color=colors)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel(f"median {label} (lower is better)", fontsize=8)
    fig.suptitle(f"Megatron async saves, W=2, TP=2, {report['bytes_total'] / MiB:.0f} MiB", fontsize=10)
    fig.tight_layout()
    path = out_dir / "megatron.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
