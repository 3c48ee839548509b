"""One rank of the demo job: a process forked by ``solosave train`` (``demo/launch.py``) or
started by torchrun / ``torch.distributed.run``.

Each rank, in order:

1. :func:`build` joins the gloo process group and builds the GPT (seeded by ``--seed``, the same
   on every rank) and AdamW, wrapped in DDP (``--parallel ddp``) or sharded with FSDP2
   ``fully_shard`` (``--parallel fsdp``: the checkpoint holds DTensor shards), and generates the
   corpus (:mod:`solosave.demo.data`);
2. :func:`resume` (``--load``) restores the newest published checkpoint - model, optimizer, step,
   data position and this rank's RNG state - so a resumed run continues the loss curve bit for bit;
3. :func:`checkpointing` (``--save``) opens a :class:`~solosave.integrations.CheckpointManager`;
4. :func:`loop` trains until ``--steps``, reading its batches at the data position, and saves every
   ``--save-interval`` steps and at the last step without waiting for the save;
5. :func:`drain` waits for the saves still in flight (also when the loop raised) and rank 0 prints
   the summary of the saves;
6. :func:`finish`: rank 0 verifies the last checkpoint, then every rank leaves the process group.

:func:`run_rank` runs them and turns a user-fixable error into one line and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import solosave
from solosave._src.core.errors import SolosaveError
from solosave._src.plan.local_plan import flatten_state_dict
from solosave._src.save.options import options_from_args, peer_ranks_per_host

from ..integrations import (
    CheckpointManager,
    PreemptionGuard,
    checkpointer_from_args,
    find_latest_checkpoint,
    find_restore_point,
)
from .data import batch_at, lr_at, make_corpus
from .model import make_model
from .report import Reporter


@dataclass
class RankState:
    """What one rank trains: ``train_model`` is the DDP wrapper of ``model`` or, under FSDP2,
    ``model`` itself (sharded in place)."""

    model: Any
    train_model: Any
    opt: Any
    corpus: Any
    rank: int
    world: int
    resumed_from: str | None = None  # the checkpoint directory resume() loaded, if any
    device: str = "cpu"
    #: The last save's handle until its staging is waited for (``--ckpt-overlap-staging``).
    staging: Any = None


def build(args: argparse.Namespace) -> RankState:
    """Join the process group; build the model, its data-parallel wrapping, AdamW and the corpus."""
    device = _join(args)
    torch.manual_seed(args.seed)
    model = make_model(args).to(device)
    if args.parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for blk in model.blocks:
            fully_shard(blk)
        fully_shard(model)
        train_model: torch.nn.Module = model
    else:
        train_model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(train_model.parameters(), lr=args.lr, weight_decay=0.01)
    return RankState(model, train_model, opt, make_corpus(args.vocab), dist.get_rank(), dist.get_world_size(),
                     device=str(device))


def _join(args: argparse.Namespace) -> torch.device:
    """Init the process group; the device this rank trains on. ``--device cuda``: NCCL when every
    local rank has a GPU of its own, else gloo with the ranks sharing the GPUs."""
    if args.device == "cpu":
        dist.init_process_group("gloo")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: this torch sees no CUDA device")
    local, n_local = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = torch.cuda.device_count()
    torch.cuda.set_device(local % gpus)
    dist.init_process_group("nccl" if n_local <= gpus else "gloo")
    return torch.device("cuda", local % gpus)


def state_dict(state: RankState, step: int, position: int) -> dict[str, Any]:
    """What a checkpoint holds: model, optimizer, step, data position and this rank's RNG state."""
    msd, osd = get_state_dict(state.train_model, state.opt)
    return {"model": msd, "optim": osd, "train": {"step": step, "data_position": position},
            "rng": {f"rank{state.rank}": torch.get_rng_state()}}


