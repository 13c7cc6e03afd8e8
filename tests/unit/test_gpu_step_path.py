"""What a GPU step does differently, shown on CPU: micro-batches copied from pinned memory
without blocking, the fused AdamW, the root FSDP unit kept gathered from forward to backward,
the straggler timer outside the fast tier's wait, per-phase memory peaks, and torch-async's
kept stager. Where CUDA is needed, torch's calls are stood in for and named as such."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from trainer import loop, parallelize
from trainer.config import build_config
from trainer.examples_data import ExampleBatch

pytestmark = pytest.mark.timeout(180)
CUDA = torch.device("cuda", 0)


class _HostBatch:
    """A stand-in for a host tensor on a machine without CUDA: records how it is moved."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def pin_memory(self) -> _HostBatch:
        self.calls.append(("pin_memory",))
        return self

    def to(self, device, non_blocking=False) -> str:
        self.calls.append(("to", device, non_blocking))
        return "on-device"


def test_a_cuda_micro_batch_is_copied_from_pinned_memory_without_blocking():
    batch = _HostBatch()
    assert loop.to_training_device(batch, CUDA) == "on-device"
    assert batch.calls == [("pin_memory",), ("to", CUDA, True)]
    ids = torch.arange(6).reshape(2, 3)
    assert loop.to_training_device(ids, torch.device("cpu")) is ids  # CPU: nothing to pin


def test_an_example_batch_is_pinned_whole_before_its_non_blocking_copy(monkeypatch):
    pinned: list[int] = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(self.numel()) or self)
    rows = ExampleBatch(torch.zeros(2, 5), torch.zeros(2, 5), torch.zeros(2, 4), scale=0.5)
    moved = loop.to_training_device(rows, torch.device("cpu"))
    assert pinned == [] and isinstance(moved, ExampleBatch)
    again = rows.pin_memory()
    assert pinned == [10, 10, 8] and again.scale == 0.5


def test_adamw_is_fused_on_cuda_and_the_default_on_cpu(monkeypatch):
    built: list[dict] = []

    class Recording(torch.optim.AdamW):
        def __init__(self, params, **kwargs):
            built.append(kwargs)
            super().__init__(params, **{**kwargs, "fused": None})

    monkeypatch.setattr(torch.optim, "AdamW", Recording)
    optimizer_config = build_config("tiny-cpu").optimizer
    params = [nn.Parameter(torch.zeros(3))]
    loop.build_optimizer(params, optimizer_config, CUDA)  # fused needs CUDA tensors: recorded only
    loop.build_optimizer(params, optimizer_config, torch.device("cpu"))
    assert built[0]["fused"] is True and built[1]["fused"] is None
    assert built[0]["lr"] == optimizer_config.lr and built[0]["weight_decay"] == optimizer_config.weight_decay


class _TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden).sum()


@pytest.mark.usefixtures("single_rank_group")
def test_the_root_unit_stays_gathered_from_forward_to_backward_and_the_blocks_do_not():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    model = _TwoBlocks()
    parallelize.apply_fsdp(model, init_device_mesh("cpu", (1,)), list(model.blocks))
    loss = model(torch.arange(4).reshape(1, 4))
    # Between forward and backward: the root's parameters are the gathered tensors, each block's
    # are its shards again.
    assert not isinstance(model.head.weight, DTensor) and not isinstance(model.embed.weight, DTensor)
    assert all(isinstance(p, DTensor) for block in model.blocks for p in block.parameters())
    loss.backward()
    assert all(isinstance(p, DTensor) for p in model.parameters())  # all resharded after backward


def test_phase_peaks_are_read_and_reset_on_cuda_only(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: calls.append("read") or 5 * 2**30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: calls.append("reset"))
    assert parallelize.phase_peak_bytes(CUDA) == 5 * 2**30 and calls == ["read", "reset"]
    assert parallelize.phase_peak_bytes(torch.device("cpu")) is None and calls == ["read", "reset"]


@pytest.mark.usefixtures("single_rank_group")
def test_the_straggler_timer_leaves_out_the_wait_for_the_fast_tiers_copy(dataset_dir, tmp_path, monkeypatch):
    import gc

    from trainer.stragglers import StragglerMonitor

    order: list[str] = []
    timed = StragglerMonitor.local_work

    def recording_local_work(self, step):
        order.append("timer starts")
        return timed(self, step)

    monkeypatch.setattr(StragglerMonitor, "local_work", recording_local_work)
    config = build_config(
        "tiny-cpu",
        [
            f"data.dataset_dir={dataset_dir}",
            f"run.workdir={tmp_path}",
            "run.steps=2",
            "checkpoint.mode=off",
            "checkpoint.local_every_steps=1",
            "resilience.straggler_every_steps=100",
            "resilience.prefork_workers=false",
        ],
    )
    try:
        with loop.Trainer(config) as trainer:
            waits = trainer.checkpoints.maybe_wait_for_staging
            trainer.checkpoints.maybe_wait_for_staging = lambda: order.append("tier wait") or waits()
            trainer.train()
    finally:
        gc.unfreeze()
    assert order == ["tier wait", "timer starts"] * 2


