"""Tiny Hugging Face model folders built offline: `rtp make-tiny-model` and the tests use them.

A folder holds what `save_pretrained` writes for a random causal LM of a given architecture
(built from a config object: hidden size 64, 2 layers) plus a small byte-level BPE tokenizer
trained here with `tokenizers` on local text, with `<|endoftext|>` as EOS. No hub is
contacted and nothing is downloaded, so a user can send a Hugging Face model through the
whole pipeline on a laptop (`rtp local --model-source FOLDER`). The models are for trying
the plumbing, not for their predictions.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

ARCHITECTURES = ("llama", "qwen2", "mistral", "gpt_neox")
EOS_TOKEN = "<|endoftext|>"
DEFAULT_TOKENIZER_VOCAB = 512
VOCAB_MULTIPLE = 64  # the model's vocabulary is the tokenizer's rounded up, as real models pad it


def train_bpe_tokenizer(folder: Path, texts: Iterable[str], vocab_size: int = DEFAULT_TOKENIZER_VOCAB) -> int:
    """A byte-level BPE tokenizer trained on `texts`, saved as tokenizer files in `folder`;
    returns its vocabulary size (at most `vocab_size`: a small corpus may give fewer merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN)
    folder.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(str(folder))
    return len(wrapped)


def tiny_config(architecture: str, vocab_size: int, *, tie: bool = False) -> object:
    """A transformers config of a 2-layer, hidden-64 model of `architecture`."""
    from transformers import AutoConfig

    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; choose one of {', '.join(ARCHITECTURES)}")
    kwargs = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 128,
        "tie_word_embeddings": tie,
    }
    if architecture != "gpt_neox":  # GPT-NeoX has no grouped-query attention
        kwargs["num_key_value_heads"] = 2
    return AutoConfig.for_model(architecture, **kwargs)


def write_tiny_model(
    folder: Path,
    architecture: str = "llama",
    *,
    texts: Iterable[str],
    tokenizer_vocab_size: int = DEFAULT_TOKENIZER_VOCAB,
    vocab_size: int | None = None,
    tie: bool = False,
    seed: int = 0,
) -> Path:
    """config.json + model.safetensors + tokenizer files of a random tiny model in `folder`.

    The tokenizer is trained on `texts`; the model's vocabulary is `vocab_size`, or the
    tokenizer's rounded up to a multiple of 64 when None."""
    import torch
    from transformers import AutoModelForCausalLM

    tokens = train_bpe_tokenizer(folder, texts, tokenizer_vocab_size)
    if vocab_size is None:
        vocab_size = -(-tokens // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    if vocab_size < tokens:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {tokens} tokens")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(architecture, vocab_size, tie=tie))
    model.save_pretrained(str(folder))
    return folder
