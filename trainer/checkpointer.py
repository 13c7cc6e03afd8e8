"""When and how a running job writes checkpoints: the four `checkpoint.mode`s.

- `off`: never saves.
- `sync`: torch DCP `dcp.save`; the loop waits for the whole write.
- `torch-async`: torch's `dcp.async_save` (stage to CPU, write in a thread over a
  dedicated gloo group): the in-project baseline.
- `async`: NVRx — a persistent writer process per rank (`AsyncCallsQueue`), the DCP
  plan / background write / finalize split with `FileSystemWriterAsync`. The state is
  copied to host buffers (`trainer.snapshot`), planned and sent to the worker by a
  background thread while the next step's forward and backward run; the loop calls
  `before_optimizer_step()` before every `optimizer.step()`, which waits for that thread
  if it is still running and registers the write for finalizing.

All modes write the same torch DCP folders through `trainer.checkpoint`'s staging and
commit, so a checkpoint saved in any mode with N ranks loads with M ranks. An async save
is committed only after every rank's write finished and was finalized: `poll()` (every
step, on every rank) finalizes it as soon as all ranks agree (for `async`, rank 0 then
writes the metadata and commits in a background thread), and the next `save()` or
`drain()` waits for all of it. Every save records how long the loop was blocked and how long the
background write took.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from trainer import checkpoint, lifecycle
from trainer.config import CHECKPOINT_MODES

log = logging.getLogger(__name__)

MODES = CHECKPOINT_MODES


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
    the snapshot copy that ran beside forward and backward, and queueing the write."""
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
class _Pending:
    record: SaveRecord
    staging: Path
    final: Path
    meta: dict[str, Any]
    queued_at: float
    future: Any = None
    request: Any = None
    """async: plans and sends the NVRx request; runs in the snapshot's thread."""