def _resume_point(args: argparse.Namespace) -> tuple[int, str] | None:
    """Rank 0 picks the newest published checkpoint under ``--load``; every rank gets its choice.
    With ``--ckpt-durable-root`` every rank takes part in the choice of the tier instead (and
    with ``--ckpt-peer-copies`` hosts that lost it get it back from their peers first)."""
    if args.durable_root:
        hosts = peer_ranks_per_host(options_from_args(args), dist.get_world_size())
        return find_restore_point(args.load, args.durable_root, storage_options=args.storage_options,
                                  ranks_per_host=hosts)
    choice = [find_latest_checkpoint(args.load, args.storage_options) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(choice, src=0)
    return choice[0]


def resume(args: argparse.Namespace, state: RankState) -> tuple[int, int]:
    """Load the newest published checkpoint under ``--load`` into ``state`` (and this rank's RNG);
    return ``(step, data position)`` to continue from: ``(0, 0)`` without one."""
    point = _resume_point(args) if args.load else None
    if args.load and point is None and state.rank == 0:
        print(f"no published checkpoint under {args.load}: starting from step 0", flush=True)
    if point is None:
        return 0, 0
    t0 = time.perf_counter()
    sd = state_dict(state, 0, 0)
    saved = solosave.load_prepared_metadata(point[1], storage_options=args.storage_options).metadata.state_dict_metadata
    own_rng = f"rng.rank{state.rank}" in saved
    if not own_rng:  # resumed at a larger world size: this rank has no RNG state in the checkpoint
        del sd["rng"]
    check_fits(sd, saved, point[1])
    t_load = time.perf_counter()
    fast = args.durable_root and os.path.dirname(os.path.normpath(point[1])) == os.path.normpath(args.load)
    hosts = peer_ranks_per_host(options_from_args(args), dist.get_world_size()) if fast else 0
    result = solosave.load(sd, point[1], storage_options=args.storage_options, ranks_per_host=hosts)
    t_load = time.perf_counter() - t_load
    set_state_dict(state.train_model, state.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    step, position = int(sd["train"]["step"]), int(sd["train"]["data_position"])
    if own_rng:
        torch.set_rng_state(sd["rng"][f"rank{state.rank}"])
    else:
        torch.manual_seed(args.seed * 1_000_003 + step * 1009 + state.rank)
    saved_world = sum(1 for k in saved if k.startswith("rng.rank"))
    if saved_world != state.world and state.rank == 0:
        print(f"resuming a checkpoint of {saved_world} ranks on {state.world}: the model, optimizer and "
              "data position carry over; ranks without a saved RNG state are re-seeded "
              "(the loss curve is not bit-identical to an uninterrupted run)", flush=True)
    state.resumed_from = point[1]
    if state.rank == 0:
        print(f"resumed from {point[1]} (step {step}) in {time.perf_counter() - t0:.2f} s "
              f"(solosave.load {t_load:.2f} s)", flush=True)
        print(f"load: {result.summary()}", flush=True)
    return step, position


def check_fits(sd: dict[str, Any], saved: dict[str, Any], path: str) -> None:
    """Raise ``ValueError`` (one line: the first difference, how many more, the fix) unless the
    checkpoint's entries ``saved`` hold every tensor of ``sd`` at its shape, and the checkpoint
    has no model entry that ``sd`` lacks (a deeper model's extra blocks would be dropped
    silently). Every rank finds the same: the model and the checkpoint are the same on all."""
    flat, _ = flatten_state_dict(sd)
    problems = []
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue
        md = saved.get(key)
        if not isinstance(md, TensorStorageMetadata):
            problems.append(f"{key} is {'not a tensor' if md is not None else 'missing'} there")
        elif tuple(md.size) != tuple(value.shape):
            problems.append(f"{key} has shape {list(md.size)} there, {list(value.shape)} in this model")
    problems += [f"{key} is there, not in this model" for key in saved
                 if key.startswith("model.") and key not in flat]
    if problems:
        more = f" (and {len(problems) - 1} more differences)" if len(problems) > 1 else ""
        raise ValueError(f"--load {path} was saved by another model: {problems[0]}{more}; resume with the "
                         "model flags of the run that saved it (--layers, --d-model, --heads, --vocab)")


def checkpointing(args: argparse.Namespace, state: RankState, reporter: Reporter) -> CheckpointManager | None:
    """The checkpoint manager the flags describe (``None`` without ``--save``); every rank. A local
    ``--save`` that cannot be created is refused here, before training, by every rank alike."""
    if not args.save:
        return None
    if "://" not in str(args.save):
        try:
            os.makedirs(args.save, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--save {args.save}: cannot create it ({e.strerror}); choose a writable "
                             "directory") from None
    ckpt = checkpointer_from_args(args, resumed_from=state.resumed_from)
    return CheckpointManager(args.save, ckpt, keep_last=args.keep_last, keep_every=args.keep_every,
                             durable_keep_last=args.durable_keep_last, async_save=args.async_save,
                             on_done=reporter.save_done)


def train_step(args: argparse.Namespace, state: RankState, step: int, position: int) -> float:
    """One optimizer step on this rank's batch at ``position``; returns the loss averaged over ranks."""
    for group in state.opt.param_groups:
        group["lr"] = lr_at(step, args)
    x, y = batch_at(state.corpus, position, state.rank, args.batch_size, args.seq_len)
    x, y = x.to(state.device), y.to(state.device)
    logits = state.train_model(x)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab), y.reshape(-1))
    state.opt.zero_grad(set_to_none=True)
    loss.backward()
    if state.staging is not None:  # overlapped staging: the copies ran during forward/backward
        state.staging.wait_staged()
        state.staging = None
    state.opt.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return float(mean) / state.world


def preemption_guard(args: argparse.Namespace) -> PreemptionGuard | None:
    """``--exit-signal-handler`` / ``--preemption-notice-file``: a SIGTERM or SIGINT on any rank,
    or the notice file appearing, makes every rank save the same next step and stop (every
    rank constructs it, right after the process group: collective). The ranks agree on a
    background thread (:class:`~solosave.integrations.PreemptionGuard`), not by a collective
    per step in the loop as Megatron's handler does."""
    if not (args.exit_signal_handler or args.preemption_notice_file):
        return None
    signals = (signal.SIGTERM, signal.SIGINT) if args.exit_signal_handler else ()
    return PreemptionGuard(signals=signals, notice_file=args.preemption_notice_file, interval=0.2,
                           timeout=min(args.timeout, 600.0))


