"""Checkpoints across torch versions: ``write DIR`` with one torch, ``read DIR`` with another.

Run with ``PYTHONPATH=src`` by any venv (tools/torch_versions.sh runs it between the main .venv
and each tested version)::

    PYTHONPATH=src .venv/bin/python tools/torch_roundtrip.py write /tmp/rt
    PYTHONPATH=src .venv-torch-2.8.0/bin/python tools/torch_roundtrip.py read /tmp/rt

``write`` saves, from 2 processes (gloo on 127.0.0.1), one state (plain tensors of many dtypes
with NaN, -0.0 and inf; DTensors sharded over the 2 ranks, one unevenly; an optimizer-like nested
dict; ints, strings, lists, a tuple; a tensor only one rank has) three times:

* ``DIR/dropin``: ``solosave.save(state, checkpoint_id=...)`` (the DCP drop-in);
* ``DIR/create``: an ``AsyncCheckpointer`` that creates ``DIR/prepared.metadata`` (collective save);
* ``DIR/reuse``: the same checkpointer's next save, other values, on the reuse path.

and ``DIR/expected.pt`` (torch.save: every rank's values, deterministic from the seed).

``read`` loads each checkpoint at world size 2 with ``solosave.load`` (through the load index,
and with ``use_index=False`` from ``.metadata``) and with stock ``torch.distributed.checkpoint.load``,
compares every value bit for bit (dtype, shape and bytes; DTensors: each rank's shard), and runs
``solosave.verify_checkpoint`` on each. One line per (checkpoint, loader), PASS or FAIL; exit
status 1 on any failure. Every wait is bounded (``--timeout``, default 300 s per phase).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: benchmarks
from benchmarks.ranks import run_ranks  # noqa: E402 - after the path

WORLD_SIZE = 2
SEED = 1234
CHECKPOINTS = {"dropin": 0, "create": 1, "reuse": 2}  # sub-folder -> variant of the values
LOADERS = ("solosave.load", "solosave.load(use_index=False)", "dcp.load")


# -- the state ---------------------------------------------------------------------------------

def _special(dtype: torch.dtype) -> torch.Tensor:
    """Values whose bits a lossy copy would change: NaN (two payloads), -0.0, +-inf, denormals."""
    bits = torch.tensor([0x7FC00001, 0xFFC12345, 0x80000000, 0x7F800000, 0xFF800000, 0x00000001],
                        dtype=torch.int64).to(torch.int32)
    return bits.view(torch.float32).to(dtype) if dtype != torch.float32 else bits.view(torch.float32).clone()


def make_state(rank: int, variant: int, seed: int = SEED) -> dict[str, Any]:
    """The state of ``rank`` (DTensor entries as their full tensors, under "dt"). Tensors under
    one key are the same on every rank (DCP saves them once), except "rank<r>_only"."""
    g = torch.Generator().manual_seed(seed * 10 + variant)

    def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    plain = {
        "f32": torch.cat([randn(37), _special(torch.float32)]),
        "f64": torch.cat([randn(5, dtype=torch.float64), _special(torch.float64)]),
        "bf16": randn(8, 16, dtype=torch.bfloat16),
        "f16": torch.cat([randn(9, dtype=torch.float16), _special(torch.float16)]),
        "i8": torch.randint(-128, 128, (11,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 256, (3, 4), generator=g, dtype=torch.uint8),
        "i32": torch.randint(-(2**31), 2**31 - 1, (7,), generator=g, dtype=torch.int32),
        "i64": torch.arange(6, dtype=torch.int64) * (2**40 + variant),
        "bool": torch.randint(0, 2, (13,), generator=g).bool(),
        "c64": torch.complex(randn(4), randn(4)),
        "scalar": torch.tensor(3.5 + variant),
        "empty": torch.zeros(0, 3),
    }
    if hasattr(torch, "float8_e4m3fn"):
        plain["f8"] = randn(10).to(torch.float8_e4m3fn)
    g_rank = torch.Generator().manual_seed(seed * 10 + variant + 1000 * (rank + 1))
    return {
        "model": plain,
        "dt": {"rows": torch.randn(24, 5, generator=g),  # Shard(0): 12 rows a rank
               "uneven": torch.randn(7, 3, generator=g).to(torch.bfloat16)},  # 4 and 3 rows
        "optim": {
            "state": {f"layer{i}.weight": {"step": torch.tensor(float(10 + variant)),
                                           "exp_avg": randn(4, 4), "exp_avg_sq": randn(4, 4).abs()}
                      for i in range(2)},
            "param_groups": [{"lr": 0.001 * (1 + variant), "betas": (0.9, 0.999), "weight_decay": 0.0,
                              "params": ["layer0.weight", "layer1.weight"]}],
        },
        "meta": {"step": 100 + variant, "name": f"run-{variant}", "sched": [1, 2, variant], "lr": 0.25},
        "mixed": [torch.arange(4, dtype=torch.int64) + variant, "tail"],
        f"rank{rank}_only": torch.randn(3, generator=g_rank),
    }


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (WORLD_SIZE,))


def _dtensor_api() -> tuple[Any, Any]:
    try:
        from torch.distributed.tensor import Shard, distribute_tensor
    except ImportError:  # an older torch: the private module
        from torch.distributed._tensor import Shard, distribute_tensor  # type: ignore[no-redef]
    return Shard, distribute_tensor


def materialize(state: dict[str, Any], mesh: Any) -> dict[str, Any]:
    """``state`` with its "dt" entries distributed over ``mesh`` (Shard(0))."""
    shard, distribute_tensor = _dtensor_api()
    out = dict(state)
    out["dt"] = {k: distribute_tensor(v, mesh, [shard(0)]) for k, v in state["dt"].items()}
    return out


def _is_terminal_list(value: list) -> bool:  # as DCP's traversal: a list of plain values is one value
    return not any(isinstance(v, (dict, list, torch.Tensor)) for v in value)


def target_like(obj: Any) -> Any:
    """A load target with ``obj``'s structure: zeroed tensors, None for other values."""
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    if isinstance(obj, dict):
        return {k: target_like(v) for k, v in obj.items()}
    if isinstance(obj, list) and not _is_terminal_list(obj):
        return [target_like(v) for v in obj]
    return None


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        return {k: v for key, sub in obj.items() for k, v in flatten(sub, f"{prefix}{key}.").items()}
    if isinstance(obj, list) and not _is_terminal_list(obj):
        return {k: v for i, sub in enumerate(obj) for k, v in flatten(sub, f"{prefix}{i}.").items()}
    return {prefix[:-1]: obj}


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().reshape(-1)
    return t.to(torch.uint8) if t.dtype == torch.bool else t.view(torch.uint8)


