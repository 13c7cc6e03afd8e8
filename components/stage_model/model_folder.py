"""Stage a Hugging Face model folder (config.json, weights, tokenizer files) onto the volume.

The folder is staged exactly like a dataset, with the same code (components/stage_data):
listed, copied in parallel, verified, committed as an immutable snapshot under
`<mount>/rtp/models/<name>/snapshots/<id>/` with `current` switched atomically, and an
unchanged source transfers nothing. The model's name is the source's last path segment.
A folder without config.json is refused here, before any GPU is requested for training.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

from components.layout import check_name
from components.stage_data.errors import StageError
from components.stage_data.stage import stage_dataset

HF_CONFIG_FILE = "config.json"


def model_name_of(source: str) -> str:
    """tiny-llama for s3://bucket/models/tiny-llama/, /data/models/tiny-llama or ./tiny-llama."""
    if source.startswith("s3://"):
        path = source.removeprefix("s3://").rstrip("/")
        name = PurePosixPath(path).name if "/" in path else ""
    else:
        name = Path(source).resolve().name if source.strip() else ""
    if not name:
        raise StageError(
            f"model_source {source!r} must name a folder (s3://bucket/prefix/<model>/ or a local path): "
            "its last segment becomes the model's name on the volume"
        )
    try:
        return check_name("model name", name)
    except ValueError as exc:
        raise StageError(str(exc)) from None


def stage_model_folder(source: str, fsx_mount_path: str, endpoint_url: str | None = None) -> dict[str, Any]:
    """Stage the folder; returns the base model's metadata: model_name, model_dir (the
    snapshot, what the trainer's model.model_dir points at) and the stage's counts."""
    name = model_name_of(source)
    result = stage_dataset(source, fsx_mount_path, name, endpoint_url=endpoint_url, collection="models")
    if not (Path(result.snapshot_dir) / HF_CONFIG_FILE).is_file():
        raise StageError(
            f"{source} has no {HF_CONFIG_FILE} at its top: a model folder holds config.json, optional "
            "*.safetensors weights and the tokenizer files (save_pretrained writes exactly that)"
        )
    return {"model_name": name, "model_dir": result.snapshot_dir, **result.as_dict()}
