"""Fault injection (gloo on 127.0.0.1, world sizes 2 and 4): a fault at any moment leaves the
last good checkpoint loadable, publishes no partial one, and ends in a clear error on every rank
within a bounded time; the next save after recovery succeeds.

Faults come from test fixtures only (``fault_fns.FaultWriter``, signals, a patch installed in a
worker by that writer). Each test logs one row per case for docs/reliability.md (conftest.py).
Already covered elsewhere, not repeated: an EIO on every save of one rank
(test_checkpointer.py::test_failure_propagates_to_every_rank,
test_reuse.py::test_reuse_write_failure_every_rank_learns_why).
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

import solosave
from tests.faults import fault_fns as F
from tests.support import dcp_save_local, run_ranks, run_ranks_tolerant, wait_until

TIMEOUT = 20.0  # the checkpointer's timeout in these tests (bounds every wait and collective)
BOUND = TIMEOUT + 5.0  # an error must reach every rank within this


def _published(path) -> bool:
    return os.path.exists(os.path.join(path, ".metadata"))


def _ok(res: dict) -> dict:
    """Every rank returned normally: {rank: value}."""
    bad = {r: v for r, v in res.items() if v[0] != "ok"}
    assert not bad, bad
    return {r: v[1] for r, v in res.items()}


def _errors(outs: dict, key: str) -> str:
    return "; ".join(f"rank {r}: {o[key]['type']} after {o[key]['after_s']} s" for r, o in sorted(outs.items()))


@pytest.mark.timeout(150)
def test_worker_sigkilled_mid_write(tmp_path, case_log):
    ws, victim = 4, 2
    t0 = time.monotonic()
    outs = _ok(run_ranks_tolerant(F.worker_killed_mid_write, ws, str(tmp_path), victim, TIMEOUT, timeout=140))
    for r, o in outs.items():
        e = o["c2"]
        assert e["is_checkpoint_error"], (r, e)
        assert e["after_s"] < BOUND
        if r == victim:
            assert e["type"] == "WorkerDiedError" and "exited with code -9" in e["msg"]
        else:
            assert "background channel failed" in e["msg"] and "create a new" in e["msg"], e["msg"]
        assert not o["worker_alive_after_close"] and o["close_s"] < BOUND
        assert o["c3"]["type"] is None and o["c3"]["mode"] == "reuse"
    assert not _published(tmp_path / "c2")
    assert (tmp_path / "c2" / f"__{victim}_0.distcp").exists()  # half written, never published
    F.check_loads(str(tmp_path / "c1"), ws, 1)
    F.check_loads(str(tmp_path / "c3"), ws, 3)
    refused = F.loaders_refuse(str(tmp_path / "c2"), ws)
    case_log("worker SIGKILLed mid-write (ws=4, rank 2, reuse save)",
             f"{_errors(outs, 'c2')}; c2 has no .metadata (loaders refuse: {', '.join(refused)}); "
             "c1 loads and matches; every rank recreated its checkpointer and c3 saved (reuse) and loads",
             time.monotonic() - t0)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("action, reuse, ws", [("eio", True, 4), ("enospc", False, 2)])
def test_write_error_on_one_rank(tmp_path, case_log, action, reuse, ws):
    t0 = time.monotonic()
    outs = _ok(run_ranks_tolerant(F.write_error_once, ws, str(tmp_path), action, reuse, TIMEOUT, timeout=140))
    needle = "Errno 5" if action == "eio" else "No space left"
    for o in outs.values():
        e = o["c1"]
        assert e["type"] == "CheckpointError" and e["failures"] == [ws - 1] and needle in e["msg"], e
        assert e["after_s"] < BOUND
        assert o["c2"]["type"] is None, o["c2"]
    assert not _published(tmp_path / "c1")
    F.check_loads(str(tmp_path / "c0"), ws, 0)
    F.check_loads(str(tmp_path / "c2"), ws, 2)
    mode = "reuse" if reuse else "collective"
    case_log(f"{'OSError(EIO)' if action == 'eio' else 'ENOSPC (injected)'} after half a file on one rank "
             f"(ws={ws}, {mode} save)",
             f"every rank: CheckpointError naming rank {ws - 1} and '{needle}' after <= "
             f"{max(o['c1']['after_s'] for o in outs.values())} s; c1 has no .metadata; c0 loads and "
             f"matches; the same checkpointer's next save ({outs[0]['c2']['mode']}) succeeded and loads",
             time.monotonic() - t0)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("what", ["metadata", "prepared"])
def test_coordinator_killed_before_rename(tmp_path, case_log, what):
    t0 = time.monotonic()
    outs = _ok(run_ranks_tolerant(F.coordinator_killed_at_publish, 2, str(tmp_path), what, TIMEOUT, timeout=140))
    o0, o1 = outs[0], outs[1]
    assert o0["tmp_exists_at_kill"]
    assert o0["c1"]["type"] == "WorkerDiedError"
    assert not _published(tmp_path / "c1")
    assert o0["prep_after"] == o0["prep_before"]  # the prepared file is the old, complete one
    solosave.load_prepared_metadata(tmp_path / "prep.md").check_compatible(2, 1)
    F.check_loads(str(tmp_path / "c0"), 2, 0, extra={"sched": [0.5] * 4})
    refused = F.loaders_refuse(str(tmp_path / "c1"), 2)
    sched = [0.5] * (4 if what == "metadata" else 3000)
    F.check_loads(str(tmp_path / "c2"), 2, 2, extra={"sched": sched})
    assert all(o["c2"]["type"] is None for o in outs.values())
    if what == "metadata":
        # rank 1 waits for the coordinator's publication receipt, which never comes
        assert o1["c1"]["is_checkpoint_error"] and o1["c1"]["after_s"] < BOUND, o1["c1"]
        assert "background channel failed" in o1["c1"]["msg"], o1["c1"]
        assert "cannot tell whether its .metadata was published" in o1["c1"]["msg"], o1["c1"]
        other = (f"rank 1: {o1['c1']['type']} (no publication receipt; it cannot tell whether .metadata "
                 f"was published) after {o1['c1']['after_s']} s")
        label = "coordinator killed after writing the temporary .metadata, before the rename (ws=2, reuse)"
    else:
        assert o1["c1"]["is_checkpoint_error"] and o1["c1"]["after_s"] < BOUND, o1["c1"]
        assert "background channel failed" in o1["c1"]["msg"]
        other = f"rank 1: {o1['c1']['type']} after {o1['c1']['after_s']} s"
        label = ("coordinator killed during the prepared-file refresh, temporary file written, before "
                 "the rename (ws=2, drift fallback)")
    case_log(label, f"rank 0: WorkerDiedError after {o0['c1']['after_s']} s; {other}; c1 has no .metadata "
             f"(both loaders refuse: {', '.join(refused)}); prepared file byte-identical to the old one; "
             f"a stray temporary file is left; c0 loads; recreated checkpointers saved c2 "
             f"({outs[0]['c2']['mode']}), which loads", time.monotonic() - t0)


@pytest.mark.timeout(150)
def test_a_lost_publication_receipt_is_not_reported_as_no_publication(tmp_path, case_log):
    """The coordinator's worker dies after renaming .metadata into place, before its receipt:
    the other rank must not claim that nothing was published (it used to)."""
    t0 = time.monotonic()
    outs = _ok(run_ranks_tolerant(F.receipt_lost, 2, str(tmp_path), TIMEOUT, timeout=140))
    o0, o1 = outs[0], outs[1]
    assert o0["published_at_kill"] and _published(tmp_path / "c1")
    assert o0["c1"]["type"] == "WorkerDiedError"
    e = o1["c1"]
    assert e["is_checkpoint_error"] and e["after_s"] < BOUND, e
    assert "no .metadata was published" not in e["msg"], e["msg"]
    assert "its .metadata was published before the failure was known" in e["msg"], e["msg"]
    assert "background channel failed" in e["msg"] and "it was published before the receipt was lost" in e["msg"]
    F.check_loads(str(tmp_path / "c1"), 2, 1)  # the published checkpoint is complete
    F.check_loads(str(tmp_path / "c2"), 2, 2)
    assert all(o["c2"]["type"] is None for o in outs.values())
    case_log("coordinator's worker SIGKILLed after renaming .metadata into place, before its publication "
             "receipt (ws=2, reuse)",
             f"rank 0: WorkerDiedError after {o0['c1']['after_s']} s; rank 1: CheckpointError after "
             f"{e['after_s']} s saying the .metadata is there (published before the receipt was lost), no "
             "longer 'no .metadata was published'; c1 loads and matches; recreated checkpointers saved "
             f"c2 ({o0['c2']['mode']}), which loads", time.monotonic() - t0)


_CHILD = r"""
import os, sys, time
from solosave._src.storage.local import LocalStorage
point, path, data = sys.argv[1], sys.argv[2], sys.argv[3].encode()
real_replace, real_fsync = os.replace, os.fsync
def fsync(fd):
    if point == "before_fsync":
        print("READY", flush=True); time.sleep(60)
    return real_fsync(fd)
