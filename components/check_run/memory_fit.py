"""Will a GPU run's ranks fit their GPUs? The memory plan of the run's parameters, in the
check step, before a GPU node is booked (trainer/memory_plan.py; docs/performance.md).

Only GPU runs (`gpus_per_node` > 0) are planned; the plan traces one training step on CPU
(seconds for small models, a minute or more at 70B). The model is the preset's byte LM, or
the Hugging Face config.json under the model source's S3 prefix, read alone before anything
is staged; a registered model (models:/) or a config.json that cannot be read is not planned,
and the report says why. The GPU is the node selector's instance type when it names one
(`GPU_MEMORY_GIB`), else an 80 GB H100.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from components.check_run.parameters import RunParameterError, normalized

INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
GPU_MEMORY_GIB = {
    "p4d.24xlarge": 39.4,  # A100 40 GB
    "p4de.24xlarge": 79.2,  # A100 80 GB
    "p5.48xlarge": 79.6,  # H100 80 GB
    "p5e.48xlarge": 140.4,  # H200 141 GB
    "p5en.48xlarge": 140.4,
}
"""One GPU's memory as CUDA reports it, GiB, by EC2 instance type."""


def gpu_memory_gib(node_selector: Any) -> float:
    from trainer.memory_plan import H100_GPU_GIB

    instance = node_selector.get(INSTANCE_TYPE_LABEL) if isinstance(node_selector, dict) else None
    return GPU_MEMORY_GIB.get(str(instance), H100_GPU_GIB)


def check_memory_fits(values: Mapping[str, Any]) -> str:
    """One line for the check step's report; RunParameterError, in one line, when a rank of
    the run cannot fit its GPU (with the cheapest change that would)."""
    values = normalized(values)
    gpus = values.get("gpus_per_node") or 0
    if gpus < 1:
        return "memory plan: not run (not a GPU run: gpus_per_node is 0)"
    from components.train.train import TrainRequest
    from trainer.arguments import PIPELINE_SETTINGS
    from trainer.config import DEFAULT_PRESET, ConfigError
    from trainer.memory_plan import Job, plan_memory

    nnodes = values.get("nnodes", 1) if values.get("launcher", "inpod") != "inpod" else 1
    with _model_folder(str(values.get("model_source") or "")) as (model_dir, reason):
        if reason:
            return f"memory plan: not run ({reason})"
        request = TrainRequest(
            dataset_dir="<staged>",
            run_folder=Path("<run>"),
            model_dir=model_dir,
            preset=values.get("preset", DEFAULT_PRESET),
            overrides=values.get("overrides", ""),
            settings={name: values[name] for name in PIPELINE_SETTINGS if name in values},
        )
        job = Job(
            config=request.config(),
            nnodes=nnodes,
            gpus_per_node=values.get("nproc") or gpus,
            gpu_memory_gib=gpu_memory_gib(values.get("gpu_node_selector")),
        )
        try:
            plan = plan_memory(job)
        except ConfigError as exc:  # e.g. a global batch the job's ranks cannot split
            raise RunParameterError(f"memory plan: {exc}") from None
    if not plan.fits:
        raise RunParameterError(f"memory plan: {plan.verdict()}")
    return f"memory plan: {plan.verdict()}"


@contextlib.contextmanager
def _model_folder(model_source: str) -> Iterator[tuple[str, str]]:
    """(a folder holding the model's config.json or "" for the byte LM, why not planned or "")."""
    if not model_source:
        yield "", ""
        return
    if not model_source.startswith("s3://"):
        yield "", f"the model {model_source} is read when staged, not before"
        return
    from components.stage_data.s3_clients import s3_client
    from components.stage_data.source import parse_s3_uri

    bucket, prefix = parse_s3_uri(model_source)
    key = f"{prefix.rstrip('/')}/config.json" if prefix else "config.json"
    try:
        body = s3_client().get_object(Bucket=bucket, Key=key)["Body"].read()
    except Exception as exc:  # any S3 or credentials error: the plan is skipped, not the run
        yield "", f"s3://{bucket}/{key} could not be read: {type(exc).__name__}"
        return
    with tempfile.TemporaryDirectory(prefix="rtp-check-model-") as folder:
        (Path(folder) / "config.json").write_bytes(body)
        yield folder, ""
