"""Decide whether a committed checkpoint is a usable model, on one CPU process.

Checks, in order, each naming the file or tensor at fault (a failure raises
CheckpointError): the checkpoint is committed and every file matches its SHA-256 manifest;
the stored tensors have the shapes the model config gives them; the optimizer state is
there when resuming is intended; the DCP shards load into one consolidated model (any
number of training ranks, no process group); every tensor is finite. Then the model is
scored on the dataset's holdout split (never trained on): nats per token and bits per byte
(`scoring.py`), and compared with `max_loss` and with the current MLflow `champion`, scored
by the same code on the same holdout text, in bytes, so tokenizers may differ.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from components.validate_checkpoint.checks import DECISIONS, decide, optimizer_problems, shape_problems
from components.validate_checkpoint.scoring import HoldoutScore, retokenized_windows, score_windows
from trainer.checkpointing import storage
from trainer.config import ModelConfig, TrainConfig
from trainer.data import TokenStream, holdout_batches, load_tokens, split_files
from trainer.models import model_spec

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from components.validate_checkpoint.champion import Champion

__all__ = ["DECISIONS", "ValidationResult", "load_validated_model", "report_markdown", "validate_checkpoint"]


@dataclass(slots=True)
class ValidationResult:
    checkpoint_dir: str
    step: int
    holdout_loss: float
    """Nats per token (per byte for the byte LM), on the evaluated holdout windows."""
    perplexity: float
    """Per token: exp(holdout_loss)."""
    holdout_bits_per_byte: float
    """The same loss per UTF-8 byte of the predicted tokens, in bits: what the champion
    comparison uses (nats per byte = this x ln 2 is what max_loss is compared with)."""
    holdout_tokens: int
    """Tokens in the holdout split."""
    holdout_files: int
    decision: str
    max_loss: float
    min_improvement: float
    evaluated_tokens: int = 0
    evaluated_bytes: int = 0
    model_kind: str = "byte-lm"
    champion_version: str | None = None
    champion_loss: float | None = None
    """The champion's nats per token, with its own tokenizer."""
    champion_bits_per_byte: float | None = None
    champion_recorded_bits_per_byte: float | None = None
    """What the champion scored when it was validated (None: registered before rtp recorded it)."""
    checks: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    @property
    def holdout_nats_per_byte(self) -> float:
        return self.holdout_bits_per_byte * math.log(2)

    @property
    def delta_bits_per_byte(self) -> float | None:
        """champion - candidate, bits per byte: positive when the candidate is better."""
        if self.champion_bits_per_byte is None:
            return None
        return self.champion_bits_per_byte - self.holdout_bits_per_byte

    @property
    def delta(self) -> float | None:
        """champion - candidate in nats per byte (the unit of min_improvement): positive when
        the candidate is better. For the byte LM: champion_loss - holdout_loss, as before."""
        delta = self.delta_bits_per_byte
        return None if delta is None else delta * math.log(2)

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "holdout_nats_per_byte": self.holdout_nats_per_byte,
            "delta": self.delta,
            "delta_bits_per_byte": self.delta_bits_per_byte,
        }


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
    checkpoint_dir: str | Path,
    require_optimizer_state: bool = False,
    checks: list[str] | None = None,
    published_manifest_sha256: str | None = None,
) -> tuple[nn.Module, TrainConfig, dict[str, Any]]:
    """Verify and load a checkpoint into a plain model (one CPU process); raise CheckpointError naming the problem.

    `checks`, when given, receives one line per check that passed (for the report). With
    `published_manifest_sha256` (the train step's output), the checkpoint must be the one
    the train step published, checked before any file of it is read beyond its manifest.
    """
    passed = checks if checks is not None else []
    if published_manifest_sha256 is not None:
        storage.verify_published(checkpoint_dir, published_manifest_sha256)
        passed.append("the manifest is the one the train step published")
    else:
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


