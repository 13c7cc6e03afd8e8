"""`rtp train-local`: train on this machine with N ranks under ft_launcher.

Takes the trainer's own flags (trainer/arguments.py), resolves them into the run's config
before any process starts, and hands that config to `trainer.launch.run_local_training`.
With CUDA devices visible, the GPU timeout table applies first (trainer/gpu_defaults.py).
"""

from __future__ import annotations

import argparse
import json

from rtp_cli.errors import UserError
from trainer.arguments import add_training_arguments, config_from_args


def add_train_local_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train-local",
        help="train on this machine with N local processes",
        description="Start N training ranks under ft_launcher on this machine. Soft faults (an "
        "exception, a hang) restart training in-process; a killed or hung rank restarts the worker "
        "group (--max-restarts). Resumes from the latest committed checkpoint in the checkpoint dir; "
        "SIGTERM saves a final checkpoint and exits non-zero (the run is unfinished). Writes <workdir>/config.json (what the "
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
    import rtp_prefork
    from trainer.launch import LauncherSettings, run_local_training

    if args.nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {args.nproc}")
    if args.max_restarts < 0:
        raise UserError(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    settings = LauncherSettings(max_restarts=args.max_restarts)
    if not args.config and torch_sees_gpus():
        # The GPU timeout table, as in pods and jobs; the user's own --override items come later and win.
        from trainer import gpu_defaults

        args.override = [*gpu_defaults.resilience_overrides(), *args.override]
        settings = gpu_defaults.launcher_settings(max_restarts=args.max_restarts)
    config = config_from_args(args)  # fail fast on bad flags, before any process starts
    summary = run_local_training(args.nproc, config, settings=rtp_prefork.launcher_settings(config, settings))
    shown = ("steps", "final_loss", "checkpoint", "model_sha256", "goodput_pct", "lost_steps")
    report = {key: getattr(summary, key) for key in shown} | {"restarts": len(summary.restarts)}
    print(json.dumps(report, indent=2))
    return 0


def torch_sees_gpus() -> bool:
    import torch

    return torch.cuda.is_available()
