"""Rank functions of ``test_lightning.py``: real Lightning Trainers on 2 gloo ranks (CPU).

The model's batches are a function of the global step and the rank only (not of the dataloader's
position), so a run resumed from a checkpoint takes exactly the steps the first run took, and its
state can be compared bit for bit."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from solosave._src.testing.dist_calls import DistCalls


def module_class(kind: str) -> type:
    import lightning.pytorch as pl

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))

        def configure_model(self) -> None:
            strategy = self.trainer.strategy
            if kind == "fsdp":  # Lightning cannot wrap FSDP1 on CPU itself: wrap it as a user would
                from torch.distributed.fsdp import FullyShardedDataParallel

                if not isinstance(self.net, FullyShardedDataParallel):
                    self.net = FullyShardedDataParallel(self.net, device_id=torch.device("cpu"),
                                                        device_mesh=strategy.device_mesh, use_orig_params=True)
            else:
                from torch.distributed.fsdp import fully_shard

                fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            g = torch.Generator().manual_seed(1000 * self.global_step + self.global_rank)
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, 0.5),
                                                       "interval": "step"}}

    return Net


def loader() -> Any:
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(400, 1)), batch_size=1)


def strategy(kind: str, **kw: Any) -> Any:
    """solosave's strategy of ``kind`` ('mp': ModelParallelStrategy, 'fsdp': FSDPStrategy), or
    Lightning's own ModelParallelStrategy ('stock')."""
    if kind == "stock":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=dist.get_world_size(), tensor_parallel_size=1)
    import solosave.lightning

    if kind == "fsdp":
        return solosave.lightning.FSDPStrategy(**kw)
    return solosave.lightning.ModelParallelStrategy(data_parallel_size=dist.get_world_size(), tensor_parallel_size=1,
                                                    **kw)


def trainer(root: str, strat: Any, max_steps: int, callbacks: list, checkpointing: bool = True) -> Any:
    import lightning.pytorch as pl

    return pl.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strat, max_steps=max_steps,
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=checkpointing, default_root_dir=root, callbacks=callbacks,
                      num_sanity_val_steps=0)


def local(t: Any) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def snapshot(trainer: Any) -> dict:
    """This rank's model shards, optimizer state, LR and loop position."""
    module = trainer.lightning_module
    opt = trainer.optimizers[0]
    return {"model": {k: local(v) for k, v in module.state_dict().items()},
            "optim": {i: {k: local(v) for k, v in s.items()} for i, s in enumerate(opt.state.values())},
            "lr": [g["lr"] for g in opt.param_groups],
            "sched": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
            "step": trainer.global_step}


def snapshot_at(steps: set[int], out: dict) -> Any:
    import lightning.pytorch as pl

    class Snap(pl.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step in steps:
                out[trainer.global_step] = snapshot(trainer)

    return Snap()


class CountCollectives:
    """Counts the torch.distributed calls made by ``trainer.save_checkpoint`` in the training thread."""

    def __init__(self, trainer: Any) -> None:
        self.per_save: list[dict[str, int]] = []
        calls = DistCalls()
        real = trainer.save_checkpoint

        def save_checkpoint(*args: Any, **kwargs: Any) -> None:
            with calls.counting() as seen:
                try:
                    real(*args, **kwargs)
                finally:
                    self.per_save.append(dict(seen))

        trainer.save_checkpoint = save_checkpoint


def fit_job(rank: int, world_size: int, root: str, kind: str, phase: str) -> dict:
    """``first``: train to step 8, ModelCheckpoint every 2 steps keeping the top 2 by step;
    ``resume``: fit(ckpt_path=step 6) to step 8 with the same callback; ``stock``: Lightning's own
    strategy restores the step-8 checkpoint (a fit with nothing left to do); ``reshard``: so does
    solosave's, at this world size."""
    os.environ["LOCAL_RANK"] = str(rank)
    import lightning.pytorch as pl

    snaps: dict = {}
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=f"{root}/ck", filename="{step}", every_n_train_steps=2,
                                        save_top_k=2, monitor="step", mode="max")
    # FSDP's first job also overlaps the staging copies with the next step (the strategy waits for
    # them before the optimizer step): its step-6 checkpoint must still resume bit for bit
    overlap = kind == "fsdp" and phase == "first"
    options = {} if phase == "stock" else {"options": _options(overlap_staging=overlap)}
    strat = strategy("stock" if phase == "stock" else kind, **options)
    t = trainer(root, strat, 8, [ckpt, snapshot_at({8}, snaps)])
    counter = CountCollectives(t)
    ckpt_path = None if phase == "first" else f"{root}/ck/step={6 if phase == 'resume' else 8}.ckpt"
    t.fit(module_class(kind)(), loader(), ckpt_path=ckpt_path)
    out: dict[str, Any] = {"in_save": counter.per_save}
    if phase in ("stock", "reshard"):
        snaps["restored"] = snapshot(t)
    else:
        out["saves"] = [(d.step, d.result.mode, d.result.collectives(), d.result.collectives("calling_thread"))
                        for d in strat.saves]
        out["checkpointer_closed"] = strat.checkpointer is None
    if phase == "first" and kind == "mp":  # after fit: the save is finished when the call returns
        from lightning.fabric.strategies.fsdp import _is_sharded_checkpoint

        out["in_save"] = list(out["in_save"])
        t.save_checkpoint(f"{root}/final.ckpt")
        out["final"] = (_is_sharded_checkpoint(Path(root) / "final.ckpt"), strat.checkpointer is None,
                        strat.saves[-1].result.mode)
    torch.save(snaps, f"{root}/{kind}-{phase}-{rank}.pt")
    return out


