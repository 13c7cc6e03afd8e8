"""The `rtp` entry point: builds the parser from the per-command modules and runs a handler.

Each subcommand calls the same function its pipeline step calls. `rtp local` and
`rtp train-local`, whose flags mirror the trainer's, are defined here; the others live in
the `*_commands.py` modules beside this one. Heavy libraries (torch, kfp, mlflow, boto3)
are imported inside the subcommand that needs them, so `rtp --help` is instant. Errors a
user can cause end with one line that says what was wrong and what to do, and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from rtp_cli.bench_commands import add_bench_parser
from rtp_cli.checkpoint_commands import add_register_parser, add_validate_parser
from rtp_cli.compile_commands import add_compile_parser
from rtp_cli.errors import UserError
from rtp_cli.job_commands import add_render_job_parser
from rtp_cli.kfp_commands import add_kfp_parsers
from rtp_cli.local_run import LocalOptions
from rtp_cli.stage_commands import add_prepare_data_parser, add_stage_parser
from trainer.arguments import (
    PIPELINE_SETTINGS,
    add_named_arguments,
    add_preset_argument,
    add_training_arguments,
    config_from_args,
    named_from_args,
)

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
    p.add_argument(
        "--nproc", type=int, default=defaults.nproc, help="training processes (default: %(default)s)"
    )
    add_preset_argument(p)
    add_named_arguments(p, PIPELINE_SETTINGS)
    p.add_argument(
        "--overrides", default="", help="extra trainer config, e.g. 'optimizer.lr=1e-3 model.n_layers=3'"
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
    from rtp_cli.local_run import format_summary, run_local

    if args.source and not args.source.startswith("s3://"):
        raise UserError(f"--source {args.source!r} must look like s3://bucket/prefix")
    options = LocalOptions(
        workdir=args.workdir,
        nproc=args.nproc,
        preset=args.preset,
        overrides=args.overrides,
        training=named_from_args(args, PIPELINE_SETTINGS),
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
    """Fail on bad training input before any step starts (the train step would, later)."""
    from components.train.train import TrainRequest

    if options.nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {options.nproc}")
    TrainRequest(
        dataset_dir="<staged>",
        run_folder=Path(options.workdir),
        preset=options.preset,
        overrides=options.overrides,
        settings=options.training,
    ).config()


def _add_train_local(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train-local",
        help="train on this machine with N local processes",
        description="Start N training ranks under ft_launcher on this machine. Soft faults (an "
        "exception, a hang) restart training in-process; a killed or hung rank restarts the worker "
        "group (--max-restarts). Resumes from the latest committed checkpoint in the checkpoint dir; "
        "SIGTERM saves a final checkpoint and exits cleanly. Writes <workdir>/config.json (what the "
        "ranks train with), <workdir>/summary.json (with restarts[], goodput_pct, lost_steps, "
        "model_sha256) and <workdir>/goodput.html.",
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
    from trainer.launch import LauncherSettings, run_local_training

    if args.nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {args.nproc}")
    if args.max_restarts < 0:
        raise UserError(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    config = config_from_args(args)  # fail fast on bad flags, before any process starts
    settings = LauncherSettings(max_restarts=args.max_restarts)
    summary = run_local_training(args.nproc, config, settings=settings)
    shown = ("steps", "final_loss", "checkpoint", "model_sha256", "goodput_pct", "lost_steps")
    report = {key: getattr(summary, key) for key in shown} | {"restarts": len(summary.restarts)}
    print(json.dumps(report, indent=2))
    return 0


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
        add_compile_parser,
        _add_train_local,
        add_stage_parser,
        add_prepare_data_parser,
        add_validate_parser,
        add_register_parser,
        add_bench_parser,
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
    from pipelines.prepare_data import PrepareError
    from rtp_cli.kfp_checks import KfpError
    from rtp_cli.local_run import LocalRunError
    from trainer.checkpoint import CheckpointError
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
        KfpError,
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
