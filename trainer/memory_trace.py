"""One training step of one rank, traced on fake tensors: the bytes each kind of state needs.

`trace_step` builds the model with the registry's own spec, shards it with rtp's own
`parallelize` over a fake process group of the job's world size, and runs what a rank runs —
the loop's `accumulate_gradients` over the step's micro-batches, gradient clipping, AdamW's
step, one evaluation forward of the rows rtp scores at once, and the fast tier's host capture
plan — under torch's `FSDPMemTracker` inside `FakeTensorMode`. Nothing is allocated: an 8B
model on 8 ranks is traced in one CPU process in well under a minute. The tracker sizes the
tensors a GPU rank would hold; what it cannot see (CUDA context, kernel workspace, NCCL
buffers, allocator fragmentation) is the margin `trainer.memory_plan` keeps.

The trace runs on the "cpu" device with the GPU run's compute dtype (bf16 on CUDA): a fake
"cuda" device needs a CUDA build of torch (docs/performance.md, "rtp plan"). It needs a
process of its own: it creates and destroys the default process group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.config import ConfigError, TrainConfig

TRAIN_CATEGORIES = {
    "parameters": ("Sharded Param", "Unsharded Param", "Buffer"),
    "gradients": ("Sharded Grad", "Unsharded Grad"),
    "optimizer_state": ("OptState",),
    "activations": ("Activation",),
    "temporaries": ("Temp", "All Gather", "Reduce Scatter", "Inputs"),
}
"""The plan's categories, from the tracker's reference types (torch's `_FSDPRefType` values)."""
TRACED_MICRO_BATCHES = 2
"""Micro-batches traced at most: a rank's memory after the second equals that after the
N-th (whatever accumulates — gradients — is at its full size after the first), and each
traced micro-batch costs a forward and backward of CPU time."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepTrace:
    """Bytes one rank holds, from the tracker's peak snapshots."""

    parameters: int
    """Elements of the whole model's parameters."""
    world: int
    mesh: tuple[int, ...]
    """(shard,) for FSDP, (replicate, shard) for HSDP."""
    micro_batches: int
    """Per rank per optimizer step (the trace runs at most TRACED_MICRO_BATCHES of them)."""
    train_bytes: dict[str, int]
    """TRAIN_CATEGORIES at the training step's peak."""
    eval_rows: int
    """Rows of the evaluation forward (0: the run scores no holdout)."""
    eval_peak_bytes: int
    """Peak of the evaluation forward, everything resident included."""
    eval_resident_bytes: int
    """What was resident when it started (parameters, optimizer state)."""
    host_capture_bytes: int
    """One host copy of this rank's shards of the training state (parameters and AdamW
    moments), as the fast tier lays it out."""
    host_slots: int
    """How many such copies the rank keeps in host memory: the fast tier's two slots (one
    when only `async` saves use it), plus the peers' replicas it holds."""

    allocator_peak_bytes: int | None = None
    """Real tensors only (`fake=False`): the CPU allocator's peak during the training step."""

    @property
    def train_peak_bytes(self) -> int:
        return sum(self.train_bytes.values())


@contextlib.contextmanager
def _fake_process_group(world: int) -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "the memory plan creates its own (fake) process group: run it in a process of its own, "
            "not inside a training rank"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _tracked_dtensor_ops() -> Iterator[None]:
    """Keep DTensor's shape propagation out of the tracker's figures under FakeTensorMode.

    torch 2.13's ShardingPropagator builds global-shape tensors in `detect_fake_mode() or
    FakeTensorMode()` (torch/distributed/tensor/_sharding_prop.py, `_propagate_tensor_meta_non_cached`);
    MemTracker skips them only when that mode is not the one active at its entry
    (mem_tracker.py, `active_fake_mode() is self._fake_mode_on_entry`). Under our FakeTensorMode
    the propagator reuses it, so every DTensor op (clipping, AdamW) counts the *unsharded*
    tensors: AdamW's foreach step of an 8B model on 8 ranks read as 101 GiB. A fresh mode per
    propagation is what eager mode gets. tests/unit/test_memory_plan.py tells when upstream no
    longer needs this."""
    from torch.distributed.tensor import _sharding_prop

    original = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = original


@contextlib.contextmanager
def _forward_methods_through_call() -> Iterator[None]:
    """Run a method registered with `register_fsdp_forward_method` (the loss, trainer/models/spec.py
    `run_as_forward`) as the module's `__call__`, so the tracker sees it.

    torch 2.13's FSDPMemTracker wraps the FSDP forward *hooks* (fsdp2_mem_tracker.py,
    `_instrument_fsdp_module`) and ModTracker learns a module at `__call__`; a registered method
    calls `FSDPState._pre_forward` directly (_fully_shard.py, `wrapped_method`), so the root's
    backward hook finds no statistics (KeyError in `_fsdp_param_group_pre_backward`). Through
    `__call__` the same FSDP pre- and post-forward run around the same computation."""
    from torch.distributed import fsdp
    from torch.distributed.fsdp import FSDPModule

    def register(module: nn.Module, method_name: str) -> None:
        if not isinstance(module, FSDPModule):
            return
        method = getattr(module, method_name)

        def through_call(*args: Any, **kwargs: Any) -> Any:
            module.forward = lambda: method(*args, **kwargs)  # type: ignore[method-assign]
            try:
                return module()
            finally:
                del module.forward

        setattr(module, method_name, through_call)

    holders = [fsdp, *(m for m in [sys.modules.get("trainer.models.spec")] if m is not None)]
    saved = [(holder, holder.__dict__.get("register_fsdp_forward_method")) for holder in holders]
    for holder, original in saved:
        if original is not None:
            holder.register_fsdp_forward_method = register  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for holder, original in saved:
            if original is not None:
                holder.register_fsdp_forward_method = original  # type: ignore[attr-defined]


class _ResettingSpec:
    """The model spec, with the tracker's per-module statistics cleared before each forward:
    FSDPMemTracker refuses a second root forward (a second micro-batch) otherwise. Its
    running and peak totals are kept."""

    def __init__(self, spec: Any, tracker: Any) -> None:
        self._spec, self._tracker = spec, tracker

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        self._tracker.reset_mod_stats()
        loss: torch.Tensor = self._spec.loss(model, batch)
        return loss

    def __getattr__(self, name: str) -> Any:
        return getattr(self._spec, name)


def _categories(snapshot: dict[Any, dict[Any, int]]) -> dict[str, int]:
    by_type: dict[str, int] = {}
    for device_snapshot in snapshot.values():
        for kind, nbytes in device_snapshot.items():
            name = getattr(kind, "value", kind)
            by_type[name] = by_type.get(name, 0) + nbytes
    return {category: sum(by_type.get(t, 0) for t in types) for category, types in TRAIN_CATEGORIES.items()}


def _total(snapshot: dict[Any, dict[Any, int]]) -> int:
    return sum(device_snapshot.get("Total", 0) for device_snapshot in snapshot.values())


def optimizer_for(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW as the loop builds it (trainer/loop.py `_build_model`). foreach=True is what
    AdamW's default picks for CUDA tensors (its for-loop on CPU tensors allocates less)."""
    opt = config.optimizer
    return torch.optim.AdamW(model.parameters(), lr=opt.lr, weight_decay=opt.weight_decay, foreach=True)


def _initialize_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's moments as the first step does, so the traced step is a steady one (the
    first step's forward and backward run before the moments exist)."""
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def eval_rows(config: TrainConfig) -> int:
    """Rows of one evaluation forward, as the ranks score the holdout: the first batch of
    `holdout_batches` (over a holdout long enough for `data.eval_windows` windows) split into
    forwards of `eval_rows_per_forward` rows; 0 when the run scores no holdout."""
    from trainer.data import holdout_batches
    from trainer.evaluation import eval_rows_per_forward

    windows = config.data.eval_windows
    if windows < 1:
        return 0
    window = config.model.seq_len + 1
    tokens = torch.zeros(windows * window + 1, dtype=torch.int32)
    batch_rows = int(holdout_batches(tokens, config.model.seq_len, max_windows=windows)[0].shape[0])
    return min(batch_rows, eval_rows_per_forward(config))


def _host_slots(config: TrainConfig) -> int:
    """Host copies of a rank's state the checkpointing keeps (trainer/checkpointing/local_tier.py):
    two slots with the fast tier on, one when only `async` saves capture, and each peer's
    replica it holds (`checkpoint.local_replicas`)."""
    ckpt = config.checkpoint
    tier_on = ckpt.local_every_steps != 0
    slots = 2 if tier_on else 1 if ckpt.mode == "async" else 0
    return slots + (ckpt.local_replicas if tier_on else 0)


def trace_step(
    config: TrainConfig, nnodes: int, gpus_per_node: int, gpu_memory_bytes: int, *, fake: bool = True
) -> StepTrace:
    """Trace one step of rank 0 of an `nnodes` x `gpus_per_node` job training `config`.

    The layout is rtp's own (`parallelize.mesh_shape`: `parallelism.dp_replicate`, or auto);
    compute is bf16 unless the config asks for fp32; activation checkpointing as configured.
    `fake=False` runs the same step on real CPU tensors (a small model only) and also reports
    the CPU allocator's own peak: how the plan is checked (tests/unit/test_memory_plan.py)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainer.data import accumulation_steps
    from trainer.models import model_spec

    world = nnodes * gpus_per_node
    if world < 1:
        raise ConfigError(
            "the memory plan needs at least one GPU: give --nnodes and --gpus-per-node of 1 or more"
        )
    config = TrainConfig.from_dict(config.to_dict())
    if config.training.mixed_precision == "auto":
        config.training.mixed_precision = "bf16"  # what `auto` is on CUDA
    config.training.compile = False  # eager: the activations compile would save are not counted
    global_batch = config.data.global_batch or config.data.batch_size * world
    accumulation = accumulation_steps(global_batch, config.data.batch_size, world)
    spec = model_spec(config.model.kind)
    rows = eval_rows(config)  # real tokens: before the fake mode
    mode: Any = FakeTensorMode() if fake else contextlib.nullcontext()
    with _fake_process_group(world), _tracked_dtensor_ops(), _forward_methods_through_call():
        model, optimizer, mesh = _sharded_model(spec, config, gpus_per_node, gpu_memory_bytes, mode)
        with mode:
            train_bytes, allocator_peak = _trace_train_step(
                spec, model, optimizer, config, min(accumulation, TRACED_MICRO_BATCHES), measure=not fake
            )
            host_capture = _host_capture_bytes(model, optimizer)
            eval_peak, eval_resident = _trace_eval_forward(spec, model, optimizer, config, rows)
    return StepTrace(
        parameters=sum(p.numel() for p in model.parameters()),
        world=world,
        mesh=mesh,
        micro_batches=accumulation,
        train_bytes=train_bytes,
        eval_rows=rows,
        eval_peak_bytes=eval_peak,
        eval_resident_bytes=eval_resident,
        host_capture_bytes=host_capture,
        host_slots=_host_slots(config),
        allocator_peak_bytes=allocator_peak,
    )


def _sharded_model(
    spec: Any, config: TrainConfig, gpus_per_node: int, gpu_memory_bytes: int, mode: Any
) -> tuple[nn.Module, torch.optim.Optimizer, tuple[int, ...]]:
    """The model built, laid out and sharded as a training rank does it, with AdamW's moments."""
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.parallelize import HSDP_DIMS, mesh_shape, parallelize

    device, world = torch.device("cpu"), dist.get_world_size()
    with mode:
        # Shapes only, whatever the kind: a model built on a device under FakeTensorMode cannot
        # be moved (`.to` swaps tensors the fake mode holds weak references to).
        model = spec.build(config.model, torch.device("meta"))
    params = sum(p.numel() for p in model.parameters())
    replicate, shard = mesh_shape(config.parallelism, world, gpus_per_node, params, gpu_memory_bytes)
    # The mesh before the fake mode: built inside it, it reads a fake tensor's values.
    layout: tuple[int, ...] = (world,) if replicate == 1 else (replicate, shard)
    names = HSDP_DIMS if replicate > 1 else None
    mesh = init_device_mesh("cpu", layout, mesh_dim_names=names)
    with mode:
        parallelize(model, mesh, spec.fsdp_units(model), config.training, device)
        model.to_empty(device=device)  # no weights are drawn or read: memory does not depend on them
        optimizer = optimizer_for(model, config)
        _initialize_optimizer_state(model, optimizer)
    return model, optimizer, layout


def _trace_train_step(
    spec: Any,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: TrainConfig,
    micro_batches: int,
    *,
    measure: bool,
) -> tuple[dict[str, int], int | None]:
    """The training step's peak by category; with `measure`, also the CPU allocator's peak."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from trainer.loop import accumulate_gradients

    batch = torch.zeros((config.data.batch_size, config.model.seq_len + 1), dtype=torch.long)
    tracker = FSDPMemTracker(model, optimizer)
    allocator = _AllocatorPeak(model, optimizer, batch) if measure else contextlib.nullcontext()
    with allocator, tracker:
        step_spec = spec if micro_batches < 2 else _ResettingSpec(spec, tracker)
        accumulate_gradients(step_spec, model, [batch] * micro_batches, torch.device("cpu"))
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.optimizer.grad_clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    peak = allocator.peak_bytes if isinstance(allocator, _AllocatorPeak) else None
    return _categories(tracker.get_tracker_snapshot("peak")), peak


def _host_capture_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """One fast-tier slot of this rank: its parameter and optimizer shards as the tier lays them out."""
    from trainer.checkpointing import plan_state

    return plan_state(list(model.parameters()), optimizer, {}, None)[0].size


def _trace_eval_forward(
    spec: Any, model: nn.Module, optimizer: torch.optim.Optimizer, config: TrainConfig, rows: int
) -> tuple[int, int]:
    """(peak, resident at its start) of one evaluation forward of `rows` windows, as
    `trainer.evaluation.score_windows` runs it (eval mode, no gradients)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    if not rows:
        return 0, 0
    batch = torch.zeros((rows, config.model.seq_len + 1), dtype=torch.long)
    tracker = FSDPMemTracker(model, optimizer)
    with tracker, torch.no_grad():
        resident = _total(tracker.get_tracker_snapshot("current"))
        model.eval()
        spec.loss(model, batch)
        model.train()
    return _total(tracker.get_tracker_snapshot("peak")), resident


class _AllocatorPeak:
    """The CPU allocator's peak during a block, from torch.profiler's memory events (every
    allocation and free the allocator reports), on top of the bytes resident at its start:
    a measure independent of the tracker's, for real tensors."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> None:
        tensors = [*model.parameters(), *model.buffers(), batch]
        tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
        storages = {}
        for tensor in tensors:
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
        self.resident_bytes = sum(storages.values())
        self.peak_bytes = self.resident_bytes
        self._profile: Any = None

    def __enter__(self) -> _AllocatorPeak:
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._profile.__exit__(*exc)
        events = sorted(
            (event.start_ns(), event.nbytes())
            for event in self._profile.profiler.kineto_results.events()
            if event.name() == "[memory]"
        )
        running = highest = 0
        for _, nbytes in events:
            running += nbytes
            highest = max(highest, running)
        self.peak_bytes = self.resident_bytes + highest
