"""What the fault-tolerance layers plug into the training loop and its checkpointing.

A leaf module: `trainer.loop` and `trainer.checkpointing.manager` both use `TrainHooks`,
and `trainer.resilience` subclasses it, without importing each other. `Stateful` is what
a checkpoint can hold beside the model (`CheckpointManager(states=...)`); `Abandonable`
is what the hooks hold for an in-process restart to release.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol


class Stateful(Protocol):
    """Saved with every durable checkpoint under its name; given back on resume."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Abandonable(Protocol):
    """Live checkpoint work that a restart drops without committing (not collective)."""

    def abandon(self) -> None: ...


class TrainHooks:
    """The progress and restart callbacks of one attempt; no-ops here (trainer/resilience.py
    overrides them)."""

    def attempt_info(self) -> dict[str, Any]:
        return {"inprocess_iteration": 0, "launcher_restart": 0, "inprocess_enabled": False}

    def step_done(self, step: int) -> None:
        """Progress signal after every step (in-process watchdog ping, launcher heartbeat)."""

    def keepalive(self) -> contextlib.AbstractContextManager[None]:
        """Around blocking checkpoint work: the progress signals go on meanwhile (bounded)."""
        return contextlib.nullcontext()

    def checkpoint_states(self) -> dict[str, Stateful]:
        """State stored in every checkpoint and restored on resume, by name (the launcher's
        learned timeouts: "launcher")."""
        return {}

    def track(self, work: Abandonable) -> None:
        """Checkpoint work started: hold it until `untrack`, for a restart to abandon."""

    def untrack(self, work: Abandonable) -> None:
        """Checkpoint work closed or abandoned: nothing left to release."""
