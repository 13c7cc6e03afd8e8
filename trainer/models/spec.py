"""What the trainer needs to know about a kind of model: the `ModelSpec` (torchtitan's TrainSpec).

A spec is a frozen record of plain functions: how to build the modules (on the meta device
when the weights are filled in after sharding), how to fill them (all, or for a resume all
but the trained parameters the checkpoint overwrites), which submodules are FSDP units, the loss,
the tokenizer, how the architecture is identified (for the checkpoint's model_hash), and
how a consolidated state dict is exported to a folder and loaded back. The loop, the
validate and register steps and the benchmarks ask the registry (`trainer.models`) for the
spec instead of naming a model class, so a new architecture touches its own module and the
registry only.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainer import env
from trainer.config import ModelConfig
from trainer.models import ModelError

__all__ = [
    "LOSS_CHUNK_LOGITS",
    "ModelError",
    "ModelSpec",
    "Tokenizer",
    "chunked_cross_entropy",
    "copy_full_into",
    "files_sha256",
    "next_token_cross_entropy",
    "published_folder",
    "require_training_memory",
    "run_as_forward",
]

# fp32 parameter + gradient + AdamW's two moments, per parameter element.
TRAINING_BYTES_PER_PARAMETER = 16
LOSS_CHUNK_LOGITS = 2**26
"""Logits (tokens x vocabulary) the loss holds at once: 0.25 GiB in fp32, 512 tokens of a
128k vocabulary. The whole batch's fp32 logits at 8B (16 rows x 4k tokens x 128k) would be 32 GiB."""


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
    init_for_resume: Callable[[nn.Module, ModelConfig, torch.device, int], None]
    """`init_weights` for a model a resume will overwrite (built by `build_for_training(...,
    weights=False)`, sharded): allocate the shards and fill only what a checkpoint does not
    hold, the buffers (rotary frequencies) and the frozen weights (a LoRA run's base, read
    from its folder). The trained parameters are left as allocated: at 8B, reading them from
    the folder or drawing them is minutes that the resume throws away."""
    init_trained: Callable[[nn.Module, ModelConfig, torch.device, int], None]
    """After `init_for_resume`, when the resume found nothing to load after all: fill the
    trained parameters as `init_weights` does, so the run starts as a fresh one would."""
    fsdp_units: Callable[[nn.Module], list[nn.Module]]
    """Submodules that each become one FSDP unit (the transformer blocks); everything else
    (embeddings, final norm, output head) stays in the root unit."""
    loss: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    """Mean next-token cross-entropy (fp32) of a (batch, seq_len + 1) tensor of token ids, on a
    plain or a sharded model; the output head runs chunk by chunk (`chunked_cross_entropy`)
    inside a forward of the root, so no rank holds the whole batch's logits."""
    tokenizer: Callable[[ModelConfig], Tokenizer]
    architecture: Callable[[ModelConfig], dict[str, Any]]
    """What identifies the architecture (hashed into model_hash): equal exactly when a
    checkpoint of one fits the other."""
    export: Callable[[Mapping[str, torch.Tensor], ModelConfig, Path], Path]
    """Write a consolidated (full, unsharded) state dict as a self-contained model folder;
    returns the folder. The folder appears complete or not at all."""
    load_exported: Callable[[Path], nn.Module]
    """A plain module (CPU, eval mode) from a folder written by `export`."""

    def build_for_training(
        self, config: ModelConfig, device: torch.device, seed: int, *, weights: bool = True
    ) -> nn.Module:
        """The modules to shard: on the meta device when the weights come after sharding, or
        when there are to be none (`weights=False`: a resume loads them; `init_for_resume`)."""
        torch.manual_seed(seed)  # identical initial weights on every rank
        on_device = weights and not self.init_after_sharding
        return self.build(config, device if on_device else torch.device("meta"))


