"""Models, optimizers and managers the checkpoint tests share."""

import os
import threading
from pathlib import Path

import torch

from benchmarks.make_checkpoint import save_checkpoint
from trainer.config import ModelConfig
from trainer.models import model_spec
from trainer.models.byte_lm import next_token_loss


def _trained_model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = model_spec("byte-lm").build(
        ModelConfig(d_model=32, n_layers=1, n_heads=2, seq_len=16), torch.device("cpu")
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    next_token_loss(model, torch.randint(0, 256, (2, 17))).backward()
    optimizer.step()
    return model, optimizer


def _save(root, step, model, optimizer):
    return save_checkpoint(root, step, model, optimizer, meta={"note": "test"}, rank_extra={"position": step})


def _manager(tmp_path, mode, model, optimizer, events=None, hooks=None, extra=(), states=None):
    from benchmarks.checkpoint import mode_overrides
    from trainer.checkpointing import CheckpointManager
    from trainer.config import build_config
    from trainer.data import StepSampler
    from trainer.events import EventLog
    from trainer.hooks import TrainHooks

    config = build_config(
        "tiny-cpu",
        [f"run.workdir={tmp_path}", *mode_overrides(mode), "checkpoint.every_steps=3", *extra],
    )
    config.model = model.cfg  # the checkpoint's model hash must match the model saved
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    sampler = StepSampler(torch.zeros(64, dtype=torch.uint8), 16, 2, 0, 0)
    return CheckpointManager(
        config,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        sampler=sampler,
        hooks=hooks or TrainHooks(),
        events=events or EventLog(tmp_path, enabled=True),
        states=states,
    )


def _step(model, optimizer) -> None:
    next_token_loss(model, torch.randint(0, 256, (2, 17))).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _train_and_capture(manager, model, optimizer, steps) -> None:
    """Steps as the loop runs them, each offered to the fast tier; its last copy waited for."""
    for step in steps:
        _step(model, optimizer)
        manager.maybe_wait_for_staging()
        manager.save(step, last_step=False, loss=1.0)
    manager.local.wait_copy()


def _heads(folder) -> list[str]:
    return sorted(p.name for p in folder.glob("*.head"))


def _resumed_at(tmp_path, step, expected, hooks=None):
    """A new attempt's manager (a fresh model, mode off) that resumed at `step` with the
    parameters `expected`; returns it with its model and optimizer. `hooks`: the process's
    (an in-process restart shares its fast-tier cache); None: a new process."""
    model, optimizer = _trained_model(seed=1)
    resumed = _manager(tmp_path, "off", model, optimizer, hooks=hooks)
    assert resumed.load() == step
    for saved, restored in zip(expected, model.parameters(), strict=True):
        assert torch.equal(saved, restored)
    return resumed, model, optimizer


class _RunsCodeWhenUnpickled:
    def __reduce__(self):
        return (Path.touch, (Path(os.environ["RTP_TEST_PWNED"]),))


def hold_slot_preparation(monkeypatch) -> threading.Event:
    """Large slots (every state counts as large here) are made ahead only once the returned
    event is set: what a test needs to see the loop go on meanwhile."""
    from trainer.checkpointing import local_tier
    from trainer.checkpointing.local_tier import LocalTier

    monkeypatch.setattr(local_tier, "PREPARE_AHEAD_BYTES", 0)  # this tiny state counts as large
    release = threading.Event()
    prepared = LocalTier._prepare_slots

    def held(self, plan):
        assert release.wait(timeout=30)
        prepared(self, plan)

    monkeypatch.setattr(LocalTier, "_prepare_slots", held)
    return release
