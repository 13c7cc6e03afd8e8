"""The run's event log (`events.jsonl`) and `summary.json`, written by rank 0 only.

One JSON object per line — steps, checkpoint saves, resumes — so later tools (goodput
report, benchmarks) read the same record the loop wrote. Summary files are replaced
atomically so a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


class EventLog:
    def __init__(
        self,
        workdir: str | Path,
        enabled: bool,
        listener: Callable[[str, dict[str, Any]], None] | None = None,
    ) -> None:
        self.path = Path(workdir) / "events.jsonl"
        self.enabled = enabled
        self.listener = listener
        """Also told of every event (rank 0's live metrics); must not block."""
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def emit(self, kind: str, **fields: Any) -> None:
        if not self.enabled:
            return
        record = {"time": time.time(), "kind": kind, **fields}
        with self.path.open("a") as handle:
            handle.write(json.dumps(record, sort_keys=True) + "\n")
        if self.listener is not None:
            self.listener(kind, record)


def write_json_atomic(path: str | Path, payload: dict[str, Any]) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with tmp.open("w") as handle:
        json.dump(payload, handle, indent=2, sort_keys=True)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, target)
