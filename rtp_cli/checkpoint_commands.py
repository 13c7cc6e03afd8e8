"""`rtp validate` and `rtp register`: check a committed checkpoint, then register it in MLflow.

Both take a `step_<N>` folder or a checkpoints folder (its latest committed step is used)
and an optional `--mlflow-uri` that wins over `MLFLOW_TRACKING_URI`; each handler calls the
same function as its pipeline step (`validate_checkpoint`, `register_checkpoint`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rtp_cli.errors import UserError


def add_validate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "validate",
        help="check a checkpoint and score it on the holdout split",
        description="Verify a committed checkpoint (manifest, SHA-256, tensor shapes, optimizer state, "
        "every tensor finite, read from the shards a few at a time), take its holdout loss from the "
        "training's eval.json when it scored these weights (else score a small model in this process) "
        "and compare it with the current champion in MLflow (--champion-model, on the same holdout). "
        "Prints the report; exit code 1 when the decision is reject.",
    )
    p.add_argument(
        "--checkpoint", required=True, help="a step_<N> folder, or a checkpoints folder (its latest is used)"
    )
    p.add_argument(
        "--dataset-dir", required=True, help="the staged dataset snapshot the model was trained on"
    )
    p.add_argument(
        "--max-loss", type=float, default=4.0, help="highest acceptable holdout loss (default: %(default)s)"
    )
    p.add_argument(
        "--min-improvement",
        type=float,
        default=0.0,
        help="how much lower than the champion's the loss must be to replace it (default: %(default)s)",
    )
    p.add_argument(
        "--champion-model",
        default="",
        help="registered model whose champion to compare with (default: no comparison)",
    )
    p.add_argument("--mlflow-uri", default="", help="MLflow tracking URI (default: MLFLOW_TRACKING_URI)")
    p.add_argument(
        "--require-optimizer-state",
        action="store_true",
        help="fail when the checkpoint holds no optimizer state (cannot be resumed)",
    )
    p.add_argument("--report", default="", help="also write the Markdown report to this file")
    p.set_defaults(handler=_cmd_validate)


def _resolve_checkpoint(path: str) -> str:
    from trainer.checkpointing import latest_committed_checkpoint

    folder = Path(path)
    if (folder / ".metadata").exists() or folder.name.startswith("step_"):
        return str(folder)
    latest = latest_committed_checkpoint(folder)
    if latest is None:
        raise UserError(f"no committed checkpoint under {folder}")
    return str(latest)


def _cmd_validate(args: argparse.Namespace) -> int:
    from components.validate_checkpoint.validate import report_markdown, validate_checkpoint

    _use_mlflow_uri(args.mlflow_uri)
    result = validate_checkpoint(
        _resolve_checkpoint(args.checkpoint),
        args.dataset_dir,
        args.max_loss,
        min_improvement=args.min_improvement,
        champion_model_name=args.champion_model,
        require_optimizer_state=args.require_optimizer_state,
    )
    report = report_markdown(result)
    if args.report:
        Path(args.report).write_text(report)
    print(report)
    return 0 if result.decision != "reject" else 1


def _use_mlflow_uri(uri: str) -> None:
    """An explicit --mlflow-uri (local use) wins over MLFLOW_TRACKING_URI."""
    if uri:
        import mlflow

        mlflow.set_tracking_uri(uri)


def add_register_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "register",
        help="log a checkpoint to MLflow and register a version",
        description="Log a validated checkpoint to MLflow (the byte LM as a pyfunc with safetensors weights, "
        "config and tokenizer description; a Hugging Face model in Hugging Face format with the transformers "
        "flavor), register a version with lineage tags and set its alias. Registering the "
        "same checkpoint again returns the existing version. The tracking server comes from "
        "MLFLOW_TRACKING_URI (or --mlflow-uri); unreachable servers are retried with backoff.",
    )
    p.add_argument(
        "--checkpoint", required=True, help="a step_<N> folder, or a checkpoints folder (its latest is used)"
    )
    p.add_argument("--model-name", default="rtp-byte-lm", help="registered model name (default: %(default)s)")
    p.add_argument(
        "--alias",
        default="champion",
        choices=["champion", "challenger"],
        help="alias for the version: the validate decision (default: %(default)s)",
    )
    p.add_argument("--dataset-dir", default="", help="the dataset snapshot trained on (recorded as lineage)")
    p.add_argument("--mlflow-uri", default="", help="MLflow tracking URI (default: MLFLOW_TRACKING_URI)")
    p.add_argument(
        "--export-dtype",
        default="auto",
        choices=["auto", "fp32", "bf16", "fp16"],
        help="dtype of a Hugging Face model's exported safetensors; auto: the source model's "
        "config.json dtype (default: %(default)s)",
    )
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest safetensors file of a Hugging Face model's export, e.g. 5GB or 500MB (default: %(default)s)",
    )
    p.add_argument(
        "--register-merged",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a LoRA checkpoint: the version is the base with the adapter merged in (the adapter logged "
        "beside it); --no-register-merged: the version is the adapter on its base folder (default: merged)",
    )
    p.set_defaults(handler=_cmd_register)


def _cmd_register(args: argparse.Namespace) -> int:
    from components.register_model.lineage import Lineage, dataset_facts, training_figures, validation_figures
    from components.register_model.register import register_checkpoint

    _use_mlflow_uri(args.mlflow_uri)
    checkpoint_dir = _resolve_checkpoint(args.checkpoint)
    snapshot_id, manifest_sha256 = dataset_facts(args.dataset_dir) if args.dataset_dir else ("", "")
    lineage = Lineage(
        dataset_snapshot_id=snapshot_id,
        dataset_manifest_sha256=manifest_sha256,
        # <run>/checkpoints/step_N -> <run>/train/summary.json, where the trainer writes it
        training_figures=training_figures(Path(checkpoint_dir).parent.parent / "train" / "summary.json"),
        # the validate step's record in the same run folder, when the pipeline wrote one
        validation_figures=validation_figures(Path(checkpoint_dir).parent.parent / "steps" / "validate.json"),
    )
    result = register_checkpoint(
        checkpoint_dir,
        args.model_name,
        args.alias,
        lineage,
        export_dtype=args.export_dtype,
        max_shard_size=args.max_shard_size,
        register_merged=args.register_merged,
    )
    print(json.dumps(result.as_dict(), indent=2))
    return 0
