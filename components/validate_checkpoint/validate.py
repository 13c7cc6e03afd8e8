"""Decide whether a committed checkpoint is a usable model, without consolidating a large one.

Checks, in order, each naming the file or tensor at fault (a failure raises
CheckpointError): the checkpoint is committed and every file matches its SHA-256 manifest
(hashed in chunks); the stored tensors have the shapes the model config gives them (from the
DCP metadata); the optimizer state is there when resuming is intended; every model tensor is
finite, read from the DCP shards a few at a time within a byte budget (any number of training
ranks, no process group), which also gives the weights' SHA-256 (`model_sha256`'s value).

Then the holdout score (nats per token and bits per byte, on the dataset's holdout split,
never trained on). The training ranks score the model after the last step and write
`<workdir>/eval.json` (trainer/evaluation.py); the record is used when it belongs to this
checkpoint: the same weights SHA-256, step, model kind and holdout windows. Otherwise a small
model is loaded into this process and scored here; a model above `max_in_process_bytes` is
refused, naming what to do. The score is compared with `max_loss` and with the current MLflow
`champion` on the same holdout windows, in bytes, so tokenizers may differ. The record's
champion score is used when it is of the version the alias points at now (the training ranks
scored it sharded: `data.eval_champion`); otherwise the champion is loaded whole and scored
here by the same code (`champion.py`), one above `max_in_process_bytes` refused.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from components.validate_checkpoint.checks import (
    DECISIONS,
    MODEL_PREFIX,
    decide,
    eval_record_problems,
    optimizer_problems,
    parameter_names,
    shape_problems,
)
from components.validate_checkpoint.scoring import HoldoutScore, champion_windows, score_windows
from trainer.checkpointing import storage
from trainer.config import ModelConfig, TrainConfig
from trainer.data import TokenStream, holdout_batches, load_tokens, shard_index, split_files
from trainer.evaluation import EVAL_RECORD, holdout_identity, read_eval_record
from trainer.lora import adapter_identity, adapter_problem, build_model
from trainer.models import model_spec

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from components.validate_checkpoint.champion import Champion

__all__ = [
    "DECISIONS",
    "ValidationResult",
    "check_model_tensors",
    "load_validated_model",
    "report_markdown",
    "stream_model_tensors",
    "validate_checkpoint",
]

MIB = 2**20
TENSOR_BUDGET_BYTES = 64 * MIB
"""Model tensors read from the shards at once (a larger single tensor is read alone)."""
MAX_IN_PROCESS_BYTES = 4 * 2**30
"""Largest model (stored bytes) scored in this process when no eval record of the training fits."""
DEFAULT_WINDOWS = 64


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
    scored_by: str = "validate"
    """training: the eval record the training ranks wrote; validate: scored in this process."""
    champion_scored_by: str | None = None
    """The same for the champion (None: no champion)."""
    weights_sha256: str = ""
    """SHA-256 of the checkpoint's model tensors (the train summary's `model_sha256`)."""
    parent_version: str | None = None
    """The registered version training started from (a models:/ model source); None otherwise."""
    started_from: str = ""
    """That version and the snapshots, in words, for the report."""
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
    return _expected(TrainConfig(model=config))[0]


def _expected(config: TrainConfig) -> tuple[dict[str, tuple[int, ...]], list[tuple[str, ...]]]:
    """(state-dict name -> shape, one tuple of names per distinct parameter) of what a
    checkpoint of `config` holds of the model, built on the meta device (no memory); tied
    names share a tuple. Frozen parameters (a LoRA run's base) are not in a checkpoint."""
    model = build_model(config, torch.device("meta"))
    named = list(model.named_parameters(remove_duplicate=False))
    frozen = {name for name, p in named if not p.requires_grad}
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items() if name not in frozen}
    return shapes, parameter_names((name, p) for name, p in named if name not in frozen)


