"""`rtp local`: the whole pipeline on this machine, with no cluster and no cloud account.

Starts an embedded S3 endpoint seeded with the demo corpus (unless `--source` names a real
bucket; with a local `--model-source` folder, the folder and the demo corpus tokenized with
its tokenizer, rtp_cli/local_model.py), points MLflow at a sqlite file in the work dir (unless `--mlflow-uri`), runs the
compiled pipeline through `kfp.local` (SubprocessRunner, tasks in this environment), and
summarizes what each step did into `<workdir>/summary.json`.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from components.layout import run_dir
from components.mlflow_access import redact_credentials
from trainer.config import DEFAULT_PRESET
from trainer.events import write_json_atomic
from trainer.launch import launch_tempdir

log = logging.getLogger(__name__)

DEMO_BUCKET = "rtp-demo"
PIPELINE_STEPS = ("stage", "train", "validate", "register")
DEMO_PREFIX = "corpus/"


class LocalRunError(RuntimeError):
    """The local pipeline run failed; the message says which step and where its log is."""


@dataclass(kw_only=True)
class LocalOptions:
    workdir: str = "rtp-work"
    nproc: int = 2
    preset: str = DEFAULT_PRESET
    overrides: str = ""
    training: dict[str, Any] = field(default_factory=dict)
    """Named training settings (trainer.arguments.PIPELINE_SETTINGS) by pipeline parameter
    name; those not given, or None, keep the pipeline's defaults."""
    source: str = ""
    s3_endpoint_url: str = ""
    stage_workers: int = 1
    """Parts the dataset is fetched in at once (the pipeline's stage_workers; here processes)."""
    mlflow_uri: str = ""
    model_name: str = "rtp-byte-lm"
    max_loss: float = 4.0
    run_name: str = ""
    dataset_name: str = "demo-corpus"
    model_source: str = ""
    """A Hugging Face model folder (local, or s3://); empty trains the built-in byte LM."""
    chat_data: str = ""
    """Conversations (a .jsonl file or a folder) to fine-tune the local model folder on, as
    example shards in the embedded S3 instead of the demo corpus."""
    verbose: bool = False
    """Show kfp.local's executor output (task outputs, artifact listings) too."""


def _read_step_records(folder: Path) -> dict[str, dict[str, Any]]:
    records = {}
    for path in sorted((folder / "steps").glob("*.json")):
        records[path.stem] = json.loads(path.read_text())
    return records


def build_summary(
    options: LocalOptions, folder: Path, tracking_uri: str, source: str, elapsed_s: float
) -> dict[str, Any]:
    steps = _read_step_records(folder)
    train = steps.get("train", {})
    validate = steps.get("validate", {})
    register = steps.get("register", {})
    return {
        "run_name": folder.name,
        "run_dir": str(folder),
        "source": source,
        "dataset_snapshot": steps.get("stage", {}).get("snapshot_dir"),
        "model_dir": steps.get("stage_model", {}).get("model_dir") or None,
        "steps": train.get("steps"),
        "final_loss": train.get("final_loss"),
        "checkpoint": train.get("checkpoint"),
        "model_sha256": train.get("model_sha256"),
        "holdout_loss": validate.get("holdout_loss"),
        "decision": validate.get("decision"),
        "mlflow": {
            "tracking_uri": redact_credentials(tracking_uri),
            "model_name": register.get("model_name"),
            "version": register.get("version"),
            "alias": register.get("alias"),
            "model_uri": register.get("model_uri"),
            "model_kind": register.get("model_kind"),
            "adapter_uri": register.get("adapter_uri") or None,
            "run_id": train.get("mlflow_run_id") or None,
            "run_url": None,
        },
        "elapsed_s": {name: steps[name].get("elapsed_s") for name in PIPELINE_STEPS if name in steps},
        "total_elapsed_s": round(elapsed_s, 3),
    }


