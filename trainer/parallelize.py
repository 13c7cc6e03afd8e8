"""Process group, device mesh and FSDP2 sharding, kept apart from the model and the loop.

The same code path serves CPU (gloo) and GPU (NCCL): the backend and device follow
`torch.cuda.is_available()`. Each transformer block is its own FSDP unit so only one
block's full parameters exist at a time; the root unit holds embeddings and the tied head.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from trainer import env


def training_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", env.local_rank())
    return torch.device("cpu")


def init_distributed(timeout_s: float = 120.0) -> DeviceMesh:
    """Join the process group described by the launcher's environment; one 1-D mesh."""
    device = training_device()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return init_device_mesh(device.type, (dist.get_world_size(),))


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def apply_fsdp(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    blocks = getattr(model, "blocks", [])
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
