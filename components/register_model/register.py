"""Log a validated checkpoint to MLflow as a servable model and register a version with an alias.

What is logged depends on the model's kind:
- byte-lm: an MLflow pyfunc that generates text (`serving_model.py`), with the consolidated
  weights (safetensors), the model config and the tokenizer description as artifacts
  (`bundle.py`), a signature and an input example;
- hf: the checkpoint exported to Hugging Face format tensor by tensor, in the source
  model's dtype, onto the shared volume next to the run's checkpoints (`streamed_export.py`),
  and that folder logged by path through MLflow's transformers flavor (`hf_export.py`),
  loadable by `mlflow.transformers`, `mlflow.pyfunc` and transformers; the model is never
  held in memory whole;
- a LoRA checkpoint (`training.method=lora`, `lora_export.py`): the adapter in PEFT's format
  (adapter_config.json naming the staged base folder + adapter_model.safetensors) and, with
  `register_merged` (the default), the base with the adapter merged in, exported streamed in
  the source dtype as for a fully trained model; the merged model is the version (servable
  anywhere, a chat model when the tokenizer has a chat template) and the adapter is logged
  beside it in the same run (`adapter/`). With `register_merged=false` the version is the
  adapter itself, logged with MLflow's transformers flavor on its base folder by path
  (`mlflow models serve` then needs that folder where it runs). Tags name the base
  (`rtp.lora.base_model_dir`, `rtp.lora.base_source`, `rtp.lora.base_weights_sha256`).
Either version carries lineage tags (`lineage.py`), a manifest of its files (`file_manifest.py`:
`rtp_files.json` beside them, its SHA-256 in `rtp.files_sha256`), what the model is (`rtp.model_kind`,
`rtp.model_seq_len`, `rtp.tokenizer`) and, when the validate step's record is given, its
holdout scores (`rtp.validate.*`, also the run's metrics), which the champion lookup reads.
The alias is the validate step's decision: `champion` moves only when the new model beat
the current one, otherwise the version becomes `challenger`.

Registration is idempotent and never leaves a half-registered version:
- a version is found by the checkpoint's manifest SHA-256 tag; registering the same
  checkpoint again (a KFP retry, a re-run) returns it instead of creating a duplicate;
- a found version that is PENDING_REGISTRATION belongs to a registration still under way
  (a concurrent task): it is waited for, never deleted;
- a found version that failed registration or has no weights is deleted and registered anew;
- a version created here is checked (READY, weights present) before any alias points at
  it, and deleted again if that check or setting the alias fails; a version this step did
  not create is never deleted;
- a request whose answer was lost is retried; looking for the version first makes the
  retry return the version the server did create.
The model name is checked before it reaches a search filter. Every server call is retried
with backoff, all of them within one deadline for the step (`components.mlflow_access`).
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

import trainer
from components.mlflow_access import RetryPolicy, call_with_retries, check_model_name, step_deadline
from components.register_model import hf_export, lora_export, streamed_export
from components.register_model.bundle import WEIGHTS_FILE, pip_requirements, write_bundle
from components.register_model.file_manifest import FILES_TAG, MANIFEST_FILE, write_manifest
from components.register_model.lineage import (
    KIND_TAG,
    SEQ_LEN_TAG,
    TOKENIZER_TAG,
    Lineage,
    code_version,
    lineage_tags,
    training_config_sha256,
)
from components.stage_model.registry_source import origin_of
from components.validate_checkpoint.validate import load_validated_model
from trainer.checkpointing import storage
from trainer.checkpointing.storage import manifest_sha256
from trainer.config import TrainConfig

log = logging.getLogger(__name__)

ALIASES = ("champion", "challenger")
EXPERIMENT = "rtp"
SERVING_MODEL = Path(__file__).with_name("serving_model.py")
SHA_TAG = "rtp.checkpoint_sha256"
READY_TIMEOUT_S = 300.0
PENDING = "PENDING_REGISTRATION"


class RegistrationError(RuntimeError):
    """A version could not be registered completely; what was created has been removed."""


@dataclass(frozen=True, slots=True)
class LoraRegistration:
    """What is logged for a LoRA checkpoint: its adapter, and the merged export (None when
    `register_merged` is false: the adapter is the version)."""

    checkpoint_dir: str
    facts: lora_export.AdapterFacts
    merged: streamed_export.ExportResult | None
    dtype: str
    """The dtype the version loads in: the merged export's, else the base's source dtype."""


@dataclass(frozen=True, slots=True)
class RegisterResult:
    model_name: str
    version: str
    alias: str
    model_uri: str
    created: bool
    model_kind: str = "byte-lm"
    adapter_uri: str = ""
    """A LoRA checkpoint's adapter (PEFT's format) in the artifact store; empty otherwise."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def checkpoint_sha256(checkpoint_dir: str | Path) -> str:
    """Identifies a checkpoint: the SHA-256 of its manifest (which holds every file's SHA-256)."""
    return manifest_sha256(checkpoint_dir)


