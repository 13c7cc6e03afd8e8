"""The interconnect check on real gloo ranks: below its floor a run stops before training,
in-process restarts do not retry it, and the launcher's restart measures again."""

import pytest

from tests.distributed.conftest import PLAIN_OVERRIDES, events, train
from trainer.faults import fatal_error_path
from trainer.launch import LauncherSettings, TrainingFailed

pytestmark = pytest.mark.launches


def test_an_all_reduce_below_the_floor_stops_the_run_before_training_and_each_restart_measures_again(
    dataset_dir, tmp_path
):
    workdir = tmp_path / "work"
    unreachable = ["resilience.allreduce_check_mib=1", "resilience.min_allreduce_gbps=1e6"]
    with pytest.raises(TrainingFailed) as failed:
        train(dataset_dir, workdir, steps=4, every=4, overrides=[*PLAIN_OVERRIDES, *unreachable],
              launcher=LauncherSettings(max_restarts=1), checkpoint_mode="sync")  # fmt: skip
    kinds = [e["kind"] for e in events(workdir)]
    checks = [e for e in events(workdir) if e["kind"] == "link_check"]
    assert len(checks) == 2, kinds  # the first group and the launcher's restart; no in-process retry
    assert all(c["world_size"] == 2 and c["bytes"] == 2**20 and 0 < c["busbw_gbps"] < 1e6 for c in checks)
    assert "step" not in kinds and "resumed" not in kinds
    assert not fatal_error_path(workdir).exists(), "a slow link is not the run's fault: a restart may pass"
    log = (workdir / "logs" / "train.log").read_text()
    assert log.count("is below resilience.min_allreduce_gbps") >= 2, str(failed.value)[-3000:]
    assert "in-process restarts ended: all-reduce of 1 MiB over 2 ranks" in log
