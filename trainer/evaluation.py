"""Holdout scores of a model, and the eval record the training ranks write after the last step.

A model is scored on fixed, evenly spaced windows of the dataset's holdout split (never
trained on): the summed next-token loss, the tokens predicted and the UTF-8 bytes they decode
to, so models with different tokenizers compare in bits per byte (`HoldoutScore`).

At the end of training every rank scores the sharded model where it already is
(`write_eval_record`, collective: each rank runs the same forwards on all windows, so the
score does not depend on the world size), and rank 0 writes `<workdir>/eval.json` bound to
the weights it scored (`model_sha256`), the step and the holdout's identity (its files and a
digest of the scored windows). The validate step then decides from that record instead of
loading the whole model into one process (components/validate_checkpoint/validate.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.models.spec import Tokenizer

__all__ = [
    "EVAL_RECORD",
    "HoldoutScore",
    "decoded_bytes",
    "holdout_identity",
    "read_eval_record",
    "score_windows",
    "write_eval_record",
]

EVAL_RECORD = "eval.json"
BYTES_IDENTITY = "bytes"
RECORD_VERSION = 1


@dataclass(frozen=True, slots=True)
class HoldoutScore:
    nats_total: float
    """Summed next-token cross-entropy over every predicted token."""
    tokens: int
    """Tokens predicted (each window's targets)."""
    bytes: int
    """UTF-8 bytes those tokens decode to."""

    @property
    def nats_per_token(self) -> float:
        return self.nats_total / max(1, self.tokens)

    @property
    def bits_per_byte(self) -> float:
        return self.nats_total / math.log(2) / max(1, self.bytes)

    @property
    def nats_per_byte(self) -> float:
        """bits_per_byte * ln 2: the unit of `max_loss` and `min_improvement`."""
        return self.nats_total / max(1, self.bytes)


def decoded_bytes(tokenizer: Tokenizer, ids: Sequence[int]) -> int:
    """UTF-8 bytes of `ids`: one per token for the byte tokenizer; otherwise the length of
    their decoded text, EOS (a document separator, not text) left out."""
    if tokenizer.identity == BYTES_IDENTITY:
        return len(ids)
    eos = tokenizer.eos_id
    return len(tokenizer.decode([i for i in ids if i != eos]).encode("utf-8"))


@torch.no_grad()
def score_windows(
    model: nn.Module,
    loss: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    batches: Sequence[torch.Tensor],
    tokenizer: Tokenizer,
    device: torch.device | None = None,
) -> HoldoutScore:
    """Score `batches` of (rows, window) token ids: `loss` is the spec's mean next-token loss.
    The model is left in eval mode (the caller restores training mode when it trains on)."""
    model.eval()
    nats, tokens, byte_count = 0.0, 0, 0
    for batch in batches:
        targets = batch[:, 1:]
        nats += loss(model, batch if device is None else batch.to(device)).item() * targets.numel()
        tokens += targets.numel()
        byte_count += sum(decoded_bytes(tokenizer, row.tolist()) for row in targets)
    return HoldoutScore(nats_total=nats, tokens=tokens, bytes=byte_count)


def holdout_identity(files: Sequence[Any], batches: Sequence[torch.Tensor], seq_len: int) -> dict[str, Any]:
    """What a score was computed on: the holdout files (key, size, dtype), the windows scored and
    a digest of their token ids, so a record is used only for exactly the same windows."""
    keys = hashlib.sha256()
    for f in files:
        keys.update(f"{f.key}\t{f.size}\t{f.dtype}\n".encode())
    windows = hashlib.sha256()
    for batch in batches:
        windows.update(batch.to(torch.int64).contiguous().numpy().tobytes())
    return {
        "files": len(files),
        "files_sha256": keys.hexdigest(),
        "windows": sum(int(b.shape[0]) for b in batches),
        "windows_sha256": windows.hexdigest(),
        "seq_len": seq_len,
    }


def write_eval_record(
    model: nn.Module, config: Any, model_sha256: str, step: int, rank: int, device: torch.device
) -> Path | None:
    """Collective: score the (sharded) model on `config.data.eval_windows` holdout windows on
    every rank, then rank 0 writes `<workdir>/eval.json` atomically. Returns its path (None
    on other ranks). Every rank runs the same forwards, as FSDP's gathers require."""
    from trainer.data import holdout_batches, load_tokens, split_files
    from trainer.models import model_spec

    spec = model_spec(config.model.kind)
    _, holdout = split_files(config.data.dataset_dir, config.data.holdout_fraction)
    tokens = load_tokens(holdout)
    batches = holdout_batches(tokens, config.model.seq_len, max_windows=config.data.eval_windows)
    was_training = model.training
    try:
        score = score_windows(model, spec.loss, batches, spec.tokenizer(config.model), device)
    finally:
        model.train(was_training)
    if rank != 0:
        return None
    record = {
        "version": RECORD_VERSION,
        "model_sha256": model_sha256,
        "step": step,
        "model_kind": config.model.kind,
        "holdout": {**holdout_identity(holdout, batches, config.model.seq_len), "tokens": tokens.numel()},
        "loss": score.nats_per_token,
        "bits_per_byte": score.bits_per_byte,
        "nats_total": score.nats_total,
        "tokens": score.tokens,
        "bytes": score.bytes,
        "device": device.type,
    }
    path = Path(config.run.workdir) / EVAL_RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{EVAL_RECORD}.tmp")
    with staging.open("w") as handle:
        json.dump(record, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(staging, path)  # readers see the old record or the new one, never half of one
    return path


def read_eval_record(path: str | Path) -> dict[str, Any] | None:
    """The eval record at `path`, or None when there is none or it is not a readable record."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("version") != RECORD_VERSION:
        return None
    return record
