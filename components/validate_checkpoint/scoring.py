"""Holdout scores that compare across tokenizers: nats per token and bits per byte.

A model's loss per token depends on its tokenizer (a BPE token covers several bytes, a
byte LM's token one), so models are compared on bits per byte: the summed next-token loss
over the evaluated windows divided by ln 2 and by the UTF-8 bytes the predicted tokens
decode to. For the byte LM one token is one byte, so its bits per byte is its nats per
token / ln 2. For a Hugging Face tokenizer the predicted tokens of each window are decoded
with the model's tokenizer; document separators (the EOS token) count as no bytes.

A champion with another tokenizer is scored on the same holdout text: each candidate
window is decoded to text and encoded again with the champion's tokenizer
(`retokenized_windows`). Nothing here reads files or talks to MLflow. The scoring
itself lives in trainer/evaluation.py, shared with the training ranks' end-of-run score.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainer.evaluation import BYTES_IDENTITY, HoldoutScore, decoded_bytes, score_windows
from trainer.models.spec import Tokenizer

__all__ = ["HoldoutScore", "decoded_bytes", "retokenized_windows", "score_windows"]


def _documents(ids: list[int], tokenizer: Tokenizer) -> list[str]:
    """The text of a window; split at EOS for a tokenizer whose EOS is not text itself."""
    if tokenizer.identity == BYTES_IDENTITY:  # its EOS is the newline: part of the text
        return [tokenizer.decode(ids)]
    parts: list[list[int]] = [[]]
    for token in ids:
        if token == tokenizer.eos_id:
            parts.append([])
        else:
            parts[-1].append(token)
    return [tokenizer.decode(part) for part in parts]


def retokenized_windows(
    batches: Sequence[torch.Tensor], source: Tokenizer, target: Tokenizer, seq_len: int
) -> list[torch.Tensor]:
    """The text of every window in `batches` (tokens of `source`) as `target`'s tokens, in
    windows of at most seq_len + 1 tokens (one row each: their lengths differ)."""
    windows = []
    for batch in batches:
        for row in batch.tolist():
            ids: list[int] = []
            for index, document in enumerate(_documents(row, source)):
                if index:
                    ids.append(target.eos_id)
                ids.extend(target.encode(document))
            for start in range(0, max(0, len(ids) - 1), seq_len):
                chunk = ids[start : start + seq_len + 1]
                if len(chunk) >= 2:
                    windows.append(torch.tensor([chunk], dtype=torch.long))
    return windows
