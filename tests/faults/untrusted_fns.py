"""Rank functions of the untrusted-input tests (``tests/faults/test_untrusted.py``): real
``AsyncCheckpointer`` saves on every rank, then prepared files and load indexes that are
damaged or crafted the way an unlucky or hostile user would (``tests/crafted.py``)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch.distributed as dist

import solosave
from tests import crafted
from tests.faults.fault_fns import SETUP_WAIT, full_at, sd_at, set_step
from tests.support import equal, fresh, zeros_like


def _error(e: BaseException, t0: float) -> dict:
    return {"type": type(e).__name__, "msg": str(e), "after_s": round(time.monotonic() - t0, 2)}


def _saved(ck: solosave.AsyncCheckpointer, sd: dict, path: str) -> dict:
    t0 = time.monotonic()
    try:
        r = ck.save(sd, path).wait(SETUP_WAIT)
    except Exception as e:  # noqa: BLE001 - the error is what the test inspects
        return _error(e, t0)
    return {"type": None, "mode": r.mode, "published": r.published, "warnings": list(r.warnings)}


def _stock_loads(path: str, ws: int, step: int) -> bool:
    """Stock DCP (a plain ``pickle.load`` of ``.metadata``) reads ``path`` in one process and
    gets exactly step ``step``'s values."""
    import torch.distributed.checkpoint as dcp

    want = full_at(ws, step)
    got = zeros_like(want)
    try:
        dcp.load(got, checkpoint_id=path, no_dist=True)
    except BaseException:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        return False
    return equal(got, want)


def crafted_prepared_files(rank: int, ws: int, root: str, timeout: float) -> dict:
    """A create save makes a good prepared file; then copies of it, each damaged or crafted in
    one way, are given to new checkpointers on every rank. Returns per case what each rank saw."""
    fresh(root)
    prep = f"{root}/prep.md"
    sd = sd_at(rank, 0)
    with solosave.AsyncCheckpointer(prepared_metadata=prep, create_prepared_metadata=True, timeout=timeout) as ck:
        ck.save(sd, f"{root}/c0").wait(SETUP_WAIT)
    good = open(prep, "rb").read()
    outside = {"relative": "../pwned.bin", "absolute": f"{root}/pwned-absolute.bin"}
    variants = {f"name/{k}": crafted.rename_data_file(good, 0, "__0_0.distcp", v) for k, v in outside.items()}
    variants["header/v4"] = crafted.nudge_template_position(good)
    v3 = crafted.as_version_3(good) if good.startswith(crafted.MAGIC + b"4\n") else good
    variants["template/v3"] = crafted.nudge_template_position(v3)
    if rank == 0:
        for name, data in variants.items():
            with open(f"{root}/{name.replace('/', '-')}.md", "wb") as f:
                f.write(data)
    dist.barrier()
    out: dict[str, Any] = {}
    for name in ("name/relative", "name/absolute", "header/v4"):
        t0 = time.monotonic()
        try:  # refused at construction, on every rank; if not, the save shows what it does
            with solosave.AsyncCheckpointer(prepared_metadata=f"{root}/{name.replace('/', '-')}.md",
                                            timeout=timeout) as ck:
                set_step(sd, rank, 1)
                out[name] = _saved(ck, sd, f"{root}/{name.replace('/', '-')}")
        except Exception as e:  # noqa: BLE001 - the error is what the test inspects
            out[name] = _error(e, t0)
        dist.barrier()
    out["outside_files"] = sorted(p for p in (f"{root}/pwned.bin", outside["absolute"]) if os.path.exists(p))
    # version 3 (no header CRC), one digit of a template position changed: opens, then the first
    # reuse save must not publish what does not read back
    for mode in ("fallback", "raise"):
        path = f"{root}/template-v3-{mode}.md"
        if rank == 0:
            with open(path, "wb") as f:
                f.write(variants["template/v3"])
        dist.barrier()
        with solosave.AsyncCheckpointer(prepared_metadata=path, on_layout_drift=mode, timeout=timeout) as ck:
            for i in (2, 3):
                set_step(sd, rank, i)
                out[f"template/{mode}/{i}"] = _saved(ck, sd, f"{root}/t-{mode}-{i}")
        dist.barrier()
        for i in (2, 3):
            d = f"{root}/t-{mode}-{i}"
            out[f"template/{mode}/{i}/loads"] = os.path.exists(f"{d}/.metadata") and _stock_loads(d, ws, i)
        out[f"template/{mode}/refreshed"] = open(path, "rb").read()[:20]
    return out


def damaged_index_loads(rank: int, ws: int, root: str, timeout: float) -> dict:
    """A create and a reuse save (each with its load index); then copies of the reuse save's
    checkpoint whose index is damaged: a flipped bit in a row block, or the high bit of the
    directory length (no CRC covers it). ``solosave.load`` on every rank must load each copy."""
    import shutil

    fresh(root)
    sd = sd_at(rank, 1)
    with solosave.AsyncCheckpointer(prepared_metadata=f"{root}/prep.md", create_prepared_metadata=True,
                                    timeout=timeout) as ck:
        ck.save(sd_at(rank, 0), f"{root}/c0").wait(SETUP_WAIT)
        ck.save(sd, f"{root}/c1").wait(SETUP_WAIT)
    cases = {"rows": lambda b: b[:-6] + bytes([b[-6] ^ 1]) + b[-5:], "directory length": _dir_length_high_bit}
    if rank == 0:
        for name, damage in cases.items():
            d = f"{root}/{name.replace(' ', '-')}"
            shutil.copytree(f"{root}/c1", d)
            index = f"{d}/.solosave-index"
            with open(index, "rb") as f:
                data = f.read()
            with open(index, "wb") as f:
                f.write(damage(data))
    dist.barrier()
    out: dict[str, Any] = {}
    for name in cases:
        got = zeros_like(sd)
        t0 = time.monotonic()
        try:
            solosave.load(got, f"{root}/{name.replace(' ', '-')}")
            out[name] = {"type": None, "equal": equal(got, sd)}
        except BaseException as e:  # noqa: BLE001 - MemoryError too: it is what the test inspects
            out[name] = _error(e, t0)
    return out


def _dir_length_high_bit(index: bytes) -> bytes:
    """The load index with the highest bit of its directory length (u64, the body's first
    field, no CRC) flipped."""
    body = index.index(b"\n", index.index(b"\n") + 1)  # after the magic line
    body = index.index(b"\n", body + 1) + 1  # after the JSON header line
    at = body + 7
    return index[:at] + bytes([index[at] ^ 0x80]) + index[at + 1:]
