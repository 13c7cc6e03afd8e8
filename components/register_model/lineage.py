"""Lineage of a registered model version: where it came from, as MLflow version tags.

Every tag is a plain string under the `rtp.` prefix. `lineage_tags` is pure: it turns what
the register step knows (KFP run, dataset snapshot, checkpoint, trainer summary, code) into
tags, dropping values that are unknown rather than writing empty strings. The readers
below gather those facts from files; each tolerates what an older run did not write.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.config import TrainConfig

CODE_VERSION_ENV = "RTP_CODE_VERSION"
"""Set in the component image at build time (e.g. the git commit); wins over what can be
found out at run time."""

# What the model is, on every version since Hugging Face models: the champion lookup
# (components/validate_checkpoint/champion.py) scores the champion again with them.
KIND_TAG = "rtp.model_kind"
SEQ_LEN_TAG = "rtp.model_seq_len"
TOKENIZER_TAG = "rtp.tokenizer"
LORA_REGISTERED_TAG = "rtp.lora.registered"
"""On a LoRA checkpoint's version: `merged` (the version is the merged model) or `adapter`."""
VALIDATE_TAG_PREFIX = "rtp.validate."
PARENT_TAG_PREFIX = "rtp.parent."
PARENT_FIELDS = ("model_name", "version", "alias", "run_id", "dataset_snapshot_id", "checkpoint_uri")
"""The parent version's facts a warm-started version carries as rtp.parent.<field> tags."""

# Training-summary figures copied onto the version, when the trainer wrote them.
SUMMARY_FIGURES = ("goodput_pct", "efficiency_pct", "restarts", "checkpoint_blocked_s", "train_seconds")


@dataclass(frozen=True, slots=True)
class Lineage:
    kfp_run_id: str = ""
    pipeline_version: str = ""
    dataset_snapshot_id: str = ""
    dataset_manifest_sha256: str = ""
    checkpoint_uri: str = ""
    checkpoint_step: int | None = None
    checkpoint_sha256: str = ""
    training_config_sha256: str = ""
    code_version: str = ""
    training_figures: dict[str, Any] | None = None
    training_report: str = ""
    """The trainer's goodput report (goodput.html), logged as an artifact of the MLflow run."""
    validation_figures: dict[str, Any] | None = None
    """Holdout scores from the validate step's record (`validation_figures`)."""
    parent: dict[str, str] | None = None
    """The registered version training started from (`registry_source.Origin.as_dict()`); None
    for a model trained from random weights or an S3 folder."""


def lineage_tags(lineage: Lineage) -> dict[str, str]:
    raw: dict[str, Any] = {
        "rtp.kfp_run_id": lineage.kfp_run_id,
        "rtp.pipeline_version": lineage.pipeline_version,
        "rtp.dataset_snapshot_id": lineage.dataset_snapshot_id,
        "rtp.dataset_manifest_sha256": lineage.dataset_manifest_sha256,
        "rtp.checkpoint_uri": lineage.checkpoint_uri,
        "rtp.checkpoint_step": lineage.checkpoint_step,
        "rtp.checkpoint_sha256": lineage.checkpoint_sha256,
        "rtp.training_config_sha256": lineage.training_config_sha256,
        "rtp.code_version": lineage.code_version,
    }
    for name, value in (lineage.training_figures or {}).items():
        raw[f"rtp.train.{name}"] = value
    for name in PARENT_FIELDS:
        raw[f"{PARENT_TAG_PREFIX}{name}"] = (lineage.parent or {}).get(name)
    tags = {key: _tag_value(value) for key, value in raw.items() if value not in (None, "")}
    # Full precision: the champion lookup reads these back as numbers.
    for name, value in (lineage.validation_figures or {}).items():
        tags[f"{VALIDATE_TAG_PREFIX}{name}"] = repr(float(value))
    return tags


def _tag_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def training_config_sha256(config_dict: dict[str, Any]) -> str:
    """Hash of the full training config stored in the checkpoint (normalized through TrainConfig)."""
    return hashlib.sha256(TrainConfig.from_dict(config_dict).to_json().encode()).hexdigest()


def dataset_facts(dataset_dir: str | Path) -> tuple[str, str]:
    """(snapshot id, SHA-256 of manifest.json) of a staged snapshot; empty strings when absent."""
    manifest = Path(dataset_dir) / "manifest.json"
    if not manifest.is_file():
        return "", ""
    data = manifest.read_bytes()
    try:
        snapshot_id = str(json.loads(data).get("snapshot_id", ""))
    except ValueError:
        snapshot_id = ""
    return snapshot_id or Path(dataset_dir).name, hashlib.sha256(data).hexdigest()


def training_figures(summary_path: str | Path) -> dict[str, Any]:
    """Goodput, efficiency and restarts from the trainer's summary.json; {} when it is absent."""
    path = Path(summary_path)
    if not path.is_file():
        return {}
    try:
        summary = json.loads(path.read_text())
    except ValueError:
        return {}
    figures = {name: summary[name] for name in SUMMARY_FIGURES if summary.get(name) is not None}
    if isinstance(summary.get("restarts"), list):  # a list of restart records: count them
        figures["restarts"] = len(summary["restarts"])
    return figures


# validate step record field -> figure name on the version (rtp.validate.<name>).
VALIDATION_FIGURES = {
    "holdout_bits_per_byte": "holdout_bits_per_byte",
    "holdout_loss": "holdout_nats_per_token",
    "holdout_nats_per_byte": "holdout_nats_per_byte",
}


def validation_figures(record_path: str | Path) -> dict[str, Any]:
    """Holdout scores from the validate step's record (`<run>/steps/validate.json`, written by
    `components.layout.record_step`); {} when it is absent. An older record without bits per
    byte yields only what it has."""
    path = Path(record_path)
    if not path.is_file():
        return {}
    try:
        record = json.loads(path.read_text())
    except ValueError:
        return {}
    return {
        name: float(record[field])
        for field, name in VALIDATION_FIGURES.items()
        if isinstance(record.get(field), int | float)
    }


def code_version() -> str:
    """rtp's package version, plus the git commit when running from a checkout."""
    import os

    from components.versioning import source_identity

    if os.environ.get(CODE_VERSION_ENV):
        return os.environ[CODE_VERSION_ENV]
    version, commit, _ = source_identity(commit_length=12)
    return f"{version}+g{commit}" if commit else version


def parent_of(tags: dict[str, str]) -> tuple[str, str] | None:
    """(model name, version) a version's tags name as its parent; None for a first version."""
    name, version = tags.get(f"{PARENT_TAG_PREFIX}model_name"), tags.get(f"{PARENT_TAG_PREFIX}version")
    return (name, version) if name and version else None


def walk_lineage(client: Any, model_name: str, version: str, limit: int = 1000) -> list[Any]:
    """The version, its parent, the parent's parent... back to the first (ModelVersions, newest
    first). Stops at a version that is gone, and at a cycle."""
    chain: list[Any] = []
    seen: set[tuple[str, str]] = set()
    current: tuple[str, str] | None = (model_name, str(version))
    while current is not None and current not in seen and len(chain) < limit:
        seen.add(current)
        try:
            found = client.get_model_version(*current)
        except Exception as exc:  # a deleted parent ends the chain, said by its absence
            if getattr(exc, "error_code", "") == "RESOURCE_DOES_NOT_EXIST":
                break
            raise
        chain.append(found)
        current = parent_of(dict(found.tags or {}))
    return chain
