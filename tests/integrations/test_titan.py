"""solosave.titan: the torchtitan checkpoint manager, with the real torchtitan package (2 ranks,
gloo): torchtitan's ModelWrapper, OptimizersContainer and LRSchedulersContainer, built from
their own configs; save, prune, resume bit for bit; the first save creates the prepared metadata
and every later save (in this job and the next) reuses it with one 8-byte all_reduce."""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from dataclasses import dataclass, field

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan not installed: pip install 'solosave[torchtitan]'")

from torchtitan.components.checkpointer import BaseCheckpointManager  # noqa: E402

from solosave.integrations import published_checkpoints, read_latest_marker  # noqa: E402
from solosave.titan import SolosaveCheckpointManager, checkpointer_options, prepared_metadata_path  # noqa: E402
from tests.support import assert_equal, run_ranks  # noqa: E402

Config = SolosaveCheckpointManager.Config
WORLD = 2
REUSE = {"all_reduce": {"count": 1, "bytes": 8}}


class Counter:
    """A Stateful stand-in for the trainer's train_state and for the dataloader's position."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


@dataclass
class Job:
    model: torch.nn.Module
    optimizers: object
    lr_schedulers: object
    train_state: Counter
    data: Counter
    manager: SolosaveCheckpointManager


def build(root: str, **config) -> Job:
    """A fresh model + torchtitan optimizer and LR scheduler containers + the manager."""
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = OptimizersContainer.Config(param_groups=[ParamGroupConfig(
        pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1})],
        implementation="for-loop").build(model_parts=[model])
    lrs = LRSchedulersContainer.Config(warmup_steps=3).build(optimizers=opt, training_steps=20)
    train_state, data = Counter(), Counter()
    cfg = Config(**{"enable": True, "folder": "ckpt", "interval": 2, "keep_latest_k": 2,
                    "last_save_model_only": False, "timeout": 120.0, **config})
    manager = cfg.build(dataloader=data, model_parts=[model], optimizers=opt, lr_schedulers=lrs,
                        states={"train_state": train_state}, sd_adapter=None, base_folder=root)
    return Job(model, opt, lrs, train_state, data, manager)


def train_until(job: Job, last: int, snapshots: dict[int, str], root: str, rank: int) -> None:
    """The trainer's loop: a step (replicated, as DDP does) and ``save`` after every step. The
    batch comes from the dataloader's position, so a resume that lost it would diverge."""
    import torch.distributed as dist
    import torch.nn.functional as F

    while job.train_state.n < last:
        job.train_state.n += 1
        g = torch.Generator().manual_seed(1000 + job.data.n)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        job.data.n += 1
        job.optimizers.zero_grad()
        F.mse_loss(job.model(x), y).backward()
        for p in job.model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        job.manager.maybe_wait_for_staging()
        job.optimizers.step()
        job.lr_schedulers.step()
        step = job.train_state.n
        if step in snapshots:
            torch.save(snapshot(job), snapshots[step].format(root=root, rank=rank))
        job.manager.save(step, last_step=step == last)


def snapshot(job: Job) -> dict:
    clone = lambda sd: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    return {"model": clone(job.model.state_dict()), "optim": clone(job.optimizers.state_dict()),
            "lr": job.lr_schedulers.state_dict(), "lr_now": [g["lr"] for o in job.optimizers for g in o.param_groups],
            "train_state": job.train_state.n, "data": job.data.n}


def saves(job: Job) -> list:
    return [(d.step, d.result.mode, d.result.collectives(), d.result.collectives("calling_thread"))
            for d in job.manager.results]


