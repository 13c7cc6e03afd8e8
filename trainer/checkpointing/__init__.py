"""Checkpointing: policy (`manager`), one writer per `checkpoint.mode`, and storage.

- `manager`: `CheckpointManager`, all the training loop calls, four calls — `load()`,
  `maybe_wait_for_staging()` before `optimizer.step()`, `save()` after every step,
  `close()` (or `abandon()` on the error path) — and the summary's figures; `resume_expected`
  tells the model build, before any weight exists, whether `load()` is to fill them.
- `writer`: the `CheckpointWriter` interface, the `off` writer and `sync` (torch DCP);
  `nvrx_writer`: `async` (NVRx's persistent worker); `checkpoint.writer` plugs in others.
- `local_tier`: the host-state engine, one host copy of each rank's shards per capture,
  read by the fast tier (with `tier_*`, `replicas`) and by `async` saves (`slot_refs`).
- `nvrx_compat`: what NVRx 0.4.1 needs on a CPU build of torch.
- `storage`: the on-disk format — staging, atomic commit, manifest, retention, loading,
  `latest_committed_checkpoint`; no training state, usable from a single process.
- `fingerprint`: SHA-256 of the weights, what the exactness checks compare.

The rest of the trainer imports only the names below (an import-linter contract in
pyproject.toml); `storage` is public too, for single-process readers of checkpoints.

Importing this package does not import NVRx.
"""

from trainer.checkpointing.fingerprint import model_sha256
from trainer.checkpointing.local_tier import forget_run
from trainer.checkpointing.manager import WRITERS, CheckpointManager, efficiency_pct, resume_expected
from trainer.checkpointing.storage import (
    CheckpointError,
    latest_committed_checkpoint,
    load_model_weights,
    read_meta,
    verify_checkpoint,
)
from trainer.checkpointing.tier_slots import (
    CaptureCache,
    default_local_root,
    forget_rank,
    local_folder,
    plan_state,
)
from trainer.checkpointing.writer import CheckpointWriter, SaveRecord

__all__ = [
    "WRITERS",
    "CaptureCache",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointWriter",
    "SaveRecord",
    "default_local_root",
    "efficiency_pct",
    "forget_rank",
    "forget_run",
    "latest_committed_checkpoint",
    "load_model_weights",
    "local_folder",
    "model_sha256",
    "plan_state",
    "read_meta",
    "resume_expected",
    "verify_checkpoint",
]
