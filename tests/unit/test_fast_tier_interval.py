"""The fast tier's interval (`checkpoint.local_every_steps`): a step count, `budget` (chosen
from the measured copy and step times, agreed by the ranks) or `auto` (budget on CUDA,
every step on CPU); its config values, its choice, the ranks' agreement and its report.

The copy and step times come from a stand-in clock (`_FakeClock`, put in place of
local_tier's `time`): the test moves it by a step's and a copy's time, so what the tier
measures, and the interval it picks, are exact whatever the machine's load."""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
from pathlib import Path

import pytest
import torch

from tests.unit.checkpoint_helpers import _heads, _manager, _step, _trained_model, hold_slot_preparation
from trainer.checkpointing import local_tier, tier_interval
from trainer.checkpointing.local_tier import LocalTier, forget_run
from trainer.checkpointing.tier_interval import CALIBRATION_STEPS, budget_interval, uses_copy_budget
from trainer.config import CheckpointConfig, ConfigError, TrainConfig, build_config, validate
from trainer.summary import TrainSummary

STEP_S = 0.06


class _FakeClock:
    """A stand-in for local_tier's `time` module: `perf_counter()` moves only by `advance()`."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _install_clock(patch: pytest.MonkeyPatch, copy_s: float) -> _FakeClock:
    """The tier's clock, and every copy taking `copy_s` on it (as a large state's would)."""
    clock = _FakeClock()
    patch.setattr(local_tier, "time", clock)  # the copies' times
    patch.setattr(tier_interval, "time", clock)  # the steps' times
    copy = LocalTier._copy_into

    def slow(self, target, sources, step_done):
        copy(self, target, sources, step_done)
        clock.advance(copy_s)

    patch.setattr(LocalTier, "_copy_into", slow)
    return clock


def _clocked_steps(capture, tier, clock, model, optimizer, steps) -> list[int]:
    """Steps of `STEP_S` each, every one offered to the tier; the copy is waited for before
    the clock moves on (so a copy's time is on the clock between this step and the next).
    Returns the steps captured."""
    captured = []
    for step in steps:
        clock.advance(STEP_S)
        _step(model, optimizer)
        tier.before_optimizer_step()
        if capture(step):
            captured.append(step)
        tier.wait_copy()
    return captured


# ---- the setting -------------------------------------------------------------------


def test_the_interval_setting_takes_auto_budget_or_a_step_count_from_overrides_and_json():
    assert TrainConfig().checkpoint.local_every_steps == "auto"
    for given, parsed in (("budget", "budget"), (" AUTO ", "auto"), ("3", 3), ("0", 0)):
        config = build_config("tiny-cpu", [f"checkpoint.local_every_steps={given}"])
        assert config.checkpoint.local_every_steps == parsed
        assert TrainConfig.from_json(config.to_json()).checkpoint.local_every_steps == parsed
    # A config written before `auto` (a number in JSON) still reads.
    old = TrainConfig.from_dict({"checkpoint": {"local_every_steps": 1}})
    assert old.checkpoint.local_every_steps == 1


@pytest.mark.parametrize("given", ["-1", "every", "1.5", "budget:2"])
def test_a_bad_interval_setting_names_what_it_takes(given):
    with pytest.raises(
        ConfigError, match=r"local_every_steps must be auto, budget or a step count \(0 = off\)"
    ):
        build_config("tiny-cpu", [f"checkpoint.local_every_steps={given}"])


def test_a_bad_interval_in_a_config_object_is_refused_too():
    config = TrainConfig(checkpoint=CheckpointConfig(local_every_steps=-2))
    with pytest.raises(ConfigError, match="got -2"):
        validate(config)
    with pytest.raises(ConfigError, match="got True"):
        TrainConfig.from_dict({"checkpoint": {"local_every_steps": True}})


def test_auto_is_the_budget_on_cuda_only_and_the_budget_is_the_shortest_interval_that_fits():
    assert uses_copy_budget("auto", on_cuda=True) and uses_copy_budget("budget", on_cuda=False)
    assert not uses_copy_budget("auto", on_cuda=False) and not uses_copy_budget(3, on_cuda=True)
    # gpu-1b on one H200, as issue 27 puts it: ~12 GB at ~50 GB/s against a 60 ms step.
    assert budget_interval(0.24, 0.06, 1.0) == 400
    assert budget_interval(0.0006, 0.06, 1.0) == 1  # exactly the budget: every step
    assert budget_interval(0.000601, 0.06, 1.0) == 2
    assert budget_interval(0.0, 0.06) == 1


# ---- one rank ----------------------------------------------------------------------


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize(("copy_s", "interval"), [(0.01, 4), (0.0, 1)])
def test_budget_captures_less_often_when_copies_are_expensive_against_the_step(
    tmp_path, monkeypatch, caplog, copy_s, interval
):
    """Over an attempt's first CALIBRATION_STEPS steps the tier captures every other step
    and times its copies and the steps without one; then it captures at the shortest
    interval whose copies take at most COPY_BUDGET_PCT of the loop's time: a 10 ms copy
    per 60 ms step is 1/6 of the loop, under 5% from every 4th step on."""
    monkeypatch.setattr(tier_interval, "COPY_BUDGET_PCT", 5.0)
    clock = _install_clock(monkeypatch, copy_s)
    model, optimizer = _trained_model()
    manager = _manager(tmp_path, "off", model, optimizer, extra=["checkpoint.local_every_steps=budget"])
    tier = manager.local

    def capture(step):
        return tier.capture(step, 0)

    try:
        measuring = _clocked_steps(capture, tier, clock, model, optimizer, range(1, CALIBRATION_STEPS + 1))
        assert (
            measuring == [1, 3, 5, 7, 9]
            and tier.schedule.interval == 2
            and "still measuring" in tier.schedule.reason
        )
        with caplog.at_level(logging.INFO, logger="trainer.checkpointing.local_tier"):
            later = _clocked_steps(capture, tier, clock, model, optimizer, range(CALIBRATION_STEPS + 1, 31))
        assert tier.schedule.measured["copy_s"] == pytest.approx(copy_s)
        assert tier.schedule.measured["step_s"] == pytest.approx(STEP_S)  # the steps without a copy in flight
        assert tier.schedule.interval == interval == budget_interval(copy_s, STEP_S, 5.0)
        assert later == [s for s in range(CALIBRATION_STEPS + 1, 31) if s % interval == 0]
        assert tier.captures == len(measuring) + len(later)
        assert _heads(tier.folder)[-1].startswith(f"rank_0_step_{later[-1]}_")
        lines = [r.getMessage() for r in caplog.records if "a capture every" in r.getMessage()]
        assert len(lines) == 1, lines
        assert (
            f"a capture every {interval} step(s)" in lines[0] and "at most 5% of the loop's time" in lines[0]
        )
        assert "checkpoint.local_every_steps=budget on CPU" in lines[0]
        assert f"a copy {1e3 * copy_s:.1f} ms, a step 60.0 ms" in lines[0]
        assert tier.schedule.summary() == {
            "local_tier_interval": interval,
            "local_tier_interval_reason": "budget: copies within 5% of the loop's time",
            "local_tier_copy_s": pytest.approx(copy_s),
            "local_tier_step_s": pytest.approx(STEP_S),
        }
    finally:
        manager.abandon()
        forget_run("", tmp_path / "checkpoints")


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize(
    ("setting", "interval", "reason"),
    [("auto", 1, "auto on CPU: every step"), ("3", 3, "checkpoint.local_every_steps=3")],
)
def test_auto_on_cpu_and_a_step_count_keep_their_interval_whatever_the_copies_cost(
    tmp_path, monkeypatch, setting, interval, reason
):
    """On CPU `auto` captures every step (at most one step redone, what the exactness tests
    rely on) and a step count is exact: nothing measured, no collective."""
    clock = _install_clock(monkeypatch, 0.05)  # copies near a step's length

    def no_collective(*args, **kwargs):
        raise AssertionError("the tier ran a collective")

    monkeypatch.setattr(local_tier.dist, "all_reduce", no_collective)
    model, optimizer = _trained_model()
    manager = _manager(tmp_path, "off", model, optimizer, extra=[f"checkpoint.local_every_steps={setting}"])
    tier = manager.local
    try:
        captured = _clocked_steps(
            lambda step: tier.capture(step, 0),
            tier,
            clock,
            model,
            optimizer,
            range(1, 2 * CALIBRATION_STEPS + 3),
        )
        assert captured == [s for s in range(1, 2 * CALIBRATION_STEPS + 3) if s % interval == 0]
        assert tier.schedule.summary() == {
            "local_tier_interval": interval,
            "local_tier_interval_reason": reason,
            "local_tier_copy_s": None,
            "local_tier_step_s": None,
        }
    finally:
        manager.abandon()
        forget_run("", tmp_path / "checkpoints")


@pytest.mark.usefixtures("single_rank_group")
def test_the_interval_is_chosen_once_a_copy_was_timed(tmp_path, monkeypatch):
    """Large slots are made ahead, and captures wait for them: a window without a timed copy
    chooses nothing, and the tier measures another window."""

    monkeypatch.setattr(tier_interval, "COPY_BUDGET_PCT", 5.0)
    release = hold_slot_preparation(monkeypatch)
    clock = _install_clock(monkeypatch, 0.01)
    model, optimizer = _trained_model()
    manager = _manager(tmp_path, "off", model, optimizer, extra=["checkpoint.local_every_steps=budget"])
    tier = manager.local

    def capture(step):
        return tier.capture(step, 0)

    try:
        first = CALIBRATION_STEPS + 1  # the window's end: nothing timed, a new window from here
        assert _clocked_steps(capture, tier, clock, model, optimizer, range(1, first + 1)) == []
        assert tier.schedule.interval == 2 and not tier.schedule.measured
        release.set()
        tier.wait_prepared(timeout=30)
        second = _clocked_steps(
            capture, tier, clock, model, optimizer, range(first + 1, first + CALIBRATION_STEPS)
        )
        assert second == list(range(first + 2, first + CALIBRATION_STEPS, 2)) and tier.schedule.interval == 2
        _clocked_steps(capture, tier, clock, model, optimizer, [first + CALIBRATION_STEPS])
        assert tier.schedule.interval == 4 and tier.schedule.measured["copy_s"] == pytest.approx(0.01)
    finally:
        manager.abandon()
        forget_run("", tmp_path / "checkpoints")


@pytest.mark.usefixtures("single_rank_group")
def test_a_saves_capture_at_an_off_step_counts_as_a_copy_while_measuring(tmp_path, monkeypatch):
    """A durable save's capture is taken at any step; in the measuring window it counts as a
    copy, so the step after it (slowed by the copy) is not timed as a step without one:
    saves at every off-step leave no step to time, and the tier measures another window."""
    clock = _install_clock(monkeypatch, 0.5)  # a copy far longer than the step
    model, optimizer = _trained_model()
    manager = _manager(tmp_path, "off", model, optimizer, extra=["checkpoint.local_every_steps=budget"])
    tier = manager.local

    def capture_or_save(step):
        if step % 2:
            return tier.capture(step, 0)
        lease = tier.capture_for_save(step, 0)
        assert lease is not None and lease.wait().step == step
        lease.release()
        return True

    try:
        steps = range(1, CALIBRATION_STEPS + 2)  # the window and its agreement step
        assert _clocked_steps(capture_or_save, tier, clock, model, optimizer, steps) == list(steps)
        assert tier.schedule.measuring and not tier.schedule.measured  # no step timed without a copy
    finally:
        manager.abandon()
        forget_run("", tmp_path / "checkpoints")


def test_the_tiers_summary_fields_are_fields_of_the_training_summary():
    names = {f.name for f in dataclasses.fields(TrainSummary)}
    assert {
        "local_tier_interval",
        "local_tier_interval_reason",
        "local_tier_copy_s",
        "local_tier_step_s",
    } <= names


# ---- two ranks ---------------------------------------------------------------------


def _budget_rank(rank: int, store_path: str, folder: str) -> None:
    """One rank of a 2-rank gloo group measuring its copies in budget mode: rank 1's copies
    take 10 ms, rank 0's 1 ms, steps 60 ms; records what it chose and its collectives."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, 2),
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    tier = None
    try:
        with pytest.MonkeyPatch.context() as patch:
            tier_interval.COPY_BUDGET_PCT = 5.0
            clock = _install_clock(patch, 0.01 if rank == 1 else 0.001)
            collectives: list[int] = []
            reduce = dist.all_reduce

            def counted(*args, **kwargs):
                collectives.append(step)
                return reduce(*args, **kwargs)

            patch.setattr(local_tier.dist, "all_reduce", counted)
            model, optimizer = _trained_model()
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
            tier = LocalTier(
                CheckpointConfig(local_every_steps="budget", local_dir=folder),
                Path(folder) / "checkpoints",
                {"model_hash": "test", "world_size": 2},
                model,
                optimizer,
                scheduler,
            )
            for step in range(1, 2 * CALIBRATION_STEPS + 1):
                clock.advance(STEP_S)
                _step(model, optimizer)
                tier.before_optimizer_step()
                tier.capture(step, 0)
                tier.wait_copy()
            result = {
                "interval": tier.schedule.interval,
                "wanted": tier.schedule.measured["wanted"],
                "collectives": collectives,
            }
            Path(folder, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        if tier is not None:
            tier.close(discard=True)
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_the_ranks_agree_on_the_longest_interval_any_of_them_needs(tmp_path):
    import torch.multiprocessing as mp

    mp.start_processes(
        _budget_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True, start_method="spawn"
    )
    rank0, rank1 = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2))
    assert rank0["wanted"] == budget_interval(0.001, STEP_S, 5.0) == 1
    assert rank1["wanted"] == budget_interval(0.01, STEP_S, 5.0) == 4
    assert rank0["interval"] == rank1["interval"] == 4
    # One collective per rank, at the same step: the end of the first window.
    assert rank0["collectives"] == rank1["collectives"] == [CALIBRATION_STEPS + 1]
