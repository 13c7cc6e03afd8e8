"""The loop's four checkpoint calls, seen from outside the manager: `on_queued` is told of
each save once the writer has it (after its `checkpoint_queued` event), and the resilience
hooks hold the manager from `load()` until `close()` or `abandon()`, for a restart to
abandon."""

from __future__ import annotations

import json

import pytest

from tests.unit.checkpoint_helpers import _manager, _step, _trained_model
from trainer.hooks import TrainHooks

pytestmark = pytest.mark.usefixtures("single_rank_group")


def _queued_events(tmp_path) -> list[int]:
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    return [event["step"] for event in map(json.loads, lines) if event["kind"] == "checkpoint_queued"]


class _TrackingHooks(TrainHooks):
    def __init__(self) -> None:
        self.live: list = []

    def track(self, work) -> None:
        self.live.append(work)

    def untrack(self, work) -> None:
        self.live.remove(work)


def test_a_sync_save_is_reported_queued_after_its_event_and_the_manager_is_held_until_closed(tmp_path):
    hooks = _TrackingHooks()
    model, optimizer = _trained_model()
    manager = _manager(tmp_path, "sync", model, optimizer, hooks=hooks)
    reported: list[tuple[int, list[int]]] = []
    manager.on_queued = lambda step: reported.append((step, _queued_events(tmp_path)))
    assert hooks.live == []
    assert manager.load() == 0
    assert hooks.live == [manager]
    for step in range(1, 6):
        manager.maybe_wait_for_staging()
        manager.save(step, last_step=step == 5, loss=1.0)
    manager.close()
    assert reported == [(3, [3]), (5, [3, 5])]
    assert hooks.live == []


def test_an_async_save_is_reported_queued_at_the_hand_off_before_the_optimizer_step(tmp_path):
    hooks = _TrackingHooks()
    model, optimizer = _trained_model()
    manager = _manager(
        tmp_path, "async", model, optimizer, hooks=hooks, extra=["checkpoint.local_every_steps=0"]
    )
    reported: list[int] = []
    manager.on_queued = reported.append
    manager.load()
    try:
        for step in (1, 2, 3):  # the save is at step 3
            _step(model, optimizer)
            manager.maybe_wait_for_staging()
            manager.save(step, last_step=False, loss=1.0)
        assert reported == []  # its snapshot copy runs beside the next forward and backward
        manager.maybe_wait_for_staging()
        assert reported == [3]
        _step(model, optimizer)
        manager.save(4, last_step=True, loss=1.0)  # the last save is written by close(): never queued
        manager.close()
        assert reported == [3]
        assert hooks.live == []
    finally:
        if hooks.live:
            manager.abandon()


def test_the_resilience_hooks_abandon_the_manager_they_hold_and_store_the_launchers_state(tmp_path):
    from trainer.resilience import _Hooks, _LauncherClient

    model, optimizer = _trained_model()
    probe = _manager(tmp_path, "off", model, optimizer)
    launcher = _LauncherClient(floor_s=10.0)
    hooks = _Hooks(probe.config, launcher, None, 0, None)
    assert hooks.checkpoint_states() == {"launcher": launcher}
    manager = _manager(tmp_path, "sync", model, optimizer, hooks=hooks)
    manager.load()
    assert hooks.checkpoints == [manager]
    hooks.abandon_checkpoints()  # what the in-process restart's finalize does
    assert hooks.checkpoints == []
    hooks.abandon_checkpoints()  # nothing left: a no-op
