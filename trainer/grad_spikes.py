"""Gradient-norm spikes: a step whose gradient norm jumps far above the run's recent ones.

A spike (bad data, a loss scale gone wrong, an optimizer about to diverge) comes before the
loss turns NaN or the run silently degrades. On the steps where the loop gathers the global
gradient norm (logging steps: `run.log_every_steps`), this callback compares it with the
median of the last `WINDOW` norms it saw; at `resilience.grad_spike_factor` times that or
more it logs a warning on rank 0 and records a `grad_spike` event (events.jsonl). It changes
nothing else: no step is skipped. Every rank sees the same gathered norm, so no collective
is needed. 0 (the default) turns it off.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from typing import Any

log = logging.getLogger(__name__)

WINDOW = 20
"""Norms kept for the median."""
MIN_SEEN = 5
"""Norms seen before any is judged: the first steps' norms fall fast."""


class GradSpikeDetector:
    """`on_step_end` compares each gathered norm with the median of the last `WINDOW`."""

    def __init__(self, factor: float, on_spike) -> None:
        self.factor = factor
        self.on_spike = on_spike
        self.norms: deque[float] = deque(maxlen=WINDOW)
        self.spikes: list[int] = []

    def on_step_end(self, result: Any) -> None:
        norm = result.grad_norm
        if norm is None:
            return
        if len(self.norms) >= MIN_SEEN:
            typical = statistics.median(self.norms)
            if typical > 0 and norm >= self.factor * typical:
                self.spikes.append(result.step)
                self.on_spike(result.step, norm, typical)
        self.norms.append(norm)


def step_callback(context: Any) -> GradSpikeDetector | None:
    """trainer/step_callbacks.py's factory: on when `resilience.grad_spike_factor` > 0."""
    factor = context.config.resilience.grad_spike_factor
    if not factor:
        return None
    if factor <= 1:
        from trainer.config import ConfigError

        raise ConfigError(
            f"resilience.grad_spike_factor must be 0 (off) or above 1 (times the median norm), got {factor:g}"
        )

    def spiked(step: int, norm: float, typical: float) -> None:
        context.events.emit("grad_spike", step=step, grad_norm=norm, median=typical, factor=factor)
        if context.rank == 0:
            log.warning(
                "step %d: gradient norm %.4g is %.1fx the median of the last %d logged (%.4g)",
                step, norm, norm / typical, WINDOW, typical,
            )  # fmt: skip

    return GradSpikeDetector(factor, spiked)
