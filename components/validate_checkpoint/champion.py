"""Fetch the model MLflow currently calls `champion`, so a candidate is scored against it.

The champion's consolidated weights bundle (safetensors + config, logged by the register
step) is downloaded and loaded into a plain model (the registry's byte-lm); the validate step then evaluates it
with the same code on the same holdout as the candidate. Server failures are retried
(`components.mlflow_access`); a registered model or alias that does not exist simply
means there is no champion yet.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from components.mlflow_access import RetryPolicy, call_with_retries
from components.register_model.bundle import WEIGHTS_FILE, read_bundle

log = logging.getLogger(__name__)

CHAMPION_ALIAS = "champion"
# What MLflow answers when the registered model or the alias does not exist.
_ABSENT_CODES = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND")


@dataclass(slots=True)
class Champion:
    model_name: str
    version: str
    model: nn.Module
    checkpoint_sha256: str

    @property
    def label(self) -> str:
        return f"champion {self.model_name} v{self.version}"


def load_champion(model_name: str, retry: RetryPolicy | None = None) -> Champion | None:
    """The current champion of `model_name`, or None when there is none.

    Raises BundleError when the champion exists but carries no readable weights bundle.
    """
    import mlflow
    from mlflow.exceptions import MlflowException

    client = mlflow.MlflowClient()
    try:
        version = call_with_retries(
            f"look up the {CHAMPION_ALIAS} of {model_name}",
            lambda: client.get_model_version_by_alias(model_name, CHAMPION_ALIAS),
            retry,
        )
    except MlflowException as exc:
        if exc.error_code in _ABSENT_CODES:
            log.info("%s has no %s yet: %s", model_name, CHAMPION_ALIAS, str(exc).splitlines()[0])
            return None
        raise
    with tempfile.TemporaryDirectory(prefix="rtp-champion-") as tmp:
        local = call_with_retries(
            f"download {model_name} version {version.version}",
            lambda: mlflow.artifacts.download_artifacts(
                artifact_uri=f"models:/{model_name}/{version.version}", dst_path=tmp
            ),
            retry,
        )
        found = sorted(Path(local).rglob(WEIGHTS_FILE))
        model = read_bundle(found[0].parent if found else Path(local) / "artifacts")
    return Champion(
        model_name=model_name,
        version=str(version.version),
        model=model,
        checkpoint_sha256=str(version.tags.get("rtp.checkpoint_sha256", "")),
    )