def _ensure_experiment(mlflow: Any, tracking_uri: str) -> None:
    """Local sqlite stores keep artifacts beside the database instead of in ./mlruns."""
    if mlflow.get_experiment_by_name(EXPERIMENT) is None:
        parsed = urlparse(tracking_uri)
        location = None
        if parsed.scheme == "sqlite":
            db_path = Path(tracking_uri[len("sqlite:///") :])
            location = (db_path.parent / "mlartifacts").resolve().as_uri()
        try:
            mlflow.create_experiment(EXPERIMENT, artifact_location=location)
        except Exception:
            # A retried call may find the experiment created by the attempt that timed out.
            if mlflow.get_experiment_by_name(EXPERIMENT) is None:
                raise
    mlflow.set_experiment(EXPERIMENT)


def _literal(value: str) -> str:
    """`value` as a quoted search-filter string. MLflow's filter grammar has no escape for a
    quote, so a value holding one is refused (names are checked up front; SHA-256s are hex)."""
    if any(c in value for c in "'\"\\`"):
        raise ValueError(f"{value!r} cannot be used in an MLflow search filter (it holds a quote)")
    return f"'{value}'"


def _find_version(client: Any, model_name: str, sha: str) -> Any | None:
    """The newest version registered from this checkpoint, or None."""
    if not client.search_registered_models(filter_string=f"name = {_literal(model_name)}"):
        return None
    found = client.search_model_versions(
        f"name = {_literal(model_name)} and tags.`{SHA_TAG}` = {_literal(sha)}"
    )
    return max(found, key=lambda v: int(v.version)) if found else None


def _version_is_complete(client: Any, model_name: str, version: Any) -> bool:
    """READY and its weights are in the artifact store (byte LM: artifacts/weights.safetensors;
    hf: model/*.safetensors). A listing that fails raises: only a listing that succeeds
    without the weights proves the version incomplete."""
    import mlflow

    if str(version.status) != "READY":
        return False
    if (version.tags or {}).get(lora_export.HOLDS_TAG) == "adapter":
        return lora_export.has_adapter(
            mlflow.artifacts.list_artifacts(
                artifact_uri=f"models:/{model_name}/{version.version}/{lora_export.PEFT_FOLDER}"
            )
        )
    if (version.tags or {}).get(KIND_TAG) == "hf":
        return hf_export.has_weights(
            mlflow.artifacts.list_artifacts(
                artifact_uri=f"models:/{model_name}/{version.version}/{hf_export.MODEL_FOLDER}"
            )
        )
    listing = mlflow.artifacts.list_artifacts(
        artifact_uri=f"models:/{model_name}/{version.version}/artifacts"
    )
    return any(Path(item.path).name == WEIGHTS_FILE for item in listing)


def model_tags(config: Any) -> dict[str, str]:
    """What the champion lookup needs to score this model again: kind, window, tokenizer."""
    from trainer.models import model_spec

    return {
        KIND_TAG: config.model.kind,
        SEQ_LEN_TAG: str(config.model.seq_len),
        TOKENIZER_TAG: model_spec(config.model.kind).tokenizer(config.model).identity,
    }


