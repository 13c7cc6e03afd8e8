"""The one contract every checkpoint mode implements, and what a save records.

A `CheckpointWriter` is how a save's state reaches a committed folder; one subclass per
`checkpoint.mode` (`manager.WRITERS` maps a mode to its class):

- `NoCheckpoints` (`off`): the contract doing nothing.
- `SyncWriter` (`sync`): torch DCP `dcp.save`; the loop waits for the write and the commit.
- `nvrx_writer.NvrxAsyncWriter` (`async`): NVRx's persistent writer process.

`checkpoint.writer` plugs in another subclass ("module:Class"): the benchmarks' `torch-async`
(torch's `dcp.async_save`, benchmarks/torch_async.py) is one.

The contract is four operations (`open`, `save`, `wait`, `close`); the manager calls them
alike in every mode. All are collective (every rank calls them at the same steps) but
`close(commit=False)`. Every mode writes the same torch DCP folders through `storage`'s
staging and commit, so a checkpoint saved in any mode with N ranks loads with M ranks. A
save is committed only after every rank's write finished. This module also holds what
the modes share: the save record, a save written in the calling process (`sync`'s, and
`async`'s last: `_write_now`), the collective commit with background retention.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from trainer import waiting
from trainer.checkpointing import storage

if TYPE_CHECKING:
    from trainer.checkpointing.slot_refs import Lease


@dataclass(slots=True)
class SaveRecord:
    step: int
    mode: str
    blocked_s: float
    """Time the training loop waited for this save: the previous save, the state dict,
    planning, the device-to-host (or host) copy, queueing, finalizing and committing."""
    write_s: float | None = None
    """From queueing to commit (background write + finalize); the blocked time for sync."""
    bytes_total: int | None = None
    path: str | None = None


@dataclass(slots=True)
class PendingSave:
    """A save between `CheckpointWriter.save()` and its commit."""

    record: SaveRecord
    staging: Path
    final: Path
    meta: dict[str, Any]
    rank_state: dict[str, Any]
    """This rank's RNG and loader state at the save's step (`storage.rank_state`), for its
    file in the staging folder."""
    started_at: float
    """When the save began (before waiting for the previous one): `blocked_s` counts from here."""
    queued_at: float = 0.0
    """When the write was handed to the background: `write_s` counts from here."""
    last: bool = False
    """The attempt's last save (its last step, or a stop was requested): no optimizer step
    follows it, so the live state stays as saved until it is committed."""
    deferrable: bool = False
    """A periodic save that a writer still warming up may skip: the fast tier covers
    recovery meanwhile (never the last save, never before a first durable one, never two in
    a row; the same on every rank)."""
    lend: Callable[[], None] = lambda: None
    """Lends the host capture of this step (sets `lease`); called by a writer that writes from it."""
    lease: Lease | None = None
    """The lent capture: its slot is not overwritten until the writer releases it."""
    during_write: Callable[[], None] = lambda: None
    """A drill's slow file system (`slow-save`): the writer calls it where it writes this
    save, on the thread that writes (never the training thread)."""


OnCommit = Callable[[SaveRecord], None]
Outcome = Literal["queued", "deferred", "off"]
Until = Literal["staged", "step", "committed"]


class CheckpointWriter:
    """How one `checkpoint.mode` writes a save, in four operations:

    - `open(background)`, once before the first save: what the mode needs up front, so the
      first save is not slower (`background`: it may finish while training runs, after a restart);
    - `save(state, pending)` at a due save: the previous save commits first, then this one
      is written or handed to the background ("queued"), or skipped ("deferred", "off");
    - `wait(until)`: "staged" right before every optimizer step (a save still copying the
      weights), "step" after every step (cheap: commits a save every rank finished),
      "committed" (the pending save is committed);
    - `close(commit)`: at the end, the last save committed and everything released; with
      `commit=False` (not collective) the pending work is dropped, never committed, because
      the process group is gone (before an in-process restart). Safe to call again.

    A save handed to the background (or written) is reported to `on_queued`, a committed
    one to `on_commit`; `prepare_captures` is called after the attempt's first step by a
    writer that writes from the fast tier's captures (`PendingSave.lend`)."""

    mode: ClassVar[str]
    host_bytes = 0
    """Host memory its own copies of the state held at most (for the summary)."""
    warming_up = False
    """Opened in the background (after a restart) and not ready yet; the same on every rank at
    the same step (it turns ready in a collective call, `save()` or `wait()`): periodic saves
    are deferred."""

    def __init__(
        self,
        root: Path,
        keep_last: int,
        keep_every: int,
        on_commit: OnCommit,
        *,
        on_queued: OnCommit = lambda record: None,
        keepalive: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
        prepare_captures: Callable[[], None] = lambda: None,
    ) -> None:
        self.root = root
        self._retain = lambda: storage.apply_retention(root, keep_last, keep_every)
        self.on_commit = on_commit
        self.on_queued = on_queued
        self.keepalive = keepalive  # around blocking waits the writer decides on itself
        self.prepare_captures = prepare_captures
        self._retention = threading.Thread()  # rank 0's latest retention; one never started joins at once

    def open(self, background: bool) -> None:  # optional: a default that does nothing
        """Collective, once: create what the mode needs before its first save."""

    def save(self, state: dict[str, Any], pending: PendingSave) -> Outcome:
        """Collective: begin writing `state` (model and optimizer) into `pending.staging`."""
        if pending.deferrable and self.warming_up:
            return "deferred"
        self.wait("committed")  # the previous save commits first: its slot or buffers are reused
        self._write(state, pending)
        return "queued"

    def wait(self, until: Until) -> None:  # a default that does nothing: nothing is pending
        """Collective: see the class doc."""

    def close(self, commit: bool = True) -> None:
        """See the class doc; subclasses release what `open()` made after this."""
        if commit:
            self.wait("committed")
            waiting.join(self._retention)

    def _write(self, state: dict[str, Any], pending: PendingSave) -> None:
        raise NotImplementedError

    def _write_now(self, state: dict[str, Any], pending: PendingSave, group: Any, loop_waits: bool) -> None:
        """Collective over `group`: stage and write the save in this process (DCP, each shard
        hashed as written), then commit it; `loop_waits`: its write counts as blocked time."""
        # In a thread bound to `group`: the staging barrier and DCP's gathers wait inside C for the
        # slowest rank, and a main thread in C stamps no progress for NVRx's watchdog
        # (trainer/waiting.py); on no group, a write an in-process restart interrupts would
        # gather on the next attempt's group.
        waiting.off_main_thread("rtp-ckpt-save", _stage_and_write, self.root, state, pending, group)
        # Each shard left its sidecar as it was written: rank 0's commit reads only those. A
        # shard without one (its write failed) is hashed here, on its own rank.
        storage.write_hash_sidecars(pending.staging, dist.get_rank())
        self._commit(pending, loop_waits)

    def _commit(self, pending: PendingSave, loop_waited_for_write: bool = False) -> None:
        """Collective commit of a finished write; rank 0 applies retention in the background."""
        record = pending.record
        record.bytes_total = storage.commit(pending.staging, pending.final, record.step, pending.meta)
        record.write_s = time.perf_counter() - pending.queued_at
        if loop_waited_for_write:
            record.blocked_s = record.write_s
        if dist.get_rank() == 0:
            # Deleting hundreds of MB is slow on some file systems; it need not block a step.
            waiting.join(self._retention)
            self._retention = threading.Thread(target=self._retain, name="rtp-ckpt-retention")
            self._retention.start()
        self.on_commit(record)


