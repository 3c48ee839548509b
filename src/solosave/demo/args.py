"""The demo's flags: its own (run, model and data) plus the library's checkpoint flags
(:func:`solosave.integrations.add_checkpoint_args`, named as Megatron-LM names them).

The same parser serves the launcher (which checks the flags before starting any rank) and each
rank (which receives the same argv, from ``solosave train`` or from torchrun)."""

from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    from ..integrations import add_checkpoint_args

    p = argparse.ArgumentParser(
        prog="solosave train",
        description="Train a small GPT on N local CPU ranks (gloo) with asynchronous solosave "
                    "checkpoints. Runs under torchrun too: `torchrun ... -m solosave.demo -- ...`.")
    g = p.add_argument_group("run")
    g.add_argument("--nproc", type=int, default=2,
                   help="local ranks to launch (default 2; ignored under torchrun)")
    g.add_argument("--steps", type=int, default=40, help="train until this step (default 40)")
    g.add_argument("--seed", type=int, default=0, help="model init and sampling seed (default 0)")
    g.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp",
                   help="data parallel (DDP) or sharded data parallel (FSDP2 fully_shard); default ddp")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the model trains (default cpu). cuda: one GPU per local rank where "
                        "there are enough (NCCL), else the ranks share the GPUs (gloo)")
    g.add_argument("--json-log", metavar="FILE", default=None,
                   help="append one JSON line per step and per save (rank 0)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM or SIGINT (any rank): every rank finishes the step that no rank "
                        "has passed yet, saves it, and exits cleanly (Megatron's flag of the same name; "
                        "agreed on a background thread, no collective per step)")
    g.add_argument("--preemption-notice-file", metavar="FILE", default=None,
                   help="a file whose appearance is a preemption notice (a scheduler's): as a signal "
                        "under --exit-signal-handler")
    m = p.add_argument_group("model and data")
    m.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    m.add_argument("--d-model", type=int, default=128, help="model width (default 128)")
    m.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    m.add_argument("--vocab", type=int, default=512, help="vocabulary size (default 512)")
    m.add_argument("--seq-len", type=int, default=64, help="tokens per sample (default 64)")
    m.add_argument("--batch-size", type=int, default=8, help="samples per rank per step (default 8)")
    m.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    add_checkpoint_args(p)
    return p


def check_args(args: argparse.Namespace) -> None:
    """Raise ``ValueError`` for a bad combination (the launcher checks before starting ranks)."""
    from ..integrations import validate_checkpoint_args

    validate_checkpoint_args(args)
    for name in ("steps", "layers", "d_model", "heads", "vocab", "seq_len", "batch_size", "nproc"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.d_model % args.heads:
        raise ValueError(f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads})")
