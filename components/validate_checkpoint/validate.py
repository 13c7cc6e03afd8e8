"""Decide whether a committed checkpoint is a usable model, on one CPU process.

Checks, in order, each naming the file or tensor at fault: the checkpoint is committed
and every file matches its SHA-256 manifest; the DCP shards load into the model (any
number of training ranks, no process group); every tensor is finite; the loss on the
dataset's holdout split (never trained on) is below `max_loss`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer import checkpoint
from trainer.config import TrainConfig
from trainer.data import holdout_batches, load_tokens, split_files
from trainer.model import ByteLM, next_token_loss

DECISIONS = ("champion", "reject")


@dataclass(slots=True)
class ValidationResult:
    checkpoint_dir: str
    step: int
    holdout_loss: float
    perplexity: float
    holdout_bytes: int
    decision: str
    reasons: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_validated_model(checkpoint_dir: str | Path) -> tuple[ByteLM, TrainConfig, dict[str, Any]]:
    """Verify and load a checkpoint into a plain ByteLM; raise CheckpointError naming the problem."""
    checkpoint.verify_checkpoint(checkpoint_dir, verify_hashes=True)
    meta = checkpoint.read_meta(checkpoint_dir)
    config = TrainConfig.from_dict(meta["config"])
    model = ByteLM(config.model)
    checkpoint.load_model_weights(checkpoint_dir, model)
    for name, tensor in model.state_dict().items():
        if not torch.isfinite(tensor).all():
            raise checkpoint.CheckpointError(f"tensor {name!r} in {checkpoint_dir} holds NaN or Inf values")
    return model, config, meta


@torch.no_grad()
def holdout_loss(model: ByteLM, dataset_dir: str, holdout_fraction: float) -> tuple[float, int]:
    _, holdout = split_files(dataset_dir, holdout_fraction)
    tokens = load_tokens(holdout)
    model.eval()
    total, count = 0.0, 0
    for batch in holdout_batches(tokens, model.cfg.seq_len):
        total += next_token_loss(model, batch).item() * batch.shape[0]
        count += batch.shape[0]
    return total / count, int(tokens.numel())


def validate_checkpoint(checkpoint_dir: str, dataset_dir: str, max_loss: float) -> ValidationResult:
    model, config, meta = load_validated_model(checkpoint_dir)
    loss, holdout_bytes = holdout_loss(model, dataset_dir, config.data.holdout_fraction)
    reasons = [
        f"checkpoint step {meta['step']} committed; all manifest files match their SHA-256",
        f"all {len(model.state_dict())} tensors finite",
    ]
    if loss <= max_loss:
        decision = "champion"
        reasons.append(f"holdout loss {loss:.4f} <= max_loss {max_loss}")
    else:
        decision = "reject"
        reasons.append(f"holdout loss {loss:.4f} > max_loss {max_loss}")
    return ValidationResult(
        checkpoint_dir=str(checkpoint_dir),
        step=int(meta["step"]),
        holdout_loss=loss,
        perplexity=math.exp(min(loss, 50.0)),
        holdout_bytes=holdout_bytes,
        decision=decision,
        reasons=reasons,
    )


def report_markdown(result: ValidationResult) -> str:
    lines = [
        f"# Checkpoint validation: **{result.decision}**",
        "",
        f"- checkpoint: `{result.checkpoint_dir}` (step {result.step})",
        f"- holdout loss: {result.holdout_loss:.4f} nats/byte, perplexity {result.perplexity:.2f}",
        f"- holdout size: {result.holdout_bytes} bytes",
        "",
        "## Checks",
        *[f"- {reason}" for reason in result.reasons],
    ]
    return "\n".join(lines) + "\n"
