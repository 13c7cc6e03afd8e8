"""The training loop of one rank: build, resume, step, checkpoint, summarize.

Everything distributed — model shards, optimizer, sampler, the checkpoint writer — is
created inside `train()`, so a restart (a new call) starts from a clean slate and the
latest committed checkpoint. The loop is deterministic on CPU for a given seed and world
size: a run stopped after a checkpoint and resumed reaches the same weights as one that
never stopped, whatever the checkpoint mode.

SIGTERM (pod eviction, preemption, `kubectl delete`) does not kill the loop: the ranks
agree on it at the next step, write a final checkpoint, and exit cleanly, so the
Kubernetes grace period is spent saving instead of losing the steps since the last save.
"""

from __future__ import annotations

import hashlib
import logging
import math
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from trainer import checkpoint
from trainer.checkpointer import Checkpointer, SaveRecord, efficiency_pct
from trainer.config import TrainConfig
from trainer.data import StepSampler, check_tokenizer, load_tokens, split_files
from trainer.events import EventLog, write_json_atomic
from trainer.faults import FaultInjector, parse_faults
from trainer.models import model_spec
from trainer.parallelize import apply_fsdp, init_distributed, set_collective_timeout, training_device

log = logging.getLogger(__name__)


def lr_factor(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine decay to `min_ratio` at `total_steps`."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def state_dict_sha256(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 over tensors in sorted key order: equal exactly when the weights are equal."""
    digest = hashlib.sha256()
    for key in sorted(state):
        digest.update(key.encode())
        digest.update(state[key].detach().to("cpu").contiguous().numpy().tobytes())
    return digest.hexdigest()


def model_sha256(model: torch.nn.Module) -> str:
    """`state_dict_sha256` of the full (unsharded) model state. Collective."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    tensors = {}
    for key, value in full.items():
        assert isinstance(value, torch.Tensor), key
        tensors[key] = value
    return state_dict_sha256(tensors)


class TrainHooks:
    """What the fault-tolerance layers (trainer/resilience.py) plug into the loop; no-ops here."""

    def attempt_info(self) -> dict[str, Any]:
        return {"inprocess_iteration": 0, "launcher_restart": 0, "inprocess_enabled": False}

    def step_done(self, step: int) -> None:
        """Progress signal after every step (in-process watchdog ping, launcher heartbeat)."""

    def launcher_state(self) -> dict[str, Any]:
        """State the launcher wants back after a restart (ft_launcher's learned timeouts)."""
        return {}

    def restore_launcher_state(self, state: dict[str, Any]) -> None:
        """Receives `launcher_state()` as stored in the checkpoint being resumed."""


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
) -> dict[str, Any]:
    """Run (or resume) training to `config.run.steps`; returns the summary (rank 0's view).

    `store` and `hooks` come from trainer/resilience.py: the rendezvous store of this
    attempt and the progress/launcher callbacks. Called again after an in-process restart."""
    hooks = hooks or TrainHooks()
    attempt = hooks.attempt_info()
    is_restart = attempt.get("inprocess_iteration", 0) > 0 or attempt.get("launcher_restart", 0) > 0
    attempt_started_at = time.time()
    wall_start = time.perf_counter()
    phases: dict[str, float] = {}
    mark = time.perf_counter()
    mesh = init_distributed(config.resilience.collective_timeout_s, store)
    phases["process_group_s"] = time.perf_counter() - mark
    rank, world = dist.get_rank(), dist.get_world_size()
    device = training_device()
    workdir = Path(config.run.workdir)
    events = EventLog(workdir, enabled=rank == 0)
    events.emit("attempt_start", at=attempt_started_at, world_size=world, **attempt)
    ckpt_root = Path(config.checkpoint_dir())
    ckpt_cfg = config.checkpoint
    injector = FaultInjector(parse_faults(config.run.faults), workdir, rank, world)

    mark = time.perf_counter()
    spec = model_spec(config.model.kind)
    model = spec.build_for_training(config.model, device, config.run.seed)
    apply_fsdp(model, mesh, spec.fsdp_units(model))
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
        load_tokens(train_files), config.model.seq_len, config.data.batch_size, config.run.seed, rank
    )
    phases["loader_s"] = time.perf_counter() - mark

    last_step = 0
    resumed_from = None
    mark = time.perf_counter()
    latest = checkpoint.latest_committed_checkpoint(ckpt_root, ckpt_cfg.verify_hashes)
    if latest is not None:
        restored = checkpoint.load_checkpoint(latest, model, optimizer)
        meta = restored["meta"]
        if meta.get("model_hash") != config.model_hash():
            raise checkpoint.CheckpointError(
                f"{latest} was trained with a different model config; use a new checkpoint dir"
            )
        scheduler.load_state_dict(meta["scheduler"])
        hooks.restore_launcher_state(meta.get("launcher", {}))
        last_step = int(meta["step"])
        resumed_from = str(latest)
        events.emit("resume", step=last_step, checkpoint=resumed_from)
        if rank == 0:
            log.info("resumed from %s at step %d", latest, last_step)
    phases["checkpoint_load_s"] = time.perf_counter() - mark

    def on_commit(record: SaveRecord) -> None:
        events.emit("checkpoint_committed", **record.as_dict())
        if rank == 0:
            log.info(
                "checkpoint step %d committed (blocked %.3fs, write %.3fs)",
                record.step,
                record.blocked_s,
                record.write_s or 0.0,
            )

    checkpointer = Checkpointer(
        ckpt_root, ckpt_cfg.mode, ckpt_cfg.keep_last, ckpt_cfg.keep_every_steps, on_commit
    )
    start_begin = time.perf_counter()
    checkpointer.start(background=is_restart)  # a restart needs its first step soon
    checkpointer_start_s = time.perf_counter() - start_begin
    phases["checkpointer_start_s"] = checkpointer_start_s
    stop = _StopRequest()
    stop.install()

    def save(step: int, loss_value: float) -> None:
        record = checkpointer.save(
            step,
            model,
            optimizer,
            meta={
                "config": config.to_dict(),
                "model_hash": config.model_hash(),
                "scheduler": scheduler.state_dict(),
                "loss": loss_value,
                "launcher": hooks.launcher_state(),
            },
            rank_extra={"sampler": sampler.state_dict(next_step=step + 1)},
        )
        if record is not None:
            fields = {"weights_sha256": model_sha256(model)} if ckpt_cfg.record_weight_hashes else {}
            events.emit(
                "checkpoint_queued", step=step, mode=record.mode, blocked_s=record.blocked_s, **fields
            )
            if not checkpointer.awaiting_handoff:  # else once it is queued, before the next step
                injector.after_checkpoint_queued(step)

    losses: list[tuple[int, float]] = []
    stop_at = config.run.stop_after_steps or config.run.steps
    stopped_by_signal = False
    step_seconds = 0.0
    steps_run = 0
    dist.barrier()  # start-up took different times on each rank; the short timeout starts even
    set_collective_timeout(config.resilience.collective_timeout_s)
    loop_start = time.perf_counter()
    events.emit("resumed", step=last_step, startup_s=loop_start - wall_start, phases=phases)
    try:
        for step in range(last_step + 1, config.run.steps + 1):
            step_start = time.perf_counter()
            injector.at_step(step)
            batch = sampler.batch(step).to(device)
            loss = spec.loss(model, batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), opt_cfg.grad_clip_norm)
            # An async save's snapshot copy ran beside this forward and backward; it must be
            # complete before the optimizer changes the weights in place.
            handed_off = checkpointer.before_optimizer_step()
            if handed_off is not None:
                injector.after_checkpoint_queued(handed_off.step)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            # One collective per step carries the mean loss and whether any rank got SIGTERM.
            reduced = torch.stack([loss.detach().float().cpu(), torch.tensor(float(stop.requested))])
            dist.all_reduce(reduced)
            loss_value = reduced[0].item() / world
            if not math.isfinite(loss_value):
                raise FloatingPointError(f"loss became {loss_value} at step {step}; lower optimizer.lr")
            step_duration_s = time.perf_counter() - step_start
            step_seconds += step_duration_s
            steps_run += 1
            losses.append((step, loss_value))
            events.emit(
                "step", step=step, loss=loss_value, lr=scheduler.get_last_lr()[0], duration_s=step_duration_s
            )
            if rank == 0 and (step % config.run.log_every_steps == 0 or step == last_step + 1):
                log.info("step %d/%d loss %.4f", step, config.run.steps, loss_value)

            stopped_by_signal = reduced[1].item() > 0
            if stopped_by_signal or step % ckpt_cfg.every_steps == 0 or step == stop_at:
                save(step, loss_value)
            checkpointer.poll()
            hooks.step_done(step)
            if stopped_by_signal:
                if rank == 0:
                    log.warning("SIGTERM received: saved step %d, stopping", step)
                events.emit("stopped_by_signal", step=step)
                break
            if step >= stop_at:
                break
        loop_wall_s = time.perf_counter() - loop_start
        drain_start = time.perf_counter()
        checkpointer.drain()  # the last checkpoint is committed: the run's result is durable
        final_drain_s = time.perf_counter() - drain_start
        checkpointer.close()
        teardown_s = time.perf_counter() - drain_start - final_drain_s
    except BaseException:
        # The pending save never commits; its writer process must not keep this one alive.
        checkpointer.abandon()
        raise
    finally:
        stop.restore()

    saves = [record.as_dict() for record in checkpointer.records]
    blocked_total = sum(record.blocked_s for record in checkpointer.records)
    latest_now = checkpoint.latest_committed_checkpoint(ckpt_root)
    final_step = losses[-1][0] if losses else last_step
    summary = {
        "steps": final_step,
        "target_steps": config.run.steps,
        "completed": final_step >= config.run.steps,
        "stopped_by_signal": stopped_by_signal,
        "steps_run": steps_run,
        "final_loss": losses[-1][1] if losses else None,
        "losses": [{"step": s, "loss": v} for s, v in losses],
        "checkpoint": str(latest_now) if latest_now else None,
        "checkpoint_mode": ckpt_cfg.mode,
        "resumed_from": resumed_from,
        "checkpoint_saves": saves,
        "checkpoint_blocked_s": blocked_total,
        "efficiency_pct": efficiency_pct(blocked_total, loop_wall_s),
        "final_drain_s": final_drain_s,
        "checkpointer_start_s": checkpointer_start_s,
        "checkpointer_teardown_s": teardown_s,
        "loop_wall_s": loop_wall_s,
        "world_size": world,
        "device": device.type,
        "model_sha256": model_sha256(model),
        "train_seconds": step_seconds,
        "wall_seconds": time.perf_counter() - wall_start,
    }
    if rank == 0:
        from trainer import goodput, report
        from trainer.faults import fired_faults

        summary.update(goodput.analyze_run(workdir, time.time()))
        report_path = report.write_goodput_report(
            workdir / "goodput.html", summary, goodput.read_events(workdir), fired_faults(workdir)
        )
        summary["goodput_report"] = str(report_path)
        write_json_atomic(workdir / "summary.json", summary)
    return summary