def run_job(rank, world_size, root, phase):
    """One job of the story told in ``test_save_prune_resume_bit_exactly``."""
    if phase == "first":  # a fresh start: train to step 8, saving every 2 steps, asynchronously
        job = build(root, async_mode="async")
        assert job.manager.load(step=-1) is False
        train_until(job, 8, {8: "{root}/first8-{rank}.pt"}, root, rank)
    elif phase == "resume":  # resume from step 6 (not the newest), synchronous saves, to step 10
        job = build(root, async_mode="disabled", load_step=6, persistent_worker=False)  # a thread writes
        assert job.manager.load(step=job.manager.config.load_step) is True and job.train_state.n == 6
        train_until(job, 10, {8: "{root}/resume8-{rank}.pt", 10: "{root}/resume10-{rank}.pt"}, root, rank)
    else:  # "latest": fresh objects load the newest checkpoint, then a model-only last save
        job = build(root, async_mode="async_with_pinned_mem", last_save_model_only=True,
                    export_dtype="bfloat16", persistent_worker=False)
        with pytest.raises(FileNotFoundError, match="load_step=4"):
            job.manager.load(step=4)  # pruned by keep_latest_k
        assert job.manager.load() is True
        torch.save(snapshot(job), f"{root}/latest-{rank}.pt")
        train_until(job, 11, {}, root, rank)
    job.manager.close()
    return saves(job)


def check_modes(results, first_mode):
    for per_rank in results:
        (_, mode0, _, calling0), *rest = per_rank
        assert mode0 == first_mode and calling0 == {}
        for step, mode, coll, calling in rest:
            assert (mode, coll, calling) == ("reuse", REUSE, {}), (step, mode, coll)


def load_snap(root, name):
    return [torch.load(f"{root}/{name}-{r}.pt", weights_only=True) for r in range(WORLD)]


@pytest.mark.timeout(400)
def test_save_prune_resume_bit_exactly(tmp_path):
    root = str(tmp_path)
    ckpt = os.path.join(root, "ckpt")
    prepared = os.path.join(ckpt, f"prepared-w{WORLD}-n1.metadata")

    first = run_ranks(run_job, WORLD, root, "first", timeout=150)
    assert [[s for s, *_ in r] for r in first] == [[2, 4, 6, 8]] * WORLD
    check_modes(first, "create")  # create once, then one 8-byte all_reduce per save
    assert os.path.isfile(prepared)
    assert [s for s, _ in published_checkpoints(ckpt)] == [6, 8]  # keep_latest_k=2
    assert read_latest_marker(ckpt) == "iter_0000008"

    resumed = run_ranks(run_job, WORLD, root, "resume", timeout=150)
    assert [[s for s, *_ in r] for r in resumed] == [[8, 10]] * WORLD
    check_modes(resumed, "reuse")  # a later job reuses the prepared file from its first save
    for a, b in zip(load_snap(root, "first8"), load_snap(root, "resume8")):
        assert_equal(a, b)  # steps 7-8 after resuming from 6 are bit-identical to the first run's
    assert [s for s, _ in published_checkpoints(ckpt)] == [8, 10]
    prepared_bytes = open(prepared, "rb").read()

    run_ranks(run_job, WORLD, root, "latest", timeout=150)
    for a, b in zip(load_snap(root, "resume10"), load_snap(root, "latest")):
        assert_equal(a, b)  # load_step=-1 into fresh objects: the newest checkpoint, exactly
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(os.path.join(ckpt, "iter_0000011")).read_metadata()
    assert set(md.state_dict_metadata) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert {m.properties.dtype for m in md.state_dict_metadata.values()} == {torch.bfloat16}
    assert open(prepared, "rb").read() == prepared_bytes  # the export did not replace it


# -- in one process ---------------------------------------------------------------------------

def test_config_maps_onto_solosave_options(tmp_path):
    c = Config(enable=True, workers=2, timeout=30.0, checksums=True, on_layout_drift="raise")
    assert prepared_metadata_path(c, "/ck", 8) == "/ck/prepared-w8-n2.metadata"
    o = checkpointer_options(c, prepared_metadata_path(c, "/ck", 8))
    assert (o.workers, o.timeout, o.checksums, o.on_layout_drift, o.create_prepared_metadata,
            o.prepared_metadata) == (2, 30.0, True, "raise", True, "/ck/prepared-w8-n2.metadata")
    assert prepared_metadata_path(Config(prepared_metadata="p.md"), "/ck", 8) == "/ck/p.md"
    assert prepared_metadata_path(Config(prepared_metadata="/abs/p.md"), "/ck", 8) == "/abs/p.md"
    none = Config(prepared_metadata=None)
    assert prepared_metadata_path(none, "/ck", 8) is None
    assert checkpointer_options(none, None).assume_constant_structure
    assert Config(async_mode="ASYNC").async_mode == "async"