def holdout_tokens(dataset_dir: str | Path, holdout_fraction: float) -> tuple[TokenStream, int]:
    """The holdout split's tokens, memory-mapped (bytes for byte data; defined by the snapshot manifest),
    and its file count."""
    _, holdout = split_files(dataset_dir, holdout_fraction)
    return load_tokens(holdout), len(holdout)


def holdout_score(model: nn.Module, tokens: TokenStream | torch.Tensor, config: ModelConfig) -> HoldoutScore:
    """Nats per token and bits per byte over fixed, evenly spaced holdout windows."""
    spec = model_spec(config.kind)
    return score_windows(model, spec.loss, holdout_batches(tokens, config.seq_len), spec.tokenizer(config))


def loss_on_tokens(
    model: nn.Module, tokens: TokenStream | torch.Tensor, config: ModelConfig | None = None
) -> float:
    """Mean next-token loss (nats per token; per byte for byte-lm) over the holdout windows.
    `config` defaults to the model's own (`model.cfg`, byte-lm bundles)."""
    return holdout_score(model, tokens, config or cast(ModelConfig, model.cfg)).nats_per_token


def champion_score(
    champion: Champion, tokens: TokenStream | torch.Tensor, config: ModelConfig
) -> HoldoutScore:
    """The champion on the candidate's holdout windows: the same tokens when it has the same
    tokenizer, else the windows' text encoded with its own tokenizer."""
    spec = model_spec(champion.kind)
    candidate_tokenizer = model_spec(config.kind).tokenizer(config)
    assert champion.tokenizer is not None
    if champion.tokenizer_identity == candidate_tokenizer.identity and champion.seq_len == config.seq_len:
        batches = holdout_batches(tokens, config.seq_len)
    else:
        batches = retokenized_windows(
            holdout_batches(tokens, config.seq_len), candidate_tokenizer, champion.tokenizer, champion.seq_len
        )
    return score_windows(champion.model, spec.loss, batches, champion.tokenizer)


def validate_checkpoint(
    checkpoint_dir: str,
    dataset_dir: str,
    max_loss: float,
    *,
    min_improvement: float = 0.0,
    champion_model_name: str = "",
    require_optimizer_state: bool = False,
    retry: Any = None,
    published_manifest_sha256: str | None = None,
) -> ValidationResult:
    """Check and score a checkpoint; compare it with the champion of `champion_model_name`
    in MLflow (skipped when the name is empty). `retry` is a RetryPolicy for MLflow calls."""
    checks: list[str] = []
    model, config, meta = load_validated_model(
        checkpoint_dir, require_optimizer_state, checks, published_manifest_sha256
    )
    tokens, files = holdout_tokens(dataset_dir, config.data.holdout_fraction)
    score = holdout_score(model, tokens, config.model)
    checks.append(
        f"holdout split: {files} file(s), {tokens.numel()} tokens, chosen by key hash from the "
        f"snapshot manifest (holdout_fraction {config.data.holdout_fraction}); never trained on"
    )
    checks.append(
        f"scored on {score.tokens} predicted tokens = {score.bytes} UTF-8 bytes "
        f"({'one byte per token' if config.model.kind == 'byte-lm' else 'decoded with the model tokenizer'})"
    )
    champion, champion_scored = None, None
    if champion_model_name:
        from components.validate_checkpoint.champion import load_champion

        champion = load_champion(champion_model_name, retry, default_seq_len=config.model.seq_len)
        if champion is None:
            checks.append(f"MLflow: {champion_model_name} has no champion yet")
        else:
            champion_scored = champion_score(champion, tokens, config.model)
            recorded = (
                f"{champion.recorded_bits_per_byte:.4f} bits/byte at its own validation"
                if champion.recorded_bits_per_byte is not None
                else "no bits per byte recorded at its registration (an older rtp): scored here only"
            )
            checks.append(
                f"MLflow: {champion.label} ({champion.kind}) scored with the same code on the same "
                f"holdout text ({recorded})"
            )
    verdict = decide(
        score.nats_per_byte,
        max_loss,
        None if champion_scored is None else champion_scored.nats_per_byte,
        min_improvement,
        champion.label if champion else "the champion",
    )
    return ValidationResult(
        checkpoint_dir=str(checkpoint_dir),
        step=int(meta["step"]),
        holdout_loss=score.nats_per_token,
        perplexity=math.exp(min(score.nats_per_token, 50.0)),
        holdout_bits_per_byte=score.bits_per_byte,
        holdout_tokens=int(tokens.numel()),
        holdout_files=files,
        decision=verdict.decision,
        max_loss=max_loss,
        min_improvement=min_improvement,
        evaluated_tokens=score.tokens,
        evaluated_bytes=score.bytes,
        model_kind=config.model.kind,
        champion_version=champion.version if champion else None,
        champion_loss=None if champion_scored is None else champion_scored.nats_per_token,
        champion_bits_per_byte=None if champion_scored is None else champion_scored.bits_per_byte,
        champion_recorded_bits_per_byte=champion.recorded_bits_per_byte if champion else None,
        checks=checks,
        reasons=verdict.reasons,
    )


