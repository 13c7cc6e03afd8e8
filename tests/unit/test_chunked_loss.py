"""The loss never holds the whole batch's logits: `chunked_cross_entropy` against torch's
cross-entropy (fp32 and bf16 logits), each chunked Hugging Face architecture against
transformers' own logits, the largest logits tensor of a forward and backward, the loss of a
sharded model (its root gathered for the head), and holdout scoring in bounded rows. One CPU
process."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.config import ModelConfig
from trainer.models import hf_causal_lm, model_spec, spec
from trainer.models.byte_lm import ByteLM, ByteTokenizer, next_token_loss
from trainer.models.spec import chunked_cross_entropy

pytestmark = pytest.mark.timeout(120)

VOCAB = 96
BYTE_LM = ModelConfig(d_model=32, n_layers=2, n_heads=4, seq_len=16)


def _head_and_hidden(dtype: torch.dtype, tokens: int = 37) -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    head = nn.Linear(24, VOCAB, bias=False).to(dtype)
    hidden = torch.randn(tokens, 24, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, VOCAB, (tokens,))
    return head, hidden, targets


def _loss_and_grads(loss: torch.Tensor, head: nn.Linear, hidden: torch.Tensor) -> list[torch.Tensor]:
    head.weight.grad, hidden.grad = None, None
    loss.backward()
    return [loss.detach(), head.weight.grad.clone(), hidden.grad.clone()]


def test_chunked_cross_entropy_equals_torchs_in_fp32():
    head, hidden, targets = _head_and_hidden(torch.float32)
    expected = _loss_and_grads(F.cross_entropy(head(hidden), targets), head, hidden)
    # 5 tokens a chunk: 8 chunks, the last of 2 tokens.
    got = _loss_and_grads(
        chunked_cross_entropy(hidden, head, targets, vocab_size=VOCAB, logits_per_chunk=5 * VOCAB),
        head,
        hidden,
    )
    for want, have in zip(expected, got, strict=True):
        torch.testing.assert_close(have, want, rtol=1e-6, atol=1e-7)


def test_chunked_cross_entropy_of_bf16_logits_is_computed_in_fp32():
    head, hidden, targets = _head_and_hidden(torch.bfloat16)
    expected = _loss_and_grads(F.cross_entropy(head(hidden).float(), targets), head, hidden)
    loss = chunked_cross_entropy(hidden, head, targets, vocab_size=VOCAB, logits_per_chunk=5 * VOCAB)
    assert loss.dtype == torch.float32
    got = _loss_and_grads(loss, head, hidden)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[2], expected[2])  # a token's gradient comes from its chunk only
    # The head's bf16 gradient is summed over the 8 chunks in bf16: a few bf16 ulps apart.
    assert (got[1] - expected[1]).abs().max() <= 2**-6 * expected[1].abs().max()


def test_a_batch_within_one_chunk_is_computed_bit_for_bit_as_before():
    """The byte LM's loss as it was computed before the chunked loss: its weights train the same."""
    torch.manual_seed(0)
    model = ByteLM(BYTE_LM)
    batch = torch.randint(0, 256, (4, 17))

    def before(m: ByteLM) -> torch.Tensor:
        logits = m(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    grads = []
    for loss in (before, lambda m: next_token_loss(m, batch)):
        model.zero_grad()
        value = loss(model)
        value.backward()
        grads.append([value.detach(), *(p.grad.clone() for p in model.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def _tiny_hf(model_type: str, **extra: object) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs: dict[str, object] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
        "pad_token_id": 0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        **extra,
    }
    if model_type != "gpt_neox":  # no grouped-query attention
        kwargs["num_key_value_heads"] = 2
    if model_type == "gemma":
        kwargs["head_dim"] = 8
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kwargs), dtype=torch.float32)


def _transformers_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [
        *((t, {}) for t in sorted(hf_causal_lm.CHUNKED_HEAD_MODEL_TYPES)),
        ("granite", {"logits_scaling": 4.0}),  # scales its logits after the head: not chunked
    ],
)
def test_the_hf_loss_is_the_loss_of_transformers_logits(model_type, extra, monkeypatch):
    model = _tiny_hf(model_type, **extra)
    batch = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(1))
    expected = _transformers_loss(model, batch)
    expected.backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    monkeypatch.setattr(spec, "LOSS_CHUNK_LOGITS", 5 * VOCAB)  # 10 chunks of the 48 tokens
    loss = hf_causal_lm.causal_lm_loss(model, batch)
    loss.backward()
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-6, atol=1e-7)
    for want, param in zip(expected_grads, model.parameters(), strict=True):
        torch.testing.assert_close(param.grad, want, rtol=1e-5, atol=1e-7)


