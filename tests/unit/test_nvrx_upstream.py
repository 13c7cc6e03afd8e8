"""What NVRx 0.4.1 does that `trainer.checkpointing.nvrx_compat` works around, one test per
work-around, numbered as there. Each test asserts the upstream behaviour, so it fails once
an NVRx upgrade stops needing the work-around: then drop the work-around with its test."""

from __future__ import annotations

import inspect

import pytest
import torch
from nvidia_resiliency_ext.checkpointing.async_ckpt import core, filesystem_async
from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import save_state_dict_async_plan
from nvidia_resiliency_ext.inprocess import monitor_thread

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU build's behaviour")


@cpu_only
@pytest.mark.usefixtures("single_rank_group")
def test_1_the_finalize_and_is_alive_agreements_reduce_a_cuda_tensor():
    """core.py:125 and :190 build the all-reduce tensor on `torch.cuda.current_device()`: why
    the writer never calls them (it finalizes every save, the warm-up's too, itself)."""
    with pytest.raises((AssertionError, RuntimeError)):
        core.AsyncRequest(None, (), []).execute_finalize_fns()
    caller = core.PersistentAsyncCaller()
    with pytest.raises((AssertionError, RuntimeError)):
        caller.sync_all_async_calls(0)


@cpu_only
def test_2_the_preload_step_synchronizes_cuda():
    """filesystem_async.py:233: `preload_tensors` ends in `torch.cuda.synchronize()`."""
    with pytest.raises((AssertionError, RuntimeError)):
        filesystem_async.FileSystemWriterAsync.preload_tensors([], non_blocking=True)


@pytest.mark.usefixtures("single_rank_group")
def test_3_host_tensors_are_handed_to_the_writer_in_place(tmp_path):
    """filesystem_async.py:140 `_clone_if_needed`: a contiguous host tensor is written from
    the live tensor, which the optimizer goes on changing (a torn save)."""
    weights = torch.arange(64, dtype=torch.float32)
    writer, _, _ = save_state_dict_async_plan(
        {"w": weights}, filesystem_async.FileSystemWriterAsync(str(tmp_path))
    )
    [(_, _, (_, [(_, written)]))] = writer.write_buckets
    assert written.data_ptr() == weights.data_ptr()


def test_4_there_is_no_warm_up_call():
    """core.py:347: the first save pays for spawning the worker; no call starts it ahead."""
    names = {name for cls in (core.AsyncCallsQueue, core.PersistentAsyncCaller) for name in dir(cls)}
    assert not {name for name in names if "warm" in name.lower() or name == "start"}


def test_5_write_results_share_one_manager_queue_and_restarts_raise_again_and_again():
    """filesystem_async.py:58-67: one process-wide queue of a Manager; inprocess
    monitor_thread.py:181-182: the restart raises into the main thread until it is stopped."""
    source = inspect.getsource(filesystem_async._get_write_results_queue)
    assert "global _results_queue" in source and "Manager().Queue()" in source
    assert "while not self.stop_raising.is_set():" in inspect.getsource(monitor_thread.MonitorThread.run)


def test_6_the_worker_and_the_manager_outlive_a_killed_rank():
    """core.py:347-360 starts the worker, filesystem_async.py:66 the Manager, neither asking
    to die with its rank."""
    started = inspect.getsource(core.PersistentAsyncCaller.schedule_async_call)
    assert "target=PersistentAsyncCaller.async_loop" in started
    for module in (core, filesystem_async):
        assert "PDEATHSIG" not in inspect.getsource(module) and "prctl" not in inspect.getsource(module)


def test_7_the_bucket_writer_opens_shards_with_the_builtin_open():
    """filesystem_async.py:386: `open_file = open` (the module's only `open`)."""
    assert "open_file = open" in inspect.getsource(
        filesystem_async.FileSystemWriterAsync.write_preloaded_data
    )