def next_token_cross_entropy(logits: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of `logits` (B, T, V), computed from batch[:, :-1], against batch[:, 1:],
    in fp32 whatever the logits' dtype. It holds the whole batch's logits: for a model whose
    output head the loss cannot call itself (else `chunked_cross_entropy`)."""
    targets = batch[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def chunked_cross_entropy(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    *,
    vocab_size: int,
    logits_per_chunk: int = 0,
) -> torch.Tensor:
    """Mean cross-entropy of `head(hidden)` (..., vocab_size) against `targets` (...), holding
    at most `logits_per_chunk` logits (0: LOSS_CHUNK_LOGITS) at a time, forward and backward.

    The head and the fp32 log-softmax run over chunks of tokens; under autograd a chunk's
    logits are recomputed in the backward pass instead of kept. A batch that fits one chunk
    is computed exactly as `next_token_cross_entropy` computes it."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1)
    tokens_per_chunk = max(1, (logits_per_chunk or LOSS_CHUNK_LOGITS) // vocab_size)
    if targets.numel() <= tokens_per_chunk:
        return F.cross_entropy(head(hidden).float(), targets)
    summed = functools.partial(_summed_cross_entropy, head)
    total = torch.zeros((), device=hidden.device)
    for hidden_chunk, target_chunk in zip(
        hidden.split(tokens_per_chunk), targets.split(tokens_per_chunk), strict=True
    ):
        if torch.is_grad_enabled():
            # The head and the cross-entropy draw no random numbers: no RNG state to restore.
            total = total + checkpoint(
                summed, hidden_chunk, target_chunk, use_reentrant=False, preserve_rng_state=False
            )
        else:
            total = total + summed(hidden_chunk, target_chunk)
    return total / targets.numel()


def _summed_cross_entropy(
    head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), targets, reduction="sum")


_FORWARD_METHOD = "rtp_forward"


def run_as_forward(
    model: nn.Module, compute: Callable[[nn.Module, torch.Tensor], torch.Tensor], batch: torch.Tensor
) -> torch.Tensor:
    """`compute(model, batch)` run as a forward of `model`.

    FSDP2 gathers a unit's parameters around that module's `forward` only: outside it, the
    root unit's embeddings, final norm and output head are sharded, and a loss that calls the
    base model and then the head itself would find the head sharded and register no backward
    hooks. FSDP2's `register_fsdp_forward_method` runs the root's pre- and post-forward around
    another method; this gives `compute` one, once per model (a no-op when not sharded)."""
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    if not isinstance(model, FSDPModule):
        return compute(model, batch)
    if _FORWARD_METHOD not in vars(model):
        setattr(model, _FORWARD_METHOD, types.MethodType(_call_compute, model))
        register_fsdp_forward_method(model, _FORWARD_METHOD)
    return cast(torch.Tensor, getattr(model, _FORWARD_METHOD)(compute, batch))


def _call_compute(
    model: nn.Module, compute: Callable[[nn.Module, torch.Tensor], torch.Tensor], batch: torch.Tensor
) -> torch.Tensor:
    return compute(model, batch)


def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the slice of `full` this rank holds into `param` (a DTensor shard or a plain tensor)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        # src_data_rank=None: every rank holds the same full tensor, so each just slices its
        # own part, with the same chunking as FSDP (no communication).
        local = distribute_tensor(
            full.to(param.device), param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


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
    moments (frozen ones, a LoRA run's base, the fp32 weight alone), plus one FSDP unit
    gathered in full for its forward (activations come on top)."""
    from torch.distributed.tensor import DTensor

    def local_numel(trainable: bool) -> int:
        return sum(
            p.to_local().numel() if isinstance(p, DTensor) else p.numel()
            for p in model.parameters()
            if p.requires_grad == trainable
        )

    largest_unit = max((sum(p.numel() for p in unit.parameters()) for unit in units), default=0)
    needed = local_numel(True) * TRAINING_BYTES_PER_PARAMETER + (local_numel(False) + largest_unit) * 4
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
