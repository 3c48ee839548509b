"""Regenerate the case table of docs/reliability.md from a run of the reliability tests.

    .venv/bin/python tools/reliability_table.py --run              # fault + bad-input suites
    .venv/bin/python tools/reliability_table.py --run --with-soak  # and the slow-marked cases (soaks)

``--run`` runs pytest with ``SOLOSAVE_RELIABILITY_OUT`` set (tests/conftest.py writes one JSON
row per case, with the test's outcome); ``--json FILE`` reuses files of earlier runs instead.
The table replaces what lies between the two ``reliability-table`` markers of the document.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "reliability.md")
START, END = "<!-- reliability-table:start -->", "<!-- reliability-table:end -->"
SUITES = ["tests/faults/test_faults.py", "tests/faults/test_faults_input.py", "tests/faults/test_faults_lifecycle.py",
          "tests/multiproc/test_load.py", "tests/unit/write/test_writer.py", "tests/unit/engine/test_engine.py",
          "tests/multiproc/test_multihost.py", "tests/integrations/test_verify.py",
          "tests/multiproc/test_checkpointer.py", "tests/unit/index/test_index.py",
          "tests/multiproc/test_dcp_compat.py",
          "tests/integrations/test_train.py::test_auto_prepared_metadata_resumes_at_fewer_ranks",
          "tests/integrations/test_train.py::test_resuming_a_checkpoint_of_another_model_fails_in_one_line",
          "tests/faults/test_untrusted.py", "tests/integrations/test_cli.py", "tests/faults/test_fuzz.py",
          "tests/multiproc/test_tiers.py", "tests/integrations/test_storage.py",
          "tests/unit/coordination/test_transfer.py", "tests/faults/test_soak_faults.py",
          "tests/unit/load/test_read.py::test_a_tensor_record_that_would_run_code_is_refused",
          "tests/faults/test_faults_round4.py", "tests/multiproc/test_peer_hosts.py",
          "tests/integrations/test_lightning.py::test_a_job_killed_while_saving_into_last_ckpt_keeps_the_previous_one"]


def run(paths: list[str], marker: str) -> tuple[dict, str, float]:
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker, *paths]
    t0 = time.monotonic()
    subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, SOLOSAVE_RELIABILITY_OUT=out), check=False)
    seconds = time.monotonic() - t0
    with open(out) as f:
        data = json.load(f)
    os.unlink(out)
    return data, " ".join(["pytest", "-m", f"'{marker}'", *paths]), seconds


def table(runs: list[tuple[dict, str, float]]) -> str:
    lines = []
    for data, cmd, seconds in runs:
        lines.append(f"Run of `{cmd}` on {data['date']}" + (f", {seconds:.0f} s in all:" if seconds else ":"))
        lines.append("")
    lines += ["| # | case | outcome | what happened | s |", "|---|---|---|---|---|"]
    n = 0
    for data, _, _ in runs:
        for row in data["rows"]:
            n += 1
            test = row["test"].split("::", 1)[-1]
            secs = row["seconds"] if row["seconds"] is not None else row.get("duration_s", "")
            observed = row["observed"].replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {n} | {row['case']} <br>`{test}` | {row.get('outcome', '?')} | {observed} | {secs} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="store_true", help="run the suites now")
    ap.add_argument("--with-soak", action="store_true", help="with --run: also the slow soak")
    ap.add_argument("--json", nargs="*", default=[], help="rows written by earlier runs "
                    "(SOLOSAVE_RELIABILITY_OUT=<file> pytest ...)")
    ap.add_argument("--print", action="store_true", help="print the table instead of editing the doc")
    a = ap.parse_args()
    runs = []
    if a.run:
        runs.append(run(SUITES, "not slow"))
        if a.with_soak:
            runs.append(run(["tests/multiproc/test_soak.py", *SUITES], "slow"))  # soaks and slow-marked cases
    for path in a.json:
        with open(path) as f:
            data = json.load(f)
        runs.append((data, data.get("command", path), float(data.get("seconds", 0.0))))
    if not runs:
        ap.error("nothing to tabulate: pass --run or --json FILE")
    text = table(runs)
    if a.print:
        print(text)
        return 0
    doc = open(DOC).read()
    i, j = doc.index(START) + len(START), doc.index(END)
    with open(DOC, "w") as f:
        f.write(doc[:i] + "\n" + text + "\n" + doc[j:])
    print(f"updated {os.path.relpath(DOC, ROOT)} ({sum(len(d['rows']) for d, _, _ in runs)} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
