"""``solosave train``: the main job - a small GPT trained on N CPU ranks with solosave saves.

Two ways to run it::

    solosave train --nproc 2 --steps 40 --save runs/train --save-interval 5 --async-save \\
        --use-persistent-ckpt-worker --ckpt-metadata runs/train/prepared.metadata --ckpt-metadata-create
    torchrun --nnodes 2 --nproc-per-node 8 ... -m solosave.train --save /ckpt ...   # any launcher

``solosave train`` launches itself through PyTorch's own launcher (``torch.distributed.run``,
``--standalone``); under ``torchrun`` it runs one rank per process. Each rank:

1. builds a GPT-style model (token + position embeddings, pre-norm transformer blocks with
   causal attention, next-token cross-entropy) and AdamW, wrapped in DDP (``--parallel ddp``)
   or sharded with FSDP2 ``fully_shard`` (``--parallel fsdp``: the checkpoint holds DTensor shards);
2. reads its batches from a corpus generated deterministically from a fixed seed (a word-level
   Markov chain), at a data position that is part of the checkpoint;
3. resumes (``--load``) from the newest published checkpoint - model, optimizer, step, data
   position and every rank's RNG state - so a resumed run continues the loss curve bit for bit;
4. saves every ``--save-interval`` steps and at the last step through a
   :class:`~solosave.integrations.CheckpointManager`; rank 0 prints one line per published save
   and a summary table at the end, and ``--json-log`` records every step and save as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any

_ENV = "SOLOSAVE_TRAIN_ARGS"
CORPUS_SEED = 20261129


def build_parser() -> argparse.ArgumentParser:
    from .integrations import add_checkpoint_args

    p = argparse.ArgumentParser(
        prog="solosave train",
        description="Train a small GPT on N local CPU ranks (gloo) with asynchronous solosave "
                    "checkpoints. Runs under torchrun too: `torchrun ... -m solosave.train ...`.")
    g = p.add_argument_group("run")
    g.add_argument("--nproc", type=int, default=2,
                   help="local ranks to launch (default 2; ignored under torchrun)")
    g.add_argument("--steps", type=int, default=40, help="train until this step (default 40)")
    g.add_argument("--seed", type=int, default=0, help="model init and sampling seed (default 0)")
    g.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp",
                   help="data parallel (DDP) or sharded data parallel (FSDP2 fully_shard); default ddp")
    g.add_argument("--json-log", metavar="FILE", default=None,
                   help="append one JSON line per step and per save (rank 0)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
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
    from .integrations import validate_checkpoint_args

    validate_checkpoint_args(args)
    for name in ("steps", "layers", "d_model", "heads", "vocab", "seq_len", "batch_size", "nproc"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.d_model % args.heads:
        raise ValueError(f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads})")


# -- model and data ------------------------------------------------------------------------------
def make_model(args: argparse.Namespace) -> Any:
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = args.d_model
            self.tok = nn.Embedding(args.vocab, d)
            self.pos = nn.Embedding(args.seq_len, d)
            self.blocks = nn.ModuleList(Block(d, args.heads) for _ in range(args.layers))
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, args.vocab, bias=False)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln_f(x))

    return GPT()


def make_corpus(vocab: int, n_tokens: int = 1 << 17) -> Any:
    """A fixed token stream: a Markov chain where each word has a few likely successors (the same
    for every run and rank; ``CORPUS_SEED``). A model can learn it: the loss falls from
    ``ln(vocab)`` towards the chain's entropy."""
    import torch

    g = torch.Generator().manual_seed(CORPUS_SEED)
    successors = torch.randint(0, vocab, (vocab, 4), generator=g)
    probs = torch.tensor([0.55, 0.25, 0.15, 0.05])
    choice = torch.multinomial(probs, n_tokens, replacement=True, generator=g)
    out = torch.empty(n_tokens, dtype=torch.long)
    tok = 0
    succ = successors.tolist()
    ch = choice.tolist()
    for i in range(n_tokens):
        tok = succ[tok][ch[i]]
        out[i] = tok
    return out


