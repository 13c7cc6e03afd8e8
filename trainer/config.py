"""The training configuration: the single source of truth for a training run.

One tree of dataclasses, named presets, `key=value` overrides, and the table of *named
settings*: the fields that have their own pipeline parameter and command-line flag (a
field's `param` metadata). `checkpoint.every_steps` is `checkpoint_every` in the pipeline
and `--checkpoint-every` on the command line; its default, its help (the docstring under
the field) and its allowed values (a Literal type) are declared here once, and
trainer/arguments.py generates the flags from them. Every entry point turns user input
into a config through `resolve_config`, so the config recorded for a run is the config
it trained with. The whole tree round-trips through JSON (`<run>/train/config.json`, and
inside every checkpoint, compared on resume).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import inspect
import itertools
import json
import re
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from trainer.config_sections import (  # noqa: F401  re-exported: callers import them from trainer.config
    CHECKPOINT_MODES,
    DEFAULT_CHECKPOINT_MODE,
    DEFAULT_PRESET,
    LOCAL_INTERVAL_MODES,
    MODEL_RULES,
    ActivationCheckpointing,
    CheckpointConfig,
    CheckpointMode,
    ConfigError,
    DataConfig,
    DataFormat,
    MixedPrecision,
    ModelConfig,
    ModelInit,
    OptimizerConfig,
    ParallelismConfig,
    ResilienceConfig,
    RunConfig,
    TrainingConfig,
    TrainingMethod,
    WarmStart,
    parse_local_interval,
)
from trainer.faults import FaultSpecError, parse_faults


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=2)

    def to_compact_json(self) -> str:
        """One line, for a command-line argument (`--config={...}` in a job's pods)."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> TrainConfig:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"a training config must be JSON: {exc}") from None
        if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
            raise ConfigError("a training config must be a JSON object of sections")
        config = cls.from_dict(raw)
        validate(config)
        return config

    @classmethod
    def read(cls, path: str | Path) -> TrainConfig:
        """A config written by `write` (`<run>/train/config.json`), validated."""
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read the training config {path}: {exc.strerror}") from None
        return cls.from_json(text)

    def write(self, path: str | Path) -> Path:
        """Write the config as JSON atomically (a reader never sees half a file)."""
        from trainer.events import write_json_atomic

        write_json_atomic(Path(path), self.to_dict())
        return Path(path)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TrainConfig:
        config = cls()
        for section_name, values in raw.items():
            for key, value in values.items():
                _set(config, f"{section_name}.{key}", value)
        return config

    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or f"{self.run.workdir}/checkpoints"

    def model_hash(self) -> str:
        """Identifies the architecture: checkpoints of a different architecture cannot resume."""
        blob = json.dumps(self.model.architecture(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


PRESETS: dict[str, dict[str, Any]] = {
    "tiny-cpu": {},
    "small-cpu": {
        "model": {"d_model": 128, "n_layers": 4, "n_heads": 4, "seq_len": 128},
        "data": {"batch_size": 8},
    },
    "bench-cpu": {
        "model": {"d_model": 640, "n_layers": 5, "n_heads": 8, "seq_len": 64},
        "data": {"batch_size": 2},
    },
    "gpu-1b": {
        "model": {"d_model": 2048, "n_layers": 20, "n_heads": 16, "seq_len": 1024},
        "data": {"batch_size": 4},
        "optimizer": {"lr": 3e-4, "warmup_steps": 100},
        "checkpoint": {"every_steps": 500},
    },
    "gpu-125m": {
        "model": {"d_model": 768, "n_layers": 12, "n_heads": 12, "seq_len": 1024},
        "data": {"batch_size": 16},
        "optimizer": {"lr": 6e-4, "warmup_steps": 200},
        "checkpoint": {"every_steps": 500},
    },
}
"""Named starting points. tiny-cpu trains in seconds on a small CPU machine (demo and
tests); bench-cpu holds ~300 MB of checkpoint state (25M parameters + AdamW) and computes
little per step (2 sequences), so a synchronous save costs about two steps there
(docs/checkpointing.md): the case asynchronous checkpointing is for (`rtp bench checkpoint`)."""


def _validate_timeouts(r: ResilienceConfig) -> None:
    """The in-process timeouts: each auto or seconds (trainer/timeouts.py)."""
    if not 0 < r.timeout_floor_s <= r.timeout_ceiling_s or r.timeout_safety_factor < 1:
        raise ConfigError(
            "resilience.timeout_floor_s must be positive and at most resilience.timeout_ceiling_s, and "
            f"resilience.timeout_safety_factor at least 1, got {r.timeout_floor_s:g}, "
            f"{r.timeout_ceiling_s:g} and {r.timeout_safety_factor:g}"
        )
    soft, hard = r.soft_timeout_s, r.hard_timeout_s
    if soft == "auto" and hard != "auto":
        raise ConfigError(
            f"resilience.hard_timeout_s ({hard}) needs a resilience.soft_timeout_s in seconds below it "
            "(a learned soft timeout is followed by a hard one of its own): set both, or leave both auto"
        )
    if soft != "auto" and hard != "auto" and not float(soft) < float(hard):
        raise ConfigError(
            f"resilience.soft_timeout_s ({soft}) must be below resilience.hard_timeout_s ({hard})"
        )


def _validate_lora(t: TrainingConfig, m: ModelConfig) -> None:
    """The LoRA settings (training.method=lora), which only pretrained Hugging Face models take."""
    if m.kind != "hf":
        raise ConfigError(
            f"training.method=lora needs a Hugging Face model (model.model_dir), not model.kind={m.kind}: "
            "train the built-in byte LM with training.method=full"
        )
    if m.init != "pretrained":
        raise ConfigError(
            "training.method=lora adapts a pretrained model's weights, which model.init=random does not "
            "load: set model.init=pretrained, or train from scratch with training.method=full"
        )
    if t.lora_rank < 1 or t.lora_alpha < 1 or not 0.0 <= t.lora_dropout < 1.0:
        raise ConfigError(
            "training.lora_rank and lora_alpha must be at least 1 and training.lora_dropout in [0, 1), "
            f"got {t.lora_rank}, {t.lora_alpha} and {t.lora_dropout:g}"
        )
    if not [name for name in t.lora_target_modules.split(",") if name.strip()]:
        raise ConfigError(
            "training.lora_target_modules is empty: all-linear, or module names such as q_proj,v_proj"
        )


def _set(config: TrainConfig, dotted_key: str, value: Any) -> None:
    section_name, _, key = dotted_key.partition(".")
    section = getattr(config, section_name, None)
    if section is None or not dataclasses.is_dataclass(section) or not key:
        sections = ", ".join(f.name for f in dataclasses.fields(config))
        raise ConfigError(
            f"unknown config key {dotted_key!r}: use <section>.<field>, sections are {sections}"
        )
    fields = {f.name: f for f in dataclasses.fields(section)}
    if key not in fields:
        raise ConfigError(
            f"unknown config key {dotted_key!r}: {section_name} has {', '.join(sorted(fields))}"
        )
    current = getattr(section, key)
    parse = fields[key].metadata.get("parse")  # a field of more than one type reads its own values
    setattr(section, key, parse(dotted_key, value) if parse else _coerce(dotted_key, value, type(current)))


def _coerce(dotted_key: str, value: Any, target: type) -> Any:
    if not isinstance(value, str):
        if target is float and isinstance(value, int):
            return float(value)
        if isinstance(value, target):
            return value
        raise ConfigError(f"{dotted_key} must be {target.__name__}, got {value!r}")
    try:
        if target is bool:
            lowered = value.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        return target(value)
    except ValueError:
        raise ConfigError(f"{dotted_key} must be {target.__name__}, got {value!r}") from None


@dataclass(frozen=True, slots=True)
class NamedSetting:
    """A config field with its own pipeline parameter and flag (see `named`)."""

    param: str
    key: str
    """Dotted config key, e.g. checkpoint.every_steps."""
    type: Any
    default: Any
    help: str
    path: bool
    pipeline: bool
    """Also a pipeline parameter (trainer.arguments.PIPELINE_SETTINGS)."""

    @property
    def flag(self) -> str:
        # `faults` is given one fault at a time on the command line: --fault KIND@STEP.
        return "--fault" if self.param == "faults" else "--" + self.param.replace("_", "-")

    @property
    def choices(self) -> tuple[Any, ...] | None:
        return typing.get_args(self.type) if typing.get_origin(self.type) is Literal else None

    @property
    def scalar_type(self) -> type:
        choices = self.choices
        return type(choices[0]) if choices else self.type


def field_docs(cls: type) -> dict[str, str]:
    """The docstrings written under a dataclass's fields (the help of flags and docs)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


@functools.cache
def named_settings() -> dict[str, NamedSetting]:
    """Every named setting by parameter name, in config order."""
    found: dict[str, NamedSetting] = {}
    for section in dataclasses.fields(TrainConfig):
        section_cls = section.default_factory  # type: ignore[misc]
        assert isinstance(section_cls, type)
        hints = typing.get_type_hints(section_cls)
        docs = field_docs(section_cls)
        for item in dataclasses.fields(section_cls):
            if "param" not in item.metadata:
                continue
            param = item.metadata["param"]
            found[param] = NamedSetting(
                param=param,
                key=f"{section.name}.{item.name}",
                type=hints[item.name],
                default=item.default,
                help=docs.get(item.name, ""),
                path=item.metadata["path"],
                pipeline=item.metadata["pipeline"],
            )
    return found


def resolve_config(
    *,
    preset: str = DEFAULT_PRESET,
    named: Mapping[str, Any] | None = None,
    overrides: Sequence[str] = (),
    base: TrainConfig | None = None,
) -> TrainConfig:
    """The one way an entry point turns user input into a checked config.

    Starts from `base` (a config read from a file) or `preset`, applies the free-form
    `overrides` (`section.field=value`), then the named settings (`{"steps": 40, ...}`,
    None meaning "not given"). An override may not set a field that has a named parameter
    (it has one source: its parameter) or a path (paths come from the run folder).
    """
    settings = named_settings()
    owned = {setting.key: setting for setting in settings.values()}
    for item in overrides:
        key = item.partition("=")[0].strip()
        if key in owned:
            setting = owned[key]
            where = (
                f"a path: the pipeline derives it from the run folder; `rtp train-local` takes {setting.flag}"
                if setting.path
                else f"set by its own parameter: {setting.param} in the pipeline, {setting.flag} on the command line"
            )
            raise ConfigError(f"override {item!r} is refused: {key} is {where}")
    items = list(overrides)
    for param, value in (named or {}).items():
        if param not in settings:
            raise ConfigError(f"unknown named setting {param!r}; known: {', '.join(settings)}")
        if value is None:
            continue
        if param == "faults":
            value = normalize_faults(value)
        items.append(f"{settings[param].key}={value}")
    if base is None:
        return build_config(preset, items)
    config = TrainConfig.from_dict(base.to_dict())
    apply_overrides(config, items)
    _infer_model_kind(config)
    validate(config)
    return config


def normalize_faults(value: str | Sequence[str]) -> str:
    """Faults as one comma-separated string; 'none' (the pipeline's default) means none."""
    text = value if isinstance(value, str) else ",".join(value)
    return "" if text.strip().lower() == "none" else text


def parse_overrides(text: str) -> list[str]:
    """Split a free-form overrides string ('a.b=1 c.d=2' or comma-separated) into items."""
    return [item for item in text.replace(",", " ").split() if item]


def build_config(preset: str = DEFAULT_PRESET, overrides: list[str] | None = None) -> TrainConfig:
    """A preset with `section.field=value` overrides applied, validated."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    config = TrainConfig.from_dict(PRESETS[preset])
    apply_overrides(config, overrides or [])
    _infer_model_kind(config)
    validate(config)
    return config


BYTE_LM_BUNDLE_WEIGHTS = "weights.safetensors"
"""The weights file of a byte LM folder (trainer/models/byte_lm.py): marks the folder's kind."""
BYTE_LM_ARCHITECTURE = ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads")


def _infer_model_kind(config: TrainConfig) -> None:
    """`--model-dir DIR` alone selects the folder's kind: a byte LM bundle (weights.safetensors,
    whose config.json then gives the architecture) stays byte-lm, anything else is hf."""
    m = config.model
    if not m.model_dir or m.kind != "byte-lm":
        return
    folder = Path(m.model_dir)
    if not (folder / BYTE_LM_BUNDLE_WEIGHTS).is_file():
        m.kind = "hf"
        return
    try:
        saved = json.loads((folder / "config.json").read_text())
        architecture = {name: int(saved[name]) for name in BYTE_LM_ARCHITECTURE}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{folder} holds {BYTE_LM_BUNDLE_WEIGHTS} but no readable byte LM config.json ({exc}): "
            "give a folder a registered byte LM version staged (weights.safetensors, config.json)"
        ) from None
    for name, value in architecture.items():
        setattr(m, name, value)


def apply_overrides(config: TrainConfig, overrides: Sequence[str]) -> None:
    """Apply `section.field=value` items in order (a later item wins), typed by the field."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} is not key=value (e.g. optimizer.lr=1e-3)")
        _set(config, key.strip(), value.strip())


def validate(config: TrainConfig) -> None:
    m = config.model
    MODEL_RULES["require_kind"](m.kind)  # a ModelError is a ConfigError
    if config.optimizer.warm_start not in typing.get_args(WarmStart):
        raise ConfigError(
            f"optimizer.warm_start {config.optimizer.warm_start!r} is not one of {', '.join(typing.get_args(WarmStart))}"
        )
    if m.init not in typing.get_args(ModelInit):
        raise ConfigError(f"model.init {m.init!r} is not one of {', '.join(typing.get_args(ModelInit))}")
    if m.kind == "hf" and not m.model_dir:
        raise ConfigError(
            "model.kind=hf needs model.model_dir: a folder with config.json (and tokenizer files)"
        )
    if m.kind == "byte-lm" and m.model_dir and not (Path(m.model_dir) / BYTE_LM_BUNDLE_WEIGHTS).is_file():
        raise ConfigError(
            f"model.model_dir {m.model_dir!r} with model.kind=byte-lm must hold a byte LM's "
            f"{BYTE_LM_BUNDLE_WEIGHTS} and config.json (a registered byte LM version, staged)"
        )
    if m.n_heads < 1 or m.d_model < 1:
        raise ConfigError(
            f"model.n_heads and model.d_model must be at least 1, got {m.n_heads} and {m.d_model}"
        )
    if m.d_model % m.n_heads:
        raise ConfigError(f"model.d_model ({m.d_model}) must be divisible by model.n_heads ({m.n_heads})")
    positive = {
        "run.steps": config.run.steps,
        "checkpoint.every_steps": config.checkpoint.every_steps,
        "checkpoint.keep_last": config.checkpoint.keep_last,
        "data.batch_size": config.data.batch_size,
        "model.seq_len": m.seq_len,
        "model.n_layers": m.n_layers,
    }
    for name, value in positive.items():
        if value < 1:
            raise ConfigError(f"{name} must be at least 1, got {value}")
    if config.data.global_batch < 0 or config.data.global_batch % config.data.batch_size:
        raise ConfigError(
            f"data.global_batch ({config.data.global_batch}) must be 0 (batch_size x world size) or a "
            f"multiple of data.batch_size ({config.data.batch_size})"
        )
    if config.data.eval_every_steps < 0 or (config.data.eval_every_steps and config.data.eval_windows < 1):
        raise ConfigError(
            f"data.eval_every_steps ({config.data.eval_every_steps}) must be 0 (off) or more, and needs "
            f"data.eval_windows of at least 1 (got {config.data.eval_windows})"
        )
    if not 0.0 < config.data.holdout_fraction < 1.0:
        raise ConfigError("data.holdout_fraction must be between 0 and 1 (exclusive)")
    if config.data.eval_windows < 0:
        raise ConfigError("data.eval_windows must be >= 0 (0: no end-of-training holdout score)")
    if config.checkpoint.mode not in CHECKPOINT_MODES:
        moved = (  # a user-facing mode until 7 December 2026
            "; torch-async is a benchmark's plug-in writer now: checkpoint.mode=sync with "
            "checkpoint.writer=benchmarks.torch_async:TorchAsyncWriter"
            if config.checkpoint.mode == "torch-async"
            else ""
        )
        raise ConfigError(
            f"checkpoint.mode {config.checkpoint.mode!r} is not one of {', '.join(CHECKPOINT_MODES)}{moved}"
        )
    if config.checkpoint.writer and (
        config.checkpoint.mode == "off" or not re.fullmatch(r"[\w.]+:\w+", config.checkpoint.writer)
    ):
        raise ConfigError(
            f"checkpoint.writer {config.checkpoint.writer!r} must be module:Class (a CheckpointWriter "
            "subclass, e.g. benchmarks.torch_async:TorchAsyncWriter) with a checkpoint.mode other than off"
        )
    if config.checkpoint.keep_every_steps < 0:
        raise ConfigError("checkpoint.keep_every_steps must be 0 (off) or a positive step count")
    interval = config.checkpoint.local_every_steps
    if interval not in LOCAL_INTERVAL_MODES and not (type(interval) is int and interval >= 0):
        raise ConfigError(
            f"checkpoint.local_every_steps must be auto, budget or a step count (0 = off), got {interval!r}"
        )
    if config.checkpoint.local_replicas < 0:
        raise ConfigError("checkpoint.local_replicas must be 0 (none) or a positive number of peers")
    r = config.resilience
    if r.inprocess_restarts < 0:
        raise ConfigError("resilience.inprocess_restarts must be 0 (off) or more")
    _validate_timeouts(r)
    if r.collective_timeout_s <= 0 or r.heartbeat_floor_s <= 0:
        raise ConfigError("resilience.collective_timeout_s and heartbeat_floor_s must be positive")
    if r.blocking_work_limit_s <= 0:
        raise ConfigError("resilience.blocking_work_limit_s must be positive (seconds)")
    if r.straggler_every_steps < 0 or r.straggler_threshold <= 1:
        raise ConfigError(
            "resilience.straggler_every_steps must be 0 (off) or more, and resilience.straggler_threshold "
            f"above 1 (times the other ranks' median), got {r.straggler_every_steps} and {r.straggler_threshold:g}"
        )
    if (
        r.allreduce_check_mib < 0
        or r.min_allreduce_gbps < 0
        or (r.min_allreduce_gbps and not r.allreduce_check_mib)
    ):
        raise ConfigError(
            "resilience.allreduce_check_mib and min_allreduce_gbps must be 0 (off) or positive, and a "
            f"floor needs a check to compare with, got {r.allreduce_check_mib:g} MiB and {r.min_allreduce_gbps:g} GB/s"
        )
    # How collective_timeout_s must compare with hard_timeout_s depends on the device
    # (gloo or NCCL): trainer.gpu_defaults.check_timeouts, when a rank starts.
    t = config.training
    choices: tuple[tuple[str, str, Any], ...] = (
        ("training.mixed_precision", t.mixed_precision, MixedPrecision),
        ("training.activation_checkpointing", t.activation_checkpointing, ActivationCheckpointing),
        ("training.method", t.method, TrainingMethod),
    )
    for key, chosen, allowed in choices:
        if chosen not in typing.get_args(allowed):
            raise ConfigError(f"{key} {chosen!r} is not one of {', '.join(typing.get_args(allowed))}")
    if t.activation_checkpointing_every < 1:
        raise ConfigError("training.activation_checkpointing_every must be at least 1")
    if t.method == "lora":
        _validate_lora(t, m)
    if config.data.format not in typing.get_args(DataFormat):
        raise ConfigError(
            f"data.format {config.data.format!r} is not one of {', '.join(typing.get_args(DataFormat))}"
        )
    if config.data.format == "examples" and m.kind != "hf":
        raise ConfigError(
            "data.format=examples trains a Hugging Face model on conversations rendered with its chat template: "
            f"give model.model_dir (the pipeline's model_source), not model.kind={m.kind}"
        )
    p = config.parallelism
    if p.dp_replicate < 0 or p.dp_shard < 0:
        raise ConfigError(
            "parallelism.dp_replicate and dp_shard must be 0 (auto) or a number of ranks, "
            f"got {p.dp_replicate} and {p.dp_shard}"
        )
    try:
        parse_faults(config.run.faults)
    except FaultSpecError as exc:
        raise ConfigError(str(exc)) from None
    if config.run.stop_after_steps < 0:
        raise ConfigError("run.stop_after_steps must be 0 (never) or a step number")
