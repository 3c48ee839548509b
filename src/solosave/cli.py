"""The ``solosave`` command line: ``demo``, ``inspect``, ``prepare``."""

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
    fp = prepared.fingerprint
    report: dict[str, Any] = {
        "source": prepared.source,
        "items": items,
        "files": dict(sorted(files.items())),
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
    print(f"  storage_meta: {report['storage_meta']}")
    print(f"  fingerprint: {report['fingerprint']}")
    return 0


def _prepare(src: str, out: str, world_size: int | None, workers: int | None) -> int:
    from ._prepared import PreparedMetadata, load_prepared_metadata, save_prepared_metadata

    p = load_prepared_metadata(src)
    save_prepared_metadata(PreparedMetadata.from_metadata(p.metadata, world_size, workers, source=out), out)
    print(f"wrote prepared metadata {out} from {p.source}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="solosave",
        description="Asynchronous DCP checkpoints whose steady-state saves need one 8-byte all_reduce.")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run the demo job: N local ranks, async create-then-reuse saves",
                       add_help=False)
    d.add_argument("args", nargs=argparse.REMAINDER, help="options of the demo (see `solosave demo --help`)")
    i = sub.add_parser("inspect", help="show a checkpoint directory, .metadata or prepared file")
    i.add_argument("path")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser("prepare", help="make a prepared-metadata file from an existing checkpoint")
    p.add_argument("--from", dest="src", required=True, help="checkpoint directory or .metadata file")
    p.add_argument("--out", required=True, help="prepared-metadata file to write")
    p.add_argument("--world-size", type=int, default=None, help="record the run's world size")
    p.add_argument("--workers", type=int, default=None, help="record the run's files per rank")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:
        from .demo import main as demo_main

        return demo_main(argv[1:])
    args = build_parser().parse_args(argv)
    from ._errors import SolosaveError

    try:
        if args.command == "inspect":
            return _inspect(args.path, args.json)
        if args.command == "prepare":
            return _prepare(args.src, args.out, args.world_size, args.workers)
    except (SolosaveError, OSError) as e:
        print(f"solosave {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 1  # pragma: no cover - argparse enforces a command


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
