"""``python -m benchmarks`` without the plotting library: the JSON files and the tables are
written all the same, and the plots are skipped with one line saying why."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# matplotlib made unimportable in the benchmark's own interpreter (None in sys.modules makes
# any import of it raise ImportError), whether or not it is installed here
NO_MATPLOTLIB = ("import sys; sys.modules['matplotlib'] = None; from benchmarks.__main__ import main; "
                 "sys.exit(main(sys.argv[1:]))")


def test_results_are_written_and_plots_skipped_without_matplotlib(tmp_path):
    out, summary = tmp_path / "out", tmp_path / "scale.json"
    r = subprocess.run([sys.executable, "-c", NO_MATPLOTLIB, "--only", "scale", "--world-sizes", "2",
                        "--solosave-only", "--out", str(out), "--json", str(summary)],
                       cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((out / "benchmarks.json").read_text())
    assert [row["world"] for row in report["scale"]["solosave"]] == [2] and "errors" not in report["scale"]
    assert [row["world_size"] for row in json.loads(summary.read_text())["scale"]] == [2]
    skipped = [ln for ln in r.stdout.splitlines() if ln.startswith("plots skipped:")]
    assert len(skipped) == 1 and "matplotlib cannot be imported" in skipped[0], r.stdout
    assert "solosave[plots]" in skipped[0]
    assert "=== scale simulation" in r.stdout and "\n     2       400 |" in r.stdout  # the table, W=2's row
    assert not list(out.glob("*.png"))
