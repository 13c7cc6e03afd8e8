"""Process group, device mesh and FSDP2 sharding, kept apart from the model and the loop.

The same code path serves CPU (gloo) and GPU: the device follows `torch.cuda.is_available()`;
on CUDA the process group has two backends (`cpu:gloo,cuda:nccl`), so a collective on a
CUDA tensor runs on NCCL and one on a host tensor (a flag, a count, a pickled object) on gloo. Each transformer block (the model spec's `fsdp_units`) is its
own FSDP unit so only one block's full parameters exist at a time; the root unit holds the
embeddings, the final norm and the output head.

With `parallelism.dp_replicate` > 1 (or auto on several nodes) the mesh is 2-D, (replicate,
shard), and `fully_shard` over it is HSDP: a block's parameters are gathered within its
shard group only, gradients reduce-scattered there and all-reduced across the groups.

`parallelize` applies the `training` section on the way (torchtitan's order: compile and
activation checkpointing per block first, then sharding): bf16 mixed precision is FSDP2's
`MixedPrecisionPolicy` — each unit gathers bf16 copies of its parameters for compute and
reduces gradients in fp32 — so the sharded parameters the optimizer steps, its AdamW state
and every checkpoint stay fp32. The root's forward ends in the loss (the model spec's), whose
log-softmax runs in fp32 over chunks of tokens, never over the whole batch's logits.
Activation checkpointing and compile replace a block's `forward` instead of wrapping the
block in another module, so parameter names (checkpoint keys, `model_sha256`, exports) are
the same with and without them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from trainer import diagnostics, env, peer_abort
from trainer.config import ConfigError, ParallelismConfig, TrainingConfig


def training_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", env.local_rank())
    return torch.device("cpu")


GPU_BACKEND = "cpu:gloo,cuda:nccl"
"""NCCL for CUDA tensors; gloo for the host tensors some collectives carry (NCCL has none)."""


def process_group_backend(device: torch.device) -> str:
    """The default process group's backend for training on `device`."""
    return GPU_BACKEND if device.type == "cuda" else "gloo"


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory so far: allocated CUDA memory on a GPU, the peak resident
    set size (which includes the Python interpreter and libraries) on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def phase_peak_bytes(device: torch.device) -> int | None:
    """CUDA: the most memory tensors held since the previous call (or the process's start),
    after which the count starts anew; None elsewhere (a resident-set peak cannot be reset)."""
    if device.type != "cuda":
        return None
    peak = int(torch.cuda.max_memory_allocated(device))
    torch.cuda.reset_peak_memory_stats(device)
    return peak


