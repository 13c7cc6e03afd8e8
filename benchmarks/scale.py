"""What rtp's costs grow with, in one run: data, validation and registration at two sizes each.

Three parts, each side by side with the implementation it replaced, each in fresh processes:

- data (benchmarks/scale_data.py): a training rank's peak RSS and start-up over 64 MiB and
  1 GiB of uint16 token shards, memory-mapped vs read whole;
- validate (benchmarks/scale_validate.py): `rtp validate`'s peak RSS and wall time on a ~20M
  and a ~120M Llama, the eval record vs scoring in-process;
- register (benchmarks/scale_register.py): the export's peak RSS and wall time on the same
  two sizes, streamed in the source dtype vs the whole model loaded, with the exported dtype
  and file count.

Targets (issue 28): data peak RSS at 1 GiB within 64 MiB of that at 64 MiB and start-up
within 1 s; validate and register peak RSS grows by at most 0.25x the fp32 size growth.
Prints each part's table; `--json PATH` writes all results.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

PARTS = ("data", "validate", "register")


def run_part(part: str) -> tuple[dict[str, Any], str]:
    """(results, table) of one part at its default sizes."""
    if part == "data":
        from benchmarks import scale_data

        results = scale_data.run_benchmark(64, 1024, 16, 2048, 8, 20)
        return results, scale_data.format_table(results)
    if part == "validate":
        from benchmarks import scale_validate

        results = scale_validate.run()
        return results, scale_validate.table(results)
    from benchmarks import scale_register

    with tempfile.TemporaryDirectory(prefix="rtp-scale-register-") as tmp:
        results = scale_register.run(Path(tmp), (4, 35), max_shard_size="5GB")
    return results, scale_register.table(results)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--part",
        choices=(*PARTS, "all"),
        default="all",
        help="run one part only (default: %(default)s)",
    )
    parser.add_argument("--json", default="", help="also write the results to this file")


def main(args: argparse.Namespace) -> int:
    report: dict[str, Any] = {}
    for part in PARTS if args.part == "all" else (args.part,):
        started = time.perf_counter()
        results, table = run_part(part)
        report[part] = {**results, "part_wall_s": round(time.perf_counter() - started, 1)}
        print(f"## {part}\n{table}\n")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0