def _model_entries(checkpoint_dir: str | Path) -> list[tuple[str, Any]]:
    """(parameter name, TensorStorageMetadata) of every model tensor, sorted by name."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = dcp.FileSystemReader(str(checkpoint_dir)).read_metadata()
    except Exception as exc:  # a torn or foreign .metadata file: say which
        raise storage.CheckpointError(f"{Path(checkpoint_dir) / '.metadata'} is unreadable: {exc}") from exc
    return sorted(
        (key[len(MODEL_PREFIX) :], entry)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(MODEL_PREFIX) and isinstance(entry, TensorStorageMetadata)
    )


def _stored_bytes(entry: Any) -> int:
    return math.prod(entry.size) * torch.empty((), dtype=entry.properties.dtype).element_size()


def model_stored_bytes(checkpoint_dir: str | Path) -> int:
    """Bytes of the model tensors in a checkpoint, from its metadata."""
    return sum(_stored_bytes(entry) for _, entry in _model_entries(checkpoint_dir))


def base_model_bytes(config: TrainConfig) -> int:
    """Bytes of the frozen base a LoRA checkpoint's adapters are loaded onto (0 for full training)."""
    if config.training.method != "lora":
        return 0
    return sum(p.stat().st_size for p in Path(config.model.model_dir).glob("*.safetensors"))


