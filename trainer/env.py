"""The one place that reads environment variables inside a training rank.

torchrun and ft_launcher describe the rank through standard variables (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, and ft_launcher's rank
monitor socket); Kubernetes adds the pod's address; MLflow's secret its variables. Modules
that set variables for processes they start (trainer/launch.py, determinism, diagnostics,
gpu_defaults) write them where they build that environment.
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


def local_world_size(default: int = 1) -> int:
    """Ranks on this machine (they share its memory)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", str(default)))


MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"  # set by torchrun / ft_launcher per worker group
FT_SOCKET = "FT_RANK_MONITOR_IPC_SOCKET"  # present when ft_launcher runs this rank


def master_addr() -> str:
    """Rank 0's host (the store server's); KeyError outside a launcher."""
    return os.environ[MASTER_ADDR]


def master_port() -> int:
    """The store server's port; KeyError outside a launcher."""
    return int(os.environ[MASTER_PORT])


def master_port_or_none() -> int | None:
    try:
        return int(os.environ.get(MASTER_PORT, ""))
    except ValueError:
        return None


def launcher_restart() -> int:
    """Worker-group restarts by the launcher before this process."""
    return int(os.environ.get(RESTART_COUNT, "0"))


def under_ft_launcher() -> bool:
    """Whether ft_launcher's rank monitor watches this rank (its socket is set)."""
    return bool(os.environ.get(FT_SOCKET))


def replica_host() -> str:
    """The address peers reach this pod at, when set (`RTP_REPLICA_HOST`, else Kubernetes'
    `POD_IP`); empty: none set."""
    return os.environ.get("RTP_REPLICA_HOST") or os.environ.get("POD_IP") or ""


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
