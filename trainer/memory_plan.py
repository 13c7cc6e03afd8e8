"""Will this job fit? The per-rank GPU memory of a run, proven on CPU before a GPU is booked.

`plan_memory` traces one steady training step and one evaluation forward of rank 0 on fake
tensors (`trainer.memory_trace`: rtp's own model build, `parallelize`, loop step and AdamW
under torch's FSDPMemTracker) and compares the peak with what a GPU can give a run: its
memory less `margin_gib`. When the job does not fit, it re-plans with the changes an
operator would make, cheapest first (`FIX_ORDER`), and names the first that fits.

`rtp plan` prints it; the check step refuses a GPU run that cannot fit with it
(components/check_run); docs/performance.md ("Memory plan") has the figures for the
reference models.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.config import ActivationCheckpointing, ConfigError, TrainConfig

if TYPE_CHECKING:
    from trainer.memory_trace import StepTrace

GIB = 2**30

H100_GPU_GIB = 79.6
"""An 80 GB H100 as CUDA reports it (81,559 MiB); an H200 (141 GB) reports 140.4."""
RESERVED_GIB = 2.0
"""Held outside PyTorch's allocator, so outside the trace: the CUDA context and its kernels
(~0.5-1 GiB), cuBLAS workspaces and NCCL's communicator buffers (a few hundred MiB per
process group; HSDP has three)."""
WORKSPACE_SHARE = 0.10
"""Of the GPU's memory, for what the allocator holds but the trace does not count: the
caching allocator's fragmentation (small with expandable_segments, up to ~10% without) and
attention and matmul kernels' workspace (the trace runs CPU kernels). To be compared with
`torch.cuda.max_memory_allocated` on a GPU run."""
FIX_ORDER = (
    "activation checkpointing",
    "micro-batch",
    "HSDP layout",
    "more nodes",
)
"""Changes tried when a job does not fit, cheapest first, each on top of the ones before:
recompute activations (~1/3 more compute, no more hardware), halve the micro-batch (the
global batch stays: more accumulation steps), shard over more ranks (fewer HSDP replica
groups: more inter-node traffic), then double the nodes (FSDP over all of them). The first
that fits is named without the earlier changes it does not need (`_without_needless`)."""
MAX_NODE_DOUBLINGS = 4


def margin_gib(gpu_memory_gib: float) -> float:
    """What a plan leaves free on a GPU of `gpu_memory_gib` (RESERVED_GIB, WORKSPACE_SHARE)."""
    return RESERVED_GIB + WORKSPACE_SHARE * gpu_memory_gib


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """What is planned: a training config on `nnodes` x `gpus_per_node` GPUs."""

    config: TrainConfig
    nnodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_gib: float = H100_GPU_GIB

    @property
    def world(self) -> int:
        return self.nnodes * self.gpus_per_node

    def changed(self, **changes: Any) -> Job:
        """This job with `changes`: `nnodes`, or dotted config keys (`data.batch_size`)."""
        nnodes = changes.pop("nnodes", self.nnodes)
        config = TrainConfig.from_dict(self.config.to_dict())
        for key, value in changes.items():
            section, _, name = key.partition(".")
            setattr(getattr(config, section), name, value)
        return dataclasses.replace(self, config=config, nnodes=nnodes)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Fix:
    """The first change (FIX_ORDER) under which the job fits."""

    changes: dict[str, Any]
    """Config keys (and `nnodes`) with their new values."""
    description: str
    peak_gib: float


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MemoryPlan:
    job: Job
    trace: StepTrace
    elapsed_s: float
    fix: Fix | None = None
    tried: tuple[str, ...] = ()
    """The changes re-planned while looking for `fix`, in order."""

    @property
    def by_category(self) -> dict[str, float]:
        """GiB per rank: the training step's peak by category, the evaluation forward's need
        above the state resident at that time, and the host slots (host memory, not GPU)."""
        t = self.trace
        gib = {name: nbytes / GIB for name, nbytes in t.train_bytes.items()}
        gib["evaluation"] = max(0, t.eval_peak_bytes - t.eval_resident_bytes) / GIB
        gib["host_slots"] = self.host_gib_per_rank
        return gib

    @property
    def train_step_gib(self) -> float:
        return self.trace.train_peak_bytes / GIB

    @property
    def evaluation_gib(self) -> float:
        return self.trace.eval_peak_bytes / GIB

    @property
    def peak_gib(self) -> float:
        """The rank's GPU peak: the larger of the training step and the evaluation forward."""
        return max(self.train_step_gib, self.evaluation_gib)

    @property
    def margin_gib(self) -> float:
        return margin_gib(self.job.gpu_memory_gib)

    @property
    def usable_gib(self) -> float:
        return self.job.gpu_memory_gib - self.margin_gib

    @property
    def fits(self) -> bool:
        return self.peak_gib <= self.usable_gib

    @property
    def host_gib_per_rank(self) -> float:
        return self.trace.host_slots * self.trace.host_capture_bytes / GIB

    def to_dict(self) -> dict[str, Any]:
        c = self.job.config
        return {
            "peak_gib": round(self.peak_gib, 2),
            "fits": self.fits,
            "by_category": {name: round(value, 2) for name, value in self.by_category.items()},
            "phases_gib": {
                "train_step": round(self.train_step_gib, 2),
                "evaluation": round(self.evaluation_gib, 2),
            },
            "gpu_memory_gib": self.job.gpu_memory_gib,
            "margin_gib": round(self.margin_gib, 2),
            "usable_gib": round(self.usable_gib, 2),
            "host": {
                "slots": self.trace.host_slots,
                "capture_gib": round(self.trace.host_capture_bytes / GIB, 2),
                "per_rank_gib": round(self.host_gib_per_rank, 2),
                "per_node_gib": round(self.host_gib_per_rank * self.job.gpus_per_node, 2),
            },
            "job": {
                "model": c.model.kind,
                "parameters": self.trace.parameters,
                "nnodes": self.job.nnodes,
                "gpus_per_node": self.job.gpus_per_node,
                "mesh": list(self.trace.mesh),
                "seq_len": c.model.seq_len,
                "batch_size": c.data.batch_size,
                "global_batch": c.data.global_batch or c.data.batch_size * self.job.world,
                "micro_batches": self.trace.micro_batches,
                "eval_rows": self.trace.eval_rows,
                "activation_checkpointing": c.training.activation_checkpointing,
                "mixed_precision": "fp32" if c.training.mixed_precision == "fp32" else "bf16",
            },
            "fix": None if self.fix is None else dataclasses.asdict(self.fix),
            "tried": list(self.tried),
            "elapsed_s": round(self.elapsed_s, 1),
        }

    def verdict(self) -> str:
        """One line: fits or not, and the cheapest change that makes it fit."""
        head = (
            f"{self.peak_gib:.1f} GiB per GPU of {self.usable_gib:.1f} usable "
            f"({self.job.gpu_memory_gib:g} GiB less a {self.margin_gib:.1f} GiB margin)"
        )
        if self.fits:
            return f"fits: {head}"
        if self.fix is not None:
            return f"does not fit: {head}; cheapest change that fits: {self.fix.description} ({self.fix.peak_gib:.1f} GiB)"
        tried = f" (tried: {', '.join(self.tried)})" if self.tried else ""
        return f"does not fit: {head}; no change tried fits{tried}: use a smaller model or larger GPUs"


