"""The two checkpoint modes built on torch DCP alone: `sync` and `torch-async`.

- `sync` (`SyncWriter`): `dcp.save`, each rank hashes its own shards, then the commit; the
  loop waits for all of it.
- `torch-async` (`TorchAsyncWriter`): torch's `dcp.async_save` stages the state to CPU and
  writes it in a thread over a gloo group of its own: the in-project baseline for NVRx.
  A second thread waits for the write and hashes this rank's shards; `poll()` (every
  step) commits once every rank's thread is done, and `finalize()` waits for it.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from trainer import peer_abort, waiting
from trainer.checkpointing import storage
from trainer.checkpointing.writer import CheckpointWriter, PendingSave


class SyncWriter(CheckpointWriter):
    """`sync`: returns from `start_save()` once the checkpoint is committed."""

    mode = "sync"

    def start_save(self, state: dict[str, Any], pending: PendingSave) -> None:
        with storage.shard_records_without_crc32():
            dcp.save(state, checkpoint_id=str(pending.staging))
        # Every rank hashes its own shards at once, so rank 0's commit reads only their sidecars.
        storage.write_hash_sidecars(pending.staging, dist.get_rank())
        self._commit(pending, loop_waited_for_write=True)
        self._queued(pending.record)

    def finalize(self) -> None:
        pass  # nothing is ever pending


class TorchAsyncWriter(CheckpointWriter):
    """`torch-async`: returns from `start_save()` once torch has staged the state."""

    mode = "torch-async"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._group: Any = None
        self._hasher: ThreadPoolExecutor | None = None
        self._pending: PendingSave | None = None

    def start(self, background: bool) -> None:
        # A group of its own: the writer thread's collectives must not interleave with
        # the training loop's on the default group.
        with peer_abort.tracking():  # an in-process restart shuts its connections down
            self._group = dist.new_group(backend="gloo")
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rtp-ckpt-hash")

    def start_save(self, state: dict[str, Any], pending: PendingSave) -> None:
        assert self._hasher is not None, "TorchAsyncWriter.start() was not called"
        write = dcp.async_save(state, checkpoint_id=str(pending.staging), process_group=self._group)
        pending.future = self._hasher.submit(_wait_then_hash, write, str(pending.staging), dist.get_rank())
        pending.queued_at = time.perf_counter()
        self._pending = pending
        pending.record.queue_s = pending.record.blocked_s = time.perf_counter() - pending.started_at
        self._queued(pending.record)

    def poll(self) -> None:
        """Its time (the agreement all-reduce, and the commit once agreed) blocks the loop, so
        it is added to the pending save's `blocked_s`."""
        pending = self._pending
        if pending is None:
            return
        started = time.perf_counter()
        not_done = torch.tensor([0 if pending.future.done() else 1], dtype=torch.int)
        dist.all_reduce(not_done)
        if not_done.item() == 0:
            self._finish()
        elapsed = time.perf_counter() - started
        pending.record.finalize_s += elapsed
        pending.record.blocked_s += elapsed

    def finalize(self) -> None:
        if self._pending is not None:
            self._finish()

    def _finish(self) -> None:
        pending = self._pending
        assert pending is not None
        waiting.result(pending.future)  # re-raises a failed background write
        self._commit(pending)
        self._pending = None

    def close(self) -> None:
        super().close()
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None
        if self._hasher is not None:
            self._hasher.shutdown()
            self._hasher = None

    def abandon(self) -> None:
        self._pending = None
        self._group = None  # its process group is gone with the default one


def _wait_then_hash(write: Any, staging: str, rank: int) -> None:
    """torch-async's write plus the shard hashes (runs in a background thread)."""
    write.result()
    storage.write_hash_sidecars(staging, rank)
