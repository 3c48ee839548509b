"""The demo job: N local ranks save a small model + optimizer asynchronously, create-then-reuse.

Run ``solosave demo`` (it launches itself under ``torch.distributed.run``), or directly
``torchrun --nproc-per-node 2 -m solosave.demo --out runs/demo``. Each rank trains a small MLP
with Adam on random data for ``--saves`` steps and saves after every step; the first save creates
the prepared metadata, every later save reuses it (one 8-byte all_reduce). Rank 0 prints one
line per published save and finally loads the last checkpoint back and checks it bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

_ENV = "SOLOSAVE_DEMO_ARGS"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="solosave demo", description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="local ranks to launch (default 2)")
    p.add_argument("--saves", type=int, default=6, help="training steps, one save each (default 6)")
    p.add_argument("--out", default="runs/demo", help="output directory (default runs/demo)")
    p.add_argument("--workers", type=int, default=1, help="files per rank (default 1)")
    p.add_argument("--hidden", type=int, default=512, help="MLP width (default 512)")
    return p


def run_rank(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import solosave

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, args.hidden), torch.nn.GELU(),
                                torch.nn.Linear(args.hidden, args.hidden), torch.nn.GELU(),
                                torch.nn.Linear(args.hidden, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if rank == 0 and os.path.exists(args.out):
        shutil.rmtree(args.out)
    dist.barrier()
    g = torch.Generator().manual_seed(1234 + rank)
    ok = True
    with solosave.AsyncCheckpointer(workers=args.workers,
                                    prepared_metadata=os.path.join(args.out, "prepared.metadata"),
                                    create_prepared_metadata=True) as ckpt:
        handle = None
        for step in range(1, args.saves + 1):
            x = torch.randn(32, 64, generator=g)
            y = torch.randint(0, 10, (32,), generator=g)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            for p in model.parameters():  # data parallel: average gradients
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
            if handle is not None:
                _report(rank, handle.wait())
            msd, osd = get_state_dict(model, opt)
            handle = ckpt.save({"model": msd, "optim": osd, "step": step, "loss": loss.item()},
                               os.path.join(args.out, f"step_{step:04d}"))
        _report(rank, handle.wait())
        final = os.path.join(args.out, f"step_{args.saves:04d}")
    msd, osd = get_state_dict(model, opt)
    expect = {k: v.clone() for k, v in msd.items()}
    target = {"model": {k: torch.zeros_like(v) for k, v in msd.items()}, "step": 0}
    solosave.load(target, final)
    ok = all(torch.equal(target["model"][k], expect[k]) for k in expect) and target["step"] == args.saves
    dist.barrier()
    if rank == 0:
        print(f"loaded {final}: model matches bit for bit: {ok}; step={target['step']}")
    dist.destroy_process_group()
    return 0 if ok else 1


def _report(rank: int, r: "object") -> None:
    if rank != 0:
        return
    t = r.timings  # type: ignore[attr-defined]
    calling = sum(v["count"] for v in r.collectives("calling_thread").values())  # type: ignore[attr-defined]
    total = r.collectives("all")  # type: ignore[attr-defined]
    kinds = ", ".join(f"{k} x{v['count']} ({v['bytes']} B)" for k, v in total.items())
    print(f"{os.path.basename(r.path)}  mode={r.mode:<8} block={t.block * 1e3:7.2f} ms  "  # type: ignore[attr-defined]
          f"published after {t.to_published * 1e3:7.1f} ms  {r.bytes_written / 1e6:6.2f} MB  "  # type: ignore[attr-defined]
          f"collectives in loop: {calling}, background: {kinds}", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["rank-entry"]:  # one rank, started by torch.distributed.run
        return run_rank(_parser().parse_args(json.loads(os.environ.get(_ENV, "[]"))))
    args = _parser().parse_args(argv)
    from torch.distributed.run import main as torchrun

    t0 = time.perf_counter()
    # torchrun would parse the demo's own options as its own: they travel in the environment.
    os.environ[_ENV] = json.dumps(argv)
    try:
        torchrun(["--standalone", f"--nproc-per-node={args.nproc}", "--module", "solosave.demo",
                  "rank-entry"])
    except SystemExit as e:
        return int(e.code or 0)
    except Exception as e:  # noqa: BLE001 - torchrun raises ChildFailedError
        print(f"solosave demo failed: {e}", file=sys.stderr)
        return 1
    print(f"demo finished in {time.perf_counter() - t0:.1f} s; checkpoints in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
