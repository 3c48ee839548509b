"""Soak: 200 consecutive reuse saves at world size 4, values changed between saves.

Slow (excluded from the default run): ``.venv/bin/python -m pytest -m slow tests/multiproc/test_soak.py``
(``make test-slow``). Every checkpoint is loaded in this process and compared with its step's
values; RSS of trainers and workers, open descriptors, child processes and /dev/shm segments are
compared before and after.
"""

import os
import time

import pytest

from tests.faults import fault_fns as F
from tests.support import run_ranks, wait_until

SAVES = int(os.environ.get("SOLOSAVE_SOAK_SAVES", "200"))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_soak_reuse_saves(tmp_path, case_log):
    ws = 4
    t0 = time.monotonic()
    shm_before = F.shm_segments()
    outs = run_ranks(F.soak, ws, str(tmp_path), SAVES, 60.0, timeout=1700)
    t_saves = max(o["seconds"] for o in outs)
    for o in outs:
        assert o["modes"] == {"reuse": SAVES}, o["modes"]
        s, e = o["start"], o["end"]
        assert e["trainer_rss_kib"] - s["trainer_rss_kib"] < 32 * 1024, (s, e)
        assert e["worker_rss_kib"] - s["worker_rss_kib"] < 32 * 1024, (s, e)
        assert e["fds"] == s["fds"], (s, e)
        assert o["fds_after_close"] <= o["fds_before"], o
        assert o["children_after"] == o["children_before"] and not o["worker_alive_after_close"], o
    assert wait_until(lambda: F.shm_segments() == shm_before, 5.0), (F.shm_segments(), shm_before)
    t1 = time.monotonic()
    for i in range(SAVES + 1):
        F.check_loads(str(tmp_path / f"s{i:04d}"), ws, i)
    t_load = time.monotonic() - t1
    rows = []
    for r, o in enumerate(outs):
        s, e = o["start"], o["end"]
        rows.append(f"rank {r}: trainer {s['trainer_rss_kib'] // 1024}->{e['trainer_rss_kib'] // 1024} MiB, "
                    f"worker {s['worker_rss_kib'] // 1024}->{e['worker_rss_kib'] // 1024} MiB, "
                    f"fds {s['fds']}->{e['fds']} (before the checkpointer {o['fds_before']}, after close "
                    f"{o['fds_after_close']}), children {len(o['children_before'])}/{len(o['children_during'])}/"
                    f"{len(o['children_after'])}")
    case_log(f"soak: {SAVES} reuse saves at ws=4, new values each (RSS at save 10 -> end)",
             f"all {SAVES + 1} checkpoints load (solosave.load and stock dcp.load) and match their step "
             f"({t_load:.0f} s to load all); {SAVES} saves took {t_saves:.0f} s "
             f"({t_saves / SAVES * 1e3:.0f} ms each, waited); /dev/shm solosave_* segments before/after: "
             f"{len(shm_before)}/{len(F.shm_segments())}; " + "; ".join(rows),
             time.monotonic() - t0)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_soak_mixed_lifecycles(tmp_path, case_log):
    ws, steps = 2, int(os.environ.get("SOLOSAVE_SOAK_MIXED_STEPS", "40"))
    t0 = time.monotonic()
    shm_before = F.shm_segments()
    outs = run_ranks(F.mixed_soak, ws, str(tmp_path), steps, 60.0, timeout=1700)
    for o in outs:
        assert o["fds_after"] <= o["fds_before"], o
        assert o["children_after"] == o["children_before"], o
    assert wait_until(lambda: F.shm_segments() == shm_before, 5.0), (F.shm_segments(), shm_before)
    counts = outs[0]["counts"]
    assert all(counts.get(a, 0) > 0 for a in ("new", "same", "overwrite", "drift", "drop")), counts
    case_log(f"mixed soak: {steps} steps at ws=2 ({', '.join(f'{k} x{v}' for k, v in sorted(counts.items()))})",
             f"after every step all {outs[0]['checkpoints']} published checkpoints loaded with both loaders "
             "and matched; re-saves without overwrite were refused on every rank; no segment, descriptor "
             "or process left", time.monotonic() - t0)
