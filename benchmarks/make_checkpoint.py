"""A committed checkpoint written in one call, for the benchmarks and tests that need one on disk.

The trainer saves through `CheckpointManager` and its writers; this is the same on-disk
format (`trainer.checkpointing.storage`: staging, DCP shards with their hashes, the commit)
without a training loop around it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from trainer.checkpointing import storage


def save_checkpoint(
    root: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    meta: dict[str, Any],
    rank_extra: dict[str, Any],
) -> Path:
    """Collective, synchronous: returns the folder once the checkpoint is committed everywhere."""
    staging, final = storage.prepare_staging(root, step, storage.rank_state(rank_extra))
    with storage.shard_records_without_crc32():
        dcp.save(storage.training_state_dict(model, optimizer), checkpoint_id=str(staging))
    storage.write_hash_sidecars(staging, dist.get_rank())
    storage.commit(staging, final, step, meta)
    return final
