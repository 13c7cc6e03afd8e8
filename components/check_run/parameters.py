"""One pure check of a pipeline run's parameters, before any staging or training.

`check_run_parameters` is what `rtp run`, `rtp schedule` and `rtp local` call before they
submit a run, and what the pipeline's first step calls in the cluster, so a bad value
fails in seconds with one message instead of after staging (and three retries). It
imports neither torch nor kfp: the training settings are resolved into the trainer's
config the way the train step will resolve them (components/train/train.py).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from components.layout import check_name
from components.mlflow_access import DEFAULT_MLFLOW_SECRET, MODEL_NAME
from trainer.config import named_settings

POSITIVE = (
    "nproc",
    "nnodes",
    "job_timeout_s",
    "stage_workers",
)  # the training numbers are checked by its config
NON_NEGATIVE = ("gpus_per_node", "efa_per_node", "keep_runs")
INTEGERS = (
    *POSITIVE,
    *NON_NEGATIVE,
    *(param for param, setting in named_settings().items() if setting.scalar_type is int),
)
STRUCTURED = ("gpu_node_selector", "gpu_tolerations")
COMPILED_MEMORY = {"validate": "validate_memory", "register": "register_memory"}
"""Step -> the check step's input holding the memory the compiled pipeline gives that step's
pod (`rtp compile --model-params`): constants of the compiled pipeline, not run parameters."""
_MODEL_NAME = MODEL_NAME  # one pattern for the run parameter and the registry calls
_LABEL_KEY = re.compile(r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")


class RunParameterError(ValueError):
    """A run parameter is wrong; the message names it and says what it accepts."""


def normalized(values: Mapping[str, Any]) -> dict[str, Any]:
    """Parameter values as typed Python values. Inside a pipeline they arrive in one struct,
    where numbers may be floats (5.0) or strings ("5") and objects JSON strings."""
    out = dict(values)
    for name in INTEGERS:
        value = out.get(name)
        if isinstance(value, float) and value.is_integer():
            out[name] = int(value)
        elif isinstance(value, str) and re.fullmatch(r"-?\d+(\.0*)?", value.strip()):
            out[name] = int(float(value))
    for name in STRUCTURED:
        value = out.get(name)
        if isinstance(value, str) and value.strip():
            with contextlib.suppress(json.JSONDecodeError):  # else reported as the wrong type
                out[name] = json.loads(value)
    return out


def check_run_parameters(values: Mapping[str, Any]) -> None:
    """Raise RunParameterError naming every wrong parameter in `values` (a run's parameters;
    those absent are not checked)."""
    from components.train.jobs import LAUNCHERS

    values = normalized(values)
    problems: list[str] = []
    for name in POSITIVE:
        if name in values and (type(values[name]) is not int or values[name] < 1):
            problems.append(f"{name} must be a whole number of at least 1, got {values[name]!r}")
    for name in NON_NEGATIVE:
        if name in values and (type(values[name]) is not int or values[name] < 0):
            problems.append(f"{name} must be a whole number of at least 0, got {values[name]!r}")
    for name, kind in (("run_name", "run name"), ("dataset_name", "dataset name")):
        value = values.get(name)
        if value:  # an empty run name means "use the KFP run id"
            try:
                check_name(kind, value)
            except ValueError as exc:
                problems.append(f"{name}: {exc}")
    if "launcher" in values and values["launcher"] not in LAUNCHERS:
        problems.append(f"launcher {values['launcher']!r} is not one of {', '.join(LAUNCHERS)}")
    if "model_name" in values and not _MODEL_NAME.fullmatch(str(values["model_name"])):
        problems.append(
            f"model_name {values['model_name']!r} must be letters, digits, '.', '_' or '-' (at most 256, "
            "starting with a letter or digit)"
        )
    for name in ("source", "model_source"):
        value = values.get(name)
        if name == "model_source" and value and str(value).startswith("models:/"):
            from components.stage_data.errors import StageError
            from components.stage_model.registry_source import parse_reference

            try:
                parse_reference(str(value))
            except StageError as exc:
                problems.append(str(exc))
        elif value and not re.fullmatch(r"s3://[a-z0-9][a-z0-9.-]{2,62}(/.*)?", str(value)):
            problems.append(
                f"{name} {value!r} must look like s3://bucket/prefix"
                + (" (or models:/<name>@<alias>, a registered version)" if name == "model_source" else "")
            )
    if values.get("data_format") == "examples" and "model_source" in values and not values["model_source"]:
        problems.append(
            "data_format examples trains a Hugging Face model on conversations (their chat template is the "
            "model's): give model_source, or data_format tokens for the built-in byte-level model"
        )
    if values.get("training_method") == "lora" and "model_source" in values and not values["model_source"]:
        problems.append(
            "training_method lora trains adapters on a pretrained Hugging Face model's frozen weights: "
            "give model_source, or training_method full for the built-in byte-level model"
        )
    if "mlflow_secret_name" in values:
        problems += _secret_name_problems(str(values["mlflow_secret_name"] or ""))
    if "source" in values and not values["source"]:
        problems.append("source is empty: give the S3 prefix of the training data, s3://bucket/prefix")
    selector = values.get("gpu_node_selector")
    if selector is not None and not (
        isinstance(selector, dict)
        and all(
            isinstance(k, str) and _LABEL_KEY.fullmatch(k) and isinstance(v, str) for k, v in selector.items()
        )
    ):
        problems.append(f"gpu_node_selector must map node label names to string values, got {selector!r}")
    tolerations = values.get("gpu_tolerations")
    if tolerations is not None and not (
        isinstance(tolerations, list) and all(isinstance(t, dict) for t in tolerations)
    ):
        problems.append(
            f"gpu_tolerations must be a list of Kubernetes toleration objects, got {tolerations!r}"
        )
    problems += _training_problems(values)
    problems += _model_step_memory_problems(values)
    if problems:
        raise RunParameterError("; ".join(problems))


def _secret_name_problems(name: str) -> list[str]:
    """Every step that reads the MLflow secret, and every job pod, references it by name: an
    empty name renders `secretKeyRef.name: ""`, which the API server refuses for every pod."""
    from components.train.jobs import _DNS_SUBDOMAIN  # the pattern the job manifest checks too

    if not name.strip():
        return [
            "mlflow_secret_name is empty: the steps and job pods read MLflow's settings from that "
            "secret and Kubernetes refuses a pod whose secret has no name; give the secret's name "
            f"(default {DEFAULT_MLFLOW_SECRET}, docs/eks.md step 6)"
        ]
    if len(name) > 253 or not _DNS_SUBDOMAIN.fullmatch(name):
        return [
            f"mlflow_secret_name {name!r} must be a Kubernetes secret name (a-z, 0-9, '-', '.', at most 253)"
        ]
    return []


def _training_problems(values: Mapping[str, Any]) -> list[str]:
    from components.train.train import TrainRequest
    from trainer.arguments import PIPELINE_SETTINGS
    from trainer.config import DEFAULT_PRESET, ConfigError

    request = TrainRequest(
        dataset_dir="<staged>",
        run_folder=Path("<run>"),
        model_dir="<staged model>" if values.get("model_source") else "",
        preset=values.get("preset", DEFAULT_PRESET),
        overrides=values.get("overrides", ""),
        settings={name: values[name] for name in PIPELINE_SETTINGS if name in values},
    )
    try:
        request.config()
    except ConfigError as exc:
        return [f"training: {exc}"]
    return []


def _model_step_memory_problems(values: Mapping[str, Any]) -> list[str]:
    """The validate and register pods' memory is compiled in (`rtp compile --model-params`);
    a run of a bigger built-in model than it was compiled for would be OOM-killed after
    training. A Hugging Face or registered model's size is unknown before it is staged."""
    from components.step_memory import byte_lm_parameters, undersized_steps
    from components.train.train import TrainRequest
    from trainer.arguments import PIPELINE_SETTINGS
    from trainer.config import DEFAULT_PRESET, ConfigError

    compiled = {step: str(values[name]) for step, name in COMPILED_MEMORY.items() if values.get(name)}
    if not compiled or values.get("model_source"):
        return []
    preset = values.get("preset", DEFAULT_PRESET)
    request = TrainRequest(
        dataset_dir="<staged>",
        run_folder=Path("<run>"),
        model_dir="",
        preset=preset,
        overrides=values.get("overrides", ""),
        settings={name: values[name] for name in PIPELINE_SETTINGS if name in values},
    )
    try:
        params = byte_lm_parameters(request.config().model)
        short = undersized_steps(params, compiled)
    except (ConfigError, ValueError):  # a wrong config or quantity is reported elsewhere
        return []
    if not short:
        return []
    needs = " and ".join(f"{step} {needed} (compiled: {given})" for step, (needed, given) in short.items())
    return [
        f"preset {preset} is a {params:.2g}-parameter model whose pods need {needs}: recompile the "
        f"pipeline with `rtp compile --model-params {params:.2g}` (docs/eks.md, step 8) or run a smaller preset"
    ]
