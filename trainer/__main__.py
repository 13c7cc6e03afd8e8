"""`python -m trainer`: what the launcher starts once per rank.

Reads the config (`--config`, as `rtp` writes it, or flags generated from the config's
named settings: trainer/arguments.py), joins the process group from the launcher's
environment, trains, and exits non-zero with a one-line reason on a user error.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from trainer.arguments import add_training_arguments, config_from_args
from trainer.config import ConfigError
from trainer.lifecycle import die_with_parent


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