def test_every_checkpointer_option_reaches_the_checkpointer():
    """The config declares every CheckpointerOptions field except the four it maps itself
    (derived from CheckpointerOptions, not copied by hand), and hands each one on."""
    from solosave import CheckpointerOptions
    from solosave._src.tools.framework import ADAPTER_SET

    changed = {"files_per_rank": 3, "worker": "thread", "on_layout_drift": "raise", "timeout": 5.0,
               "checksums": True, "staging_dir": "/tmp/stage", "stage_replicas": True,
               "storage_options": {"anon": True}, "durable_root": "/tmp/durable", "durable_every_save": True, "durable_retries": 4,
               "peer_copy": True,
               "peer_copies": 2, "ranks_per_host": 2, "hosts_per_domain": 4}
    names = {f.name for f in dataclasses.fields(CheckpointerOptions)} - ADAPTER_SET
    assert names == set(changed)  # a new option: add a value here; the config has it already
    o = checkpointer_options(Config(**changed), "/ck/p.md")
    assert {n: getattr(o, n) for n in names} == changed


@pytest.mark.parametrize("kwargs, needle", [
    ({"files_per_rank": 0}, "checkpoint.files_per_rank must be >= 1"),
    ({"workers": 0}, "checkpoint.files_per_rank must be >= 1"),  # the old name, an alias
    ({"worker": "fork"}, "checkpoint.worker must be one of"),
    ({"timeout": -1.0}, "checkpoint.timeout must be a positive number"),
    ({"on_layout_drift": "ignore"}, "checkpoint.on_layout_drift must be one of"),
    ({"async_mode": "sometimes"}, "checkpoint.async_mode must be one of"),
    ({"last_save_in_hf": True}, "Hugging Face"),
    ({"folder": "s3://bucket/ckpt"}, "local"),
    ({"keep_latest_k": 1}, "at least 2"),  # torchtitan's own rule, kept
])
def test_bad_config_names_the_field(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        Config(**kwargs)


@dataclass(kw_only=True, slots=True)
class TrainerLike:
    """torchtitan's Trainer.Config declares its ``checkpoint`` field so."""

    checkpoint: BaseCheckpointManager.Config = field(default_factory=BaseCheckpointManager.Config)


def test_selected_by_config_and_overridable_from_the_command_line():
    import tyro

    got = tyro.cli(TrainerLike, default=TrainerLike(checkpoint=Config(enable=True)), args=[
        "--checkpoint.interval", "7", "--checkpoint.workers", "3", "--checkpoint.async-mode", "disabled"])
    assert isinstance(got.checkpoint, Config)
    assert (got.checkpoint.interval, got.checkpoint.files_per_rank, got.checkpoint.async_mode) == (7, 3, "disabled")
    new = tyro.cli(TrainerLike, default=TrainerLike(checkpoint=Config(enable=True)),
                   args=["--checkpoint.files-per-rank", "2", "--checkpoint.worker", "thread"])
    assert (new.checkpoint.files_per_rank, new.checkpoint.worker) == (2, "thread")
    assert got.checkpoint._owner is SolosaveCheckpointManager  # what build() constructs


def test_disabled_manager_does_nothing():
    m = Config(enable=False).build(dataloader=None, model_parts=[torch.nn.Linear(2, 2)], optimizers=None,
                                   lr_schedulers=None, states={}, sd_adapter=None)
    assert m.save(10) is False and m.load() is False
    m.maybe_wait_for_saving()
    m.maybe_wait_for_staging()
    m.close()


def test_missing_torchtitan_names_the_extra(monkeypatch):
    for name in [n for n in sys.modules if n == "torchtitan" or n.startswith("torchtitan.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchtitan", None)  # import torchtitan now fails
    monkeypatch.delitem(sys.modules, "solosave.titan")
    with pytest.raises(ImportError, match=r"pip install 'solosave\[torchtitan\]'"):
        importlib.import_module("solosave.titan")
