"""The demo's output, written by rank 0: a progress bar, one line per finished save, JSON lines
(``--json-log``: every step and save) and a summary table of the saves at the end. Other ranks
hold a :class:`Reporter` too and call the same methods; it prints nothing for them."""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

from solosave._src.storage.registry import backend_for, storage_for


class Reporter:
    """Rank 0's output: progress bar, one line per finished save, JSON lines, summary table."""

    def __init__(self, args: argparse.Namespace, rank: int, start_step: int) -> None:
        from solosave._src.core.progress import ProgressBar

        self.rank = rank
        self.storage_options = getattr(args, "storage_options", None)
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
            self.bar.write(f"save  {backend_for(done.path).basename(done.path)}  FAILED: {done.error}")
        else:
            r = done.result
            storage = storage_for(done.path, self.storage_options)  # a local path or a URL
            total_bytes = sum(storage.size(storage.join(done.path, f)) for f in storage.listdir(done.path)
                              if f.endswith(".distcp"))
            loop = sum(v["count"] for v in r.collectives("calling_thread").values())
            allc = r.collectives("all")
            rec.update(ok=True, mode=r.mode, block_ms=r.timings.block * 1e3,
                       to_published_ms=r.timings.to_published * 1e3, bytes_rank0=r.bytes_written,
                       bytes_total=total_bytes, collectives_in_loop=loop,
                       collectives_total=sum(v["count"] for v in allc.values()),
                       collective_bytes=sum(v["bytes"] for v in allc.values()), collectives=allc)
            kinds = ", ".join(f"{k} x{v['count']} ({v['bytes']} B)" for k, v in allc.items())
            lag = ""
            if r.durable is not None:  # two tiers: how far the durable tier is behind
                rec.update(durable_behind=r.durable_behind, durable_lag_s=r.durable_lag_s)
                lag = (f"  durable: {r.durable_behind} save(s) behind, {r.durable_lag_s:.1f} s"
                       if r.durable_behind else "  durable: up to date")
            self.bar.write(
                f"save  {storage.basename(done.path)}  step {done.step:>5}  mode={r.mode:<15} "
                f"block {rec['block_ms']:7.2f} ms  published after {rec['to_published_ms']:8.1f} ms  "
                f"{total_bytes / 1e6:6.2f} MB  collectives in loop {loop} / total "
                f"{rec['collectives_total']} [{kinds}]{lag}")
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
