"""Every touch of NVRx 0.4.1 beyond its public API, each work-around named after the
upstream behaviour it answers (file:line at v0.4.1). tests/unit/test_nvrx_upstream.py
asserts each behaviour, so an upgrade that no longer needs a work-around fails its test.
`nvrx_writer` uses NVRx's public API (`FileSystemWriterAsync`, `save_state_dict_async_plan`,
`AsyncCallsQueue`, `AsyncRequest`) and this module, and reads the same on CPU and GPU.

NVRx 0.4.1 assumes CUDA in four places:

1. Collectives on CUDA tensors (core.py:125, :190): `AsyncRequest.execute_finalize_fns` and
   `PersistentAsyncCaller.sync_all_async_calls` build their all-reduce tensor on
   `torch.cuda.current_device()`, which raises on a CPU build. Neither is called: every
   save, the warm-up's too, is finalized by the writer's own code (its finisher waits for
   the worker's report on `comp_q`, then gathers over the writer's gloo group).
2. The preload step (filesystem_async.py:233). The writer's `preload_fn` calls `torch.cuda.synchronize()` inside
   the persistent worker: on CPU that kills the worker and the trainer then waits forever;
   on a GPU it opens a CUDA context on the worker's current device, GPU 0, for every local
   rank. No request passes one (the warm-up's tensor is on the host; real saves' capture,
   point 3, already is the device-to-host copy), and the worker sees only its rank's GPU.
3. Torn checkpoints (filesystem_async.py:140, `_clone_if_needed`). CPU tensors are handed to the worker in place (moved to shared
   memory) and written while the optimizer keeps changing them, so a saved step would mix
   weights from later steps. Every save is
   therefore written from the host-state engine's capture of its step (`local_tier`, on
   CUDA as well, where it replaces NVRx's preload), taken beside the next forward and backward.
4. Warm-up. 0.4.1 has no warm-up call (core.py:347 starts the worker at the first save): the first save pays for spawning the worker and the
   write-results Manager, and the first real write for the worker's
   first fork of writer processes. `warm_up` sends a one-tensor DCP save into a scratch
   folder at start-up (all ranks, like a real save); the writer waits for it before its
   first save and then deletes the folder.
And on CPU and GPU alike:

5. Write results across in-process restarts. Writers report through one process-wide
   queue (`filesystem_async._results_queue`, a Manager's: filesystem_async.py:58-67). A save abandoned by a restart
   may already have posted its results, which the next save's finalize would read instead
   of its own. And NVRx raises its restart into the main thread again and again until the
   thread reaches the wrapper (inprocess/monitor_thread.py:181-182, `MonitorThread.run`:
   `while not self.stop_raising.is_set(): async_abort_main_thread()`): one landing between a
   Manager call's request and its reply leaves the reply in that thread's connection, and
   every later call on it reads the reply of the call before (seen: every later attempt's
   warm-up read "results_queue should not be empty" beside its own result). So each
   attempt reads a queue of its own (`new_calls_queue`), and the rank calls the Manager
   from threads of their own only, never the main thread.
6. Orphans. That queue lives in a Manager process NVRx spawns on first use
   (filesystem_async.py:66), its worker too (core.py:347-360), neither asking to die with
   its rank; a rank killed
   with SIGKILL leaves it (and multiprocessing's resource tracker) running forever. The
   queue is created here first, by a Manager that asks to die with its rank. The persistent
   worker is started here too, not by NVRx, so that it asks the same as its first act: a
   worker still importing torch when its rank is killed (during a restart's background
   warm-up) then does not wait for requests forever, holding the resource tracker,
   torch_shm_manager and /dev/shm.
   Each asks with its parent's pid, so a parent that died before the request still counts.
   Both are forked from the rank's own fork server where it runs (`trainer.forkserver`:
   imported already, where NVRx's spawn imports torch and NVRx again), else spawned.
7. Shard writes. NVRx's bucket writer opens each shard with the builtin `open`
   (filesystem_async.py:386);
   `prepare_shard_writer_process` makes that `storage.ShardWriter`, which hashes the bytes on
   their way (the shard is not read back for the manifest), and the worker skips torch.save's
   per-record CRC-32, which torch.load never checks.
"""

