"""Checkpoint work that blocks inside C runs off the training thread, which waits from Python:
NVRx's automatic progress stamp (a pending call only the main thread's eval loop runs) stays
fresh through a sync save, the attempt's last async save and a drill's slow file system.

One rank in this process; a write that blocks in one C call for `SLOW_S` stands in for the
slowest rank's write, which the other ranks' gathers wait for inside C. The oracle is
tests/unit/test_waiting.py's: the longest gap between stamps on the main thread."""

from __future__ import annotations

import time

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from tests.unit.checkpoint_helpers import _manager, _trained_model
from tests.unit.test_waiting import longest_gap_between_stamps
from trainer import waiting
from trainer.checkpointing import storage
from trainer.models.byte_lm import next_token_loss

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("single_rank_group", "short_waits")]

SLOW_S = 1.0


@pytest.fixture
def short_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The training thread's waits return to Python every 0.1 s (0.5 s in a run)."""
    monkeypatch.setattr(waiting, "BLOCK_S", 0.1)


def _ready_manager(tmp_path, mode: str):
    """A manager after load() and one step, whose next save is at step 3."""
    model, optimizer = _trained_model()
    manager = _manager(tmp_path, mode, model, optimizer, extra=["checkpoint.local_every_steps=0"])
    manager.load()
    next_token_loss(model, torch.randint(0, 256, (2, 17))).backward()
    manager.maybe_wait_for_staging()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return manager


def _save_step_3(manager, last: bool) -> None:
    """Step 3's save as the loop makes it, and its commit waited for."""
    manager.save(3, last_step=last, loss=1.0)
    manager.maybe_wait_for_staging()
    manager.writer.wait("committed")


def _committed(tmp_path) -> list[int]:
    return [step for step, _ in storage.committed_steps(tmp_path / "checkpoints")]


@pytest.mark.parametrize(("mode", "last"), [("sync", False), ("async", True)])
def test_a_save_written_in_the_rank_whose_write_blocks_in_c_leaves_the_training_thread_stamping(
    tmp_path, monkeypatch, mode, last
):
    """A `sync` save, and `async`'s last save, are DCP writes in the rank itself."""
    write_data = FileSystemWriter.write_data

    def slow_write_data(self, plan, planner):
        time.sleep(SLOW_S)  # one C call, as a write to a slow file system is
        return write_data(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", slow_write_data)
    manager = _ready_manager(tmp_path, mode)
    try:
        gap = longest_gap_between_stamps(lambda: _save_step_3(manager, last=last))
        manager.close()
    finally:
        manager.abandon()
    assert _committed(tmp_path) == [3]
    assert gap < SLOW_S / 2


@pytest.mark.parametrize("mode", ["sync", "torch-async", "async"])
def test_a_slow_save_drill_blocks_the_thread_that_writes_not_the_training_thread(tmp_path, mode):
    manager = _ready_manager(tmp_path, mode)
    slowed: list[int] = []

    def slow_file_system(step: int) -> None:
        slowed.append(step)
        time.sleep(SLOW_S)

    manager.during_save = slow_file_system
    try:
        gap = longest_gap_between_stamps(lambda: _save_step_3(manager, last=False))
        manager.close()
    finally:
        manager.abandon()
    assert slowed == [3] and _committed(tmp_path) == [3]
    assert gap < SLOW_S / 2
