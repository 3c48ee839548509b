"""The save at the machine's limits (``--only limits``): stall vs memcpy, publication vs raw write.

Three cases at W=2 ranks (gloo, ``OMP_NUM_THREADS=1`` as torchrun sets it), each rank holding its
own fp32 tensors: ``large`` = 32 x 4 MiB per rank, ``small`` = 2048 x 32 KiB per rank, and
``small_dtensor`` = ``small`` as FSDP2 holds it: 2048 ``DTensor``s sharded ``Shard(0)`` over the
ranks, a 32 KiB shard of each per rank (saved through DCP's DTensor write items). For each,
one launch measures the limits with every rank at once (``copy_`` of the same bytes into
preallocated memory; a sequential write + ``fsync`` of the same bytes), then solosave reuse saves
(``solosave_create_reuse``), the same with zlib's CRC32 instead of ISA-L's
(``solosave_create_reuse_zlib``: what the CRC costs) and stock DCP ``async_save`` run on the same
state, one after the other (the save benchmark's machinery, ``save_modes.run_save_bench``). Per save the slowest rank
counts; medians of the steady saves (the first saves, which create the prepared metadata, are
reported apart). Ratios, all from the same run:

* ``stall_over_memcpy`` = time inside ``save()`` / memcpy of the same bytes (goals: <= 1.2 large,
  <= 2 small);
* ``published_over_raw_write`` = ``save()`` start -> ``wait()`` returned / raw write + fsync of the
  same bytes, measured before the saves (goal: <= 1.25);
* ``published_over_raw_after`` = the same over a raw write + fsync of the same bytes into a new
  file by every rank at once right after each save (medians of the steady saves): the same disk
  state as the saves, whose files accumulate and are deleted between saves (on this machine's
  disk the two ways of measuring it differed by up to a quarter in one run, in either direction).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .save_modes import MiB, run_save_bench

Json = dict[str, Any]

WORLD_SIZE = 2
#: name -> (tensors per rank, bytes per tensor (per shard), FSDP-style DTensors)
CASES: dict[str, tuple[int, int, bool]] = {"large": (32, 4 * MiB, False), "small": (2048, 32 * 1024, False),
                                           "small_dtensor": (2048, 32 * 1024, True)}
GOALS = {"large": {"stall_over_memcpy": 1.2, "published_over_raw_write": 1.25},
         "small": {"stall_over_memcpy": 2.0, "published_over_raw_write": 1.25},
         "small_dtensor": {"stall_over_memcpy": 2.0, "published_over_raw_write": 1.25}}
MODES = ("solosave_create_reuse", "solosave_create_reuse_zlib", "dcp_async_thread")


def run_limits_bench(cfg: Json, out_dir: Path, progress: Any) -> Json:
    """Both cases; returns the ``limits`` report section."""
    report: Json = {"config": cfg, "cases": {}}
    for name, (per_rank, each, dtensor) in CASES.items():
        count = per_rank * WORLD_SIZE
        scfg = {"total_mib": count * each // MiB, "count": count, "saves": cfg["saves"], "warmup": cfg["warmup"],
                "timeout": cfg["timeout"], "memcpy_reps": 5, "write_reps": 3, "world_sizes": [WORLD_SIZE],
                "modes": list(MODES), "interleave_raw": True, "dtensor": dtensor}
        res = run_save_bench(scfg, out_dir / f"limits-{name}", progress)
        entry = res["world_sizes"][str(WORLD_SIZE)]
        report["cases"][name] = {"tensors_per_rank": per_rank, "bytes_per_tensor": each, "dtensor": dtensor,
                                 "limits": entry["limits"], "modes": _summaries(entry["modes"]),
                                 "ratios": _ratios(name, entry)}
    return report


def _summaries(modes: Json) -> Json:
    return {m: (e["summary"] if "summary" in e else {"error": e.get("error")}) for m, e in modes.items()}


def _ratios(name: str, entry: Json) -> Json:
    limits = entry["limits"]
    out: Json = {}
    for m, e in entry["modes"].items():
        if "summary" not in e or not limits or "error" in limits:
            continue
        s = e["summary"]["steady_median"]
        out[m] = {"stall_ms": s["block_ms"], "memcpy_ms": limits["memcpy_ms"],
                  "stall_over_memcpy": s["block_ms"] / limits["memcpy_ms"],
                  "published_ms": s["to_waited_ms"], "raw_write_ms": limits["write_ms"],
                  "published_over_raw_write": s["to_waited_ms"] / limits["write_ms"],
                  "raw_after_ms": s["raw_write_ms"],
                  "published_over_raw_after": s["to_waited_ms"] / s["raw_write_ms"]}
    out["goals"] = GOALS[name]
    return out


def print_limits(report: Json) -> None:
    print("\n== the save at the machine's limits (W=2, slowest rank, medians of steady saves) ==")
    print(f"{'case':<27}{'mode':<28}{'stall ms':>9}{'memcpy ms':>10}{'ratio':>7}{'goal':>6}"
          f"{'published ms':>13}{'raw write ms':>13}{'ratio':>7}{'raw after ms':>13}{'ratio':>7}{'goal':>6}")
    for name, c in report["cases"].items():
        label = f"{name} {c['tensors_per_rank']}x{c['bytes_per_tensor'] // 1024}KiB"
        goals = c["ratios"]["goals"]
        for m in MODES:
            r = c["ratios"].get(m)
            if r is None:
                print(f"{label:<27}{m:<28} FAILED: {c['modes'].get(m)}")
                continue
            print(f"{label:<27}{m:<28}{r['stall_ms']:>9.1f}{r['memcpy_ms']:>10.1f}{r['stall_over_memcpy']:>7.2f}"
                  f"{goals['stall_over_memcpy']:>6.2f}{r['published_ms']:>13.1f}{r['raw_write_ms']:>13.1f}"
                  f"{r['published_over_raw_write']:>7.2f}{r['raw_after_ms']:>13.1f}{r['published_over_raw_after']:>7.2f}"
                  f"{goals['published_over_raw_write']:>6.2f}")


def plot_limits(report: Json, out_dir: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    names = list(report["cases"])
    for ax, key, title in ((axes[0], "stall_over_memcpy", "stall / memcpy"),
                           (axes[1], "published_over_raw_write", "published / raw before the saves"),
                           (axes[2], "published_over_raw_after", "published / raw after each save")):
        width = 0.8 / len(MODES)
        for i, m in enumerate(MODES):
            vals = [report["cases"][n]["ratios"].get(m, {}).get(key, 0.0) for n in names]
            ax.bar([x + (i - (len(MODES) - 1) / 2) * width for x in range(len(names))], vals, width, label=m)
        for x, n in enumerate(names):
            g = report["cases"][n]["ratios"]["goals"][key.replace("_after", "_write")]
            ax.hlines(g, x - 0.45, x + 0.45, colors="k", linestyles="dashed")
        ax.set_xticks(range(len(names)), [f"{n}\n{report['cases'][n]['tensors_per_rank']} tensors/rank" for n in names])
        ax.set_title(f"{title} (dashed: goal)")
        ax.set_ylabel("ratio (lower is better)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "limits.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
