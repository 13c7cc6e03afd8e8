"""Decide whether a committed checkpoint is a usable model, on one CPU process.

Checks, in order, each naming the file or tensor at fault (a failure raises
CheckpointError): the checkpoint is committed and every file matches its SHA-256 manifest;
the stored tensors have the shapes the model config gives them; the optimizer state is
there when resuming is intended; the DCP shards load into one consolidated model (any
number of training ranks, no process group); every tensor is finite. Then the model is
scored on the dataset's holdout split (never trained on) and compared with `max_loss` and
with the current MLflow `champion`, scored by the same code on the same holdout bytes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from components.validate_checkpoint.checks import DECISIONS, decide, optimizer_problems, shape_problems
from trainer.checkpointing import storage
from trainer.config import ModelConfig, TrainConfig
from trainer.data import holdout_batches, load_tokens, split_files
from trainer.models import model_spec

__all__ = ["DECISIONS", "ValidationResult", "load_validated_model", "report_markdown", "validate_checkpoint"]


@dataclass(slots=True)
class ValidationResult:
    checkpoint_dir: str
    step: int
    holdout_loss: float
    perplexity: float
    holdout_bytes: int
    holdout_files: int
    decision: str
    max_loss: float
    min_improvement: float
    champion_version: str | None = None
    champion_loss: float | None = None
    checks: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    @property
    def delta(self) -> float | None:
        """champion_loss - holdout_loss: positive when the candidate is better."""
        return None if self.champion_loss is None else self.champion_loss - self.holdout_loss

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "delta": self.delta}


def stored_tensor_shapes(checkpoint_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Shapes of every tensor in a DCP checkpoint, from its metadata (no tensor data read)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = dcp.FileSystemReader(str(checkpoint_dir)).read_metadata()
    except Exception as exc:  # a torn or foreign .metadata file: say which
        raise storage.CheckpointError(f"{Path(checkpoint_dir) / '.metadata'} is unreadable: {exc}") from exc
    return {
        key: tuple(entry.size)
        for key, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    model = model_spec(config.kind).build(config, torch.device("meta"))  # shapes only: no memory
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def load_validated_model(
    checkpoint_dir: str | Path, require_optimizer_state: bool = False, checks: list[str] | None = None
) -> tuple[nn.Module, TrainConfig, dict[str, Any]]:
    """Verify and load a checkpoint into a plain model (one CPU process); raise CheckpointError naming the problem.

    `checks`, when given, receives one line per check that passed (for the report).
    """
    passed = checks if checks is not None else []
    storage.verify_checkpoint(checkpoint_dir, verify_hashes=True)
    meta = storage.read_meta(checkpoint_dir)
    passed.append(f"committed (marker, DCP metadata, meta.json) at step {meta['step']}")
    passed.append("every file in the SHA-256 manifest present with the right size and hash")
    config = TrainConfig.from_dict(meta["config"])
    stored = stored_tensor_shapes(checkpoint_dir)
    expected = expected_shapes(config.model)
    problems = shape_problems(stored, expected)
    if problems:
        raise storage.CheckpointError(f"{checkpoint_dir}: {'; '.join(problems)}")
    passed.append(f"all {len(expected)} model tensors have the shapes the model config gives")
    if require_optimizer_state:
        problems = optimizer_problems(stored, expected)
        if problems:
            raise storage.CheckpointError(f"{checkpoint_dir} cannot be resumed: {'; '.join(problems)}")
        passed.append("optimizer state present for every parameter (the run can resume from it)")
    model = model_spec(config.model.kind).build(config.model, torch.device("cpu"))
    storage.load_model_weights(checkpoint_dir, model)
    world_size = meta.get("world_size", "?")
    passed.append(f"saved by {world_size} rank(s), consolidated into one state dict on one CPU process")
    for name, tensor in model.state_dict().items():
        if not torch.isfinite(tensor).all():
            bad = int((~torch.isfinite(tensor)).sum())
            raise storage.CheckpointError(
                f"tensor {name!r} in {checkpoint_dir} holds {bad} NaN or Inf value(s)"
            )
    passed.append(f"all {len(expected)} tensors finite")
    return model, config, meta


def holdout_tokens(dataset_dir: str | Path, holdout_fraction: float) -> tuple[torch.Tensor, int]:
    """The holdout split's bytes (defined by the snapshot manifest) and its file count."""
    _, holdout = split_files(dataset_dir, holdout_fraction)
    return load_tokens(holdout), len(holdout)


