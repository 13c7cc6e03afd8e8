"""`rtp bench throughput` runs both stacks at toy size and writes the documented JSON (no timing asserts)."""

import pytest

from benchmarks.throughput import mfu_pct, peak_bf16_flops
from tests.benchmarks import run_bench

pytestmark = [pytest.mark.timeout(600)]

SIDE_KEYS = {"tokens_per_s", "wall_s", "step_s_median", "peak_mem_bytes", "mfu_pct"}


def test_peak_flops_and_mfu():
    assert peak_bf16_flops("NVIDIA H200") == peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_bf16_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_bf16_flops("cpu") is None
    # 1B parameters at 41,200 tokens/s on one H200: 6e9 x 41.2e3 / 989e12 = 25%
    assert mfu_pct(10**9, 41_200, 989e12, 1) == pytest.approx(24.99, abs=0.01)
    assert mfu_pct(10**9, 41_200, None, 1) is None


@pytest.mark.bench
@pytest.mark.launches
def test_bench_throughput_writes_both_sides_and_the_tax(tmp_path):
    out = tmp_path / "throughput.json"
    data, printed = run_bench("throughput", out, "--preset", "tiny-cpu", "--steps", "4", "--every", "2")
    for side in ("rtp", "bare"):
        assert set(data[side]) >= SIDE_KEYS, side
        assert data[side]["tokens_per_s"] > 0 and data[side]["peak_mem_bytes"] > 0
        assert data[side]["mfu_pct"] is None  # CPU: no peak FLOP/s to compare with
    assert data["tax"] == pytest.approx(data["rtp"]["wall_s"] / data["bare"]["wall_s"])
    assert data["rtp"]["saves"] == 2
    for side in ("rtp", "bare"):  # wall = steps x median iteration + what lies beyond it
        row = data[side]
        assert row["beyond_median_s"] == pytest.approx(row["wall_s"] - 4 * row["iteration_s_median"])
    assert "beyond steps x iteration median" in printed
    # The same model on the same batches: both stacks reach the same loss.
    assert data["rtp"]["final_loss"] == pytest.approx(data["bare"]["final_loss"], rel=1e-6)
    assert "tax (rtp wall / bare wall)" in printed
