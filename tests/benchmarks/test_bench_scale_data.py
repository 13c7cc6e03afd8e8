"""`python -m benchmarks.scale_data` at toy size: the JSON shape and the equal-batches check (no
timing asserts here: a shared machine makes them noise; docs/data.md holds the measurement)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)


@pytest.mark.bench
def test_bench_scale_data_reports_both_implementations_at_both_sizes(tmp_path):
    out = tmp_path / "scale.json"
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "benchmarks.scale_data", "--small-mib", "2", "--large-mib", "4",
               "--shard-mib", "1", "--seq-len", "32", "--batches", "3", "--json", str(out)]  # fmt: skip
    result = subprocess.run(command, cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                            capture_output=True, text=True, timeout=200)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    results = json.loads(out.read_text())
    rows = {(r["implementation"], r["data_mib"]): r for r in results["rows"]}
    assert set(rows) == {(impl, size) for impl in ("legacy", "trainer.data") for size in (2, 4)}
    for row in rows.values():
        assert {"startup_s", "peak_rss_mib", "rss_before_data_mib", "batches_sha256"} <= set(row)
        assert row["peak_rss_mib"] >= row["rss_before_data_mib"] > 0
    assert set(results["summary"]) == {"legacy", "trainer.data"}
    assert results["targets"]["batches_equal"] is True
    assert "| trainer.data | 4 MiB |" in result.stdout
