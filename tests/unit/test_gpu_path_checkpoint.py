"""Checkpoint work on the GPU path, checked in one process over a one-rank gloo group: the
async mode's last save is a DCP write (device tensors copied by DCP) on the writer's group,
blocking checkpoint work runs inside the hooks' keep-alive, and NVRx's worker never preloads."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.unit.checkpoint_helpers import _manager, _trained_model
from trainer.checkpointing import nvrx_compat, storage
from trainer.hooks import TrainHooks

pytestmark = pytest.mark.usefixtures("single_rank_group")


def test_the_async_last_save_is_a_dcp_write_on_the_writers_group(tmp_path, monkeypatch):
    """The attempt's last `async` save is written in the rank by DCP (which copies a device
    state to the host itself, as in `sync` mode), off the training thread, on the writer's
    own group bound at the call: neither the training group nor none (an in-process restart
    may leave the thread running into the next attempt)."""
    import threading

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    calls = []
    real_save = dcp.save

    def recording(*args, process_group=None, **kwargs):
        calls.append((threading.current_thread().name, process_group))
        return real_save(*args, process_group=process_group, **kwargs)

    monkeypatch.setattr(dcp, "save", recording)
    model, optimizer = _trained_model()
    manager = _manager(tmp_path, "async", model, optimizer)
    manager.load()
    manager.maybe_wait_for_staging()
    manager.save(1, last_step=True, loss=1.0)  # the attempt's last save: written by close()
    manager.close()
    [(thread, group)] = calls
    assert thread == "rtp-ckpt-save"
    assert isinstance(group, dist.ProcessGroup) and group is not dist.group.WORLD
    assert (
        storage.latest_committed_checkpoint(tmp_path / "checkpoints") == tmp_path / "checkpoints" / "step_1"
    )
    other, other_optimizer = _trained_model(seed=1)
    resumed = _manager(tmp_path, "async", other, other_optimizer)
    assert resumed.load() == 1
    assert torch.equal(other.blocks[0].qkv.weight, model.blocks[0].qkv.weight)
    resumed.close()


class _RecordingHooks(TrainHooks):
    def __init__(self) -> None:
        self.depth = 0

    @contextlib.contextmanager
    def keepalive(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1


def test_blocking_checkpoint_work_runs_inside_the_keepalive(tmp_path, monkeypatch):
    from trainer.checkpointing import storage as storage_module
    from trainer.checkpointing.writer import SyncWriter

    hooks = _RecordingHooks()
    seen: dict[str, int] = {}
    real_save, real_load, real_start = SyncWriter._write, storage_module.load_checkpoint, SyncWriter.open

    def start(self, background):
        seen["start"] = hooks.depth  # NVRx's writer process may take long to start on a busy node
        return real_start(self, background)

    def save(self, state, pending):
        seen[f"save {pending.record.step}"] = hooks.depth
        return real_save(self, state, pending)

    def load(*args, **kwargs):
        seen["load"] = hooks.depth
        return real_load(*args, **kwargs)

    monkeypatch.setattr(SyncWriter, "_write", save)
    monkeypatch.setattr(SyncWriter, "open", start)
    monkeypatch.setattr(storage_module, "load_checkpoint", load)
    model, optimizer = _trained_model()
    manager = _manager(tmp_path, "sync", model, optimizer, hooks=hooks)
    manager.load()
    for step in range(1, 5):
        manager.maybe_wait_for_staging()
        manager.save(step, last_step=step == 4, loss=1.0)
    manager.close()
    resumed = _manager(tmp_path, "sync", *_trained_model(seed=1), hooks=hooks)
    assert resumed.load() == 4
    assert seen == {"start": 1, "save 3": 1, "save 4": 1, "load": 1}
    assert hooks.depth == 0


def test_nvrx_worker_never_preloads_and_sees_only_its_ranks_gpu(tmp_path, monkeypatch):
    requests = []

    class Worker:
        def schedule_async_call(self, request):
            requests.append(request)

    class Calls:
        call_idx = -1
        persistent_caller = Worker()

    nvrx_compat.warm_up(Calls(), tmp_path / "warm", None)
    [request] = requests
    assert request.preload_fn is None  # NVRx's preload synchronizes the worker's GPU 0
    environ = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    nvrx_compat.only_the_ranks_gpu(2, environ)
    assert environ["CUDA_VISIBLE_DEVICES"] == "6"
    unset: dict[str, str] = {}
    nvrx_compat.only_the_ranks_gpu(3, unset)
    assert unset["CUDA_VISIBLE_DEVICES"] == "3"
    narrowed = {"CUDA_VISIBLE_DEVICES": "GPU-1234"}
    nvrx_compat.only_the_ranks_gpu(5, narrowed)  # one device per rank already
    assert narrowed["CUDA_VISIBLE_DEVICES"] == "GPU-1234"
