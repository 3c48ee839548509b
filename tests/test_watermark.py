"""The staging watermark (``_watermark.py``): a reader waits for its bytes, learns a failed or
abandoned copy, and never waits past its timeout."""

from __future__ import annotations

import threading

import pytest

from solosave import SaveTimeoutError
from solosave._protocol import StageProgress
from solosave._watermark import StagingFailed, Watermark

pytestmark = pytest.mark.timeout(30)


def _waiter(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            fn()
            out["ok"] = True
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_reader_waits_until_its_bytes_are_staged():
    mark = Watermark(seq=3, timeout=20)
    t, out = _waiter(lambda: mark.wait(1000))
    mark.update(StageProgress(3, 999))  # one byte short: still waiting
    t.join(0.2)
    assert t.is_alive() and not out
    mark.update(StageProgress(3, 1000))
    t.join(10)
    assert out == {"ok": True}
    mark.wait(1000)  # below the mark: returns at once
    assert not mark.done


def test_progress_of_another_save_is_ignored():
    mark = Watermark(seq=3, timeout=0.2)
    mark.update(StageProgress(2, 10**9, True))
    assert not mark.done
    with pytest.raises(SaveTimeoutError, match="save 3: waited 0.2 s for byte 1"):
        mark.wait(1)


def test_done_releases_every_reader_and_wait_done():
    mark = Watermark(seq=1, timeout=20)
    t, out = _waiter(lambda: mark.wait(1 << 40))
    t2, out2 = _waiter(mark.wait_done)
    mark.update(StageProgress(1, 4096, True))
    t.join(10)
    t2.join(10)
    assert out == {"ok": True} and out2 == {"ok": True} and mark.done


def test_a_failed_copy_fails_every_waiter_naming_its_error():
    mark = Watermark(seq=5, timeout=20)
    mark.update(StageProgress(5, 4096))
    t, out = _waiter(lambda: mark.wait(8192))
    mark.update(StageProgress(5, 0, True, "save() raised on this rank: RuntimeError: boom"))
    t.join(10)
    assert isinstance(out.get("error"), StagingFailed)
    assert "staging failed on this rank: save() raised on this rank: RuntimeError: boom" in str(out["error"])
    with pytest.raises(StagingFailed, match="boom"):
        mark.wait_done()  # bytes written before the failure do not make the save good
    mark.wait(4096)  # those bytes were staged: a reader of them is not failed
    mark.update(StageProgress(5, 1 << 20, True))  # nothing changes a finished copy
    with pytest.raises(StagingFailed):
        mark.wait(8192)


def test_an_abandoned_copy_fails_at_once():
    mark = Watermark(seq=2, timeout=600)
    t, out = _waiter(mark.wait_done)
    mark.abandon("the trainer exited")
    t.join(10)
    assert isinstance(out.get("error"), StagingFailed) and "the trainer exited" in str(out["error"])


def test_a_reader_gives_up_after_the_timeout():
    mark = Watermark(seq=9, timeout=0.1)
    with pytest.raises(SaveTimeoutError, match="the staging copy to end"):
        mark.wait_done()
