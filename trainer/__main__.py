"""`python -m trainer`: what the launcher starts once per rank.

Reads the config (`--config`, as `rtp` writes it, or flags generated from the config's
named settings: trainer/arguments.py), joins the process group from the launcher's
environment, trains, and exits non-zero with a one-line reason on a user error. A run
that SIGTERM stopped before its last step exits with EXIT_STOPPED_BY_SIGNAL once its final
checkpoint is committed: a partly trained run must not pass for a finished one (the pod
would count as Succeeded), and the launcher or the engine restarts it from that checkpoint.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import sys
import time

from trainer.arguments import add_training_arguments, config_from_args
from trainer.config import ConfigError
from trainer.faults import recorded_fatal_error
from trainer.lifecycle import die_with_parent

EXIT_STOPPED_BY_SIGNAL = 143
"""128 + SIGTERM, the shell's code for a process ended by SIGTERM; the Training Operator's
ExitCode restart policy treats 128-255 as retryable."""


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
    faulthandler.enable(all_threads=True)  # a crashing rank logs every thread's Python stack
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        parser.error(str(exc))
    earlier = recorded_fatal_error(config.run.workdir)
    if earlier:  # a restarted rank of a run that hit an error no restart can fix
        print(f"trainer: error: {earlier} (not retried: a restart would fail the same way)", file=sys.stderr)
        return 2
    from trainer.data import DataError  # torch imports only once arguments are valid
    from trainer.link_check import SlowInterconnect
    from trainer.parallelize import shutdown_distributed
    from trainer.resilience import fault_tolerance

    if config.checkpoint.mode == "async":  # NVRx's writer processes, forked ready-imported
        from trainer import forkserver
        from trainer.checkpointing import WRITERS

        forkserver.start([WRITERS["async"].partition(":")[0]])
    try:
        with fault_tolerance(config, process_started_at) as train:
            summary = train()
    except (DataError, ConfigError) as exc:
        print(f"trainer: error: {exc}", file=sys.stderr)
        return 2
    except SlowInterconnect as exc:  # without the in-process layer; the launcher may retry
        print(f"trainer: error: {exc}", file=sys.stderr)
        return 1
    except BaseException as exc:
        if type(exc).__name__ != "RestartAbort":
            raise
        # In-process restarts are over (exhausted, a fatal error, or a rank died): say why
        # in one line; the launcher decides whether the worker group starts again.
        print(f"trainer: error: in-process restarts ended: {exc}", file=sys.stderr)
        return 1
    finally:
        shutdown_distributed()
    if summary is not None and summary.stopped_by_signal and not summary.completed:
        print(
            f"trainer: stopped by SIGTERM at step {summary.steps} of {summary.target_steps}; the final "
            f"checkpoint is committed ({summary.checkpoint}); exiting {EXIT_STOPPED_BY_SIGNAL} so the run "
            "is not taken for finished",
            file=sys.stderr,
        )
        return EXIT_STOPPED_BY_SIGNAL
    return 0


if __name__ == "__main__":
    sys.exit(main())
