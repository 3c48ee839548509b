"""What `checksums=True` costs: one rank's file write with and without per-record CRC32.

Run: .venv/bin/python benchmarks/checksum_cost.py [--mib 256] [--repeat 3]
Writes the same records (64 fp32 tensors) with solosave's FileWriter (fsync on) into a temporary
directory, alternating the two settings, and prints the median seconds, throughput and ratio.
This is the background write phase only: the training loop's stall does not change.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from solosave._src.core.checksum import IMPLEMENTATION, crc32
from solosave._src.write.writer import FileWriter, Record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    n = a.mib * (1 << 20) // 4 // 64
    recs = [Record((f"t{i}", (0,)), tensor=torch.randn(n)) for i in range(64)]
    times: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(dir=".") as d:
        for _ in range(a.repeat):
            for crc in (False, True):
                t0 = time.perf_counter()
                FileWriter(checksums=crc).write_file(d, "__0_0.distcp", recs)
                times[crc].append(time.perf_counter() - t0)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    t0 = time.perf_counter()
    for r in recs:
        crc32(r.tensor.numpy().data)
    crc_only = time.perf_counter() - t0
    print(f"{a.mib} MiB, median of {a.repeat}: write {off:.3f} s ({a.mib / off:.0f} MiB/s) without "
          f"checksums, {on:.3f} s ({a.mib / on:.0f} MiB/s) with; ratio {on / off:.2f}x; "
          f"crc32 alone ({IMPLEMENTATION}'s) {crc_only:.3f} s ({a.mib / crc_only:.0f} MiB/s)")


if __name__ == "__main__":
    main()
