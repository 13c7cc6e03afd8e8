"""The `rtp` command line: each subcommand calls the same function its pipeline step calls.

Heavy libraries (torch, kfp, mlflow, boto3) are imported inside the subcommand that needs
them, so `rtp --help` is instant. Errors a user can cause end with one line that says
what was wrong and what to do, and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from pipelines.k8s_cli import add_platform_arguments, add_render_job_parser, platform_options_from_args
from pipelines.kfp_cli import add_kfp_parsers
from pipelines.local import LocalOptions
from pipelines.stage_cli import add_prepare_data_parser, add_stage_parser
from trainer.config import CHECKPOINT_MODES

EPILOG = """examples:
  rtp local                              # whole pipeline on embedded defaults
  rtp local --steps 100 --nproc 2        # longer demo run
  rtp compile -o pipeline.yaml --image 123456789012.dkr.ecr.us-east-1.amazonaws.com/rtp:0.1.0
  rtp train-local --dataset-dir DIR --workdir runs/a --steps 40 --checkpoint-every 10
  rtp upload --host http://127.0.0.1:8888 --image REGISTRY/rtp:0.1.0   # a new pipeline version
  rtp run --host http://127.0.0.1:8888 --version latest --param steps=200 --wait
  rtp schedule --host http://127.0.0.1:8888 --name nightly --cron "0 3 * * *"
  rtp render-job --mode pytorchjob --nnodes 2 --gpus-per-node 8 --nproc-per-node 8 --efa-per-node 32
