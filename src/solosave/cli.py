"""The ``solosave`` command line: ``train``, ``inspect``, ``verify``, ``prepare``, ``export``.

``inspect``, ``verify`` and ``prepare`` take URLs too (``s3://bucket/run/iter_0000100``), with the
storage's usual credentials (for S3 the standard AWS variables) or ``--storage-options JSON``.

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


def _inspect(path: str, as_json: bool, storage_options: dict | None = None) -> int:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from solosave._src.prepared.prepared import load_prepared_metadata

    prepared = load_prepared_metadata(path, storage_options=storage_options)
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
    from solosave._src.formats.dcp import parse_file_name

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


def _prepare(src: str, out: str, world_size: int | None, workers: int | None,
             storage_options: dict | None = None) -> int:
    from solosave._src.prepared.prepared import (
        PreparedMetadata,
        check_prepared_target,
        load_prepared_metadata,
        save_prepared_metadata,
    )

    check_prepared_target(out, storage_options)  # before reading the checkpoint
    p = load_prepared_metadata(src, storage_options=storage_options)
    save_prepared_metadata(PreparedMetadata.from_metadata(p.metadata, world_size, workers, source=out), out,
                           storage_options=storage_options)
    print(f"wrote prepared metadata {out} from {p.source}")
    return 0


def _verify(path: str, prepared: str | None, as_json: bool, checksums: bool, progress: bool,
            storage_options: dict | None = None) -> int:
    from solosave._src.core.progress import ProgressBar
    from solosave._src.tools.verify import verify_checkpoint

    bars: list[ProgressBar] = []

    def advance(n: int, total: int) -> None:
        if not bars:  # sized on the first read; drawn only for large checkpoints
            bars.append(ProgressBar(total / 1e6, "verify", unit="MB", enabled=progress and total >= (64 << 20)))
        bars[0].update(n / 1e6)

    try:
        report = verify_checkpoint(path, prepared=prepared, checksums=checksums, progress=advance,
                                   storage_options=storage_options)
    finally:
        for bar in bars:
            bar.close()
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(f"{report.path}: {report.items} items, {report.records} records in {len(report.files)} "
              f"files, {sum(report.files.values())} bytes")
        print(f"  checksums: {report.checksum_summary()}"
              + (" (save with checksums=True / --ckpt-checksums to record them)" if report.checksums == "absent"
                 else ""))
        if report.prepared is not None:
            print(f"  prepared metadata {prepared}: {report.prepared}")
        if report.index is not None:
            print(f"  load index: {report.index}")
        if report.problems:
            print(f"{len(report.problems)} problem(s):")
            for p in report.problems:
                print(f"  - {p}")
        else:
            print("OK")
    return 0 if report.ok else 1


def _export(args: argparse.Namespace) -> int:
    from solosave._src.core.progress import ProgressBar
    from solosave._src.tools.export import export

    bars: list[ProgressBar] = []

    def advance(n: int, total: int) -> None:
        if not bars:  # sized on the first read; by default drawn only for large exports
            shown = args.progress if args.progress is not None else total >= (64 << 20)
            bars.append(ProgressBar(total / 1e6, "export", unit="MB", enabled=shown))
        bars[0].update(n / 1e6)

    try:
        report = export(args.path, args.out, format=args.format, max_shard_size=args.max_shard_size,
                        prefix=args.prefix, overwrite=args.overwrite, progress=advance)
    except (ImportError, KeyError, ValueError) as e:
        print(f"solosave export: error: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return 2
    finally:
        for bar in bars:
            bar.close()
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    print(f"{report.out}: {report.tensors} tensors ({report.total_size} bytes)"
          + (f" and {report.values} other values" if report.values else "")
          + f" from {report.checkpoint}, {report.format} in {len(report.files)} file(s)")
    for name in report.files + ((report.index,) if report.index else ()):
        print(f"  {name}")
    if report.skipped:
        print(f"{len(report.skipped)} value(s) not exported:")
        for key, reason in report.skipped:
            print(f"  - {key}: {reason}")
    return 0


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _size(text: str) -> int:
    from solosave._src.tools.export import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _storage_flag(parser: argparse.ArgumentParser) -> None:
    from solosave._src.save.options import json_object

    parser.add_argument("--storage-options", type=json_object, default=None, metavar="JSON",
                        help="paths may be URLs (s3://bucket/path; pip install 'solosave[s3]'): keyword "
                        "arguments of their fsspec filesystem (default: the standard AWS variables apply)")


def build_parser() -> argparse.ArgumentParser:
    """Build the ``solosave`` argument parser, with one subparser per command.

    The commands are ``train`` (its options are left to ``solosave train --help``), ``inspect``,
    ``verify``, ``prepare`` and ``export``; ``--version`` prints the installed version.
    """
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="solosave",
        description="Asynchronous DCP checkpoints whose steady-state saves need one 8-byte all_reduce.")
    parser.add_argument("--version", action="version", version=f"solosave {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="the main job: train a small GPT on N local ranks with async "
                       "solosave checkpoints (see `solosave train --help`)", add_help=False)
    t.add_argument("args", nargs=argparse.REMAINDER, help="options of the job (see `solosave train --help`)")
    i = sub.add_parser("inspect", help="show a checkpoint directory, .metadata or prepared file: "
                       "items, files, storage_meta, fingerprint")
    i.add_argument("path", help="prepared-metadata file, .metadata file or checkpoint directory (a path or a URL)")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    _storage_flag(i)
    v = sub.add_parser("verify", help="check that a checkpoint's data files hold every byte range "
                       "its .metadata names (and recorded checksums match)")
    v.add_argument("path", help="checkpoint directory")
    v.add_argument("--prepared", metavar="FILE", default=None,
                   help="also check that this prepared-metadata file matches the checkpoint's layout")
    v.add_argument("--no-checksums", action="store_true", help="skip the checksum pass even if recorded")
    v.add_argument("--json", action="store_true", help="machine-readable output")
    v.add_argument("--no-progress", action="store_true", help="no progress bar")
    _storage_flag(v)
    p = sub.add_parser("prepare", help="make a prepared-metadata file from an existing checkpoint")
    p.add_argument("--from", dest="src", required=True, help="checkpoint directory or .metadata file")
    p.add_argument("--out", required=True, help="prepared-metadata file to write")
    p.add_argument("--world-size", type=_positive, default=None, help="record the run's world size (>= 1)")
    p.add_argument("--workers", type=_positive, default=None, help="record the run's files per rank (>= 1)")
    _storage_flag(p)
    e = sub.add_parser("export", help="write a checkpoint's full (unsharded) tensors as safetensors or a "
                       "torch.save file, for evaluation and serving")
    e.add_argument("path", help="checkpoint directory")
    e.add_argument("out", help="directory to write (new or empty, unless --overwrite)")
    e.add_argument("--format", choices=("safetensors", "torch"), default="safetensors",
                   help="safetensors (tensors only; other values are listed) or torch (torch.save, all "
                   "values); default: safetensors")
    e.add_argument("--max-shard-size", type=_size, default=None, metavar="SIZE",
                   help="split into model-0000i-of-0000N files plus an index above this size, e.g. 5GB "
                   "(default: 5GB for safetensors, one file for torch)")
    e.add_argument("--prefix", default="", help="export only the keys starting with this prefix, "
                   "written without it (e.g. model.)")
    e.add_argument("--overwrite", action="store_true", help="replace an earlier export in OUT")
    shown = e.add_mutually_exclusive_group()
    shown.add_argument("--progress", dest="progress", action="store_const", const=True, default=None,
                       help="always draw a progress bar (default: only for exports over 64 MB)")
    shown.add_argument("--no-progress", dest="progress", action="store_const", const=False, help="no progress bar")
    e.add_argument("--json", action="store_true", help="machine-readable report")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``solosave`` command line on ``argv`` and return its exit status.

    ``argv`` defaults to ``sys.argv[1:]``. ``train`` hands the rest of ``argv`` to the demo job's
    launcher. The other commands are parsed by :func:`build_parser`; an error a user can fix (a
    solosave error, ``OSError``, ``ImportError`` or ``ValueError``) prints one
    ``solosave <command>: error: ...`` line to stderr and returns 2. Bad arguments exit through
    argparse.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        from .demo.launch import main as train_main

        return train_main(argv[1:])
    args = build_parser().parse_args(argv)
    from solosave._src.core.errors import SolosaveError

    try:
        if args.command == "inspect":
            return _inspect(args.path, args.json, args.storage_options)
        if args.command == "prepare":
            return _prepare(args.src, args.out, args.world_size, args.workers, args.storage_options)
        if args.command == "export":
            return _export(args)
        if args.command == "verify":
            return _verify(args.path, args.prepared, args.json, not args.no_checksums,
                           not args.no_progress, args.storage_options)
    except (SolosaveError, OSError, ImportError, ValueError) as e:  # (a bad URL: ValueError, ImportError)
        print(f"solosave {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 1  # pragma: no cover - argparse enforces a command


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
