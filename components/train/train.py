"""Run training for one pipeline run on this pod (or machine) and describe the result.

`TrainRequest` is the train step's half of the train contract: the pipeline's training
parameters for one run, mapped onto the trainer's config in one place
(`trainer.arguments.config_from_pipeline`). Whichever launcher trains, the ranks receive
that one config (`--config`), and the step gets back a `TrainResult`. The run's folder on
the shared volume holds its checkpoints, so a retried train task of the same run resumes
from the latest committed checkpoint instead of starting over.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import rtp_prefork
from components.train.job_scale import job_scale
from trainer.arguments import config_from_pipeline
from trainer.config import DEFAULT_PRESET, TrainConfig
from trainer.gpu_defaults import launcher_settings as gpu_launcher_settings
from trainer.gpu_defaults import resilience_overrides
from trainer.launch import TrainingFailed, run_local_training
from trainer.summary import TrainSummary

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class TrainRequest:
    """A pipeline run's training parameters, as the train step receives them."""

    dataset_dir: str
    """The staged dataset snapshot to train on."""
    run_folder: Path
    """<mount>/rtp/runs/<run>: the trainer works in train/, checkpoints go to checkpoints/."""
    model_dir: str = ""
    """The staged Hugging Face model folder; empty trains the built-in byte-level model."""
    preset: str = DEFAULT_PRESET
    overrides: str = ""
    """Extra trainer config, 'section.field=value' items separated by spaces."""
    settings: Mapping[str, Any] = field(default_factory=dict)
    """The named settings the pipeline exposes (trainer.arguments.PIPELINE_SETTINGS)."""
    mlflow_experiment: str = ""
    """The MLflow experiment of the run's live metrics (the pipeline's name); empty keeps
    the config's."""
    mlflow_tags: Mapping[str, str] = field(default_factory=dict)
    """Tags of the run's MLflow run (KFP run id, pipeline version)."""

    @property
    def workdir(self) -> Path:
        return Path(self.run_folder) / "train"

    def config(self) -> TrainConfig:
        """The checked config; fails in one line on a bad override or fault, before any rank starts."""
        config = config_from_pipeline(
            preset=self.preset,
            overrides=self.overrides,
            dataset_dir=self.dataset_dir,
            workdir=str(self.workdir),
            checkpoint_dir=str(Path(self.run_folder) / "checkpoints"),
            model_dir=self.model_dir,
            **self.settings,
        )
        staged = bool(self.model_dir) and Path(self.model_dir).is_dir()  # not the check step's placeholder
        if staged:
            _check_parent_tokenizer(self.model_dir, self.dataset_dir)
        if config.optimizer.warm_start == "parent" and staged and not config.optimizer.initial_state_dir:
            _point_at_parent_checkpoint(config, Path(self.run_folder).parents[2])
        if self.mlflow_experiment:
            config.run.mlflow_experiment = self.mlflow_experiment
        config.run.mlflow_tags = {**config.run.mlflow_tags, **self.mlflow_tags}
        return config


def _check_parent_tokenizer(model_dir: str, dataset_dir: str) -> None:
    """A registered parent's tokenizer (its tag) against the dataset's, before any rank starts."""
    from components.stage_model.registry_source import origin_of
    from trainer.data import check_tokenizer

    origin = origin_of(model_dir)
    if origin is not None and origin.tokenizer and (Path(dataset_dir) / "manifest.json").is_file():
        check_tokenizer(dataset_dir, origin.tokenizer)


def _point_at_parent_checkpoint(config: TrainConfig, fsx_mount_path: Path) -> None:
    """optimizer.warm_start=parent: the parent version's checkpoint, if it is still there and the
    one it was exported from; otherwise the run starts fresh (logged)."""
    from components.stage_model.registry_source import origin_of, parent_checkpoint
    from trainer.config import ConfigError

    origin = origin_of(config.model.model_dir)
    if origin is None:
        raise ConfigError(
            "optimizer.warm_start=parent needs a registered version as the model source "
            "(model_source models:/<name>@<alias>); without one use optimizer.warm_start=fresh"
        )
    path, why_not = parent_checkpoint(origin, fsx_mount_path)
    if path is None:
        log.warning("optimizer.warm_start=parent: %s; starting with fresh AdamW moments", why_not)
        return
    config.optimizer.initial_state_dir, config.optimizer.initial_state_sha256 = (
        str(path),
        origin.checkpoint_sha256,
    )
    log.info("optimizer.warm_start=parent: AdamW moments from %s", path)