class NoCheckpoints(CheckpointWriter):
    """`off`: never saves."""

    mode = "off"

    def save(self, state: dict[str, Any], pending: PendingSave) -> Outcome:
        return "off"


SAVE_THREADS = 2
"""Writer threads per rank for a `sync` save (torch's FileSystemWriter `thread_count`, one by
default): each serializes and writes a shard file of its own (`__<rank>_<thread>.distcp`),
so one file's serialization overlaps the other's write."""


class _HashingFileSystem(FileSystem):
    """torch DCP's local file system, whose shard files hash their bytes as they are written."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        shard = mode == "wb" and str(path).endswith(".distcp")  # not `.metadata`, nor a read
        with storage.ShardWriter(path) if shard else super().create_stream(path, mode) as stream:
            yield stream


def hashing_writer(staging: str | Path, thread_count: int = SAVE_THREADS) -> FileSystemWriter:
    """DCP's FileSystemWriter into `staging`, each shard hashed as written (its sidecar)."""
    writer = FileSystemWriter(str(staging), thread_count=thread_count)
    writer.fs = _HashingFileSystem()
    return writer


class SyncWriter(CheckpointWriter):
    """`sync`: returns from `save()` once the checkpoint is committed."""

    mode = "sync"

    def _write(self, state: dict[str, Any], pending: PendingSave) -> None:
        pending.queued_at = pending.started_at
        self._write_now(state, pending, dist.group.WORLD, loop_waits=True)
        self.on_queued(pending.record)


def _stage_and_write(root: Path, state: dict[str, Any], pending: PendingSave, group: Any) -> None:
    """`_write_now`'s thread: the staging folder (a barrier over `group`), then the DCP write."""
    storage.prepare_staging(root, pending.record.step, pending.rank_state, group=group)
    with storage.shard_records_without_crc32():
        dcp.save(state, storage_writer=hashing_writer(pending.staging), process_group=group)
    pending.during_write()
