"""Shared test configuration: the reliability report's rows.

Reliability tests take the ``case_log`` fixture and call ``case_log(case, observed, seconds)``
once per case they check. With ``SOLOSAVE_RELIABILITY_OUT=<file.json>`` set, every row, with
its test's outcome (passed / failed / skipped and the reason), is written there at the end of the
session; ``tools/reliability_table.py`` turns the file into the table in docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import time

import pytest

_ROWS: list[dict] = []


@pytest.fixture
def case_log(request):
    def log(case: str, observed: str, seconds: float | None = None) -> None:
        _ROWS.append({"test": request.node.nodeid, "case": case, "observed": observed,
                      "seconds": None if seconds is None else round(seconds, 2)})
    return log


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call" or (rep.when == "setup" and rep.skipped):
        status = rep.outcome
        reason = ""
        if rep.skipped and isinstance(rep.longrepr, tuple):
            reason = str(rep.longrepr[2]).removeprefix("Skipped: ")
        rows = [r for r in _ROWS if r["test"] == item.nodeid]
        if not rows and "case_log" in getattr(item, "fixturenames", ()):
            _ROWS.append({"test": item.nodeid, "case": item.name, "observed": reason, "seconds": None})
            rows = _ROWS[-1:]
        for r in rows:
            r["outcome"] = status
            r["duration_s"] = round(rep.duration, 1)


_START = time.monotonic()


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("SOLOSAVE_RELIABILITY_OUT")
    if path and _ROWS:
        with open(path, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "command": "pytest " + " ".join(session.config.invocation_params.args),
                       "seconds": round(time.monotonic() - _START), "rows": _ROWS}, f, indent=1)
