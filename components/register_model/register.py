"""Log a validated checkpoint to MLflow as a servable model and register a version with an alias.

The tracking server and its credentials come from MLflow's own environment variables
(MLFLOW_TRACKING_URI, MLFLOW_TRACKING_TOKEN, ...), never from pipeline parameters. A
version is tagged with the checkpoint's manifest SHA-256: registering the same checkpoint
again returns that version instead of creating a duplicate.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

import trainer
from components.validate_checkpoint.validate import load_validated_model
from trainer.checkpoint import MANIFEST

log = logging.getLogger(__name__)

ALIASES = {"champion": "champion", "challenger": "challenger"}
EXPERIMENT = "rtp"
SERVING_MODEL = Path(__file__).with_name("serving_model.py")


@dataclass(frozen=True, slots=True)
class RegisterResult:
    model_name: str
    version: str
    alias: str
    model_uri: str
    created: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def checkpoint_sha256(checkpoint_dir: str | Path) -> str:
    return hashlib.sha256((Path(checkpoint_dir) / MANIFEST).read_bytes()).hexdigest()


def _ensure_experiment(mlflow: Any, tracking_uri: str) -> None:
    """Local sqlite stores keep artifacts beside the database instead of in ./mlruns."""
    if mlflow.get_experiment_by_name(EXPERIMENT) is None:
        parsed = urlparse(tracking_uri)
        location = None
        if parsed.scheme == "sqlite":
            db_path = Path(tracking_uri[len("sqlite:///") :])
            location = (db_path.parent / "mlartifacts").resolve().as_uri()
        mlflow.create_experiment(EXPERIMENT, artifact_location=location)
    mlflow.set_experiment(EXPERIMENT)


def register_checkpoint(
    checkpoint_dir: str,
    model_name: str,
    decision: str,
    lineage: dict[str, str] | None = None,
) -> RegisterResult:
    import mlflow
    import pandas as pd
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    if decision not in ALIASES:
        raise ValueError(f"decision {decision!r} cannot be registered; expected one of {', '.join(ALIASES)}")
    alias = ALIASES[decision]
    client = mlflow.MlflowClient()
    sha = checkpoint_sha256(checkpoint_dir)
    if client.search_registered_models(filter_string=f"name = '{model_name}'"):
        existing = client.search_model_versions(
            f"name = '{model_name}' and tags.`rtp.checkpoint_sha256` = '{sha}'"
        )
        if existing:
            version = existing[0]
            log.info("checkpoint already registered as %s version %s", model_name, version.version)
            client.set_registered_model_alias(model_name, alias, version.version)
            return RegisterResult(
                model_name, str(version.version), alias, f"models:/{model_name}/{version.version}", False
            )

    model, config, meta = load_validated_model(checkpoint_dir)
    tags = {
        "rtp.checkpoint_sha256": sha,
        "rtp.checkpoint_dir": str(checkpoint_dir),
        "rtp.checkpoint_step": str(meta["step"]),
        **(lineage or {}),
    }
    _ensure_experiment(mlflow, mlflow.get_tracking_uri())
    signature = ModelSignature(
        inputs=Schema([ColSpec("string", "prompt")]),
        outputs=Schema([ColSpec("string")]),
        params=ParamSchema(
            [ParamSpec("max_new_tokens", "long", 64), ParamSpec("temperature", "double", 0.0)]
        ),
    )
    with (
        tempfile.TemporaryDirectory() as tmp,
        mlflow.start_run(run_name=f"register-step-{meta['step']}") as run,
    ):
        weights = Path(tmp) / "weights.pt"
        torch.save(model.state_dict(), weights)
        config_file = Path(tmp) / "config.json"
        config_file.write_text(json.dumps(config.to_dict()["model"]))
        mlflow.log_params({f"model.{k}": v for k, v in config.to_dict()["model"].items()})
        mlflow.log_metric("checkpoint_step", float(meta["step"]))
        mlflow.set_tags(tags)
        info = mlflow.pyfunc.log_model(
            name="model",
            python_model=str(SERVING_MODEL),
            artifacts={"weights": str(weights), "config": str(config_file)},
            code_paths=[str(Path(trainer.__file__).parent)],
            signature=signature,
            input_example=pd.DataFrame({"prompt": ["def "]}),
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", "numpy", "pandas"],
        )
        log.info("logged model %s in MLflow run %s", info.model_uri, run.info.run_id)
    version = mlflow.register_model(info.model_uri, model_name, tags=tags)
    client.set_registered_model_alias(model_name, alias, version.version)
    return RegisterResult(
        model_name, str(version.version), alias, f"models:/{model_name}/{version.version}", True
    )
