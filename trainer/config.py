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
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from trainer.faults import FaultSpecError, parse_faults

CheckpointMode = Literal["off", "sync", "torch-async", "async"]
ModelInit = Literal["pretrained", "random"]
MixedPrecision = Literal["auto", "bf16", "fp32"]
ActivationCheckpointing = Literal["none", "full", "every_n"]
CHECKPOINT_MODES: tuple[str, ...] = typing.get_args(CheckpointMode)
DEFAULT_CHECKPOINT_MODE: CheckpointMode = "async"
DEFAULT_PRESET = "tiny-cpu"


def named(param: str, default: Any, *, path: bool = False, pipeline: bool = False) -> Any:
    """A field with its own name `param` (flag `--param-with-dashes`); with `pipeline`, also
    a parameter of the pipeline (its Kubeflow UI form, `rtp local` and `rtp render-job`).

    Overrides may not set it: the named parameter is its one source. `path` marks a
    location on disk, which entry points derive from the run folder.
    """
    return field(default=default, metadata={"param": param, "path": path, "pipeline": pipeline})


class ConfigError(ValueError):
    """A configuration value a user supplied is wrong; the message says how to fix it."""


MODEL_RULES: dict[str, Callable[..., Any]] = {}
"""How a model kind is checked (`require_kind`) and identified (`architecture`): set by
trainer.models, which trainer/__init__.py imports, so this module never imports model code."""


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    kind: str = "byte-lm"
    """Registry key (trainer/models): byte-lm (built-in, byte-level) or hf (a Hugging Face
    causal LM from model_dir; vocab_size, d_model, n_layers, n_heads then come from its config.json).
    Giving model_dir selects hf."""
    model_dir: str = named("model_dir", "", path=True)
    """A Hugging Face model folder (config.json, optional *.safetensors weights, tokenizer
    files) to train instead of the built-in byte-level model; empty = the byte-level model."""
    init: ModelInit = named("model_init", "pretrained", pipeline=True)
    """How a Hugging Face model's weights start: pretrained (the folder's safetensors) or
    random (seeded, from config.json: pretraining). The byte-level model always starts random."""
    vocab_size: int = 256
    """Byte-level vocabulary: every byte value is a token, so no tokenizer is needed."""
    seq_len: int = 64
    """Context length in tokens."""
    d_model: int = 64
    """Width of the residual stream."""
    n_layers: int = 2
    """Number of transformer blocks; each block is one FSDP unit."""
    n_heads: int = 4
    """Attention heads; must divide d_model."""

    def architecture(self) -> dict[str, Any]:
        """What identifies the architecture (hashed into model_hash); the registry entry says."""
        return MODEL_RULES["architecture"](self)


@dataclass(kw_only=True, slots=True)
class DataConfig:
    dataset_dir: str = named("dataset_dir", "", path=True)
    """A staged dataset snapshot (folder with manifest.json), as written by the stage step."""
    batch_size: int = 8
    """Sequences per rank per forward and backward (one micro-batch)."""
    global_batch: int = 0
    """Sequences per optimizer step over all ranks, a multiple of batch_size x world size: each
    rank accumulates gradients over global_batch / (batch_size x world size) micro-batches.
    0 = batch_size x world size (no accumulation). A fixed value keeps the batch and the data
    order when a run resumes on another number of ranks."""
    holdout_fraction: float = 0.1
    """Share of the dataset's files reserved for validation, chosen deterministically by key."""
    eval_windows: int = 64
    """Holdout windows the training ranks score after the last step, written to <workdir>/eval.json
    for the validate step (which then never loads the whole model); 0: no record, validate scores
    the checkpoint in one process (small models only)."""
    eval_champion: str = ""
    """A registered model name: the training ranks also score its MLflow `champion` (a Hugging
    Face version, loaded sharded) on the same windows, into eval.json, so the validate step
    never loads it whole; empty: off (validate scores the champion in its process)."""


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    lr: float = 3e-3
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.01
    warmup_steps: int = 5
    """Linear warm-up steps before the cosine decay."""
    min_lr_ratio: float = 0.1
    """The cosine decays to lr * min_lr_ratio at the last step."""
    grad_clip_norm: float = 1.0


