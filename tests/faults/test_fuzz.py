"""Fuzzing every reader of bytes from storage, on real files made by real saves.

Each target is a file that solosave reads (a ``.metadata`` as solosave and as stock DCP write it,
the load index, prepared files of versions 2, 3 and 4, data files through the record decoder and
through ``solosave.load``, a checksum file) and the reader(s) that take it. Every mutation (bits
flipped, bytes set to 0x00 / 0xFF / 0x7F / 0x80, 8-byte runs of them over length fields, a
truncation, bytes inserted or deleted) is written over the real file, read, and must end in

* a value (a ``Metadata`` of the shape DCP's loaders need, a layout, a report), or
* a solosave exception (:class:`solosave.SolosaveError`: a clear error naming the file),

never another exception, never longer than ``SLOW_S`` seconds, and never an allocation sized by
a number in the file: the readers run under an address-space limit of what the process uses
plus 1 GiB (the files are kilobytes). Where a fast path refuses its input, the load takes the
safe path: a damaged load index or data record still gives the exact values or a solosave error.

The default run (CI) does 2,920 mutations with a fixed seed in well under a minute. On
demand, more::

    SOLOSAVE_FUZZ_ROUNDS=20 SOLOSAVE_FUZZ_SEED=7 .venv/bin/python -m pytest -q tests/faults/test_fuzz.py

(``ROUNDS`` multiplies every target's count; ``SEED`` picks other mutations.) A failure names the
target, the seed and the mutation's number and description: ``mutate(data, seed, target, i)``
replays it.
"""

from __future__ import annotations

import os
import random
import resource
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import solosave
from solosave._src.core.errors import SolosaveError
from solosave._src.formats.metadata_check import metadata_problem
from solosave._src.formats.record_reader import RecordCache, TensorLayout, parse_tensor_record
from solosave._src.index.reader import LoadIndex, wanted_of
from solosave._src.load.load import parse_metadata
from solosave._src.prepared.prepared import load_prepared_metadata
from solosave._src.write.writer import FileWriter
from tests import crafted
from tests.support import dcp_save_local, equal, zeros_like
from tests.unit.engine.test_engine import Ranks

ROUNDS = float(os.environ.get("SOLOSAVE_FUZZ_ROUNDS", "1"))
SEED = int(os.environ.get("SOLOSAVE_FUZZ_SEED", "29"))
SLOW_S = 10.0
HEADROOM = 1 << 30

pytestmark = pytest.mark.timeout(max(300, int(300 * ROUNDS)))


def mutate(data: bytes, seed: int, target: str, i: int) -> tuple[bytes, str]:
    """Mutation ``i`` of ``data`` for ``target`` (reproducible alone) and what it did."""
    rng = random.Random(f"{seed}:{target}:{i}")
    out = bytearray(data)
    kind = rng.randrange(8)
    if kind <= 2:
        at = sorted(rng.randrange(len(out)) for _ in range(rng.choice((1, 1, 2, 3))))
        for a in at:
            out[a] ^= 1 << rng.randrange(8)
        return bytes(out), f"bits flipped at {at}"
    if kind == 3:
        a = rng.randrange(len(out))
        out[a] = rng.choice((0x00, 0xFF, 0x7F, 0x80, 0x01))
        return bytes(out), f"byte {a} set to {out[a]:#04x}"
    if kind == 4:
        a, fill = rng.randrange(len(out)), rng.choice((b"\xff", b"\x00", b"\x7f"))
        out[a:a + 8] = fill * 8
        return bytes(out[:len(data)]), f"8 bytes at {a} set to {fill!r}"
    if kind == 5:
        a = rng.randrange(len(out))
        return bytes(out[:a]), f"truncated to {a} bytes"
    a, n = rng.randrange(len(out)), rng.randrange(1, 9)
    if kind == 6:
        del out[a:a + n]
        return bytes(out), f"{n} bytes deleted at {a}"
    out[a:a] = bytes(rng.randrange(256) for _ in range(n))
    return bytes(out), f"{n} bytes inserted at {a}"


def _state(r: int) -> dict:
    g = torch.Generator().manual_seed(100)  # replicated values: the same on every rank
    return {"w": torch.randn(8, 8, generator=g), "big": torch.randn(40000, generator=g),
            f"mine{r}": torch.full((3,), float(r)), "h": torch.arange(10, dtype=torch.float16),
            "meta": {"step": 3, "lr": 0.1, "name": "run", "sched": [1, 2, 3]}}


def _full() -> dict:
    """Every value of the 2-rank checkpoint, for a one-process load."""
    return {**_state(0), "mine1": _state(1)["mine1"]}


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> Path:
    """Real files: a create and a reuse save of 2 ranks (engine threads, checksums on, a
    prepared file), and a stock DCP checkpoint."""
    root = tmp_path_factory.mktemp("fuzz")
    rk = Ranks(2, root, writer=FileWriter(fsync=False, checksums=True),
               prepared_metadata=str(root / "prepared.metadata"), create_prepared_metadata=True)
    try:
        for name in ("c0", "c1"):
            assert all(o.ok and o.published for o in rk.save(_state, name))
    finally:
        rk.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_save_local(_state(0), checkpoint_id=str(root / "stock"))
    prepared = (root / "prepared.metadata").read_bytes()
    assert prepared.startswith(crafted.MAGIC + b"4\n")
    (root / "prepared-v3.metadata").write_bytes(crafted.as_version_3(prepared))
    v2 = Path(__file__).parents[1] / "unit" / "prepared" / "data" / "prepared_v2.bin"
    shutil.copy(v2, root / "prepared-v2.metadata")
    return root


