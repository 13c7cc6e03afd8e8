"""Why each restart happened, as the ranks saw it: `<workdir>/restart_causes/*.json`.

When an in-process attempt ends, each rank notes what ended it (`cause_of`): its own
exception (with the exception's type), or the interruptions NVRx's wrapper reported when it
interrupted the rank: a soft timeout (no progress), a hard timeout (a rank terminated for not
reacting), an exception on another rank, a rank that stopped heart-beating to the wrapper or
whose process ended. NVRx 0.4.1 reports these only as the message of the exception it raises
in the main thread (`inprocess.attribution.format_interruption_records`, e.g.
"Interruption.SOFT_TIMEOUT on ranks={1}"), so that message is read; tests build it with
NVRx's own function and fail when its form changes.

The wrapper's teardown writes the note (trainer/resilience.py), one file per rank and
attempt; `trainer.goodput` merges the notes of the attempt before each restart. A worker
group restarted by ft_launcher with no note behind it lost a rank to a process exit or to
missed launcher heartbeats (`LAUNCHER`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

SOFT_TIMEOUT = "soft_timeout"
HARD_TIMEOUT = "hard_timeout"
COLLECTIVE_TIMEOUT = "collective_timeout"
EXCEPTION = "exception"
UNRESPONSIVE = "unresponsive"
TERMINATED = "terminated"
LAUNCHER = "launcher"
RELAUNCH = "relaunch"
UNKNOWN = "unknown"

_FROM_NVRX = {
    "HARD_TIMEOUT": HARD_TIMEOUT,
    "SOFT_TIMEOUT": SOFT_TIMEOUT,
    "EXCEPTION": EXCEPTION,
    "BASE_EXCEPTION": EXCEPTION,
    "UNRESPONSIVE": UNRESPONSIVE,
    "TERMINATED": TERMINATED,
    "MONITOR_PROCESS_EXCEPTION": TERMINATED,
}
"""NVRx's `inprocess.attribution.Interruption` names, most telling first."""
_RECORDS = re.compile(r"Interruption\.(\w+) on ranks=\{([\d,\s]*)\}")
_COLLECTIVE_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)
"""How gloo ("Timed out waiting 5000ms for recv ...") and NCCL's watchdog ("Watchdog caught
collective operation timeout") word a collective that waited `collective_timeout_s` for a peer."""
_PEER_GONE = re.compile(r"Connection (closed|reset) by peer|Broken pipe", re.IGNORECASE)
"""How an error says that a peer went away (gloo, sockets): the consequence of a fault elsewhere."""
_PRIORITY = [
    HARD_TIMEOUT,
    SOFT_TIMEOUT,
    COLLECTIVE_TIMEOUT,
    EXCEPTION,
    UNRESPONSIVE,
    TERMINATED,
    LAUNCHER,
    RELAUNCH,
    UNKNOWN,
]
_WORDS = {
    SOFT_TIMEOUT: "soft timeout",
    HARD_TIMEOUT: "hard timeout",
    COLLECTIVE_TIMEOUT: "collective timeout",
    EXCEPTION: "exception",
    UNRESPONSIVE: "wrapper heartbeat lost",
    TERMINATED: "process ended",
    LAUNCHER: "process exit or missed ft_launcher heartbeat",
    RELAUNCH: "launcher started again",
    UNKNOWN: "unknown",
}


@dataclasses.dataclass(frozen=True, slots=True)
class RestartCause:
    cause: str
    """One of soft_timeout, hard_timeout, collective_timeout (a rank waited past
    resilience.collective_timeout_s for a peer), exception, unresponsive, terminated,
    launcher, relaunch."""
    ranks: tuple[int, ...] = ()
    exception: str = ""
    """The exception's type, when this rank raised it."""
    message: str = ""
    soft_timeout_s: float | None = None
    """The soft timeout in force when it ended (a soft timeout is no progress for this long)."""

    def describe(self) -> str:
        """One line for the log and the report, e.g. "soft timeout on rank 1 (no progress for 23 s)"."""
        text = _WORDS.get(self.cause, self.cause)
        if self.exception:
            text += f" {self.exception}"
        if self.ranks:
            text += f" on rank{'s' if len(self.ranks) > 1 else ''} {', '.join(map(str, self.ranks))}"
        if self.cause == SOFT_TIMEOUT and self.soft_timeout_s:
            text += f" (no progress for {self.soft_timeout_s:.0f} s)"
        elif self.message:
            text += f": {self.message}"
        return text

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "ranks": list(self.ranks), "detail": self.describe()}


