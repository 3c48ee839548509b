"""The scale simulation's code paths at a tiny simulated world size (seconds)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import scale  # noqa: E402


def test_structure_is_llama_like_and_shards_tile():
    st = scale.llama_like()
    assert len(st) == 200
    for w in (3, 512):
        for _, shape in st[:8]:
            covered = sum(scale.shard_dim0(shape, w, r)[1][0] for r in range(w))
            assert covered == shape[0]


@pytest.mark.parametrize("world", [2, 8])
def test_solosave_and_dcp_simulations_run(tmp_path, world):
    st = scale.llama_like(layers=2)
    s = scale.simulate_solosave(st, world, 1, str(tmp_path))
    d = scale.simulate_dcp(st, world, str(tmp_path))
    for r in (s, d):
        assert r["coordinator_total_s"] > 0 and r["metadata_bytes"] > 0
        assert r["plan_bytes_gathered"] > world * 100
    assert s["plan_bytes_per_rank"] < d["plan_bytes_per_rank"]
    assert s["reuse_coordinator_s"] > 0 and s["t_reuse_rank_plan_and_guard"] > 0
    assert list(tmp_path.iterdir()) == []  # scratch checkpoints removed


def test_world_sizes():
    assert scale.world_sizes(16) == [2, 4, 8, 16]


def test_command_line_scale_part_writes_report_and_plots(tmp_path, capsys):
    import json

    from benchmarks.__main__ import main

    assert main(["--only", "scale", "--scale-max-w", "4", "--dcp-max-w", "2", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "benchmarks.json").read_text())
    assert [r["world"] for r in report["scale"]["solosave"]] == [2, 4]
    assert [r["world"] for r in report["scale"]["dcp"]] == [2]
    assert (tmp_path / "scale_time.png").stat().st_size > 1000
    assert (tmp_path / "scale_bytes.png").stat().st_size > 1000
    assert "not run" in capsys.readouterr().out  # DCP stopped at --dcp-max-w, and the table says so
