"""`python -m trainer`: what the launcher starts once per rank.

Parses the flags into a TrainConfig, joins the process group from the launcher's
environment, trains, and exits non-zero with a one-line reason on a user error.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from trainer.config import CHECKPOINT_MODES, PRESETS, ConfigError, TrainConfig, build_config
from trainer.lifecycle import die_with_parent


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by `python -m trainer` and `rtp train-local` (same names as the config)."""
    parser.add_argument(
        "--preset",
        default="tiny-cpu",
        choices=sorted(PRESETS),
        help="model/optimizer preset (default: %(default)s)",
    )
    parser.add_argument(
        "--dataset-dir", required=True, help="staged dataset snapshot (folder with manifest.json)"
    )
    parser.add_argument(
        "--workdir",
        default="rtp-work/train",
        help="checkpoints, events.jsonl and summary.json go here (default: %(default)s)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        help="total optimizer steps; a resumed run continues up to this (config run.steps)",
    )
    parser.add_argument(
        "--checkpoint-every", type=int, help="save a checkpoint every N steps (config checkpoint.every_steps)"
    )
    parser.add_argument(
        "--checkpoint-mode",
        choices=CHECKPOINT_MODES,
        help="off | sync | torch-async | async (NVRx, the default) (config checkpoint.mode)",
    )
    parser.add_argument(
        "--checkpoint-dir", help="where step_<N>/ checkpoints go (default: <workdir>/checkpoints)"
    )
    parser.add_argument("--seed", type=int, help="random seed (config run.seed)")
    parser.add_argument(
        "--stop-after",
        type=int,
        help="stop cleanly after this step's checkpoint, to resume later (config run.stop_after_steps)",
    )
    parser.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="KIND@STEP[:RANK]",
        help="inject a fault for a drill or test: KIND is exception, hang, sigkill or "
        "sigkill-during-save; fires once per run on RANK (default 0); repeatable (config run.faults)",
    )
    parser.add_argument(
        "--inprocess-restarts",
        type=int,
        help="in-process restarts allowed per process for soft faults, 0 = leave every fault to "
        "the launcher (config resilience.inprocess_restarts, default 3)",
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any config field, e.g. optimizer.lr=1e-3 or model.n_layers=4; repeatable",
    )


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    overrides = [f"data.dataset_dir={args.dataset_dir}", f"run.workdir={args.workdir}"]
    named = {
        "run.steps": args.steps,
        "checkpoint.every_steps": args.checkpoint_every,
        "checkpoint.mode": args.checkpoint_mode,
        "checkpoint.dir": args.checkpoint_dir,
        "run.seed": args.seed,
        "run.stop_after_steps": args.stop_after,
        "run.faults": ",".join(args.fault) if args.fault else None,
        "resilience.inprocess_restarts": args.inprocess_restarts,
    }
    overrides += [f"{key}={value}" for key, value in named.items() if value is not None]
    return build_config(args.preset, overrides + list(args.override))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer",
        description="One training rank (FSDP2 over gloo on CPU, NCCL on GPU). Start it through "
        "a launcher (torchrun, ft_launcher) or `rtp train-local`, which set RANK/WORLD_SIZE.",
    )
    add_training_arguments(parser)
    process_started_at = time.time()
    args = parser.parse_args(argv)
    die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        parser.error(str(exc))
    from trainer.data import DataError  # torch imports only once arguments are valid
    from trainer.parallelize import shutdown_distributed
    from trainer.resilience import FatalTrainingError, run_training

    try:
        run_training(config, process_started_at)
    except (DataError, ConfigError, FatalTrainingError) as exc:
        print(f"trainer: error: {exc}", file=sys.stderr)
        return 2
    except BaseException as exc:
        if type(exc).__name__ != "RestartAbort":
            raise
        # In-process restarts are over (exhausted, a fatal error, or a rank died): say why
        # in one line; the launcher decides whether the worker group starts again.
        print(f"trainer: error: in-process restarts ended: {exc}", file=sys.stderr)
        return 1
    finally:
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