def replace(a, b):
    if point == "before_rename":
        print("READY", flush=True); time.sleep(60)
    return real_replace(a, b)
os.fsync, os.replace = fsync, replace
LocalStorage().commit(path, data)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point", ["before_fsync", "before_rename"])
@pytest.mark.parametrize("existing", [True, False])
def test_atomic_write_killed_in_its_window(tmp_path, case_log, point, existing):
    """The commit primitive alone, in a child process SIGKILLed at the point: ``.metadata`` of a
    real checkpoint is the old complete one or absent, and both loaders agree."""
    t0 = time.monotonic()
    ck = tmp_path / "ck"
    sd = {"w": torch.arange(12.0).reshape(3, 4), "step": 7}
    dcp_save_local(sd, checkpoint_id=str(ck))
    old = (ck / ".metadata").read_bytes()
    if not existing:
        os.unlink(ck / ".metadata")
    child = subprocess.Popen([sys.executable, "-c", _CHILD, point, str(ck / ".metadata"), "x" * 4096],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "READY"
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
    leftovers = [n for n in os.listdir(ck) if n.startswith("..metadata.tmp.")]
    assert len(leftovers) == 1
    got = []
    for load in (lambda t: solosave.load(t, ck), lambda t: dcp.load(t, checkpoint_id=str(ck), no_dist=True)):
        tgt = {"w": torch.zeros(3, 4), "step": 0}
        try:
            load(tgt)
            got.append(bool(torch.equal(tgt["w"], sd["w"]) and tgt["step"] == 7))
        except BaseException:  # noqa: BLE001 - a refusal (DCP raises CheckpointException)
            got.append("refused")
    if existing:
        assert (ck / ".metadata").read_bytes() == old
        assert got == [True, True]
        seen = "old complete .metadata kept; both loaders read the old checkpoint"
    else:
        assert not (ck / ".metadata").exists()
        assert got == ["refused", "refused"]
        seen = ".metadata absent; both loaders refuse the directory"
    case_log(f"atomic_write SIGKILLed {point.replace('_', ' ')} ({'replacing' if existing else 'no'} "
             "old .metadata)", f"{seen}; one stray temporary file", time.monotonic() - t0)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("when, ws, victim", [("between", 4, 3), ("all_reduce", 2, 0)])
def test_rank_process_dies(tmp_path, case_log, when, ws, victim):
    t0 = time.monotonic()
    res = run_ranks_tolerant(F.rank_dies, ws, str(tmp_path), victim, when, TIMEOUT, timeout=140)
    assert res[victim] == ("died", -signal.SIGKILL), res[victim]
    survivors = {r: v[1] for r, v in res.items() if r != victim}
    assert all(res[r][0] == "ok" for r in survivors), res
    for o in survivors.values():
        e = o["c1"]
        assert e["type"] in ("CheckpointError", "SaveTimeoutError"), e
        assert e["after_s"] < BOUND, e
        assert not o["worker_alive_after_close"] and o["close_s"] < BOUND
    workers = [int((tmp_path / f"worker.{r}").read_text()) for r in range(ws)]
    assert wait_until(lambda: not any(F.alive(p) for p in workers), 5.0), "a worker outlived its trainer"
    assert not _published(tmp_path / "c1")
    F.check_loads(str(tmp_path / "c0"), ws, 0)
    recovered = ""
    if ws == 2:  # the job restarts: a new job reuses the prepared file and saves
        out = run_ranks(F.recover_job, ws, str(tmp_path), TIMEOUT)
        assert all(o["type"] is None and o["mode"] == "reuse" for o in out)
        F.check_loads(str(tmp_path / "c2"), ws, 2)
        recovered = "; a restarted job saved c2 (reuse, from the prepared file), which loads"
    label = {"between": "between two saves", "all_reduce": "while the others wait in the status all_reduce"}[when]
    case_log(f"whole rank process (trainer) SIGKILLed {label} (ws={ws}, rank {victim})",
             f"survivors: {_errors(survivors, 'c1')}; close() <= {max(o['close_s'] for o in survivors.values())} s; "
             f"no worker outlived its trainer; c1 has no .metadata; c0 loads and matches{recovered}",
             time.monotonic() - t0)


@pytest.mark.timeout(150)
def test_back_to_back_saves(tmp_path, case_log):
    t0 = time.monotonic()
    saves = 24
    outs = run_ranks(F.back_to_back, 2, str(tmp_path), saves, TIMEOUT, timeout=140)
    for o in outs:
        assert all(o["done"]) and not o["errors"] and o["last_mode"] == "reuse"
        assert o["segments"] == [1, 1]  # one staging buffer mapped, reused
        (t3, w3), (tn, wn) = o["rss"]
        assert tn - t3 < 30 * 1024 and wn - w3 < 30 * 1024, o["rss"]
        assert sum(o["blocks"][2:]) > 0.05 * (saves - 2) * 0.5  # save() waited for the previous one
    for i in range(saves):
        d = tmp_path / f"s{i:03d}"
        assert sorted(os.listdir(d)) == [".metadata", ".solosave-index", "__0_0.distcp", "__1_0.distcp"], os.listdir(d)
        F.check_loads(str(d), 2, i)  # its own values: no interleaving, snapshot at save()
    rss = outs[0]["rss"]
    case_log(f"{saves} saves requested back to back while the previous one is writing (ws=2, slow writer)",
             f"each save() waited for the previous one (median block {sorted(outs[0]['blocks'])[saves // 2] * 1e3:.0f} ms); "
             f"all {saves} published, each holds exactly its own files and values; one staging buffer; "
             f"rank 0 RSS trainer {rss[0][0] // 1024}->{rss[1][0] // 1024} MiB, worker "
             f"{rss[0][1] // 1024}->{rss[1][1] // 1024} MiB", time.monotonic() - t0)


@pytest.mark.timeout(150)
def test_close_while_a_save_is_in_flight(tmp_path, case_log):
    t0 = time.monotonic()
    outs = run_ranks(F.close_in_flight, 2, str(tmp_path), TIMEOUT, timeout=140)
    for rank, o in enumerate(outs):
        assert o["a"]["type"] is None  # close() let the save finish
        assert o["b"]["type"] == "CheckpointError", o["b"]
        # Rank 1's write is stuck: its close abandons the save. Rank 0's worker waits for rank 1
        # in the agreement; it either is stopped by its own close too, or first sees rank 1's
        # worker (stopped by rank 1's close) go away (which the two ranks' timing decides).
        assert "abandoned by close()" in o["b"]["msg"] or (
            rank == 0 and "another rank's process or worker died" in o["b"]["msg"]), o["b"]
        assert o["b_close_s"] < 2 * 2 + 5 + 3 + 2, o["b_close_s"]  # + rank 0 waiting for rank 1 to close (bounded)
        assert not o["b_worker_alive"] and o["b_segments"] == []
        assert o["save_after_close"].startswith("ValueError") and "closed" in o["save_after_close"]
        assert o["c"]["type"] is None
    F.check_loads(str(tmp_path / "a"), 2, 0)
    assert not _published(tmp_path / "b")
    F.check_loads(str(tmp_path / "c"), 2, 2)
    case_log("close() right after save()", f"the save finished and was published before close() returned "
             f"({max(o['a_close_s'] for o in outs)} s, includes the worker start); it loads", None)
    case_log("close(timeout=2) while one rank's write is stuck (ws=2)",
             f"close() returned after <= {max(o['b_close_s'] for o in outs)} s on every rank; the save was "
             "abandoned: wait() raises CheckpointError 'abandoned by close()' (on the other rank, or "
             "'another rank's process or worker died' if it saw that worker stopped first), no .metadata, no worker "
             "or segment left, save() after close raises ValueError; a new checkpointer saved and loads",
             time.monotonic() - t0)


@pytest.mark.timeout(150)
def test_save_raising_on_one_rank_only(tmp_path, case_log):
    """Rank 1's save() of c1 raises (a value only it holds cannot be serialized): it hands its
    worker a job that fails c1 on every rank at once, naming rank 1 and its error; the ranks stay
    in step, so c2 and c3 save normally with the same checkpointers."""
    t0 = time.monotonic()
    timeout = 10.0
    outs = run_ranks(F.out_of_step, 2, str(tmp_path), timeout, timeout=140)
    assert outs[1]["steps"][1]["save"]["type"] == "TypeError"
    e = outs[0]["steps"][1]["wait"]
    assert e["is_checkpoint_error"] and e["failures"] == [1], e
    assert "save() raised on this rank: TypeError" in e["msg"] and "cannot be serialized" in e["msg"], e
    assert e["after_s"] < timeout, e  # the failure itself arrived, not the timeout
    for o in outs:
        for i in (2, 3):
            assert o["steps"][i]["wait"]["type"] is None and o["steps"][i]["wait"]["published"], o["steps"][i]
        assert o["c4"]["type"] is None
    assert not _published(tmp_path / "c1")
    for i in (0, 2, 3, 4):
        F.check_loads(str(tmp_path / f"c{i}"), 2, i)
    case_log("save() raises on one rank only (a value only it holds cannot be serialized)",
             f"that rank: TypeError from save(); the other rank's wait(): CheckpointError naming rank 1 "
             f"and its TypeError after {e['after_s']} s (timeout {timeout:g} s); no .metadata for c1; "
             "the same checkpointers saved c2 and c3, which load", time.monotonic() - t0)
