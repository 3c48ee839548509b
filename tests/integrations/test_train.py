"""End to end: `solosave train` at 2 ranks under torch.distributed.run - create-then-reuse saves,
resume bit for bit (ignoring a partial checkpoint), `--ckpt-metadata auto`, FSDP2 shards, and the
CLI subcommands on the checkpoints it produced."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from solosave.cli import main as cli

pytestmark = pytest.mark.timeout(300)
# The tests of run_a's job share one worker under pytest-xdist (make test: --dist loadgroup), so
# that the module fixture trains once, not once per worker.
RUN_A = pytest.mark.xdist_group("train_run_a")

COMMON = ["--nproc", "2", "--no-progress", "--layers", "1", "--d-model", "64", "--heads", "2",
          "--vocab", "128", "--seq-len", "32", "--batch-size", "4"]


def train(*args, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "solosave", "train", *COMMON, *map(str, args)],
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
              "--json-log", tmp_path / "b.jsonl")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resumed from" in r.stdout and "iter_0000004" in r.stdout
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


def test_exit_signal_handler_saves_and_exits_cleanly(tmp_path):
    import signal
    import time

    log = tmp_path / "log.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-m", "solosave", "train", *COMMON, "--steps", "100000",
                          "--save", str(tmp_path / "ck"), "--save-interval", "100000", "--async-save",
                          "--use-persistent-ckpt-worker", "--exit-signal-handler", "--json-log", str(log)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (log.exists() and len(records(log, "step")) >= 3) and time.monotonic() < deadline:
            time.sleep(0.2)
        os.killpg(p.pid, signal.SIGTERM)  # a scheduler's preemption: the whole job
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 0, out
    saves = records(log, "save")
    assert len(saves) == 1 and saves[0]["ok"], out
    assert "exit signal received: saved step" in out and "verified" in out
    assert (tmp_path / "ck" / f"iter_{saves[0]['step']:07d}" / ".metadata").exists()
