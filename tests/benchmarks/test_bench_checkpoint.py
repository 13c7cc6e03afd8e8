"""`rtp bench checkpoint` runs every mode and reports the documented JSON (no timing asserts)."""

import pytest

from tests.benchmarks import run_bench

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def test_bench_checkpoint_reports_every_mode(tmp_path):
    out = tmp_path / "bench.json"
    data, printed = run_bench(
        "checkpoint", out, "--preset", "tiny-cpu", "--steps", "4", "--every", "2", "--nproc", "1"
    )
    assert set(data["modes"]) == {"off", "sync", "torch-async", "async"}
    assert data["interval_steps"] == 2 and data["model_params"] > 0
    keys = {
        "blocked_s_per_save_median",
        "blocked_s_per_save_max",
        "efficiency_pct",
        "wall_s",
        "saves",
        "checkpoint_bytes",
    }
    for mode, row in data["modes"].items():
        assert keys <= set(row), mode
        assert row["saves"] == (0 if mode == "off" else 2)
        # The fast tier copies every step in every mode but the baseline.
        assert row["local_tier_copies"] == (0 if mode == "off" else 4), mode
        assert (row["local_tier_ms_per_copy"] > 0) == (mode != "off"), mode
    assert data["modes"]["off"]["efficiency_pct"] == 100.0
    # Host memory for checkpointing: none without it; async writes from the tier's two slots
    # (their alignment and RNG states weigh at this size) and holds nothing more than sync.
    assert data["modes"]["off"]["host_copies"] == 0.0
    assert data["modes"]["async"]["host_copies"] == data["modes"]["sync"]["host_copies"] >= 2.0
    # every mode trains the same run: the weights agree
    assert len({row["model_sha256"] for row in data["modes"].values()}) == 1
    assert "efficiency" in printed and "torch-async" in printed