# -- the readers and what each must give ---------------------------------------------------------

def _metadata(path: Path) -> None:
    md = parse_metadata(path.read_bytes(), path.parent)
    assert metadata_problem(md) is None


def _prepared(path: Path) -> None:
    pm = load_prepared_metadata(path)
    for r in range(int(pm._reader.header["world"]) + 1):
        pm.rank_files(r)
    for b in range(pm._reader.buckets):
        pm._reader.bucket(b)
    pm.structure
    pm.index_body
    pm.checked_template()
    assert metadata_problem(pm.metadata) is None


def _index(path: Path) -> None:
    idx = LoadIndex.open(path.parent)
    if idx is None:
        return
    with idx:
        idx.metadata_for({k: None for k in idx.keys})
        idx.metadata_for(wanted_of(_full()))
        idx.whole_records({"w": ((8, 8), (0, 0), (8, 8)), "big": ((40000,), (0,), (40000,))})


def _load_exact(path: Path) -> None:
    """A damaged index or record: the exact values, or a solosave error; never anything else."""
    got = zeros_like(_full())
    solosave.load(got, path.parent)
    if path.name == ".solosave-index":  # the data and .metadata are intact: the load must succeed
        assert equal(got, _full()), "a damaged index gave other values"


def _records(path: Path) -> None:
    """The record decoder on every record of the (mutated) data file, at its recorded range."""
    data = path.read_bytes()
    cache = RecordCache()
    for off, n in _RANGES[path.name]:
        rec = data[off:off + n]
        out = parse_tensor_record(lambda o, k, rec=rec: rec[o:o + k], len(rec), cache)
        assert out is None or isinstance(out, TensorLayout)


def _verify(path: Path) -> None:
    rep = solosave.verify_checkpoint(path.parent)
    assert rep.checksums in ("verified", "failed"), rep.checksums
    assert (rep.checksums == "verified") == (not rep.problems), (rep.checksums, rep.problems)


_RANGES: dict[str, list[tuple[int, int]]] = {}

#: target -> (file, reader, mutations per round)
TARGETS: dict[str, tuple[str, Callable[[Path], None], int]] = {
    ".metadata (solosave, pickle protocol 2)": ("c1/.metadata", _metadata, 500),
    ".metadata (stock DCP, pickle protocol 4)": ("stock/.metadata", _metadata, 300),
    "load index (reader)": ("c1/.solosave-index", _index, 500),
    "load index (solosave.load)": ("c1/.solosave-index", _load_exact, 80),
    "prepared file v4": ("prepared.metadata", _prepared, 400),
    "prepared file v3": ("prepared-v3.metadata", _prepared, 200),
    "prepared file v2": ("prepared-v2.metadata", _prepared, 150),
    "tensor records (record decoder)": ("c1/__1_0.distcp", _records, 400),
    "data file of large records (solosave.load)": ("c1/__0_0.distcp", _load_exact, 70),
    "data file of small records (solosave.load)": ("c1/__1_0.distcp", _load_exact, 70),
    "checksum file (solosave verify)": ("c1/__1_0.distcp.crc32", _verify, 250),
}


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))


@pytest.mark.parametrize("target", list(TARGETS))
def test_fuzz(real, tmp_path, target, case_log):
    rel, read, count = TARGETS[target]
    work = tmp_path / "work"
    shutil.copytree(real, work)
    path = work / rel
    original = path.read_bytes()
    if read is _records:
        import pickle

        md = pickle.loads((path.parent / ".metadata").read_bytes())
        _RANGES[path.name] = [(v.offset, v.length) for v in md.storage_data.values()
                              if v.relative_path == path.name and v.length >= 1024]
    read(path)  # the intact file reads (and warms up every code path before the limit)
    n = max(1, int(count * ROUNDS))
    outcomes: dict[str, int] = {}
    failures: list[str] = []
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    t0 = time.monotonic()
    resource.setrlimit(resource.RLIMIT_AS, (_vm_size() + HEADROOM, hard))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i in range(n):
                data, how = mutate(original, SEED, target, i)
                path.write_bytes(data)
                t = time.monotonic()
                try:
                    read(path)
                    outcome = "read"
                except SolosaveError as e:
                    outcome = type(e).__name__
                except BaseException as e:  # noqa: BLE001 - a finding: recorded, reported below
                    if isinstance(e, KeyboardInterrupt):
                        raise
                    outcome = "finding"
                    failures.append(f"#{i} ({how}): {type(e).__name__}: {str(e)[:300]}")
                if time.monotonic() - t > SLOW_S:
                    failures.append(f"#{i} ({how}): took {time.monotonic() - t:.1f} s")
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        path.write_bytes(original)
    seconds = time.monotonic() - t0
    assert not failures, f"{target}, seed {SEED}: {len(failures)} of {n} mutations:\n" + "\n".join(failures[:8])
    summary = ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items(), key=lambda kv: -kv[1]))
    case_log(f"fuzz: {target}, {n} mutations of a real file (seed {SEED})",
             f"no other exception, none slower than {SLOW_S:.0f} s, within 1 GiB of address space: {summary}",
             seconds)
