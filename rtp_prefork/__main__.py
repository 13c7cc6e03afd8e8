"""`python -m rtp_prefork <trainer args>`: what the launcher starts per rank with the plugin on.

A restarted rank asks the node's zygote to fork it (waiting while the zygote still
imports) and stands in for the forked rank. A rank that finds none runs `python -m trainer`
itself in this process; local rank 0 first imports what a rank needs and then starts the
zygote, so that the zygote's imports overlap this rank's start-up, not its own imports.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys
from pathlib import Path

from rtp_prefork import zygote


def _config_json(argv: list[str]) -> str:
    """The run's config as JSON from the trainer's `--config` (inline or a path); `{}` if none."""
    for index, arg in enumerate(argv):
        value = arg.partition("=")[2] if arg.startswith("--config=") else None
        if arg == "--config" and index + 1 < len(argv):
            value = argv[index + 1]
        if value is None:
            continue
        if value.lstrip().startswith("{"):
            return value
        with contextlib.suppress(OSError):
            return Path(value).read_text()
    return "{}"


def _workdir(config_json: str) -> Path:
    workdir = "."
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        workdir = json.loads(config_json).get("run", {}).get("workdir") or "."
    return Path(workdir)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    forked = zygote.run_forked([sys.argv[0], *argv], wait_s=zygote.ZYGOTE_WAIT_S if restarted else 0.0)
    if forked is not None:  # this process stood in for a rank forked pre-imported
        return forked
    if os.environ.get("LOCAL_RANK", "0") == "0" and zygote.PREFORKED_ENV not in os.environ:
        from trainer.faults import recorded_fatal_error  # torch-free

        config_json = _config_json(argv)
        workdir = _workdir(config_json)
        if not recorded_fatal_error(workdir):  # else the trainer fails at once, before importing torch
            zygote.warm_up(zygote.modules_for(config_json))
            zygote.start_zygote(config_json, workdir / "logs" / "prefork.log")
    sys.argv = [sys.argv[0], *argv]
    runpy.run_module("trainer", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