def _await_ready(
    client: Any,
    model_name: str,
    version: str,
    timeout_s: float = READY_TIMEOUT_S,
    *,
    failed_is_error: bool = True,
) -> Any:
    """The version once READY. A FAILED_REGISTRATION one is returned as it is when
    `failed_is_error` is False (the caller replaces it); still pending at the timeout raises."""
    deadline = time.monotonic() + timeout_s
    while True:
        current = client.get_model_version(model_name, version)
        if str(current.status) == "READY":
            return current
        if str(current.status) == "FAILED_REGISTRATION" and not failed_is_error:
            return current
        if str(current.status) == "FAILED_REGISTRATION" or time.monotonic() > deadline:
            raise RegistrationError(
                f"{model_name} version {version} is {current.status}: {current.status_message or 'no message'}"
                + (
                    ""
                    if failed_is_error
                    else "; another registration of this checkpoint holds it: retry later"
                )
            )
        time.sleep(1.0)


def _delete_version(client: Any, model_name: str, version: str, retry: RetryPolicy | None) -> None:
    """Best effort: a version that could not be completed must not stay visible."""
    try:
        call_with_retries(
            f"delete incomplete version {version} of {model_name}",
            lambda: client.delete_model_version(model_name, version),
            retry,
        )
        log.warning("deleted incomplete %s version %s", model_name, version)
    except Exception as exc:
        log.error("could not delete incomplete %s version %s: %s", model_name, version, exc)


def _set_alias(client: Any, model_name: str, decision: str, version: Any, retry: RetryPolicy | None) -> str:
    """Point the decision's alias at `version`; a version that already is the champion stays so
    (re-validating the champion itself gives it no improvement over itself)."""
    alias = decision
    if decision == "challenger":
        # search results carry no aliases: ask for the version itself
        current = call_with_retries(
            f"read {model_name} version {version.version}",
            lambda: client.get_model_version(model_name, version.version),
            retry,
        )
        if "champion" in (current.aliases or []):
            return "champion"
    call_with_retries(
        f"set alias {alias} of {model_name} to version {version.version}",
        lambda: client.set_registered_model_alias(model_name, alias, version.version),
        retry,
    )
    return alias


def _signature() -> Any:
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    return ModelSignature(
        inputs=Schema([ColSpec("string", "prompt")]),
        outputs=Schema([ColSpec("string")]),
        params=ParamSchema(
            [ParamSpec("max_new_tokens", "long", 64), ParamSpec("temperature", "double", 0.0)]
        ),
    )


def _log_model(
    model: Any,
    config: Any,
    meta: dict[str, Any],
    tags: dict[str, str],
    lineage: Lineage | None = None,
    training_run_id: str = "",
) -> Any:
    """The model (and the training report) in an MLflow run: the run that holds the
    training's live metrics when `training_run_id` is given (so the version points at the run
    that trained it), else a new one. `model` is the byte LM's module, or the ExportResult of a
    Hugging Face model's export, or a LoRA checkpoint's LoraRegistration. Returns its ModelInfo."""
    import mlflow
    import pandas as pd

    if not training_run_id:
        _ensure_experiment(mlflow, mlflow.get_tracking_uri())
    with (
        tempfile.TemporaryDirectory() as tmp,
        mlflow.start_run(
            run_id=training_run_id or None,
            run_name=None if training_run_id else f"register-step-{meta['step']}",
        ) as run,
    ):
        if isinstance(model, LoraRegistration):
            return _log_lora(model, config, meta, tags, lineage, run)
        # The manifest of the files logged below: its SHA-256 is a tag of the run and the version.
        if config.model.kind == "hf":
            tags[FILES_TAG] = write_manifest(model.folder)
        else:
            artifacts = write_bundle(model, tmp, metadata={"step": str(meta["step"]), SHA_TAG: tags[SHA_TAG]})
            tags[FILES_TAG] = write_manifest(tmp)
            artifacts["files"] = str(Path(tmp) / MANIFEST_FILE)
        _log_run_facts(config, meta, tags, lineage)
        if config.model.kind == "hf":
            mlflow.set_tags({"rtp.export.dtype": model.dtype, "rtp.export.files": str(len(model.files))})
            info = hf_export.log_hf_model(model.folder, getattr(torch, model.dtype))
            log.info("logged model %s in MLflow run %s", info.model_uri, run.info.run_id)
            return info
        info = mlflow.pyfunc.log_model(
            name="model",
            python_model=str(SERVING_MODEL),
            artifacts=artifacts,
            code_paths=[str(Path(trainer.__file__).parent)],
            signature=_signature(),
            input_example=pd.DataFrame({"prompt": ["def "]}),
            pip_requirements=pip_requirements(),
        )
        log.info("logged model %s in MLflow run %s", info.model_uri, run.info.run_id)
    return info


