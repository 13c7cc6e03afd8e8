"""Staging progress for people: a bar with bytes/s and ETA in a terminal, log lines in a pod.

`format_progress` is pure (tested alone); `Progress` is thread-safe, counts bytes from the
download threads and redraws at most a few times a second on a terminal, or logs a line
every `log_interval_s` when stderr is not one (a pod's log).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import TextIO

log = logging.getLogger(__name__)


def _human_bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    raise AssertionError("unreachable")


def _human_seconds(seconds: float) -> str:
    seconds = round(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}:{seconds % 60:02d}"


def format_progress(
    done_bytes: int, total_bytes: int, done_files: int, total_files: int, elapsed_s: float, width: int = 24
) -> str:
    """`[#####-----]  42.0%  1.2 GiB/2.9 GiB  310.4 MiB/s  ETA 0:05  120/300 files`."""
    fraction = done_bytes / total_bytes if total_bytes else 1.0
    filled = round(fraction * width)
    rate = done_bytes / elapsed_s if elapsed_s > 0 else 0.0
    eta = (total_bytes - done_bytes) / rate if rate > 0 else None
    return (
        f"[{'#' * filled}{'-' * (width - filled)}] {100 * fraction:5.1f}%  "
        f"{_human_bytes(done_bytes)}/{_human_bytes(total_bytes)}  {_human_bytes(rate)}/s  "
        f"ETA {_human_seconds(eta) if eta is not None else '--:--'}  {done_files}/{total_files} files"
    )


class Progress:
    def __init__(
        self,
        total_bytes: int,
        total_files: int,
        stream: TextIO | None = None,
        log_interval_s: float = 10.0,
        redraw_interval_s: float = 0.2,
        label: str = "staging",
    ) -> None:
        self.label = label
        self.total_bytes = total_bytes
        self.total_files = total_files
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval_s = redraw_interval_s if self.interactive else log_interval_s
        self.done_bytes = 0
        self.done_files = 0
        self.started = time.perf_counter()
        self._last = self.started
        self._lock = threading.Lock()

    def add_bytes(self, count: int) -> None:
        with self._lock:
            self.done_bytes += count
        self._maybe_report()

    def add_file(self, count: int = 1) -> None:
        with self._lock:
            self.done_files += count
        self._maybe_report()

    def line(self) -> str:
        return format_progress(
            self.done_bytes,
            self.total_bytes,
            self.done_files,
            self.total_files,
            time.perf_counter() - self.started,
        )

    def _maybe_report(self, force: bool = False) -> None:
        now = time.perf_counter()
        with self._lock:
            if not force and now - self._last < self.interval_s:
                return
            self._last = now
        if self.interactive:
            self.stream.write("\r" + self.line())
            self.stream.flush()
        else:
            log.info("%s %s", self.label, self.line())

    def close(self) -> None:
        self._maybe_report(force=True)
        if self.interactive:
            self.stream.write("\n")
            self.stream.flush()