def run_local(options: LocalOptions) -> dict[str, Any]:
    from kfp import local

    from pipelines.pipeline import build_pipeline
    from pipelines.platform import PlatformOptions

    started = time.time()
    workdir = Path(options.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    fsx = workdir / "fsx"
    run_name = options.run_name or time.strftime("local-%Y%m%d-%H%M%S")
    folder = run_dir(fsx, run_name)
    tracking_uri = options.mlflow_uri or f"sqlite:///{workdir / 'mlflow.db'}"
    os.environ["MLFLOW_TRACKING_URI"] = tracking_uri  # the register task reads it, as on a cluster

    embedded = None
    source, endpoint = options.source, options.s3_endpoint_url
    model_source, dataset_name = options.model_source, options.dataset_name
    if not source:
        from rtp_support.embedded_s3 import DEMO_CREDENTIALS, EmbeddedS3

        embedded = EmbeddedS3().start()
        os.environ.update(DEMO_CREDENTIALS)
        endpoint = embedded.endpoint_url
        print(f"rtp local: embedded S3 (moto) at {endpoint}", flush=True)
    try:
        if embedded and model_source.startswith("models:/"):
            source, dataset_name = _seed_for_registered_model(
                endpoint, model_source, dataset_name, options.chat_data
            )
        elif embedded and model_source:
            source, model_source, dataset_name = _seed_model(
                endpoint, model_source, dataset_name, options.chat_data
            )
        elif embedded:
            source = _seed_byte_corpus(endpoint)
        print(
            f"rtp local: running the pipeline (stage data, stage model, train, validate, register) on {source}"
            + (f" with model {model_source}" if model_source else " with the built-in byte LM"),
            flush=True,
        )
        # Expected locally and said once in the README: the project image and display
        # names only matter on a cluster. Hiding these keeps the task logs readable.
        warnings.filterwarnings("ignore", message=".*non-Python base image.*")
        warnings.filterwarnings("ignore", message=".*have no effect in the current local runner.*")
        if not options.verbose:
            from rtp_cli.local_console import quiet_kfp_local

            quiet_kfp_local()
        local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(workdir / "kfp-local"))
        # The mount path is compiled into the pipeline: here, the run's local folder.
        pipeline = build_pipeline(options=PlatformOptions(fsx_mount_path=str(fsx)))
        try:
            # The tasks inherit this process's environment: what they leave in their temporary
            # folder (each task's command writes its program to a `mktemp -d` folder) goes.
            with launch_tempdir(os.environ, prefix="rtp-local-"):
                pipeline(
                    source=source,
                    s3_endpoint_url=endpoint,
                    dataset_name=dataset_name,
                    stage_workers=options.stage_workers,
                    model_source=model_source,
                    run_name=run_name,
                    nproc=options.nproc,
                    preset=options.preset,
                    overrides=options.overrides,
                    **{name: value for name, value in options.training.items() if value is not None},
                    max_loss=options.max_loss,
                    model_name=options.model_name,
                )
        except RuntimeError as exc:
            done = sorted(_read_step_records(folder))
            raise LocalRunError(
                f"the pipeline failed after steps {done or 'none'}: {exc}\n"
                f"task logs are above; task outputs are under {workdir / 'kfp-local'}"
            ) from exc
    finally:
        if embedded:
            embedded.stop()
    summary = build_summary(options, folder, tracking_uri, source, time.time() - started)
    if summary["mlflow"]["run_id"]:
        summary["mlflow"]["run_url"] = mlflow_run_url(tracking_uri, summary["mlflow"]["run_id"])
    write_json_atomic(workdir / "summary.json", summary)
    write_json_atomic(folder / "summary.json", summary)
    return summary


def mlflow_run_url(tracking_uri: str, run_id: str) -> str:
    """Where the run shows in the MLflow UI (for a sqlite store: under `mlflow ui`'s default address)."""
    base = (
        tracking_uri.rstrip("/")
        if tracking_uri.startswith(("http://", "https://"))
        else "http://127.0.0.1:5000"
    )
    try:
        import mlflow

        experiment_id = mlflow.MlflowClient(tracking_uri).get_run(run_id).info.experiment_id
    except Exception:  # the summary still names the run id
        return f"{base}/#/runs/{run_id}"
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}"


