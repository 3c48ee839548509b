"""The Lightning benchmark (``python -m benchmarks --only lightning``): sharded saves in ``fit``.

Two launches of W=2 local ranks (``benchmarks/ranks.run_ranks``, gloo on 127.0.0.1, CPU), one
per strategy, each a ``Trainer.fit`` of a stack of ``count`` bias-free ``Linear`` layers holding
``total_mib`` MiB of fp32 parameters over both ranks (FSDP2 through ``ModelParallelStrategy``,
AdamW: a checkpoint holds about three times that), with ``ModelCheckpoint(every_n_train_steps=K,
save_top_k=2)`` (older checkpoints are deleted, as in a real run):

``lightning``  Lightning's own ``ModelParallelStrategy``: DCP's synchronous save, then ``meta.pt``
``solosave``   ``solosave.lightning.ModelParallelStrategy``: an asynchronous solosave save (the
               first creates the prepared metadata in the checkpoint root, the others reuse it),
               ``meta.pt`` written after publication

Measured on every rank, for the saves after the first ``warmup`` (default 2: solosave's second
save waits for its first, which also waited for the workers' start; the first is reported apart):

* ``stall``: how much longer a saving step takes than the median step without a save (the
  interval between two ``on_train_batch_start`` calls, which holds the save of the step before);
* ``in save``: the time inside ``trainer.save_checkpoint`` (Lightning's ``dump_checkpoint``, the
  strategy's save, the Trainer's barrier), and the torch.distributed calls made there;
* ``published``: from entering ``trainer.save_checkpoint`` to ``.metadata`` in place (Lightning:
  when the call returns; solosave: its ``SaveResult``), and to ``meta.pt`` in place (rank 0; for
  solosave it is written when the strategy next collects the save, at the next step's start);
* ``setup``: from ``fit`` to the first batch (solosave starts its workers there).

Medians over saves, the slowest rank per save; the JSON holds every figure. Whether the
checkpoints load (bit for bit, by either strategy) is checked by ``tests/integrations/
test_lightning.py``, not here. Needs ``pip install 'solosave[lightning]'``; not part of ``all``.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

from .ranks import run_ranks

Json = dict[str, Any]
MiB = 1 << 20
WORLD_SIZE = 2
STRATEGIES = ("lightning", "solosave")
LABELS = {"lightning": "Lightning ModelParallelStrategy (DCP save)",
          "solosave": "solosave.lightning.ModelParallelStrategy"}


# ---------------------------------------------------------------------------------------------
# Rank-side code (spawned processes; module-level so that it pickles)
# ---------------------------------------------------------------------------------------------

def _module(width: int, layers: int) -> Any:
    import lightning.pytorch as pl
    import torch

    class Stack(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.layers, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.layers(torch.ones(1, width)).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return Stack()


class _Probe:
    """Times the steps and every ``trainer.save_checkpoint``, and counts the torch.distributed
    calls made inside it in the training thread."""

    def __init__(self, trainer: Any) -> None:
        from solosave._src.testing.dist_calls import DistCalls

        self.starts: list[float] = []
        self.saves: list[Json] = []
        calls = DistCalls()
        real_save = trainer.save_checkpoint

        def save_checkpoint(filepath: Any, *a: Any, **k: Any) -> None:
            t_wall, t0 = time.time(), time.perf_counter()
            with calls.counting() as seen:
                try:
                    real_save(filepath, *a, **k)
                finally:
                    self.saves.append({"path": os.fspath(filepath), "step": trainer.global_step, "t_wall": t_wall,
                                       "in_save_s": time.perf_counter() - t0, "calls": dict(seen)})

        trainer.save_checkpoint = save_checkpoint


def rank_lightning(rank: int, world_size: int, cfg: Json, which: str) -> Json:
    import lightning.pytorch as pl
    import torch

    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    root = f"{cfg['scratch']}/{which}"
    width = int((cfg["total_mib"] * MiB // 4 // cfg["count"]) ** 0.5)
    if which == "solosave":
        import solosave
        import solosave.lightning

        strategy = solosave.lightning.ModelParallelStrategy(
            data_parallel_size=world_size, tensor_parallel_size=1,
            options=solosave.CheckpointerOptions(timeout=cfg["timeout"]))
    else:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)

    class Marks(pl.Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            probe.starts.append(time.perf_counter())

    k = cfg["interval"]
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=f"{root}/ck", filename="{step}", every_n_train_steps=k,
                                        save_top_k=2, monitor="step", mode="max")
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=k * cfg["saves"] + 1,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Marks(), ckpt], default_root_dir=root)
    probe = _Probe(trainer)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(10_000, 1)), batch_size=1)
    t0 = time.perf_counter()
    trainer.fit(_module(width, cfg["count"]), data)
    out: Json = {"fit_s": time.perf_counter() - t0, "setup_s": probe.starts[0] - t0,
                 "intervals": [b - a for a, b in zip(probe.starts, probe.starts[1:])], "saves": probe.saves,
                 "param_bytes": width * width * 4 * cfg["count"] // world_size}
    if which == "solosave":
        out["results"] = [{"step": d.step, "mode": d.result.mode, "to_published_s": d.result.timings.to_published,
                           "collectives": d.result.collectives()} for d in strategy.saves if d.result is not None]
    if rank == 0:  # when each kept checkpoint became finished for Lightning (meta.pt in place)
        out["meta_after_s"] = {s["step"]: os.stat(Path(s["path"]) / "meta.pt").st_mtime - s["t_wall"]
                               for s in probe.saves if (Path(s["path"]) / "meta.pt").exists()}
    return out


# ---------------------------------------------------------------------------------------------
# Driver, report
# ---------------------------------------------------------------------------------------------

def _summary(res: list[Json], cfg: Json, which: str) -> Json:
    k, w = cfg["interval"], cfg["warmup"]
    n = len(res[0]["saves"])
    # interval i runs from the start of batch i to the start of batch i + 1: it holds the save
    # that follows step i + 1, which is a saving step when (i + 1) % k == 0
    saving = [i for i in range(len(res[0]["intervals"])) if (i + 1) % k == 0]
    plain = [max(r["intervals"][i] for r in res) for i in range(len(res[0]["intervals"])) if (i + 1) % k]
    base = statistics.median(plain)
    stall = [max(r["intervals"][i] for r in res) - base for i in saving]
    in_save = [max(r["saves"][j]["in_save_s"] for r in res) for j in range(n)]
    if which == "solosave":
        published = [max(r["results"][j]["to_published_s"] for r in res) for j in range(len(res[0]["results"]))]
        modes = [x["mode"] for x in res[0]["results"]]
        worker_collectives = res[0]["results"][-1]["collectives"]
    else:
        published, modes, worker_collectives = in_save, ["dcp"] * n, {}
    meta = res[0]["meta_after_s"]
    steady_meta = [v for s, v in sorted(meta.items()) if s > w * k]
    return {"step_ms": base * 1e3, "stall_ms": [s * 1e3 for s in stall], "in_save_ms": [s * 1e3 for s in in_save],
            "published_ms": [p * 1e3 for p in published], "meta_after_ms": {s: v * 1e3 for s, v in meta.items()},
            "stall_median_ms": statistics.median(stall[w:] or stall) * 1e3,
            "stall_max_ms": max(stall[w:] or stall) * 1e3,
            "in_save_median_ms": statistics.median(in_save[w:] or in_save) * 1e3,
            "published_median_ms": statistics.median(published[w:] or published) * 1e3,
            "meta_median_ms": statistics.median(steady_meta) * 1e3 if steady_meta else None,
            "first": {"stall_ms": stall[0] * 1e3, "published_ms": published[0] * 1e3, "mode": modes[0]},
            "modes": modes, "calls_in_save": res[0]["saves"][-1]["calls"], "worker_collectives": worker_collectives,
            "setup_s": max(r["setup_s"] for r in res), "fit_s": max(r["fit_s"] for r in res),
            "checkpoint_bytes_per_rank": 3 * res[0]["param_bytes"]}


def run_lightning_bench(cfg: Json, out: Path, progress: Any) -> Json:
    """One launch per strategy at W=2; returns the ``lightning`` report section."""
    cfg = {**cfg, "scratch": str(out / "lightning")}
    strategies: Json = {}
    for which in STRATEGIES:
        progress.step(f"lightning: {which}, W={WORLD_SIZE}, {cfg['total_mib']} MiB of parameters, "
                      f"{cfg['saves']} saves")
        res = run_ranks(rank_lightning, WORLD_SIZE, cfg, which, timeout=cfg["timeout"])
        strategies[which] = {**_summary(res, cfg, which), "ranks": res}
    return {"config": cfg, "world_size": WORLD_SIZE, "strategies": strategies}


def print_lightning(report: Json) -> None:
    c = report["config"]
    mb = report["strategies"]["solosave"]["checkpoint_bytes_per_rank"] * report["world_size"] / 1e6
    print(f"\n== Lightning fit, W={report['world_size']}: ModelParallelStrategy (FSDP2), {c['total_mib']} MiB of "
          f"parameters in {c['count']} layers + AdamW ({mb:.0f} MB per checkpoint), a save every "
          f"{c['interval']} steps, {c['saves']} saves (medians after the first {c['warmup']}; slowest rank) ==")
    print(f"{'strategy':<44}{'step ms':>8}{'stall ms':>10}{'max':>8}{'in save ms':>11}{'published':>10}"
          f"{'meta.pt':>9}{'first stall':>12}{'setup s':>8}")
    for which, e in report["strategies"].items():
        meta = "-" if e["meta_median_ms"] is None else f"{e['meta_median_ms']:.0f}"
        print(f"{LABELS[which]:<44}{e['step_ms']:>8.1f}{e['stall_median_ms']:>10.1f}{e['stall_max_ms']:>8.1f}"
              f"{e['in_save_median_ms']:>11.1f}{e['published_median_ms']:>10.0f}{meta:>9}"
              f"{e['first']['stall_ms']:>12.0f}{e['setup_s']:>8.1f}")
    for which, e in report["strategies"].items():
        calls = ", ".join(f"{k} x{v}" for k, v in sorted(e["calls_in_save"].items())) or "none"
        coll = ", ".join(f"{k} x{v['count']} ({v['bytes']} B)" for k, v in sorted(e["worker_collectives"].items()))
        print(f"{which}: torch.distributed calls in trainer.save_checkpoint (last save): {calls}"
              + (f"; solosave's worker per steady save: {coll}; modes {e['modes']}" if coll else ""))


def plot_lightning(report: Json, out_dir: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4))
    names = list(report["strategies"])
    labels = [LABELS[n].replace(" (", "\n(").replace("lightning.", "lightning.\n") for n in names]
    colors = ["tab:orange", "tab:blue"][:len(names)]
    for ax, key, title in ((axes[0], "stall_median_ms", "stall per saving step, ms"),
                           (axes[1], "published_median_ms", "save to .metadata published, ms")):
        ax.bar(range(len(names)), [report["strategies"][n][key] for n in names], color=colors)
        ax.set_xticks(range(len(names)), labels, fontsize=7)
        ax.set_title(title, fontsize=9)
    fig.suptitle(f"Lightning fit, W=2, {report['config']['total_mib']} MiB parameters + AdamW", fontsize=10)
    fig.tight_layout()
    path = out_dir / "lightning.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
