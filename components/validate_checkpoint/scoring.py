"""Holdout scores that compare across tokenizers: nats per token and bits per byte.

A model's loss per token depends on its tokenizer (a BPE token covers several bytes, a
byte LM's token one), so models are compared on bits per byte: the summed next-token loss
over the evaluated windows divided by ln 2 and by the UTF-8 bytes the predicted tokens
decode to. For the byte LM one token is one byte, so its bits per byte is its nats per
token / ln 2. For a Hugging Face tokenizer the predicted tokens of each window are decoded
with the model's tokenizer; document separators (the EOS token) count as no bytes.

A champion with another tokenizer is scored on the same holdout text: each candidate
window is decoded to text and encoded again with the champion's tokenizer
(`retokenized_windows`). Nothing here reads files or talks to MLflow. The scoring and the
retokenization live in trainer/evaluation.py, shared with the training ranks' end-of-run
scores of the candidate and the champion.
"""

from __future__ import annotations

from trainer.evaluation import (
    HoldoutScore,
    champion_windows,
    decoded_bytes,
    retokenized_windows,
    score_windows,
)

__all__ = ["HoldoutScore", "champion_windows", "decoded_bytes", "retokenized_windows", "score_windows"]