def batch_at(corpus: Any, position: int, rank: int, batch: int, seq_len: int) -> tuple[Any, Any]:
    """Samples ``position + rank*batch .. +batch`` of the global sample order (a fixed stride
    through the corpus), as ``(inputs, targets)``."""
    import torch

    span = corpus.numel() - seq_len - 1
    starts = [((position + rank * batch + j) * 7919 * seq_len) % span for j in range(batch)]
    x = torch.stack([corpus[s:s + seq_len] for s in starts])
    y = torch.stack([corpus[s + 1:s + seq_len + 1] for s in starts])
    return x, y


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up over 5 steps, then cosine decay to 10% at ``--steps``."""
    if step <= 5:
        return args.lr * step / 5
    frac = min(1.0, (step - 5) / max(1, args.steps - 5))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


# -- one rank ------------------------------------------------------------------------------------
class _Reporter:
    """Rank 0's output: progress bar, one line per finished save, JSON lines, summary table."""

    def __init__(self, args: argparse.Namespace, rank: int, start_step: int) -> None:
        from ._progress import ProgressBar

        self.rank = rank
        self.bar = ProgressBar(args.steps - start_step, "train", enabled=rank == 0 and not args.no_progress)
        self.json = None
        if rank == 0 and args.json_log:
            os.makedirs(os.path.dirname(os.path.abspath(args.json_log)), exist_ok=True)
            self.json = open(args.json_log, "a")  # noqa: SIM115 - closed in summary()
        self.saves: list[dict[str, Any]] = []

    def log(self, record: dict[str, Any]) -> None:
        if self.json is not None:
            self.json.write(json.dumps(record) + "\n")
            self.json.flush()

    def step(self, step: int, loss: float) -> None:
        self.log({"event": "step", "step": step, "loss": loss})
        self.bar.update(1, note=f"step {step} loss {loss:.4f}")

    def save_done(self, done: Any) -> None:
        if self.rank != 0:
            return
        rec: dict[str, Any] = {"event": "save", "step": done.step, "path": done.path}
        if done.error is not None:
            rec.update(ok=False, error=str(done.error))
            self.bar.write(f"save  {os.path.basename(done.path)}  FAILED: {done.error}")
        else:
            r = done.result
            total_bytes = sum(os.path.getsize(os.path.join(done.path, f)) for f in os.listdir(done.path)
                              if f.endswith(".distcp"))
            loop = sum(v["count"] for v in r.collectives("calling_thread").values())
            allc = r.collectives("all")
            rec.update(ok=True, mode=r.mode, block_ms=r.timings.block * 1e3,
                       to_published_ms=r.timings.to_published * 1e3, bytes_rank0=r.bytes_written,
                       bytes_total=total_bytes, collectives_in_loop=loop,
                       collectives_total=sum(v["count"] for v in allc.values()),
                       collective_bytes=sum(v["bytes"] for v in allc.values()), collectives=allc)
            kinds = ", ".join(f"{k} x{v['count']} ({v['bytes']} B)" for k, v in allc.items())
            self.bar.write(
                f"save  {os.path.basename(done.path)}  step {done.step:>5}  mode={r.mode:<15} "
                f"block {rec['block_ms']:7.2f} ms  published after {rec['to_published_ms']:8.1f} ms  "
                f"{total_bytes / 1e6:6.2f} MB  collectives in loop {loop} / total "
                f"{rec['collectives_total']} [{kinds}]")
        self.saves.append(rec)
        self.log(rec)

    def summary(self) -> None:
        self.bar.close()
        if self.rank != 0 or not self.saves:
            return
        print("\nsummary of saves (rank 0)")
        print(f"{'mode':<16}{'saves':>6}{'block med ms':>14}{'block max ms':>14}{'published med ms':>18}"
              f"{'MB/save':>9}{'in loop':>9}{'total':>7}")
        by_mode: dict[str, list[dict[str, Any]]] = {}
        for rec in self.saves:
            by_mode.setdefault(rec.get("mode", "FAILED"), []).append(rec)
        for mode, recs in by_mode.items():
            ok = [r for r in recs if r.get("ok")]
            if not ok:
                print(f"{mode:<16}{len(recs):>6}  (failed)")
                continue
            print(f"{mode:<16}{len(recs):>6}{statistics.median(r['block_ms'] for r in ok):>14.2f}"
                  f"{max(r['block_ms'] for r in ok):>14.2f}"
                  f"{statistics.median(r['to_published_ms'] for r in ok):>18.1f}"
                  f"{statistics.median(r['bytes_total'] for r in ok) / 1e6:>9.2f}"
                  f"{statistics.median(r['collectives_in_loop'] for r in ok):>9.0f}"
                  f"{statistics.median(r['collectives_total'] for r in ok):>7.0f}")
        if self.json is not None:
            self.json.close()