def _seed_byte_corpus(endpoint: str) -> str:
    from components.stage_data.stage import s3_client
    from rtp_support.demo_data import upload_demo_corpus

    count = upload_demo_corpus(s3_client(endpoint), DEMO_BUCKET, DEMO_PREFIX)
    source = f"s3://{DEMO_BUCKET}/{DEMO_PREFIX}"
    print(f"rtp local: seeded {count} demo byte shards into {source}", flush=True)
    return source


def _seed_for_registered_model(
    endpoint: str, model_source: str, dataset_name: str, chat_data: str = ""
) -> tuple[str, str]:
    """The demo corpus in the tokens of the version `model_source` names (bytes for a byte LM),
    or `chat_data` rendered with the version's own tokenizer and chat template (downloaded
    without the weights); returns (data source, dataset name). The stage-model step resolves
    and stages the version."""
    from components.stage_data.stage import s3_client
    from components.stage_model.registry_source import parse_reference
    from rtp_cli.errors import UserError
    from rtp_cli.local_model import download_tokenizer_files, upload_demo_tokens

    with tempfile.TemporaryDirectory(prefix="rtp-parent-tokenizer-") as tmp:
        kind, tokenizer_dir = download_tokenizer_files(model_source, Path(tmp))
        if tokenizer_dir is None:
            if chat_data:
                raise UserError(f"--chat-data fine-tunes a Hugging Face model; {model_source} is a {kind}")
            return _seed_byte_corpus(endpoint), dataset_name
        name = parse_reference(model_source).name
        if chat_data:
            prefix = f"chat-{name}/"
            index = _upload_chat(s3_client(endpoint), prefix, Path(chat_data), tokenizer_dir)
            source = f"s3://{DEMO_BUCKET}/{prefix}"
            print(
                f"rtp local: rendered {index['conversations']} conversation(s) from {chat_data} with "
                f"{model_source}'s chat template: {index['examples']} examples -> {source}",
                flush=True,
            )
            return source, f"{dataset_name.replace('corpus', 'chat')}-{name}"
        prefix = f"{DEMO_PREFIX.rstrip('/')}-{name}/"
        index = upload_demo_tokens(s3_client(endpoint), DEMO_BUCKET, prefix, tokenizer_dir)
    source = f"s3://{DEMO_BUCKET}/{prefix}"
    print(
        f"rtp local: tokenized the demo corpus with {model_source}'s tokenizer ({kind}): "
        f"{index['tokens']} tokens -> {source}",
        flush=True,
    )
    return source, f"{dataset_name}-{name}"


def _seed_model(
    endpoint: str, model_source: str, dataset_name: str, chat_data: str = ""
) -> tuple[str, str, str]:
    """Put a local model folder and the demo corpus in its tokens (or, with `chat_data`, those
    conversations as example shards) into the embedded S3; returns (data source, model
    source, dataset name) for the pipeline."""
    from components.stage_data.stage import s3_client
    from rtp_cli.local_model import plan_model_run, upload_demo_tokens, upload_model_folder

    plan = plan_model_run(model_source, "")
    assert plan.folder is not None  # an s3:// model source comes with --source
    client = s3_client(endpoint)
    tokenize_started = time.time()
    if chat_data:
        prefix = f"chat-{plan.name}/"
        source = f"s3://{DEMO_BUCKET}/{prefix}"
        index = _upload_chat(client, prefix, Path(chat_data), plan.folder)
        print(
            f"rtp local: rendered {index['conversations']} conversation(s) from {chat_data} with {plan.name}'s "
            f"chat template in {time.time() - tokenize_started:.1f}s: {index['examples']} examples, "
            f"{index['assistant_tokens']} of {index['tokens']} tokens trained on (the assistant's), "
            f"{index['truncated']} truncated, {index['dropped_overlong'] + index['dropped_no_assistant_tokens']} "
            f"dropped -> {source}",
            flush=True,
        )
        dataset_name = f"{dataset_name.replace('corpus', 'chat')}"
    else:
        prefix = f"{DEMO_PREFIX.rstrip('/')}-{plan.name}/"
        index = upload_demo_tokens(client, DEMO_BUCKET, prefix, plan.folder)
        source = f"s3://{DEMO_BUCKET}/{prefix}"
        print(
            f"rtp local: tokenized the demo corpus with {plan.name}'s tokenizer in "
            f"{time.time() - tokenize_started:.1f}s: {index['documents']} documents, {index['tokens']} tokens "
            f"({index['dtype']}, vocabulary {index['vocab_size']}) in {len(index['shards'])} shards -> {source}",
            flush=True,
        )
    model_prefix = f"models/{plan.name}/"
    count = upload_model_folder(client, plan.folder, DEMO_BUCKET, model_prefix)
    model_uri = f"s3://{DEMO_BUCKET}/{model_prefix}"
    print(f"rtp local: uploaded model folder {plan.folder} ({count} files) -> {model_uri}", flush=True)
    return source, model_uri, f"{dataset_name}-{plan.name}"


