"""The training loop of one rank: build, resume, step, checkpoint, summarize.

Everything distributed — model shards, optimizer, sampler — is created inside `train()`,
so a restart (a new call) starts from a clean slate and the latest committed checkpoint.
The loop is deterministic on CPU for a given seed and world size: a run stopped after a
checkpoint and resumed reaches the same weights as one that never stopped.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from trainer import checkpoint
from trainer.config import TrainConfig
from trainer.data import StepSampler, load_tokens, split_files
from trainer.events import EventLog, write_json_atomic
from trainer.model import ByteLM, next_token_loss
from trainer.parallelize import apply_fsdp, init_distributed, training_device

log = logging.getLogger(__name__)


def lr_factor(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine decay to `min_ratio` at `total_steps`."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def model_sha256(model: torch.nn.Module) -> str:
    """SHA-256 over the full (unsharded) state dict in sorted key order. Collective."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    digest = hashlib.sha256()
    for key in sorted(full):
        value = full[key]
        assert isinstance(value, torch.Tensor), key
        tensor = value.detach().to("cpu").contiguous()
        digest.update(key.encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def train(config: TrainConfig) -> dict[str, Any]:
    """Run (or resume) training to `config.run.steps`; returns the summary (rank 0's view)."""
    wall_start = time.perf_counter()
    mesh = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = training_device()
    workdir = Path(config.run.workdir)
    events = EventLog(workdir, enabled=rank == 0)
    ckpt_root = Path(config.checkpoint_dir())

    torch.manual_seed(config.run.seed)  # identical initial weights on every rank
    model = ByteLM(config.model).to(device)
    apply_fsdp(model, mesh)
    opt_cfg = config.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt_cfg.lr, weight_decay=opt_cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_factor(s, config.run.steps, opt_cfg.warmup_steps, opt_cfg.min_lr_ratio),
    )
    train_files, _ = split_files(config.data.dataset_dir, config.data.holdout_fraction)
    sampler = StepSampler(
        load_tokens(train_files), config.model.seq_len, config.data.batch_size, config.run.seed, rank
    )

    last_step = 0
    resumed_from = None
    latest = checkpoint.latest_committed_checkpoint(ckpt_root, config.checkpoint.verify_hashes)
    if latest is not None:
        restored = checkpoint.load_checkpoint(latest, model, optimizer)
        meta = restored["meta"]
        if meta.get("model_hash") != config.model_hash():
            raise checkpoint.CheckpointError(
                f"{latest} was trained with a different model config; use a new checkpoint dir"
            )
        scheduler.load_state_dict(meta["scheduler"])
        last_step = int(meta["step"])
        resumed_from = str(latest)
        events.emit("resume", step=last_step, checkpoint=resumed_from)
        if rank == 0:
            log.info("resumed from %s at step %d", latest, last_step)

    losses: list[tuple[int, float]] = []
    saves: list[dict[str, Any]] = []
    last_checkpoint = latest
    stop_at = config.run.stop_after_steps or config.run.steps
    step_seconds = 0.0
    steps_run = 0
    for step in range(last_step + 1, config.run.steps + 1):
        step_start = time.perf_counter()
        batch = sampler.batch(step).to(device)
        loss = next_token_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt_cfg.grad_clip_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        loss_value = mean_loss.item() / world
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"loss became {loss_value} at step {step}; lower optimizer.lr")
        step_seconds += time.perf_counter() - step_start
        steps_run += 1
        losses.append((step, loss_value))
        events.emit("step", step=step, loss=loss_value, lr=scheduler.get_last_lr()[0])
        if rank == 0 and (step % config.run.log_every_steps == 0 or step == last_step + 1):
            log.info("step %d/%d loss %.4f", step, config.run.steps, loss_value)

        if step % config.checkpoint.every_steps == 0 or step == stop_at:
            result = checkpoint.save_checkpoint(
                ckpt_root,
                step,
                model,
                optimizer,
                meta={
                    "config": config.to_dict(),
                    "model_hash": config.model_hash(),
                    "scheduler": scheduler.state_dict(),
                    "loss": loss_value,
                },
                rank_extra={"sampler": sampler.state_dict(next_step=step + 1)},
            )
            last_checkpoint = result.path
            saves.append({"step": step, "blocked_s": result.blocked_s, "bytes": result.bytes_total})
            events.emit("checkpoint", step=step, path=str(result.path), blocked_s=result.blocked_s)
            if rank == 0:
                checkpoint.apply_retention(ckpt_root, config.checkpoint.keep_last)
                log.info("checkpoint step %d committed in %.2fs: %s", step, result.blocked_s, result.path)
        if step >= stop_at:
            break

    final_step = losses[-1][0] if losses else last_step
    summary = {
        "steps": final_step,
        "target_steps": config.run.steps,
        "completed": final_step >= config.run.steps,
        "steps_run": steps_run,
        "final_loss": losses[-1][1] if losses else None,
        "losses": [{"step": s, "loss": v} for s, v in losses],
        "checkpoint": str(last_checkpoint) if last_checkpoint else None,
        "resumed_from": resumed_from,
        "checkpoint_saves": saves,
        "world_size": world,
        "device": device.type,
        "model_sha256": model_sha256(model),
        "train_seconds": step_seconds,
        "wall_seconds": time.perf_counter() - wall_start,
    }
    if rank == 0:
        write_json_atomic(workdir / "summary.json", summary)
    return summary