@dataclass(kw_only=True, slots=True)
class TrainResult:
    """What the train step reports: the trainer's summary and the config it trained with."""

    summary: TrainSummary
    config: TrainConfig
    preset: str
    launcher: str = "inpod"
    job_name: str = ""

    @property
    def config_sha256(self) -> str:
        return hashlib.sha256(self.config.to_json().encode()).hexdigest()

    @property
    def model_config(self) -> dict[str, Any]:
        return self.config.to_dict()["model"]


class FinishedRun(ValueError):
    """The run folder's training finished in another pipeline run at or past the steps asked
    for: training it again would train nothing and register the same model again."""


def refuse_finished_run(run_folder: Path, run_id: str, steps: int) -> None:
    """Before training: raise FinishedRun when `run_folder` holds a training that finished
    at `steps` or later in a KFP run other than `run_id` (a retry of the same run resumes).

    The train step's record (steps/train.json) names the KFP run that wrote it; a record
    without one (written before it was kept) counts as another run's."""
    import json

    record_path = Path(run_folder) / "steps" / "train.json"
    try:
        record = json.loads(record_path.read_text())
    except FileNotFoundError:
        return
    except (OSError, ValueError) as exc:
        raise FinishedRun(
            f"{record_path} cannot be read ({exc}); remove it or pick another run_name"
        ) from exc
    finished_in = str(record.get("kfp_run_id") or "")
    trained = int(record.get("steps") or 0)
    if (run_id and finished_in == run_id) or trained < steps:
        return
    raise FinishedRun(
        f"run {Path(run_folder).name!r} finished training at step {trained} in "
        f"{f'KFP run {finished_in}' if finished_in else 'an earlier pipeline run'}; training it to "
        f"step {steps} would train nothing and register the same model again: pass a new run_name "
        "(empty uses the KFP run id, as a recurring run should), or more steps to continue it; to train "
        "further from its registered version, start a new run with model_source=models:/<name>@<alias>"
    )


class CheckpointOutsideRun(RuntimeError):
    """The training reported a checkpoint outside its own run folder."""


class TrainingIncomplete(TrainingFailed):
    """Training ended before its target step (SIGTERM from a node drain, a Spot reclaim or a
    deleted pod): the model is partly trained and must not be validated or registered."""


def require_completed(summary: TrainSummary, config: TrainConfig) -> None:
    """Raise TrainingIncomplete unless the run reached its target step (or the `stop_after`
    step it was asked to stop at, without a signal)."""
    if summary.completed:
        return
    stop_after = config.run.stop_after_steps
    if stop_after and summary.steps >= stop_after and not summary.stopped_by_signal:
        return
    why = "it was stopped by SIGTERM (a node drain, Spot reclaim or deleted pod)" if (
        summary.stopped_by_signal) else "it ended early"  # fmt: skip
    raise TrainingIncomplete(
        f"training reached step {summary.steps} of {summary.target_steps}: {why}. Its last checkpoint "
        f"({summary.checkpoint or 'none'}) is kept; run again with the same run_name to resume from it"
    )


def checked_result(result: TrainResult, request: TrainRequest) -> TrainResult:
    """`result`, once training is known to have reached its target and its checkpoint to lie
    in this run's checkpoints folder: later steps load and register whatever the train step
    reports, so it must be this run's finished model."""
    require_completed(result.summary, result.config)
    checkpoint = result.summary.checkpoint
    own = (Path(request.run_folder) / "checkpoints").resolve()
    if checkpoint is not None and not Path(checkpoint).resolve().is_relative_to(own):
        raise CheckpointOutsideRun(
            f"training reported checkpoint {checkpoint}, which is not under this run's {own}; "
            "refusing to hand another run's checkpoint to validate and register"
        )
    return result


def train_in_pod(
    request: TrainRequest, *, nproc: int, echo: bool = True, gpus: int | None = None
) -> TrainResult:
    """Train with `nproc` local ranks under ft_launcher. On a pod with GPUs (`gpus`, default:
    the CUDA devices visible here) the GPU timeout table applies, as in job pods
    (trainer/gpu_defaults.py); a user's `resilience.*` override still wins."""
    gpus = _visible_gpus() if gpus is None else gpus
    settings = None
    if gpus > 0:
        scaled = " ".join([*resilience_overrides(), request.overrides]).strip()
        request = dataclasses.replace(request, overrides=scaled)
        settings = gpu_launcher_settings(max_restarts=job_scale(gpus).max_restarts)
    config = request.config()
    settings = rtp_prefork.launcher_settings(config, settings)
    summary = run_local_training(nproc, config, echo=echo, settings=settings)
    return checked_result(TrainResult(summary=summary, config=config, preset=request.preset), request)


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