def differences(got: dict[str, Any], expected: dict[str, Any], rank: int) -> list[str]:
    """Every key whose loaded value is not ``expected``'s, bit for bit (DTensors: ``rank``'s
    Shard(0) chunk of the full tensor ``expected`` holds)."""
    got_flat, exp_flat = flatten(got), flatten(expected)
    problems = [f"{k}: missing" for k in exp_flat if k not in got_flat]
    for k, want in exp_flat.items():
        if k not in got_flat:
            continue
        have = got_flat[k]
        if hasattr(have, "to_local"):  # a DTensor: its shard (no collective), and the full shape
            if tuple(have.shape) != tuple(want.shape):
                problems.append(f"{k}: DTensor of shape {list(have.shape)}, expected {list(want.shape)}")
                continue
            have, want = have.to_local(), torch.chunk(want, WORLD_SIZE, dim=0)[rank]
        if isinstance(want, torch.Tensor):
            if not isinstance(have, torch.Tensor):
                problems.append(f"{k}: {type(have).__name__}, not a tensor")
            elif have.dtype != want.dtype or have.shape != want.shape:
                problems.append(f"{k}: {have.dtype}{list(have.shape)}, expected {want.dtype}{list(want.shape)}")
            elif not torch.equal(_bits(have), _bits(want)):
                problems.append(f"{k}: bytes differ")
        elif type(have) is not type(want) or have != want:
            problems.append(f"{k}: {have!r}, expected {want!r}")
    return problems


# -- the two modes, on each rank -----------------------------------------------------------------