def stream_model_tensors(
    checkpoint_dir: str | Path, budget_bytes: int = TENSOR_BUDGET_BYTES
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of every model tensor in sorted name order, read from the DCP shards
    in groups of at most `budget_bytes` (one process, no group): the model is never whole."""
    import torch.distributed.checkpoint as dcp

    def read(group: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        try:
            dcp.load(group, storage_reader=dcp.FileSystemReader(str(checkpoint_dir)), no_dist=True)
        except Exception as exc:  # DCP raises a bare CheckpointException listing rank errors
            raise storage.CheckpointError(f"cannot read model tensors from {checkpoint_dir}: {exc}") from exc
        return group

    group: dict[str, torch.Tensor] = {}
    group_bytes = 0
    for name, entry in _model_entries(checkpoint_dir):
        size = _stored_bytes(entry)
        if group and group_bytes + size > budget_bytes:
            for key, tensor in read(group).items():
                yield key[len(MODEL_PREFIX) :], tensor
            group, group_bytes = {}, 0
        group[MODEL_PREFIX + name] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        group_bytes += size
    if group:
        for key, tensor in read(group).items():
            yield key[len(MODEL_PREFIX) :], tensor


def check_model_tensors(
    checkpoint_dir: str | Path, budget_bytes: int = TENSOR_BUDGET_BYTES
) -> tuple[str, int]:
    """Every model tensor finite, streamed from the shards; returns (weights SHA-256, tensor count).

    The SHA-256 hashes what `trainer.checkpointing.model_sha256` hashes (each key, then its
    values, in sorted key order), so it equals the train summary's for the final checkpoint."""
    digest = hashlib.sha256()
    count = 0
    for name, tensor in stream_model_tensors(checkpoint_dir, budget_bytes):
        finite = torch.isfinite(tensor)
        if not finite.all():
            raise storage.CheckpointError(
                f"tensor {name!r} in {checkpoint_dir} holds {int((~finite).sum())} NaN or Inf value(s)"
            )
        digest.update(name.encode())
        digest.update(tensor.contiguous().numpy().data)
        count += 1
    return digest.hexdigest(), count


def _verify_files(
    checkpoint_dir: str | Path,
    require_optimizer_state: bool,
    passed: list[str],
    published_manifest_sha256: str | None,
) -> tuple[TrainConfig, dict[str, Any], dict[str, tuple[int, ...]]]:
    """Integrity (manifest, SHA-256), shapes and optimizer state; no tensor data is loaded."""
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
    expected, parameters = _expected(config)
    problems = shape_problems(stored, expected)
    if problems:
        raise storage.CheckpointError(f"{checkpoint_dir}: {'; '.join(problems)}")
    passed.append(f"all {len(expected)} model tensors have the shapes the model config gives")
    if require_optimizer_state:
        problems = optimizer_problems(stored, parameters)
        if problems:
            raise storage.CheckpointError(f"{checkpoint_dir} cannot be resumed: {'; '.join(problems)}")
        passed.append("optimizer state present for every parameter (the run can resume from it)")
    return config, meta, expected


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
    config, meta, expected = _verify_files(
        checkpoint_dir, require_optimizer_state, passed, published_manifest_sha256
    )
    model = _load_model(checkpoint_dir, config, meta, passed)
    for name, tensor in model.state_dict().items():
        if not torch.isfinite(tensor).all():
            bad = int((~torch.isfinite(tensor)).sum())
            raise storage.CheckpointError(
                f"tensor {name!r} in {checkpoint_dir} holds {bad} NaN or Inf value(s)"
            )
    passed.append(f"all {len(expected)} tensors finite")
    return model, config, meta


def _load_model(
    checkpoint_dir: str | Path, config: TrainConfig, meta: dict[str, Any], passed: list[str]
) -> nn.Module:
    problem = adapter_problem(meta.get("adapters"), adapter_identity(config), config.model)
    if problem:  # the base a LoRA checkpoint's adapters apply to must be model.model_dir's
        raise storage.CheckpointError(f"{checkpoint_dir} cannot be loaded: {problem}")
    model = build_model(config, torch.device("cpu"))
    storage.load_model_weights(checkpoint_dir, model)
    if meta.get("adapters"):
        passed.append(
            f"LoRA adapters on the base model in {config.model.model_dir} "
            f"(weights {meta['adapters']['base_weights_sha256'][:24]}…, the one they were trained on)"
        )
    world_size = meta.get("world_size", "?")
    passed.append(f"saved by {world_size} rank(s), consolidated into one state dict on one CPU process")
    return model


def holdout_tokens(dataset_dir: str | Path, holdout_fraction: float) -> tuple[TokenStream, int]:
    """The holdout split's tokens, memory-mapped (bytes for byte data; defined by the snapshot manifest),
    and its file count."""
    _, holdout = split_files(dataset_dir, holdout_fraction)
    return load_tokens(holdout), len(holdout)


def holdout_score(
    model: nn.Module,
    tokens: TokenStream | torch.Tensor,
    config: ModelConfig,
    max_windows: int = DEFAULT_WINDOWS,
) -> HoldoutScore:
    """Nats per token and bits per byte over fixed, evenly spaced holdout windows."""
    spec = model_spec(config.kind)
    batches = holdout_batches(tokens, config.seq_len, max_windows=max_windows)
    return score_windows(model, spec.loss, batches, spec.tokenizer(config))


def loss_on_tokens(
    model: nn.Module, tokens: TokenStream | torch.Tensor, config: ModelConfig | None = None
) -> float:
    """Mean next-token loss (nats per token; per byte for byte-lm) over the holdout windows.
    `config` defaults to the model's own (`model.cfg`, byte-lm bundles)."""
    return holdout_score(model, tokens, config or cast(ModelConfig, model.cfg)).nats_per_token


def champion_score(
    champion: Champion, batches: list[torch.Tensor], config: ModelConfig, held: Any = None
) -> HoldoutScore:
    """The champion on the candidate's holdout windows `batches`: the same tokens when it has the
    same tokenizer, else the windows' text encoded with its own tokenizer. With `held` (holdout
    conversations, data.format=examples), the same rows and mask: the same tokenizer and chat
    template are required, since another would render the conversations differently."""
    spec = model_spec(champion.kind)
    candidate_tokenizer = model_spec(config.kind).tokenizer(config)
    assert champion.tokenizer is not None
    if held is not None:
        from trainer.examples_eval import score_examples

        if champion.tokenizer_identity != candidate_tokenizer.identity:
            raise storage.CheckpointError(
                f"{champion.label} uses another tokenizer or chat template ({champion.tokenizer_identity[:12]}, "
                f"the candidate {candidate_tokenizer.identity[:12]}): conversations rendered for one cannot "
                "score the other; register the fine-tuned model under a new name, or fine-tune from the champion"
            )
        return score_examples(champion.model, held, champion.tokenizer)
    windows = champion_windows(
        batches,
        candidate_tokenizer,
        champion.tokenizer,
        champion.tokenizer_identity,
        champion.seq_len,
        config.seq_len,
    )
    return score_windows(champion.model, spec.loss, windows, champion.tokenizer)


def _recorded_champion(
    record: dict[str, Any] | None, model_name: str, version: Any
) -> tuple[HoldoutScore | None, str]:
    """The record's score of the champion `version`, or None and why it is not usable."""
    entry = (record or {}).get("champion")
    if record is None:
        return None, "no eval record of the training is used"
    if not isinstance(entry, dict):
        return None, "the eval record holds no champion score (train with data.eval_champion=<model name>)"
    if not entry.get("scored"):
        return None, f"no champion scored in training: {entry.get('reason', 'no reason recorded')}"
    if entry.get("model_name") != model_name or str(entry.get("version")) != str(version.version):
        return None, (
            f"the training scored {entry.get('model_name')} v{entry.get('version')}, "
            f"but the {model_name} champion is v{version.version} now"
        )
    if entry.get("run_id") and version.run_id and entry["run_id"] != version.run_id:
        return (
            None,
            f"the training scored v{entry['version']} of run {entry['run_id']}, not of run {version.run_id}",
        )
    return HoldoutScore(float(entry["nats_total"]), int(entry["tokens"]), int(entry["bytes"])), ""


def _record_candidates(checkpoint_dir: str | Path, config: TrainConfig) -> list[Path]:
    """Where the training's eval record lies: its workdir, or two levels above a step folder
    (the default <workdir>/checkpoints/step_<N> layout, for a run folder that moved)."""
    here = Path(checkpoint_dir).resolve().parent.parent / EVAL_RECORD
    return list(dict.fromkeys([Path(config.run.workdir) / EVAL_RECORD, here]))


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
    eval_record: str | None = None,
    max_in_process_bytes: int = MAX_IN_PROCESS_BYTES,
    tensor_budget_bytes: int = TENSOR_BUDGET_BYTES,
) -> ValidationResult:
    """Check and score a checkpoint; compare it with the champion of `champion_model_name`
    in MLflow (skipped when the name is empty). `retry` is a RetryPolicy for MLflow calls.

    `eval_record`: the training's eval.json (None: looked for in the run's workdir; "": not
    used). Without a record that belongs to this checkpoint, a model of at most
    `max_in_process_bytes` is scored in this process; a larger one is refused."""
    checks: list[str] = []
    config, meta, _ = _verify_files(
        checkpoint_dir, require_optimizer_state, checks, published_manifest_sha256
    )
    weights_sha256, count = check_model_tensors(checkpoint_dir, tensor_budget_bytes)
    checks.append(
        f"all {count} model tensors finite, read from the shards of {meta.get('world_size', '?')} rank(s) "
        f"at most {max(tensor_budget_bytes, 1) / MIB:.0f} MiB at a time (weights SHA-256 {weights_sha256[:16]}…)"
    )
    windows = config.data.eval_windows or DEFAULT_WINDOWS
    held = None
    if config.data.format == "examples":  # conversations: the assistant tokens of holdout examples
        from trainer.examples_eval import example_holdout

        eos = model_spec(config.model.kind).tokenizer(config.model).eos_id
        held = example_holdout(dataset_dir, config.model.seq_len, windows, eos)
        batches: list[torch.Tensor] = []
        identity = held.identity(config.model.seq_len)
        files, token_count = held.holdout_examples, held.tokens
        checks.append(
            f"holdout split: {files} conversation(s), {token_count} tokens, chosen by conversation content when "
            f"the data was prepared; never trained on; {held.examples} scored on the assistant's tokens only"
        )
    else:
        _, holdout = split_files(dataset_dir, config.data.holdout_fraction)
        tokens = load_tokens(holdout)
        files, token_count = len(holdout), tokens.numel()
        batches = holdout_batches(tokens, config.model.seq_len, max_windows=windows)
        identity = holdout_identity(holdout, batches, config.model.seq_len)
        index = shard_index(dataset_dir)
        rule = (
            f"by document content when the data was prepared (holdout fraction {index['split']['holdout_fraction']})"
            if index and "split" in index
            else f"by key hash from the snapshot manifest (holdout_fraction {config.data.holdout_fraction})"
        )
        checks.append(
            f"holdout split: {files} file(s), {token_count} tokens, chosen {rule}; never trained on"
        )
    score, scored_by, used_record = None, "validate", None
    if eval_record is None:
        paths = _record_candidates(checkpoint_dir, config)
    else:
        paths = [Path(eval_record)] if eval_record else []
    why_not = f"no {EVAL_RECORD} in {' or '.join(str(p.parent) for p in paths)}" if paths else "not asked for"
    for path in paths:
        record = read_eval_record(path)
        if record is None:
            continue
        problems = eval_record_problems(
            record, weights_sha256, int(meta["step"]), config.model.kind, identity
        )
        if problems:
            why_not = f"{path}: {'; '.join(problems)}"
            continue
        score, scored_by = (
            HoldoutScore(float(record["nats_total"]), int(record["tokens"]), int(record["bytes"])),
            "training",
        )
        used_record = record
        checks.append(
            f"holdout scored by the training ranks after step {record['step']} ({path}): the record's "
            "weights SHA-256, step, model kind and holdout windows are this checkpoint's"
        )
        break
    if score is None:
        stored_bytes = model_stored_bytes(checkpoint_dir) + base_model_bytes(config)
        if stored_bytes > max_in_process_bytes:
            raise storage.CheckpointError(
                f"{checkpoint_dir}: no eval record of the training for these weights ({why_not}) and its "
                f"{stored_bytes / 2**30:.1f} GiB model is above the {max_in_process_bytes / 2**30:.1f} GiB "
                "bound for scoring in one process: train with data.eval_windows > 0 (the default), so the "
                f"training ranks write <workdir>/{EVAL_RECORD}, then validate again"
            )
        log.info("scoring %s in this process: %s", checkpoint_dir, why_not)
        model = _load_model(checkpoint_dir, config, meta, checks)
        spec = model_spec(config.model.kind)
        if held is not None:
            from trainer.examples_eval import score_examples

            score = score_examples(model, held, spec.tokenizer(config.model))
        else:
            score = score_windows(model, spec.loss, batches, spec.tokenizer(config.model))
        checks.append(f"holdout scored in this process ({why_not})")
        del model
    checks.append(
        f"scored on {score.tokens} predicted tokens = {score.bytes} UTF-8 bytes "
        f"({'one byte per token' if config.model.kind == 'byte-lm' else 'decoded with the model tokenizer'})"
    )
    champion, champion_scored, champion_version, champion_scored_by = None, None, None, None
    champion_label, champion_recorded = "the champion", None
    if champion_model_name:
        from components.validate_checkpoint import champion as registry

        version = registry.champion_version(champion_model_name, retry)
        if version is None:
            checks.append(f"MLflow: {champion_model_name} has no champion yet")
        else:
            champion_version = str(version.version)
            champion_label = f"champion {champion_model_name} v{champion_version}"
            champion_recorded = registry.version_tags(version)["recorded_bits_per_byte"]
            champion_scored, why_not_recorded = _recorded_champion(used_record, champion_model_name, version)
        if champion_scored is not None:
            champion_scored_by = "training"
            entry = cast(dict[str, Any], used_record)["champion"]
            checks.append(
                f"MLflow: {champion_label} scored by the training ranks on the same holdout windows, "
                f"loaded sharded from its files (SHA-256 {str(entry.get('files_sha256', ''))[:16]}…); "
                "not downloaded here"
            )
        elif version is not None:
            weight_bytes = registry.champion_weight_bytes(champion_model_name, version, retry)
            if weight_bytes > max_in_process_bytes:
                raise storage.CheckpointError(
                    f"{champion_label}: {why_not_recorded}, and its {weight_bytes / 2**30:.1f} GiB of weights are "
                    f"above the {max_in_process_bytes / 2**30:.1f} GiB bound for scoring in one process: train "
                    f"with data.eval_champion={champion_model_name} so the training ranks score it, then validate again"
                )
            log.info("scoring %s in this process: %s", champion_label, why_not_recorded)
            champion = registry.download_champion(
                champion_model_name, version, retry, default_seq_len=config.model.seq_len
            )
            champion_scored, champion_scored_by = (
                champion_score(champion, batches, config.model, held),
                "validate",
            )
            recorded = (
                f"{champion.recorded_bits_per_byte:.4f} bits/byte at its own validation"
                if champion.recorded_bits_per_byte is not None
                else "no bits per byte recorded at its registration (an older rtp): scored here only"
            )
            checks.append(
                f"MLflow: {champion.label} ({champion.kind}) scored in this process with the same code on "
                f"the same holdout text ({recorded}; {why_not_recorded})"
            )
    parent_version, started_from = _started_from(config, dataset_dir, champion_version, checks)
    verdict = decide(
        score.nats_per_byte,
        max_loss,
        None if champion_scored is None else champion_scored.nats_per_byte,
        min_improvement,
        champion_label,
    )
    return ValidationResult(
        checkpoint_dir=str(checkpoint_dir),
        step=int(meta["step"]),
        holdout_loss=score.nats_per_token,
        perplexity=math.exp(min(score.nats_per_token, 50.0)),
        holdout_bits_per_byte=score.bits_per_byte,
        holdout_tokens=int(token_count),
        holdout_files=files,
        decision=verdict.decision,
        max_loss=max_loss,
        min_improvement=min_improvement,
        evaluated_tokens=score.tokens,
        evaluated_bytes=score.bytes,
        model_kind=config.model.kind,
        champion_version=champion_version,
        champion_loss=None if champion_scored is None else champion_scored.nats_per_token,
        champion_bits_per_byte=None if champion_scored is None else champion_scored.bits_per_byte,
        champion_recorded_bits_per_byte=champion_recorded,
        scored_by=scored_by,
        champion_scored_by=champion_scored_by,
        weights_sha256=weights_sha256,
        parent_version=parent_version,
        started_from=started_from,
        checks=checks,
        reasons=verdict.reasons,
    )


def _started_from(
    config: TrainConfig, dataset_dir: str, champion_version: str | None, checks: list[str]
) -> tuple[str | None, str]:
    """(parent version, a line for the report) when training started from a registered version."""
    from components.register_model.lineage import dataset_facts
    from components.stage_model.registry_source import origin_of

    origin = origin_of(config.model.model_dir) if config.model.init == "pretrained" else None
    if origin is None:
        return None, ""
    snapshot, _ = dataset_facts(dataset_dir)
    line = (
        f"started from {origin.label}, which was trained on snapshot {origin.dataset_snapshot_id or 'unknown'}; "
        f"trained on snapshot {snapshot or 'unknown'}"
    )
    if champion_version is not None and champion_version != origin.version:
        line += f"; the champion is v{champion_version} now (the alias moved since): compared with it"
    checks.append(line)
    return origin.version, line


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
        *([f"| started from | {result.started_from} |"] if result.started_from else []),
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