def plan_memory(job: Job, *, find_fix: bool = True) -> MemoryPlan:
    """Trace `job`; when it does not fit (and `find_fix`), re-plan with FIX_ORDER's changes.

    `training.activation_checkpointing` may be "auto": none when the job fits so, else full."""
    started = time.perf_counter()
    auto = job.config.training.activation_checkpointing == "auto"
    if auto:
        job = job.changed(**{"training.activation_checkpointing": "none"})
    plan = _plan_once(job)
    if plan.fits or not find_fix:
        return plan
    tried: list[str] = []
    for rungs in _fixes(job, plan.trace.mesh):
        tried.append(_described(rungs))
        candidate = _plan_with(job, rungs)
        if candidate is None or not candidate.fits:
            continue
        rungs, candidate = _without_needless(job, rungs, candidate)
        elapsed_s = time.perf_counter() - started
        if auto and list(rungs) == ["recompute"]:  # what auto chooses
            return dataclasses.replace(candidate, tried=tuple(tried), elapsed_s=elapsed_s)
        fix = Fix(
            changes=_merged(rungs), description=_described(rungs), peak_gib=round(candidate.peak_gib, 2)
        )
        return dataclasses.replace(plan, fix=fix, tried=tuple(tried), elapsed_s=elapsed_s)
    return dataclasses.replace(plan, tried=tuple(tried), elapsed_s=time.perf_counter() - started)


Rungs = dict[str, tuple[str, dict[str, Any]]]
"""kind of change -> (description, config changes), in FIX_ORDER."""


def _merged(rungs: Rungs) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    for _, rung_changes in rungs.values():
        changes.update(rung_changes)
    return changes


def _described(rungs: Rungs) -> str:
    return " + ".join(text for text, _ in rungs.values())


def _plan_with(job: Job, rungs: Rungs) -> MemoryPlan | None:
    """The plan under `rungs`; None when they make no valid job (a global batch the ranks cannot split)."""
    try:
        return _plan_once(job.changed(**_merged(rungs)))
    except ConfigError:
        return None


def _without_needless(job: Job, rungs: Rungs, plan: MemoryPlan) -> tuple[Rungs, MemoryPlan]:
    """Drop the earlier changes a fitting plan does not need (more nodes alone may fit where
    recomputing activations did not help), so the change named is the smallest found."""
    for kind in list(rungs)[:-1]:
        fewer = {k: v for k, v in rungs.items() if k != kind}
        candidate = _plan_with(job, fewer)
        if candidate is not None and candidate.fits:
            rungs, plan = fewer, candidate
    return rungs, plan