LOCAL_INTERVAL_MODES = ("auto", "budget")
"""The named values of `checkpoint.local_every_steps` (besides a step count)."""


def parse_local_interval(dotted_key: str, value: Any) -> int | str:
    """`checkpoint.local_every_steps` from an override or JSON: a mode name or a step count."""
    text = str(value).strip().lower()
    if text in LOCAL_INTERVAL_MODES:
        return text
    if (isinstance(value, int) and not isinstance(value, bool)) or text.isdigit():
        return int(text)
    raise ConfigError(f"{dotted_key} must be auto, budget or a step count (0 = off), got {value!r}")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    mode: CheckpointMode = named("checkpoint_mode", DEFAULT_CHECKPOINT_MODE, pipeline=True)
    """How checkpoints are written: async (NVRx persistent worker, overlaps the write with
    training), torch-async (dcp.async_save), sync (dcp.save; each rank hashes its own shards,
    rank 0 commits from their sidecars) or off."""
    dir: str = named("checkpoint_dir", "", path=True)
    """Folder holding step_<N>/ checkpoints; empty means <workdir>/checkpoints."""
    every_steps: int = named("checkpoint_every", 10, pipeline=True)
    """Save a checkpoint every N steps (and always after the last step)."""
    keep_last: int = 3
    """Committed checkpoints to keep; older ones are deleted after a new one commits."""
    keep_every_steps: int = 0
    """Also keep every checkpoint whose step is a multiple of this (0 = none)."""
    record_weight_hashes: bool = False
    """Log the SHA-256 of the full weights at every save (events.jsonl), to prove async saves
    never tear. Costs a full gather per save: for tests and drills."""
    verify_hashes: bool = False
    """Also verify SHA-256 of every file when choosing the checkpoint to resume from."""
    local_every_steps: int | str = field(default="auto", metadata={"parse": parse_local_interval})
    """The fast tier: every N steps each rank keeps a copy of its own shard of the training
    state in memory (an in-process restart resumes from it) and in local_dir (a restarted
    worker group resumes from it), so a fault redoes at most N steps instead of every step
    since the last durable checkpoint; 0 = off. `budget`: the ranks measure the copy and the
    step over an attempt's first steps and agree on the shortest interval whose copies take
    at most 1% of the loop's time. `auto`: budget on CUDA, every step on CPU
    (trainer/checkpointing/local_tier.py)."""
    local_dir: str = named("checkpoint_local_dir", "", path=True)
    """Node-local folder of the fast tier's files (the rank processes' survivor, not the
    node's); empty = /dev/shm/rtp-local (a pod's memory-backed /dev/shm)."""
    local_replicas: int = 0
    """Peers that also hold each rank's fast-tier file (ranks on other nodes; on one node,
    the next ranks), so a rank whose node is lost resumes from a peer's copy instead of
    the durable checkpoint; 0 = none. Costs a network copy of the rank's state per file
    written (trainer/checkpointing/replicas.py)."""


