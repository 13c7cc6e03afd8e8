"""Run training for one pipeline run on this pod (or machine) and describe the result.

The run's folder on the shared volume holds its checkpoints, so a retried train task of
the same run resumes from the latest committed checkpoint instead of starting over.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from trainer.config import DEFAULT_CHECKPOINT_MODE, TrainConfig, build_config, parse_overrides
from trainer.faults import parse_faults
from trainer.launch import run_local_training, trainer_arguments


def plan_run(
    *,
    dataset_dir: str,
    run_folder: str | Path,
    steps: int,
    checkpoint_every: int,
    checkpoint_mode: str = DEFAULT_CHECKPOINT_MODE,
    seed: int,
    preset: str,
    overrides: str = "",
    faults: str = "",
) -> tuple[TrainConfig, list[str]]:
    """The checked config and the trainer's arguments for one pipeline run, in whichever pod
    or job it trains. Fails in one line on a bad override or fault, before any rank starts."""
    override_items = parse_overrides(overrides)
    fault_items = [str(spec) for spec in parse_faults(faults)]
    config = build_config(
        preset,
        [
            *override_items,
            f"run.steps={steps}",
            f"checkpoint.every_steps={checkpoint_every}",
            f"checkpoint.mode={checkpoint_mode}",
        ],
    )
    args = trainer_arguments(
        dataset_dir=dataset_dir,
        workdir=str(Path(run_folder) / "train"),
        steps=steps,
        checkpoint_every=checkpoint_every,
        checkpoint_mode=checkpoint_mode,
        seed=seed,
        preset=preset,
        checkpoint_dir=str(Path(run_folder) / "checkpoints"),
        overrides=override_items,
        faults=fault_items,
    )
    return config, args


def run_result(summary: dict[str, Any], config: TrainConfig, preset: str) -> dict[str, Any]:
    """The trainer's summary plus what the later steps need to know about the config."""
    return {
        **summary,
        "preset": preset,
        "config_sha256": hashlib.sha256(config.to_json().encode()).hexdigest(),
        "model_config": config.to_dict()["model"],
    }


def train_in_pod(
    *,
    dataset_dir: str,
    run_folder: str | Path,
    steps: int,
    nproc: int,
    checkpoint_every: int,
    checkpoint_mode: str = DEFAULT_CHECKPOINT_MODE,
    seed: int,
    preset: str,
    overrides: str = "",
    faults: str = "",
    echo: bool = True,
) -> dict[str, Any]:
    """Train with `nproc` local ranks; returns the trainer's summary plus the config used."""
    config, args = plan_run(
        dataset_dir=dataset_dir,
        run_folder=run_folder,
        steps=steps,
        checkpoint_every=checkpoint_every,
        checkpoint_mode=checkpoint_mode,
        seed=seed,
        preset=preset,
        overrides=overrides,
        faults=faults,
    )
    summary = run_local_training(nproc, args, Path(run_folder) / "train", echo=echo)
    return run_result(summary, config, preset)
