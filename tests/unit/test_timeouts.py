"""The in-process timeouts learned from step times (trainer/timeouts.py) and how a rank applies
them to NVRx's step watchdog (trainer/resilience.py's `_ProgressGate`)."""

from __future__ import annotations

import time

import pytest

from trainer.config import ConfigError, ResilienceConfig, TrainConfig, build_config
from trainer.launch import mark_new_run
from trainer.timeouts import LEARN_AFTER_STEPS, TIMEOUTS_FILE, StepTimeouts, soft_timeout_s, watchdog_timeouts

RULE = {"safety_factor": 5.0, "floor_s": 20.0, "ceiling_s": 600.0}


def test_an_explicit_soft_timeout_wins_over_what_was_learned():
    assert soft_timeout_s(100.0, 50, explicit_s=45.0, **RULE) == 45.0


def test_the_ceiling_applies_before_any_step_interval_was_seen():
    assert soft_timeout_s(None, 0, **RULE) == 600.0


def test_warm_up_allows_twice_the_learned_timeout():
    assert soft_timeout_s(10.0, LEARN_AFTER_STEPS - 1, **RULE) == 100.0
    assert soft_timeout_s(10.0, LEARN_AFTER_STEPS, **RULE) == 50.0


def test_the_learned_timeout_is_the_safety_factor_times_the_longest_interval():
    assert soft_timeout_s(46.0, 20, **RULE) == pytest.approx(230.0)


def test_the_learned_timeout_stays_above_the_floor():
    assert soft_timeout_s(0.5, 20, **RULE) == 20.0


def test_the_learned_timeout_stays_below_the_ceiling():
    assert soft_timeout_s(300.0, 20, **RULE) == 600.0


def test_timeouts_are_learned_by_default():
    r = TrainConfig().resilience
    assert (r.soft_timeout_s, r.hard_timeout_s) == ("auto", "auto")
    assert watchdog_timeouts(r) == (r.timeout_floor_s, 2 * r.timeout_floor_s)


def test_an_explicit_timeout_override_is_kept_in_seconds():
    r = build_config("tiny-cpu", ["resilience.soft_timeout_s=45", "resilience.hard_timeout_s=90"]).resilience
    assert watchdog_timeouts(r) == (45.0, 90.0)
    only_soft = build_config("tiny-cpu", ["resilience.soft_timeout_s=45"]).resilience
    assert watchdog_timeouts(only_soft) == (45.0, 45.0 + only_soft.timeout_floor_s)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["resilience.soft_timeout_s=soon"], r"must be auto or a positive number of seconds"),
        (["resilience.hard_timeout_s=90"], r"set both, or leave both auto"),
        (["resilience.soft_timeout_s=90", "resilience.hard_timeout_s=60"], r"must be below"),
        (["resilience.timeout_floor_s=700"], r"at most resilience\.timeout_ceiling_s"),
    ],
)
def test_a_bad_timeout_setting_says_how_to_fix_it(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_config("tiny-cpu", overrides)


def _learn(timeouts: StepTimeouts, interval_s: float, count: int = LEARN_AFTER_STEPS) -> None:
    for _ in range(count):
        timeouts.observe(interval_s)


def test_a_restarted_process_starts_with_the_learned_timeout(tmp_path):
    r = ResilienceConfig()
    first = StepTimeouts(r, tmp_path, write=True)
    _learn(first, 10.0)
    assert first.soft_s == 50.0 and (tmp_path / TIMEOUTS_FILE).is_file()
    restarted = StepTimeouts(r, tmp_path)  # a new process of the same run
    assert (restarted.soft_s, restarted.hard_s) == (50.0, 50.0 + r.timeout_floor_s)


def test_only_rank_zero_writes_the_learned_timeout(tmp_path):
    _learn(StepTimeouts(ResilienceConfig(), tmp_path, write=False), 10.0)
    assert not (tmp_path / TIMEOUTS_FILE).exists()


def test_a_longer_step_later_raises_the_kept_timeout(tmp_path):
    first = StepTimeouts(ResilienceConfig(), tmp_path, write=True)
    _learn(first, 10.0)
    first.observe(30.0)
    assert StepTimeouts(ResilienceConfig(), tmp_path).soft_s == 150.0


def test_an_explicit_timeout_ignores_a_learned_one(tmp_path):
    _learn(StepTimeouts(ResilienceConfig(), tmp_path, write=True), 10.0)
    explicit = StepTimeouts(ResilienceConfig(soft_timeout_s=30.0, hard_timeout_s=45.0), tmp_path)
    assert (explicit.soft_s, explicit.hard_s, explicit.learning) == (30.0, 45.0, False)


def test_a_new_run_forgets_the_learned_timeout(tmp_path):
    _learn(StepTimeouts(ResilienceConfig(), tmp_path, write=True), 10.0)
    mark_new_run(tmp_path)
    assert StepTimeouts(ResilienceConfig(), tmp_path).soft_s == ResilienceConfig().timeout_ceiling_s


class _CountingWrapper:
    """Stands in for NVRx's CallWrapper (which needs a monitor process): records ping times."""

    def __init__(self) -> None:
        self.iteration = 0
        self.pings: list[float] = []

    def ping(self) -> None:
        self.pings.append(time.monotonic())


@pytest.mark.timeout(30)
def test_the_watchdog_is_pinged_for_the_learned_timeout_less_the_floor_after_a_step(tmp_path):
    from trainer.hooks import StepResult
    from trainer.resilience import _Hooks, _LauncherClient

    config = build_config(
        "tiny-cpu",
        [f"run.workdir={tmp_path}", "resilience.timeout_floor_s=1", "resilience.timeout_ceiling_s=3"],
    )
    wrapper = _CountingWrapper()
    hooks = _Hooks(config, _LauncherClient(1.0), wrapper, 0, None)
    try:
        hooks.on_step_end(StepResult(1, 1.0, 0.1, 0.1, None, False))
        stepped = hooks.progress_at
        assert stepped is not None
        time.sleep(3.5)  # the soft timeout before learning: the ceiling, 3 s
    finally:
        hooks.close()
    after = [ping - stepped for ping in wrapper.pings]
    assert max(after) > 1.0  # kept alive past the wrapper's own 1 s timeout...
    assert max(after) < 2.0 + 0.3  # ...until 3 s less the 1 s floor, then left to time out


@pytest.mark.timeout(30)
def test_blocking_checkpoint_work_restarts_the_gate_s_clock(tmp_path):
    from trainer.hooks import StepResult
    from trainer.resilience import _Hooks, _LauncherClient

    config = build_config(
        "tiny-cpu",
        [f"run.workdir={tmp_path}", "resilience.timeout_floor_s=1", "resilience.timeout_ceiling_s=3"],
    )
    wrapper = _CountingWrapper()
    hooks = _Hooks(config, _LauncherClient(1.0), wrapper, 0, None)
    try:
        hooks.on_step_end(StepResult(1, 1.0, 0.1, 0.1, None, False))
        with hooks.keepalive():  # a save of the next step, longer than the 2 s the gate allows
            time.sleep(2.5)
        saved = time.monotonic()
        time.sleep(1.5)
    finally:
        hooks.close()
    # The rest of the step is timed from the save's end: still pinged a second after it.
    assert max(wrapper.pings) - saved > 0.9
