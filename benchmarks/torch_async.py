"""`torch-async`, the peer the checkpoint benchmarks compare NVRx's `async` with: torch's
`dcp.async_save`, plugged into the trainer as a writer class (`checkpoint.writer`), not a
user-facing `checkpoint.mode`.

It stages the state to host memory and writes it in a thread over a gloo group of its own.
It stages through one `DefaultStager` kept for the attempt, as NVRx keeps its slots: its
host buffers are made at the first save and reused (torch's default makes and frees a copy
per save), and on CUDA they are pinned and filled by non-blocking copies on a stream of
their own while the next forward and backward run (`wait("staged")` before the optimizer
step), as NVRx's capture does. A second thread waits for the write and hashes this rank's
shards; `wait("step")` (every step) commits once every rank's thread is done, and
`wait("committed")` waits for it.

`benchmarks.checkpoint.mode_overrides` plugs it in: `checkpoint.mode=sync` with this writer
in its place.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from trainer import peer_abort, waiting
from trainer.checkpointing import CheckpointWriter, storage
from trainer.checkpointing.writer import PendingSave, Until


class TorchAsyncWriter(CheckpointWriter):
    """`torch-async`: returns from `save()` once torch has staged the state (on CUDA: once
    the copies are queued; `wait("staged")` waits for them)."""

    mode = "torch-async"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._group: Any = None
        self._hasher: ThreadPoolExecutor | None = None
        self._stager: Any = None
        self._pending: PendingSave | None = None
        self._write_done: Future[None] | None = None
        self._staging: Future[None] | None = None

    def open(self, background: bool) -> None:
        # A group of its own: the writer thread's collectives must not interleave with
        # the training loop's on the default group.
        with peer_abort.tracking():  # an in-process restart shuts its connections down
            self._group = dist.new_group(backend="gloo")
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rtp-ckpt-hash")
        self._stager = kept_stager(torch.cuda.is_available())

    def _write(self, state: dict[str, Any], pending: PendingSave) -> None:
        assert self._hasher is not None, "TorchAsyncWriter.open() was not called"
        storage.prepare_staging(self.root, pending.record.step, pending.rank_state)
        staged = {} if self._stager is None else {"async_stager": self._stager}
        response = dcp.async_save(
            state, checkpoint_id=str(pending.staging), process_group=self._group, **staged
        )
        # An asynchronous stager (CUDA) is answered with (staging, upload) futures.
        write = getattr(response, "upload_completion", response)
        self._staging = getattr(response, "staging_completion", None)
        self._write_done = self._hasher.submit(
            _wait_then_hash, write, str(pending.staging), dist.get_rank(), pending.during_write
        )
        pending.queued_at = time.perf_counter()
        self._pending = pending
        pending.record.blocked_s = time.perf_counter() - pending.started_at
        if self._stager is not None and not self.host_bytes:
            self.host_bytes = _host_bytes(state)  # the stager's buffers, kept for the attempt
        if self._staging is None:
            self.on_queued(pending.record)

    def wait(self, until: Until) -> None:
        pending = self._pending
        if pending is None:
            return
        if until != "step":
            self._wait_staged(pending)  # for the last save no optimizer step waited for it
        if until == "committed":
            self._finish(pending)
            return
        if until == "step":
            # The agreement all-reduce, and the commit once agreed, block the loop.
            started = time.perf_counter()
            assert self._write_done is not None
            not_done = torch.tensor([0 if self._write_done.done() else 1], dtype=torch.int)
            dist.all_reduce(not_done)
            if not_done.item() == 0:
                self._finish(pending)
            pending.record.blocked_s += time.perf_counter() - started

    def _wait_staged(self, pending: PendingSave) -> None:
        """The staging copies (CUDA) read the weights the optimizer is about to change."""
        if self._staging is None:
            return
        with self.keepalive():
            started = time.perf_counter()
            staging, self._staging = self._staging, None
            waiting.result(staging)
        pending.record.blocked_s += time.perf_counter() - started
        self.on_queued(pending.record)

    def _finish(self, pending: PendingSave) -> None:
        assert self._write_done is not None
        waiting.result(self._write_done)  # re-raises a failed background write
        self._commit(pending)
        self._pending = None

    def close(self, commit: bool = True) -> None:
        super().close(commit)
        self._pending = self._staging = self._write_done = None
        if commit and self._group is not None:
            dist.destroy_process_group(self._group)
        self._group = None  # without commit, its process group is gone with the default one
        if commit and self._hasher is not None:
            self._hasher.shutdown()
        self._hasher = None
        if commit and self._stager is not None:
            self._stager.close()  # frees (and unpins) its buffers
        self._stager = None  # without commit, a staging copy may still run: its buffers go with it


def kept_stager(cuda: bool) -> Any:
    """One DefaultStager for the attempt's saves: host buffers made at the first save and
    reused; on CUDA pinned, filled by non-blocking copies on a stream of their own, in the
    background (staged state in shared memory is for a writer process: not used here).
    None where this torch has no DefaultStager: torch's default then."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        return None
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=False,
            use_async_staging=cuda,
            use_non_blocking_copy=cuda,
        )
    )


def _host_bytes(state: Any) -> int:
    """Bytes of the tensors (a DTensor: its local shard) in a nested state dict."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return sum(_host_bytes(value) for value in state.values())
    if isinstance(state, list | tuple):
        return sum(_host_bytes(value) for value in state)
    if isinstance(state, DTensor):
        state = state._local_tensor
    return state.numel() * state.element_size() if isinstance(state, torch.Tensor) else 0


def _wait_then_hash(
    write: Any, staging: str, rank: int, during_write: Callable[[], None] | None = None
) -> None:
    """torch-async's write plus the shard hashes (runs in a background thread)."""
    write.result()
    if during_write is not None:
        during_write()
    storage.write_hash_sidecars(staging, rank)
