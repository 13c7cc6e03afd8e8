"""The one place that reads environment variables inside a training rank.

torchrun and ft_launcher describe the rank through the standard variables below; the
names are kept as constants so a grep finds every use.
"""

from __future__ import annotations

import os

RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"


def rank() -> int:
    return int(os.environ.get(RANK, "0"))


def world_size() -> int:
    return int(os.environ.get(WORLD_SIZE, "1"))


def local_rank() -> int:
    return int(os.environ.get(LOCAL_RANK, "0"))


def launched_by_torchrun() -> bool:
    return MASTER_ADDR in os.environ and MASTER_PORT in os.environ
