"""Where every step reads and writes on the shared volume (the FSx for Lustre PVC).

    <mount>/rtp/datasets/<dataset>/snapshots/<snapshot-id>/   immutable, complete
    <mount>/rtp/datasets/<dataset>/current -> snapshots/<id>   switched atomically
    <mount>/rtp/datasets/<dataset>/.staging/<id>/              in progress, resumable
    <mount>/rtp/runs/<run>/checkpoints/step_<N>/               committed DCP checkpoints
    <mount>/rtp/runs/<run>/export/step_<N>/                    that checkpoint in Hugging Face format (register)
    <mount>/rtp/runs/<run>/steps/<step>.json                   each step's record

`<run>` is the run name when one is given, else the KFP run id, so a retried train task
of the same run resumes from that run's checkpoints.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

PIPELINE_NAME = "rtp-resilient-training"
"""The pipeline's name, also the MLflow experiment its train step logs to."""

_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_name(kind: str, value: str) -> str:
    # fullmatch: `$` in a pattern also matches before a trailing newline.
    if not _SAFE_NAME.fullmatch(value):
        raise ValueError(
            f"{kind} {value!r} is not a safe folder name: use letters, digits, '.', '_' or '-' "
            "(at most 128, not starting with a symbol)"
        )
    return value


COLLECTIONS = {"datasets": "dataset name", "models": "model name"}
"""What the stage step can stage onto the volume: <mount>/rtp/<collection>/<name>/."""


def dataset_root(mount: str | Path, dataset: str) -> Path:
    return snapshot_root(mount, "datasets", dataset)


def snapshot_root(mount: str | Path, collection: str, name: str) -> Path:
    """<mount>/rtp/datasets/<name> or <mount>/rtp/models/<name>: snapshots/, current, .staging/."""
    if collection not in COLLECTIONS:
        raise ValueError(f"collection {collection!r} is not one of {', '.join(COLLECTIONS)}")
    return Path(mount) / "rtp" / collection / check_name(COLLECTIONS[collection], name)


def run_dir(mount: str | Path, run_name: str, job_id: str = "") -> Path:
    name = run_name or job_id
    if not name:
        raise ValueError("no run name and no KFP run id: pass --run-name")
    return Path(mount) / "rtp" / "runs" / check_name("run name", name)


def record_step(run_folder: Path, pipeline_step: str, started_at: float, /, **fields: Any) -> dict[str, Any]:
    """Write steps/<step>.json (elapsed seconds + outputs) so a driver can summarize the run."""
    from trainer.events import write_json_atomic  # here: importing trainer costs a stage's start-up

    record = {**fields, "pipeline_step": pipeline_step, "elapsed_s": round(time.time() - started_at, 3)}
    write_json_atomic(run_folder / "steps" / f"{pipeline_step}.json", record)
    return record
