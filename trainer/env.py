"""The one place that reads environment variables inside a training rank.

torchrun and ft_launcher describe the rank through standard variables (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), which `torch.distributed.init_process_group` reads itself; the
trainer needs only the local rank, to pick its GPU.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

LOCAL_RANK = "LOCAL_RANK"


def local_rank() -> int:
    return int(os.environ.get(LOCAL_RANK, "0"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_world_size() -> int:
    """Ranks on this machine (they share its memory)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


MLFLOW_TRACKING_URI = "MLFLOW_TRACKING_URI"


MLFLOW_SECRET_VARIABLES = (
    MLFLOW_TRACKING_URI,
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
)
"""What a Kubernetes secret fills in for MLflow (components.mlflow_access.MLFLOW_SECRET_KEYS)."""


def strip_secret_newlines(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Drop the line end a secret file written with an editor keeps (`kubectl create secret
    --from-file` copies it into the value) from the MLflow variables, before MLflow reads
    them: a newline breaks the tracking URI and the login header. Returns the names changed."""
    env = os.environ if environ is None else environ
    changed = []
    for name in MLFLOW_SECRET_VARIABLES:
        value = env.get(name)
        if value is not None and value != value.rstrip("\r\n"):
            env[name] = value.rstrip("\r\n")
            changed.append(name)
    return changed


def mlflow_tracking_uri() -> str:
    """The MLflow server live metrics go to; empty = none (training logs only to files)."""
    strip_secret_newlines()
    return os.environ.get(MLFLOW_TRACKING_URI, "")


FORKED_ENV = "RTP_PREFORKED"
"""Set by a launcher plugin (rtp_prefork) in a rank it forked from a pre-imported process."""


def forked_rank() -> bool:
    """Whether this rank was forked from a pre-imported process rather than started anew."""
    return FORKED_ENV in os.environ
