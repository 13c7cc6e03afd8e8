"""When the fast tier captures: every `checkpoint.local_every_steps` steps, or at an interval
chosen from a copy budget (`budget`, and `auto` on CUDA): over an attempt's first steps the
tier times its copies and the loop's steps, and the ranks agree on the shortest interval
whose copies fit `COPY_BUDGET_PCT` of the loop's time. `auto` on CPU copies every step."""

from __future__ import annotations

import itertools
import logging
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("trainer.checkpointing.local_tier")

CALIBRATION_STEPS = 10
"""Budget mode: the steps of an attempt over which the tier times its copies and the loop's
steps (capturing every other step) before the ranks agree on its interval."""
COPY_BUDGET_PCT = 1.0
"""Budget mode: the share of the loop's time, in percent, the tier's copies may take."""


def uses_copy_budget(setting: int | str, on_cuda: bool) -> bool:
    """Whether `checkpoint.local_every_steps` asks for an interval chosen from the copy budget:
    `budget`, or `auto` on CUDA (on CPU `auto` is every step)."""
    return setting == "budget" or (setting == "auto" and on_cuda)


def budget_interval(copy_s: float, step_s: float, budget_pct: float = COPY_BUDGET_PCT) -> int:
    """The shortest interval, in steps, at which one copy of `copy_s` seconds per interval
    takes at most `budget_pct` percent of the loop's time at `step_s` seconds a step."""
    if copy_s <= 0 or step_s <= 0:
        return 1
    return max(1, math.ceil(copy_s / (budget_pct / 100 * step_s) - 1e-9))


class CaptureInterval:
    """One attempt's capture schedule; `interval` 0 means the tier is off."""

    def __init__(self, setting: int | str, on_cuda: bool, wait_copy: Callable[[], Any]) -> None:
        self._wait_copy = wait_copy  # waits for the copy thread's newest capture
        self.measuring = uses_copy_budget(setting, on_cuda)
        if self.measuring:
            self.interval = 2  # while measuring: a step after one without a capture is a clean step
            label = "budget" if setting == "budget" else "auto on CUDA"
            self._budget_label = f"{label}: copies within {COPY_BUDGET_PCT:g}% of the loop's time"
            self._on = f"checkpoint.local_every_steps={setting} on {'CUDA' if on_cuda else 'CPU'}"
            self.reason = f"{self._budget_label}, still measuring (a capture every other step)"
        elif setting == "auto":
            self.interval, self.reason = 1, "auto on CPU: every step"
        else:
            self.interval, self.reason = int(setting), f"checkpoint.local_every_steps={setting}"
        self._window_start: int | None = None  # the step the current measuring window began at
        self._marks: list[tuple[float, bool]] = []  # per step measured: its time, whether it copied
        # The copy's own time per capture, while measuring; appended by the tier's copy thread,
        # read by `_agree` only once that thread is idle (`_wait_copy`).
        self.copy_seconds: list[float] = []
        self.measured: dict[str, float] = {}  # this rank's copy_s, step_s and the interval it wanted

    def summary(self) -> dict[str, Any]:
        """The summary's fields of the interval: what it is, why, and what it was chosen on."""
        return {
            "local_tier_interval": self.interval,
            "local_tier_interval_reason": self.reason,
            "local_tier_copy_s": self.measured.get("copy_s"),
            "local_tier_step_s": self.measured.get("step_s"),
        }

    def maybe_capture(self, step: int, capture: Callable[[], bool], force: bool = False) -> bool:
        """`capture()` if step `step` is a capture step (`force`: a save's, at any step); whether
        it captured. While measuring: every other step for `CALIBRATION_STEPS` steps, timing
        each step after one without a copy (a capture slows the next step: its optimizer step
        waits for the copy); then the agreement (`_agree`)."""
        if self.measuring:
            now = time.perf_counter()
            if self._window_start is None:
                self._window_start = step
            elif step - self._window_start >= CALIBRATION_STEPS:
                self._agree(step, now)
            if self.measuring:
                copied = (force or (step - self._window_start) % 2 == 0) and capture()
                self._marks.append((now, copied))
                return copied
        return (force or step % self.interval == 0) and capture()

    def _agree(self, step: int, now: float) -> None:
        """Collective (one all-reduce, at the same step on every rank): the longest interval
        any rank needs for its copies to fit the budget. While no rank has timed a copy yet
        (large slots are still being made), another window is measured."""
        self._wait_copy()  # the newest copy's time is in
        copies = self.copy_seconds[2:]  # the first copy into each slot also faults its pages in
        marks = [*self._marks, (now, False)]
        steps = [b - a for (a, copied), (b, _) in itertools.pairwise(marks) if not copied]
        wanted = 0
        if copies and steps:
            copy_s, step_s = statistics.median(copies), statistics.median(steps)
            wanted = budget_interval(copy_s, step_s, COPY_BUDGET_PCT)
            self.measured = {"copy_s": copy_s, "step_s": step_s, "wanted": float(wanted)}
        agreed = torch.tensor([wanted], dtype=torch.int64)  # a CPU tensor: gloo's side of the group
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        self._marks, self._window_start = [], step  # a next window, while no rank has timed a copy
        if int(agreed.item()) == 0:
            return
        self.interval = int(agreed.item())
        self.measuring, self.reason = False, self._budget_label
        if dist.get_rank() == 0:
            copy_ms, step_ms = (1e3 * self.measured.get(key, math.nan) for key in ("copy_s", "step_s"))
            log.info(
                f"fast checkpoint tier: a capture every {self.interval} step(s), the longest interval any "
                f"rank needs for its copies to take at most {COPY_BUDGET_PCT:g}% of the loop's time "
                f"({self._on}; rank 0: a copy {copy_ms:.1f} ms, a step {step_ms:.1f} ms)"
            )
