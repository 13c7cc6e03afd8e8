"""Holdout scores on example shards (`data.format=examples`): the loss per assistant token and
the bits per UTF-8 byte of the assistant's text, the same mask training uses.

The holdout examples scored are evenly spaced over the holdout side (at most `max_examples`,
the run's `data.eval_windows`), packed into rows as training packs them (each example
attending only to itself), so the score is the same whatever the world size or the rows
per forward. `identity` binds a score to those exact rows, as `holdout_identity` does for
token windows (trainer/evaluation.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from trainer.evaluation import HoldoutScore
from trainer.examples_data import ExampleBatch, build_rows, load_examples, masked_loss
from trainer.models.spec import Tokenizer


@dataclass(frozen=True, slots=True)
class ExampleHoldout:
    rows: ExampleBatch
    """Every scored row (scale 1: a forward returns its summed target loss)."""
    examples: int
    """Examples scored."""
    holdout_examples: int
    """Examples on the holdout side."""
    tokens: int
    """Tokens of the holdout side's examples."""
    files_sha256: str

    def identity(self, seq_len: int) -> dict[str, Any]:
        digest = hashlib.sha256()
        for tensor in (self.rows.ids, self.rows.positions, self.rows.targets):
            digest.update(tensor.to(torch.int64).contiguous().numpy().tobytes())
        return {
            "format": "examples",
            "files_sha256": self.files_sha256,
            "examples": self.examples,
            "windows": int(self.rows.ids.shape[0]),
            "windows_sha256": digest.hexdigest(),
            "seq_len": seq_len,
        }


def example_holdout(dataset_dir: str | Path, seq_len: int, max_examples: int, pad_id: int) -> ExampleHoldout:
    """The holdout rows of an example-shard snapshot (module docstring)."""
    _, holdout, index = load_examples(dataset_dir)
    count = max(1, min(max_examples, len(holdout)))
    chosen = np.linspace(0, len(holdout) - 1, num=count, dtype=np.int64).tolist()
    ids, positions, targets, _ = build_rows(
        [holdout.example(i) for i in chosen], seq_len + 1, packing=True, pad_id=pad_id, rows_multiple=1
    )
    files = hashlib.sha256()
    for shard in index["shards"]:
        if shard["split"] == "holdout":
            files.update(f"{shard['name']}\t{shard['sha256']}\n".encode())
    return ExampleHoldout(
        rows=ExampleBatch(ids, positions, targets, 1.0),
        examples=count,
        holdout_examples=len(holdout),
        tokens=sum(int(s["tokens"]) for s in index["shards"] if s["split"] == "holdout"),
        files_sha256=files.hexdigest(),
    )


def assistant_bytes(tokenizer: Tokenizer, ids: torch.Tensor, targets: torch.Tensor) -> int:
    """UTF-8 bytes of the target tokens of each row (EOS, not text, left out)."""
    total = 0
    for row_ids, row_targets in zip(ids[:, 1:].tolist(), targets.tolist(), strict=True):
        chosen = [i for i, t in zip(row_ids, row_targets, strict=True) if t and i != tokenizer.eos_id]
        total += len(tokenizer.decode(chosen).encode("utf-8"))
    return total


@torch.no_grad()
def score_examples(
    model: nn.Module,
    holdout: ExampleHoldout,
    tokenizer: Tokenizer,
    device: torch.device | None = None,
    rows_per_forward: int = 0,
) -> HoldoutScore:
    """Summed assistant-token loss, assistant tokens and their bytes over the holdout rows.
    The model is left in eval mode (the caller restores training mode)."""
    model.eval()
    rows = holdout.rows
    step = rows_per_forward or rows.ids.shape[0]
    nats = 0.0
    for start in range(0, rows.ids.shape[0], step):
        part = ExampleBatch(
            rows.ids[start : start + step],
            rows.positions[start : start + step],
            rows.targets[start : start + step],
            1.0,
        )
        nats += float(masked_loss(model, part if device is None else part.to(device)))
    return HoldoutScore(
        nats_total=nats,
        tokens=int(rows.targets.sum()),
        bytes=assistant_bytes(tokenizer, rows.ids, rows.targets),
    )
