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


def test_the_placement_model_counts_what_brute_force_counts():
    """``--only placement``: the exact counts of the model against every F-subset of small jobs,
    for the library's placement (``PeerPlacement.lost_files_of``) and the others'."""
    import itertools
    import math

    from benchmarks.placement import groups_of, p_no_durable_read, p_no_durable_read_domains, safe_subsets
    from solosave._src.tiers.placement import PeerPlacement

    for g, k in ((2, 1), (3, 1), (5, 2), (7, 3), (9, 1)):
        brute = [sum(1 for c in itertools.combinations(range(g), m)
                     if not any(all((q + j) % g in c for j in range(k + 1)) for q in range(g))) for m in range(5)]
        assert list(safe_subsets(g, k, 4)) == brute, (g, k)
    for hosts, k in ((7, 1), (9, 2), (10, 3), (8, 1)):
        p, groups = PeerPlacement(hosts, k), groups_of("solosave", hosts, k)
        for f in range(1, 5):
            ok = sum(1 for c in itertools.combinations(range(hosts), f) if not p.lost_files_of(set(c)))
            assert math.isclose(p_no_durable_read(groups, k, f), ok / math.comb(hosts, f)), (hosts, k, f)
    assert groups_of("clique", 9, 2) == [(0, 1, 2), (3, 4, 5), (6, 7, 8)] and groups_of("clique", 8, 2) is None
    assert groups_of("pairs", 6, 1) == [(0, 3), (1, 4), (2, 5)]
    # 8 hosts in 4 racks of 2, one copy: losing one rack never loses a file with the domains known
    assert p_no_durable_read_domains(groups_of("solosave", 8, 1, 2), 1, 2, 1) == (1.0, "exact")
    assert p_no_durable_read_domains(groups_of("solosave", 8, 1, 1), 1, 2, 1)[0] < 1.0


def test_the_overhead_benchmark_times_every_configuration(tmp_path):
    """A small run of ``--only overhead``: every configuration timed on both ranks, solosave's
    save phases reported, and the table printed."""
    from benchmarks import overhead

    cfg = {"per_rank_mib": 4, "tensors": 4, "matmuls": 1, "intervals": [1, 3], "warmup": 1,
           "steps": {"none": 6, "1": 4, "3": 6}, "timeout": 200, "fast_dir": str(tmp_path)}
    r = overhead.run_overhead_bench(cfg, tmp_path)
    assert list(r["figures"]) == ["none", "solosave/1", "dcp/1", "solosave/3", "dcp/3"]
    assert [f["steps"] for f in r["figures"].values()] == [6, 4, 4, 6, 6]
    assert r["figures"]["none"]["mean_ratio"] == 1.0 and all(f["mean_s"] > 0 for f in r["figures"].values())
    assert set(r["solosave_phases_s"]) == {"solosave/1", "solosave/3"}
    assert all(ph["to_published"] >= ph["write"] > 0 for ph in r["solosave_phases_s"].values())
    overhead.print_overhead(r)
