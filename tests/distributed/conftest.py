import json
import sys
from pathlib import Path

from trainer.launch import run_local_training, trainer_arguments


def train(
    dataset_dir, workdir, nproc: int = 2, steps: int = 12, every: int = 4, overrides=(), **extra
) -> dict:
    """A real multi-process run through the launcher; returns its summary.json."""
    args = trainer_arguments(
        dataset_dir=str(dataset_dir),
        workdir=str(workdir),
        steps=steps,
        checkpoint_every=every,
        seed=7,
        overrides=list(overrides),
        **extra,
    )
    return run_local_training(nproc, args, workdir, echo=False)


def train_local_command(dataset_dir, workdir, steps: int, every: int, *extra: str) -> list[str]:
    """The user's command, `rtp train-local`, with 2 ranks and seed 7."""
    return [
        sys.executable,
        "-m",
        "rtp_cli.main",
        "train-local",
        "--nproc",
        "2",
        "--dataset-dir",
        str(dataset_dir),
        "--workdir",
        str(workdir),
        "--steps",
        str(steps),
        "--checkpoint-every",
        str(every),
        "--seed",
        "7",
        *extra,
    ]


def events(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(workdir) / "events.jsonl").read_text().splitlines()]
