"""The bare FSDP loop `rtp bench throughput` compares the rtp stack against: one rank of it.

Started by torchrun (`python -m torch.distributed.run -m benchmarks.bare_fsdp CONFIG OUT`),
it trains the same model as the trainer — built by the model registry, sharded by
`trainer.parallelize.parallelize` with the same mixed precision, activation checkpointing
and compile settings — on the same batches (`StepSampler`, with the same gradient
accumulation) with the same AdamW, schedule and gradient clipping, and nothing else:
no launcher monitor, no in-process restart wrapper, no checkpoints, no event log, no
per-step loss all-reduce. Rank 0 writes the timings as JSON to OUT. It imports nothing the
trainer's loop does not.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer.config import TrainConfig
from trainer.data import StepSampler, load_tokens, split_files
from trainer.loop import accumulate_gradients, build_optimizer, lr_factor
from trainer.models import model_spec
from trainer.parallelize import (
    init_distributed,
    parallelize,
    peak_memory_bytes,
    shutdown_distributed,
    training_device,
)


def train_bare(config: TrainConfig) -> dict[str, Any]:
    """Train `config.run.steps` steps from scratch; this rank's timings."""
    started = time.perf_counter()
    mesh = init_distributed(config.resilience.collective_timeout_s)
    rank = dist.get_rank()
    device = training_device()
    spec = model_spec(config.model.kind)
    model = spec.build_for_training(config.model, device, config.run.seed)
    parallelize(model, mesh, spec.fsdp_units(model), config.training, device)
    spec.init_weights(model, config.model, device, config.run.seed)
    opt = config.optimizer
    optimizer = build_optimizer(model.parameters(), opt, device)  # as the trainer: fused on CUDA
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, config.run.steps, opt.warmup_steps, opt.min_lr_ratio)
    )
    train_files, _ = split_files(config.data.dataset_dir, config.data.holdout_fraction)
    sampler = StepSampler(
        load_tokens(train_files),
        config.model.seq_len,
        config.data.batch_size,
        config.run.seed,
        rank,
        world_size=dist.get_world_size(),
        global_batch=config.data.global_batch,
    )
    dist.barrier()
    startup_s = time.perf_counter() - started
    step_seconds = []
    step_ends_s = []  # from the loop's start: the steady state's window (rtp bench throughput)
    loop_started_at = time.time()
    loop_start = time.perf_counter()
    loss = torch.zeros(())
    for step in range(1, config.run.steps + 1):
        step_start = time.perf_counter()
        loss = accumulate_gradients(spec, model, sampler.micro_batches(step), device)  # as the trainer
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # a step's time is its GPU time, as in the trainer's loss read
        step_seconds.append(time.perf_counter() - step_start)
        step_ends_s.append(time.perf_counter() - loop_start)
    final_loss = loss.detach().float().item()
    dist.barrier()
    loop_wall_s = time.perf_counter() - loop_start
    return {
        "wall_s": loop_wall_s,
        "step_s_median": statistics.median(step_seconds),
        "steps": len(step_seconds),
        "step_ends_s": step_ends_s,
        "startup_s": startup_s,
        "loop_started_at": loop_started_at,
        "peak_mem_bytes": peak_memory_bytes(device),
        "peak_mem_bytes_by_phase": {} if device.type != "cuda" else {"train": peak_memory_bytes(device)},
        "final_loss": final_loss,
        "world_size": dist.get_world_size(),
        "device": device.type,
    }


def main(argv: list[str]) -> int:
    config_path, out_path = argv
    config = TrainConfig.read(config_path)
    try:
        result = train_bare(config)
        if dist.get_rank() == 0:
            Path(out_path).write_text(json.dumps(result, indent=2))
    finally:
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
