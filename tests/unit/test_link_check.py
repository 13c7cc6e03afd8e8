"""The interconnect check's arithmetic and settings (its collective runs in
tests/distributed/test_link_check.py and in the 4-rank HSDP runs)."""

import pytest

from trainer.config import ConfigError, build_config
from trainer.link_check import LinkCheck, bus_bandwidth_gbps


def test_bus_bandwidth_is_what_each_link_carries_as_nccl_tests_count_it():
    assert bus_bandwidth_gbps(10**9, 1.0, 2) == pytest.approx(1.0)  # 2(n-1)/n = 1
    assert bus_bandwidth_gbps(10**9, 0.5, 8) == pytest.approx(3.5)  # 1.75 x 2 GB/s
    assert bus_bandwidth_gbps(10**9, 1.0, 16) == pytest.approx(1.875)


def test_only_a_floor_above_the_measured_bandwidth_refuses():
    measured = LinkCheck(world_size=16, bytes=2**28, seconds=0.01, busbw_gbps=50.3, floor_gbps=100.0)
    assert measured.too_slow and "bus bandwidth 50.3 GB/s (floor 100 GB/s)" in measured.refusal()
    assert "256 MiB over 16 ranks: 10.00 ms" in measured.line()
    assert not LinkCheck(16, 2**28, 0.01, 50.3, floor_gbps=0.0).too_slow  # report only
    assert not LinkCheck(16, 2**28, 0.01, 150.0, floor_gbps=100.0).too_slow


def test_a_floor_without_a_check_or_a_negative_size_is_refused():
    with pytest.raises(ConfigError, match="a floor needs a check"):
        build_config("tiny-cpu", ["resilience.min_allreduce_gbps=10"])
    with pytest.raises(ConfigError, match="allreduce_check_mib"):
        build_config("tiny-cpu", ["resilience.allreduce_check_mib=-1"])
    config = build_config(
        "tiny-cpu", ["resilience.allreduce_check_mib=8", "resilience.min_allreduce_gbps=10"]
    )
    assert (config.resilience.allreduce_check_mib, config.resilience.min_allreduce_gbps) == (8, 10)
