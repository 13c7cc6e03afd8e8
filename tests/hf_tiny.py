"""Tiny Hugging Face model folders for tests (rtp_support/tiny_models.py builds them offline)
with a tokenizer trained on a small fixed text, plus a corpus in all three accepted forms
and a tokenized snapshot of it. No hub is contacted."""

from __future__ import annotations

from pathlib import Path

from rtp_support import tiny_models
from rtp_support.tiny_models import ARCHITECTURES, train_bpe_tokenizer

__all__ = [
    "ARCHITECTURES",
    "CORPUS",
    "train_tokenizer",
    "write_corpus",
    "write_tiny_model",
    "write_token_snapshot",
]
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.\n",
    "Checkpoints are committed atomically; a torn save is never resumed.\n",
    "for step in range(steps):\n    loss = model(batch)\n    loss.backward()\n",
] * 20


def train_tokenizer(folder: Path, vocab_size: int = 300) -> None:
    """A byte-level BPE tokenizer with an <|endoftext|> EOS, trained on CORPUS."""
    train_bpe_tokenizer(folder, CORPUS, vocab_size)


def write_tiny_model(
    folder: Path, architecture: str = "llama", *, tie: bool = False, seed: int = 0, vocab_size: int = 320
) -> Path:
    """config.json + model.safetensors + tokenizer files of a random 2-layer model."""
    return tiny_models.write_tiny_model(
        folder,
        architecture,
        texts=CORPUS,
        tokenizer_vocab_size=300,
        vocab_size=vocab_size,
        tie=tie,
        seed=seed,
    )


def write_token_snapshot(corpus: Path, model_dir: Path, snapshot: Path, shard_bytes: int = 800) -> Path:
    """`corpus` tokenized with the model folder's tokenizer, laid out as a staged snapshot
    (the stage step's manifest.json beside the shards and index.json)."""

    from rtp_support.demo_data import write_local_manifest
    from trainer.tokenized_data import write_token_shards

    write_token_shards(corpus, snapshot / "files", model_dir, shard_bytes=shard_bytes, workers=2)
    return write_local_manifest(snapshot, key_prefix="tokens/", snapshot_id="test-tokens")


def write_corpus(folder: Path, documents: int = 40) -> Path:
    """A small corpus in all three accepted forms: text files, JSON Lines and Parquet."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    texts = [f"{CORPUS[i % len(CORPUS)]}document {i}\n" for i in range(documents)]
    third = documents // 3
    for i, text in enumerate(texts[:third]):
        (folder / f"doc-{i:03d}.txt").write_text(text)
    (folder / "more.jsonl").write_text(
        "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts[third : 2 * third]))
    )
    pq.write_table(pa.table({"text": texts[2 * third :]}), folder / "rest.parquet")
    return folder
