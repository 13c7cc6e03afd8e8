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