def init_distributed(timeout_s: float = 120.0, store: dist.Store | None = None) -> DeviceMesh:
    """Join the process group described by the launcher's environment; one 1-D mesh.

    With `store`, rendezvous goes through it (each in-process restart brings a fresh key
    prefix); rank and world size still come from the launcher's environment."""
    device = training_device()
    backend = process_group_backend(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        from trainer.gpu_defaults import apply_nccl_environment

        apply_nccl_environment()  # read by NCCL and torch's watchdog when the group is made
    if not dist.is_initialized():
        diagnostics.enable_flight_recorder()  # read when the group is made
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


HSDP_DIMS = ("dp_replicate", "dp_shard")
STATE_BYTES_PER_PARAM = 16
"""fp32 parameter, gradient and AdamW's two moments: what a rank's shard of the state weighs."""


def mesh_shape(
    parallelism: ParallelismConfig,
    world: int,
    local_world: int,
    params: int,
    device_memory: int | None,
) -> tuple[int, int]:
    """(replicate, shard) degrees for `world` ranks, `local_world` per node: the settings
    when given (checked: their product is the world size), else auto (ParallelismConfig)."""
    replicate, shard = parallelism.dp_replicate, parallelism.dp_shard
    if replicate == 0 and shard == 0:
        nodes = world // local_world if local_world and world % local_world == 0 else 1
        fits = device_memory is None or params * STATE_BYTES_PER_PARAM / local_world <= device_memory / 2
        replicate = nodes if nodes > 1 and fits else 1
    elif replicate == 0:
        replicate = world // shard if world % shard == 0 else 0
    shard = shard or (world // replicate if replicate and world % replicate == 0 else 0)
    if not replicate or replicate * shard != world:
        raise ConfigError(
            f"parallelism.dp_replicate ({parallelism.dp_replicate or 'auto'}) x dp_shard "
            f"({parallelism.dp_shard or 'auto'}) must multiply to the world size, {world}: "
            "set degrees that divide it, or 0 (auto)"
        )
    return replicate, shard


def data_parallel_mesh(
    world_mesh: DeviceMesh, parallelism: ParallelismConfig, model: nn.Module, device: torch.device
) -> DeviceMesh:
    """The mesh to shard `model` over (built, unsharded, possibly on the meta device): the
    world's 1-D mesh, or a 2-D HSDP mesh whose groups a restart's abort shuts down too."""
    params = sum(p.numel() for p in model.parameters())
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    replicate, shard = mesh_shape(parallelism, dist.get_world_size(), env.local_world_size(), params, memory)
    if replicate == 1:
        return world_mesh
    with peer_abort.tracking():  # the sub-groups' connections, like the world group's
        return init_device_mesh(device.type, (replicate, shard), mesh_dim_names=HSDP_DIMS)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def compute_dtype(training: TrainingConfig, device: torch.device) -> torch.dtype:
    """The dtype forward and backward run in: `auto` is bf16 on CUDA and fp32 on CPU (where
    bf16 matmuls are slower and the bit-exact resume tests run)."""
    setting = training.mixed_precision
    if setting == "auto":
        setting = "bf16" if device.type == "cuda" else "fp32"
    return torch.bfloat16 if setting == "bf16" else torch.float32


def mixed_precision_policies(dtype: torch.dtype) -> tuple[MixedPrecisionPolicy, MixedPrecisionPolicy]:
    """(per-block policy, root policy) for computing in `dtype`. Gradients are always reduced
    in fp32 (summing bf16 gradients over ranks loses bits). The root returns the loss, which
    the spec computes in fp32 chunk by chunk: no output cast, which on logits would upcast the
    whole batch's at once."""
    if dtype == torch.float32:
        return MixedPrecisionPolicy(), MixedPrecisionPolicy()
    block = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    return block, block


def checkpointed_layers(n_layers: int, training: TrainingConfig) -> list[int]:
    """Indices of the decoder layers whose activations are recomputed in the backward pass."""
    # "auto" is decided before the ranks start (trainer.memory_plan.resolve_activation_checkpointing);
    # one still here (a CPU run, or a config written by hand) means none.
    if training.activation_checkpointing == "full":
        return list(range(n_layers))
    if training.activation_checkpointing == "every_n":
        return list(range(0, n_layers, training.activation_checkpointing_every))
    return []


def apply_activation_checkpointing(layer: nn.Module) -> None:
    """Recompute `layer`'s activations during backward (non-reentrant torch.utils.checkpoint).

    The layer's own `forward` is replaced rather than the layer wrapped in a
    CheckpointWrapper, so its parameter names stay the same. Under FSDP2 the layer's
    parameters are gathered again for the backward before the recomputation needs them."""
    from torch.utils.checkpoint import checkpoint

    layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)  # type: ignore[method-assign]


def apply_compile(layer: nn.Module) -> None:
    """torch.compile the layer's `forward` in place; names and FSDP's hooks stay outside.

    Not `nn.Module.compile()`, which wraps `Module._call_impl`: on torch 2.13 (CPU) a layer
    compiled that way captured no graph at all (dynamo's counters stayed empty)."""
    layer.forward = torch.compile(layer.forward)  # type: ignore[method-assign]


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    units: Sequence[nn.Module],
    training: TrainingConfig,
    device: torch.device,
) -> nn.Module:
    """Compile and checkpoint the decoder layers as `training` asks, then shard (`apply_fsdp`)
    with the mixed-precision policy for `device`."""
    # Compile first, then checkpoint around the compiled forward: the recomputation in the
    # backward pass runs the compiled code again.
    if training.compile:
        for unit in units:
            apply_compile(unit)
    for index in checkpointed_layers(len(units), training):
        apply_activation_checkpointing(units[index])
    return apply_fsdp(model, mesh, units, compute_dtype(training, device))


def apply_fsdp(
    model: nn.Module, mesh: DeviceMesh, units: Sequence[nn.Module], dtype: torch.dtype = torch.float32
) -> nn.Module:
    """Shard each of `units` (from `ModelSpec.fsdp_units`) as its own FSDP unit, then the root;
    compute runs in `dtype`, the sharded parameters stay as they are (fp32)."""
    block_policy, root_policy = mixed_precision_policies(dtype)
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=block_policy)
    # The root (embeddings, final norm, head) stays gathered from forward to backward: the
    # backward starts with the head and would gather it again at once. Said rather than left
    # to the default (torch 2.13: unset means reshard every unit but the one lazy init finds
    # to be the root), which a wrapper around the model would change.
    fully_shard(model, mesh=mesh, mp_policy=root_policy, reshard_after_forward=False)
    return model


def set_collective_timeout(timeout_s: float) -> None:
    """From here on a collective waits at most `timeout_s` for its peers. On CPU this bounds
    how long a rank sits in a gloo op after a peer failed (gloo ops cannot be aborted)."""
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s))