@dataclass(kw_only=True, slots=True)
class RunConfig:
    steps: int = named("steps", 40, pipeline=True)
    """Total optimizer steps of the run (a resumed run continues up to this number)."""
    seed: int = named("seed", 1234, pipeline=True)
    """Random seed for weights and data order."""
    workdir: str = named("workdir", "rtp-work/train", path=True)
    """Where checkpoints, events.jsonl, logs and summary.json go."""
    log_every_steps: int = 5
    """Rank 0 logs a progress line and live metrics (MLflow, when configured) every N steps."""
    mlflow_experiment: str = "rtp"
    """MLflow experiment of the run's live metrics (named after the pipeline). Metrics go to
    MLflow only when MLFLOW_TRACKING_URI is set."""
    mlflow_run_name: str = ""
    """Name of the run's MLflow run; empty = the run folder's name. Every attempt of a run
    (resume, restart, KFP retry) continues the one MLflow run tagged with its workdir."""
    mlflow_tags: dict[str, str] = field(default_factory=dict)
    """Extra tags on the MLflow run when it is created (the train step adds the KFP run id
    and the pipeline version)."""
    mlflow_buffer_limit: int = 20000
    """Metric values held in memory while MLflow is unreachable; later ones are dropped (with
    one warning) so training never waits on MLflow."""
    stop_after_steps: int = named("stop_after", 0)
    """Stop (exit cleanly) once this step is reached and checkpointed; 0 = never. Lets a
    test or an operator interrupt a run at a known step and resume it later."""
    faults: str = named("faults", "", pipeline=True)
    """Injected faults for a drill or test, `KIND@STEP[:RANK]` separated by commas: KIND is
    exception, hang, sigkill or sigkill-during-save; each fires once per run on RANK
    (default 0); slow-save blocks every rank's save at STEP for twice the soft timeout.
    Empty (or none) = no faults."""


@dataclass(kw_only=True, slots=True)
class ResilienceConfig:
    inprocess_restarts: int = named("inprocess_restarts", 3)
    """Soft faults (an exception, a hang) restart training inside the same processes (NVRx
    in-process restart) up to this many times per process; 0 turns the layer off and leaves
    every fault to the launcher (ft_launcher restarts the whole worker group)."""
    soft_timeout_s: float = 30.0
    """A rank that reports no progress for this long is considered hung and restarted."""
    hard_timeout_s: float = 45.0
    """A hung rank that does not react within this long is terminated (must exceed soft)."""
    collective_timeout_s: float = 15.0
    """Process-group timeout: a safety net. A gloo collective cannot be aborted (pytorch
    issue 130345), so an in-process restart shuts the process groups' connections down
    instead and the ranks waiting on a failed peer leave at once (trainer/peer_abort.py);
    NCCL aborts at once. Only a wait no abort reaches ends here. On CPU it must stay below
    hard_timeout_s (or the waiting rank looks hung, is killed, and the launcher has to
    restart the group); on GPUs it is NCCL's watchdog and must exceed hard_timeout_s, since
    it ends the process (trainer/gpu_defaults.py)."""
    heartbeat_floor_s: float = 15.0
    """ft_launcher learns heartbeat timeouts from observed step times; learned values are
    never set below this floor (a busy shared CPU makes step times jumpy)."""
    blocking_work_limit_s: float = 120.0
    """Longest a blocking piece of checkpoint work (a sync save, the wait for an async write,
    the final save, the resume load, the end-of-run fingerprint) keeps the in-process
    watchdog and ft_launcher's heartbeats alive; past it they see no progress, so a hung
    file system is still caught. GPU runs get 3600 (trainer/gpu_defaults.py)."""
    prefork_workers: bool = True
    """Ranks the launcher starts again after a hard fault are forked from a process per
    node that has imported torch and the trainer already (trainer/prefork.py), instead of
    importing everything anew: a killed rank's worker group is back seconds sooner. The
    first worker group starts the usual way."""


