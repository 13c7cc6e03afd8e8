"""A registered model version as the model source: `models:/<name>@<alias>` or `models:/<name>/<version>`.

Continual training starts from what the registry holds (a nightly run from the champion).
The stage-model step resolves an alias to a version once; the version, not the alias, is
recorded and staged, so the rest of the run uses it even if the alias moves meanwhile.
The version's own files are downloaded from MLflow's artifact store (the byte LM's bundle,
`artifacts/`; a Hugging Face export, `model/`), checked against the manifest rtp wrote when
it registered the version (`file_manifest.py`: every file's size and SHA-256, the manifest's
hash in the version's `rtp.files_sha256` tag), and published atomically as

    <mount>/rtp/models/<name>/versions/<version>/        the model folder (model.model_dir)
    <mount>/rtp/models/<name>/versions/<version>.json    what it is (`origin_of` reads it)

A version already there is not downloaded again (its sizes are checked). The validate and
register steps find the parent from the checkpoint's own `model.model_dir` (`origin_of`),
so the lineage says what the weights really started from.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from components.mlflow_access import RetryPolicy, call_with_retries, check_model_name, step_deadline
from components.register_model.file_manifest import FILES_TAG, MANIFEST_FILE, ManifestError, verify_folder
from components.register_model.lineage import KIND_TAG, LORA_REGISTERED_TAG, TOKENIZER_TAG
from components.stage_data.errors import StageError
from trainer.events import write_json_atomic

log = logging.getLogger(__name__)

PREFIX = "models:/"
_REFERENCE = re.compile(r"models:/(?P<name>[^/@]+)(?:@(?P<alias>[A-Za-z0-9_-]+)|/(?P<version>[0-9]+))")
PAYLOAD_FOLDERS = {"byte-lm": "artifacts", "hf": "model"}
"""Where each kind's model folder sits inside a version's artifacts."""
_ABSENT = "RESOURCE_DOES_NOT_EXIST"


def is_registry_reference(source: str) -> bool:
    return source.startswith(PREFIX)


@dataclass(frozen=True, slots=True)
class Reference:
    name: str
    alias: str = ""
    version: str = ""

    def __str__(self) -> str:
        return f"{PREFIX}{self.name}@{self.alias}" if self.alias else f"{PREFIX}{self.name}/{self.version}"


def parse_reference(source: str) -> Reference:
    match = _REFERENCE.fullmatch(source.strip())
    if not match:
        raise StageError(
            f"model_source {source!r} is not a registry reference: write models:/<name>@<alias> "
            "(e.g. models:/rtp-model@champion) or models:/<name>/<version>"
        )
    try:
        check_model_name(match["name"])
    except ValueError as exc:
        raise StageError(str(exc)) from None
    return Reference(match["name"], match["alias"] or "", match["version"] or "")


@dataclass(frozen=True, slots=True)
class Origin:
    """A staged registered version: what the register and validate steps record as the parent."""

    model_name: str
    version: str
    alias: str
    """The alias it was resolved from; empty for models:/<name>/<version>."""
    run_id: str
    """The MLflow run the version was logged in (its training run)."""
    kind: str
    tokenizer: str
    dataset_snapshot_id: str
    """The snapshot the parent was trained on (its rtp.dataset_snapshot_id tag)."""
    checkpoint_uri: str
    checkpoint_sha256: str
    """The manifest SHA-256 of the checkpoint the version was exported from."""
    files_sha256: str

    def as_dict(self) -> dict[str, str]:
        return asdict(self)

    @property
    def label(self) -> str:
        return f"{self.model_name} v{self.version}" + (f" ({self.alias})" if self.alias else "")


def _require_tracking_uri(reference: Reference) -> None:
    from components.mlflow_access import tracking_uri_is_configured

    if not tracking_uri_is_configured():
        raise StageError(
            f"model_source {reference} is a registry reference but no MLflow is configured: set "
            "MLFLOW_TRACKING_URI (the pipeline's mlflow_secret_name secret; rtp local --mlflow-uri), "
            "or give an s3:// model folder"
        )


def resolve(reference: Reference, retry: RetryPolicy | None = None) -> Any:
    """The ModelVersion the reference names now; StageError says what does not exist."""
    import mlflow
    from mlflow.exceptions import MlflowException

    _require_tracking_uri(reference)
    client = mlflow.MlflowClient()

    def lookup() -> Any:
        try:
            registered = client.get_registered_model(reference.name)
        except MlflowException as exc:
            if exc.error_code == _ABSENT:
                raise StageError(
                    f"model_source {reference}: MLflow has no registered model {reference.name!r}; "
                    "register one first (a run with model_source empty or an s3:// folder)"
                ) from None
            raise
        if reference.alias:
            aliases = dict(registered.aliases or {})
            if reference.alias not in aliases:
                known = ", ".join(f"{a} -> v{v}" for a, v in sorted(aliases.items())) or "none"
                raise StageError(
                    f"model_source {reference}: {reference.name} has no alias {reference.alias!r} "
                    f"(its aliases: {known}); name an alias it has or a version, models:/{reference.name}/<version>"
                )
            return client.get_model_version(reference.name, str(aliases[reference.alias]))
        try:
            return client.get_model_version(reference.name, reference.version)
        except MlflowException as exc:
            if exc.error_code == _ABSENT:
                raise StageError(
                    f"model_source {reference}: {reference.name} has no version {reference.version}"
                ) from None
            raise

    with step_deadline(retry):
        return call_with_retries(f"resolve {reference}", lookup, retry)


def origin_from_version(version: Any, reference: Reference) -> Origin:
    """What the version is, from its tags; StageError when it is not an rtp export."""
    tags = dict(version.tags or {})
    kind = tags.get(KIND_TAG, "")
    if kind not in PAYLOAD_FOLDERS or not tags.get(FILES_TAG):
        raise StageError(
            f"model_source {reference}: {version.name} v{version.version} is not an rtp export "
            f"(no {KIND_TAG} or {FILES_TAG} tag: registered by another tool, or by rtp before it recorded "
            "its files); register it with rtp, or give its files as an s3:// model folder"
        )
    if tags.get(LORA_REGISTERED_TAG) == "adapter":
        raise StageError(
            f"model_source {reference}: {version.name} v{version.version} is a LoRA adapter registered "
            f"without its merged model (register_merged=false; base {tags.get('rtp.lora.base_source', '?')}): "
            "continue from a version registered with register_merged=true"
        )
    return Origin(
        model_name=str(version.name),
        version=str(version.version),
        alias=reference.alias,
        run_id=str(version.run_id or ""),
        kind=kind,
        tokenizer=tags.get(TOKENIZER_TAG, ""),
        dataset_snapshot_id=tags.get("rtp.dataset_snapshot_id", ""),
        checkpoint_uri=tags.get("rtp.checkpoint_uri", ""),
        checkpoint_sha256=tags.get("rtp.checkpoint_sha256", ""),
        files_sha256=tags[FILES_TAG],
    )


def versions_dir(fsx_mount_path: str | Path, model_name: str) -> Path:
    return Path(fsx_mount_path) / "rtp" / "models" / model_name / "versions"


def origin_of(model_dir: str | Path) -> Origin | None:
    """The registered version a staged model folder is, from the record beside it; None for
    a folder staged from S3 (or none)."""
    if not model_dir:
        return None
    folder = Path(model_dir)
    record = folder.parent / f"{folder.name}.json"
    if folder.parent.name != "versions" or not record.is_file():
        return None
    try:
        return Origin(**json.loads(record.read_text())["origin"])
    except (ValueError, KeyError, TypeError):
        return None


def stage_registered_model(
    source: str, fsx_mount_path: str | Path, retry: RetryPolicy | None = None
) -> dict[str, Any]:
    """Resolve, download, verify and publish the version; returns the base model's metadata."""
    started = time.monotonic()
    reference = parse_reference(source)
    version = resolve(reference, retry)
    origin = origin_from_version(version, reference)
    root = versions_dir(fsx_mount_path, origin.model_name)
    target, record = root / origin.version, root / f"{origin.version}.json"
    downloaded = 0
    if _already_staged(target, record, origin):
        try:
            verify_folder(target, origin.files_sha256, hashes=False)
        except ManifestError as exc:  # another run may be training from it: never replaced here
            raise StageError(
                f"{origin.label} staged at {target} is damaged ({exc}); delete that folder and retry"
            ) from None
        log.info("%s is staged already at %s: nothing downloaded", origin.label, target)
    else:
        downloaded = _download(origin, root, target, retry)
        write_json_atomic(record, {"origin": origin.as_dict(), "staged_at": time.time()})
    log.info("model_source %s resolved to %s, staged at %s", reference, origin.label, target)
    return {
        "model_name": origin.model_name,
        "model_dir": str(target),
        "model_kind": origin.kind,
        "registry": origin.as_dict(),
        "bytes_downloaded": downloaded,
        "seconds": round(time.monotonic() - started, 3),
    }


