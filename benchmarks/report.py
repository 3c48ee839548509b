"""Terminal tables and PNG plots for a benchmark report (see ``benchmarks/__main__.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .save_modes import LABELS, MODES

Json = dict[str, Any]
MiB = 1 << 20
#: Width of the mode column of the save tables.
LW = max(len(v) for v in LABELS.values())


def fmt_bytes(n: float) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1024)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{int(n)} B"


def _x(v: float | None) -> str:
    return f"{v:.2f}x" if v is not None else "n/a"


def _kinds(k: dict[str, dict[str, int]]) -> str:
    return ", ".join(f"{n} x{v['count']} ({fmt_bytes(v['bytes'])})" for n, v in sorted(k.items())) or "none"


# ---------------------------------------------------------------------------------------------
# Save benchmark
# ---------------------------------------------------------------------------------------------

def print_save(save: Json) -> None:
    cfg = save["config"]
    for ws, entry in save["world_sizes"].items():
        ws_i = int(ws)
        print()
        print(f"=== world size {ws}: {cfg['total_mib']} MiB total, {cfg['total_mib'] / ws_i:g} MiB/rank "
              f"({cfg['count'] // ws_i} x {cfg['total_mib'] / cfg['count']:g} MiB fp32 tensors per rank); "
              f"{cfg['saves']} saves, first {cfg['warmup']} warm-up; medians of the rest ===")
        head = (f"{'mode':<{LW}} {'path':<10} {'block ms':>9} {'to_pub ms':>10} {'MB/s':>6} {'coll call':>9} "
                f"{'coll all':>8} {'payload':>10}  warm-up block / to_pub ms")
        print(head)
        print("-" * len(head))
        for m in MODES:
            me = entry["modes"].get(m)
            if me is None:
                continue
            if "error" in me:
                print(f"{LABELS[m]:<{LW}} FAILED: {me['error'].strip().splitlines()[-1]}")
                continue
            s = me["summary"]["steady_median"]
            path = "/".join(me["summary"]["steady_paths"])
            warm = "; ".join(f"{w['block_ms']:.0f} / {w['to_published_ms']:.0f}" for w in me["summary"]["warmup"])
            print(f"{LABELS[m]:<{LW}} {path:<10} {s['block_ms']:>9.1f} {s['to_published_ms']:>10.1f} "
                  f"{s['write_MBps']:>6.0f} {s['coll_calling_count']:>9.0f} {s['coll_total_count']:>8.0f} "
                  f"{fmt_bytes(s['coll_total_bytes']):>10}  {warm}")
        lim = entry.get("limits")
        if lim and "error" not in lim:
            print(f"limits (all ranks at once): memcpy {lim['memcpy_ms']:.1f} ms per rank "
                  f"({lim['memcpy_GBps_per_rank']:.2f} GB/s per rank); write+fsync {lim['write_ms']:.0f} ms "
                  f"({lim['write_MBps']:.0f} MB/s all ranks)")
        print("collectives per steady save (rank 0, every process of the rank):")
        for m in MODES:
            me = entry["modes"].get(m)
            if me and "summary" in me:
                print(f"  {LABELS[m]:<{LW}} {_kinds(me['summary']['steady_kinds_rank0'])}")
        if entry.get("ratios"):
            print("ratios (steady medians): block/memcpy, write throughput/raw write"
                  " [, DCP async (thread) block / this, to_published / this]")
            for m in MODES:
                r = entry["ratios"].get(m)
                if r is None:
                    continue
                parts = [f"{_x(r['block_over_memcpy']):>8}", f"{_x(r['write_over_raw_write']):>7}"]
                if "dcp_async_block_over_this" in r:
                    parts += [f"{_x(r['dcp_async_block_over_this']):>8}",
                              f"{_x(r['dcp_async_to_published_over_this']):>7}"]
                print(f"  {LABELS[m]:<{LW}} " + "  ".join(parts))
    print("* DCP async no-collectives writes no global .metadata (one __{rank}.metadata per rank): "
          "a different format, not loadable as one checkpoint by stock DCP.")


# ---------------------------------------------------------------------------------------------
# Scale simulation
# ---------------------------------------------------------------------------------------------

def print_scale(scale: Json) -> None:
    cfg = scale["config"]
    dcp = {r["world"]: r for r in scale["dcp"]}
    print()
    print(f"=== scale simulation: {cfg['tensors']} fp32 tensors (Llama-7B-like, {cfg['layers']} layers), "
          f"Shard(0) over W ranks, workers={cfg['workers']} file(s)/rank; one process; "
          f"stock DCP up to W={cfg['dcp_max_w']} ===")
    print("coordinator seconds per save (measured; network not included; reuse all_reduce modelled "
          f"as ceil(log2 W) x {cfg['reduce_model_s_per_level'] * 1e6:.0f} us)")
    head = (f"{'W':>6} {'chunks':>9} | {'DCP total':>9} {'plan+val':>8} {'finish':>7} | "
            f"{'solo coll':>9} {'plan+val':>8} {'finish':>7} | {'reuse pub':>9} {'rank/save':>9} | "
            f"{'tmpl once':>9} {'index once':>10}")
    print(head)
    print("-" * len(head))
    for s in scale["solosave"]:
        w = s["world"]
        d = dcp.get(w)
        dpart = (f"{d['coordinator_total_s']:>9.2f} {d['t_global_plan']:>8.2f} {d['t_finish_publish']:>7.2f}"
                 if d else f"{'not run':>9} {'':>8} {'':>7}")
        print(f"{w:>6} {w * cfg['tensors']:>9} | {dpart} | {s['coordinator_total_s']:>9.2f} "
              f"{s['t_global_plan']:>8.2f} {s['t_finish_publish']:>7.2f} | {s['reuse_coordinator_s']:>9.3f} "
              f"{s['t_reuse_rank_plan_and_guard'] * 1e3:>7.2f}ms | {s['t_template_once']:>9.2f} "
              f"{s['t_prepared_index_once']:>10.2f}")
    print("bytes")
    head = (f"{'W':>6} | {'DCP plan/rank':>13} {'DCP gathered':>12} {'DCP .metadata':>13} | "
            f"{'solo plan/rank':>14} {'solo gathered':>13} {'solo .metadata':>14} | {'load DCP s':>10} {'load solo s':>11} {'solo index':>10}")
    print(head)
    print("-" * len(head))
    for s in scale["solosave"]:
        w = s["world"]
        d = dcp.get(w)
        dg = (d["plan_bytes_gathered"] + d["result_bytes_gathered"]) if d else None
        sg = s["plan_bytes_gathered"] + s["result_bytes_gathered"]
        dpart = (f"{fmt_bytes(d['plan_bytes_per_rank']):>13} {fmt_bytes(dg):>12} {fmt_bytes(d['metadata_bytes']):>13}"
                 if d else f"{'not run':>13} {'':>12} {'':>13}")
        print(f"{w:>6} | {dpart} | {fmt_bytes(s['plan_bytes_per_rank']):>14} {fmt_bytes(sg):>13} "
              f"{fmt_bytes(s['metadata_bytes']):>14} | "
              f"{(format(d['t_load_unpickle'], '>10.2f') if d else 'not run'):>10} "
              f"{s['load_metadata_s_per_rank']:>11.3f} {fmt_bytes(s['load_read_bytes_per_rank']):>10}")
    print("gathered = plans + write results moved to the coordinator by the two gathers of one save. load: "
          "seconds per loading rank to learn where its shards are (DCP: unpickle .metadata; solosave: its "
          "load index, and the bytes a rank reads of it)")
    print("solosave payloads against the wire form before the typed protocol (rebuilt in scale.py: "
          "plain tuples, staged positions always sent as array('q')); new/old <= 1.000x: did not grow")
    head = (f"{'W':>6} | {'plan/rank':>10} {'old form':>10} {'new/old':>8} | {'results/rank':>12} {'old form':>10} "
            f"{'new/old':>8} | {'scatter (all)':>13} {'old form':>10} {'new/old':>8}")
    print(head)
    print("-" * len(head))
    for s in scale["solosave"]:
        if "plan_bytes_per_rank_old_form" not in s:
            continue
        print(f"{s['world']:>6} | {fmt_bytes(s['plan_bytes_per_rank']):>10} "
              f"{fmt_bytes(s['plan_bytes_per_rank_old_form']):>10} "
              f"{_x3(_ratio(s['plan_bytes_per_rank'], s['plan_bytes_per_rank_old_form'])):>8} | "
              f"{fmt_bytes(s['result_bytes_per_rank']):>12} {fmt_bytes(s['result_bytes_per_rank_old_form']):>10} "
              f"{_x3(_ratio(s['result_bytes_per_rank'], s['result_bytes_per_rank_old_form'])):>8} | "
              f"{fmt_bytes(s['scatter_bytes']):>13} {fmt_bytes(s['scatter_bytes_old_form']):>10} "
              f"{_x3(_ratio(s['scatter_bytes'], s['scatter_bytes_old_form'])):>8}")


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _x3(v: float | None) -> str:
    return f"{v:.3f}x" if v is not None else "n/a"


# ---------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------

def plotting_missing() -> str | None:
    """Why no plot can be drawn here (matplotlib cannot be imported), or ``None``."""
    try:
        import matplotlib  # noqa: F401 - only whether it imports
    except ImportError as e:
        return f"matplotlib cannot be imported ({e}); pip install 'solosave[plots]' to draw them"
    return None


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_save(save: Json, out: Path) -> list[Path]:
    plt = _plt()
    files = []
    wss = list(save["world_sizes"])
    modes = [m for m in MODES if any("summary" in save["world_sizes"][w]["modes"].get(m, {}) for w in wss)]
    fig, axes = plt.subplots(1, len(wss), figsize=(5.5 * len(wss), 4.8), squeeze=False)
    for ax, ws in zip(axes[0], wss):
        e = save["world_sizes"][ws]["modes"]
        y = range(len(modes))
        block = [e[m]["summary"]["steady_median"]["block_ms"] if "summary" in e.get(m, {}) else 0 for m in modes]
        pub = [e[m]["summary"]["steady_median"]["to_published_ms"] if "summary" in e.get(m, {}) else 0 for m in modes]
        ax.barh([i + 0.2 for i in y], block, height=0.4, label="block (training stall)", color="#d62728")
        ax.barh([i - 0.2 for i in y], pub, height=0.4, label="to published", color="#1f77b4")
        ax.set_yticks(list(y), [LABELS[m] for m in modes], fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("ms (median of steady saves, log)")
        ax.set_title(f"world size {ws}")
        lim = save["world_sizes"][ws].get("limits") or {}
        if "memcpy_ms" in lim:
            ax.axvline(lim["memcpy_ms"], color="#d62728", ls=":", lw=1, label="memcpy limit")
            ax.axvline(lim["write_ms"], color="#1f77b4", ls=":", lw=1, label="write+fsync limit")
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    files.append(out / "save_block_published.png")
    fig.savefig(files[-1], dpi=70)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(wss), figsize=(5.5 * len(wss), 4.8), squeeze=False)
    for ax, ws in zip(axes[0], wss):
        e = save["world_sizes"][ws]["modes"]
        y = range(len(modes))
        tot = [e[m]["summary"]["steady_median"]["coll_total_count"] if "summary" in e.get(m, {}) else 0 for m in modes]
        call = [e[m]["summary"]["steady_median"]["coll_calling_count"] if "summary" in e.get(m, {}) else 0 for m in modes]
        ax.barh([i - 0.2 for i in y], tot, height=0.4, label="all threads/processes", color="#9467bd")
        ax.barh([i + 0.2 for i in y], call, height=0.4, label="calling (training) thread", color="#ff7f0e")
        for i, m in enumerate(modes):
            if "summary" in e.get(m, {}):
                ax.text(tot[i] + 0.1, i - 0.2, fmt_bytes(e[m]["summary"]["steady_median"]["coll_total_bytes"]),
                        va="center", fontsize=7)
        ax.set_yticks(list(y), [LABELS[m] for m in modes], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("collectives per steady save (rank max), payload bytes")
        ax.set_title(f"world size {ws}")
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    files.append(out / "save_collectives.png")
    fig.savefig(files[-1], dpi=70)
    plt.close(fig)
    return files


def plot_scale(scale: Json, out: Path) -> list[Path]:
    plt = _plt()
    files = []
    s = scale["solosave"]
    d = scale["dcp"]
    ws = [r["world"] for r in s]
    wd = [r["world"] for r in d]
    fig, ax = plt.subplots(figsize=(7.5, 5))
    ax.loglog(wd, [r["coordinator_total_s"] for r in d], "o-", color="#7f7f7f", label="stock DCP: coordinator total")
    ax.loglog(wd, [r["t_global_plan"] for r in d], "o--", color="#7f7f7f", label="stock DCP: global plan + validation")
    ax.loglog(ws, [r["coordinator_total_s"] for r in s], "s-", color="#1f77b4", label="solosave collective: coordinator total")
    ax.loglog(ws, [r["t_global_plan"] for r in s], "s--", color="#1f77b4", label="solosave collective: global plan + validation")
    ax.loglog(ws, [r["reuse_coordinator_s"] for r in s], "^-", color="#2ca02c", label="solosave reuse: publish (+ modelled reduce)")
    ax.loglog(ws, [r["t_reuse_rank_plan_and_guard"] for r in s], "v-", color="#bcbd22", label="solosave reuse: per-rank work per save")
    ax.loglog(ws, [r["t_template_once"] for r in s], "x:", color="#2ca02c", label="solosave: template, once per prepared file")
    ax.loglog(wd, [r["t_load_unpickle"] for r in d], "D-", color="#d62728", label="stock DCP load: .metadata per rank")
    ax.loglog(ws, [r["load_metadata_s_per_rank"] for r in s], "D--", color="#d62728",
              label="solosave load: load index per rank")
    ax.axhline(5, color="#1f77b4", lw=0.6, ls=":")
    ax.axhline(1, color="#2ca02c", lw=0.6, ls=":")
    ax.set_xlabel("simulated world size W")
    ax.set_ylabel("seconds (one process, measured)")
    ax.set_title(f"coordinator work per save, {scale['config']['tensors']} tensors sharded over W")
    ax.legend(fontsize=7)
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    files.append(out / "scale_time.png")
    fig.savefig(files[-1], dpi=70)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7.5, 5))
    ax.loglog(wd, [r["plan_bytes_gathered"] + r["result_bytes_gathered"] for r in d], "o-", color="#7f7f7f",
              label="stock DCP: gathered to coordinator (plans + results)")
    ax.loglog(wd, [r["metadata_bytes"] for r in d], "o--", color="#7f7f7f", label="stock DCP: .metadata")
    ax.loglog(ws, [r["plan_bytes_gathered"] + r["result_bytes_gathered"] for r in s], "s-", color="#1f77b4",
              label="solosave collective: gathered (plans + results)")
    ax.loglog(ws, [r["metadata_bytes"] for r in s], "s--", color="#1f77b4", label="solosave: .metadata")
    ax.loglog(ws, [8 for _ in s], "^-", color="#2ca02c", label="solosave reuse: 8-byte all_reduce per rank")
    ax.set_xlabel("simulated world size W")
    ax.set_ylabel("bytes")
    ax.set_title("bytes per save")
    ax.legend(fontsize=7)
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    files.append(out / "scale_bytes.png")
    fig.savefig(files[-1], dpi=70)
    plt.close(fig)
    return files
