"""The demo's entry point: ``solosave train``, ``python -m solosave.demo`` and
``torchrun ... -m solosave.demo ...``.

Two ways to run it::

    solosave train --nproc 2 --steps 40 --save runs/train --save-interval 5 --async-save \\
        --use-persistent-ckpt-worker --ckpt-metadata runs/train/prepared.metadata --ckpt-metadata-create
    torchrun --nnodes 2 --nproc-per-node 8 ... -m solosave.demo --save /ckpt ...   # any launcher

Under a launcher (``LOCAL_RANK`` and ``WORLD_SIZE`` set) :func:`main` runs one rank
(:func:`solosave.demo.job.run_rank`). Otherwise it checks the flags and launches itself through
PyTorch's own launcher (``torch.distributed.run --standalone``, ``--nproc`` ranks), with the job's
arguments after the module name, as torchrun passes them to any script.
"""

from __future__ import annotations

import os
import sys
import time

from .args import build_parser, check_args


def under_launcher() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if under_launcher():  # one rank, started by torchrun / torch.distributed.run
        if argv[:1] == ["--"]:  # the separator launch() puts there, if a launcher passed it on
            argv = argv[1:]
        args = build_parser().parse_args(argv)
        check_args(args)
        from .job import run_rank

        return run_rank(args)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except ValueError as e:
        parser.error(str(e))
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    t0 = time.perf_counter()
    # torchrun hands everything after the module name to each rank unchanged. "--" keeps its own
    # parser from reading the job's flags while it classifies its arguments (`--nproc` would be an
    # ambiguous abbreviation of its --nproc-per-node / --nproc_per_node). argparse drops that "--";
    # a rank skips it should a launcher pass it on.
    try:
        torchrun(["--standalone", f"--nproc-per-node={args.nproc}", "--module", "solosave.demo", "--", *argv])
    except SystemExit as e:
        return int(e.code or 0)
    except SignalException as e:  # torchrun got SIGTERM/SIGINT and stopped the ranks
        if args.exit_signal_handler:
            print(f"stopped by signal {e.sigval.name}: the ranks saved and exited", file=sys.stderr)
            return 0
        return 128 + int(e.sigval)
    except Exception as e:  # noqa: BLE001 - torchrun raises ChildFailedError
        codes = sorted({f.exitcode for f in getattr(e, "failures", {}).values()})
        print(f"solosave train failed: a rank exited with code {codes or '?'} (its error is above)",
              file=sys.stderr)
        return 2 if 2 in codes else 1  # 2: a user error (other ranks may have been stopped)
    print(f"training finished in {time.perf_counter() - t0:.1f} s" +
          (f"; checkpoints in {args.save}" if args.save else ""))
    return 0
