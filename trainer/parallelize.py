"""Process group, device mesh and FSDP2 sharding, kept apart from the model and the loop.

The same code path serves CPU (gloo) and GPU (NCCL): the backend and device follow
`torch.cuda.is_available()`. Each transformer block (the model spec's `fsdp_units`) is its
own FSDP unit so only one block's full parameters exist at a time; the root unit holds the
embeddings, the final norm and the output head.
"""

from __future__ import annotations

from collections.abc import Sequence
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


def init_distributed(timeout_s: float = 120.0, store: dist.Store | None = None) -> DeviceMesh:
    """Join the process group described by the launcher's environment; one 1-D mesh.

    With `store`, rendezvous goes through it (each in-process restart brings a fresh key
    prefix); rank and world size still come from the launcher's environment."""
    device = training_device()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # Joining and start-up (model build, checkpoint load, writer warm-up) may take a
        # while and differ between ranks; the loop later sets the short collective timeout
        # (`set_collective_timeout`).
        join_timeout = timedelta(seconds=max(120.0, timeout_s))
        if store is None:
            dist.init_process_group(backend=backend, timeout=join_timeout)
        else:
            dist.init_process_group(
                backend=backend,
                store=store,
                rank=env.rank(),
                world_size=env.world_size(),
                timeout=join_timeout,
            )
    return init_device_mesh(device.type, (dist.get_world_size(),))


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, units: Sequence[nn.Module]) -> nn.Module:
    """Shard each of `units` (from `ModelSpec.fsdp_units`) as its own FSDP unit, then the root."""
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def set_collective_timeout(timeout_s: float) -> None:
    """From here on a collective waits at most `timeout_s` for its peers. On CPU this bounds
    how long a rank sits in a gloo op after a peer failed (gloo ops cannot be aborted)."""
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s))