def _already_staged(target: Path, record: Path, origin: Origin) -> bool:
    if not (target.is_dir() and record.is_file()):
        return False
    try:
        return json.loads(record.read_text())["origin"]["files_sha256"] == origin.files_sha256
    except (ValueError, KeyError, TypeError):
        return False


def _download(origin: Origin, root: Path, target: Path, retry: RetryPolicy | None) -> int:
    """Download the version's model folder beside `target`, verify it, rename it into place."""
    import mlflow

    root.mkdir(parents=True, exist_ok=True)
    payload = PAYLOAD_FOLDERS[origin.kind]
    incoming = Path(tempfile.mkdtemp(prefix=f".incoming-{origin.version}-", dir=root))
    try:
        with step_deadline(retry):
            local = Path(
                call_with_retries(
                    f"download {origin.label}",
                    lambda: mlflow.artifacts.download_artifacts(
                        artifact_uri=f"models:/{origin.model_name}/{origin.version}/{payload}",
                        dst_path=str(incoming),
                    ),
                    retry,
                )
            )
        try:
            entries = verify_folder(local, origin.files_sha256)
        except ManifestError as exc:
            raise StageError(
                f"{origin.label} refused: {exc}; re-register the model or stage another version"
            ) from None
        listed = {entry["path"] for entry in entries}
        for path in sorted(local.rglob("*"), reverse=True):  # only the registered files are staged
            relative = path.relative_to(local).as_posix()
            if path.is_file() and relative not in listed and path.name != MANIFEST_FILE:
                path.unlink()
        if target.exists():  # a concurrent stage of the same version published it first
            return 0
        os.replace(local, target)
        return sum(entry["size"] for entry in entries)
    finally:
        shutil.rmtree(incoming, ignore_errors=True)


def parent_checkpoint(origin: Origin, fsx_mount_path: str | Path) -> tuple[Path | None, str]:
    """The parent's committed training checkpoint on this volume, or None and why not: it must
    be there, committed, and have the manifest the version was exported from."""
    from components.retention import run_of_checkpoint
    from trainer.checkpointing import storage

    run = run_of_checkpoint(origin.checkpoint_uri)
    if not run or not origin.checkpoint_sha256:
        return None, f"{origin.label} records no checkpoint on an rtp volume"
    step_folder = origin.checkpoint_uri.rstrip("/").rsplit("/", 1)[-1]
    path = Path(fsx_mount_path) / "rtp" / "runs" / run / "checkpoints" / step_folder
    if not (path / storage.COMMIT_MARKER).is_file():
        return None, f"{path} (the checkpoint {origin.label} came from) is no longer on the volume"
    if storage.manifest_sha256(path) != origin.checkpoint_sha256:
        return None, f"{path} is not the checkpoint {origin.label} was exported from (its manifest differs)"
    return path, ""
