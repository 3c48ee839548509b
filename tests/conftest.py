"""Shared test configuration: the reliability report's rows, and test ports per pytest session.

Reliability tests take the ``case_log`` fixture and call ``case_log(case, observed, seconds)``
once per case they check. With ``SOLOSAVE_RELIABILITY_OUT=<file.json>`` set, every row, with
its test's outcome (passed / failed / skipped and the reason), is written there at the end of the
session; ``tools/reliability_table.py`` turns the file into the table in docs/reliability.md.

Under pytest-xdist (``make test`` runs ``-n``) each worker process runs torch with one intra-op
thread (``OMP_NUM_THREADS=1``, unless set), as torchrun does for each rank: several pytest
processes share the cores, and idle OpenMP threads spinning beside the ranks of other tests
would burn the CPU those ranks need. A test runs in a worker process: its rows travel
to the controlling process inside the test's report (``user_properties``, which xdist sends
back), and only the controlling process writes the file. Run alone, the same path is taken in
one process.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):  # before any test module imports torch
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def worker_zygote(tmp_path_factory):
    """One worker zygote per pytest process (``worker/zygote.py``): the suite's checkpointers get
    their workers as forks of it instead of fresh interpreters, each of which imported torch
    and DCP again (about 3 s of CPU each, most of the suite's CPU time). Set before the first
    rank starts, so that the ranks, and the `solosave train` jobs tests start, inherit it. The
    fresh-interpreter start stays covered: ``run_ranks(..., fresh=True)``, the multi-host
    tests, ``test_zygote.py``, and `make train` and the wheel smoke test in CI.
    ``SOLOSAVE_TEST_ZYGOTE=0`` turns it off.

    Started on first use only (:func:`_zygote_when_needed`): a run of unit tests alone never
    pays for it (the zygote imports torch and DCP, seconds of one core)."""
    if os.environ.get("SOLOSAVE_TEST_ZYGOTE", "1") == "0":  # before the import, which imports torch
        yield None
        return
    from solosave._src.worker.zygote import ZYGOTE_ENV, start_zygote

    address = str(tmp_path_factory.mktemp("zygote") / "z.sock")
    proc = start_zygote(address)
    os.environ[ZYGOTE_ENV] = address
    try:
        yield address
    finally:
        os.environ.pop(ZYGOTE_ENV, None)
        proc.kill()
        proc.wait(10)


_UNIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "unit") + os.sep


@pytest.fixture(autouse=True)
def _zygote_when_needed(request):
    """The zygote for every test that may start a worker process: all but the unit tests
    (``tests/unit``: in-process, threads), and a unit test marked ``worker``. A test that starts
    a worker without it still runs, in a fresh interpreter (only slower)."""
    if not str(request.node.path).startswith(_UNIT) or request.node.get_closest_marker("worker"):
        request.getfixturevalue("worker_zygote")

_ITEM_ROWS = pytest.StashKey[list]()
_PROPERTY = "solosave_reliability_rows"  # the user_properties entry that carries a test's rows


@pytest.fixture
def case_log(request):
    rows = request.node.stash.setdefault(_ITEM_ROWS, [])

    def log(case: str, observed: str, seconds: float | None = None) -> None:
        rows.append({"test": request.node.nodeid, "case": case, "observed": observed,
                     "seconds": None if seconds is None else round(seconds, 2)})
    return log


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Where the test ran (a worker or the only process): its rows, with its outcome, join the
    report of its call (or of its skipped set-up)."""
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call" or (rep.when == "setup" and rep.skipped):
        reason = ""
        if rep.skipped and isinstance(rep.longrepr, tuple):
            reason = str(rep.longrepr[2]).removeprefix("Skipped: ")
        rows = item.stash.get(_ITEM_ROWS, [])
        if not rows and "case_log" in getattr(item, "fixturenames", ()):
            rows = [{"test": item.nodeid, "case": item.name, "observed": reason, "seconds": None}]
        for r in rows:
            r["outcome"] = rep.outcome
            r["duration_s"] = round(rep.duration, 1)
        if rows:
            rep.user_properties.append((_PROPERTY, json.dumps(rows)))


class ReliabilityReport:
    """Gathers the rows from the reports that reach this process and writes them at the end
    (the controlling process only: an xdist worker's reports are forwarded, not written)."""

    def __init__(self, config: pytest.Config, path: str) -> None:
        self.config = config
        self.path = path
        self.rows: list[dict] = []
        self.start = time.monotonic()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        for name, value in report.user_properties:
            if name == _PROPERTY:
                self.rows.extend(json.loads(value))

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if hasattr(self.config, "workerinput") or not self.rows:
            return
        with open(self.path, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "command": "pytest " + " ".join(self.config.invocation_params.args),
                       "seconds": round(time.monotonic() - self.start), "rows": self.rows}, f, indent=1)


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") and "torch" in sys.modules:  # imported before this file
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    path = os.environ.get("SOLOSAVE_RELIABILITY_OUT")
    if path:
        config.pluginmanager.register(ReliabilityReport(config, path), "solosave-reliability-report")
