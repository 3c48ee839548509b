"""End to end: `solosave train` at 2 ranks (forked by its launcher; one test under
torch.distributed.run) - create-then-reuse saves,
resume bit for bit (ignoring a partial checkpoint), `--ckpt-metadata auto`, FSDP2 shards, and the
CLI subcommands on the checkpoints it produced."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

import solosave
from solosave.cli import main as cli

pytestmark = pytest.mark.timeout(300)
# The tests of run_a's job share one worker under pytest-xdist (make test: --dist loadgroup), so
# that the module fixture trains once, not once per worker.
RUN_A = pytest.mark.xdist_group("train_run_a")

COMMON = ["--nproc", "2", "--no-progress", "--layers", "1", "--d-model", "64", "--heads", "2",
          "--vocab", "128", "--seq-len", "32", "--batch-size", "4"]


def train(*args, timeout=240, torchrun=False):
    """`solosave train` (its ranks are forks of its process), or with ``torchrun``: the job's
    module under PyTorch's own launcher (fresh interpreters), as on a cluster."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launcher = ["solosave", "train"]
    if torchrun:
        # "--": torchrun would read the job's --nproc as an abbreviation of its --nproc-per-node
        launcher = ["torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "solosave.demo", "--"]
    r = subprocess.run([sys.executable, "-m", *launcher, *COMMON, *map(str, args)],
                       capture_output=True, text=True, timeout=timeout, env=env)
    return r


def records(path, event):
    with open(path) as f:
        return [r for r in map(json.loads, f) if r["event"] == event]


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    """8 steps, saves at 4 and 8 with create-then-reuse, checksums recorded."""
    d = tmp_path_factory.mktemp("a")
    r = train("--steps", 8, "--save", d / "ckpt", "--save-interval", 4, "--async-save",
              "--use-persistent-ckpt-worker", "--ckpt-metadata", d / "prepared.metadata",
              "--ckpt-metadata-create", "--ckpt-checksums", "--json-log", d / "log.jsonl")
    assert r.returncode == 0, r.stdout + r.stderr
    return d, r.stdout


@RUN_A
def test_create_then_reuse_and_report_lines(run_a):
    d, out = run_a
    saves = records(d / "log.jsonl", "save")
    assert [s["mode"] for s in saves] == ["create", "reuse"]
    assert saves[1]["collectives"] == {"all_reduce": {"count": 1, "bytes": 8}}
    assert saves[1]["collectives_in_loop"] == 0 and saves[0]["collectives_in_loop"] == 0
    assert all(s["bytes_total"] > 0 and s["block_ms"] > 0 for s in saves)
    assert "summary of saves" in out and "mode=reuse" in out and "verified" in out
    assert (d / "ckpt" / "latest").read_text().strip() == "iter_0000008"
    losses = [s["loss"] for s in records(d / "log.jsonl", "step")]
    assert len(losses) == 8 and losses[-1] < losses[0]  # it learns


@RUN_A
def test_resume_bit_for_bit_ignoring_partial(run_a, tmp_path):
    d, _ = run_a
    load_dir = tmp_path / "load"
    shutil.copytree(d / "ckpt", load_dir)
    os.remove(load_dir / "iter_0000008" / ".metadata")  # now partial: must be ignored
    r = train("--steps", 8, "--load", load_dir, "--save", tmp_path / "b", "--save-interval", 4,
              "--async-save", "--use-persistent-ckpt-worker", "--ckpt-metadata", "auto", "--ckpt-overlap-staging",
              "--json-log", tmp_path / "b.jsonl", torchrun=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resumed from" in r.stdout and "iter_0000004" in r.stdout
    assert re.search(r"load: rank 0 loaded \S+iter_0000004 in [0-9.]+ s: read [0-9.]+ MiB from \d+ files", r.stdout)
    original = {s["step"]: s["loss"] for s in records(d / "log.jsonl", "step")}
    resumed = {s["step"]: s["loss"] for s in records(tmp_path / "b.jsonl", "step")}
    assert sorted(resumed) == [5, 6, 7, 8]
    assert all(resumed[k] == original[k] for k in resumed), (resumed, original)
    # auto: the resumed checkpoint's .metadata fits, so even the first save of this job reuses it
    assert [s["mode"] for s in records(tmp_path / "b.jsonl", "save")] == ["reuse"]


@pytest.mark.slow  # 29 s; run by make test-slow (in CI)
def test_fsdp_shards_resume_and_keep_last(tmp_path):
    log = tmp_path / "log.jsonl"
    r = train("--parallel", "fsdp", "--steps", 6, "--save", tmp_path / "c", "--save-interval", 2,
              "--async-save", "--use-persistent-ckpt-worker", "--ckpt-metadata",
              tmp_path / "p.md", "--ckpt-metadata-create", "--keep-last", 1, "--json-log", log)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [s["mode"] for s in records(log, "save")] == ["create", "reuse", "reuse"]
    assert sorted(p for p in os.listdir(tmp_path / "c") if p.startswith("iter_")) == ["iter_0000006"]
    r2 = train("--parallel", "fsdp", "--steps", 7, "--load", tmp_path / "c", "--json-log", tmp_path / "d.jsonl")
    assert r2.returncode == 0, r2.stdout + r2.stderr
    assert [s["step"] for s in records(tmp_path / "d.jsonl", "step")] == [7]


def test_fsdp_checkpoint_holds_shards(tmp_path, capsys):
    r = train("--parallel", "fsdp", "--steps", 1, "--save", tmp_path / "s", "--save-interval", 1)
    assert r.returncode == 0, r.stdout + r.stderr
    assert cli(["inspect", str(tmp_path / "s" / "iter_0000001"), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    chunks = {i["key"]: i.get("chunks") for i in rep["items"]}
    assert chunks["model.tok.weight"] == 2  # one shard per rank


@RUN_A
def test_cli_on_trained_checkpoint(run_a, tmp_path, capsys):
    d, _ = run_a
    ck = d / "ckpt" / "iter_0000008"
    assert cli(["verify", str(ck), "--prepared", str(d / "prepared.metadata"), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["ok"] and rep["checksums"] == "verified" and rep["prepared"] == "matches"
    assert rep["checksummed_records"] == rep["records"]
    out = tmp_path / "offline.md"
    assert cli(["prepare", "--from", str(ck), "--out", str(out), "--world-size", "2", "--workers", "1"]) == 0
    assert cli(["inspect", str(out), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert rep["fingerprint"]["world_size"] == 2
    # a flipped byte in a data file is caught by its checksum
    bad = tmp_path / "bad"
    shutil.copytree(ck, bad)
    data = bytearray((bad / "__1_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bad / "__1_0.distcp").write_bytes(bytes(data))
    assert cli(["verify", str(bad)]) == 1
    assert "checksum mismatch" in capsys.readouterr().out


def test_flag_errors_are_clear(tmp_path):
    r = train("--steps", 2, "--ckpt-metadata-create")
    assert r.returncode == 2 and "--ckpt-metadata-create needs --ckpt-metadata" in r.stderr
    assert "Traceback" not in r.stderr


@RUN_A
def test_mismatched_prepared_file_fails_clearly(run_a, tmp_path):
    d, _ = run_a
    other = tmp_path / "ws4.md"
    assert cli(["prepare", "--from", str(d / "ckpt" / "iter_0000008"), "--out", str(other),
                "--world-size", "4"]) == 0
    r = train("--steps", 2, "--save", tmp_path / "x", "--ckpt-metadata", other, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "world_size differs" in r.stderr and "Traceback" not in r.stderr


def test_auto_prepared_metadata_resumes_at_fewer_ranks(tmp_path, case_log):
    """--ckpt-metadata auto keeps one prepared file per topology: a resume at 1 rank into the
    --save of a 2-rank run creates its own file instead of meeting the 2-rank one (it used to
    exit 2: 'world_size differs ... Delete the file')."""
    save = tmp_path / "ckpt"
    flags = ["--save", save, "--save-interval", 2, "--async-save", "--use-persistent-ckpt-worker",
             "--ckpt-metadata", "auto"]
    r = train("--steps", 2, *flags, "--json-log", tmp_path / "two.jsonl")
    assert r.returncode == 0, r.stdout + r.stderr
    r = train("--nproc", 1, "--steps", 4, "--load", save, *flags, "--json-log", tmp_path / "one.jsonl")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resumed from" in r.stdout and "checkpoint of 2 ranks on 1" in r.stdout
    assert (save / "prepared-w2-n1.metadata").exists() and (save / "prepared-w1-n1.metadata").exists()
    modes = [s["mode"] for s in records(tmp_path / "one.jsonl", "save")]
    assert modes == ["create"], modes  # the 2-rank checkpoint does not fit 1 rank: its own file
    solosave.load_prepared_metadata(save / "prepared-w2-n1.metadata").check_compatible(2, 1)  # untouched
    case_log("solosave train --ckpt-metadata auto at 2 ranks, then resumed at 1 rank into the same --save",
             "the resume creates <save>/prepared-w1-n1.metadata (one prepared file per topology) and "
             "trains and saves; the 2-rank file is left as it was (it used to exit 2: 'world_size differs')")


@RUN_A
def test_resuming_a_checkpoint_of_another_model_fails_in_one_line(run_a, case_log):
    d, _ = run_a  # saved with --layers 1
    r = train("--layers", 2, "--steps", 10, "--load", d / "ckpt", timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if "solosave train: error" in line]
    assert len(errors) == 1, r.stderr  # rank 0 says it, once: every rank has the same error
    assert "was saved by another model: model.blocks.1." in errors[0] and "--layers" in errors[0], errors
    case_log("solosave train --load of a checkpoint saved with another model (--layers 2 resuming 1 layer)",
             f"exit status 2 and one line, no traceback: {errors[0].split('error: ', 1)[1][:160]}...")


def test_a_save_directory_that_cannot_be_created_fails_in_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    r = train("--steps", 2, "--save", tmp_path / "file" / "ck", "--save-interval", 2, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if "solosave train: error" in line]
    assert len(errors) == 1 and "cannot create it (Not a directory)" in errors[0], r.stderr  # not one per rank
    assert "Traceback" not in r.stderr


def test_a_user_error_is_printed_once_before_training_and_by_its_rank_after(monkeypatch, capsys):
    from solosave.demo.job import run_rank

    def fails(training):
        def body(args, progress):
            progress.training = training
            raise solosave.CheckpointError("save to x failed on rank(s) [1]", {1: "OSError: disk full"})
        return body

    # Before training, rank 1 waits for the launcher to stop it once rank 0 said the error (the
    # 2-rank tests below check that the job prints it once); if not stopped, it says it itself.
    for rank, training, where in [("0", False, ""), ("1", False, " on rank 1"), ("1", True, " on rank 1")]:
        monkeypatch.setenv("RANK", rank)
        t0 = time.monotonic()
        assert run_rank(None, fails(training), grace=0.5) == 2
        assert (time.monotonic() - t0 >= 0.5) == (rank == "1" and not training)
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err  # one line, its parts joined
        assert err == f"solosave train: error{where}: save to x failed on rank(s) [1]; rank 1: OSError: disk full\n"


def test_check_fits_names_the_first_difference():
    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorProperties, TensorStorageMetadata

    from solosave.demo.job import check_fits

    def md(*shape):
        return TensorStorageMetadata(TensorProperties(), torch.Size(shape), [])

    sd = {"model": {"a": torch.zeros(2, 3)}, "train": {"step": 4}}
    check_fits(sd, {"model.a": md(2, 3), "train.step": BytesStorageMetadata()}, "ck")
    with pytest.raises(ValueError, match=r"model.a has shape \[4, 3\] there, \[2, 3\] in this model; resume"):
        check_fits(sd, {"model.a": md(4, 3)}, "ck")
    with pytest.raises(ValueError, match=r"model.b is there, not in this model; resume"):
        check_fits(sd, {"model.a": md(2, 3), "model.b": md(1)}, "ck")
    with pytest.raises(ValueError, match=r"model.a is missing there \(and 1 more differences\)"):
        check_fits(sd, {"model.c": md(1)}, "ck")


SCRIPT_WITHOUT_MAIN_GUARD = '''
import sys, torch, torch.distributed as dist
import solosave
dist.init_process_group("gloo")
with solosave.AsyncCheckpointer(prepared_metadata=sys.argv[1] + "/p.md", create_prepared_metadata=True) as ck:
    modes = [ck.save({"w": torch.full((4,), float(s))}, f"{sys.argv[1]}/s{s}").wait().mode for s in range(2)]
print("modes", dist.get_rank(), modes, flush=True)
dist.destroy_process_group()
'''


def test_user_script_without_main_guard(tmp_path):
    """The worker is a fresh interpreter: it must not re-run the user's script (a multiprocessing
    *spawn* child would, and would fail without an ``if __name__ == "__main__"`` guard)."""
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT_WITHOUT_MAIN_GUARD)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(script), str(tmp_path)], capture_output=True, text=True, timeout=200, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("['create', 'reuse']") == 2
    assert "resource_tracker" not in r.stderr  # the worker neither owns nor leaks the segments


@pytest.mark.slow  # 25 s; run by make test-slow (in CI)
@RUN_A
def test_resume_at_another_world_size(run_a, tmp_path):
    d, _ = run_a
    r = train("--nproc", 1, "--steps", 10, "--load", d / "ckpt", "--save", tmp_path / "one",
              "--save-interval", 5, "--json-log", tmp_path / "one.jsonl")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resumed from" in r.stdout and "checkpoint of 2 ranks on 1" in r.stdout
    assert [s["step"] for s in records(tmp_path / "one.jsonl", "step")] == [9, 10]
    r = train("--nproc", 3, "--steps", 11, "--load", tmp_path / "one", "--save", tmp_path / "three",
              "--json-log", tmp_path / "three.jsonl")
    assert r.returncode == 0, r.stdout + r.stderr  # rank 1 and 2 have no saved RNG: re-seeded
    assert "checkpoint of 1 ranks on 3" in r.stdout and "re-seeded" in r.stdout


def _preempted_job(tmp_path, flags, preempt):
    """A long job with ``flags``; after its third step ``preempt(process)`` (the notice); it must
    save once and exit 0. Returns (the steps logged before the notice, its output, the save)."""
    log = tmp_path / "log.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-m", "solosave", "train", *COMMON, "--steps", "100000",
                          "--save", str(tmp_path / "ck"), "--save-interval", "100000", "--async-save", *flags,
                          "--json-log", str(log)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (log.exists() and len(records(log, "step")) >= 3) and time.monotonic() < deadline:
            time.sleep(0.2)
        before = len(records(log, "step"))
        preempt(p)
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 0, out
    saves = records(log, "save")
    assert len(saves) == 1 and saves[0]["ok"] and saves[0]["step"] >= before, out
    assert f"exit signal received: saved step {saves[0]['step']}, exiting" in out and "verified" in out
    assert (tmp_path / "ck" / f"iter_{saves[0]['step']:07d}" / ".metadata").exists()
    return before, out, saves[0]


def test_exit_signal_handler_saves_and_exits_cleanly(tmp_path):
    # a scheduler's preemption: the launcher's process group, which the ranks are not in (each
    # has a session of its own): the launcher passes the signal on
    _preempted_job(tmp_path, ["--use-persistent-ckpt-worker", "--exit-signal-handler"],
                   lambda p: os.killpg(p.pid, signal.SIGTERM))


def test_a_preemption_notice_file_saves_one_step_on_every_rank_and_exits(tmp_path):
    notice = tmp_path / "preempt-notice"
    _preempted_job(tmp_path, ["--preemption-notice-file", str(notice)],
                   lambda p: notice.write_text("the scheduler will stop this job in 60 s\n"))


@pytest.mark.slow  # 34 s here; run by make test-slow (in CI)
def test_two_tiers_train_then_resume_from_the_durable_copy(tmp_path):
    """`--ckpt-durable-root`: every save is copied to the durable root; with the fast tier gone,
    `--load` resumes from the durable copy, bit for bit."""
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    r = train("--steps", 8, "--save", fast, "--save-interval", 4, "--async-save", "--use-persistent-ckpt-worker",
              "--ckpt-assume-constant-structure", "--ckpt-durable-root", durable, "--keep-last", 1,
              "--json-log", tmp_path / "a.jsonl")
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(os.listdir(fast)) == ["iter_0000008", "latest"]  # keep-last on the fast tier
    assert sorted(os.listdir(durable)) == ["iter_0000004", "iter_0000008", "latest"]
    assert (durable / "latest").read_text().strip() == "iter_0000008"
    shutil.rmtree(fast)  # the node's fast tier is lost
    shutil.rmtree(durable / "iter_0000008")  # and step 8's copy: step 4 is the newest restorable
    r = train("--steps", 8, "--load", fast, "--save", tmp_path / "b", "--save-interval", 4, "--async-save",
              "--use-persistent-ckpt-worker", "--ckpt-durable-root", durable, "--json-log", tmp_path / "b.jsonl")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"resumed from {durable / 'iter_0000004'} (step 4)" in r.stdout
    original = {s["step"]: s["loss"] for s in records(tmp_path / "a.jsonl", "step")}
    resumed = {s["step"]: s["loss"] for s in records(tmp_path / "b.jsonl", "step")}
    assert sorted(resumed) == [5, 6, 7, 8] and all(resumed[k] == original[k] for k in resumed)
    assert (durable / "latest").read_text().strip() == "iter_0000008"  # the resumed job's copy
