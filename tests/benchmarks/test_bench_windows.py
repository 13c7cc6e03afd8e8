"""The GPU check's figures without set-up, checked on made-up timings (no launches): the
checkpoint benchmark's steady-state window, the throughput benchmark's window, its MFU from the
median iteration over non-embedding parameters, and the memory plan beside measured peaks."""

from __future__ import annotations

import pytest
from torch import nn

from benchmarks import checkpoint, throughput

pytestmark = pytest.mark.timeout(120)


def test_the_checkpoint_window_starts_after_warm_up_and_leaves_the_last_save_out():
    # 60 steps of 1 s, saves every 20 blocking 2 s each, the last one (step 60) after the window.
    ends = {step: float(step) for step in range(1, 61)}
    saves = [{"step": s, "blocked_s": 2.0} for s in (20, 40, 60)]
    window = checkpoint.timed_window(ends, saves, warmup_steps=20)
    assert window == {
        "window_s": 40.0,
        "window_steps": 40,
        "window_saves": 2,  # steps 20 and 40; 60's commit is the run's end, not its steady state
        "window_blocked_s": 4.0,
        "window_efficiency_pct": 90.0,
    }
    assert checkpoint.timed_window(ends, saves, warmup_steps=0)["window_s"] == 59.0  # from step 1's end
    with pytest.raises(ValueError, match="leaves no step to time"):
        checkpoint.timed_window(ends, saves, warmup_steps=60)


def test_each_modes_window_is_compared_with_its_own_rounds_off_window():
    rows = {
        "off": [{"wall_s": 30.0, "window_s": 10.0, "model_sha256": "x"}],
        "async": [{"wall_s": 45.0, "window_s": 10.5, "model_sha256": "x"}],
    }
    combined = checkpoint.combine_rounds(rows)
    # The whole run's ratio is dominated by set-up and the last commit; the window's is not.
    assert combined["async"]["wall_vs_off"] == 1.5
    assert combined["async"]["window_vs_off"] == pytest.approx(1.05)


def test_the_throughput_window_counts_tokens_from_the_end_of_warm_up():
    ends = {1: 5.0, 2: 5.5, 3: 6.0, 4: 6.5}  # a slow first step
    window = throughput.steady_window(ends, warmup_steps=2, tokens_per_step=1000)
    assert window == {"window_s": 1.0, "window_steps": 2, "window_tokens_per_s": 2000.0}


class _TiedLM(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 10)  # 1,000 parameters, a lookup
        self.block = nn.Linear(10, 10)  # 110, a matmul
        self.head = nn.Linear(10, 100, bias=False)  # 1,000, a matmul
        if tied:
            self.head.weight = self.embed.weight


def test_mfu_counts_the_parameters_that_multiply_and_a_tied_head_once():
    assert throughput.flop_parameters(_TiedLM(tied=False)) == 110 + 1000  # the lookup table left out
    assert throughput.flop_parameters(_TiedLM(tied=True)) == 110 + 1000  # the shared weight is a matmul


def test_the_memory_plan_is_set_beside_the_measured_peaks():
    from trainer.config import build_config

    gib = 2**30
    rtp = {"peak_mem_bytes_by_phase": {"train": 2 * gib, "fingerprint": gib, "evaluation": gib}}
    bare = {"peak_mem_bytes_by_phase": {"train": 2 * gib}}
    memory = throughput.memory_beside_plan(build_config("tiny-cpu"), 1, rtp, bare)
    assert set(memory["plan_gib"]) == {"train_step", "evaluation"} and memory["plan_fits"]
    assert memory["measured_gib"] == {
        "rtp": {"train": 2.0, "fingerprint": 1.0, "evaluation": 1.0},
        "bare": {"train": 2.0},
    }
    train = memory["rtp_measured_over_plan"]["train"]
    assert train == pytest.approx(2.0 / memory["plan_gib"]["train_step"])


def test_the_table_says_how_mfu_was_taken_and_the_steady_state():
    side = {
        "tokens_per_s": 1.0, "wall_s": 1.0, "step_s_median": 0.1, "iteration_s_median": 0.1,
        "peak_mem_bytes": 0, "mfu_pct": None, "startup_s": 1.0, "beyond_median_s": 0.0,
        "window_tokens_per_s": 123.0,
    }  # fmt: skip
    rtp = {**side, "loop_wall_s": 1.0, "saves": 1, "checkpoint_blocked_s": 0.0, "final_drain_s": 0.0}
    result = {
        "model_params": 2e6, "flop_params": 1e6, "steps": 4, "tokens_per_step": 10, "nproc": 1,
        "device": "cpu", "compute_dtype": "torch.float32", "checkpoint.every_steps": 2, "repeats": 1,
        "rtp": rtp, "bare": side, "tax": 1.0, "step_tax": 1.0, "load_avg_1m": [0.0, 0.0], "cpu_count": 2,
        "warmup_steps": 2, "memory": None,
    }  # fmt: skip
    table = throughput.format_table(result)
    assert "steady state (end of step 2 to the last): rtp 123 tokens/s" in table
    assert "6 x 1.0M non-embedding parameters" in table
