"""The one interface every checkpoint mode implements, and what a save records.

A `CheckpointWriter` is how a save's state reaches a committed folder; one subclass per
`checkpoint.mode` (`manager.WRITERS` maps a mode to its class):

- `NoCheckpoints` (`off`): never saves.
- `torch_writers.SyncWriter` (`sync`): torch DCP `dcp.save`; the loop waits for the write.
- `torch_writers.TorchAsyncWriter` (`torch-async`): torch's `dcp.async_save`.
- `nvrx_writer.NvrxAsyncWriter` (`async`): NVRx's persistent writer process.

All of them are collective objects: every rank holds one and calls it at the same steps.
They write the same torch DCP folders through `storage`'s staging and commit, so a
checkpoint saved in any mode with N ranks loads with M ranks. A save is committed only
after every rank's write finished. This module also holds the helpers the modes share: the
save record, the collective commit with background retention.
"""

from __future__ import annotations

import contextlib
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch.distributed as dist

from trainer import waiting
from trainer.checkpointing import storage

if TYPE_CHECKING:
    from trainer.checkpointing.slot_refs import Lease


@dataclass(slots=True)
class SaveRecord:
    step: int
    mode: str
    blocked_s: float
    """Time the training loop waited: for the previous save, building the state dict,
    planning, the device-to-host (or host) copy, queueing, finalizing."""
    queue_s: float = 0.0
    """The part of `blocked_s` spent inside save(): previous save, state dict, planning, and
    for sync and torch-async the copy."""
    previous_wait_s: float = 0.0
    """The part of `queue_s` spent waiting for the previous save to commit (its background
    write had not finished within the checkpoint interval)."""
    handoff_s: float = 0.0
    """async only: the part of `blocked_s` spent before the next optimizer step, waiting for
    the capture and planning that ran beside forward and backward, and starting the finisher."""
    finalize_s: float = 0.0
    """The part of `blocked_s` spent in later steps agreeing that the write finished,
    finalizing and committing it."""
    write_s: float | None = None
    """From queueing to commit (background write + finalize); the blocked time for sync."""
    bytes_total: int | None = None
    path: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class PendingSave:
    """A save between `start_save()` and its commit."""

    record: SaveRecord
    staging: Path
    final: Path
    meta: dict[str, Any]
    started_at: float
    """When the save began (before waiting for the previous one): `blocked_s` counts from here."""
    queued_at: float
    """When the write was handed to the background: `write_s` counts from here."""
    future: Any = None
    """torch-async: the background write and shard hashing."""
    rank_state: dict[str, Any] | None = None
    """This rank's RNG and loader state at the save's step, for its file in the staging
    folder; set when the writer's `stage()` leaves making the folder to `start_save()`."""
    last: bool = False
    """The attempt's last save (its last step, or a stop was requested): no optimizer step
    follows it, so the live state stays as saved until `finalize()`."""
    lease: Lease | None = None
    """The host capture of this step, lent to a writer that `reads_captures`: its slot is
    not overwritten until the writer releases it."""
    during_write: Callable[[], None] | None = None
    """A drill's slow file system (`slow-save`): the writer calls it where it writes this
    save, on the thread that writes (never the training thread)."""


OnCommit = Callable[[SaveRecord], None]
KeepAlive = Callable[[], contextlib.AbstractContextManager[None]]


