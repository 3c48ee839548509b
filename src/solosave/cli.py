"""The ``solosave`` command line: ``train``, ``inspect``, ``verify``, ``prepare``.

Every subcommand runs in one process without torch.distributed (``train`` launches its own
ranks). Errors a user can fix (a missing path, a directory without ``.metadata``, a corrupt or
mismatched prepared file) print one ``solosave <command>: error: ...`` line and exit with 2;
``verify`` exits with 1 when it finds problems in a readable checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from typing import Any


def _inspect(path: str, as_json: bool) -> int:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ._prepared import load_prepared_metadata

    prepared = load_prepared_metadata(path)
    md = prepared.metadata
    items = []
    for fqn in sorted(md.state_dict_metadata):
        m = md.state_dict_metadata[fqn]
        if isinstance(m, TensorStorageMetadata):
            items.append({"key": fqn, "kind": "tensor", "shape": list(m.size),
                          "dtype": str(m.properties.dtype).removeprefix("torch."), "chunks": len(m.chunks)})
        else:
            items.append({"key": fqn, "kind": "bytes"})
    files: dict[str, int] = defaultdict(int)
    for info in md.storage_data.values():
        files[info.relative_path] += int(info.length)
    from ._format import parse_file_name

    ranks: dict[int, int] = defaultdict(int)
    for f, n in files.items():
        parsed = parse_file_name(f)
        if parsed is not None:
            ranks[parsed[0]] += n
    fp = prepared.fingerprint
    report: dict[str, Any] = {
        "source": prepared.source,
        "items": items,
        "files": dict(sorted(files.items())),
        "bytes_per_rank": {str(r): n for r, n in sorted(ranks.items())},
        "storage_meta": {"checkpoint_id": str(getattr(md.storage_meta, "checkpoint_id", None)),
                         "save_id": getattr(md.storage_meta, "save_id", None)},
        "fingerprint": json.loads(fp.to_json()),
    }
    if as_json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{prepared.source}: {len(items)} items, {len(files)} files, {sum(files.values())} bytes")
    for it in items:
        shape = f"{it['dtype']}{it['shape']} in {it['chunks']} chunk(s)" if it["kind"] == "tensor" else "bytes"
        print(f"  {it['key']:<50} {shape}")
    for f, n in report["files"].items():
        print(f"  file {f}: {n} bytes")
    for r, n in report["bytes_per_rank"].items():
        print(f"  rank {r}: {n} bytes")
    print(f"  storage_meta: {report['storage_meta']}")
    print(f"  fingerprint: {report['fingerprint']}")
    return 0


def _prepare(src: str, out: str, world_size: int | None, workers: int | None) -> int:
    from ._prepared import PreparedMetadata, load_prepared_metadata, save_prepared_metadata

    p = load_prepared_metadata(src)
    save_prepared_metadata(PreparedMetadata.from_metadata(p.metadata, world_size, workers, source=out), out)
    print(f"wrote prepared metadata {out} from {p.source}")
    return 0


def _verify(path: str, prepared: str | None, as_json: bool, checksums: bool, progress: bool) -> int:
    from ._progress import ProgressBar
    from ._verify import verify_checkpoint

    bars: list[ProgressBar] = []

    def advance(n: int, total: int) -> None:
        if not bars:  # sized on the first read; drawn only for large checkpoints
            bars.append(ProgressBar(total / 1e6, "verify", unit="MB", enabled=progress and total >= (64 << 20)))
        bars[0].update(n / 1e6)

    try:
        report = verify_checkpoint(path, prepared=prepared, checksums=checksums, progress=advance)
    finally:
        for bar in bars:
            bar.close()
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(f"{report.path}: {report.items} items, {report.records} records in {len(report.files)} "
              f"files, {sum(report.files.values())} bytes")
        print(f"  checksums: {report.checksums}"
              + (f" ({report.checksummed_records} records match)" if report.checksums != "absent" else
                 " (save with checksums=True / --ckpt-checksums to record them)"))
        if report.prepared is not None:
            print(f"  prepared metadata {prepared}: {report.prepared}")
        if report.problems:
            print(f"{len(report.problems)} problem(s):")
            for p in report.problems:
                print(f"  - {p}")
        else:
            print("OK")
    return 0 if report.ok else 1


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="solosave",
        description="Asynchronous DCP checkpoints whose steady-state saves need one 8-byte all_reduce.")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="the main job: train a small GPT on N local ranks with async "
                       "solosave checkpoints (see `solosave train --help`)", add_help=False)
    t.add_argument("args", nargs=argparse.REMAINDER, help="options of the job (see `solosave train --help`)")
    i = sub.add_parser("inspect", help="show a checkpoint directory, .metadata or prepared file: "
                       "items, files, storage_meta, fingerprint")
    i.add_argument("path", help="checkpoint directory, .metadata file or prepared-metadata file")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    v = sub.add_parser("verify", help="check that a checkpoint's data files hold every byte range "
                       "its .metadata names (and recorded checksums match)")
    v.add_argument("path", help="checkpoint directory")
    v.add_argument("--prepared", metavar="FILE", default=None,
                   help="also check that this prepared-metadata file matches the checkpoint's layout")
    v.add_argument("--no-checksums", action="store_true", help="skip the checksum pass even if recorded")
    v.add_argument("--json", action="store_true", help="machine-readable output")
    v.add_argument("--no-progress", action="store_true", help="no progress bar")
    p = sub.add_parser("prepare", help="make a prepared-metadata file from an existing checkpoint")
    p.add_argument("--from", dest="src", required=True, help="checkpoint directory or .metadata file")
    p.add_argument("--out", required=True, help="prepared-metadata file to write")
    p.add_argument("--world-size", type=_positive, default=None, help="record the run's world size (>= 1)")
    p.add_argument("--workers", type=_positive, default=None, help="record the run's files per rank (>= 1)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        from .demo.launch import main as train_main

        return train_main(argv[1:])
    args = build_parser().parse_args(argv)
    from ._errors import SolosaveError

    try:
        if args.command == "inspect":
            return _inspect(args.path, args.json)
        if args.command == "prepare":
            return _prepare(args.src, args.out, args.world_size, args.workers)
        if args.command == "verify":
            return _verify(args.path, args.prepared, args.json, not args.no_checksums,
                           not args.no_progress)
    except (SolosaveError, OSError) as e:
        print(f"solosave {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 1  # pragma: no cover - argparse enforces a command


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
