"""The one place that reads environment variables inside a training rank.

torchrun and ft_launcher describe the rank through standard variables (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), which `torch.distributed.init_process_group` reads itself; the
trainer needs only the local rank, to pick its GPU.
"""

from __future__ import annotations

import os

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


def mlflow_tracking_uri() -> str:
    """The MLflow server live metrics go to; empty = none (training logs only to files)."""
    return os.environ.get(MLFLOW_TRACKING_URI, "")


FORKED_ENV = "RTP_PREFORKED"
"""Set by a launcher plugin (rtp_prefork) in a rank it forked from a pre-imported process."""


def forked_rank() -> bool:
    """Whether this rank was forked from a pre-imported process rather than started anew."""
    return FORKED_ENV in os.environ