class _LargestLogits(TorchDispatchMode):
    """Records the most elements of any tensor an op returns whose last dimension is the
    vocabulary: logits, their fp32 copies, log-probabilities and their gradients."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.dim() and tensor.shape[-1] == self.vocab:
                self.largest = max(self.largest, tensor.numel())
        return out


def _largest_logits(model: nn.Module, loss, batch: torch.Tensor, vocab: int) -> int:
    with _LargestLogits(vocab) as seen:
        loss(model, batch).backward()
    return seen.largest


@pytest.mark.parametrize("kind", ["byte-lm", "hf"])
def test_no_tensor_holds_more_logits_than_a_chunk(kind, monkeypatch):
    if kind == "hf":
        model, loss, vocab = _tiny_hf("llama"), hf_causal_lm.causal_lm_loss, VOCAB
    else:
        torch.manual_seed(0)
        model, loss, vocab = ByteLM(BYTE_LM), next_token_loss, 256
    batch = torch.randint(0, vocab, (4, 17))  # 64 tokens predicted
    whole = _largest_logits(model, loss, batch, vocab)
    assert whole == 64 * vocab  # the detector sees the logits: one chunk is the whole batch
    # Chunks of 40 and 24 tokens (more than the width, 32: the head's transposed weight is
    # 32 x vocab).
    monkeypatch.setattr(spec, "LOSS_CHUNK_LOGITS", 40 * vocab)
    assert _largest_logits(model, loss, batch, vocab) == 40 * vocab


def _sharded(model: nn.Module, units: list[nn.Module], dtype: torch.dtype) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.parallelize import apply_fsdp

    return apply_fsdp(model, init_device_mesh("cpu", (1,)), units, dtype)


def _full_grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]


@pytest.mark.parametrize("kind", ["byte-lm", "hf"])
def test_the_loss_of_a_sharded_model_is_the_loss_of_the_plain_model(kind, single_rank_group, monkeypatch):
    """The head runs inside the root's forward: its sharded weight is gathered for it, and
    the root's gradients come back sharded."""
    build = (
        (lambda: _tiny_hf("llama", tie_word_embeddings=True)) if kind == "hf" else (lambda: ByteLM(BYTE_LM))
    )
    loss_of = hf_causal_lm.causal_lm_loss if kind == "hf" else next_token_loss
    units = model_spec(kind).fsdp_units
    batch = torch.randint(0, VOCAB, (3, 17))
    monkeypatch.setattr(spec, "LOSS_CHUNK_LOGITS", 5 * 256)
    torch.manual_seed(0)
    plain = build()
    expected = loss_of(plain, batch)
    expected.backward()
    torch.manual_seed(0)
    sharded = build()
    sharded = _sharded(sharded, units(sharded), torch.float32)
    for step in range(2):  # the second forward reuses the registered forward method
        sharded.zero_grad()
        loss = loss_of(sharded, batch)
        loss.backward()
        assert torch.equal(loss.detach(), expected.detach()), step
    for want, have in zip(_full_grads(plain), _full_grads(sharded), strict=True):
        torch.testing.assert_close(have, want, rtol=1e-6, atol=1e-7)


def test_a_bf16_sharded_loss_is_fp32(single_rank_group, monkeypatch):
    monkeypatch.setattr(spec, "LOSS_CHUNK_LOGITS", 5 * VOCAB)
    model = _tiny_hf("llama")
    batch = torch.randint(0, VOCAB, (2, 17))
    expected = _transformers_loss(model, batch).item()
    sharded = _sharded(model, model_spec("hf").fsdp_units(model), torch.bfloat16)
    loss = hf_causal_lm.causal_lm_loss(sharded, batch)
    loss.backward()
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(expected, rel=2e-2)  # bf16 weights, fp32 log-softmax
    assert all(torch.isfinite(g).all() for g in _full_grads(sharded))


def test_scoring_in_bounded_rows_gives_the_score_of_whole_batches():
    from trainer.evaluation import score_windows

    torch.manual_seed(0)
    model = ByteLM(BYTE_LM)
    batches = [torch.randint(0, 256, (16, 17)), torch.randint(0, 256, (5, 17))]
    rows_seen: list[int] = []

    def counting_loss(m: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        rows_seen.append(rows.shape[0])
        return next_token_loss(m, rows)

    whole = score_windows(model, next_token_loss, batches, ByteTokenizer())
    bounded = score_windows(model, counting_loss, batches, ByteTokenizer(), rows_per_forward=3)
    assert rows_seen == [3, 3, 3, 3, 3, 1, 3, 2]
    assert (bounded.tokens, bounded.bytes) == (whole.tokens, whole.bytes) == (21 * 16, 21 * 16)
    assert bounded.nats_total == pytest.approx(whole.nats_total, rel=1e-6)
    assert math.isfinite(bounded.bits_per_byte)