def loop(args: argparse.Namespace, state: RankState, manager: CheckpointManager | None,
         reporter: Reporter, step: int, position: int, guard: PreemptionGuard | None = None) -> None:
    """Train from ``step`` to ``--steps``; save every ``--save-interval`` steps and at the last one,
    and (``guard``) once more at the step every rank agreed on after a preemption notice, then stop."""
    interval = args.save_interval or args.steps
    while step < args.steps:
        step += 1
        loss = train_step(args, state, step, position)
        position += args.batch_size * state.world
        reporter.step(step, loss)
        if manager is not None:
            manager.poll()
            if step % interval == 0 or step == args.steps:
                state.staging = manager.save(step, state_dict(state, step, position))
        if guard is not None and guard.stop_here(step, lambda s=step, p=position: state_dict(state, s, p)):
            state.staging = None  # the guard waited for the save's publication
            if state.rank == 0:
                o = guard.outcome
                if manager is None:
                    said = f"nothing to save at step {step} (no --save)"
                elif o is not None and o.published:
                    said = f"saved step {step}" + (f" ({o.error})" if o.error else "")
                else:
                    said = f"the save of step {step} failed ({o.error if o is not None else 'not reported'})"
                print(f"exit signal received: {said}, exiting", flush=True)
            return


def drain(manager: CheckpointManager | None, reporter: Reporter) -> int:
    """Wait for the saves in flight and close the manager; print the summary. Returns the number of
    failed saves."""
    failures = 0
    if manager is not None:
        manager.finish()
        failures = len(manager.failures)
    reporter.summary()
    return failures


def finish(state: RankState, manager: CheckpointManager | None, failures: int) -> int:
    """Rank 0 verifies the last published checkpoint; every rank leaves the process group.
    Returns the rank's exit status: 1 if a save failed or the verification found problems."""
    if state.rank == 0 and manager is not None and manager.done and manager.done[-1].result is not None:
        last = manager.done[-1].path
        report = solosave.verify_checkpoint(last, storage_options=manager.storage_options)
        print(f"verified {last}: {'ok' if report.ok else report.problems} "
              f"({report.records} records, checksums {report.checksums})", flush=True)
        failures += 0 if report.ok else 1
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failures else 0


@dataclass
class Progress:
    """How far a rank got: until ``training``, every rank meets the same errors (the flags, the
    model, the checkpoint it resumes and the checkpointer's set-up are the same on all)."""

    training: bool = False


def run_rank(args: argparse.Namespace, body: Any = None, grace: float = 10.0) -> int:
    """One rank of the job (``body(args, progress)``, default: the job). A user-fixable error
    (bad prepared metadata, an existing checkpoint, a checkpoint of another model, a bad flag)
    prints one line and returns 2, without a traceback: before training, every rank has the same
    error and rank 0 prints it; once training, the rank that raised it prints it, naming itself
    (another rank may not have it).

    Before training, a rank other than 0 waits up to ``grace`` seconds before it exits: its exit
    would make the launcher stop rank 0, perhaps before rank 0 met the error and said it. Rank 0's
    exit makes the launcher stop it instead; should rank 0 not meet the error (one of this rank's
    own), this rank says it after the grace period, naming itself."""
    progress = Progress()
    try:
        return (body or _run)(args, progress)
    except (SolosaveError, ValueError, FileNotFoundError) as e:
        rank = int(os.environ.get("RANK", "0"))
        if rank != 0 and not progress.training:
            _wait_to_be_stopped(grace)
        where = f" on rank {rank}" if rank != 0 or progress.training else ""
        line = "; ".join(part.strip() for part in str(e).splitlines() if part.strip())
        print(f"solosave train: error{where}: {line}", file=sys.stderr, flush=True)
        if dist.is_initialized():  # leave it before exiting: a live gloo group at interpreter
            try:                   # exit aborted a rank once ("terminate called", exit -6)
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001,S110 - exiting with status 2 anyway
                pass
        return 2


def _wait_to_be_stopped(seconds: float) -> None:
    """Sleep, ended by SIGTERM or SIGINT (the launcher's stop) even under ``--exit-signal-handler``."""
    if threading.current_thread() is not threading.main_thread():  # handlers are the main thread's
        time.sleep(seconds)
        return
    previous = {sig: signal.signal(sig, signal.SIG_DFL) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        time.sleep(seconds)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(args: argparse.Namespace, progress: Progress) -> int:
    state = build(args)
    guard = preemption_guard(args)  # before the resume: a notice meanwhile is kept
    step, position = resume(args, state)
    reporter = Reporter(args, state.rank, step)
    manager = checkpointing(args, state, reporter)
    if guard is not None:
        guard.manager = manager
    progress.training = True
    try:
        loop(args, state, manager, reporter, step, position, guard)
    finally:
        if guard is not None:
            guard.close()
        failures = drain(manager, reporter)
    return finish(state, manager, failures)