def _options(**kw: Any) -> Any:
    import solosave

    return solosave.CheckpointerOptions(timeout=60.0, **kw)


def faults_job(rank: int, world_size: int, root: str, victim: int) -> dict:
    """Saves by a callback at steps 2, 4, 6, 8: step 4's checkpoint is removed (as top-k does)
    while it is in flight; during step 6's the victim's worker is killed mid-write; step 8's save
    then raises on every rank and fit fails with it."""
    os.environ["LOCAL_RANK"] = str(rank)
    import lightning.pytorch as pl
    from lightning.fabric.strategies.fsdp import _is_sharded_checkpoint

    from solosave._src.testing.introspect import worker_pid
    from tests.faults.fault_fns import FaultWriter, wait_for_file

    marker = f"{root}/marker"
    seen: dict[str, Any] = {}

    class SaveEveryTwo(pl.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            step = trainer.global_step
            if step % 2:
                return
            path = f"{root}/c{step}"
            trainer.save_checkpoint(path)
            seen[f"c{step}_finished_after_save"] = _is_sharded_checkpoint(Path(path))
            if step == 4:
                trainer.strategy.remove_checkpoint(path)
                seen["c4_exists_after_remove"] = os.path.exists(path)
            if step == 6 and rank == victim:
                wait_for_file(marker)
                os.kill(worker_pid(trainer.strategy.checkpointer), signal.SIGKILL)

    # the save of c6 is written beside it (the third save: .c6.solosave-3), then put in place
    strat = strategy("mp", options=_options(), writer=FaultWriter(victim, ".c6.solosave-3", "block", marker))
    t = trainer(root, strat, 10, [SaveEveryTwo()], checkpointing=False)
    try:
        t.fit(module_class("mp")(), loader())
        seen["error"] = None
    except Exception as e:  # noqa: BLE001 - what the test inspects
        seen["error"] = (type(e).__name__, str(e), t.global_step)
    seen["finished"] = {name: _is_sharded_checkpoint(Path(f"{root}/{name}")) for name in ("c2", "c4", "c6")}
    seen["checkpointer_closed"] = strat.checkpointer is None
    try:
        strat.load_checkpoint(f"{root}/c6")
    except (ValueError, FileNotFoundError) as e:
        seen["load_c6"] = str(e)
    return seen


def last_ckpt_job(rank: int, world_size: int, root: str, phase: str) -> dict:
    """``save_last=True, save_top_k=0``: every save goes to ``last.ckpt``. ``kill``: the second
    save (step 4) blocks on rank 1 mid-write and every rank then SIGKILLs itself (the whole
    job dies mid-save); ``resume``: a new job fits from ``last.ckpt``, which still holds step 2."""
    os.environ["LOCAL_RANK"] = str(rank)
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.faults.fault_fns import FaultWriter, wait_for_file

    marker = f"{root}/marker"
    ckpt = ModelCheckpoint(dirpath=root, save_last=True, save_top_k=0, every_n_train_steps=2)
    out: dict[str, Any] = {}
    if phase == "kill":
        def die_when_blocked() -> None:  # a thread: the training thread may be waiting in the next save
            wait_for_file(marker)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=die_when_blocked, daemon=True).start()
        writer = FaultWriter(1, ".last.ckpt.solosave-2", "block", marker, block_s=120.0)
        t = trainer(root, strategy("mp", options=_options(), writer=writer), 40, [ckpt])
        t.fit(module_class("mp")(), loader())
        return {"survived": True}  # never reached: the job dies in its second save
    t = trainer(root, strategy("mp", options=_options()), 6, [ckpt, snapshot_at({2}, out)])
    t.fit(module_class("mp")(), loader(), ckpt_path=f"{root}/last.ckpt")
    return {"resumed_at": sorted(out), "step": t.global_step,
            "left_beside": sorted(n for n in os.listdir(root) if ".solosave-" in n)}
