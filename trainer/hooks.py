"""What the fault-tolerance layers plug into the training loop and its checkpointing.

A leaf module: `trainer.loop` and `trainer.checkpointing.manager` both use `TrainHooks`,
and `trainer.resilience` subclasses it, without importing each other. `Attempt` says which
attempt of the run this is; `StepResult` is what a `Callback` gets after every step;
`Stateful` is what a checkpoint can hold beside the model (`CheckpointManager(states=...)`);
`Abandonable` is what the hooks hold for an in-process restart to release.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from trainer.checkpointing import CaptureCache


@dataclasses.dataclass(frozen=True, kw_only=True)
class Attempt:
    """Which attempt of the run a `Trainer` is: recorded in the `attempt_start` event (the
    restart accounting of trainer/goodput.py reads it back)."""

    inprocess_iteration: int = 0
    """In-process restarts before this attempt, in this process."""
    launcher_restart: int = 0
    """Worker-group restarts by the launcher before this process (TORCHELASTIC_RESTART_COUNT)."""
    inprocess_enabled: bool = False
    launcher: str = "other"
    """"ft_launcher" when its rank monitor watches this rank."""
    fault_detected_at: float | None = None
    """When the wrapper tore the previous attempt down (epoch seconds)."""
    process_started_at: float | None = None
    preforked: bool = False
    """This rank was forked from a pre-imported process by a launcher plugin (`env.forked_rank`)."""
    diagnostics: str = ""
    """The folder where the teardown before this attempt left each rank's stacks and
    flight recorder dump (trainer/diagnostics.py); empty for a first attempt."""
    restart_cause: str = ""
    """What ended the previous attempt in this process, as this rank saw it (a soft timeout, an
    exception and its type, ...: trainer/restart_causes.py); empty for a process's first."""

    @property
    def is_restart(self) -> bool:
        return self.inprocess_iteration > 0 or self.launcher_restart > 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One finished step as every rank saw it (the loss is the mean over the ranks)."""

    step: int
    loss: float
    lr: float
    duration_s: float
    grad_norm: float | None
    """Gathered on logging steps only (`Progress.wants_detail`), else None."""
    stop_requested: bool
    """Some rank got SIGTERM: this step is the attempt's last."""


class Callback(Protocol):
    """Called on every rank after each step, once the step's checkpoint work was offered."""

    def on_step_end(self, result: StepResult) -> None: ...


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

    def attempt(self) -> Attempt:
        return Attempt()

    def on_step_end(self, result: StepResult) -> None:
        """Progress signal after every step (in-process watchdog ping, launcher heartbeat)."""

    def keepalive(self) -> contextlib.AbstractContextManager[None]:
        """Around blocking checkpoint work: the progress signals go on meanwhile (bounded)."""
        return contextlib.nullcontext()

    def checkpoint_states(self) -> dict[str, Stateful]:
        """State stored in every checkpoint and restored on resume, by name (the launcher's
        learned timeouts: "launcher")."""
        return {}

    def capture_cache(self) -> CaptureCache:
        """Where the fast tier keeps its newest capture in memory: the resilience layer gives one
        that outlives the attempt (an in-process restart resumes from it); here, one per hooks."""
        from trainer.checkpointing import CaptureCache

        cache = getattr(self, "_capture_cache", None)
        if cache is None:
            cache = self._capture_cache = CaptureCache()
        return cache

    def track(self, work: Abandonable) -> None:
        """Checkpoint work started: hold it until `untrack`, for a restart to abandon."""

    def untrack(self, work: Abandonable) -> None:
        """Checkpoint work closed or abandoned: nothing left to release."""
