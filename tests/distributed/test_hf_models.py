"""Two ranks over gloo with Hugging Face models: sharded initialization (random and
pretrained) gives exactly the weights one process builds, the decoder layers are the FSDP
units, and a tiny model trains through the real trainer (`rtp`'s launcher)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from pipelines.services import free_port
from tests.hf_tiny import write_tiny_model
from trainer.config import ModelConfig
from trainer.loop import state_dict_sha256
from trainer.models import model_spec

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _shard_and_init(rank: int, world: int, port: int, config: ModelConfig, out: str) -> None:
    """One rank: build on meta, shard the spec's units, fill the shards, report full weights."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from trainer.parallelize import apply_fsdp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        spec = model_spec(config.kind)
        model = spec.build_for_training(config, torch.device("cpu"), seed=5)
        assert all(p.device.type == "meta" for p in model.parameters())  # nothing materialized yet
        units = spec.fsdp_units(model)
        apply_fsdp(model, mesh, units)
        spec.init_weights(model, config, torch.device("cpu"), 5)
        local_numel = sum(p.to_local().numel() for p in model.parameters())
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
        loss = spec.loss(model, torch.arange(34).reshape(2, 17) % 256).item()
        if rank == 0:
            result = {
                "sha256": state_dict_sha256({k: v for k, v in full.items() if isinstance(v, torch.Tensor)}),
                "sharded_units": sum(isinstance(m, FSDPModule) for m in model.modules()),
                "units": len(units),
                "local_numel": local_numel,
                "total_numel": sum(v.numel() for v in full.values()),
                "loss": loss,
            }
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("architecture", "init", "tie"),
    [("llama", "pretrained", False), ("qwen2", "random", True), ("gpt_neox", "pretrained", False)],
)
def test_two_rank_sharded_init_equals_one_process_build(architecture, init, tie, tmp_path):
    folder = write_tiny_model(tmp_path / "model", architecture, tie=tie)
    config = ModelConfig(kind="hf", model_dir=str(folder), init=init)
    out = tmp_path / "rank0.json"
    mp.start_processes(
        _shard_and_init, args=(2, free_port(), config, str(out)), nprocs=2, join=True, start_method="spawn"
    )
    result = json.loads(out.read_text())

    spec = model_spec("hf")
    torch.manual_seed(5)
    reference = spec.build(config, torch.device("cpu"))
    assert result["sha256"] == state_dict_sha256(reference.state_dict())
    assert result["units"] == 2 and result["sharded_units"] == 3  # 2 decoder layers + the root
    assert result["local_numel"] < result["total_numel"]  # each rank holds a slice
    expected_loss = spec.loss(reference, torch.arange(34).reshape(2, 17) % 256).item()
    assert result["loss"] == pytest.approx(expected_loss, rel=1e-5)
