"""The sections of the training configuration (model, data, optimizer, checkpoint, run,
resilience, training, parallelism) and `named()`, which marks a field as a named setting. `trainer.config`
assembles them into `TrainConfig` and is where every caller imports them from."""

from __future__ import annotations

import math
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

CheckpointMode = Literal["off", "sync", "async"]
ModelInit = Literal["pretrained", "random"]
WarmStart = Literal["fresh", "parent"]
MixedPrecision = Literal["auto", "bf16", "fp32"]
ActivationCheckpointing = Literal["auto", "none", "full", "every_n"]
DataFormat = Literal["tokens", "examples"]
TrainingMethod = Literal["full", "lora"]
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
    files) to train instead of the built-in byte-level model, or a byte LM folder
    (weights.safetensors + config.json, a registered version) to continue; empty = a new byte LM."""
    init: ModelInit = named("model_init", "pretrained", pipeline=True)
    """How a Hugging Face model's weights start: pretrained (the folder's safetensors) or
    random (seeded, from config.json: pretraining). The byte-level model starts random unless
    model_dir holds a byte LM folder (then: its weights, or random with its architecture)."""
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
    """Share of the dataset's files reserved for validation, chosen deterministically by key;
    shards of `rtp prepare-data` keep the document split recorded in their index.json instead."""
    eval_windows: int = 64
    """Holdout windows the training ranks score after the last step, written to <workdir>/eval.json
    for the validate step (which then never loads the whole model); 0: no record, validate scores
    the checkpoint in one process (small models only)."""
    eval_every_steps: int = 0
    """The validation pass: every this many steps the ranks score the model on the same
    `eval_windows` holdout windows (collective; no weight changes) and report the loss in the
    log, the events (`eval`) and MLflow (`eval.loss`, `eval.bits_per_byte`); 0: only the end."""
    eval_champion: str = ""
    """A registered model name: the training ranks also score its MLflow `champion` (a Hugging
    Face version, loaded sharded) on the same windows, into eval.json, so the validate step
    never loads it whole; empty: off (validate scores the champion in its process)."""
    format: DataFormat = named("data_format", "tokens", pipeline=True)
    """tokens: a token stream (text, byte or token shards) read in random windows, every token
    trained on; examples: example shards of `rtp prepare-data --format chat` (conversations
    rendered with the model's chat template), trained on the assistant's tokens only, with
    data.global_batch counting examples (docs/fine-tuning.md)."""
    packing: bool = True
    """With data.format=examples: lay several examples in one row of seq_len + 1 tokens, each
    attending only to itself (positions restart per example); false: one example per row."""


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
    warm_start: WarmStart = "fresh"
    """A run that starts from a registered version (model_source models:/…): fresh = new AdamW
    moments and a new warm-up (the default: the parent's moments belong to its data and its
    learning-rate schedule's end); parent = the AdamW moments of the parent's committed training
    checkpoint, when it is still on the volume and is the one the version was exported from
    (else fresh, with the reason in the events). The warm-up runs again either way."""
    initial_state_dir: str = ""
    """Set by the train step for warm_start=parent: the parent's checkpoint folder."""
    initial_state_sha256: str = ""
    """Its manifest SHA-256 as the registered version records it; checked before it is read."""


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


def parse_timeout(dotted_key: str, value: Any) -> float | str:
    """`resilience.soft_timeout_s` / `hard_timeout_s` from an override or JSON: auto or seconds."""
    text = str(value).strip().lower()
    if text == "auto":
        return text
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if isinstance(value, bool) or not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"{dotted_key} must be auto or a positive number of seconds, got {value!r}")
    return seconds


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    mode: CheckpointMode = named("checkpoint_mode", DEFAULT_CHECKPOINT_MODE, pipeline=True)
    """How checkpoints are written: async (NVRx persistent worker, overlaps the write with
    training), sync (dcp.save; each rank hashes its own shards, rank 0 commits from their
    sidecars) or off."""
    writer: str = ""
    """A `CheckpointWriter` class (module:Class) that writes the saves in place of the mode's
    own: a plug-in, such as the benchmarks' torch-async (benchmarks.torch_async:TorchAsyncWriter)."""
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
    since the last durable checkpoint; 0 = off (`async` saves are still copied to host
    through one slot file in local_dir). `budget`: the ranks measure the copy and the
    step over an attempt's first steps and agree on the shortest interval whose copies take
    at most 1% of the loop's time. `auto`: budget on CUDA, every step on CPU
    (trainer/checkpointing/local_tier.py)."""
    local_dir: str = named("checkpoint_local_dir", "", path=True)
    """Node-local folder of the fast tier's files and of the slots `async` saves are written
    from (the rank processes' survivor, not the node's); empty = /dev/shm/rtp-local (a pod's
    memory-backed /dev/shm)."""
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
    (default 0); slow-save blocks every rank's save at STEP for twice the soft timeout;
    slow@STEP[:RANK][:MS] makes RANK's optimizer step MS ms (200) slower from STEP on (a
    straggler). Empty (or none) = no faults."""


@dataclass(kw_only=True, slots=True)
class ResilienceConfig:
    inprocess_restarts: int = named("inprocess_restarts", 3)
    """Soft faults (an exception, a hang) restart training inside the same processes (NVRx
    in-process restart) up to this many times per process; 0 turns the layer off and leaves
    every fault to the launcher (ft_launcher restarts the whole worker group)."""
    soft_timeout_s: float | str = field(default="auto", metadata={"parse": parse_timeout})
    """A rank that makes no progress (no step ends, no checkpoint work moves) for this long is
    hung and restarted in-process. `auto`: learned per run (trainer/timeouts.py) as
    timeout_safety_factor x the longest step-to-step interval, within timeout_floor_s and
    timeout_ceiling_s (twice that over the first 8 intervals, the ceiling before the first);
    kept across restarts in <workdir>/timeouts.json."""
    hard_timeout_s: float | str = field(default="auto", metadata={"parse": parse_timeout})
    """A hung rank that does not react within this long is terminated and ft_launcher restarts
    the worker group (must exceed soft). `auto`: the soft timeout plus timeout_floor_s."""
    timeout_floor_s: float = 20.0
    """Least learned soft timeout, and (auto mode) how long one C call may block the main
    thread before NVRx's automatic progress stamp calls it hung. GPU runs get 120."""
    timeout_ceiling_s: float = 600.0
    """Most learned soft timeout, and the one in force before a first step-to-step interval
    was seen. GPU runs get 1800."""
    timeout_safety_factor: float = 5.0
    """Learned soft timeout = this x the longest step-to-step interval (ft_launcher's factor
    for its heartbeat timeouts)."""
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
    the final save, the model build, the resume load, the end-of-run fingerprint) keeps the in-process
    watchdog and ft_launcher's heartbeats alive; past it they see no progress, so a hung
    file system is still caught. GPU runs get 3600 (trainer/gpu_defaults.py)."""
    straggler_every_steps: int = 20
    """Every this many steps the ranks compare their step's local work (trainer/stragglers.py)
    and a rank slower than `straggler_threshold` times the median is named; 0 turns it off."""
    straggler_threshold: float = 1.5
    """How many times the median of the other ranks' local work makes a rank a straggler."""
    grad_spike_factor: float = 0.0
    """A logged step's gradient norm at this many times the median of the last 20 logged ones
    is reported (a warning and a `grad_spike` event: trainer/grad_spikes.py); 0 turns it off."""
    allreduce_check_mib: float = 0.0
    """Before a process's first attempt trains, the ranks time an all-reduce of this many MiB
    over the world and report its bus bandwidth (trainer/link_check.py); 0 turns it off
    (CPU runs' default; GPU runs get 256)."""
    min_allreduce_gbps: float = 0.0
    """A bus bandwidth (GB/s) below this ends the attempt (SlowInterconnect; the launcher's
    restart measures again); 0 only reports. Take it from nccl-tests' all_reduce_perf on
    a healthy pair of your nodes."""
    prefork_workers: bool = True
    """Ranks the launcher starts again after a hard fault are forked from a process per
    node that has imported torch and the trainer already, instead of importing everything
    anew: a killed rank's worker group is back seconds sooner. Read by the launcher side,
    which then starts ranks through the rtp_prefork plugin; the trainer never reads it."""