class Checkpointer:
    """Collective object: every rank creates it, and calls save/poll/drain at the same steps."""

    def __init__(
        self,
        root: str | Path,
        mode: str,
        keep_last: int,
        keep_every: int = 0,
        on_commit: Callable[[SaveRecord], None] | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"checkpoint mode {mode!r} is not one of {', '.join(MODES)}")
        self.root = Path(root)
        self.mode = mode
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.on_commit = on_commit
        self.records: list[SaveRecord] = []
        self._pending: _Pending | None = None
        self._calls: Any = None
        self._group: Any = None
        self._snapshot: Any = None
        self._handoff: _Pending | None = None
        self._plan_cache: Any = None
        self._hasher: ThreadPoolExecutor | None = None
        self._retention: threading.Thread | None = None
        self._committer: threading.Thread | None = None
        self._committer_error: BaseException | None = None
        self._warming_up = False

    def start(self, background: bool = False) -> None:
        """Collective: create what the mode needs up front, so the first save is not slower.

        `background`: let the NVRx writer warm up while training runs (after a restart)."""
        _LIVE.append(self)
        if self.mode == "torch-async":
            # A group of its own: the writer thread's collectives must not interleave with
            # the training loop's on the default group.
            self._group = dist.new_group(backend="gloo")
            self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rtp-ckpt-hash")
        elif self.mode == "async":
            from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import (
                CheckpointMetadataCache,
            )

            from trainer import nvrx_compat
            from trainer.snapshot import HostSnapshot, share_snapshots_by_file_name

            share_snapshots_by_file_name()
            # Save planning gathers plans from all ranks, and runs in the snapshot's thread
            # while the loop runs collectives of its own: a group of its own keeps them apart.
            self._group = dist.new_group(backend="gloo")
            self._snapshot = HostSnapshot()
            self._plan_cache = CheckpointMetadataCache()
            with lifecycle.children_ignore_sigterm():  # the results Manager starts here too
                self._calls = nvrx_compat.new_calls_queue()
                nvrx_compat.warm_up(self._calls, self.root / ".warm-up", wait=not background)
            self._warming_up = background

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        meta: dict[str, Any],
        rank_extra: dict[str, Any],
    ) -> SaveRecord | None:
        """Collective. Sync: returns once committed. torch-async: returns once queued.
        async: returns once the snapshot copy started; `before_optimizer_step()` queues it."""
        if not self.enabled:
            return None
        started = time.perf_counter()
        self.drain()
        previous_wait_s = time.perf_counter() - started
        staging, final = checkpoint.prepare_staging(self.root, step, rank_extra)
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        record = SaveRecord(
            step=step, mode=self.mode, blocked_s=0.0, previous_wait_s=previous_wait_s, path=str(final)
        )
        pending = _Pending(record, staging, final, meta, queued_at=started)
        if self.mode == "sync":
            dcp.save(state, checkpoint_id=str(staging))
            self._commit(pending)
        elif self.mode == "torch-async":
            assert self._hasher is not None, "Checkpointer.start() was not called"
            write = dcp.async_save(state, checkpoint_id=str(staging), process_group=self._group)
            pending.future = self._hasher.submit(_wait_then_hash, write, str(staging), dist.get_rank())
            pending.queued_at = time.perf_counter()
            self._pending = pending
        else:
            self._plan_nvrx(state, pending)
        if self.mode != "sync":
            record.queue_s = record.blocked_s = time.perf_counter() - started
        self.records.append(record)
        return record

    def _plan_nvrx(self, state: dict[str, Any], pending: _Pending) -> None:
        """Start the snapshot copy. The write is planned over the snapshot's buffers and
        sent to the writer process as soon as the copy is complete; the loop registers it
        for finalizing in `_hand_off()`, before the next optimizer step.

        The snapshot's thread plans and sends the write right after the copy, so the write
        starts while the loop is still in forward and backward. Planning runs collectives
        (the first two saves gather plans from all ranks; later ones reuse NVRx's cached
        plan) over the checkpointer's own gloo group, never the loop's."""
        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync

        writer = FileSystemWriterAsync(str(pending.staging))
        # NVRx numbers requests in the order every rank schedules them; taken here, on the loop.
        self._calls.call_idx += 1
        pending.request = partial(self._plan_and_send, writer, pending, self._calls.call_idx)
        self._snapshot.start(state, after_copy=pending.request)
        self._pending = self._handoff = pending

    def _plan_and_send(self, writer: Any, pending: _Pending, call_idx: int, snapshot: dict[str, Any]) -> Any:
        """Plan the write over the complete snapshot and send it to the writer process.

        This is the first half of NVRx's `AsyncCallsQueue.schedule_async_request` (number,
        freeze, send to the persistent worker); the second half, registering the request
        for finalizing (`maybe_finalize_async_calls` runs collectives over that list), is
        `_hand_off()`'s, on the loop, so every rank's list changes at the same step."""
        from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import save_state_dict_async_plan

        from trainer import nvrx_compat

        writer, metadata, dist_wrapper = save_state_dict_async_plan(
            snapshot, writer, process_group=self._group, enable_cache=True, metadata_cache=self._plan_cache
        )
        save_fn, _preload_fn, save_args = writer.get_save_function_and_args()
        request = nvrx_compat.CpuSafeAsyncRequest(
            partial(_write_then_hash, save_fn, str(pending.staging), dist.get_rank()) if save_fn else None,
            save_args,
            [partial(self._finalize_nvrx, writer, metadata, dist_wrapper, pending)],
            # The snapshot already is the device-to-host copy; NVRx's preload would copy
            # again and make the loop wait for the worker to do it.
            preload_fn=None,
            call_idx=call_idx,
        ).freeze()
        self._calls.persistent_caller.schedule_async_call(request._replace(finalize_fns=[]))
        pending.queued_at = time.perf_counter()
        return request

    @property
    def awaiting_handoff(self) -> bool:
        """An async save was taken but not yet registered for finalizing (until the next step)."""
        return self._handoff is not None

    def before_optimizer_step(self) -> SaveRecord | None:
        """Collective; call right before every `optimizer.step()`. Completes the hand-off of
        an async save whose snapshot was copied while forward and backward ran (waiting for
        the copy if needed) and returns its record; otherwise does nothing, returns None."""
        pending = self._handoff
        if pending is None:
            return None
        started = time.perf_counter()
        self._hand_off()
        elapsed = time.perf_counter() - started
        pending.record.handoff_s += elapsed
        pending.record.blocked_s += elapsed
        return pending.record

    def _hand_off(self) -> None:
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import _ActiveAsyncRequest

        pending, self._handoff = self._handoff, None
        assert pending is not None
        request = self._snapshot.wait()  # the request, planned and sent
        pending.request = None
        self._calls.async_calls.append(
            _ActiveAsyncRequest(request.call_idx, self._calls.persistent_caller, request)
        )

    def _finalize_nvrx(self, writer: Any, metadata: Any, dist_wrapper: Any, pending: _Pending) -> None:
        """NVRx's finalize step, run on the loop by every rank once all ranks' writes finished
        (NVRx's `save_state_dict_async_finalize`, split in two): the collective part, gathering
        the write results, stays here; rank 0 then writes DCP's `.metadata` and commits
        (fsyncs, manifest, rename, retention) in a background thread, so that file work does
        not block training. `drain()` waits for it; the next save starts with a `drain()`."""
        from torch.distributed.checkpoint import CheckpointException
        from torch.distributed.checkpoint.utils import _get_failure_dict

        all_results = dist_wrapper.gather_object(writer.retrieve_write_results())
        self._pending = None
        if not dist_wrapper.is_coordinator:
            self._record_commit(pending)
            return
        failures = _get_failure_dict(all_results)
        if failures:
            raise CheckpointException("write", failures)
        self._join_committer()
        self._committer = threading.Thread(
            target=self._commit_in_background,
            args=(writer, metadata, all_results, pending, dist.get_world_size()),
            name="rtp-ckpt-commit",
        )
        self._committer.start()

    def _commit_in_background(
        self, writer: Any, metadata: Any, all_results: Any, pending: _Pending, world_size: int
    ) -> None:
        try:
            writer.finish(metadata, all_results)  # DCP's .metadata: the checkpoint is readable
            checkpoint.commit_files(
                pending.staging, pending.final, pending.record.step, pending.meta, world_size
            )
            pending.record.bytes_total = checkpoint.checkpoint_bytes(pending.final)
            self._record_commit(pending)
            checkpoint.apply_retention(self.root, self.keep_last, self.keep_every)
        except BaseException as exc:  # re-raised on the training thread by _join_committer()
            self._committer_error = exc

    def _join_committer(self) -> None:
        committer, self._committer = self._committer, None
        if committer is not None:
            committer.join()
        error, self._committer_error = self._committer_error, None
        if error is not None:
            raise checkpoint.CheckpointError(f"committing a checkpoint failed: {error}") from error

    def _record_commit(self, pending: _Pending) -> None:
        pending.record.write_s = time.perf_counter() - pending.queued_at
        if self.on_commit:
            self.on_commit(pending.record)

    def poll(self) -> None:
        """Collective, cheap: finalize the pending save if every rank's write has finished.

        Its time (the agreement all-reduce, finalize; for sync modes the commit) blocks the
        loop, so it is added to the pending save's `blocked_s`.
        """
        pending = self._pending
        if pending is None:
            if self._warming_up and not self._calls.get_num_unfinalized_calls():
                self._finish_warm_up()
            elif self._warming_up:
                self._calls.maybe_finalize_async_calls(blocking=False)
            return
        started = time.perf_counter()
        if self.mode == "async":
            self._calls.maybe_finalize_async_calls(blocking=False)  # commits via finalize fns
        else:
            not_done = torch.tensor([0 if pending.future.done() else 1], dtype=torch.int)
            dist.all_reduce(not_done)
            if not_done.item() == 0:
                self._finish_torch_async()
        elapsed = time.perf_counter() - started
        pending.record.finalize_s += elapsed
        pending.record.blocked_s += elapsed

    def _finish_warm_up(self) -> None:
        from trainer import nvrx_compat

        self._warming_up = False
        nvrx_compat.finish_warm_up(self.root / ".warm-up")

    def drain(self) -> None:
        """Collective: wait for the pending save (and a background warm-up) and commit it."""
        if self._warming_up:
            self._wait_for_writer()
            self._finish_warm_up()
        if self._pending is not None:
            if self._handoff is not None:  # saved at the loop's last step: no optimizer step follows
                self._hand_off()
            if self.mode == "async":
                self._wait_for_writer()
            else:
                self._finish_torch_async()
        self._join_committer()

    def _wait_for_writer(self) -> None:
        """Finalize every queued NVRx request, checking every 5 ms.

        `maybe_finalize_async_calls(blocking=True)` sleeps 0.1 s between checks, which showed
        up as waits for the previous save quantized to 100 ms. Each check is one all-reduce
        on every rank with the same result everywhere, so the ranks leave together."""
        while self._calls.get_num_unfinalized_calls():
            if not self._calls.maybe_finalize_async_calls(blocking=False):
                time.sleep(0.005)

    def _finish_torch_async(self) -> None:
        pending = self._pending
        assert pending is not None
        pending.future.result()  # re-raises a failed background write
        self._commit(pending)

    def _commit(self, pending: _Pending) -> None:
        pending.record.bytes_total = checkpoint.commit(
            pending.staging, pending.final, pending.record.step, pending.meta
        )
        pending.record.write_s = time.perf_counter() - pending.queued_at
        if self.mode == "sync":  # the loop waited for all of it
            pending.record.blocked_s = pending.record.write_s
        self._pending = None
        if dist.get_rank() == 0:
            # Deleting hundreds of MB is slow on some file systems; it need not block a step.
            if self._retention is not None:
                self._retention.join()
            self._retention = threading.Thread(
                target=checkpoint.apply_retention,
                args=(self.root, self.keep_last, self.keep_every),
                name="rtp-ckpt-retention",
            )
            self._retention.start()
        if self.on_commit:
            self.on_commit(pending.record)

    def close(self) -> None:
        """Collective: drain, then stop the writer process (safe to call twice)."""
        self.drain()
        if self._retention is not None:
            self._retention.join()
        if self._calls is not None:
            self._calls.close()
            self._calls = None
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None
        if self._hasher is not None:
            self._hasher.shutdown()
            self._hasher = None
        if self in _LIVE:
            _LIVE.remove(self)

    def abandon(self) -> None:
        """Not collective: drop pending work without finalizing (its process group is gone,
        e.g. before an in-process restart). The staging folder is never committed.

        Safe to call again after being interrupted half-way (an in-process restart raises
        asynchronously into the main thread): each step is re-checked, and the writer
        process is forgotten only once it is dead, so NVRx's `close()`/`__del__` never waits
        on a writer that can no longer answer."""
        self._pending = self._handoff = None
        self._warming_up = False
        if self._snapshot is not None:
            self._snapshot.discard()
        if self._committer is not None:  # local file work only: let it finish, atomic either way
            self._committer.join(timeout=30)
            self._committer = self._committer_error = None
        if self._calls is not None:
            caller = self._calls.persistent_caller
            if caller is not None and caller.process is not None:
                if caller.process.is_alive():
                    caller.process.kill()  # it ignores SIGTERM (lifecycle.children_ignore_sigterm)
                    caller.process.join(timeout=10)
                caller.process = None
            from trainer import nvrx_compat

            nvrx_compat.discard_stale_results()
            self._calls.async_calls.clear()
            self._calls = None
        self._group = None
        if self in _LIVE:
            _LIVE.remove(self)


_LIVE: list[Checkpointer] = []
"""Started checkpointers not yet closed: what `abandon_all` releases before a restart."""


def abandon_all() -> None:
    """Abandon every live checkpointer of this process (the in-process restart's Finalize)."""
    for checkpointer in list(_LIVE):
        checkpointer.abandon()


def _write_then_hash(save_fn: Callable[..., None], staging: str, rank: int, *args: Any) -> None:
    """The NVRx writer's job plus the shard hashes (runs in the background worker)."""
    lifecycle.prepare_background_writer()
    save_fn(*args)
    checkpoint.write_hash_sidecars(staging, rank)


def _wait_then_hash(write: Any, staging: str, rank: int) -> None:
    """torch-async's write plus the shard hashes (runs in a background thread)."""
    write.result()
    checkpoint.write_hash_sidecars(staging, rank)


def efficiency_pct(blocked_s_total: float, wall_s: float) -> float:
    """AWS's definition: 100 - 100 * (time the loop was blocked by checkpointing) / wall time."""
    if wall_s <= 0:
        return 100.0
    return 100.0 - 100.0 * blocked_s_total / wall_s
