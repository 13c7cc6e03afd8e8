"""The loop extensions (trainer/step_callbacks.py): built from the config, in registry order,
and the gradient-norm spike detector added through it (trainer/grad_spikes.py)."""

from __future__ import annotations

import contextlib
import json
import logging

import pytest
import torch

from trainer import step_callbacks
from trainer.config import ConfigError, build_config
from trainer.events import EventLog
from trainer.grad_spikes import MIN_SEEN, GradSpikeDetector
from trainer.hooks import StepResult
from trainer.progress import Progress


def context(tmp_path, *overrides: str) -> step_callbacks.LoopContext:
    config = build_config("tiny-cpu", [f"run.workdir={tmp_path}", *overrides])
    return step_callbacks.LoopContext(
        config=config,
        rank=0,
        world=1,
        device=torch.device("cpu"),
        model=torch.nn.Linear(2, 2),
        events=EventLog(tmp_path, enabled=True),
        progress=Progress(config, rank=0, world_size=1),
        keepalive=contextlib.nullcontext,
    )


def result(step: int, grad_norm: float | None) -> StepResult:
    return StepResult(
        step=step, loss=1.0, lr=1e-3, duration_s=0.01, grad_norm=grad_norm, stop_requested=False
    )


def test_the_config_decides_which_extensions_run_in_registry_order(tmp_path):
    off = step_callbacks.build(
        context(tmp_path, "resilience.straggler_every_steps=0", "data.eval_every_steps=0")
    )
    assert off == {}
    on = step_callbacks.build(
        context(tmp_path, "resilience.straggler_every_steps=4", "resilience.grad_spike_factor=10")
    )
    assert (
        list(on)
        == [name for name, _ in step_callbacks.REGISTRY if name in on]
        == ["stragglers", "grad_spikes"]
    )
    # What the extensions add to the summary: the straggler report (empty before a window ends).
    assert step_callbacks.summary_fields(on) == {"stragglers": {}}


def test_a_spike_is_logged_and_recorded_and_nothing_else_changes(tmp_path, caplog):
    ctx = context(tmp_path, "resilience.grad_spike_factor=5")
    detector = step_callbacks.build(ctx)["grad_spikes"]
    norms = [4.0, 3.0, 2.5, 2.0, 2.2, 1.9, None, 2.1, 12.0, 2.0, 9.0]
    with caplog.at_level(logging.WARNING, logger="trainer.grad_spikes"):
        for step, norm in enumerate(norms, start=1):
            detector.on_step_end(result(step, norm))
    # The median of the norms before step 9 is 2.2: 12.0 is a spike (x5 = 11); step 11's 9.0 is not.
    assert detector.spikes == [9]
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["step"], e["grad_norm"]) for e in events] == [("grad_spike", 9, 12.0)]
    assert events[0]["median"] == pytest.approx(2.2) and events[0]["factor"] == 5
    assert "step 9: gradient norm 12 is 5.5x the median" in caplog.text


def test_no_norm_is_judged_before_enough_were_seen():
    spikes = []
    detector = GradSpikeDetector(2.0, lambda *args: spikes.append(args))
    for step, norm in enumerate([1.0] * (MIN_SEEN - 1) + [100.0], start=1):
        detector.on_step_end(result(step, norm))
    assert spikes == [] and detector.spikes == []
    detector.on_step_end(result(MIN_SEEN + 1, 100.0))
    assert detector.spikes == [MIN_SEEN + 1]


def test_a_factor_that_would_flag_ordinary_steps_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"grad_spike_factor must be 0 \(off\) or above 1"):
        step_callbacks.build(context(tmp_path, "resilience.grad_spike_factor=0.5"))


def test_local_work_enters_each_extensions_context_around_the_step(tmp_path):
    entered = []

    class Timed:
        @contextlib.contextmanager
        def local_work(self, step):
            entered.append(("in", step))
            yield
            entered.append(("out", step))

        def on_step_end(self, result):
            pass

    with step_callbacks.local_work({"a": Timed(), "b": object()}, 3):
        entered.append(("work", 3))
    assert entered == [("in", 3), ("work", 3), ("out", 3)]