def _write(rank: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    import solosave

    mesh = _mesh()
    modes: dict[str, Any] = {}
    solosave.save(materialize(make_state(rank, CHECKPOINTS["dropin"]), mesh), checkpoint_id=f"{root}/dropin")
    modes["dropin"] = solosave.default_saver.last_result().mode
    solosave.default_saver.close()
    with solosave.AsyncCheckpointer(prepared_metadata=f"{root}/prepared.metadata", create_prepared_metadata=True,
                                    checksums=True, timeout=120.0) as ck:
        for name in ("create", "reuse"):
            result = ck.save(materialize(make_state(rank, CHECKPOINTS[name]), mesh), f"{root}/{name}").wait(120)
            modes[name] = result.mode
    dist.barrier()
    return modes


def _read(rank: int, root: str) -> dict[tuple[str, str], list[str]]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import solosave

    mesh = _mesh()
    expected = torch.load(f"{root}/expected.pt", weights_only=True)["ranks"][rank]
    out: dict[tuple[str, str], list[str]] = {}
    for name in CHECKPOINTS:
        want = expected[name]
        for loader in LOADERS:
            target = materialize(target_like(want), mesh)
            try:
                if loader == "dcp.load":
                    dcp.load(target, checkpoint_id=f"{root}/{name}")
                else:
                    solosave.load(target, f"{root}/{name}", use_index=loader == "solosave.load")
                out[(name, loader)] = differences(target, want, rank)
            except Exception:  # noqa: BLE001 - reported as this loader's failure
                out[(name, loader)] = [traceback.format_exc()]
            dist.barrier()
    return out


# -- processes ------------------------------------------------------------------------------------

def _phase(rank: int, world_size: int, mode: str, root: str) -> Any:
    torch.set_num_threads(1)
    return (_write if mode == "write" else _read)(rank, root)


def run_phase(mode: str, root: str, timeout: float) -> dict[int, tuple[str, Any]]:
    """``{rank: ("ok", value) | ("err", why)}`` from the project's bounded launcher
    (``benchmarks.ranks.run_ranks``: spawned ranks, gloo on 127.0.0.1, every rank killed past
    ``timeout``)."""
    try:
        values = run_ranks(_phase, WORLD_SIZE, mode, root, timeout=timeout)
    except AssertionError as e:  # the launcher's report: every failing rank's traceback
        return {r: ("err", str(e)) for r in range(WORLD_SIZE)}
    return {r: ("ok", v) for r, v in enumerate(values)}


def _writer_of(root: str) -> str:
    try:
        return Path(root, "writer.txt").read_text().strip()
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("write", "read"))
    ap.add_argument("dir")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per phase (default 300)")
    args = ap.parse_args(argv)
    root = os.path.abspath(args.dir)
    here = torch.__version__.split("+")[0]
    t0 = time.monotonic()
    if args.mode == "write":
        Path(root).mkdir(parents=True, exist_ok=True)
        Path(root, "writer.txt").write_text(f"{here}\n")
        torch.save({"seed": SEED, "torch": here,
                    "ranks": {r: {name: make_state(r, v) for name, v in CHECKPOINTS.items()}
                              for r in range(WORLD_SIZE)}}, f"{root}/expected.pt")
        got = run_phase("write", root, args.timeout)
        bad = {r: v for r, (kind, v) in got.items() if kind != "ok"}
        for r, tb in sorted(bad.items()):
            print(f"rank {r}:\n{tb}", file=sys.stderr)
        modes = got[0][1] if not bad else {}
        status = "FAIL" if bad else "PASS"
        print(f"write torch {here} {root}: {status} (modes {modes}; {time.monotonic() - t0:.0f} s)")
        return 1 if bad else 0

    from solosave import verify_checkpoint

    writer = _writer_of(root)
    got = run_phase("read", root, args.timeout)
    failed = False
    for name in CHECKPOINTS:
        for loader in LOADERS:
            problems = []
            for r, (kind, value) in sorted(got.items()):
                if kind != "ok":
                    problems.append(f"rank {r}: {value}")
                elif value[(name, loader)]:
                    problems += [f"rank {r}: {p}" for p in value[(name, loader)]]
            failed |= bool(problems)
            print(f"{name} {loader} (written by torch {writer}, read by {here}): {'FAIL' if problems else 'PASS'}")
            for p in problems[:20]:
                print("    " + p.replace("\n", "\n    "))
        try:
            report = verify_checkpoint(f"{root}/{name}")
            problems = list(report.problems)
            detail = f"checksums {report.checksum_summary()}, index {report.index}"
        except Exception:  # noqa: BLE001 - reported as a failure
            problems, detail = [traceback.format_exc()], "raised"
        failed |= bool(problems)
        print(f"{name} verify (written by torch {writer}, read by {here}): {'FAIL' if problems else 'PASS'} ({detail})")
        for p in problems[:20]:
            print("    " + p.replace("\n", "\n    "))
    print(f"read torch {here} {root}: {'FAIL' if failed else 'PASS'} ({time.monotonic() - t0:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
