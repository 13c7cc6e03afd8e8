"""The training loop of one rank: `Trainer`, built per attempt, with `train()`, `train_step()`
and `close()`.

Everything distributed — model shards, optimizer, sampler, the checkpoint writer — is
created by `Trainer(...)`, so a restart (a new Trainer) starts from a clean slate and the
latest committed checkpoint. The loop is deterministic on CPU for a given seed and world
size: a run stopped after a checkpoint and resumed reaches the same weights as one that
never stopped, whatever the checkpoint mode. Checkpoint policy (resume, when to save, what
a save holds) is `trainer.checkpointing.CheckpointManager`'s; the loop makes its four calls:
`load()` at start-up, `maybe_wait_for_staging()` and `save()` every step, `close()`.
What is not the step's math plugs in around it: the loop extensions of
trainer/step_callbacks.py (straggler detection, periodic evaluation, gradient-norm spikes),
`Callback.on_step_end` after each step (the resilience layers' watchdog pings and
heartbeats), `Progress` (log line, live metrics),
`FaultInjector` (drills), `_StartupClock` (start-up phases), `_publish` (rank 0's summary,
goodput report and MLflow figures).

SIGTERM (pod eviction, preemption, `kubectl delete`) does not kill the loop: the ranks
agree on it at the next step, write a final checkpoint, and exit cleanly, so the
Kubernetes grace period is spent saving instead of losing the steps since the last save.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import math
import signal
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from trainer import peer_abort, step_callbacks, waiting
from trainer.checkpointing import CheckpointManager, forget_rank, local_folder, model_sha256, resume_expected
from trainer.config import OptimizerConfig, TrainConfig
from trainer.data import DataError, StepSampler, check_tokenizer, load_tokens, split_files
from trainer.determinism import apply_determinism
from trainer.events import EventLog
from trainer.examples_data import ExampleBatch, ExampleSampler, masked_loss
from trainer.faults import FaultInjector, parse_faults
from trainer.gpu_defaults import check_timeouts
from trainer.hooks import Attempt, Callback, StepResult, TrainHooks
from trainer.link_check import SlowInterconnect, check_links
from trainer.lora import apply_method
from trainer.models import model_spec
from trainer.parallelize import (
    compute_dtype,
    data_parallel_mesh,
    init_distributed,
    parallelize,
    peak_memory_bytes,
    phase_peak_bytes,
    set_collective_timeout,
    training_device,
)
from trainer.progress import Progress
from trainer.summary import TrainSummary
from trainer.timeouts import watchdog_timeouts

log = logging.getLogger(__name__)


def lr_factor(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine decay to `min_ratio` at `total_steps`."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def accumulate_gradients(
    spec: Any,
    model: torch.nn.Module,
    micro_batches: Sequence[torch.Tensor | ExampleBatch],
    device: torch.device,
) -> torch.Tensor:
    """Forward and backward over a step's micro-batches; returns this rank's mean loss.

    Every micro-batch's backward reduce-scatters its gradients into the sharded ones, which
    FSDP2 sums, so a rank never keeps the whole model's unsharded gradients between
    micro-batches. Under HSDP the all-reduce across replica groups waits for the last
    micro-batch (FSDP2 keeps the partial sum sharded meantime); a 1-D mesh has none to skip.
    The sum, averaged over the ranks by FSDP, is the mean over the global batch."""
    loss = torch.zeros((), device=device)
    for index, micro_batch in enumerate(micro_batches):
        cast(FSDPModule, model).set_requires_all_reduce(index == len(micro_batches) - 1)
        on_device = to_training_device(micro_batch, device)
        if isinstance(on_device, ExampleBatch):  # data.format=examples: its share of the global mean
            micro_loss = masked_loss(model, on_device)
        else:
            micro_loss = spec.loss(model, on_device) / len(micro_batches)
        micro_loss.backward()
        loss += micro_loss.detach()
    return loss


def to_training_device(
    batch: torch.Tensor | ExampleBatch, device: torch.device
) -> torch.Tensor | ExampleBatch:
    """A micro-batch on the training device. On CUDA it is copied from pinned host memory
    without blocking the host: the copy is queued on the stream ahead of the forward that
    reads it (from pageable memory a "non-blocking" copy is a synchronous one)."""
    if device.type != "cuda":
        return batch.to(device)
    pinned = batch.pin_memory()
    if isinstance(pinned, ExampleBatch):
        return pinned.to(device)  # its tensors' copies are non-blocking
    return pinned.to(device, non_blocking=True)


def build_optimizer(
    params: Iterable[torch.nn.Parameter], optimizer: OptimizerConfig, device: torch.device
) -> torch.optim.AdamW:
    """AdamW as every rtp loop builds it. On CUDA its fused kernel: one launch per step for
    all of a rank's shards (FSDP2's DTensors included) instead of foreach's several per
    operation with their intermediate lists. On CPU the default implementation, which the
    bit-exact resume tests were written against."""
    fused = True if device.type == "cuda" else None  # None: torch's own choice
    return torch.optim.AdamW(params, lr=optimizer.lr, weight_decay=optimizer.weight_decay, fused=fused)


def _gathered_norm(norm: torch.Tensor) -> float:
    """The total grad norm as a number. Under FSDP2 it may be a DTensor: every rank calls
    this on the same steps, so gathering it is a collective all ranks take part in."""
    full = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return float(full.detach().float().cpu().item())


class _StopRequest:
    """Remembers a SIGTERM until the ranks agree to act on it at a step boundary."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def install(self) -> None:
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


