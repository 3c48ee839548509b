"""Workers forked by a zygote (worker/zygote.py) against fresh interpreters: both save, report a
killed worker's exit code alike, and end with their trainer."""

import os
import time

import pytest

from solosave._src.worker.host import _forked
from solosave._src.worker.zygote import ZYGOTE_ENV
from tests.multiproc import zygote_fns
from tests.support import run_ranks, run_ranks_tolerant, wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("zygote", [True, False])
def test_a_worker_saves_and_its_death_is_reported_alike(tmp_path, zygote, worker_zygote):
    env = {} if zygote else {ZYGOTE_ENV: ""}
    (o,) = run_ranks(zygote_fns.who_starts_the_worker, 1, str(tmp_path), env=env, timeout=90)
    assert o["published"] and o["loads"], o
    assert o["parent_is_trainer"] is (not zygote or worker_zygote is None), o
    assert "exited with code -9" in o["after_kill"], o


def test_a_zygotes_worker_ends_with_its_trainer(tmp_path, worker_zygote):
    if worker_zygote is None:
        pytest.skip("the suite's zygote is off (SOLOSAVE_TEST_ZYGOTE=0)")
    res = run_ranks_tolerant(zygote_fns.trainer_dies, 1, str(tmp_path), timeout=90)
    assert res[0][0] == "died" and res[0][1] == 0, res
    pid = int((tmp_path / "pid").read_text())

    def gone():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    assert wait_until(gone, timeout=10), f"worker {pid} outlived its trainer"


def test_an_unreachable_zygote_means_a_fresh_interpreter(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(ZYGOTE_ENV, str(tmp_path / "nobody.sock"))
    t0 = time.monotonic()
    assert _forked(0) is None
    assert time.monotonic() - t0 < 5
    assert "starting the worker as a fresh interpreter" in caplog.text and "nobody.sock" in caplog.text
