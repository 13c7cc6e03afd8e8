"""Fault injection for tests, demos and chaos drills: `--fault KIND@STEP[:RANK]`.

A fault fires once per run, on one rank (rank 0 unless given), when that rank reaches the
step. Before firing, the rank writes a record to `<workdir>/faults/` (fsynced): the record
is how a restarted rank — in the same process after an in-process restart, or a new
process after ft_launcher restarted the group — knows the fault already happened and must
not fire again when the step is redone, and it is what the goodput accounting reads as the
fault's time. The launcher clears the folder when a new run (not a restart) begins.

Kinds:
- `exception`: the rank raises (a soft fault: in-process restart recovers it);
- `hang`: the rank stops making progress (Python keeps running, so the restart machinery
  can interrupt it); detected by the in-process progress watchdog or ft_launcher's
  heartbeat timeout;
- `sigkill`: the rank is killed (a hard fault: only ft_launcher recovers it);
- `sigkill-during-save`: the rank is killed right after it queued an asynchronous
  checkpoint, while the writer is still writing it;
- `node-loss`: the rank's node is replaced: what it kept in the fast tier's node-local
  folder (its captures, the replicas it holds) is removed, then it is killed; its state
  must come from a peer (a replica, or under HSDP a twin) or the durable checkpoint;
- `slow-save`: the write of the save at STEP blocks every rank for twice the in-process
  watchdog's soft timeout (`resilience.soft_timeout_s`, or `timeout_floor_s` when that is
  auto) in one call into C, where the mode writes (a slow file system; RANK is ignored,
  nothing is recorded, a redone step is slow again): the in-process watchdog and the
  launcher's heartbeats must stay alive through it, the training thread must not be the
  one blocked in C;
- `slow`: from STEP on, the rank's local work (the optimizer step) takes MS milliseconds
  longer at every step (`slow@STEP[:RANK][:MS]`, default 200): a straggler, which
  trainer/stragglers.py must name (nothing is recorded, the weights are unchanged).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FAULT_KINDS = ("exception", "hang", "sigkill", "sigkill-during-save", "node-loss", "slow-save", "slow")
_SPEC = re.compile(r"^\s*(?P<kind>[a-z-]+)@(?P<step>\d+)(?::(?P<rank>\d+))?(?::(?P<ms>\d+))?\s*$")
SLOW_MS = 200
"""A `slow` drill's default: milliseconds added to the rank's local work at every step from its step on."""


class FaultSpecError(ValueError):
    """A `--fault` value is malformed; the message shows the accepted form."""


class InjectedFault(RuntimeError):
    """The exception an `exception` fault raises."""


@dataclass(frozen=True, slots=True)
class FaultSpec:
    kind: str
    step: int
    rank: int = 0
    ms: int = 0
    """`slow` only: the delay per step."""

    def __str__(self) -> str:
        return f"{self.kind}@{self.step}:{self.rank}" + (f":{self.ms}" if self.kind == "slow" else "")


def parse_fault(text: str) -> FaultSpec:
    match = _SPEC.match(text)
    if not match:
        raise FaultSpecError(
            f"bad fault {text!r}: use KIND@STEP[:RANK] (slow: KIND@STEP[:RANK][:MS]), e.g. exception@12, "
            "sigkill@20:1 or slow@5:1:300; "
            f"KIND is one of {', '.join(FAULT_KINDS)}"
        )
    kind = match["kind"]
    if kind not in FAULT_KINDS:
        raise FaultSpecError(f"unknown fault kind {kind!r} in {text!r}; use one of {', '.join(FAULT_KINDS)}")
    step = int(match["step"])
    if step < 1:
        raise FaultSpecError(f"fault step must be at least 1 in {text!r}")
    if match["ms"] and kind != "slow":
        raise FaultSpecError(f"only a slow fault takes milliseconds, in {text!r}: use {kind}@STEP[:RANK]")
    ms = int(match["ms"] or SLOW_MS) if kind == "slow" else 0
    return FaultSpec(kind, step, int(match["rank"] or 0), ms)


def parse_faults(text: str) -> list[FaultSpec]:
    """Comma- or space-separated specs (the form the config and pipeline parameter hold)."""
    items = [item for item in re.split(r"[,\s]+", text or "") if item and item.lower() != "none"]
    specs = [parse_fault(item) for item in items]
    if len(set(specs)) != len(specs):
        raise FaultSpecError(f"the same fault is listed twice in {text!r}")
    return specs


def faults_dir(workdir: str | Path) -> Path:
    return Path(workdir) / "faults"


def fired_faults(workdir: str | Path) -> list[dict[str, Any]]:
    """The records of faults that fired in this run, oldest first."""
    records = []
    for path in sorted(faults_dir(workdir).glob("*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # a record being written right now; it is complete on the next read
    return sorted(records, key=lambda record: record["time"])


def clear_fault_records(workdir: str | Path) -> None:
    """Forget fired faults and a recorded fatal error: called when a new run begins."""
    folder = faults_dir(workdir)
    if folder.is_dir():
        for path in folder.glob("*.json"):
            path.unlink(missing_ok=True)
    fatal_error_path(workdir).unlink(missing_ok=True)


def fatal_error_path(workdir: str | Path) -> Path:
    return Path(workdir) / "fatal_error.json"


def record_fatal_error(workdir: str | Path, error: BaseException) -> str:
    """Note an error no restart can fix (bad data, a diverged loss), so restarted
    processes stop at once instead of failing the same way again; returns the message."""
    message = f"{type(error).__name__}: {error}"
    path = fatal_error_path(workdir)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_record(path, {"error": message, "time": time.time(), "pid": os.getpid()})
    return message


def _write_record(path: Path, record: dict[str, Any]) -> None:
    """Write a JSON record whole or not at all. Several ranks may write the same record at
    once (a diverged loss): each uses its own temporary file (a shared name let one rank
    truncate the file another had just renamed into place, and a rank killed right then
    left an empty record: the restarted group did not see it and trained again)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w") as handle:
        json.dump(record, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def recorded_fatal_error(workdir: str | Path) -> str | None:
    try:
        return str(json.loads(fatal_error_path(workdir).read_text())["error"])
    except (OSError, ValueError, KeyError):
        return None


_AT_SAVE = ("sigkill-during-save", "slow-save")
"""Kinds that act at a save instead of at the start of a step."""
HARD_FAULTS = ("sigkill", "sigkill-during-save", "node-loss")
"""Faults the launcher recovers from by starting the worker group again."""


class FaultInjector:
    """Fires this rank's faults at their steps, each once per run."""

    def __init__(
        self,
        specs: list[FaultSpec],
        workdir: str | Path,
        rank: int,
        world_size: int,
        slow_save_s: float = 0.0,
        lose_node: Callable[[], None] | None = None,
    ) -> None:
        for spec in specs:
            if spec.rank >= world_size:
                raise FaultSpecError(
                    f"fault {spec} names rank {spec.rank}, but the run has {world_size} ranks"
                )
        self.all_specs = list(specs)
        self.specs = [spec for spec in specs if spec.rank == rank]
        self.slow_save_s = slow_save_s
        self.lose_node = lose_node  # `node-loss`: removes what this rank keeps on its node
        self.folder = faults_dir(workdir)
        self.rank = rank

    def _record_path(self, spec: FaultSpec) -> Path:
        return self.folder / f"{spec.kind}-{spec.step}-{spec.rank}.json"

    def _claim(self, spec: FaultSpec) -> bool:
        """Write the record (durably) unless it exists: True when the fault must fire now."""
        path = self._record_path(spec)
        if path.exists():
            return False
        self.folder.mkdir(parents=True, exist_ok=True)
        record = {
            "kind": spec.kind,
            "step": spec.step,
            "rank": spec.rank,
            "time": time.time(),
            "pid": os.getpid(),
        }
        _write_record(path, record)
        return True

    def at_step(self, step: int) -> None:
        """Called at the start of `step`, before any collective of that step."""
        for spec in self.specs:
            if spec.step == step and spec.kind not in (*_AT_SAVE, "slow") and self._claim(spec):
                self._fire(spec)

    def in_local_work(self, step: int) -> None:
        """Called inside the step's local work (the straggler monitor's section)."""
        delay = sum(spec.ms for spec in self.specs if spec.kind == "slow" and step >= spec.step)
        if delay:
            time.sleep(delay / 1e3)

    def during_save(self, step: int) -> None:
        """Called inside the write of the save of `step`, on the thread that writes it."""
        if any(spec.kind == "slow-save" and spec.step == step for spec in self.all_specs):
            # One call into C, as a write to a slow file system is: the thread runs no Python
            # meanwhile, and on the training thread it would starve NVRx's progress stamp.
            time.sleep(self.slow_save_s)

    def after_checkpoint_queued(self, step: int) -> None:
        """Called right after the save of `step` was queued (the writer is busy with it)."""
        for spec in self.specs:
            if spec.kind == "sigkill-during-save" and step >= spec.step and self._claim(spec):
                self._fire(spec)

    def _fire(self, spec: FaultSpec) -> None:
        if spec.kind == "exception":
            raise InjectedFault(f"injected fault {spec}")
        if spec.kind == "hang":
            # Short sleeps, not one long one: the rank stays interruptible by the restart
            # machinery (an asynchronous exception only lands between bytecodes).
            while True:
                time.sleep(0.05)
        if spec.kind == "node-loss" and self.lose_node is not None:
            self.lose_node()
        os.kill(os.getpid(), signal.SIGKILL)
