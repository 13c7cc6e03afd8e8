"""The training loop of one rank: build, resume, step, checkpoint, summarize.

Everything distributed — model shards, optimizer, sampler, the checkpoint writer — is
created inside `train()`, so a restart (a new call) starts from a clean slate and the
latest committed checkpoint. The loop is deterministic on CPU for a given seed and world
size: a run stopped after a checkpoint and resumed reaches the same weights as one that
never stopped, whatever the checkpoint mode. Checkpoint policy (resume, when to save, what
a save holds) is `trainer.checkpointing.CheckpointManager`'s; the loop makes its four calls:
`load()`, `maybe_wait_for_staging()` and `save()` every step, `close()`.

SIGTERM (pod eviction, preemption, `kubectl delete`) does not kill the loop: the ranks
agree on it at the next step, write a final checkpoint, and exit cleanly, so the
Kubernetes grace period is spent saving instead of losing the steps since the last save.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import signal
import time
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from trainer import peer_abort
from trainer.checkpointing import CheckpointManager, model_sha256
from trainer.config import TrainConfig
from trainer.data import StepSampler, check_tokenizer, load_tokens, split_files
from trainer.determinism import apply_determinism
from trainer.events import EventLog
from trainer.faults import FaultInjector, parse_faults
from trainer.gpu_defaults import check_timeouts
from trainer.hooks import TrainHooks
from trainer.models import model_spec
from trainer.parallelize import (
    compute_dtype,
    init_distributed,
    parallelize,
    peak_memory_bytes,
    set_collective_timeout,
    training_device,
)
from trainer.progress import Progress
from trainer.summary import TrainSummary

log = logging.getLogger(__name__)


def lr_factor(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine decay to `min_ratio` at `total_steps`."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def accumulate_gradients(
    spec: Any, model: torch.nn.Module, micro_batches: list[torch.Tensor], device: torch.device
) -> torch.Tensor:
    """Forward and backward over a step's micro-batches; returns this rank's mean loss.

    Reduce-scatter once, after the last micro-batch: its gradient (averaged over the ranks
    by FSDP) is then the mean over the global batch."""
    loss = torch.zeros((), device=device)
    for index, micro_batch in enumerate(micro_batches):
        cast(FSDPModule, model).set_requires_gradient_sync(index == len(micro_batches) - 1)
        micro_loss = spec.loss(model, micro_batch.to(device)) / len(micro_batches)
        micro_loss.backward()
        loss += micro_loss.detach()
    return loss


def _gathered_norm(norm: torch.Tensor) -> float:
    """The total grad norm as a number. Under FSDP2 it may be a DTensor: every rank calls
    this on the same steps, so gathering it is a collective all ranks take part in."""
    full = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return float(full.detach().float().cpu().item())


def _report_restart(workdir: Path, progress: Progress) -> None:
    """Rank 0 of a restarted attempt: what the restart cost, for the log and MLflow."""
    from trainer import goodput

    restarts = goodput.analyze_run(workdir, time.time())["restarts"]
    if restarts:
        progress.on_restart(restarts[-1], len(restarts))


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


def train(
    config: TrainConfig, store: dist.Store | None = None, hooks: TrainHooks | None = None
) -> TrainSummary:
    """Run (or resume) training to `config.run.steps`; returns the summary (rank 0's view).

    `store` and `hooks` come from trainer/resilience.py: the rendezvous store of this
    attempt and the progress/launcher callbacks. Called again after an in-process restart."""
    hooks = hooks or TrainHooks()
    check_timeouts(config.resilience, training_device().type)
    apply_determinism(config.training, cuda=training_device().type == "cuda")  # before NCCL and cuBLAS start
    # An in-process restart interrupts the previous attempt with an asynchronous exception,
    # which can land inside a `torch.no_grad()` block before its exit restores grad mode
    # (the next attempt's backward would then fail with "does not require grad"). Grad mode is
    # per thread and part of the clean slate each attempt starts from.
    torch.set_grad_enabled(True)
    attempt = hooks.attempt_info()
    is_restart = attempt.get("inprocess_iteration", 0) > 0 or attempt.get("launcher_restart", 0) > 0
    attempt_started_at = time.time()
    wall_start = time.perf_counter()
    phases: dict[str, float] = {}
    mark = time.perf_counter()
    with peer_abort.tracking():  # an in-process restart shuts these connections down at once
        mesh = init_distributed(config.resilience.collective_timeout_s, store)
    phases["process_group_s"] = time.perf_counter() - mark
    rank, world = dist.get_rank(), dist.get_world_size()
    device = training_device()
    workdir = Path(config.run.workdir)
    progress = Progress(config, rank, world)
    events = EventLog(workdir, enabled=rank == 0, listener=progress.on_event)
    events.emit("attempt_start", at=attempt_started_at, world_size=world, **attempt)
    injector = FaultInjector(
        parse_faults(config.run.faults),
        workdir,
        rank,
        world,
        wait_for_prefork=config.resilience.prefork_workers,
        slow_save_s=2 * config.resilience.soft_timeout_s,
        keepalive=hooks.keepalive,
    )

    mark = time.perf_counter()
    spec = model_spec(config.model.kind)
    model = spec.build_for_training(config.model, device, config.run.seed)
    parallelize(model, mesh, spec.fsdp_units(model), config.training, device)
    if rank == 0:
        log.info("compute dtype %s", str(compute_dtype(config.training, device)).removeprefix("torch."))
    spec.init_weights(model, config.model, device, config.run.seed)
    opt_cfg = config.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt_cfg.lr, weight_decay=opt_cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_factor(s, config.run.steps, opt_cfg.warmup_steps, opt_cfg.min_lr_ratio),
    )
    phases["model_build_s"] = time.perf_counter() - mark
    mark = time.perf_counter()
    check_tokenizer(config.data.dataset_dir, spec.tokenizer(config.model).identity)
    train_files, _ = split_files(config.data.dataset_dir, config.data.holdout_fraction)
    sampler = StepSampler(
        load_tokens(train_files),
        config.model.seq_len,
        config.data.batch_size,
        config.run.seed,
        rank,
        world_size=world,
        global_batch=config.data.global_batch,
    )
    phases["loader_s"] = time.perf_counter() - mark

    checkpoints = CheckpointManager(
        config,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        sampler=sampler,
        hooks=hooks,
        events=events,
        states=hooks.checkpoint_states(),
        on_queued=injector.after_checkpoint_queued,
        during_save=injector.during_save,
    )
    last_step = checkpoints.load(background=is_restart)  # a restart needs its first step soon
    phases["checkpoint_load_s"] = checkpoints.load_s
    phases["checkpointer_start_s"] = checkpoints.start_s
    stop = _StopRequest()
    stop.install()

    losses: list[tuple[int, float]] = []
    stop_at = config.run.stop_after_steps or config.run.steps
    stopped_by_signal = False
    step_seconds = 0.0
    steps_run = 0
    # What start-up built (modules, tensors, imported libraries: millions of objects) lives
    # for the whole attempt; the garbage collector's full passes would scan all of it and
    # pause the loop. Frozen, it is left out of every pass.
    # After an in-process restart it is unfrozen first, so the previous attempt's cyclic
    # garbage is freed. Not on a process's first attempt: a rank forked from the zygote
    # (trainer/prefork.py) shares the zygote's frozen objects, and a pass over them would
    # copy every page they live on.
    mark = time.perf_counter()
    if attempt.get("inprocess_iteration", 0) > 0:
        gc.unfreeze()
    gc.collect()
    gc.freeze()
    phases["gc_s"] = time.perf_counter() - mark
    mark = time.perf_counter()
    dist.barrier()  # start-up took different times on each rank; the short timeout starts even
    phases["barrier_s"] = time.perf_counter() - mark
    set_collective_timeout(config.resilience.collective_timeout_s)
    loop_start = time.perf_counter()
    events.emit("resumed", step=last_step, startup_s=loop_start - wall_start, phases=phases)
    if rank == 0 and last_step > 0:
        progress.backfill(workdir, last_step)
    if is_restart and rank == 0:
        _report_restart(workdir, progress)
    try:
        for step in range(last_step + 1, config.run.steps + 1):
            step_start = time.perf_counter()
            injector.at_step(step)
            loss = accumulate_gradients(spec, model, sampler.micro_batches(step), device)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), opt_cfg.grad_clip_norm)
            # An async save's snapshot copy ran beside this forward and backward; it must be
            # complete before the optimizer changes the weights in place.
            checkpoints.maybe_wait_for_staging()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            # One collective per step carries the mean loss and whether any rank got SIGTERM.
            # On the training device: NCCL on a GPU (the group's gloo part serves host tensors).
            reduced = torch.stack(
                [loss.detach().float(), torch.tensor(float(stop.requested), device=loss.device)]
            )
            dist.all_reduce(reduced)
            loss_value = reduced[0].item() / world
            if not math.isfinite(loss_value):
                raise FloatingPointError(f"loss became {loss_value} at step {step}; lower optimizer.lr")
            step_duration_s = time.perf_counter() - step_start
            step_seconds += step_duration_s
            steps_run += 1
            losses.append((step, loss_value))
            lr = float(scheduler.get_last_lr()[0])
            norm = _gathered_norm(grad_norm) if progress.wants_detail(step) else None
            detail = {} if norm is None else {"grad_norm": norm}
            events.emit("step", step=step, loss=loss_value, lr=lr, duration_s=step_duration_s, **detail)
            progress.on_step(step, loss_value, lr, step_duration_s, norm)

            stopped_by_signal = reduced[1].item() > 0
            checkpoints.save(step, last_step=stopped_by_signal or step == stop_at, loss=loss_value)
            hooks.step_done(step)
            if stopped_by_signal:
                if rank == 0:
                    log.warning("SIGTERM received: saved step %d, stopping", step)
                events.emit("stopped_by_signal", step=step)
                break
            if step >= stop_at:
                break
        loop_wall_s = time.perf_counter() - loop_start
        checkpoints.close()  # the last checkpoint is committed: the run's result is durable
    except BaseException:
        # The pending save never commits; its writer process must not keep this one alive.
        checkpoints.abandon()
        raise
    finally:
        stop.restore()

    with hooks.keepalive():  # gathers every tensor: minutes at 8B+
        fingerprint = model_sha256(model)
    final_step = losses[-1][0] if losses else last_step
    # Scored where the model already is, for the validate step; not in a SIGTERM's grace period
    # (the run resumes later and scores its last step then).
    if config.data.eval_windows > 0 and not stopped_by_signal:
        from trainer.evaluation import write_eval_record

        with hooks.keepalive():
            write_eval_record(model, config, fingerprint, final_step, rank, device)
    summary = TrainSummary(
        steps=final_step,
        target_steps=config.run.steps,
        completed=final_step >= config.run.steps,
        stopped_by_signal=stopped_by_signal,
        steps_run=steps_run,
        final_loss=losses[-1][1] if losses else None,
        losses=[{"step": s, "loss": v} for s, v in losses],
        **checkpoints.summary(loop_wall_s),
        loop_wall_s=loop_wall_s,
        world_size=world,
        device=device.type,
        model_sha256=fingerprint,
        train_seconds=step_seconds,
        wall_seconds=time.perf_counter() - wall_start,
        peak_mem_bytes=peak_memory_bytes(device),
    )
    if rank == 0:
        from trainer import goodput, report
        from trainer.faults import fired_faults

        summary = dataclasses.replace(summary, **goodput.analyze_run(workdir, time.time()))
        report_path = report.write_goodput_report(
            workdir / "goodput.html",
            summary.to_dict(),
            goodput.read_events(workdir),
            fired_faults(workdir),
            progress.tokens_per_step,
        )
        summary.goodput_report = str(report_path)
        summary.mlflow_run_id = progress.finish(summary.to_dict())
        summary.write(workdir / "summary.json")
    return summary
