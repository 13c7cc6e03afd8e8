"""Smoke tests of the `rtp bench` commands: they run at toy size and write their JSON."""

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_bench(kind: str, out: Path, *args: str) -> tuple[dict[str, Any], str]:
    """`rtp bench KIND ARGS --json OUT` as a user runs it; returns the JSON it wrote and
    what it printed (the table)."""
    command = [sys.executable, "-m", "rtp_cli.main", "bench", kind, *args, "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=550, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(out.read_text()), result.stdout
