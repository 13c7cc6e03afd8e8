"""Goodput accounting: what a run's faults and restarts cost, read from its own records.

Inputs are the rank-0 event log (`events.jsonl`: `launch`, `attempt_start`, `resumed`,
`step`, checkpoint events) and the fault records (`faults/*.json`) of the run that began at
the last `launch` event. Pure functions of those records, so the numbers can be recomputed
and tested without processes.

- A *restart* is every attempt after the first: its fault (the latest fault record before
  it), the mechanism (`inprocess` when the in-process iteration advanced, `launcher` when
  ft_launcher restarted the worker group, `cold` when a new launcher was started for the
  same run, as after a pod restart), the step the fault hit, the step resumed from,
  detection time (in-process only: when the wrapper began tearing the attempt down),
  shutdown (fault → the new attempt's process/function started) and startup (→ first step
  of the new attempt, with its phases), and the steps redone.
- Each restart's `cause` (soft_timeout, hard_timeout, collective_timeout, exception,
  unresponsive, terminated, launcher, relaunch) and `cause_detail` come from the ranks' notes of the attempt before it
  (trainer/restart_causes.py); `kind` is the injected fault's kind, or the cause when none
  was injected.
- *Goodput* is productive step time — each step counted once, in the execution that
  lasted — over the run's wall time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer import restart_causes
from trainer.faults import fired_faults
from trainer.restart_causes import RestartCause


def read_events(workdir: str | Path) -> list[dict[str, Any]]:
    """The events of the current run (since the last `launch` record), in order."""
    path = Path(workdir) / "events.jsonl"
    if not path.is_file():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a killed writer
    launches = [i for i, event in enumerate(events) if event.get("kind") == "launch"]
    return events[launches[-1] :] if launches else events


def _cause(
    previous: dict[str, Any], attempt: dict[str, Any], mechanism: str, notes: list[dict[str, Any]]
) -> RestartCause:
    """What ended `previous`, from the ranks' notes written between the two attempts."""
    since, until = previous.get("at", previous["time"]), attempt.get("at", attempt["time"])
    mine = [
        note
        for note in notes
        if note.get("launcher_restart", 0) == previous.get("launcher_restart", 0)
        and note.get("iteration", 0) == previous.get("inprocess_iteration", 0)
        and since <= note.get("time", since) <= until
    ]
    merged = restart_causes.merge(mine)
    if merged is not None and not (mechanism == "launcher" and restart_causes.peers_gone_only(mine)):
        return merged
    if mechanism == "launcher":  # no rank could say: one was killed or exited
        return RestartCause(restart_causes.LAUNCHER)
    return RestartCause(restart_causes.RELAUNCH if mechanism == "cold" else restart_causes.UNKNOWN)


def analyze(
    events: list[dict[str, Any]],
    faults: list[dict[str, Any]],
    end_time: float,
    causes: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Restarts, goodput and lost steps of one run; `causes`: the ranks' restart notes."""
    attempts = [e for e in events if e["kind"] == "attempt_start"]
    starts = [e for e in events if e["kind"] == "launch"] or attempts[:1]
    run_start = starts[0].get("at", starts[0]["time"]) if starts else end_time
    wall_s = max(1e-9, end_time - run_start)

    last_execution: dict[int, float] = {}
    for event in events:
        if event["kind"] == "step":
            last_execution[event["step"]] = float(event.get("duration_s", 0.0))
    productive_s = sum(last_execution.values())

    restarts = []
    unclaimed = sorted(faults, key=lambda record: record["time"])
    for index in range(1, len(attempts)):
        previous, attempt = attempts[index - 1], attempts[index]
        attempt_at = attempt.get("at", attempt["time"])
        before = [f for f in unclaimed if f["time"] <= attempt_at]
        fault = before[-1] if before else None
        if fault is not None:
            unclaimed = [f for f in unclaimed if f is not fault]
        resumed = next(
            (e for e in events if e["kind"] == "resumed" and e["time"] >= attempt_at),
            None,
        )
        done_before = [
            e["step"]
            for e in events
            if e["kind"] == "step" and e["time"] <= (fault["time"] if fault else attempt_at)
        ]
        last_done = max(done_before) if done_before else 0
        resumed_step = resumed["step"] if resumed else None
        if attempt.get("launcher_restart", 0) > previous.get("launcher_restart", 0):
            mechanism = "launcher"
        elif attempt.get("inprocess_iteration", 0) > 0:
            mechanism = "inprocess"
        else:  # a first attempt of a new launcher in the same run: everything was restarted
            mechanism = "cold"
        # For a launcher restart the new process's start marks the end of the shutdown;
        # for an in-process restart it is the new call of the training function.
        restarted_at = attempt.get("process_started_at") if mechanism != "inprocess" else None
        restarted_at = restarted_at or attempt_at
        fault_at = fault["time"] if fault else None
        cause = _cause(previous, attempt, mechanism, causes or [])
        record: dict[str, Any] = {
            "kind": fault["kind"] if fault else cause.cause,
            "cause": cause.cause,
            "cause_detail": cause.describe(),
            "mechanism": mechanism,
            "fault_rank": fault["rank"] if fault else None,
            "fault_step": fault["step"] if fault else None,
            "fault_at": fault_at,
            "resumed_step": resumed_step,
            "resumed_at": resumed["time"] if resumed else None,
            "detection_s": None,
            "shutdown_s": None,
            "startup_s": (resumed["time"] - restarted_at) if resumed else None,
            "startup_phases": resumed.get("phases", {}) if resumed else {},
            "downtime_s": None,
            "steps_redone": max(0, last_done - resumed_step) if resumed_step is not None else None,
            "preforked": bool(attempt.get("preforked", False)),
            "diagnostics": attempt.get("diagnostics", ""),
        }
        detected_at = attempt.get("fault_detected_at")
        if fault_at is not None:
            record["shutdown_s"] = max(0.0, restarted_at - fault_at)
            if detected_at:
                record["detection_s"] = max(0.0, detected_at - fault_at)
            if resumed:
                record["downtime_s"] = resumed["time"] - fault_at
        restarts.append(record)

    return {
        "restarts": restarts,
        "goodput_pct": round(100.0 * productive_s / wall_s, 2),
        "productive_s": productive_s,
        "run_wall_s": wall_s,
        "lost_steps": sum(r["steps_redone"] or 0 for r in restarts),
        "faults_injected": len(faults),
    }


def analyze_run(workdir: str | Path, end_time: float) -> dict[str, Any]:
    return analyze(read_events(workdir), fired_faults(workdir), end_time, restart_causes.read_notes(workdir))