from __future__ import annotations

import gc
import os
import queue
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from nvidia_resiliency_ext.checkpointing.async_ckpt import core, filesystem_async, state_dict_saver

from trainer import env, forkserver, lifecycle, waiting
from trainer.checkpointing import slot_refs, storage

_shard_writer_prepared = False


def prepare_shard_writer_process() -> None:
    """(7) In the persistent worker, at its first save (its start-up overlaps the ranks'
    and imports nothing more): shards hashed as written, no CRC-32, and its start-up
    objects frozen out of the garbage collector."""
    global _shard_writer_prepared
    if _shard_writer_prepared:
        return
    # NVRx's bucket writer (its module's only `open`) writes through `ShardWriter`.
    filesystem_async.open = storage.ShardWriter  # type: ignore[attr-defined]
    torch.serialization.set_crc32_options(False)
    gc.freeze()
    _shard_writer_prepared = True


class DyingWithRankAsyncCaller(core.PersistentAsyncCaller):
    """(6) NVRx's persistent caller, with a worker that dies with its rank from its start."""

    def schedule_async_call(self, async_req: core.AsyncRequest) -> None:
        if async_req.async_fn is not None and self.process is None:
            self._start_worker()
        super().schedule_async_call(async_req)

    def _start_worker(self) -> None:
        """NVRx's own start of the worker (`schedule_async_call`), with `_worker_main` first."""
        self.rank = rank = dist.get_rank()  # NVRx's own start sets it the same way
        context, parent = forkserver.context()  # the rank's fork server, else spawn (NVRx's own)
        loop_args = (rank, self.queue, self.preload_q, self.comp_q, core.logger.getEffectiveLevel())
        args = (parent, env.local_rank(), *loop_args)
        self.process = context.Process(target=_worker_main, args=args, name="rtp-ckpt-writer")
        self.process.start()


_results_manager: Any = None


def new_calls_queue() -> core.AsyncCallsQueue:
    """A persistent-worker queue whose worker dies with its rank, with a write-results queue
    of its own: (5) for this attempt only, (6) from a Manager that dies with the rank."""
    global _results_manager
    if _results_manager is None:
        from multiprocessing.managers import SyncManager

        # On the main thread: Linux sends the death signal when the thread that started it ends.
        manager = SyncManager(ctx=forkserver.context()[0])
        manager.start(initializer=lifecycle.die_with_parent, initargs=(forkserver.context()[1],))
        _results_manager = manager  # keep it referenced: a collected manager shuts down
    filesystem_async._results_queue = waiting.off_main_thread("rtp-ckpt-results", _results_manager.Queue)
    calls = core.AsyncCallsQueue(persistent=True)
    calls.persistent_caller = DyingWithRankAsyncCaller()
    return calls


def number_request(calls: core.AsyncCallsQueue) -> int:
    """NVRx numbers requests in the order every rank schedules them (its
    `schedule_async_request`, core.py:550); taken on the loop, for a request sent later."""
    calls.call_idx += 1
    return calls.call_idx


def send(calls: core.AsyncCallsQueue, request: core.AsyncRequest) -> None:
    """The first half of NVRx's `schedule_async_request` (core.py:538-560): the request to
    the persistent worker, from the planner thread. Its finalize half is the writer's own
    finisher, not `maybe_finalize_async_calls`, whose collectives would run on the loop."""
    calls.persistent_caller.schedule_async_call(request)


