"""`sync`, the checkpoint mode built on torch DCP alone (`SyncWriter`): `dcp.save` with
`SAVE_THREADS` writer threads per rank, each shard hashed on its way to the file
(`storage.ShardWriter`: never read back on the training thread), then the commit; the loop
waits for all of it. `write_dcp` is that write, which `async`'s last save shares.
(`torch-async`, torch's `dcp.async_save`, is the benchmarks' writer: benchmarks/torch_async.py.)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from trainer import waiting
from trainer.checkpointing import storage
from trainer.checkpointing.writer import CheckpointWriter, PendingSave, Until

SAVE_THREADS = 2
"""Writer threads per rank for a `sync` save (torch's FileSystemWriter `thread_count`, one by
default): each serializes and writes a shard file of its own (`__<rank>_<thread>.distcp`),
so one file's serialization overlaps the other's write."""


class _HashingFileSystem(FileSystem):
    """torch DCP's local file system, whose shard files hash their bytes as they are written."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        if mode != "wb" or not str(path).endswith(".distcp"):  # `.metadata`, reads
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with storage.ShardWriter(path) as shard:
            yield shard


def hashing_writer(staging: str | Path, thread_count: int = SAVE_THREADS) -> FileSystemWriter:
    """DCP's FileSystemWriter into `staging`, each shard hashed as written (its sidecar)."""
    writer = FileSystemWriter(str(staging), thread_count=thread_count)
    writer.fs = _HashingFileSystem()
    return writer


class SyncWriter(CheckpointWriter):
    """`sync`: returns from `save()` once the checkpoint is committed."""

    mode = "sync"

    def _write(self, state: dict[str, Any], pending: PendingSave) -> None:
        storage.prepare_staging(self.root, pending.record.step, pending.rank_state)
        # Not on this thread: DCP's gathers wait inside C for the slowest rank's write, and a
        # main thread in C stamps no progress for NVRx's watchdog (trainer/waiting.py).
        pending.queued_at = pending.started_at
        waiting.off_main_thread("rtp-ckpt-save", write_dcp, state, pending, dist.group.WORLD)  # bound now
        # Each shard left its sidecar as it was written: rank 0's commit reads only those. A
        # shard without one (its write failed) is hashed here, on its own rank.
        storage.write_hash_sidecars(pending.staging, dist.get_rank())
        self._commit(pending, loop_waited_for_write=True)
        self._queued(pending.record)

    def wait(self, until: Until) -> None:
        pass  # nothing is ever pending


def write_dcp(state: dict[str, Any], pending: PendingSave, group: Any) -> None:
    """A save's DCP write in the calling process (`sync`, and `async`'s last save), each shard
    hashed as written, in a thread of its own, on the group bound when it began: on none, a
    write an in-process restart interrupts would gather on the next attempt's group."""
    with storage.shard_records_without_crc32():
        dcp.save(state, storage_writer=hashing_writer(pending.staging), process_group=group)
    if pending.during_write is not None:
        pending.during_write()
