"""The built-in byte-level language model (registry entry "byte-lm"), as a plain `nn.Module`.

A small decoder-only transformer whose tokens are bytes (vocabulary 256, no tokenizer
files). Parallelism is applied elsewhere (`trainer.parallelize`); this module knows nothing
about processes or devices, so the validate and register steps build the same class on one
CPU process and load a consolidated checkpoint into it. Every rank builds the whole model
from the same seed before sharding (it is small), which keeps runs bit-exact; a resume,
whose checkpoint holds every weight, builds it on the meta device and draws nothing.

Its exported folder (the register step's bundle) holds weights.safetensors (the state
dict), config.json (the ModelConfig) and tokenizer.json (a description of the byte tokenizer).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import ModelConfig
from trainer.models.spec import ModelError, ModelSpec, chunked_cross_entropy, copy_full_into, published_folder

KIND = "byte-lm"
WEIGHTS_FILE = "weights.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
NEWLINE = 10  # separates documents in byte data


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln_attn = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.ln_mlp = nn.LayerNorm(cfg.d_model)
        self.mlp_in = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False)
        self.mlp_out = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.ln_attn(x)).split(width, dim=-1)
        shape = (batch, seq, self.n_heads, width // self.n_heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, width))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.ln_mlp(x))))


class ByteLM(nn.Module):
    """Token + position embeddings, `n_layers` pre-norm blocks, a tied output head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_out = nn.LayerNorm(cfg.d_model)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The logits (B, T, vocab) of `tokens` (B, T); with `targets` (B, T), the mean
        cross-entropy against them instead, the head run chunk by chunk. Inside `forward`,
        so that under FSDP2 the root's parameters (embeddings, head) are gathered for it."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        hidden = self.ln_out(x)
        if targets is None:
            return self.head(hidden)
        return chunked_cross_entropy(hidden, self.head, targets, vocab_size=self.tok_emb.num_embeddings)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        # Weight tying through the embedding module keeps the output head in the same
        # FSDP unit as the embedding (the root), so no parameter is shared across units.
        return hidden @ self.tok_emb.weight.t()


def next_token_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting byte t+1 from bytes <= t; batch is (B, seq_len+1)."""
    return model(batch[:, :-1], targets=batch[:, 1:])


@torch.no_grad()
def generate(model: ByteLM, prompt: bytes, max_new_tokens: int = 64, temperature: float = 0.0) -> bytes:
    """Greedy (temperature 0) or sampled continuation of a byte prompt."""
    model.eval()
    tokens = torch.tensor([list(prompt) or [10]], dtype=torch.long)
    for _ in range(max_new_tokens):
        logits = model(tokens[:, -model.cfg.seq_len :])[:, -1, :]
        if temperature <= 0:
            next_token = logits.argmax(dim=-1, keepdim=True)
        else:
            next_token = torch.multinomial(F.softmax(logits / temperature, dim=-1), 1)
        tokens = torch.cat([tokens, next_token], dim=1)
    return bytes(tokens[0, len(prompt or b"\n") :].tolist())


class ByteTokenizer:
    """Token id = byte value of the UTF-8 text; documents end with a newline."""

    identity = "bytes"
    vocab_size = 256
    eos_id = NEWLINE

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def tokenizer_description(config: ModelConfig) -> dict[str, Any]:
    return {
        "type": "byte",
        "vocab_size": config.vocab_size,
        "encode": "the UTF-8 bytes of the text; token id = byte value",
        "decode": "bytes(token ids) decoded as UTF-8, invalid sequences replaced",
        "special_tokens": {},
        "max_context_tokens": config.seq_len,
    }


def architecture(config: ModelConfig) -> dict[str, Any]:
    # Exactly the fields the byte LM had before the registry: its model_hash is unchanged,
    # so checkpoints written before it still resume.
    return {
        "vocab_size": config.vocab_size,
        "seq_len": config.seq_len,
        "d_model": config.d_model,
        "n_layers": config.n_layers,
        "n_heads": config.n_heads,
    }


def write_files(
    state: Mapping[str, torch.Tensor],
    config: ModelConfig,
    folder: Path,
    metadata: dict[str, str] | None = None,
) -> dict[str, Path]:
    """Write weights, config and tokenizer description into `folder` (created if needed)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    # Contiguous copies: safetensors refuses views and shared storage.
    tensors = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in state.items()}
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata=metadata or {})
    (folder / CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(config), indent=2, sort_keys=True))
    (folder / TOKENIZER_FILE).write_text(json.dumps(tokenizer_description(config), indent=2, sort_keys=True))
    return {
        "weights": folder / WEIGHTS_FILE,
        "config": folder / CONFIG_FILE,
        "tokenizer": folder / TOKENIZER_FILE,
    }


