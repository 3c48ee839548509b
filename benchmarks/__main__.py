"""``python -m benchmarks``: the save benchmark, the load benchmark and the scale simulation, one command.

See ``benchmarks/__init__.py`` for what is measured and ``docs/benchmarks.md`` for results.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import coop_load as coop_bench
from . import lightning_saves as lightning_bench
from . import limits as limits_bench
from . import load as load_bench
from . import megatron_save as megatron_bench
from . import object_store as s3_bench
from . import overhead as overhead_bench
from . import peers as peers_bench
from . import placement as placement_bench
from . import report as rep
from . import tiers as tiers_bench
from .progress import Progress
from .save_modes import MODES, MiB, run_save_bench
from .scale import run_scale, scale_steps, scale_summary


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=(
        "solosave vs torch.distributed.checkpoint: saves on local ranks side by side, physical "
        "limits, and a scale simulation of the coordinator's work up to W=16384."))
    p.add_argument("--only", choices=("all", "save", "limits", "load", "coop", "scale", "s3", "lightning", "tiers",
                                      "megatron", "placement", "peers", "overhead"), default="all",
                   help="which part to run (s3: saves to s3:// on a local server; lightning: a Lightning fit with "
                        "its own strategy and with solosave's; tiers: a fast tier against s3:// on a local "
                        "server; megatron: megatron-core's torch_dist strategy against solosave's; placement: "
                        "the peer copies' placement model, exact probabilities of a restore without durable "
                        "reads up to 4,096 hosts; peers: peer copies and a restore against raw transfers of the "
                        "same bytes; overhead: the step time of a compute-bound loop with a save every 1, 10, "
                        "100 steps, solosave against stock DCP async_save; none of these seven is part of all)")
    p.add_argument("--tiers-fast-dir", default=None, metavar="DIR",
                   help="tiers: where the fast tier lives (default /dev/shm, else <out>/fast)")
    p.add_argument("--total-mib", type=int, default=256, help="state size over all ranks (default 256)")
    p.add_argument("--count", type=int, default=64, help="fp32 tensors over all ranks (default 64)")
    p.add_argument("--world-sizes", default=None,
                   help="comma-separated (default 2,4); with --only scale: the simulated world sizes")
    p.add_argument("--saves", type=int, default=8, help="consecutive saves per mode (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="first saves reported separately (default 2)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of: " + ",".join(MODES))
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch (default 600)")
    p.add_argument("--scale-max-w", type=int, default=16384, help="largest simulated world size (default 16384)")
    p.add_argument("--dcp-max-w", type=int, default=4096,
                   help="largest world size simulated for stock DCP (default 4096; it takes minutes there)")
    p.add_argument("--coop-mib", type=int, default=256,
                   help="load / coop: size of the checkpoint the cooperative-load cases load (MiB)")
    p.add_argument("--solosave-only", action="store_true", help="scale: simulate solosave only, not stock DCP")
    p.add_argument("--json", default=None, metavar="OUT.json",
                   help="also write the scale figures per world size to this file ({'scale': [...]})")
    p.add_argument("--scale-workers", type=int, default=1, help="files per rank in the simulation (default 1)")
    p.add_argument("--scale-layers", type=int, default=22, help="layers of the simulated model (22: 200 tensors)")
    p.add_argument("--load-reps", type=int, default=15, help="timed loads per method and case (default 15: medians "
                   "of 7 of a 35 ms read moved by a third between runs)")
    p.add_argument("--out", default="bench-out", help="scratch + report directory (default bench-out)")
    p.add_argument("--plots", default=None, help="directory for the PNGs (default <out>)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 64 MiB, 16 tensors, 4 saves, world 2; scale up to W=256")
    return p


def _machine() -> dict[str, Any]:
    import torch

    model = ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "")
    except (OSError, subprocess.SubprocessError):
        pass
    return {"cpus": os.cpu_count(), "cpu_model": model, "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.cuda.is_available(), "loadavg_start": os.getloadavg()}


#: Each part of the report: how its table is printed and its plots drawn (in this order).
_PRINTERS = {"save": (rep.print_save, rep.plot_save), "scale": (rep.print_scale, rep.plot_scale),
             "limits": (limits_bench.print_limits, limits_bench.plot_limits),
             "load": (load_bench.print_load, load_bench.plot_load),
             "coop": (coop_bench.print_coop, coop_bench.plot_coop), "s3": (s3_bench.print_s3, s3_bench.plot_s3),
             "lightning": (lightning_bench.print_lightning, lightning_bench.plot_lightning),
             "tiers": (tiers_bench.print_tiers, tiers_bench.plot_tiers),
             "megatron": (megatron_bench.print_megatron, megatron_bench.plot_megatron),
             "placement": (placement_bench.print_placement, placement_bench.plot_placement),
             "peers": (peers_bench.print_peers, peers_bench.plot_peers),
             "overhead": (overhead_bench.print_overhead, overhead_bench.plot_overhead)}


def _emit(report: dict[str, Any], args: argparse.Namespace, out: Path, plots: Path) -> None:
    """Write the JSON files, print the tables, then draw the plots: the results are on disk
    before anything that needs the plotting library runs, and without it the plots are skipped
    with one line saying why."""
    if args.json and "scale" in report:
        Path(args.json).write_text(json.dumps({"scale": scale_summary(report["scale"])}, indent=1))
    json_path = out / "benchmarks.json"
    json_path.write_text(json.dumps(report, indent=1, sort_keys=True, default=str))
    for part, (show, _) in _PRINTERS.items():
        if part in report:
            show(report[part])
    print(f"report: {json_path}" + (f", {args.json}" if args.json and "scale" in report else ""))
    missing = rep.plotting_missing()
    if missing:
        print(f"plots skipped: {missing}")
        return
    files: list[Path] = []
    for part, (_, plot) in _PRINTERS.items():
        if part in report:
            files += plot(report[part], plots)
    print(f"plots: {', '.join(str(f) for f in files) or 'none'}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    scale_world_sizes = [int(w) for w in (args.world_sizes or "").split(",") if w]
    if args.quick:
        args.total_mib, args.count, args.saves, args.world_sizes = 64, 16, 4, "2"
        args.scale_max_w, args.dcp_max_w = min(args.scale_max_w, 256), min(args.dcp_max_w, 256)
    args.world_sizes = args.world_sizes or "2,4"
    world_sizes = [int(w) for w in args.world_sizes.split(",") if w]
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    for ws in world_sizes if args.only != "scale" else ():
        if args.count % ws:
            raise SystemExit(f"--count {args.count} is not divisible by world size {ws}")
    if (args.total_mib * MiB) % (args.count * 4):
        raise SystemExit("--total-mib * MiB must be a multiple of 4 * --count")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    plots = Path(args.plots).resolve() if args.plots else out
    plots.mkdir(parents=True, exist_ok=True)

    save_cfg = {"total_mib": args.total_mib, "count": args.count, "saves": args.saves,
                "warmup": min(args.warmup, args.saves), "timeout": args.timeout, "memcpy_reps": 3,
                "write_reps": 2, "world_sizes": world_sizes, "modes": modes}
    scale_cfg = {"max_w": args.scale_max_w, "dcp_max_w": args.dcp_max_w, "workers": args.scale_workers,
                 "layers": args.scale_layers, "scratch": str(out)}
    if args.solosave_only:
        scale_cfg["dcp_max_w"] = 0
    if args.only == "scale" and scale_world_sizes:
        scale_cfg["world_sizes"] = scale_world_sizes
    steps = 0
    if args.only in ("all", "save"):
        steps += len(world_sizes) * (1 + len(modes))
    if args.only in ("all", "scale"):
        steps += scale_steps(scale_cfg)
    if args.only in ("all", "load"):
        steps += len(load_bench.CASES)
    if args.only in ("all", "load", "coop"):
        steps += len(coop_bench.CASES) * len(coop_bench.STORAGES) + 4
    if args.only in ("all", "limits"):
        steps += len(limits_bench.CASES) * (1 + len(limits_bench.MODES))
    steps += args.only == "s3"
    steps += len(lightning_bench.STRATEGIES) if args.only == "lightning" else 0
    steps += args.only == "tiers"
    steps += args.only == "megatron"
    steps += len(placement_bench.HOSTS) if args.only == "placement" else 0
    steps += args.only == "peers"
    steps += args.only == "overhead"
    progress = Progress(steps)
    report: dict[str, Any] = {"command": " ".join(["python -m benchmarks"] + (argv if argv is not None else sys.argv[1:])),
                              "machine": _machine()}
    t0 = time.perf_counter()
    if args.only in ("all", "save"):
        report["save"] = run_save_bench(save_cfg, out, progress)
    if args.only in ("all", "scale"):
        report["scale"] = run_scale(scale_cfg, progress)
    if args.only in ("all", "load"):
        load_cfg = {"world_size": 2, "reps": 3 if args.quick else args.load_reps, "timeout": args.timeout,
                    "methods": list(load_bench.METHODS)}
        report["load"] = load_bench.run_load_bench(load_cfg, out, progress)
    if args.only in ("all", "load", "coop"):
        coop_cfg = {"total_mib": 64 if args.quick else args.coop_mib, "sweep_mib": 32 if args.quick else 64, "reps": 2 if args.quick else min(args.load_reps, 5),
                    "timeout": args.timeout, "methods": list(coop_bench.METHODS),
                    "storages": list(coop_bench.STORAGES)}
        report["coop"] = coop_bench.run_coop_bench(coop_cfg, out, progress)
    if args.only in ("all", "limits"):
        limits_cfg = {"saves": args.saves, "warmup": min(args.warmup, args.saves), "timeout": args.timeout}
        report["limits"] = limits_bench.run_limits_bench(limits_cfg, out, progress)
    if args.only == "s3":
        s3_cfg = {"per_rank_mib": min(args.total_mib // 2, 64), "tensors": 16, "saves": args.saves // 2 or 1,
                  "timeout": args.timeout}
        report["s3"] = s3_bench.run_s3_bench(s3_cfg, progress)
    if args.only == "lightning":
        lightning_cfg = {"total_mib": args.total_mib, "count": args.count, "saves": args.saves,
                         "warmup": min(args.warmup, args.saves - 1), "interval": 3, "timeout": args.timeout}
        report["lightning"] = lightning_bench.run_lightning_bench(lightning_cfg, out, progress)
    if args.only == "tiers":
        tiers_cfg = {"per_rank_mib": min(args.total_mib // 2, 64), "tensors": 16, "saves": args.saves // 2 or 1,
                     "reps": 3 if args.quick else 5, "timeout": args.timeout, "fast_dir": args.tiers_fast_dir}
        report["tiers"] = tiers_bench.run_tiers_bench(tiers_cfg, out, progress)
    if args.only == "megatron":
        mg_cfg = {"total_mib": args.total_mib, "saves": args.saves, "timeout": args.timeout, "poll_s": 0.01}
        report["megatron"] = megatron_bench.run_megatron_bench(mg_cfg, out, progress)
    if args.only == "placement":
        report["placement"] = placement_bench.run_placement_model(progress)
    if args.only == "peers":
        peers_cfg = {"per_rank_mib": min(args.total_mib // 2, 128), "tensors": 16, "reps": 3 if args.quick else 5,
                     "timeout": args.timeout}
        report["peers"] = peers_bench.run_peers_bench(peers_cfg, out, progress)
    if args.only == "overhead":
        quick = args.quick
        overhead_cfg = {"per_rank_mib": 32 if quick else args.total_mib, "tensors": 16, "matmuls": 12,
                        "intervals": [1, 10] if quick else [1, 10, 100], "warmup": 3,
                        "steps": {"none": 30 if quick else 300, "1": 10 if quick else 40, "10": 30 if quick else 200,
                                  "100": 300},
                        "timeout": args.timeout}
        report["overhead"] = overhead_bench.run_overhead_bench(overhead_cfg, out, progress)
    progress.finish()
    report["wall_s"] = time.perf_counter() - t0
    report["machine"]["loadavg_end"] = os.getloadavg()

    _emit(report, args, out, plots)
    la = report["machine"]
    print(f"\nwall time {report['wall_s']:.0f} s on {la['cpus']} CPUs ({la['cpu_model']}); load average "
          f"(1 min) {la['loadavg_start'][0]:.2f} at start, {la['loadavg_end'][0]:.2f} at end")
    failed = any("error" in m for e in report.get("save", {}).get("world_sizes", {}).values()
                 for m in e["modes"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