def _log_run_facts(config: Any, meta: dict[str, Any], tags: dict[str, str], lineage: Lineage | None) -> None:
    """The active run's params, tags, training and validation figures and training report."""
    import mlflow

    mlflow.log_params({f"model.{k}": v for k, v in config.to_dict()["model"].items()})
    mlflow.log_metric("checkpoint_step", float(meta["step"]))
    mlflow.set_tags(tags)
    for prefix, figures in (
        ("train", (lineage.training_figures if lineage else None) or {}),
        ("validate", (lineage.validation_figures if lineage else None) or {}),
    ):
        mlflow.log_metrics(
            {f"{prefix}.{k}": float(v) for k, v in figures.items() if isinstance(v, int | float)}
        )
    if lineage and lineage.training_report and Path(lineage.training_report).is_file():
        mlflow.log_artifact(lineage.training_report, artifact_path="reports")


def _log_lora(
    model: LoraRegistration,
    config: Any,
    meta: dict[str, Any],
    tags: dict[str, str],
    lineage: Lineage | None,
    run: Any,
) -> Any:
    """A LoRA checkpoint in the active run: the adapter (PEFT's format) under `adapter/`, and the
    merged export as the model; or, without a merged export, the adapter on its base folder as
    the model. The version's tags say which (`lora_export.HOLDS_TAG`) and name the base."""
    import mlflow

    facts = model.facts
    tags.update(facts.tags())
    with lora_export.written_adapter(model.checkpoint_dir, config, facts.base_model_dir) as adapter:
        adapter_files = write_manifest(adapter)
        if model.merged is not None:
            tags[FILES_TAG] = write_manifest(model.merged.folder)
            tags[lora_export.HOLDS_TAG] = "merged"
        else:
            tags[FILES_TAG] = adapter_files
            tags[lora_export.HOLDS_TAG] = "adapter"
        tags[lora_export.ADAPTER_URI_TAG] = f"{run.info.artifact_uri}/{lora_export.ADAPTER_FOLDER}"
        tags["rtp.export.dtype"] = model.dtype
        _log_run_facts(config, meta, tags, lineage)
        mlflow.log_artifacts(str(adapter), artifact_path=lora_export.ADAPTER_FOLDER)
        if model.merged is not None:
            mlflow.set_tags({"rtp.export.files": str(len(model.merged.files))})
            info = hf_export.log_hf_model(model.merged.folder, getattr(torch, model.dtype))
        else:
            info = hf_export.log_peft_model(adapter, Path(facts.base_model_dir), getattr(torch, model.dtype))
    log.info(
        "logged LoRA model %s (%s) in MLflow run %s",
        info.model_uri,
        tags[lora_export.HOLDS_TAG],
        run.info.run_id,
    )
    return info


def _verified_model(
    checkpoint_dir: str,
    published_manifest_sha256: str | None,
    sha: str,
    export_settings: tuple[str, str | int],
    register_merged: bool = True,
) -> tuple[Any, TrainConfig, dict[str, Any]]:
    """The byte LM loaded after validate's checks; a Hugging Face model exported (streamed,
    hashes verified first, shapes and finiteness checked tensor by tensor) and checked; a LoRA
    checkpoint's base checked and, with `register_merged`, its merged model exported so."""
    if published_manifest_sha256 is not None:
        storage.verify_published(checkpoint_dir, published_manifest_sha256)
    else:
        storage.verify_checkpoint(checkpoint_dir, verify_hashes=True)
    meta = storage.read_meta(checkpoint_dir)
    config = TrainConfig.from_dict(meta["config"])
    if config.model.kind != "hf":
        return load_validated_model(checkpoint_dir, published_manifest_sha256=published_manifest_sha256)
    export_dtype, max_shard_size = export_settings
    if config.training.method == "lora":
        return (
            _lora_registration(checkpoint_dir, config, meta, sha, export_settings, register_merged),
            config,
            meta,
        )
    result = streamed_export.export_checkpoint(
        checkpoint_dir, config.model, sha, export_dtype=export_dtype, max_shard_size=max_shard_size
    )
    if result.parameters <= streamed_export.LOAD_CHECK_MAX_PARAMETERS:
        streamed_export.check_export_loads(
            result.folder, checkpoint_dir, config.model, getattr(torch, result.dtype)
        )
    return result, config, meta


