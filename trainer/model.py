"""A small decoder-only transformer language model over bytes, as a plain `nn.Module`.

Parallelism is applied elsewhere (`trainer.parallelize`); this module knows nothing about
processes or devices, so the validate and register steps build the same class on one CPU
process and load a consolidated checkpoint into it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import ModelConfig


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

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        # Weight tying through the embedding module keeps the output head in the same
        # FSDP unit as the embedding (the root), so no parameter is shared across units.
        return self.ln_out(x) @ self.tok_emb.weight.t()


def next_token_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting byte t+1 from bytes <= t; batch is (B, seq_len+1)."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


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
