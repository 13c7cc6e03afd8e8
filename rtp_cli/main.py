"""The `rtp` entry point: builds the parser from the per-command modules and runs a handler.

Each subcommand calls the same function its pipeline step calls; each is defined in one
of the `*_commands.py` modules beside this one. Heavy libraries (torch, kfp, mlflow, boto3)
are imported inside the subcommand that needs them, so `rtp --help` is instant. Errors a
user can cause end with one line that says what was wrong and what to do, and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from rtp_cli.errors import UserError

EPILOG = """examples:
  rtp local                              # whole pipeline on embedded defaults
  rtp local --steps 100 --nproc 2        # longer demo run
  rtp make-tiny-model --arch llama tiny-llama && rtp local --model-source tiny-llama   # a Hugging Face model
  rtp compile -o pipeline.yaml --image 123456789012.dkr.ecr.us-east-1.amazonaws.com/rtp:0.1.0
  rtp train-local --dataset-dir DIR --workdir runs/a --steps 40 --checkpoint-every 10
  rtp plan --model-config benchmarks/model_configs/llama-3.1-8b.json --seq-len 8192   # will it fit 8 H100s?
  rtp upload --host http://127.0.0.1:8888 --image REGISTRY/rtp:0.1.0   # a new pipeline version
  rtp run --host http://127.0.0.1:8888 --version latest --param steps=200 --wait
  rtp schedule --host http://127.0.0.1:8888 --name nightly --cron "0 3 * * *"
  rtp render-job --mode pytorchjob --nnodes 2 --gpus-per-node 8 --nproc-per-node 8 --efa-per-node 32
  rtp gc --fsx-mount-path /fsx --keep 5  # what old run folders would go (add --apply to remove them)
"""


def _top_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    parser = argparse.ArgumentParser(
        prog="rtp",
        description="rtp — the resilient training pipeline: Kubeflow Pipelines components that stage data "
        "from S3 to FSx, train with FSDP and resilient checkpoints, validate, and register in MLflow.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser, parser.add_subparsers(dest="command", metavar="COMMAND", required=True)


def build_parser() -> argparse.ArgumentParser:
    from rtp_cli.bench_commands import add_bench_parser
    from rtp_cli.checkpoint_commands import add_register_parser, add_validate_parser
    from rtp_cli.compile_commands import add_compile_parser
    from rtp_cli.gc_commands import add_gc_parser
    from rtp_cli.job_commands import add_render_job_parser
    from rtp_cli.kfp_commands import add_kfp_parsers
    from rtp_cli.local_commands import add_local_parser
    from rtp_cli.model_commands import add_make_tiny_model_parser
    from rtp_cli.plan_commands import add_plan_parser
    from rtp_cli.stage_commands import add_prepare_data_parser, add_stage_parser
    from rtp_cli.train_commands import add_train_local_parser

    parser, sub = _top_parser()
    for add in (
        add_local_parser,
        add_compile_parser,
        add_train_local_parser,
        add_plan_parser,
        add_stage_parser,
        add_prepare_data_parser,
        add_make_tiny_model_parser,
        add_validate_parser,
        add_register_parser,
        add_bench_parser,
        add_kfp_parsers,
        add_render_job_parser,
        add_gc_parser,
    ):
        add(sub)
    return parser


USER_ERRORS = (
    ("components.mlflow_access", "RegistryUnavailable"),
    ("components.retention", "RetentionError"),
    ("components.register_model.bundle", "BundleError"),
    ("components.register_model.register", "RegistrationError"),
    ("components.stage_data.prepare_data", "PrepareError"),
    ("components.stage_data.errors", "StageError"),
    ("components.train.train", "CheckpointOutsideRun"),
    ("rtp_cli.kfp_checks", "KfpError"),
    ("rtp_cli.local_run", "LocalRunError"),
    ("trainer.checkpointing.storage", "CheckpointError"),
    ("trainer.config", "ConfigError"),
    ("trainer.data", "DataError"),
    ("trainer.launch", "TrainingFailed"),
)
"""Exceptions that mean bad input or environment, not a bug: shown as one line."""


def _user_error_types() -> tuple[type[BaseException], ...]:
    """The USER_ERRORS whose modules are loaded: an exception can only come from a module
    that was imported, and importing nothing here means a broken heavy library (torch,
    mlflow) cannot turn every error message into an ImportError traceback."""
    found: list[type[BaseException]] = [UserError, ValueError, FileNotFoundError, PermissionError]
    for module_name, class_name in USER_ERRORS:
        module = sys.modules.get(module_name)
        if module is not None:
            found.append(getattr(module, class_name))
    return tuple(found)


def _parser_for(argv: list[str]) -> argparse.ArgumentParser:
    """`rtp stage` builds only its own parser, so a re-stage of an unchanged prefix (a
    fraction of a second of work) does not import every other command's modules."""
    command = next((arg for arg in argv if not arg.startswith("-")), "")
    if command != "stage":
        return build_parser()
    from rtp_cli.stage_commands import add_stage_parser

    parser, sub = _top_parser()
    add_stage_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser_for(sys.argv[1:] if argv is None else argv).parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except _user_error_types() as exc:
        from components.mlflow_access import redact_credentials  # light: imports no MLflow

        # A URI in a message (an MLflow tracking URI, an endpoint) may hold user:password@.
        print(f"rtp {args.command}: error: {redact_credentials(str(exc))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