def _plan_once(job: Job) -> MemoryPlan:
    from trainer.memory_trace import trace_step  # torch: not when the CLI only builds its parser

    started = time.perf_counter()
    trace = trace_step(job.config, job.nnodes, job.gpus_per_node, int(job.gpu_memory_gib * GIB))
    return MemoryPlan(job=job, trace=trace, elapsed_s=time.perf_counter() - started)


def _fixes(job: Job, mesh: tuple[int, ...]) -> Iterator[Rungs]:
    """The changes of FIX_ORDER, cumulatively: each yield keeps the rungs before it."""
    c = job.config
    rungs: Rungs = {}

    def rung(kind: str, text: str, **changes: Any) -> Rungs:
        rungs[kind] = (text, changes)
        return dict(rungs)

    if c.training.activation_checkpointing != "full":
        yield rung(
            "recompute", "activation checkpointing full", **{"training.activation_checkpointing": "full"}
        )
    global_batch = c.data.global_batch or c.data.batch_size * job.world
    batch = c.data.batch_size
    while batch > 1:
        batch //= 2
        yield rung(
            "micro-batch",
            f"micro-batch {batch} (global batch {global_batch} kept)",
            **{"data.batch_size": batch, "data.global_batch": global_batch},
        )
    replicate = mesh[0] if len(mesh) == 2 else 1
    while replicate > 1:
        replicate //= 2
        text = f"HSDP with {replicate} replica groups" if replicate > 1 else "FSDP over all ranks (no HSDP)"
        yield rung("layout", text, **{"parallelism.dp_replicate": replicate, "parallelism.dp_shard": 0})
    fixed_batch = global_batch if batch != c.data.batch_size else c.data.global_batch
    nnodes = job.nnodes
    for _ in range(MAX_NODE_DOUBLINGS):
        nnodes *= 2
        if fixed_batch and fixed_batch % (batch * nnodes * job.gpus_per_node):
            return  # the global batch cannot be split over that many ranks
        yield rung(
            "nodes",
            f"{nnodes} nodes (FSDP over all ranks)",
            nnodes=nnodes,
            **{"parallelism.dp_replicate": 1, "parallelism.dp_shard": 0},
        )


def check_fits(job: Job) -> MemoryPlan:
    """The plan of `job`; ConfigError, in one line, when it cannot fit (the check step's call)."""
    plan = plan_memory(job)
    if not plan.fits:
        raise ConfigError(f"memory plan: {plan.verdict()}")
    return plan


@contextlib.contextmanager
def model_settings(path: str | Path) -> Iterator[tuple[dict[str, Any], list[str]]]:
    """(named settings, overrides) that select the model `path` describes, for the plan's lifetime.

    `path` is a Hugging Face config.json (or a folder holding one: `hf`; a file is given a
    folder of its own, which the `hf` registry entry reads), or a byte LM config.json (its
    vocab_size, d_model, n_layers, n_heads: `byte-lm`), or a registered byte LM folder."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the model config {file}: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file} is not a JSON object: give a model's config.json")
    if "model_type" not in raw:
        byte_lm = ("vocab_size", "d_model", "n_layers", "n_heads")
        missing = [key for key in byte_lm if key not in raw]
        if missing:
            raise ConfigError(
                f"{file} is neither a Hugging Face config.json (no model_type) nor a byte LM config "
                f"(missing {', '.join(missing)})"
            )
        yield {}, ["model.kind=byte-lm", *(f"model.{key}={raw[key]}" for key in byte_lm)]
        return
    if path.is_dir():
        yield {"model_dir": str(path)}, []
        return
    with tempfile.TemporaryDirectory(prefix="rtp-plan-") as folder:
        shutil.copyfile(file, Path(folder) / "config.json")
        yield {"model_dir": folder}, []


def resolve_activation_checkpointing(
    config: TrainConfig, *, gpu_memory_gib: float | None, nnodes: int, gpus_per_node: int
) -> tuple[TrainConfig, str]:
    """`training.activation_checkpointing=auto` made a decision, with the reason in a line:
    none on CPU (`gpu_memory_gib` None); on GPUs none when the plan fits without it, else full.
    Any other setting is returned as it is."""
    if config.training.activation_checkpointing != "auto":
        return config, ""
    resolved = TrainConfig.from_dict(config.to_dict())
    if gpu_memory_gib is None or gpus_per_node < 1:
        resolved.training.activation_checkpointing = "none"
        return resolved, "activation checkpointing auto: none (no GPU memory to fit)"
    job = Job(config=resolved, nnodes=nnodes, gpus_per_node=gpus_per_node, gpu_memory_gib=gpu_memory_gib)
    plan = plan_memory(job.changed(**{"training.activation_checkpointing": "none"}), find_fix=False)
    chosen: ActivationCheckpointing = "none"
    if not plan.fits:
        chosen = "full"
        plan = plan_memory(job.changed(**{"training.activation_checkpointing": "full"}), find_fix=False)
    resolved.training.activation_checkpointing = chosen
    return resolved, f"activation checkpointing auto: {chosen} (with it, {plan.verdict()})"
