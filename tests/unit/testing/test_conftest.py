"""tests/conftest.py under pytest-xdist: the reliability report's rows logged by tests in worker
processes reach the file that the controlling process writes, and each worker runs torch with
one intra-op thread."""

import json
import os
import shutil
import subprocess
import sys

import pytest

CONFTEST = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "conftest.py")

TESTS = '''
import pytest

@pytest.mark.parametrize("i", range(4))
def test_logs(case_log, i):
    case_log(f"case {i}", f"observed {i}", 0.5)

def test_fails(case_log):
    case_log("failing case", "seen")
    assert False

def test_skipped(case_log):
    pytest.skip("no reason to run")
'''


@pytest.mark.parametrize("workers", [0, 2])
def test_rows_of_every_worker_reach_the_report(tmp_path, workers):
    if workers:
        pytest.importorskip("xdist", reason="pytest-xdist is not installed (requirements-dev.txt)")
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_cases.py").write_text(TESTS)
    out = tmp_path / "rows.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["SOLOSAVE_RELIABILITY_OUT"] = str(out)
    env["SOLOSAVE_TEST_ZYGOTE"] = "0"  # these tests start no worker: no zygote per pytest process
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(workers), "test_cases.py"]
    if not workers:
        cmd[cmd.index("-n"):cmd.index("-n") + 2] = []
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr  # test_fails fails, the rest pass or skip
    rows = {row["case"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {f"case {i}" for i in range(4)} | {"failing case", "test_skipped"}
    assert all(rows[f"case {i}"]["outcome"] == "passed" and rows[f"case {i}"]["observed"] == f"observed {i}"
               and rows[f"case {i}"]["seconds"] == 0.5 for i in range(4))
    assert rows["failing case"]["outcome"] == "failed"
    assert rows["test_skipped"]["outcome"] == "skipped" and rows["test_skipped"]["observed"] == "no reason to run"


THREADS = '''
import os

def test_threads():
    import torch
    assert os.environ["OMP_NUM_THREADS"] == "1" and torch.get_num_threads() == 1, torch.get_num_threads()
'''


def test_xdist_workers_run_torch_with_one_thread(tmp_path):
    pytest.importorskip("xdist", reason="pytest-xdist is not installed (requirements-dev.txt)")
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_threads.py").write_text(THREADS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != "OMP_NUM_THREADS"}
    env["SOLOSAVE_TEST_ZYGOTE"] = "0"  # it starts no worker: no zygote per pytest process
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "1", "test_threads.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
