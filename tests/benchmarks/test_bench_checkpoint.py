"""`rtp bench checkpoint` runs every mode and reports the documented JSON (no timing asserts)."""

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def test_bench_checkpoint_reports_every_mode(tmp_path):
    out = tmp_path / "bench.json"
    command = [
        sys.executable,
        "-m",
        "rtp_cli.main",
        "bench",
        "checkpoint",
        "--preset",
        "tiny-cpu",
        "--steps",
        "4",
        "--every",
        "2",
        "--nproc",
        "1",
        "--json",
        str(out),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=550, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
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
    assert data["modes"]["off"]["efficiency_pct"] == 100.0
    # every mode trains the same run: the weights agree
    assert len({row["model_sha256"] for row in data["modes"].values()}) == 1
    assert "efficiency" in result.stdout and "torch-async" in result.stdout