@dataclass(kw_only=True, slots=True)
class TrainingConfig:
    """How the model's compute runs; none of it changes the weights a checkpoint holds
    (fp32 master weights whatever the compute dtype), so a run may resume under another."""

    mixed_precision: MixedPrecision = "auto"
    """Compute dtype: bf16 (FSDP2 gathers bf16 parameters and computes in bf16; gradients
    are reduced, and parameters, AdamW state and checkpoints kept, in fp32), fp32, or auto
    (bf16 on CUDA, fp32 on CPU, where bf16 is slower and the exactness tests run)."""
    activation_checkpointing: ActivationCheckpointing = "none"
    """Recompute a decoder layer's activations in the backward pass instead of keeping them:
    none, full (every layer) or every_n (every activation_checkpointing_every-th layer).
    Trades compute for memory; the weights trained are the same."""
    activation_checkpointing_every: int = 2
    """With activation_checkpointing=every_n: checkpoint layers 0, N, 2N, ..."""
    compile: bool = False
    """torch.compile each decoder layer's forward (the first steps pay for compilation;
    results match fp32 eager closely, not bit for bit)."""
    deterministic: bool = False
    """What bit-identical GPU resumes need: deterministic kernels only (torch.use_deterministic_algorithms;
    an op without one fails, naming it; cuDNN deterministic, no benchmarking), cuBLAS's fixed
    workspace (CUBLAS_WORKSPACE_CONFIG=:4096:8) and one NCCL algorithm and protocol
    (NCCL_ALGO=Ring, NCCL_PROTO=Simple; a value already in the environment is kept), for the
    same world size, GPUs and software. Without it a resumed GPU run ends close to an
    uninterrupted one, not equal. Slower. fp32 CPU training is deterministic either way and its
    weights do not change (trainer/determinism.py)."""


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)

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


def _infer_model_kind(config: TrainConfig) -> None:
    """A model folder means a Hugging Face model: `--model-dir DIR` alone selects kind hf."""
    if config.model.model_dir and config.model.kind == "byte-lm":
        config.model.kind = "hf"


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
    if m.init not in typing.get_args(ModelInit):
        raise ConfigError(f"model.init {m.init!r} is not one of {', '.join(typing.get_args(ModelInit))}")
    if m.kind == "hf" and not m.model_dir:
        raise ConfigError(
            "model.kind=hf needs model.model_dir: a folder with config.json (and tokenizer files)"
        )
    if m.kind != "hf" and m.model_dir:
        raise ConfigError(f"model.model_dir needs model.kind=hf (got {m.kind!r})")
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
    if not 0.0 < config.data.holdout_fraction < 1.0:
        raise ConfigError("data.holdout_fraction must be between 0 and 1 (exclusive)")
    if config.data.eval_windows < 0:
        raise ConfigError("data.eval_windows must be >= 0 (0: no end-of-training holdout score)")
    if config.checkpoint.mode not in CHECKPOINT_MODES:
        raise ConfigError(
            f"checkpoint.mode {config.checkpoint.mode!r} is not one of {', '.join(CHECKPOINT_MODES)}"
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
    if not 0 < r.soft_timeout_s < r.hard_timeout_s:
        raise ConfigError("resilience.soft_timeout_s must be positive and below resilience.hard_timeout_s")
    if r.collective_timeout_s <= 0 or r.heartbeat_floor_s <= 0:
        raise ConfigError("resilience.collective_timeout_s and heartbeat_floor_s must be positive")
    if r.blocking_work_limit_s <= 0:
        raise ConfigError("resilience.blocking_work_limit_s must be positive (seconds)")
    # How collective_timeout_s must compare with hard_timeout_s depends on the device
    # (gloo or NCCL): trainer.gpu_defaults.check_timeouts, when a rank starts.
    t = config.training
    choices: tuple[tuple[str, str, Any], ...] = (
        ("training.mixed_precision", t.mixed_precision, MixedPrecision),
        ("training.activation_checkpointing", t.activation_checkpointing, ActivationCheckpointing),
    )
    for key, chosen, allowed in choices:
        if chosen not in typing.get_args(allowed):
            raise ConfigError(f"{key} {chosen!r} is not one of {', '.join(typing.get_args(allowed))}")
    if t.activation_checkpointing_every < 1:
        raise ConfigError("training.activation_checkpointing_every must be at least 1")
    try:
        parse_faults(config.run.faults)
    except FaultSpecError as exc:
        raise ConfigError(str(exc)) from None
    if config.run.stop_after_steps < 0:
        raise ConfigError("run.stop_after_steps must be 0 (never) or a step number")