def _resume_point(args: argparse.Namespace) -> tuple[int, str] | None:
    """Rank 0 picks the newest published checkpoint under ``--load``; every rank gets its choice."""
    import torch.distributed as dist

    from .integrations import find_latest_checkpoint

    choice = [find_latest_checkpoint(args.load) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(choice, src=0)
    return choice[0]


def run_rank(args: argparse.Namespace) -> int:
    """One rank of the job. A user-fixable error (bad prepared metadata, an existing checkpoint,
    a bad flag) prints one line on rank 0 and returns 2 on every rank, without a traceback."""
    from ._errors import SolosaveError

    try:
        return _run_rank(args)
    except (SolosaveError, ValueError, FileNotFoundError) as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"solosave train: error: {e}", file=sys.stderr, flush=True)
        return 2


def _run_rank(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import solosave

    from .integrations import CheckpointManager, checkpointer_from_args

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = make_model(args)
    if args.parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for blk in model.blocks:
            fully_shard(blk)
        fully_shard(model)
        train_model = model
    else:
        train_model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(train_model.parameters(), lr=args.lr, weight_decay=0.01)
    corpus = make_corpus(args.vocab)

    step, position = 0, 0
    resume = _resume_point(args) if args.load else None
    if args.load and resume is None and rank == 0:
        print(f"no published checkpoint under {args.load}: starting from step 0", flush=True)
    if resume is not None:
        msd, osd = get_state_dict(train_model, opt)
        sd = {"model": msd, "optim": osd, "train": {"step": 0, "data_position": 0},
              "rng": {f"rank{rank}": torch.get_rng_state()}}
        solosave.load(sd, resume[1])
        set_state_dict(train_model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        step, position = int(sd["train"]["step"]), int(sd["train"]["data_position"])
        torch.set_rng_state(sd["rng"][f"rank{rank}"])
        if rank == 0:
            print(f"resumed from {resume[1]} (step {step})", flush=True)

    rep = _Reporter(args, rank, step)
    manager = None
    if args.save:
        ckpt = checkpointer_from_args(args, resumed_from=resume[1] if resume else None)
        manager = CheckpointManager(args.save, ckpt, keep_last=args.keep_last,
                                    async_save=args.async_save, on_done=rep.save_done)
    interval = args.save_interval or args.steps
    try:
        while step < args.steps:
            step += 1
            for group in opt.param_groups:
                group["lr"] = lr_at(step, args)
            x, y = batch_at(corpus, position, rank, args.batch_size, args.seq_len)
            position += args.batch_size * world
            logits = train_model(x)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            rep.step(step, float(mean) / world)
            if manager is not None:
                manager.poll()
                if step % interval == 0 or step == args.steps:
                    msd, osd = get_state_dict(train_model, opt)
                    manager.save(step, {"model": msd, "optim": osd,
                                        "train": {"step": step, "data_position": position},
                                        "rng": {f"rank{rank}": torch.get_rng_state()}})
    finally:
        failures = 0
        if manager is not None:
            manager.finish()
            failures = len(manager.failures)
        rep.summary()
    if rank == 0 and manager is not None and manager.done and manager.done[-1].result is not None:
        report = solosave.verify_checkpoint(manager.done[-1].path)
        print(f"verified {manager.done[-1].path}: {'ok' if report.ok else report.problems} "
              f"({report.records} records, checksums {report.checksums})", flush=True)
        failures += 0 if report.ok else 1
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failures else 0


# -- entry points -----------------------------------------------------------------------------
def _under_launcher() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if _under_launcher():  # one rank, started by torchrun / torch.distributed.run
        if _ENV in os.environ:
            argv = json.loads(os.environ[_ENV])
        args = build_parser().parse_args(argv)
        check_args(args)
        return run_rank(args)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except ValueError as e:
        parser.error(str(e))
    from torch.distributed.run import main as torchrun

    t0 = time.perf_counter()
    # The job's options travel in the environment: torchrun must not parse them as its own.
    os.environ[_ENV] = json.dumps(argv)
    try:
        torchrun(["--standalone", f"--nproc-per-node={args.nproc}", "--module", "solosave.train"])
    except SystemExit as e:
        return int(e.code or 0)
    except Exception as e:  # noqa: BLE001 - torchrun raises ChildFailedError
        codes = sorted({f.exitcode for f in getattr(e, "failures", {}).values()})
        print(f"solosave train failed: a rank exited with code {codes or '?'} (its error is above)",
              file=sys.stderr)
        return 2 if 2 in codes else 1  # 2: a user error (other ranks may have been stopped)
    print(f"training finished in {time.perf_counter() - t0:.1f} s" +
          (f"; checkpoints in {args.save}" if args.save else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