def _lora_registration(
    checkpoint_dir: str,
    config: TrainConfig,
    meta: dict[str, Any],
    sha: str,
    export_settings: tuple[str, str | int],
    register_merged: bool,
) -> LoraRegistration:
    facts = lora_export.check_base(checkpoint_dir, config, meta)
    export_dtype, max_shard_size = export_settings
    if not register_merged:
        source = streamed_export.resolve_export_dtype(
            export_dtype, json.loads((Path(facts.base_model_dir) / streamed_export.CONFIG_FILE).read_text())
        )
        return LoraRegistration(checkpoint_dir, facts, None, streamed_export.dtype_name(source))
    merged = streamed_export.export_checkpoint(
        checkpoint_dir,
        config.model,
        sha,
        export_dtype=export_dtype,
        max_shard_size=max_shard_size,
        tensors_from=lora_export.merged_source(config),
    )
    if merged.parameters <= streamed_export.LOAD_CHECK_MAX_PARAMETERS:
        dtype = getattr(torch, merged.dtype)
        streamed_export.check_export_loads(
            merged.folder,
            checkpoint_dir,
            config.model,
            dtype,
            expected=lora_export.merged_reference(checkpoint_dir, config, dtype),
        )
    return LoraRegistration(checkpoint_dir, facts, merged, merged.dtype)


def register_checkpoint(
    checkpoint_dir: str,
    model_name: str,
    decision: str,
    lineage: Lineage | None = None,
    retry: RetryPolicy | None = None,
    published_manifest_sha256: str | None = None,
    training_run_id: str = "",
    export_dtype: str = streamed_export.DEFAULT_EXPORT_DTYPE,
    max_shard_size: str | int = streamed_export.DEFAULT_MAX_SHARD_SIZE,
    register_merged: bool = True,
) -> RegisterResult:
    """Register `checkpoint_dir` as a version of `model_name` with the alias `decision`.
    With `published_manifest_sha256` (the train step's output) the checkpoint must be the
    one the train step published before anything is loaded from it. `training_run_id` is the
    MLflow run of the training's live metrics; the model is logged into it.
    `export_dtype` (auto = the source model's dtype, fp32, bf16, fp16) and `max_shard_size`
    (bytes or e.g. "5GB" per safetensors file) shape a Hugging Face model's export.
    `register_merged` (LoRA checkpoints only): the version is the base with the adapter merged
    in (the adapter logged beside it), else the adapter on its base folder.

    `lineage` supplies what the checkpoint cannot tell (KFP run, dataset, training figures);
    the checkpoint's own step, URI, SHA-256 and config hash are always filled in here.
    """
    if decision not in ALIASES:
        raise ValueError(f"decision {decision!r} cannot be registered; expected one of {', '.join(ALIASES)}")
    check_model_name(model_name)
    if export_dtype not in streamed_export.EXPORT_DTYPES:
        raise ValueError(
            f"export_dtype {export_dtype!r} is not one of {', '.join(streamed_export.EXPORT_DTYPES)}"
        )
    streamed_export.parse_max_shard_size(max_shard_size)
    with step_deadline(retry):
        return _register(
            checkpoint_dir,
            model_name,
            decision,
            lineage,
            retry,
            published_manifest_sha256,
            training_run_id,
            (export_dtype, max_shard_size),
            register_merged,
        )