class _StartupClock:
    """Seconds of each start-up phase, for the `resumed` event (goodput's start-up split)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.phases: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        mark = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = time.perf_counter() - mark


def _freeze_startup_objects(attempt: Attempt) -> None:
    """Leave what start-up built (millions of objects, alive for the whole attempt) out of
    the garbage collector's full passes, which would pause the loop to scan it.

    After an in-process restart, unfreeze first so the previous attempt's cyclic garbage is
    freed; not on a process's first attempt: a rank forked from the zygote shares its frozen
    objects, and a pass over them would copy every page they live on."""
    if attempt.inprocess_iteration > 0:
        gc.unfreeze()
    gc.collect()
    gc.freeze()


class Trainer:
    """One attempt of one rank; collective: every rank builds one and calls `train()`.

    `store`: the rendezvous store of this attempt (trainer/resilience.py gives each attempt a
    fresh key prefix); `hooks`: the resilience layers' callbacks; `callbacks`: more
    `on_step_end` listeners, called before the hooks'. Use as a context manager: `close()`
    releases the checkpoint writer when the attempt ends by an exception."""

    sampler: StepSampler | ExampleSampler  # data.format tokens or examples

    def __init__(
        self,
        config: TrainConfig,
        store: dist.Store | None = None,
        hooks: TrainHooks | None = None,
        callbacks: Sequence[Callback] = (),
    ) -> None:
        self.config = config
        self.hooks = hooks or TrainHooks()
        self.callbacks: list[Callback] = [*callbacks, self.hooks]
        self.attempt = self.hooks.attempt()
        self.clock = _StartupClock()
        self.checkpoints: CheckpointManager | None = None
        self._checkpoints_open = False
        self._stop = _StopRequest()
        device = training_device()
        check_timeouts(config.resilience, device.type)
        apply_determinism(config.training, cuda=device.type == "cuda")  # before NCCL and cuBLAS start
        # An in-process restart interrupts the previous attempt with an asynchronous exception,
        # which can land inside a `torch.no_grad()` block before its exit restores grad mode;
        # grad mode is per thread and part of the clean slate each attempt starts from.
        torch.set_grad_enabled(True)
        attempt_started_at = time.time()
        with self.clock.phase("process_group_s"), peer_abort.tracking():  # a restart shuts these down at once
            mesh = init_distributed(config.resilience.collective_timeout_s, store)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = device
        self.workdir = Path(config.run.workdir)
        self.progress = Progress(config, self.rank, self.world)
        self.events = EventLog(self.workdir, enabled=self.rank == 0, listener=self.progress.on_event)
        self.events.emit(
            "attempt_start", at=attempt_started_at, world_size=self.world, **self.attempt.as_dict()
        )
        if not self.attempt.inprocess_iteration:  # an in-process restart keeps the same links
            self._check_links()
        self.injector = FaultInjector(
            parse_faults(config.run.faults),
            self.workdir,
            self.rank,
            self.world,
            slow_save_s=2 * watchdog_timeouts(config.resilience)[0],
            lose_node=functools.partial(
                forget_rank,
                local_folder(config.checkpoint.local_dir, config.checkpoint_dir()),
                dist.get_rank(),
            ),
        )
        # At 8B reading or drawing the weights outlasts the launcher's heartbeat timeout.
        with self.clock.phase("model_build_s"), self.hooks.keepalive():
            self._build_model(mesh)
        # The loop extensions the config turns on (straggler detection, periodic evaluation, ...).
        self.extensions = step_callbacks.build(
            step_callbacks.LoopContext(
                config,
                self.rank,
                self.world,
                device,
                self.model,
                self.events,
                self.progress,
                self.hooks.keepalive,
            )
        )
        self.callbacks[:0] = self.extensions.values()  # before the given ones and the hooks
        with self.clock.phase("loader_s"):
            self._build_sampler()
        self.losses: list[tuple[int, float]] = []
        self.steps_run = 0
        self.step_seconds = 0.0
        try:
            self.checkpoints = CheckpointManager(
                config,
                model=self.model,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                sampler=self.sampler,
                hooks=self.hooks,
                events=self.events,
                states=self.hooks.checkpoint_states(),
                on_queued=self.injector.after_checkpoint_queued,
                during_save=self.injector.during_save,
            )
            self._checkpoints_open = True
            self.last_step = self.checkpoints.load(
                background=self.attempt.is_restart,  # a restart needs its first step soon
                init_trained=functools.partial(
                    self.spec.init_trained, self.model, config.model, device, config.run.seed
                )
                if self.restoring
                else None,
            )
        except BaseException:
            self.close()
            raise
        self.clock.phases["checkpoint_load_s"] = self.checkpoints.load_s
        self.clock.phases["checkpointer_start_s"] = self.checkpoints.start_s

    def _check_links(self) -> None:
        r = self.config.resilience
        with self.clock.phase("link_check_s"):
            link = check_links(r.allreduce_check_mib, r.min_allreduce_gbps, self.device)
        if link is None:
            return
        self.events.emit("link_check", **link.as_dict())
        if self.rank == 0:
            log.info("link check: %s", link.line())
        if link.too_slow:
            raise SlowInterconnect(link.refusal())

    def _build_model(self, mesh: Any) -> None:
        config, device = self.config, self.device
        self.spec = model_spec(config.model.kind)
        # A resume overwrites the trained weights: then none are read or drawn here.
        self.restoring = resume_expected(config, self.hooks.capture_cache())
        # training.method=lora: peft's adapters go in before sharding, the base frozen.
        self.model = apply_method(
            self.spec.build_for_training(config.model, device, config.run.seed, weights=not self.restoring),
            config.training,
        )
        mesh = data_parallel_mesh(mesh, config.parallelism, self.model, device)
        parallelize(self.model, mesh, self.spec.fsdp_units(self.model), config.training, device)
        self.events.emit("parallelism", mesh=list(mesh.shape), dims=list(mesh.mesh_dim_names or ("dp",)))
        if self.rank == 0:
            dtype = str(compute_dtype(config.training, device)).removeprefix("torch.")
            log.info("compute dtype %s, data-parallel mesh %s", dtype, "x".join(map(str, list(mesh.shape))))
        init = self.spec.init_for_resume if self.restoring else self.spec.init_weights
        init(self.model, config.model, device, config.run.seed)
        opt = config.optimizer
        trainable = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapters
        self.optimizer = build_optimizer(trainable, opt, device)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_factor(s, config.run.steps, opt.warmup_steps, opt.min_lr_ratio),
        )

    def _build_sampler(self) -> None:
        data = self.config.data
        check_tokenizer(data.dataset_dir, self.spec.tokenizer(self.config.model).identity)
        if data.format == "examples":
            from trainer.examples_data import load_examples

            train, _, _ = load_examples(data.dataset_dir)
            self.sampler = ExampleSampler(
                train,
                self.config.model.seq_len,
                data.batch_size,
                self.config.run.seed,
                self.rank,
                world_size=self.world,
                global_batch=data.global_batch,
                packing=data.packing,
                pad_id=self.spec.tokenizer(self.config.model).eos_id,
            )
            return
        from trainer.examples_data import example_index

        if example_index(data.dataset_dir) is not None:
            raise DataError(
                f"{data.dataset_dir} holds example shards (conversations with a loss mask): train on them "
                "with data.format=examples (the pipeline's data_format, `--data-format examples`)"
            )
        train_files, _ = split_files(data.dataset_dir, data.holdout_fraction)
        self.sampler = StepSampler(
            load_tokens(train_files),
            self.config.model.seq_len,
            data.batch_size,
            self.config.run.seed,
            self.rank,
            world_size=self.world,
            global_batch=data.global_batch,
        )

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def train(self) -> TrainSummary:
        """Run (or resume) to `run.steps` (or `run.stop_after_steps`, or a SIGTERM); returns
        the summary (rank 0's view), the last checkpoint committed."""
        checkpoints = cast(CheckpointManager, self.checkpoints)
        self._stop.install()
        try:
            loop_start = self._start_loop()
            stop_at = self.config.run.stop_after_steps or self.config.run.steps
            stopped_by_signal = False
            for step in range(self.last_step + 1, self.config.run.steps + 1):
                result = self.train_step(step)
                self._record(result)
                stopped_by_signal = result.stop_requested
                checkpoints.save(step, last_step=stopped_by_signal or step == stop_at, loss=result.loss)
                for callback in self.callbacks:
                    callback.on_step_end(result)
                if stopped_by_signal:
                    if self.rank == 0:
                        log.warning("SIGTERM received: saved step %d, stopping", step)
                    self.events.emit("stopped_by_signal", step=step)
                    break
                if step >= stop_at:
                    break
            loop_wall_s = time.perf_counter() - loop_start
            checkpoints.close()  # the last checkpoint is committed: the run's result is durable
            self._checkpoints_open = False
        finally:
            self._stop.restore()
        # The run's end is blocking work too: rank 0's goodput report, MLflow and summary can
        # outlast a soft timeout on a busy node (and restart a finished run in-process).
        with self.hooks.keepalive():
            return self._finish(loop_wall_s, stopped_by_signal)

    def train_step(self, step: int) -> StepResult:
        """One optimizer step over the global batch; collective (one all-reduce at its end)."""
        step_start = time.perf_counter()
        self.injector.at_step(step)
        loss = accumulate_gradients(self.spec, self.model, self.sampler.micro_batches(step), self.device)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.config.optimizer.grad_clip_norm
        )
        # A save step's host capture ran beside this forward and backward; it must be
        # complete before the optimizer changes the weights in place.
        cast(CheckpointManager, self.checkpoints).maybe_wait_for_staging()
        with step_callbacks.local_work(self.extensions, step):  # no collective in it
            self.injector.in_local_work(step)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        # One collective per step carries the mean loss and whether any rank got SIGTERM.
        # On the training device: NCCL on a GPU (the group's gloo part serves host tensors).
        reduced = torch.stack(
            [loss.detach().float(), torch.tensor(float(self._stop.requested), device=loss.device)]
        )
        dist.all_reduce(reduced)
        loss_value = reduced[0].item() / self.world
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"loss became {loss_value} at step {step}; lower optimizer.lr")
        norm = _gathered_norm(grad_norm) if self.progress.wants_detail(step) else None
        return StepResult(
            step=step,
            loss=loss_value,
            lr=float(self.scheduler.get_last_lr()[0]),
            duration_s=time.perf_counter() - step_start,
            grad_norm=norm,
            stop_requested=reduced[1].item() > 0,
        )

    def close(self) -> None:
        """Idempotent. After an exception: the pending save never commits, and its writer
        process must not keep this one alive."""
        self._stop.restore()
        if self._checkpoints_open and self.checkpoints is not None:
            self._checkpoints_open = False
            self.checkpoints.abandon()

    def _start_loop(self) -> float:
        """Collective: the loop's start (perf_counter) once every rank is ready."""
        # Until the first step, no step end heart-beats: a busy node, or a peer still starting,
        # must not look like a hang to the watchdog or ft_launcher (seen: a restarted group
        # killed after 15 s without heartbeats here).
        with self.hooks.keepalive():
            with self.clock.phase("gc_s"):
                _freeze_startup_objects(self.attempt)
            with self.clock.phase("barrier_s"):
                # Start-up took different times on each rank; the short timeout starts even.
                waiting.barrier()
            loop_start = time.perf_counter()
            startup_s = loop_start - self.clock.started
            self.events.emit("resumed", step=self.last_step, startup_s=startup_s, phases=self.clock.phases)
            if self.rank == 0 and self.last_step > 0:
                self.progress.backfill(self.workdir, self.last_step)
            if self.rank == 0 and self.attempt.is_restart:
                from trainer import goodput

                restarts = goodput.analyze_run(self.workdir, time.time())["restarts"]
                if restarts:  # what the restart cost, for the log and MLflow
                    self.progress.on_restart(restarts[-1], len(restarts))
            if self.last_step > 0 or self.attempt.is_restart:
                # Rank 0 read the run's history meanwhile: the others wait here, under the
                # start-up timeout, not in the first step's collectives under the loop's.
                waiting.barrier()
        set_collective_timeout(self.config.resilience.collective_timeout_s)
        return loop_start

    def _record(self, result: StepResult) -> None:
        self.step_seconds += result.duration_s
        self.steps_run += 1
        self.losses.append((result.step, result.loss))
        detail = {} if result.grad_norm is None else {"grad_norm": result.grad_norm}
        self.events.emit(
            "step", step=result.step, loss=result.loss, lr=result.lr, duration_s=result.duration_s, **detail
        )
        self.progress.on_step(result.step, result.loss, result.lr, result.duration_s, result.grad_norm)

    def _finish(self, loop_wall_s: float, stopped_by_signal: bool) -> TrainSummary:
        config = self.config
        phases: dict[str, int] = {}

        def phase_ended(name: str) -> None:
            peak = phase_peak_bytes(self.device)
            if peak is not None:
                phases[name] = peak

        phase_ended("train")
        fingerprint = model_sha256(self.model)  # gathers every tensor: minutes at 8B+
        phase_ended("fingerprint")
        final_step = self.losses[-1][0] if self.losses else self.last_step
        # Scored where the model already is, for the validate step; not in a SIGTERM's grace
        # period (the run resumes later and scores its last step then).
        if config.data.eval_windows > 0 and not stopped_by_signal:
            from trainer.evaluation import write_eval_record

            write_eval_record(self.model, config, fingerprint, final_step, self.rank, self.device)
            phase_ended("evaluation")
        summary = TrainSummary(
            steps=final_step,
            target_steps=config.run.steps,
            completed=final_step >= config.run.steps,
            stopped_by_signal=stopped_by_signal,
            steps_run=self.steps_run,
            **step_callbacks.summary_fields(self.extensions),
            final_loss=self.losses[-1][1] if self.losses else None,
            losses=[{"step": s, "loss": v} for s, v in self.losses],
            **cast(CheckpointManager, self.checkpoints).summary(loop_wall_s),
            loop_wall_s=loop_wall_s,
            world_size=self.world,
            device=self.device.type,
            model_sha256=fingerprint,
            train_seconds=self.step_seconds,
            wall_seconds=time.perf_counter() - self.clock.started,
            peak_mem_bytes=max(phases.values()) if phases else peak_memory_bytes(self.device),
            peak_mem_bytes_by_phase=phases,
        )
        if self.rank != 0:
            return summary
        # In a thread: a call blocked in C (an MLflow request to a stalled server) on the main
        # thread stamps no progress for NVRx's watchdog, keep-alive or not (trainer/waiting.py).
        return waiting.off_main_thread("rtp-publish", _publish, summary, self.workdir, self.progress)


def _publish(summary: TrainSummary, workdir: Path, progress: Progress) -> TrainSummary:
    """Rank 0: add the run's goodput, write goodput.html, send the final figures to MLflow,
    then write summary.json."""
    from trainer import goodput, report
    from trainer.faults import fired_faults

    summary = dataclasses.replace(summary, **goodput.analyze_run(workdir, time.time()))
    summary.goodput_report = str(
        report.write_goodput_report(
            workdir / "goodput.html",
            summary.to_dict(),
            goodput.read_events(workdir),
            fired_faults(workdir),
            progress.tokens_per_step,
        )
    )
    summary.mlflow_run_id = progress.finish(summary.to_dict())
    summary.write(workdir / "summary.json")
    return summary
