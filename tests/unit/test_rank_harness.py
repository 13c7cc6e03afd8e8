"""The rank harness (tests/distributed/harness.py) starts nothing in a test not marked
`launches`, and `train()` sends a run to the launcher exactly when it needs one."""

import pytest

from tests.conftest import LAUNCH_GUARD
from tests.distributed import harness
from tests.distributed.conftest import needs_launcher, run_config
from trainer.launch import LauncherSettings


def test_a_test_not_marked_launches_cannot_fork_ranks_and_nothing_starts(tmp_path):
    session = harness.current()
    assert session is not None  # the session's (`--rank-harness=auto`)
    config = run_config(tmp_path / "data", tmp_path / "work")
    with pytest.raises(RuntimeError, match=r"2 ranks of the rank harness.* not marked `launches`"):
        session.run(2, config)
    assert not (tmp_path / "work").exists()  # refused before the run's folder, the zygote or a rank
    LAUNCH_GUARD.refused.clear()  # this test's own refusal, made on purpose


@pytest.mark.parametrize(
    ("named", "launcher", "needed"),
    [
        ({}, None, False),
        ({"stop_after": 6, "checkpoint_mode": "async"}, None, False),
        ({"faults": "exception@6:1,hang@11:1"}, None, False),  # soft faults: recovered in-process
        ({"faults": "exception@6:1", "inprocess_restarts": 0}, None, True),  # the launcher restarts
        ({"faults": "exception@2:1,sigkill@5:0"}, None, True),
        ({"faults": "node-loss@7:1"}, None, True),
        ({}, LauncherSettings(max_restarts=1), True),  # the launcher's settings are the subject
    ],
)
def test_a_run_needs_the_launcher_for_a_hard_fault_or_launcher_settings(named, launcher, needed, tmp_path):
    config = run_config(tmp_path / "data", tmp_path / "work", **named)
    assert needs_launcher(config, launcher) is needed