"""


def _add_local(sub: argparse._SubParsersAction) -> None:
    defaults = LocalOptions()
    p = sub.add_parser(
        "local",
        help="run the whole pipeline on this machine with kfp.local",
        description="Compile the pipeline and run it with kfp.local: stage (embedded S3 seeded with "
        "a demo corpus unless --source), train (FSDP, gloo on CPU), validate, register (MLflow sqlite "
        "file in the work dir unless --mlflow-uri). Writes <workdir>/summary.json.",
    )
    p.add_argument("--workdir", default=defaults.workdir, help="all outputs go here (default: %(default)s)")
    p.add_argument("--steps", type=int, default=defaults.steps, help="training steps (default: %(default)s)")
    p.add_argument(
        "--nproc", type=int, default=defaults.nproc, help="training processes (default: %(default)s)"
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=defaults.checkpoint_every,
        help="checkpoint every N steps (default: %(default)s)",
    )
    p.add_argument(
        "--checkpoint-mode",
        default=defaults.checkpoint_mode,
        choices=CHECKPOINT_MODES,
        help="how checkpoints are written: async (NVRx) overlaps the write with training (default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=defaults.seed, help="random seed (default: %(default)s)")
    p.add_argument("--preset", default=defaults.preset, help="model preset (default: %(default)s)")
    p.add_argument(
        "--overrides", default="", help="extra trainer config, e.g. 'optimizer.lr=1e-3 model.n_layers=3'"
    )
    p.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="KIND@STEP[:RANK]",
        help="inject a fault into training (chaos drill): KIND is exception, hang, sigkill or "
        "sigkill-during-save; repeatable",
    )
    p.add_argument(
        "--source",
        default="",
        help="s3://bucket/prefix to stage instead of the embedded demo corpus; "
        "credentials come from the standard AWS chain",
    )
    p.add_argument("--s3-endpoint-url", default="", help="S3-compatible endpoint for --source (default: AWS)")
    p.add_argument(
        "--mlflow-uri", default="", help="MLflow tracking URI (default: sqlite:///<workdir>/mlflow.db)"
    )
    p.add_argument(
        "--model-name", default=defaults.model_name, help="registered model name (default: %(default)s)"
    )
    p.add_argument(
        "--max-loss",
        type=float,
        default=defaults.max_loss,
        help="highest holdout loss to register (default: %(default)s)",
    )
    p.add_argument(
        "--run-name",
        default="",
        help="run folder name; reuse one to resume its checkpoints (default: local-<time>)",
    )
    p.set_defaults(handler=_cmd_local)


def _cmd_local(args: argparse.Namespace) -> int:
    from pipelines.local import format_summary, run_local

    if args.source and not args.source.startswith("s3://"):
        raise UserError(f"--source {args.source!r} must look like s3://bucket/prefix")
    options = LocalOptions(
        workdir=args.workdir,
        steps=args.steps,
        nproc=args.nproc,
        checkpoint_every=args.checkpoint_every,
        checkpoint_mode=args.checkpoint_mode,
        seed=args.seed,
        preset=args.preset,
        overrides=args.overrides,
        faults=",".join(args.fault) or "none",
        source=args.source,
        s3_endpoint_url=args.s3_endpoint_url,
        mlflow_uri=args.mlflow_uri,
        model_name=args.model_name,
        max_loss=args.max_loss,
        run_name=args.run_name,
    )
    _check_training_options(options)
    summary = run_local(options)
    print(format_summary(summary, args.workdir))
    return 0


def _check_training_options(options: LocalOptions) -> None:
    from trainer.config import build_config, parse_overrides

    if options.nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {options.nproc}")
    build_config(
        options.preset,
        [
            *parse_overrides(options.overrides),
            f"run.steps={options.steps}",
            f"checkpoint.every_steps={options.checkpoint_every}",
            f"checkpoint.mode={options.checkpoint_mode}",
            f"run.faults={options.faults if options.faults != 'none' else ''}",
        ],
    )


def _add_compile(sub: argparse._SubParsersAction) -> None:
    from components import DEFAULT_IMAGE

    p = sub.add_parser(
        "compile",
        help="write the pipeline's KFP IR YAML",
        description="Compile the pipeline to KFP IR YAML for upload to Kubeflow Pipelines.",
    )
    p.add_argument("-o", "--output", default="pipeline.yaml", help="output file (default: %(default)s)")
    p.add_argument(
        "--image",
        default=DEFAULT_IMAGE,
        help="component image built from the Dockerfile (default: %(default)s)",
    )
    add_platform_arguments(p)
    p.set_defaults(handler=_cmd_compile)


def _cmd_compile(args: argparse.Namespace) -> int:
    from pipelines.pipeline import compile_pipeline

    options = platform_options_from_args(args)
    path = compile_pipeline(args.output, image=args.image, launcher=args.launcher, options=options)
    print(f"wrote {path} (image {args.image}, launcher {args.launcher})")
    return 0


def _add_train_local(sub: argparse._SubParsersAction) -> None:
    from trainer.__main__ import add_training_arguments

    p = sub.add_parser(
        "train-local",
        help="train on this machine with N local processes",
        description="Start N training ranks under ft_launcher on this machine. Soft faults (an "
        "exception, a hang) restart training in-process; a killed or hung rank restarts the worker "
        "group (--max-restarts). Resumes from the latest committed checkpoint in the checkpoint dir; "
        "SIGTERM saves a final checkpoint and exits cleanly. Writes <workdir>/summary.json (with "
        "restarts[], goodput_pct, lost_steps, model_sha256) and <workdir>/goodput.html.",
    )
    p.add_argument("--nproc", type=int, default=2, help="training processes (default: %(default)s)")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="ft_launcher worker-group restarts after hard faults (default: %(default)s)",
    )
    add_training_arguments(p)
    p.set_defaults(handler=_cmd_train_local)


def _cmd_train_local(args: argparse.Namespace) -> int:
    from trainer.__main__ import config_from_args
    from trainer.launch import LauncherSettings, run_local_training, trainer_arguments

    if args.nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {args.nproc}")
    config = config_from_args(args)  # fail fast on bad flags, before any process starts
    trainer_args = trainer_arguments(
        dataset_dir=args.dataset_dir,
        workdir=args.workdir,
        steps=config.run.steps,
        checkpoint_every=config.checkpoint.every_steps,
        checkpoint_mode=config.checkpoint.mode,
        seed=config.run.seed,
        preset=args.preset,
        checkpoint_dir=args.checkpoint_dir,
        stop_after=args.stop_after,
        overrides=args.override,
        faults=args.fault,
        inprocess_restarts=args.inprocess_restarts,
    )
    if args.max_restarts < 0:
        raise UserError(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    settings = LauncherSettings(max_restarts=args.max_restarts)
    summary = run_local_training(args.nproc, trainer_args, args.workdir, settings=settings)
    print(
        json.dumps(
            {
                k: summary.get(k)
                for k in ("steps", "final_loss", "checkpoint", "model_sha256", "goodput_pct", "lost_steps")
            }
            | {"restarts": len(summary.get("restarts", []))},
            indent=2,
        )
    )
    return 0


def _add_validate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "validate",
        help="check a checkpoint and score it on the holdout split",
        description="Verify a committed checkpoint (manifest, SHA-256, tensor shapes, optimizer state, "
        "loadable on one CPU process, finite), compute its holdout loss and compare it with the current "
        "champion in MLflow (--champion-model, on the same holdout). Prints the report; exit code 1 when "
        "the decision is reject.",
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


def _add_register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "register",
        help="log a checkpoint to MLflow and register a version",
        description="Log a validated checkpoint as an MLflow pyfunc model (safetensors weights, config, "
        "tokenizer description), register a version with lineage tags and set its alias. Registering the "
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
    p.set_defaults(handler=_cmd_register)


def _cmd_register(args: argparse.Namespace) -> int:
    from components.register_model.lineage import Lineage, dataset_facts, training_figures
    from components.register_model.register import register_checkpoint

    _use_mlflow_uri(args.mlflow_uri)
    checkpoint_dir = _resolve_checkpoint(args.checkpoint)
    snapshot_id, manifest_sha256 = dataset_facts(args.dataset_dir) if args.dataset_dir else ("", "")
    lineage = Lineage(
        dataset_snapshot_id=snapshot_id,
        dataset_manifest_sha256=manifest_sha256,
        # <run>/checkpoints/step_N -> <run>/train/summary.json, where the trainer writes it
        training_figures=training_figures(Path(checkpoint_dir).parent.parent / "train" / "summary.json"),
    )
    result = register_checkpoint(checkpoint_dir, args.model_name, args.alias, lineage)
    print(json.dumps(result.as_dict(), indent=2))
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from benchmarks import checkpoint as bench_checkpoint
    from benchmarks import recovery as bench_recovery
    from benchmarks import staging as bench_staging

    p = sub.add_parser(
        "bench",
        help="side-by-side benchmarks (JSON + table)",
        description="Benchmarks that compare alternatives in one run and print JSON and a table.",
    )
    kinds = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    ckpt = kinds.add_parser(
        "checkpoint",
        help="the same training under every checkpoint mode",
        description=bench_checkpoint.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench_checkpoint.add_arguments(ckpt)
    ckpt.set_defaults(handler=bench_checkpoint.main)
    recovery = kinds.add_parser(
        "recovery",
        help="the same soft fault under in-process, ft_launcher and cold restart",
        description=bench_recovery.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench_recovery.add_arguments(recovery)
    recovery.set_defaults(handler=bench_recovery.main)
    staging = kinds.add_parser(
        "staging",
        help="rtp stage vs aws s3 sync vs a sequential boto3 loop on a real S3 server",
        description=bench_staging.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench_staging.add_arguments(staging)
    staging.set_defaults(handler=bench_staging.main)


class UserError(Exception):
    """Bad input from the command line."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rtp",
        description="rtp — the resilient training pipeline: Kubeflow Pipelines components that stage data "
        "from S3 to FSx, train with FSDP and resilient checkpoints, validate, and register in MLflow.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in (
        _add_local,
        _add_compile,
        _add_train_local,
        add_stage_parser,
        add_prepare_data_parser,
        _add_validate,
        _add_register,
        _add_bench,
        add_kfp_parsers,
        add_render_job_parser,
    ):
        add(sub)
    return parser


def _user_error_types() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input or environment, not a bug: shown as one line."""
    from components.mlflow_access import RegistryUnavailable
    from components.register_model.bundle import BundleError
    from components.register_model.register import RegistrationError
    from components.stage_data.stage import StageError
    from pipelines.local import LocalRunError
    from pipelines.ops import OpsError
    from pipelines.prepare_data import PrepareError
    from trainer.checkpointing import CheckpointError
    from trainer.config import ConfigError
    from trainer.data import DataError
    from trainer.launch import TrainingFailed

    return (
        UserError,
        ConfigError,
        DataError,
        CheckpointError,
        StageError,
        PrepareError,
        TrainingFailed,
        LocalRunError,
        OpsError,
        RegistryUnavailable,
        RegistrationError,
        BundleError,
        ValueError,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except _user_error_types() as exc:
        print(f"rtp {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