class CheckpointWriter(ABC):
    """How one `checkpoint.mode` writes a save. Collective: call on every rank, same steps.

    The manager calls, in order: `start()` once; per due save `defers()`, then
    `finalize()` (the previous save must be committed first), `stage()` and `start_save()`;
    `wait_for_staging()` before every optimizer step; `poll()` after every step; `close()`
    at the end, or `abandon()` when the process group is gone. A save handed to the
    background (or written) is reported to `on_queued`, a committed one to `on_commit`."""

    mode: ClassVar[str]
    writes_checkpoints: ClassVar[bool] = True
    reads_captures: ClassVar[bool] = False
    """Writes a save from the host capture of its step (`PendingSave.lease`)."""
    host_bytes = 0
    """Host memory its own copies of the state held at most (for the summary)."""

    def __init__(
        self,
        root: Path,
        keep_last: int,
        keep_every: int,
        on_commit: OnCommit,
        *,
        on_queued: OnCommit | None = None,
        keepalive: KeepAlive = contextlib.nullcontext,
    ) -> None:
        self.root = root
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.on_commit = on_commit
        self.on_queued = on_queued
        self.keepalive = keepalive  # around blocking waits the writer decides on itself
        self._retention: threading.Thread | None = None

    def start(self, background: bool) -> None:  # noqa: B027 (optional: a default that does nothing)
        """Collective: create what the mode needs up front, so the first save is not slower.

        `background`: may finish warming up while training runs (after a restart)."""

    def defers(self, step: int, last_step: bool, previous_save: int, interval: int) -> bool:
        """Whether the periodic save due at `step` is skipped because the writer is still
        warming up (a restart's writer warms up in the background; waiting here would block
        the loop for seconds and could trip the in-process watchdog). The fast tier covers
        recovery meanwhile. Never the attempt's last save, never before a first durable save
        (`previous_save`: the newest one this attempt resumed from or queued, 0 for none),
        never two in a row (at most `interval` steps after it). Every rank decides alike: the
        warm-up ends in a collective, and the steps compared are the ones every rank resumed
        from or queued."""
        return not last_step and self.warming_up and previous_save > 0 and step - previous_save <= interval

    def stage(self, step: int, rank_extra: dict[str, Any]) -> tuple[Path, Path, dict[str, Any] | None]:
        """Collective: (staging, final, rank_state) for step `step`'s save. Here the staging
        folder is made now with this rank's RNG/loader file; a writer that makes it later
        (in a background thread) returns the rank state taken now instead of None."""
        staging, final = storage.prepare_staging(self.root, step, rank_extra)
        return staging, final, None

    @abstractmethod
    def start_save(self, state: dict[str, Any], pending: PendingSave) -> None:
        """Collective: begin writing `state` (model and optimizer) into `pending.staging`."""

    @property
    def warming_up(self) -> bool:
        """The writer started in the background (after a restart) and is not ready yet; the
        same on every rank at the same step (it turns ready in a collective `poll()`)."""
        return False

    def wait_for_staging(self) -> None:  # noqa: B027 (optional: a default that does nothing)
        """Collective: the optimizer is about to change the weights in place; a save still
        copying them is waited for here (and reported to `on_queued` once queued)."""

    def poll(self) -> None:  # noqa: B027 (optional: a default that does nothing)
        """Collective, cheap, every step: commit the pending save if every rank's write finished."""

    @abstractmethod
    def finalize(self) -> None:
        """Collective: wait for the pending save (and any warm-up) and commit it."""

    def close(self) -> None:
        """Collective: finalize, then release what `start()` created (safe to call twice)."""
        self.finalize()
        if self._retention is not None:
            waiting.join(self._retention)

    def abandon(self) -> None:  # noqa: B027 (optional: a default that does nothing)
        """Not collective: drop pending work without committing it (its process group is
        gone, e.g. before an in-process restart). Safe to call again if interrupted."""

    def _commit(self, pending: PendingSave, loop_waited_for_write: bool = False) -> None:
        """Collective commit of a finished write; rank 0 applies retention in the background."""
        record = pending.record
        record.bytes_total = storage.commit(pending.staging, pending.final, record.step, pending.meta)
        record.write_s = time.perf_counter() - pending.queued_at
        if loop_waited_for_write:
            record.blocked_s = record.write_s
        if dist.get_rank() == 0:
            # Deleting hundreds of MB is slow on some file systems; it need not block a step.
            if self._retention is not None:
                waiting.join(self._retention)
            self._retention = threading.Thread(
                target=storage.apply_retention,
                args=(self.root, self.keep_last, self.keep_every),
                name="rtp-ckpt-retention",
            )
            self._retention.start()
        self.on_commit(record)

    def _queued(self, record: SaveRecord) -> None:
        """The save is handed to the background (or written): tell `on_queued`."""
        if self.on_queued is not None:
            self.on_queued(record)


class NoCheckpoints(CheckpointWriter):
    """`off`: never saves (the manager checks `writes_checkpoints` before building any state)."""

    mode = "off"
    writes_checkpoints = False

    def start_save(self, state: dict[str, Any], pending: PendingSave) -> None:
        raise RuntimeError("checkpoint.mode is off: nothing may be saved")

    def finalize(self) -> None:
        pass
