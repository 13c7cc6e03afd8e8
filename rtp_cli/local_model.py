"""`rtp local --model-source`: where the model and its data come from in a local run.

A local model folder is put into the embedded S3 beside the demo corpus tokenized with the
model's own tokenizer, so the pipeline stages both from S3 exactly as it would a user's
bucket (the stage-model step snapshots the folder under <mount>/rtp/models/<name>/). An
s3:// model source is used as given, with the `--source` data the user tokenized for it
(`rtp prepare-data --tokenizer`). `plan_model_run` decides which case applies and refuses
combinations that cannot work, before any server starts.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rtp_cli.errors import UserError


@dataclass(frozen=True, slots=True)
class ModelPlan:
    """How a local run gets its model: `folder` set means upload it to the embedded S3."""

    name: str
    """The model's name: the source's last path segment (its folder on the volume)."""
    folder: Path | None
    """A local model folder to upload and tokenize the demo corpus with; None for s3://."""
    registry: bool = False
    """models:/<name>@<alias>: a registered version (`name` is the registered model's)."""


def plan_model_run(model_source: str, data_source: str) -> ModelPlan:
    """Check `--model-source` against `--source`; UserError names the fix."""
    from components.stage_data.errors import StageError
    from components.stage_model.model_folder import model_name_of
    from components.stage_model.registry_source import is_registry_reference, parse_reference

    try:
        if is_registry_reference(model_source):
            return ModelPlan(name=parse_reference(model_source).name, folder=None, registry=True)
        name = model_name_of(model_source)
    except StageError as exc:
        raise UserError(str(exc)) from None
    if model_source.startswith("s3://"):
        if not data_source:
            raise UserError(
                f"--model-source {model_source} needs --source s3://… with data tokenized by its tokenizer "
                "(rtp prepare-data --tokenizer MODEL_DIR --dest s3://…); or give a local model folder, "
                "whose tokenizer then tokenizes the demo corpus"
            )
        return ModelPlan(name=name, folder=None)
    if data_source:
        raise UserError(
            "a local --model-source folder goes into the embedded S3 with the demo corpus; with --source, "
            "upload the model folder to S3 too and give --model-source s3://…"
        )
    folder = Path(model_source)
    check_model_folder(folder)
    return ModelPlan(name=name, folder=folder.resolve())


def check_model_folder(folder: Path) -> None:
    """UserError unless `folder` holds a config.json transformers knows and tokenizer files."""
    from trainer.models import ModelError
    from trainer.models.hf_causal_lm import read_hf_config, tokenizer_identity

    if not folder.is_dir():
        raise UserError(
            f"--model-source {folder}: no such folder; give a Hugging Face model folder "
            "(config.json, *.safetensors, tokenizer files) or s3://bucket/prefix/<model>/"
        )
    try:
        read_hf_config(folder)
        tokenizer_identity(folder)
    except ModelError as exc:
        raise UserError(str(exc)) from None


def upload_model_folder(client: Any, folder: Path, bucket: str, prefix: str) -> int:
    """Upload the folder's files (not hidden ones, not symlinks) under `prefix`; returns the count."""
    files = [
        path
        for path in sorted(folder.rglob("*"))
        if path.is_file()
        and not path.is_symlink()
        and not path.relative_to(folder).as_posix().startswith(".")
    ]
    for path in files:
        client.upload_file(str(path), bucket, f"{prefix}{path.relative_to(folder).as_posix()}")
    return len(files)


def upload_demo_tokens(client: Any, bucket: str, prefix: str, tokenizer_dir: Path) -> dict[str, Any]:
    """The demo corpus tokenized with the folder's tokenizer, uploaded as `rtp prepare-data
    --tokenizer` would; returns the shard index."""
    from components.stage_data.prepare_data import upload_shards
    from rtp_support.demo_data import DEMO_SHARD_BYTES, demo_corpus
    from trainer.tokenized_data import tokenize_files

    files = [path for _, path in demo_corpus()]
    with tempfile.TemporaryDirectory(prefix="rtp-demo-tokens-") as tmp:
        index = tokenize_files(files, Path(tmp), tokenizer_dir, DEMO_SHARD_BYTES, workers=2)
        upload_shards(client, Path(tmp), bucket, prefix)
    return index


def download_tokenizer_files(model_source: str, folder: Path) -> tuple[str, Path | None]:
    """The kind of the version `model_source` names now and, for a Hugging Face one, its
    model folder without the weights (config and tokenizer files) downloaded into `folder`."""
    import mlflow

    from components.stage_data.errors import StageError
    from components.stage_model.registry_source import (
        PAYLOAD_FOLDERS,
        origin_from_version,
        parse_reference,
        resolve,
    )

    reference = parse_reference(model_source)
    try:
        origin = origin_from_version(resolve(reference), reference)
    except StageError as exc:
        raise UserError(str(exc)) from None
    if origin.kind != "hf":
        return origin.kind, None
    base = f"models:/{origin.model_name}/{origin.version}/{PAYLOAD_FOLDERS['hf']}"
    landed = folder
    for entry in mlflow.artifacts.list_artifacts(artifact_uri=base):
        name = Path(entry.path).name
        if not entry.is_dir and not name.endswith(".safetensors"):
            # MLflow keeps the artifact's folder under dst_path (`<folder>/model/<name>`):
            # the files are where it says it put them, not directly in `folder`.
            path = mlflow.artifacts.download_artifacts(artifact_uri=f"{base}/{name}", dst_path=str(folder))
            landed = Path(path).parent
    return origin.kind, landed