def read_folder(folder: Path) -> ByteLM:
    """A ByteLM (CPU, eval mode) with the folder's weights; ModelError names what is wrong."""
    from safetensors.torch import load_file

    for file_name in (WEIGHTS_FILE, CONFIG_FILE):
        if not (folder / file_name).is_file():
            raise ModelError(f"{folder / file_name} is missing: not a byte-lm model folder")
    config = ModelConfig(**json.loads((folder / CONFIG_FILE).read_text()))
    model = ByteLM(config)
    try:
        model.load_state_dict(load_file(str(folder / WEIGHTS_FILE)))
    except RuntimeError as exc:
        raise ModelError(f"{folder / WEIGHTS_FILE} does not fit {folder / CONFIG_FILE}: {exc}") from exc
    return model.eval()


def export(state: Mapping[str, torch.Tensor], config: ModelConfig, folder: Path) -> Path:
    with published_folder(folder) as staging:
        write_files(state, config, staging)
    return folder


def _build(config: ModelConfig, device: torch.device) -> nn.Module:
    if device.type == "meta":
        with torch.device("meta"):
            return ByteLM(config)
    model = ByteLM(config)  # weights drawn from the torch RNG on CPU: the same everywhere
    if config.model_dir and config.init == "pretrained":
        _load_weights(model, Path(config.model_dir))
    return model.to(device)


def _load_weights(model: ByteLM, folder: Path) -> None:
    """A warm start: the folder's weights (a registered byte LM, staged), strictly."""
    from safetensors.torch import load_file

    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise ModelError(f"{path} is missing: model.init=pretrained needs the byte LM's weights")
    try:
        model.load_state_dict(load_file(str(path)))
    except RuntimeError as exc:
        raise ModelError(f"{path} does not fit the configured byte LM: {exc}") from exc


def blocks(model: nn.Module) -> list[nn.Module]:
    assert isinstance(model, ByteLM), type(model)
    return list(model.blocks)


def _no_init_after_sharding(model: nn.Module, config: ModelConfig, device: torch.device, seed: int) -> None:
    """The weights were final before sharding."""


def _allocate_for_resume(model: nn.Module, config: ModelConfig, device: torch.device, seed: int) -> None:
    """Built on the meta device for a resume: allocate the shards; every parameter is trained
    (no buffers, nothing frozen), so the resume fills them all."""
    model.to_empty(device=device)


@torch.no_grad()
def _init_trained(model: nn.Module, config: ModelConfig, device: torch.device, seed: int) -> None:
    """The resume found nothing: the weights `build_for_training` draws, drawn the same way
    (the torch RNG seeded alike, left where a fresh start leaves it) and sliced into the shards."""
    torch.manual_seed(seed)
    full = dict(_build(config, torch.device("cpu")).named_parameters())
    for name, param in model.named_parameters():
        copy_full_into(param, full[name])


SPEC = ModelSpec(
    kind=KIND,
    build=_build,
    init_after_sharding=False,
    init_weights=_no_init_after_sharding,
    init_for_resume=_allocate_for_resume,
    init_trained=_init_trained,
    fsdp_units=blocks,
    loss=next_token_loss,
    tokenizer=lambda config: ByteTokenizer(),
    architecture=architecture,
    export=export,
    load_exported=read_folder,
)