def format_summary(summary: dict[str, Any], workdir: str) -> str:
    mlflow_info = summary["mlflow"]
    lines = [
        "",
        "rtp local: pipeline finished",
        f"  dataset snapshot : {summary['dataset_snapshot']}",
        f"  model            : {summary['model_dir'] or 'built-in byte LM'}",
        f"  training         : {summary['steps']} steps, final loss {_fmt(summary['final_loss'])}",
        f"  checkpoint       : {summary['checkpoint']}",
        f"  validation       : holdout loss {_fmt(summary['holdout_loss'])} -> {summary['decision']}",
    ]
    if mlflow_info["version"]:
        lines.append(
            f"  MLflow model     : {mlflow_info['model_name']} version {mlflow_info['version']} "
            f"(alias {mlflow_info['alias']}, {mlflow_info['model_uri']})"
        )
        if mlflow_info.get("adapter_uri"):
            lines.append(
                f"  LoRA adapter     : {mlflow_info['adapter_uri']} (PEFT's format, on the base above)"
            )
        lines.append(
            f"  serve it         : MLFLOW_TRACKING_URI={mlflow_info['tracking_uri']} mlflow models serve "
            f"-m models:/{mlflow_info['model_name']}@{mlflow_info['alias']} --env-manager local -p 5001"
        )
    else:
        lines.append("  MLflow model     : not registered (validation rejected the checkpoint)")
    if mlflow_info.get("run_url"):
        lines.append(f"  MLflow run       : {mlflow_info['run_url']} (live metrics, holdout scores, model)")
    timing = ", ".join(f"{k} {v:.1f}s" for k, v in summary["elapsed_s"].items() if v is not None)
    lines += [
        f"  time             : {timing}; total {summary['total_elapsed_s']:.1f}s",
        f"  summary          : {Path(workdir).resolve() / 'summary.json'}",
    ]
    if mlflow_info["tracking_uri"].startswith("sqlite:"):
        lines.append(f"  MLflow UI        : mlflow ui --backend-store-uri {mlflow_info['tracking_uri']}")
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _upload_chat(client: Any, prefix: str, chat_data: Path, model_folder: Path) -> dict[str, Any]:
    """`rtp prepare-data --format chat` of `chat_data` with the model's tokenizer, uploaded."""
    from components.stage_data.prepare_data import PrepareError, upload_shards
    from rtp_cli.errors import UserError
    from trainer.chat_data import write_example_shards
    from trainer.data import DataError

    with tempfile.TemporaryDirectory(prefix="rtp-chat-shards-") as tmp:
        try:
            index = write_example_shards(chat_data, Path(tmp), model_folder)
        except DataError as exc:
            raise UserError(f"--chat-data: {exc}") from None
        try:
            upload_shards(client, Path(tmp), DEMO_BUCKET, prefix)
        except PrepareError as exc:
            raise UserError(str(exc)) from None
    return index
