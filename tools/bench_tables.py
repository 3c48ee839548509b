"""Markdown tables for docs/benchmarks.md from the JSON reports of ``python -m benchmarks``.

``tools/bench_tables.py bench-out/<part>/benchmarks.json ...`` prints, for every part found in
each report (save, limits, load, s3, scale), the tables the page shows, so that no figure is
copied by hand. Prose around them is written by hand from the same output.
"""

from __future__ import annotations

import json
import sys
from typing import Any

sys.path.insert(0, ".")
from benchmarks.report import fmt_bytes  # noqa: E402 - after the path set-up
from benchmarks.save_modes import LABELS, MODES  # noqa: E402

Json = dict[str, Any]


def _x(v: float | None) -> str:
    return "" if v is None else f"{v:.2f}"


def save_tables(save: Json) -> None:
    for ws, entry in save["world_sizes"].items():
        cfg = save["config"]
        print(f"\nWorld size {ws} ({cfg['total_mib'] // int(ws)} MiB per rank), medians of saves "
              f"{cfg['warmup'] + 1}..{cfg['saves']}:\n")
        print("| mode | path | block ms | to_pub ms | MB/s | coll call | coll all | payload/save | block / memcpy "
              "| MB/s / raw write | DCP thread block / this | DCP thread to_pub / this |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for m in MODES:
            me = entry["modes"].get(m)
            if me is None or "summary" not in me:
                continue
            s, r = me["summary"]["steady_median"], entry["ratios"].get(m, {})
            print(f"| {LABELS[m]} | {'/'.join(me['summary']['steady_paths'])} | {s['block_ms']:.1f} | "
                  f"{s['to_published_ms']:.1f} | {s['write_MBps']:.0f} | {s['coll_calling_count']:.0f} | "
                  f"{s['coll_total_count']:.0f} | {fmt_bytes(s['coll_total_bytes'])} | "
                  f"{_x(r.get('block_over_memcpy'))} | {_x(r.get('write_over_raw_write'))} | "
                  f"{_x(r.get('dcp_async_block_over_this'))} | {_x(r.get('dcp_async_to_published_over_this'))} |")
        lim = entry["limits"]
        print(f"\nLimits (all ranks at once): memcpy {lim['memcpy_ms']:.1f} ms per rank "
              f"({lim['memcpy_GBps_per_rank']:.2f} GB/s per rank); write+fsync {lim['write_ms']:.0f} ms "
              f"({lim['write_MBps']:.0f} MB/s all ranks).")


def limits_tables(limits: Json) -> None:
    print("\n| case | mode | stall ms | memcpy ms | stall / memcpy (goal) | published ms | raw write+fsync "
          "before ms | published / raw before (goal) | raw after each save ms | published / raw after (goal) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, c in limits["cases"].items():
        label = f"{name}: {c['tensors_per_rank']} x {c['bytes_per_tensor'] // 1024} KiB per rank"
        if c.get("dtensor"):
            label += " (DTensor shards)"
        goals = c["ratios"]["goals"]
        for m, r in c["ratios"].items():
            if m == "goals":
                continue
            print(f"| {label} | {m} | {r['stall_ms']:.1f} | {r['memcpy_ms']:.1f} | "
                  f"{r['stall_over_memcpy']:.2f} ({goals['stall_over_memcpy']}) | {r['published_ms']:.1f} | "
                  f"{r['raw_write_ms']:.1f} | {r['published_over_raw_write']:.2f} "
                  f"({goals['published_over_raw_write']}) | {r['raw_after_ms']:.1f} | "
                  f"{r['published_over_raw_after']:.2f} ({goals['published_over_raw_write']}) |")


def scale_tables(scale: Json, min_w: int = 256) -> None:
    """Issue #15's figures per simulated world size (solosave; start-up and load: the worst of
    the sampled ranks)."""
    print("\n| W | start-up read per rank | start-up s per rank | worker gets | create save s (coordinator) "
          "| of which finish s | drift fallback s | reuse publish s | load index written s (beside the data) "
          "| load: index read per rank (bytes, s) | load: whole `.metadata` per rank (bytes, s) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in scale["solosave"]:
        if r["world"] < min_w:
            continue
        print(f"| {r['world']} | {fmt_bytes(r['startup_read_bytes_per_rank'])} | {r['startup_s_per_rank']:.4f} | "
              f"{fmt_bytes(r['worker_prepared_bytes'])} | {r['create_save_s']:.2f} | {r['t_finish_publish']:.2f} | "
              f"{r['fallback_save_s']:.2f} | {r['reuse_publish_s']:.2f} | {r['reuse_index_write_s']:.3f} | "
              f"{fmt_bytes(r['load_read_bytes_per_rank'])}, {r['load_metadata_s_per_rank']:.3f} | "
              f"{fmt_bytes(r['load_full_metadata_bytes_per_rank'])}, {r['load_full_metadata_s_per_rank']:.2f} |")


def main(paths: list[str]) -> int:
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        print(f"<!-- {report.get('command')} ; load average {report['machine']['loadavg_start'][0]:.2f} -> "
              f"{report['machine']['loadavg_end'][0]:.2f}; wall {report['wall_s']:.0f} s -->")
        if "save" in report:
            save_tables(report["save"])
        if "limits" in report:
            limits_tables(report["limits"])
        if "scale" in report:
            scale_tables(report["scale"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