def wait_for_write(calls: core.AsyncCallsQueue, call_idx: int, abandoned: threading.Event) -> bool:
    """Until the worker reports request `call_idx` written (True; core.py:496 puts it on
    `comp_q`), or `abandoned` is set (False); raises if the worker died."""
    caller = calls.persistent_caller
    while True:
        try:
            if caller.comp_q.get(timeout=0.05) == call_idx:
                return True
        except queue.Empty:
            if abandoned.is_set():
                return False
            if caller.process is None or not caller.process.is_alive():
                raise RuntimeError("the checkpoint writer process died before finishing the write") from None


def forget(calls: core.AsyncCallsQueue) -> None:
    """An in-process restart's end of the queue: the worker killed (it ignores SIGTERM) and
    forgotten only once dead, so NVRx's `close()`/`__del__` (core.py:432-447) never waits on
    a worker that cannot answer; its requests dropped unfinalized. Safe to repeat."""
    caller = calls.persistent_caller
    if caller is not None and caller.process is not None:
        if caller.process.is_alive():
            caller.process.kill()
            caller.process.join(timeout=10)
        caller.process = None
    calls.async_calls.clear()


def only_the_ranks_gpu(local_rank: int, environ: dict[str, str] | Any = os.environ) -> None:
    """(2) Before CUDA initializes in the worker: any CUDA use lands on its rank's GPU."""
    visible = [d.strip() for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if not visible:
        environ["CUDA_VISIBLE_DEVICES"] = str(local_rank)
    elif local_rank < len(visible):
        environ["CUDA_VISIBLE_DEVICES"] = visible[local_rank]
    # Fewer devices than local ranks: the launcher already narrowed them per rank.


def _worker_main(parent_pid: int, local_rank: int, *loop_args: Any) -> None:
    """(6) The persistent worker: set it up to die with its parent (the rank, or the rank's
    fork server, which dies with it), then NVRx's loop."""
    lifecycle.prepare_background_writer(parent_pid=parent_pid)
    only_the_ranks_gpu(local_rank)
    core.PersistentAsyncCaller.async_loop(*loop_args)


def warm_up(calls: core.AsyncCallsQueue, scratch_dir: Path, group: Any) -> Callable[[threading.Event], None]:
    """(4) Collective over the writer's `group`: plan one tiny save into `scratch_dir` (the
    same path on every rank) and send it, which starts the worker (a fresh interpreter:
    seconds) while the caller goes on. Returns what waits for this rank's write and reads
    its results (5: not on the main thread), until `abandoned` is set."""
    if dist.get_rank() == 0:
        shutil.rmtree(scratch_dir, ignore_errors=True)
        scratch_dir.mkdir(parents=True)
    waiting.barrier(group)
    writer = filesystem_async.FileSystemWriterAsync(str(scratch_dir))
    # A key per rank: DCP writes a replicated tensor from one rank only, and a rank with
    # nothing to write would not start its worker.
    tiny_state = {f"warm_up_rank_{dist.get_rank()}": torch.zeros(1)}
    writer, _, _ = state_dict_saver.save_state_dict_async_plan(tiny_state, writer, process_group=group)
    save_fn, _preload_fn, save_args = writer.get_save_function_and_args()
    call_idx = number_request(calls)
    # (2) The tiny state is on the host: nothing to preload, and no CUDA in the worker.
    send(calls, core.AsyncRequest(save_fn, save_args, [], preload_fn=None, call_idx=call_idx).freeze())

    def written(abandoned: threading.Event) -> None:
        if wait_for_write(calls, call_idx, abandoned):
            writer.retrieve_write_results()  # raises what failed

    return written


def write_then_hash(save_fn: Callable[..., None], staging: str, rank: int, *args: Any) -> None:
    """The NVRx writer's job plus the shard hashes (runs in the background worker)."""
    prepare_shard_writer_process()
    if len(args) > 1:
        args = (args[0], slot_refs.resolve(args[1]), *args[2:])
    save_fn(*args)
    storage.write_hash_sidecars(staging, rank)
