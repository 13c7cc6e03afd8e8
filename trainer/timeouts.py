"""How long a rank may go without progress before the in-process layer calls it hung.

`resilience.soft_timeout_s` and `hard_timeout_s` are `auto` by default: the soft timeout is
learned from the run's own step-to-step intervals (a step, and the checkpoint work after
it) the way ft_launcher learns its heartbeat timeouts: after `LEARN_AFTER_STEPS` intervals
it is `clamp(timeout_safety_factor x longest interval, timeout_floor_s, timeout_ceiling_s)`;
before, twice that (`WARMUP_MARGIN`), and the ceiling until a first interval was seen (the
first step of an attempt is never timed: NVRx's step watchdog starts at its end).
The hard timeout is the soft one plus `timeout_floor_s` (time to react before being
terminated). An explicit number in either setting is used as given and nothing is learned.

The learned value is kept: in memory by `StepTimeouts` across in-process restarts, and in
`<workdir>/timeouts.json` (rank 0 writes it) across worker-group restarts, so a restarted
rank starts with it. A new run forgets it (`forget`).

The rule (`soft_timeout_s`) and the watchdog's fixed timeouts (`watchdog_timeouts`) are pure;
`StepTimeouts` holds the observations and does the file I/O.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.config import ResilienceConfig

log = logging.getLogger(__name__)

AUTO = "auto"
LEARN_AFTER_STEPS = 8
"""Step-to-step intervals observed before the soft timeout is learned (ft_launcher's rank
monitor learns its heartbeat timeouts at the same step: trainer/resilience.py)."""
WARMUP_MARGIN = 2.0
"""Before warm-up the learned rule is this much more generous: the first steps after start-up
may still be slower (allocator, compiled graphs), and a hang in them is still seen long
before the ceiling."""
TIMEOUTS_FILE = "timeouts.json"
REWRITE_RATIO = 1.1
"""Rank 0 rewrites timeouts.json only when the learned soft timeout grew by this factor."""


def soft_timeout_s(
    longest_interval_s: float | None,
    samples: int,
    *,
    explicit_s: float | None = None,
    safety_factor: float = 5.0,
    floor_s: float = 20.0,
    ceiling_s: float = 600.0,
    warmup: int = LEARN_AFTER_STEPS,
) -> float:
    """The soft timeout: `explicit_s` when set; the ceiling before any interval was seen;
    `safety_factor` x the longest interval, within [floor_s, ceiling_s], once `warmup`
    intervals were seen, and `WARMUP_MARGIN` times that before."""
    if explicit_s is not None:
        return explicit_s
    if longest_interval_s is None or samples < 1:
        return ceiling_s
    factor = safety_factor * (WARMUP_MARGIN if samples < warmup else 1.0)
    return min(ceiling_s, max(floor_s, factor * longest_interval_s))


def explicit_s(value: float | str) -> float | None:
    """A timeout setting as seconds, or None for `auto`."""
    return None if value == AUTO else float(value)


def watchdog_timeouts(r: ResilienceConfig) -> tuple[float, float]:
    """(soft, hard) seconds that NVRx's in-process wrapper is built with, fixed for the process.

    NVRx 0.4.1 hands its timeouts to the monitor process when the wrapper is first called
    (`inprocess.wrap.CallWrapper.__init__`) and offers no call to change them later. So in
    `auto` mode the wrapper gets the floor (soft) and twice the floor (hard), and a rank's
    `ProgressGate` (trainer/resilience.py) keeps pinging it for the learned timeout less the
    floor after each step: no progress for the learned soft timeout is then a soft timeout,
    for it plus the floor a hard one. The floor is also how long one C call may block the
    main thread (NVRx's automatic progress stamp, which pings cannot stretch)."""
    soft = explicit_s(r.soft_timeout_s)
    hard = explicit_s(r.hard_timeout_s)
    if soft is None:
        return r.timeout_floor_s, 2 * r.timeout_floor_s
    return soft, hard if hard is not None else soft + r.timeout_floor_s


class StepTimeouts:
    """The learned soft timeout of one process: observed intervals, the value they give,
    and its copy in `<workdir>/timeouts.json`. Owned by the process's resilience layer and
    handed to each attempt, so an in-process restart keeps what was learned."""

    def __init__(self, r: ResilienceConfig, workdir: str | Path | None = None, write: bool = False) -> None:
        self.config = r
        self.path = Path(workdir) / TIMEOUTS_FILE if workdir is not None else None  # None: not kept
        self.write_enabled = write and self.path is not None  # rank 0 only
        self.longest_interval_s: float | None = None
        self.samples = 0
        self._written_s = 0.0
        self.learning = explicit_s(r.soft_timeout_s) is None
        if self.learning:
            self._read()

    @property
    def soft_s(self) -> float:
        r = self.config
        return soft_timeout_s(
            self.longest_interval_s,
            self.samples,
            explicit_s=explicit_s(r.soft_timeout_s),
            safety_factor=r.timeout_safety_factor,
            floor_s=r.timeout_floor_s,
            ceiling_s=r.timeout_ceiling_s,
        )

    @property
    def hard_s(self) -> float:
        soft, hard = watchdog_timeouts(self.config)
        return self.soft_s + (hard - soft)

    def observe(self, interval_s: float) -> None:
        """One step-to-step interval (the step and the checkpoint work after it)."""
        if not self.learning or not math.isfinite(interval_s) or interval_s < 0:
            return
        before = self.soft_s
        self.samples += 1
        self.longest_interval_s = max(self.longest_interval_s or 0.0, interval_s)
        after = self.soft_s
        if self.samples >= LEARN_AFTER_STEPS and after != before:
            if self.samples == LEARN_AFTER_STEPS or after >= REWRITE_RATIO * self._written_s:
                self._write()
        elif self.samples == LEARN_AFTER_STEPS:
            self._write()  # learned: a restarted group starts with it

    def _read(self) -> None:
        if self.path is None:
            return
        try:
            saved = json.loads(self.path.read_text())
            longest, samples = float(saved["longest_interval_s"]), int(saved["samples"])
        except (OSError, ValueError, KeyError, TypeError):
            return  # none yet, or one cut short: learn again
        self.longest_interval_s, self.samples = longest, samples
        self._written_s = self.soft_s
        log.info(
            "in-process timeouts learned earlier in this run: soft %.0f s, hard %.0f s (%s)",
            self.soft_s, self.hard_s, self.path,
        )  # fmt: skip

    def _write(self) -> None:
        soft = self.soft_s
        if self.write_enabled and self.path is not None:
            from trainer.events import write_json_atomic

            write_json_atomic(self.path, self.as_dict())
            log.info(
                "in-process timeouts learned: soft %.0f s, hard %.0f s (%g x the longest step %.1f s, "
                "within %g-%g s)",
                soft, self.hard_s, self.config.timeout_safety_factor, self.longest_interval_s or 0.0,
                self.config.timeout_floor_s, self.config.timeout_ceiling_s,
            )  # fmt: skip
        self._written_s = soft

    def as_dict(self) -> dict[str, Any]:
        return {
            "longest_interval_s": self.longest_interval_s,
            "samples": self.samples,
            "soft_timeout_s": self.soft_s,
            "hard_timeout_s": self.hard_s,
            "time": time.time(),
        }


def forget(workdir: str | Path) -> None:
    """A new run begins: what an earlier run learned does not apply."""
    (Path(workdir) / TIMEOUTS_FILE).unlink(missing_ok=True)
