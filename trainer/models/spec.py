"""What the trainer needs to know about a kind of model: the `ModelSpec` (torchtitan's TrainSpec).

A spec is a frozen record of plain functions: how to build the modules (on the meta device
when the weights are filled in after sharding), which submodules are FSDP units, the loss,
the tokenizer, how the architecture is identified (for the checkpoint's model_hash), and
how a consolidated state dict is exported to a folder and loaded back. The loop, the
validate and register steps and the benchmarks ask the registry (`trainer.models`) for the
spec instead of naming a model class, so a new architecture touches its own module and the
registry only.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from trainer import env
from trainer.config import ModelConfig
from trainer.models import ModelError

__all__ = [
    "ModelError",
    "ModelSpec",
    "Tokenizer",
    "files_sha256",
    "next_token_cross_entropy",
    "published_folder",
    "require_training_memory",
]

# fp32 parameter + gradient + AdamW's two moments, per parameter element.
TRAINING_BYTES_PER_PARAMETER = 16


class Tokenizer(Protocol):
    """Text <-> token ids, as the data preparation, validation and serving code need it."""

    @property
    def identity(self) -> str:
        """Names the tokenizer exactly: 'bytes', or SHA-256 over a model folder's tokenizer files.
        Token shards record it; training refuses shards made with another tokenizer."""
        ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int:
        """The token that separates documents in token shards."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    kind: str
    """Registry key: `model.kind` in the config."""
    build: Callable[[ModelConfig, torch.device], nn.Module]
    """The model's modules with their parameters on the device. On the meta device they hold
    shapes only; elsewhere their weights are the start of training (random init drawn from
    the torch RNG, or the pretrained weights). Raises ModelError for a bad model folder."""
    init_after_sharding: bool
    """True: training builds on the meta device, shards, then calls `init_weights`, so no rank
    ever holds the whole model. False: every rank builds the full model from the same seed
    and sharding keeps each rank's slice (exact, for small models)."""
    init_weights: Callable[[nn.Module, ModelConfig, torch.device, int], None]
    """(model, config, device, seed), after sharding: allocate each rank's shards on the device
    and fill them (seeded random, or pretrained weights read slice by slice)."""
    fsdp_units: Callable[[nn.Module], list[nn.Module]]
    """Submodules that each become one FSDP unit (the transformer blocks); everything else
    (embeddings, final norm, output head) stays in the root unit."""
    loss: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    """Mean next-token cross-entropy of a (batch, seq_len + 1) tensor of token ids."""
    tokenizer: Callable[[ModelConfig], Tokenizer]
    architecture: Callable[[ModelConfig], dict[str, Any]]
    """What identifies the architecture (hashed into model_hash): equal exactly when a
    checkpoint of one fits the other."""
    export: Callable[[Mapping[str, torch.Tensor], ModelConfig, Path], Path]
    """Write a consolidated (full, unsharded) state dict as a self-contained model folder;
    returns the folder. The folder appears complete or not at all."""
    load_exported: Callable[[Path], nn.Module]
    """A plain module (CPU, eval mode) from a folder written by `export`."""

    def build_for_training(self, config: ModelConfig, device: torch.device, seed: int) -> nn.Module:
        """The modules to shard: on the meta device when the weights come after sharding."""
        torch.manual_seed(seed)  # identical initial weights on every rank
        return self.build(config, torch.device("meta") if self.init_after_sharding else device)


def next_token_cross_entropy(logits: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of `logits` (B, T, V), computed from batch[:, :-1], against batch[:, 1:]."""
    targets = batch[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def files_sha256(paths: Iterable[Path]) -> str:
    """SHA-256 over (name, content) of the files in name order: a folder-independent identity."""
    digest = hashlib.sha256()
    for path in sorted(paths, key=lambda p: p.name):
        digest.update(path.name.encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


@contextlib.contextmanager
def published_folder(folder: Path) -> Iterator[Path]:
    """Yield a staging folder beside `folder` and rename it to `folder` when the block succeeds;
    on failure the staging folder is removed, so `folder` appears complete or not at all."""
    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()):
        raise ModelError(f"{folder} already holds files: export into a new or empty folder")
    staging = folder.with_name(f".{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if folder.exists():
        folder.rmdir()  # empty, checked above
    os.replace(staging, folder)


def require_training_memory(model: nn.Module, units: list[nn.Module], device: torch.device) -> int:
    """ModelError when this rank's share of the training state cannot fit the device's free
    memory; returns the estimate in bytes. Call on the sharded model before allocating it.

    The estimate is a floor: this rank's parameter shards with their gradients and AdamW
    moments, plus one FSDP unit gathered in full for its forward (activations come on top)."""
    from torch.distributed.tensor import DTensor

    def local_numel(module: nn.Module) -> int:
        return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in module.parameters())

    largest_unit = max((sum(p.numel() for p in unit.parameters()) for unit in units), default=0)
    needed = local_numel(model) * TRAINING_BYTES_PER_PARAMETER + largest_unit * 4
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:  # the machine's memory is shared by its ranks
        free = host_available_memory_bytes() // max(1, env.local_world_size())
    if needed > free:
        raise ModelError(
            f"the model needs at least {needed / 2**30:.1f} GiB per rank for weights, gradients and "
            f"AdamW state but {device} has {free / 2**30:.1f} GiB free: use more ranks (nodes) or a smaller model"
        )
    return needed


def host_available_memory_bytes() -> int:
    """Memory this process may still use: /proc/meminfo's MemAvailable, capped by the
    container's cgroup (v2) limit, which is what a Kubernetes pod is killed at."""
    available = 2**62
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return available
