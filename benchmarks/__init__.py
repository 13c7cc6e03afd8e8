"""Side-by-side measurements that print JSON and a table (never asserted in tests)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def report(
    result: dict[str, Any], json_path: str | None, format_table: Callable[[dict[str, Any]], str]
) -> int:
    """Print a benchmark's result as JSON and as a table; also write the JSON to `json_path`."""
    document = json.dumps(result, indent=2)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(document + "\n")
    print(document)
    print(format_table(result))
    return 0
