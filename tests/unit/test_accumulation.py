"""Gradient accumulation keeps only sharded gradients between micro-batches: the collectives
each micro-batch's backward issues (counted at the dispatcher, under torch's fake process group
of 4 ranks in this one process: plain FSDP and a 2 x 2 HSDP mesh), and the accumulated
gradients on a real one-rank gloo group against the plain model's on the whole batch."""

from __future__ import annotations

import collections
import types
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.config import ModelConfig
from trainer.loop import accumulate_gradients
from trainer.models import model_spec
from trainer.models.byte_lm import ByteLM, next_token_loss
from trainer.parallelize import HSDP_DIMS, apply_fsdp

pytestmark = pytest.mark.timeout(120)

CPU = torch.device("cpu")
CONFIG = ModelConfig(d_model=32, n_layers=2, n_heads=4, seq_len=16)
UNITS = CONFIG.n_layers + 1  # the blocks and the root: one reduce-scatter each per backward
MICRO_BATCHES = 3


@pytest.fixture
def fake_world() -> Iterator[None]:
    """torch's fake process group (collectives return at once, nothing is sent): 4 ranks' worth
    of FSDP bookkeeping in this process, as torch's FSDPMemTracker runs it."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Collectives(TorchDispatchMode):
    """Counts the c10d operations dispatched (all-gather, reduce-scatter, all-reduce)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.counts[func._opname] += 1
        return func(*args, **(kwargs or {}))


def _sharded_byte_lm(mesh: DeviceMesh) -> nn.Module:
    torch.manual_seed(0)
    model = ByteLM(CONFIG)
    return apply_fsdp(model, mesh, model_spec("byte-lm").fsdp_units(model))


def _collectives_before_each_forward(model: nn.Module) -> list[collections.Counter[str]]:
    """Reduce-scatters and all-reduces issued so far, as each micro-batch's forward starts and
    after the step's last backward."""
    seen: list[collections.Counter[str]] = []

    def loss(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        seen.append(_reductions(collectives.counts))
        return next_token_loss(m, batch)

    micro_batches = [torch.randint(0, 256, (2, 17)) for _ in range(MICRO_BATCHES)]
    with _Collectives() as collectives:
        accumulate_gradients(types.SimpleNamespace(loss=loss), model, micro_batches, CPU)
    return [*seen, _reductions(collectives.counts)]


def _reductions(counts: collections.Counter[str]) -> collections.Counter[str]:
    return collections.Counter(
        {
            "reduce_scatter": sum(n for op, n in counts.items() if "reduce_scatter" in op),
            "all_reduce": sum(n for op, n in counts.items() if op.startswith("allreduce")),
        }
    )


def test_plain_fsdp_reduce_scatters_every_micro_batch(fake_world):
    model = _sharded_byte_lm(init_device_mesh("cpu", (4,)))
    seen = _collectives_before_each_forward(model)
    assert [c["reduce_scatter"] for c in seen] == [UNITS * i for i in range(MICRO_BATCHES + 1)]
    assert all(c["all_reduce"] == 0 for c in seen)


def test_hsdp_reduce_scatters_every_micro_batch_and_all_reduces_after_the_last(fake_world):
    model = _sharded_byte_lm(init_device_mesh("cpu", (2, 2), mesh_dim_names=HSDP_DIMS))
    seen = _collectives_before_each_forward(model)
    assert [c["reduce_scatter"] for c in seen] == [UNITS * i for i in range(MICRO_BATCHES + 1)]
    assert [c["all_reduce"] for c in seen] == [0] * MICRO_BATCHES + [UNITS]


def test_accumulated_gradients_are_the_gradients_of_the_whole_batch(single_rank_group):
    torch.manual_seed(1)
    batch = torch.randint(0, 256, (6, 17))
    torch.manual_seed(0)
    plain = ByteLM(CONFIG)
    expected = next_token_loss(plain, batch)
    expected.backward()
    model = _sharded_byte_lm(init_device_mesh("cpu", (1,)))
    loss = accumulate_gradients(model_spec("byte-lm"), model, list(batch.split(2)), CPU)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=1e-7)
    for param, want in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(param.grad.full_tensor(), want.grad, rtol=1e-5, atol=1e-7)
