"""How long `rtp local` takes per pipeline step, with 1 and with 2 training ranks, in one run.

    make bench   (or: python -m benchmarks.demo_pipeline [--steps 40] [--repeats 1])

Each configuration runs the whole pipeline (embedded S3, kfp.local, sqlite MLflow) in a
fresh work dir; the dataset upload and every step's process start-up are included, as a
user running `make demo` would see them. Prints one JSON document, then a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

STEP_ORDER = ("stage", "train", "validate", "register")


def measure(nproc: int, steps: int, repeats: int) -> dict:
    runs = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="rtp-bench-") as workdir:
            command = [
                "-m",
                "rtp_cli.main",
                "local",
                f"--workdir={workdir}",
                f"--nproc={nproc}",
                f"--steps={steps}",
            ]
            subprocess.run([sys.executable, *command], check=True)  # `rtp local`, as `make demo` runs it
            summary = json.loads((Path(workdir) / "summary.json").read_text())
            runs.append(
                {
                    "elapsed_s": summary["elapsed_s"],
                    "total_s": summary["total_elapsed_s"],
                    "final_loss": summary["final_loss"],
                }
            )
    return {
        "nproc": nproc,
        "steps": steps,
        "repeats": repeats,
        "median_total_s": statistics.median(r["total_s"] for r in runs),
        "median_step_s": {s: statistics.median(r["elapsed_s"][s] for r in runs) for s in STEP_ORDER},
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--json-out", default="rtp-work/bench-demo-pipeline.json", help="also write the JSON here"
    )
    args = parser.parse_args()
    results = [measure(nproc, args.steps, args.repeats) for nproc in (1, 2)]
    document = json.dumps({"benchmark": "demo_pipeline", "results": results}, indent=2)
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(document + "\n")
    # kfp.local prints task logs to stdout above; the results come last.
    print(document)
    header = f"{'nproc':>5} " + " ".join(f"{s:>9}" for s in STEP_ORDER) + f" {'total':>8}"
    print(header)
    for result in results:
        cells = " ".join(f"{result['median_step_s'][s]:>8.1f}s" for s in STEP_ORDER)
        print(f"{result['nproc']:>5} {cells} {result['median_total_s']:>7.1f}s")


if __name__ == "__main__":
    main()
