"""`rtp local`'s console: the pipeline's own lines, without kfp.local's executor chatter.

kfp.local prints, for every task, the executor's start-up lines, the whole executor input
as JSON, where it wrote its output and then every output artifact. Those lines say nothing
about the run, so unless `--verbose` they are dropped (with two kinds of repeated library
noise, below): task starts and ends, the steps' own
log lines (progress lines, checkpoint commits, restarts) and errors stay. Only kfp.local's
printing is filtered; files under `<workdir>/kfp-local` keep everything.
"""

from __future__ import annotations

import builtins
import logging
from typing import Any

_EXECUTOR_PREFIX = "[KFP Executor "
_EXECUTOR_CHATTER = (
    "Looking for component",
    "Loading KFP component",
    "Got executor_input:",
    "Wrote executor output file",
)
# Repeated library noise in the train step's output: c10d's store polling while NVRx's
# monitor waits, and a deprecation warning printed by every process that imports torch.cuda.
_LIBRARY_NOISE = ("socket.cpp:", "The pynvml package is deprecated", "import pynvml  # type: ignore")


class ExecutorChatterFilter:
    """A line filter for a task's streamed output (stateful: the executor input spans lines)."""

    def __init__(self) -> None:
        self._in_executor_input = False

    def keep(self, line: str) -> bool:
        if self._in_executor_input:
            if line.rstrip("\n") == "}":  # the dump's closing brace, at column 0
                self._in_executor_input = False
            return False
        if any(noise in line for noise in _LIBRARY_NOISE):
            return False
        if line.startswith(_EXECUTOR_PREFIX):
            message = line.split("]: ", 1)[-1]
            if message.startswith("Got executor_input:"):
                self._in_executor_input = True
            return not message.startswith(_EXECUTOR_CHATTER)
        return True


class _KfpLocalLogFilter(logging.Filter):
    """kfp.local logs on the root logger: drop the streamed-logs banner and the output listings."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (
            message.startswith("Streamed logs") or " outputs:" in message or "has no outputs" in message
        )


def quiet_kfp_local() -> None:
    """Install both filters (idempotent)."""
    from kfp.local import subprocess_task_handler

    root = logging.getLogger()
    if not any(isinstance(f, _KfpLocalLogFilter) for f in root.filters):
        root.addFilter(_KfpLocalLogFilter())
    if getattr(subprocess_task_handler, "print", None) is None:
        lines = ExecutorChatterFilter()

        def print_kept(*args: Any, **kwargs: Any) -> None:
            # Looked up at call time: kfp.local swaps builtins.print to indent task output.
            if not (args and isinstance(args[0], str) and not lines.keep(args[0])):
                builtins.print(*args, **kwargs)

        # The module prints each streamed line with the global name `print`; a module
        # attribute of that name takes precedence over the builtin.
        subprocess_task_handler.print = print_kept  # type: ignore[attr-defined]
