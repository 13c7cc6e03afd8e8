"""Tiny Hugging Face model folders for tests, built offline: a random model of a given
architecture from a config object (hidden 64, 2 layers) and a small byte-level BPE
tokenizer trained on local text with `tokenizers`. No hub is contacted."""

from __future__ import annotations

from pathlib import Path

ARCHITECTURES = ("llama", "qwen2", "mistral", "gpt_neox")
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.\n",
    "Checkpoints are committed atomically; a torn save is never resumed.\n",
    "for step in range(steps):\n    loss = model(batch)\n    loss.backward()\n",
] * 20


def train_tokenizer(folder: Path, vocab_size: int = 300) -> None:
    """A byte-level BPE tokenizer with an <|endoftext|> EOS, saved as tokenizer files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(
        str(folder)
    )


def write_tiny_model(
    folder: Path, architecture: str = "llama", *, tie: bool = False, seed: int = 0, vocab_size: int = 320
) -> Path:
    """config.json + model.safetensors + tokenizer files of a random 2-layer model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 128,
        "tie_word_embeddings": tie,
    }
    if architecture != "gpt_neox":
        kwargs["num_key_value_heads"] = 2
    config = AutoConfig.for_model(architecture, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    train_tokenizer(folder)
    return folder


def write_token_snapshot(corpus: Path, model_dir: Path, snapshot: Path, shard_bytes: int = 800) -> Path:
    """`corpus` tokenized with the model folder's tokenizer, laid out as a staged snapshot
    (the stage step's manifest.json beside the shards and index.json)."""
    import hashlib
    import json

    from trainer.tokenized_data import write_token_shards

    write_token_shards(corpus, snapshot / "files", model_dir, shard_bytes=shard_bytes, workers=2)
    files = []
    for path in sorted((snapshot / "files").iterdir()):
        data = path.read_bytes()
        files.append(
            {
                "key": f"tokens/{path.name}",
                "size": len(data),
                "etag": hashlib.md5(data).hexdigest(),
                "path": f"files/{path.name}",
            }
        )
    (snapshot / "manifest.json").write_text(json.dumps({"snapshot_id": "test-tokens", "files": files}))
    return snapshot


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
