"""`trainer.loop.Trainer` in this process, on one gloo rank, with fake callbacks.

What the multi-process tests check end to end (exactness, faults, SIGTERM), here seen from
the loop's own interface: what a callback gets after each step, the stack down to
`optimizer.step()`, a stop request, and an attempt that ends by an exception."""

from __future__ import annotations

import gc
import math
import os
import signal
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from trainer.checkpointing import storage
from trainer.config import build_config
from trainer.hooks import StepResult, TrainHooks
from trainer.loop import Trainer

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("single_rank_group", "quiet_process")]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def quiet_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No MLflow; the SIGTERM handler and the garbage collector as they were."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    handler = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        gc.unfreeze()  # a Trainer freezes what it built; this process goes on with other tests
        assert signal.getsignal(signal.SIGTERM) is handler, "the Trainer left its SIGTERM handler installed"


class _Recorder:
    def __init__(self, act=None) -> None:
        self.results: list[StepResult] = []
        self.act = act

    def on_step_end(self, result: StepResult) -> None:
        self.results.append(result)
        if self.act is not None:
            self.act(result)


class _Hooks(TrainHooks):
    def __init__(self, order: list[str]) -> None:
        self.order = order
        self.tracked: list[object] = []

    def on_step_end(self, result: StepResult) -> None:
        self.order.append(f"hooks:{result.step}")

    def track(self, work: object) -> None:
        self.tracked.append(work)

    def untrack(self, work: object) -> None:
        if work in self.tracked:
            self.tracked.remove(work)


def _config(dataset_dir: Path, workdir: Path, *overrides: str):
    return build_config(
        "tiny-cpu",
        [
            f"data.dataset_dir={dataset_dir}",
            f"run.workdir={workdir}",
            "run.steps=4",
            "run.seed=3",
            "run.log_every_steps=2",
            "checkpoint.mode=sync",
            "checkpoint.every_steps=2",
            "checkpoint.local_every_steps=0",
            "resilience.prefork_workers=false",
            *overrides,
        ],
    )


def test_callbacks_see_every_step_before_the_hooks_and_two_rtp_frames_reach_the_optimizer(
    dataset_dir, tmp_path, monkeypatch
):
    order: list[str] = []
    recorder = _Recorder(lambda result: order.append(f"callback:{result.step}"))
    stacks: list[list[traceback.FrameSummary]] = []
    step = torch.optim.AdamW.step

    def recording_step(self, *args, **kwargs):
        stacks.append(traceback.extract_stack())
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    hooks = _Hooks(order)
    with Trainer(_config(dataset_dir, tmp_path), hooks=hooks, callbacks=[recorder]) as trainer:
        summary = trainer.train()

    assert [r.step for r in recorder.results] == [1, 2, 3, 4]
    assert order == [f"{who}:{s}" for s in (1, 2, 3, 4) for who in ("callback", "hooks")]
    assert all(math.isfinite(r.loss) and r.duration_s > 0 and not r.stop_requested for r in recorder.results)
    # Grad norm is gathered on logging steps only (every 2 and the last).
    assert [r.grad_norm is not None for r in recorder.results] == [False, True, False, True]
    assert summary.completed and summary.steps == 4 and summary.steps_run == 4
    assert summary.losses == [{"step": r.step, "loss": r.loss} for r in recorder.results]
    assert sorted(step for step, _ in storage.committed_steps(tmp_path / "checkpoints")) == [2, 4]
    assert hooks.tracked == []  # the manager untracked itself at close
    # From the attempt's call to optimizer.step(): Trainer.train and Trainer.train_step only.
    assert len(stacks) == 4
    ours = [f.name for f in stacks[0] if Path(f.filename).is_relative_to(REPO / "trainer")]
    assert ours == ["train", "train_step"]


def test_a_stop_request_saves_the_step_it_is_seen_at_and_ends_the_attempt(dataset_dir, tmp_path):
    def sigterm_at_step_1(result: StepResult) -> None:
        if result.step == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # the Trainer's handler only records it

    recorder = _Recorder(sigterm_at_step_1)
    config = _config(dataset_dir, tmp_path, "run.steps=6", "checkpoint.every_steps=4")
    with Trainer(config, callbacks=[recorder]) as trainer:
        summary = trainer.train()

    # The ranks learn of it at step 2's all-reduce: step 2, no save step otherwise, is saved.
    assert [r.stop_requested for r in recorder.results] == [False, True]
    assert summary.stopped_by_signal and not summary.completed and summary.steps == 2
    assert [step for step, _ in storage.committed_steps(config.checkpoint_dir())] == [2]


def test_an_attempt_ended_by_an_exception_abandons_its_save_and_the_next_resumes_from_the_last_commit(
    dataset_dir, tmp_path
):
    class Fault(Exception):
        pass

    def fail_at_step_3(result: StepResult) -> None:
        if result.step == 3:
            raise Fault

    hooks = _Hooks([])
    config = _config(dataset_dir, tmp_path)
    with pytest.raises(Fault), Trainer(config, hooks=hooks, callbacks=[_Recorder(fail_at_step_3)]) as trainer:
        trainer.train()
    assert hooks.tracked == []  # close() abandoned the live writer

    resumed = _Recorder()
    with Trainer(config, callbacks=[resumed]) as trainer:
        assert trainer.last_step == 2
        summary = trainer.train()
    assert [r.step for r in resumed.results] == [3, 4]
    assert summary.completed and summary.resumed_from is not None


def test_an_empty_dataset_folder_stops_the_trainer_with_a_data_error_naming_rtp_stage(tmp_path):
    """What a rank's entry reports in one line (exit 2) when the dataset folder holds nothing."""
    from trainer.data import DataError

    (tmp_path / "empty").mkdir()
    with (
        pytest.raises(DataError, match="rtp stage"),
        Trainer(_config(tmp_path / "empty", tmp_path)) as trainer,
    ):
        trainer.train()