def _register(
    checkpoint_dir: str,
    model_name: str,
    decision: str,
    lineage: Lineage | None,
    retry: RetryPolicy | None,
    published_manifest_sha256: str | None,
    training_run_id: str,
    export_settings: tuple[str, str | int],
    register_merged: bool = True,
) -> RegisterResult:
    import mlflow

    client = mlflow.MlflowClient()
    sha = checkpoint_sha256(checkpoint_dir)

    def find_complete() -> Any | None:
        version = _find_version(client, model_name, sha)
        if version is not None and str(version.status) == PENDING:
            # Another registration of this checkpoint is under way: wait for it, never delete it.
            log.info(
                "%s version %s of this checkpoint is being registered: waiting", model_name, version.version
            )
            version = _await_ready(client, model_name, str(version.version), failed_is_error=False)
        if version is not None and not _version_is_complete(client, model_name, version):
            log.warning(
                "%s version %s of this checkpoint is incomplete: replacing it", model_name, version.version
            )
            client.delete_model_version(model_name, version.version)
            return None
        return version

    existing = call_with_retries(f"look up {model_name} versions", find_complete, retry)
    if existing is not None:
        log.info("checkpoint already registered as %s version %s", model_name, existing.version)
        alias = _set_alias(client, model_name, decision, existing, retry)
        return RegisterResult(
            model_name,
            str(existing.version),
            alias,
            f"models:/{model_name}/{existing.version}",
            False,
            (existing.tags or {}).get(KIND_TAG, "byte-lm"),
            (existing.tags or {}).get(lora_export.ADAPTER_URI_TAG, ""),
        )

    # Checked again here: the register step must not trust a checkpoint that changed on the
    # shared volume since validation.
    model, config, meta = _verified_model(
        checkpoint_dir, published_manifest_sha256, sha, export_settings, register_merged
    )
    base = lineage or Lineage()
    origin = origin_of(config.model.model_dir) if config.model.init == "pretrained" else None
    if origin is not None:  # what the checkpoint's weights started from, whatever the caller says
        base = replace(base, parent=origin.as_dict())
    tags = lineage_tags(
        Lineage(
            **{
                **asdict(base),
                "checkpoint_uri": Path(checkpoint_dir).resolve().as_uri(),
                "checkpoint_step": int(meta["step"]),
                "checkpoint_sha256": sha,
                "training_config_sha256": training_config_sha256(meta["config"]),
                "code_version": base.code_version or code_version(),
            }
        )
    )
    tags.update(model_tags(config))
    info = call_with_retries(
        f"log the model of {checkpoint_dir}",
        lambda: _log_model(model, config, meta, tags, base, training_run_id),
        retry,
    )

    attempts = 0
    created_here = False

    def find_or_create() -> Any:
        # Looking first makes a retry after a lost response return the version the server
        # did create, instead of registering a second one.
        nonlocal attempts, created_here
        attempts += 1
        found = _find_version(client, model_name, sha)
        if found is not None:
            # Found on a retry: most likely our own request whose answer was lost. Found on
            # the first try: a concurrent registration's, which this step must not delete.
            created_here = attempts > 1 and str(found.status) != PENDING
            return found
        created = mlflow.register_model(info.model_uri, model_name, tags=tags, await_registration_for=0)
        created_here = True
        return created

    version = call_with_retries(f"register a version of {model_name}", find_or_create, retry)
    try:
        version = call_with_retries(
            f"wait for {model_name} version {version.version}",
            lambda: _await_ready(client, model_name, str(version.version)),
            retry,
        )
        if not call_with_retries(
            f"check {model_name} version {version.version}",
            lambda: _version_is_complete(client, model_name, version),
            retry,
        ):
            raise RegistrationError(f"{model_name} version {version.version} has no weights in its artifacts")
        alias = _set_alias(client, model_name, decision, version, retry)
    except BaseException:
        if created_here:
            _delete_version(client, model_name, str(version.version), retry)
        raise
    log.info("registered %s version %s as %s", model_name, version.version, alias)
    return RegisterResult(
        model_name,
        str(version.version),
        alias,
        f"models:/{model_name}/{version.version}",
        True,
        config.model.kind,
        tags.get(lora_export.ADAPTER_URI_TAG, ""),
    )
