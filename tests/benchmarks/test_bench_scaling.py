"""`rtp bench scaling` trains both layouts and reports the documented JSON (no timing asserts)."""

import pytest

from benchmarks.scaling import traffic
from tests.benchmarks import run_bench

pytestmark = [pytest.mark.timeout(600)]


@pytest.mark.bench
@pytest.mark.launches
def test_bench_scaling_trains_fsdp_and_hsdp_side_by_side(tmp_path):
    data, printed = run_bench(
        "scaling", tmp_path / "bench.json", "--steps", "2", "--every", "2", "--nproc", "2", "--replicate", "2"
    )
    assert data["fsdp"]["mesh"] == [1, 2] and data["hsdp"]["mesh"] == [2, 1]
    for side in ("fsdp", "hsdp"):
        assert data[side]["tokens_per_s"] > 0 and data[side]["saves"] == 1
    # Both layouts train the same model on the same batches: the losses agree closely.
    assert data["fsdp"]["final_loss"] == pytest.approx(data["hsdp"]["final_loss"], rel=1e-5)
    assert data["hsdp"]["cross_group_bytes"] > 0 == data["fsdp"]["cross_group_bytes"]
    assert "hsdp 2x1" in printed and "fsdp 1x2" in printed


def test_traffic_splits_the_bytes_between_the_shard_group_and_the_replicas():
    # 1,000 fp32 parameters: FSDP over 4 moves (4 + 4 + 4) x 1000 x 3/4; HSDP 2 x 2 moves the
    # same over a group of 2 (1/2) and all-reduces its 500 gradient shard: 2 x 2000 B x 1/2.
    assert traffic(1000, 4, 1, 4) == {"in_group_bytes": 9000.0, "cross_group_bytes": 0.0}
    assert traffic(1000, 4, 2, 2) == {"in_group_bytes": 6000.0, "cross_group_bytes": 2000.0}
    assert traffic(1000, 2, 2, 2)["in_group_bytes"] == 4000.0  # bf16 gathers