def report_markdown(result: ValidationResult) -> str:
    """What was checked, the numbers, the decision and why."""

    def number(value: float | None, fmt: str = ".4f") -> str:
        return "—" if value is None else format(value, fmt)

    champion = f"v{result.champion_version}" if result.champion_version else "none"
    if result.champion_version is None:
        recorded = "—"
    elif result.champion_recorded_bits_per_byte is None:
        recorded = "not recorded (registered by an older rtp)"
    else:
        recorded = number(result.champion_recorded_bits_per_byte)
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
        f"| holdout loss (nats/token) | {number(result.holdout_loss)} |",
        f"| holdout loss (bits/byte) | {number(result.holdout_bits_per_byte)} |",
        f"| holdout loss (nats/byte, compared with max_loss) | {number(result.holdout_nats_per_byte)} |",
        f"| perplexity (per token) | {number(result.perplexity, '.2f')} |",
        f"| max_loss (nats/byte) | {result.max_loss} |",
        f"| champion | {champion} |",
        f"| champion's holdout loss (nats/token, its tokenizer) | {number(result.champion_loss)} |",
        f"| champion's holdout loss (bits/byte) | {number(result.champion_bits_per_byte)} |",
        f"| champion's bits/byte recorded at its validation | {recorded} |",
        f"| improvement over champion (bits/byte, champion - candidate) | "
        f"{number(result.delta_bits_per_byte, '+.4f')} |",
        f"| improvement over champion (nats/byte) | {number(result.delta, '+.4f')} |",
        f"| min_improvement (nats/byte) | {result.min_improvement} |",
        f"| holdout size | {result.holdout_files} file(s), {result.holdout_tokens} tokens |",
        f"| evaluated | {result.evaluated_tokens} predicted tokens, {result.evaluated_bytes} bytes |",
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


def log_to_training_run(run_id: str, result: ValidationResult, step: int) -> None:
    """The holdout scores and the decision on the MLflow run of the training's live metrics,
    at the checkpoint's step. Best effort: the decision stands even if MLflow does not answer."""
    import mlflow
    from mlflow.entities import Metric, RunTag

    now_ms = int(time.time() * 1000)
    figures = {
        "holdout.loss": result.holdout_loss,
        "holdout.perplexity": result.perplexity,
        "holdout.bits_per_byte": result.holdout_bits_per_byte,
    }
    try:
        mlflow.MlflowClient().log_batch(
            run_id,
            metrics=[Metric(key, float(value), now_ms, step) for key, value in figures.items()],
            tags=[RunTag("rtp.validate.decision", result.decision)],
        )
    except Exception as exc:  # the validate step's answer does not depend on this record
        log.warning("could not log the holdout scores to MLflow run %s: %s", run_id, exc)
