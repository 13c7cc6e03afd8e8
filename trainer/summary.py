"""What a training run reports when it ends: `<workdir>/summary.json` as a dataclass.

Rank 0 writes it once the loop is done; `rtp train-local`, the train step (in its pod or
after a job) and the benchmarks read it back with `TrainSummary.read`. Having one typed
record instead of a string-keyed dict built in several places means a field is named,
typed and documented once, and a reader fails loudly on a summary it does not understand.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(kw_only=True, slots=True)
class TrainSummary:
    steps: int
    """The last step trained (equals target_steps when the run completed)."""
    target_steps: int
    completed: bool
    stopped_by_signal: bool
    """SIGTERM arrived: the run saved a final checkpoint and stopped early."""
    steps_run: int
    """Steps this attempt trained (after resuming)."""
    final_loss: float | None
    losses: list[dict[str, Any]]
    """Training loss by step, as {"step", "loss"} records."""
    checkpoint: str | None
    """The latest committed checkpoint folder, or None when none was written."""
    checkpoint_mode: str
    resumed_from: str | None
    checkpoint_saves: list[dict[str, Any]]
    checkpoint_blocked_s: float
    """Seconds the loop waited on checkpoint saves in total (the fast tier's copies included)."""
    local_tier_s: float = 0.0
    """Of those, the fast tier's copies (checkpoint.local_every_steps)."""
    local_tier_captures: int = 0
    """Fast-tier copies taken by this attempt (rank 0's view)."""
    local_tier_interval: int = 0
    """The fast tier's interval in steps at the attempt's end (0 = off)."""
    local_tier_interval_reason: str = ""
    """Why that interval: checkpoint.local_every_steps, or the copy budget it was chosen from."""
    local_tier_copy_s: float | None = None
    """Budget mode: rank 0's median time of one copy, what the interval was chosen on."""
    local_tier_step_s: float | None = None
    """Budget mode: rank 0's median step time (steps without a copy in flight)."""
    local_tier_checksum_s: float = 0.0
    """Seconds rank 0's copy thread spent on its captures' checksums (off the loop's path)."""
    local_replicas_sent: int = 0
    """Fast-tier files rank 0 sent to its peers (checkpoint.local_replicas)."""
    stragglers: dict[str, Any] = field(default_factory=dict)
    """The newest comparison of the ranks' local work (trainer/stragglers.py): each rank's
    median and its ratio to the other ranks' median, and `slow`, the ranks named."""
    efficiency_pct: float
    """Share of the loop's wall time not spent blocked on checkpoints."""
    final_drain_s: float
    checkpointer_start_s: float
    checkpointer_teardown_s: float
    checkpoint_host_copies: float = 0.0
    """Host memory checkpointing held at most (fast-tier slots + the writer's own buffers),
    in copies of rank 0's state; 2 when a save writes from the fast tier's capture."""
    loop_wall_s: float
    world_size: int
    device: str
    model_sha256: str
    """SHA-256 of the full trained weights: equal runs have equal hashes."""
    train_seconds: float
    wall_seconds: float
    peak_mem_bytes: int = 0
    """Rank 0's peak memory at the end of the loop (CUDA: allocated; CPU: resident set)."""
    peak_mem_bytes_by_phase: dict[str, int] = field(default_factory=dict)
    """CUDA only: rank 0's `torch.cuda.max_memory_allocated` per phase of the attempt —
    `train` (start-up, the loop with its saves and periodic evaluation, the last commit),
    `fingerprint` (model_sha256 gathers each tensor whole) and `evaluation` (the end-of-run
    holdout score) — to set beside the memory plan's `phases_gib` (trainer/memory_plan.py)."""
    # Rank 0 adds the goodput analysis of the whole run (all attempts) and its report.
    restarts: list[dict[str, Any]] = field(default_factory=list)
    goodput_pct: float = 0.0
    productive_s: float = 0.0
    run_wall_s: float = 0.0
    lost_steps: int = 0
    """Steps trained again after restarts."""
    faults_injected: int = 0
    goodput_report: str = ""
    """Path of the run's goodput.html."""
    mlflow_run_id: str = ""
    """The MLflow run holding the live metrics (empty without MLFLOW_TRACKING_URI)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TrainSummary:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(
                f"training summary has unknown fields {unknown}: written by another rtp version?"
            )
        return cls(**raw)

    @classmethod
    def read(cls, path: str | Path) -> TrainSummary:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def write(self, path: str | Path) -> None:
        from trainer.events import write_json_atomic

        write_json_atomic(Path(path), self.to_dict())
