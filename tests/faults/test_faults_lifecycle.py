"""Lifecycles, interleavings and machines (reliability round 2, and the worker on real machines):
re-saves to the same path, a checkpoint's own .metadata as prepared file, dropped checkpointers,
the store's address, a trainer that dies at once, a final save from a SIGTERM handler, and a
/dev/shm too small for the staging buffer. Each test logs rows for docs/reliability.md."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.faults import lifecycle_fns as L
from tests.support import can_mount_private_tmpfs, free_port, run_ranks, run_ranks_tolerant, wait_until

TIMEOUT = 20.0


def _alive(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"_worker_entry" in f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False


def _script(template, tmp_path):
    return template.format(port=free_port(), root=str(tmp_path))


@pytest.mark.timeout(200)
def test_resave_to_the_same_path_right_after_wait(tmp_path, case_log):
    t0 = time.monotonic()
    outs = run_ranks(L.resave_same_path, 2, str(tmp_path), TIMEOUT, timeout=180)
    for o in outs:
        assert o["published_c1"] is True  # known on every rank, not only the coordinator
        assert o["again"][0] == "CheckpointExistsError", o["again"]
        assert o["overwrite"] == ("reuse", True)
    assert run_ranks(L.load_resave, 2, str(tmp_path)) == [True, True]
    case_log("re-save to the directory of the save just waited for (reuse, ws=2)",
             "published=True on every rank; without overwrite every rank's save() raises "
             "CheckpointExistsError; with overwrite=True the checkpoint holds exactly the second save "
             "(loads, every rank's tensors of step 2)", time.monotonic() - t0)


@pytest.mark.timeout(200)
def test_a_checkpoints_own_metadata_as_prepared_file_is_never_overwritten(tmp_path, case_log):
    t0 = time.monotonic()
    outs = run_ranks(L.prepared_is_a_checkpoint, 2, str(tmp_path), TIMEOUT, timeout=180)
    for o in outs:
        assert o["unchanged"], "a refresh wrote into a checkpoint"
        assert o["modes"] == ["reuse+fallback", "reuse"], o["modes"]
    from tests.faults.fault_fns import check_loads  # one process: both loaders

    check_loads(str(tmp_path / "c0"), 2, 0)
    case_log("prepared_metadata is a checkpoint's own .metadata, then a layout drift (ws=2)",
             "the drifted save fell back and published; the refreshed layout is kept in memory (the next "
             "save reuses it); c0's .metadata is byte-identical and c0 loads with both loaders",
             time.monotonic() - t0)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("persistent", [True, False])
def test_a_dropped_checkpointer_leaves_no_segment_or_worker(tmp_path, case_log, persistent):
    t0 = time.monotonic()
    outs = run_ranks(L.dropped_checkpointer, 2, str(tmp_path), TIMEOUT, persistent, timeout=180)
    assert all(o["segment_gone"] and o["worker_gone"] for o in outs), outs
    case_log(f"AsyncCheckpointer dropped without close() ({'process' if persistent else 'thread'} mode, ws=2)",
             "its staging buffer (never named in /dev/shm) is unmapped and its worker stopped when it is "
             "garbage-collected",
             time.monotonic() - t0)


@pytest.mark.timeout(120)
def test_the_store_listens_on_the_training_address_only(tmp_path):
    hosts = run_ranks(L.store_address, 2, str(tmp_path))
    assert hosts == ["127.0.0.1", None]


@pytest.mark.timeout(120)
def test_a_trainer_that_exits_at_once_leaves_no_worker(tmp_path, case_log):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", _script(L.EXIT_RIGHT_AWAY, tmp_path)],
                       capture_output=True, text=True, timeout=60)  # a worker holding stdout would hang this
    waited = time.monotonic() - t0
    pid = int(r.stdout.split("WORKER")[1].split()[0])
    assert wait_until(lambda: not _alive(pid), 1.0), "the worker outlived its trainer by more than 1 s"
    case_log("trainer exits (os._exit) right after creating the checkpointer",
             f"subprocess.run(capture_output=True) returned after {waited:.1f} s (the worker released "
             "the trainer's stdout); the worker was gone within 1 s", waited)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_final_save_after_a_signal_to_the_whole_process_group(tmp_path, case_log, sig):
    t0 = time.monotonic()
    code = _script(L.FINAL_SAVE_ON_SIGTERM, tmp_path).replace("signal.SIGTERM", f"signal.{sig.name}")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)  # its own process group, like a job under a scheduler
    try:
        line = p.stdout.readline()
        assert line.startswith("READY"), line
        worker = int(line.split()[1])
        os.killpg(p.pid, sig)  # what Ctrl-C or a scheduler does: the whole group
        out, _ = p.communicate(timeout=150)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, out
    final = [ln for ln in out.splitlines() if ln.startswith("FINAL")]
    assert final and final[0].split()[2] == "True", out  # FINAL <mode> <published> <step>
    assert wait_until(lambda: not _alive(worker), 5.0)
    assert (tmp_path / "final" / ".metadata").exists()
    case_log(f"{sig.name} to the trainer's whole process group; the handler asks for a final save",
             "the worker ignored the signal; the final save published and the trainer exited 0",
             time.monotonic() - t0)


@pytest.mark.timeout(300)
@pytest.mark.skipif(not can_mount_private_tmpfs(), reason="needs root and unshare for a private 64 MiB /dev/shm")
def test_a_dev_shm_too_small_falls_back_to_a_file_with_a_warning(tmp_path, case_log):
    t0 = time.monotonic()
    code = _script(L.SAVE_BIG, tmp_path)
    r = subprocess.run(["unshare", "-m", "sh", "-c",
                        f'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec {sys.executable} -c "$CODE"'],
                       env=dict(os.environ, CODE=code), capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout + r.stderr  # before: killed by SIGBUS (-7)
    assert "LOADED True True" in r.stdout, r.stdout + r.stderr
    assert "--shm-size" in r.stdout + r.stderr
    case_log("Docker-sized /dev/shm (64 MiB tmpfs), 256 MiB staged on one rank",
             "no SIGBUS: the reservation failed cleanly, one warning naming --shm-size / --ipc=host, "
             "staged in a file under the temporary directory; published and loads bit-exact",
             time.monotonic() - t0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("persistent", [True, False])
def test_a_sigkilled_trainer_leaves_no_segment(tmp_path, case_log, persistent):
    code = _script(L.KILLED_AFTER_SAVE.replace("{persistent}", str(persistent)), tmp_path)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
    assert r.returncode == -signal.SIGKILL, r.stdout + r.stderr
    pid = int(r.stdout.split("SAVED")[1].split()[0])

    def left():
        return [n for n in os.listdir("/dev/shm") if n.startswith(f"solosave_{pid}_")]

    assert wait_until(lambda: not left(), 10.0), left()
    case_log(f"trainer SIGKILLed after a save ({'process' if persistent else 'thread'} mode)",
             "no staging segment left in /dev/shm (it never had a name there after its creation)")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("persistent", [True, False])
def test_a_job_sigkilled_as_a_whole_leaves_no_segment(tmp_path, case_log, persistent):
    """The whole process group SIGKILLed (a scheduler's preemption, an OOM kill of the job's
    cgroup): the trainer's resource tracker dies with it, so nothing is left to unlink a named
    segment; the staging buffer must never be left in /dev/shm."""
    t0 = time.monotonic()
    code = _script(L.JOB_KILLED_AS_A_WHOLE.replace("{persistent}", str(persistent)), tmp_path)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    pid = None
    try:
        line = p.stdout.readline()
        assert line.startswith("SAVED"), line + p.stdout.read()
        pid, maps = int(line.split()[1]), int(line.split()[2])
        assert maps >= 1  # the trainer had its staging buffer mapped
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)

    def left():
        return [n for n in os.listdir("/dev/shm") if n.startswith(f"solosave_{pid}_")]

    time.sleep(2.0)  # a resource tracker, had one survived, would have unlinked it by now
    leftover = left()
    for n in leftover:  # do not leave it for the next test
        os.unlink(os.path.join("/dev/shm", n))
    assert leftover == []
    case_log(f"the trainer's whole process group SIGKILLed with a save in flight "
             f"({'process' if persistent else 'thread'} mode, 64 MiB staged)",
             "no staging segment left in /dev/shm (it is unlinked as soon as it is created; "
             "its memory goes with the last process that maps it)", time.monotonic() - t0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("persistent", [True, False])
def test_close_while_an_overlapped_copy_runs_does_not_crash(tmp_path, case_log, persistent):
    t0 = time.monotonic()
    res = run_ranks_tolerant(L.close_during_overlapped_copy, 1, str(tmp_path), persistent, timeout=100)
    kind, out = res[0]
    assert kind == "ok", (kind, out)  # before: died of SIGSEGV when the held copy ran
    assert out["close_s"] < 15
    assert out["mapped_after_close"] >= 1  # close() left the buffer to the copy still running
    assert out["unmapped"] is True  # and it went when the copy ended
    assert out["published"] is False and out["a"].startswith("CheckpointError")
    case_log(f"close(timeout=0.5) while an overlapped staging copy is held back "
             f"({'process' if persistent else 'thread'} mode)",
             f"close() returned after {out['close_s']} s; the buffer stayed mapped until the copy "
             "ended, then was unmapped; no crash; the save was abandoned (CheckpointError, no .metadata)",
             time.monotonic() - t0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["grow", "free", "set", "drop", "view_grow", "view_free", "view_drop"])
def test_a_saved_tensor_resized_or_freed_before_its_overlapped_copy(tmp_path, case_log, how):
    t0 = time.monotonic()
    res = run_ranks_tolerant(L.change_before_overlapped_copy, 1, str(tmp_path), how, timeout=100)
    kind, out = res[0]
    assert kind == "ok", (kind, out)  # before: SIGSEGV
    if how.endswith("drop"):
        assert out["error"] is None  # a dropped tensor is kept alive until its copy ends
    else:
        assert out["error"].startswith("StagingRaceError") and "'big'" in out["error"], out
    what = {"grow": "resized larger (resize_)", "free": "whose storage was freed (untyped_storage().resize_(0))",
            "set": "whose storage was replaced (set_)", "drop": "dropped by the caller (del)",
            "view_grow": "saved as a view (base.t()) whose base was resized larger",
            "view_free": "saved as a view (base.t()) whose base's storage was freed",
            "view_drop": "saved as a view (base.t()) whose base was dropped (del)"}[how]
    case_log(f"overlap_staging: a saved tensor {what} before its copy ran",
             "no crash; " + ("StagingRaceError naming the key from the staging's wait (wait_staged()); "
                             "its bytes were never read" if not how.endswith("drop")
                             else "no error: the staging holds the tensor until its copy ends"),
             time.monotonic() - t0)