@torch.no_grad()
def loss_on_tokens(model: nn.Module, tokens: torch.Tensor, config: ModelConfig | None = None) -> float:
    """Mean next-token loss (nats per token; per byte for byte-lm) over fixed, evenly spaced
    holdout windows. `config` defaults to the model's own (`model.cfg`, byte-lm bundles)."""
    model.eval()
    total, count = 0.0, 0
    config = config or cast(ModelConfig, model.cfg)
    spec = model_spec(config.kind)
    for batch in holdout_batches(tokens, config.seq_len):
        total += spec.loss(model, batch).item() * batch.shape[0]
        count += batch.shape[0]
    return total / count


def holdout_loss(model: nn.Module, dataset_dir: str, holdout_fraction: float) -> tuple[float, int]:
    tokens, _ = holdout_tokens(dataset_dir, holdout_fraction)
    return loss_on_tokens(model, tokens), int(tokens.numel())


def validate_checkpoint(
    checkpoint_dir: str,
    dataset_dir: str,
    max_loss: float,
    *,
    min_improvement: float = 0.0,
    champion_model_name: str = "",
    require_optimizer_state: bool = False,
    retry: Any = None,
) -> ValidationResult:
    """Check and score a checkpoint; compare it with the champion of `champion_model_name`
    in MLflow (skipped when the name is empty). `retry` is a RetryPolicy for MLflow calls."""
    checks: list[str] = []
    model, config, meta = load_validated_model(checkpoint_dir, require_optimizer_state, checks)
    tokens, files = holdout_tokens(dataset_dir, config.data.holdout_fraction)
    loss = loss_on_tokens(model, tokens, config.model)
    checks.append(
        f"holdout split: {files} file(s), {tokens.numel()} bytes, chosen by key hash from the "
        f"snapshot manifest (holdout_fraction {config.data.holdout_fraction}); never trained on"
    )
    champion_loss, champion_version, label = None, None, "the champion"
    if champion_model_name:
        from components.validate_checkpoint.champion import load_champion

        champion = load_champion(champion_model_name, retry)
        if champion is None:
            checks.append(f"MLflow: {champion_model_name} has no champion yet")
        else:
            champion_loss = loss_on_tokens(champion.model, tokens)
            champion_version, label = champion.version, champion.label
            checks.append(f"MLflow: {champion.label} scored with the same code on the same holdout bytes")
    verdict = decide(loss, max_loss, champion_loss, min_improvement, label)
    return ValidationResult(
        checkpoint_dir=str(checkpoint_dir),
        step=int(meta["step"]),
        holdout_loss=loss,
        perplexity=math.exp(min(loss, 50.0)),
        holdout_bytes=int(tokens.numel()),
        holdout_files=files,
        decision=verdict.decision,
        max_loss=max_loss,
        min_improvement=min_improvement,
        champion_version=champion_version,
        champion_loss=champion_loss,
        checks=checks,
        reasons=verdict.reasons,
    )


def report_markdown(result: ValidationResult) -> str:
    """What was checked, the numbers, the decision and why."""

    def number(value: float | None, fmt: str = ".4f") -> str:
        return "—" if value is None else format(value, fmt)

    champion = f"v{result.champion_version}" if result.champion_version else "none"
    lines = [
        f"# Checkpoint validation: **{result.decision}**",
        "",
        f"Checkpoint `{result.checkpoint_dir}` (step {result.step}).",
        "",
        "## Checks passed",
        *[f"- {check}" for check in result.checks],
        "",
        "## Numbers",
        "",
        "| measure | value |",
        "|---|---|",
        f"| holdout loss (nats/byte) | {number(result.holdout_loss)} |",
        f"| perplexity | {number(result.perplexity, '.2f')} |",
        f"| max_loss | {result.max_loss} |",
        f"| champion | {champion} |",
        f"| champion's holdout loss | {number(result.champion_loss)} |",
        f"| improvement over champion (champion - candidate) | {number(result.delta, '+.4f')} |",
        f"| min_improvement | {result.min_improvement} |",
        f"| holdout size | {result.holdout_files} file(s), {result.holdout_bytes} bytes |",
        "",
        f"## Decision: {result.decision}",
        *[f"- {reason}" for reason in result.reasons],
        "",
        {
            "champion": "The register step registers this model and moves the `champion` alias to it.",
            "challenger": "The register step registers this model as `challenger`; `champion` stays.",
            "reject": "The model is not registered.",
        }[result.decision],
    ]
    return "\n".join(lines) + "\n"
