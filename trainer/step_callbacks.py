"""Loop extensions: what runs beside the training step on every rank, built from the config.

Each entry of `REGISTRY` names a factory, `module:function`, that gets the attempt's
`LoopContext` and returns a step callback, or None when its config turns it off. A step
callback has `on_step_end(result)` (trainer.hooks.StepResult, every step, after the step's
checkpoint work was offered) and may have:

- `local_work(step)`: a context manager around the rank's local work of the step (the
  optimizer step; no collective runs inside it), to time or disturb it;
- `summary_fields()`: fields it adds to the run's summary (trainer/summary.py).

Callbacks run in registry order, every rank the same; one that runs a collective does so at
the same steps on every rank. Adding one takes its module (the factory and the callback), its
config field, a line here, and its row in docs/configuration.md.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from trainer.config import TrainConfig
    from trainer.events import EventLog
    from trainer.hooks import Callback
    from trainer.progress import Progress

REGISTRY: tuple[tuple[str, str], ...] = (
    ("stragglers", "trainer.stragglers:step_callback"),  # collective every straggler_every_steps
    ("eval", "trainer.evaluation:step_callback"),  # collective every data.eval_every_steps
    ("grad_spikes", "trainer.grad_spikes:step_callback"),
)


@dataclass(frozen=True)
class LoopContext:
    """What a factory may use: the attempt's config, place in the world and outlets."""

    config: TrainConfig
    rank: int
    world: int
    device: torch.device
    model: nn.Module
    events: EventLog
    """Rank 0 writes events.jsonl (the other ranks' `emit` does nothing)."""
    progress: Progress
    """The log and MLflow (rank 0)."""
    keepalive: Callable[[], contextlib.AbstractContextManager[None]]
    """Around work that may outlast the restart layers' timeouts (a gather, an evaluation)."""

    @property
    def workdir(self) -> Path:
        return Path(self.config.run.workdir)


def build(context: LoopContext) -> dict[str, Callback]:
    """The registry's callbacks that the config turns on, by name, in registry order."""
    built: dict[str, Callback] = {}
    for name, target in REGISTRY:
        module, _, function = target.partition(":")
        callback = getattr(importlib.import_module(module), function)(context)
        if callback is not None:
            built[name] = callback
    return built


@contextlib.contextmanager
def local_work(callbacks: dict[str, Any], step: int) -> Iterator[None]:
    """Every callback's `local_work(step)` around the rank's local work."""
    with contextlib.ExitStack() as stack:
        for callback in callbacks.values():
            if hasattr(callback, "local_work"):
                stack.enter_context(callback.local_work(step))
        yield


def summary_fields(callbacks: dict[str, Any]) -> dict[str, Any]:
    """The fields the callbacks add to the run's summary."""
    fields: dict[str, Any] = {}
    for callback in callbacks.values():
        if hasattr(callback, "summary_fields"):
            fields.update(callback.summary_fields())
    return fields