def interruptions_in(error: BaseException) -> dict[str, list[int]]:
    """The interruptions NVRx named in `error` or the errors it was raised from or during."""
    found: dict[str, list[int]] = {}
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for name, ranks in _RECORDS.findall(str(current)):
            if name in _FROM_NVRX:
                listed = found.setdefault(_FROM_NVRX[name], [])
                listed.extend(int(rank) for rank in re.findall(r"\d+", ranks) if int(rank) not in listed)
        current = current.__cause__ or current.__context__
    return found


def cause_of(error: BaseException | None, rank: int, soft_timeout_s: float | None = None) -> RestartCause:
    """What ended an attempt on `rank`: NVRx's interruptions when it named any, else the
    rank's own exception."""
    if error is None:
        return RestartCause(UNKNOWN)
    named = interruptions_in(error)
    if named:
        cause = next(kind for kind in _PRIORITY if kind in named)
        return RestartCause(cause, tuple(sorted(named[cause])), soft_timeout_s=soft_timeout_s)
    if "RankShouldRestart" in (cls.__name__ for cls in type(error).__mro__):
        # Without NVRx's message: raised again until the rank reaches the wrapper, or raised
        # anew (the type alone) after one landed in a weakref callback or `__del__` and was
        # ignored (inprocess/monitor_thread.py:181-182 and :96-100): it names no cause here.
        return RestartCause(UNKNOWN, (rank,))
    kind = EXCEPTION
    if type(error).__name__ in (
        "RuntimeError",
        "DistBackendError",
        "DistError",
    ) and _COLLECTIVE_TIMED_OUT.search(str(error)):
        kind = COLLECTIVE_TIMEOUT
    return RestartCause(kind, (rank,), exception=type(error).__name__, message=str(error)[:200])


def causes_dir(workdir: str | Path) -> Path:
    return Path(workdir) / "restart_causes"


def write_note(
    workdir: str | Path, cause: RestartCause, *, launcher_restart: int, iteration: int, rank: int, at: float
) -> None:
    """One rank's note of what ended its attempt `iteration` of worker group `launcher_restart`."""
    from trainer.events import write_json_atomic

    record = {**cause.as_dict(), "launcher_restart": launcher_restart, "iteration": iteration, "rank": rank}
    record["time"] = at
    write_json_atomic(
        causes_dir(workdir) / f"group{launcher_restart}-attempt{iteration}-rank{rank}.json", record
    )


def read_notes(workdir: str | Path) -> list[dict[str, Any]]:
    notes = []
    for path in sorted(causes_dir(workdir).glob("*.json")) if causes_dir(workdir).is_dir() else []:
        try:
            notes.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return notes


def forget(workdir: str | Path) -> None:
    """A new run begins."""
    folder = causes_dir(workdir)
    if folder.is_dir():
        for path in folder.glob("*.json"):
            path.unlink(missing_ok=True)


def peers_gone_only(notes: list[dict[str, Any]]) -> bool:
    """Whether every note is an error that says a peer went away: what the survivors of a
    rank whose process ended (SIGKILL, an abort) see, a consequence and not the cause."""
    return bool(notes) and all(
        note.get("cause") == EXCEPTION and _PEER_GONE.search(note.get("message") or "") for note in notes
    )


def merge(notes: list[dict[str, Any]]) -> RestartCause | None:
    """The ranks' notes of one attempt as one cause: the most telling kind; for an
    exception, the note of the rank that raised it (it knows the type), not a peer's error
    that says a peer went away (gloo's "Connection closed by peer" once the restart took
    the raising rank's connections down: a consequence, noted as early or later), and the
    ranks that raised the same type."""
    notes = [note for note in notes if note.get("cause") != UNKNOWN]  # they say nothing
    if not notes:
        return None
    best = min(
        notes,
        key=lambda note: (
            _PRIORITY.index(note.get("cause", UNKNOWN)) if note.get("cause") in _PRIORITY else len(_PRIORITY),
            not note.get("exception"),
            bool(_PEER_GONE.search(note.get("message") or "")),
            note.get("time", math.inf),
        ),
    )
    same = [note for note in notes if note.get("cause") == best["cause"]]
    if best.get("exception"):
        same = [note for note in same if note.get("exception") in (best["exception"], "", None)]
    ranks = sorted({rank for note in same for rank in note.get("ranks", [])})
    return RestartCause(
        best["cause"],
        tuple(ranks),
        exception=best.get("exception", ""),
        message=best.get("message", ""),
        soft_timeout_s=best.get("soft_timeout_s"),
    )
