"""Which rank is slow: each rank times its step's local work, the ranks compare every N steps.

FSDP's collectives make every rank wait for the slowest, so the step time is the same on
every rank and names nobody. What differs is the work a rank does on its own: the
optimizer step over its shard (no collective in it), timed every step (CUDA events on a
GPU, so the device's time is measured, not the launch). Every
`resilience.straggler_every_steps` steps the ranks gather their medians over the window
(one small all-gather) and score each against the median of the other ranks; a rank at or
past `resilience.straggler_threshold` times it is named in the log, the event log
(`stragglers`), summary.json, MLflow and goodput.html. NVRx's own straggler detector
needs CUPTI (GPUs only); this measure runs everywhere. A slowdown inside forward or
backward shows in every rank's step time but not in this score.
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist


def scores(medians: list[float], hosts: list[str], threshold: float) -> dict[str, Any]:
    """The report for one window: each rank's median local time and its ratio to the
    median of the other ranks (with two ranks, the other one's); `slow`: the ranks at or
    past `threshold` times it."""
    ranks: list[dict[str, Any]] = []
    slow: list[int] = []
    for rank, (value, host) in enumerate(zip(medians, hosts, strict=True)):
        others = medians[:rank] + medians[rank + 1 :]
        middle = statistics.median(others) if others else value
        relative = round(value / middle, 3) if middle > 0 else 1.0
        ranks.append({"rank": rank, "host": host, "local_s": round(value, 6), "relative": relative})
        if others and relative >= threshold:
            slow.append(rank)
    return {"ranks": ranks, "slow": slow}


class StragglerMonitor:
    """One per attempt and rank: `local_work()` around the step's local work; as a step
    callback it compares the ranks every `every_steps` and reports through `on_report`
    (rank 0: the event log, the log, MLflow). `last`: the newest report."""

    def __init__(
        self,
        every_steps: int,
        threshold: float,
        device: torch.device,
        on_report: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.every = every_steps
        self.on_report = on_report
        self.last: dict[str, Any] = {}
        self.threshold = threshold
        self.cuda = device.type == "cuda"
        self.host = socket.gethostname()
        self._times: list[float] = []
        self._events: list[tuple[Any, Any]] = []
        self._first_step: int | None = None

    @contextlib.contextmanager
    def local_work(self, step: int) -> Iterator[None]:
        if not self.every:
            yield
            return
        if self._first_step is None:
            self._first_step = step
        if self.cuda:
            began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            began.record()
            yield
            ended.record()
            self._events.append((began, ended))
        else:
            started = time.perf_counter()
            yield
            self._times.append(time.perf_counter() - started)

    def on_step_end(self, result: Any) -> None:
        report = self.report(result.step)
        if report is not None:
            self.last = report
            if self.on_report is not None:
                self.on_report(report)

    def report(self, step: int) -> dict[str, Any] | None:
        """Collective at every `every`-th step (the same steps on every rank): the window's
        report (every rank gets it), else None."""
        if not self.every or step % self.every:
            return None
        if self._events:
            self._events[-1][1].synchronize()
            self._times += [began.elapsed_time(ended) / 1e3 for began, ended in self._events]
            self._events.clear()
        mine = (statistics.median(self._times) if self._times else 0.0, self.host)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        window = [self._first_step if self._first_step is not None else step, step]
        self._times.clear()
        self._first_step = None
        medians, hosts = [g[0] for g in gathered], [g[1] for g in gathered]
        return {"steps": window, "threshold": self.threshold, **scores(medians, hosts, self.threshold)}

    def summary_fields(self) -> dict[str, Any]:
        return {"stragglers": self.last}


def step_callback(context: Any) -> StragglerMonitor | None:
    """trainer/step_callbacks.py's factory: on when `resilience.straggler_every_steps` > 0;
    rank 0 reports each window to the event log (`stragglers`), the log and MLflow."""
    r = context.config.resilience
    if not r.straggler_every_steps:
        return None

    def reported(report: dict[str, Any]) -> None:
        # The event names the slow ranks only: one line per window must not grow with the world.
        slow = [report["ranks"][rank] for rank in report["slow"]]
        worst = max((entry["relative"] for entry in report["ranks"]), default=1.0)
        context.events.emit(
            "stragglers", steps=report["steps"], threshold=report["threshold"], slow=report["slow"],
            slow_ranks=slow, max_relative=worst,
        )  # fmt: skip
        context.progress.on_stragglers(report)

    return StragglerMonitor(r.straggler_every_steps, r.straggler_threshold, context.device, reported)
