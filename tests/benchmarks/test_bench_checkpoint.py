"""`rtp bench checkpoint` runs every mode and reports the documented JSON (no timing asserts)."""

import pytest

from tests.benchmarks import run_bench


@pytest.mark.bench
@pytest.mark.launches
@pytest.mark.timeout(600)
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


def test_bench_checkpoint_rounds_pair_each_mode_with_its_rounds_off_run(monkeypatch, tmp_path):
    """With --rounds the modes run in turn, each round starting one mode further on, and the
    wall ratio is the median of per-round ratios (a slow minute moves one pair only)."""
    from benchmarks import checkpoint

    order = []
    walls = {("off", 0): 10.0, ("async", 0): 25.0, ("off", 1): 20.0, ("async", 1): 21.0,
             ("off", 2): 30.0, ("async", 2): 31.5}  # fmt: skip

    def stand_in(mode, dataset_dir, workdir, **kwargs):  # the launcher is not run
        round_ = int(workdir.name.rsplit("-", 1)[1])
        order.append(mode)
        assert dataset_dir.is_dir() and not workdir.exists()
        return {"wall_s": walls[mode, round_], "saves": round_, "model_sha256": "same", "final_loss": 1.0}

    monkeypatch.setattr(checkpoint, "run_mode", stand_in)
    result = checkpoint.run_benchmark(
        modes=["off", "async"], nproc=1, steps=2, every=1, preset="tiny-cpu", workdir=tmp_path, rounds=3
    )
    assert order == ["off", "async", "async", "off", "off", "async"]
    off, async_ = result["modes"]["off"], result["modes"]["async"]
    assert (off["wall_s"], async_["wall_s"], async_["saves"]) == (20.0, 25.0, 1)
    # Per-round ratios 2.5, 1.05, 1.05: their median, not the medians' ratio 25 / 20 = 1.25.
    assert async_["wall_vs_off"] == pytest.approx(1.05)
    assert async_["wall_vs_off_rounds"] == pytest.approx([2.5, 1.05, 1.05])
    assert async_["wall_s_rounds"] == [25.0, 21.0, 31.5]
    assert off["wall_vs_off"] == 1.0 and result["rounds"] == 3
    table = checkpoint.format_table({**result, "modes": {m: _row(r) for m, r in result["modes"].items()}})
    assert "medians of 3 rounds" in table and "async 2.50x, 1.05x, 1.05x" in table


def test_bench_checkpoint_refuses_rounds_that_trained_different_weights():
    from benchmarks import checkpoint

    rows = [{"wall_s": 1.0, "model_sha256": "a"}, {"wall_s": 1.0, "model_sha256": "b"}]
    with pytest.raises(RuntimeError, match="different weights"):
        checkpoint.combine_rounds({"off": rows})


def _row(r):
    """A stand-in row with every figure the table prints."""
    figures = ("blocked_s_per_save_median", "blocked_s_per_save_max", "write_s_per_save_median",
               "efficiency_pct", "checkpoint_bytes", "local_tier_ms_per_copy", "host_copies")  # fmt: skip
    return {**dict.fromkeys(figures, 0.0), **r}