def test_torch_async_keeps_one_stager_pinned_and_in_the_background_on_cuda(monkeypatch):
    from torch.distributed.checkpoint import staging

    from benchmarks import torch_async

    seen: list[staging.StagingOptions] = []

    class Recording:  # DefaultStager's pinned options need CUDA: recorded only
        def __init__(self, options):
            seen.append(options)

    monkeypatch.setattr(staging, "DefaultStager", Recording)
    torch_async.kept_stager(cuda=True)
    torch_async.kept_stager(cuda=False)
    assert seen[0] == staging.StagingOptions(
        use_pinned_memory=True, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=True
    )
    assert seen[1] == staging.StagingOptions(False, False, False, False)  # what torch's default stages with


@pytest.mark.usefixtures("single_rank_group")
def test_torch_async_stages_every_save_through_the_same_stager_into_the_same_buffers(tmp_path, monkeypatch):
    import time

    import torch.distributed.checkpoint as dcp

    from benchmarks import torch_async
    from trainer.checkpointing import storage
    from trainer.checkpointing.writer import PendingSave, SaveRecord

    stagers: list[object] = []
    buffers: list[set[int]] = []
    async_save = dcp.async_save

    def recording_async_save(state, **kwargs):
        stager = kwargs["async_stager"]
        stagers.append(stager)
        response = async_save(state, **kwargs)
        mapping = stager._state_dict_stager._cached_storage_mapping  # torch's cache of host buffers
        buffers.append({id(buffer) for buffer in mapping.values()})
        return response

    monkeypatch.setattr(torch_async.dcp, "async_save", recording_async_save)
    writer = torch_async.TorchAsyncWriter(Path(tmp_path), keep_last=5, keep_every=0, on_commit=lambda r: None)
    writer.open(background=False)
    weights = {"w": torch.arange(1000, dtype=torch.float32)}
    for step in (1, 2):
        weights["w"] += 1
        staging_dir, final = storage.staging_paths(tmp_path, step)
        record = SaveRecord(step=step, mode="torch-async", blocked_s=0.0)
        pending = PendingSave(
            record=record,
            staging=staging_dir,
            final=final,
            meta={},
            rank_state=storage.rank_state({}),
            started_at=time.perf_counter(),
        )
        assert writer.save({"model": dict(weights)}, pending) == "queued"  # the previous one committed first
    writer.close()
    assert len(stagers) == 2 and stagers[0] is stagers[1]
    assert buffers[0] and buffers[0] == buffers[1]  # the second save reused the first's host buffers
    assert writer.host_bytes == 4000
    assert sorted(step for step, _ in storage.committed_steps(tmp_path)) == [1, 2]


@pytest.mark.usefixtures("single_rank_group")
def test_a_sync_save_writes_a_shard_per_thread_and_hashes_each_as_written(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from trainer.checkpointing import storage, writer

    read_back: list[str] = []
    sha256_file = storage.sha256_file
    monkeypatch.setattr(
        storage, "sha256_file", lambda path, *a: read_back.append(path.name) or sha256_file(path, *a)
    )
    state = {"a": torch.arange(4000, dtype=torch.float32), "b": torch.ones(3000)}
    with storage.shard_records_without_crc32():
        dcp.save(state, storage_writer=writer.hashing_writer(tmp_path, thread_count=2))
    shards = sorted(p.name for p in tmp_path.glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__0_1.distcp"]
    storage.write_hash_sidecars(tmp_path, 0)  # what the sync writer calls: nothing left to hash
    assert read_back == []
    for shard in shards:
        assert (tmp_path / f"{shard}.sha256").read_text() == sha256_file(tmp_path / shard)
    assert not (tmp_path / ".metadata.sha256").exists()
    loaded = {"a": torch.zeros(4000), "b": torch.zeros(3000)}
    dcp.load(loaded, checkpoint_id=str(tmp_path))
    assert torch.equal(loaded["a"], state["a"]) and torch.equal(loaded["b"], state["b"])