@dataclass(kw_only=True, slots=True)
class TrainingConfig:
    """How the model's compute runs and which parameters train. Only `method` and the LoRA
    settings change what a checkpoint holds (a LoRA run's adapters, not its weights); the rest
    does not (fp32 master weights whatever the compute dtype), so a run may resume under another."""

    method: TrainingMethod = named("training_method", "full", pipeline=True)
    """full: every parameter trains; lora: the model's weights stay frozen and low-rank adapters
    (peft's LoRA) on `lora_target_modules` train, so gradients, AdamW state and checkpoints hold
    the adapters only, with the identity of the base model they apply to (Hugging Face models;
    trainer/lora.py, docs/fine-tuning.md)."""
    lora_rank: int = 16
    """LoRA: the adapters' rank r; an adapted weight W (out x in) gains B @ A, A r x in, B out x r."""
    lora_alpha: int = 32
    """LoRA: the adapters' output is scaled by lora_alpha / lora_rank."""
    lora_dropout: float = 0.0
    """LoRA: dropout on the adapters' input (drawn from the torch RNG, which checkpoints restore)."""
    lora_target_modules: str = "all-linear"
    """LoRA: the modules that get adapters: all-linear (every linear layer but the output head:
    the attention and MLP projections), or module names separated by commas
    (q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj for Llama)."""

    mixed_precision: MixedPrecision = "auto"
    """Compute dtype: bf16 (FSDP2 gathers bf16 parameters and computes in bf16; gradients
    are reduced, and parameters, AdamW state and checkpoints kept, in fp32), fp32, or auto
    (bf16 on CUDA, fp32 on CPU, where bf16 is slower and the exactness tests run)."""
    activation_checkpointing: ActivationCheckpointing = "auto"
    """Recompute a decoder layer's activations in the backward pass instead of keeping them:
    none, full (every layer) or every_n (every activation_checkpointing_every-th layer).
    Trades compute for memory; the weights trained are the same. auto: on GPUs, full when the
    memory plan (`rtp plan`, trainer/memory_plan.py) says the job does not fit without it,
    else none, decided once before the ranks start; none on CPU."""
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
class ParallelismConfig:
    """How the data-parallel ranks hold the state: FSDP over every rank, or HSDP, sharded
    within groups of `dp_shard` ranks and replicated over `dp_replicate` such groups (a 2-D
    mesh; the gradients are reduce-scattered in a group, then all-reduced across groups).
    Checkpoints do not depend on it: a run may resume under another layout."""

    dp_replicate: int = 0
    """Replica groups; 0 = auto: one (plain FSDP) on one node; on several nodes, one per node
    (shard within a node over NVLink, replicate across nodes over EFA) when a node's share
    of the state fits in half of a GPU's memory, else one."""
    dp_shard: int = 0
    """Ranks each replica group shards over; 0 = the world size / dp_replicate."""
