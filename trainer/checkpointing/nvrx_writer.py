"""The `async` checkpoint mode: NVRx's persistent writer process, one per rank.

NVRx 0.4.1's persistent writer process with the DCP plan / background write / finalize
split of `FileSystemWriterAsync`. A save writes the host capture of its step, lent by the
host-state engine (`PendingSave.lend`); its tensors reach the worker as references into
the slot file (`slot_refs`). The writer's planner thread waits for the capture, plans the
write and sends it to the worker while the next step's forward and backward run;
`wait("staged")`, before every `optimizer.step()`, waits for the planner if it is
still running and then queues the save's *finish* behind it. The finish waits for the
worker to report the write done, gathers every rank's write results over the writer's own
gloo group (NVRx's finalize, with the request numbers compared), and on rank 0 writes
DCP's metadata and commits; `wait("step")` only looks whether it ended, and reports the
commit from the loop. The next save or `wait("committed")` joins it.

NVRx's own finalizing (`AsyncCallsQueue.maybe_finalize_async_calls`) runs collectives on
the loop at every step; it is not used, not even for the start-up warm-up, whose write is
waited for by the planner thread, and agreed on at a save (docs/checkpointing.md). What
0.4.1 needs on a CPU build lives in `nvrx_compat`.

The attempt's last save (its last step, or a stop was requested) has no step to hide a
background write behind: `wait("committed")` writes it in this process as a `sync` save is
written (`CheckpointWriter._write_now`, over the writer's group), with the same shard hashes and
commit, and without the hand-offs to other threads and processes.
"""

from __future__ import annotations

import queue
import shutil
import threading
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing
from nvidia_resiliency_ext.checkpointing.async_ckpt import core
from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync
from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import (
    CheckpointMetadataCache,
    save_state_dict_async_plan,
)
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.utils import _get_failure_dict

from trainer import lifecycle, peer_abort, waiting
from trainer.checkpointing import nvrx_compat, slot_refs, storage
from trainer.checkpointing.writer import CheckpointWriter, Outcome, PendingSave, Until

# Imported only when `checkpoint.mode` is async (`manager.WRITERS`): the other modes never import NVRx.


class NvrxAsyncWriter(CheckpointWriter):
    """`async`: returns from `save()` once the save's planning is queued."""

    mode = "async"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: PendingSave | None = None  # not committed yet
        # What completes `_pending`'s hand-off (`_queue_finish`, or `_write_last`), until it ran.
        self._handoff: Callable[[], None] | None = None
        self._calls: Any = None
        self._group: Any = None
        self._planner: Planner | None = None
        self._finished: Future[None] | None = None  # the pending save's finish (`_finish`)
        self._plan_cache = CheckpointMetadataCache()
        self._abandoned = threading.Event()  # tells a finish to stop waiting
        self._commit_lock = threading.Lock()  # abandoned, or committing: never both
        self._committing = False
        self._warm_up: Future[None] | None = None  # this rank's warm-up write (`nvrx_compat.warm_up`)

    def open(self, background: bool) -> None:

        # What is not a slot reference travels by shared-memory file name, not descriptor.
        torch.multiprocessing.set_sharing_strategy("file_system")
        # Save planning gathers plans from all ranks, and runs in the planner thread
        # while the loop runs collectives of its own: a group of its own keeps them apart.
        with peer_abort.tracking():  # an in-process restart shuts its connections down
            self._group = dist.new_group(backend="gloo")
        self._planner = Planner()
        with lifecycle.children_ignore_sigterm():  # the results Manager starts here too
            self._calls = nvrx_compat.new_calls_queue()
            written = nvrx_compat.warm_up(self._calls, self.root / ".warm-up", self._group)
        # The planner is idle until the first save, which waits for the warm-up first.
        self._warm_up = self._planner.submit(partial(written, self._abandoned))
        self.warming_up = True
        if not background:
            self._finish_warm_up()

    def save(self, state: dict[str, Any], pending: PendingSave) -> Outcome:
        if self.warming_up and pending.deferrable:
            # Collective (while warming up, at a save only): ready when every rank's warm-up is written.
            done = torch.tensor([int(self._warm_up is not None and self._warm_up.done())])
            waiting.wait_polled(dist.all_reduce(done, dist.ReduceOp.MIN, group=self._group, async_op=True))
            if done.item():
                self._finish_warm_up()
        return super().save(state, pending)

    def _write(self, state: dict[str, Any], pending: PendingSave) -> None:
        """Queue the save's planning: the planner thread waits for the lent capture, plans
        the write over it and sends it to the writer process, while the loop is still in
        forward and backward; the loop registers it for finalizing in `_hand_off()`, before
        the next optimizer step. Planning runs collectives (the first two saves gather
        plans from all ranks; later ones reuse NVRx's cached plan) over the writer's own
        gloo group, never the loop's.

        The attempt's last save (`pending.last`) is only remembered: `wait("committed")`
        writes it."""
        if pending.last:
            # No optimizer step is to follow: the hand-off writes it, before one could.
            self._handoff = partial(self._write_last, state, pending)
            pending.queued_at = time.perf_counter()
        else:
            pending.lend()
            if pending.lease is None or self._planner is None:
                raise RuntimeError("an async save needs the host capture of its step (PendingSave.lend)")
            writer = FileSystemWriterAsync(str(pending.staging))
            call_idx = nvrx_compat.number_request(self._calls)
            # The group is bound now: an in-process restart's `_abandon` drops `self._group` while
            # the planner may still run, and a plan on no group would run on the training group.
            job = partial(self._plan_and_send, writer, pending, call_idx, state, self._group)
            self._handoff = partial(self._queue_finish, pending, self._planner.submit(job))
        self._pending = pending
        pending.record.blocked_s = time.perf_counter() - pending.started_at

    def _plan_and_send(
        self, writer: Any, pending: PendingSave, call_idx: int, state: dict[str, Any], group: Any
    ) -> Callable[[], None]:
        """The planner thread: plan the write over the complete capture and send it to the
        writer process; returns what finishes it (`_finish`, queued at the hand-off).

        This is the first half of NVRx's `AsyncCallsQueue.schedule_async_request` (number,
        freeze, send to the persistent worker); the finalize half is `_finish`."""

        assert pending.lease is not None
        snapshot = pending.lease.state_over(state)
        if self._abandoned.is_set():
            raise storage.CheckpointError(f"the save of step {pending.record.step} was abandoned")
        # The staging folder and this rank's RNG/loader file: a barrier over the writer's group.
        storage.prepare_staging(self.root, pending.record.step, pending.rank_state, group=group)
        pending.during_write()
        writer, metadata, dist_wrapper = save_state_dict_async_plan(
            snapshot, writer, process_group=group, enable_cache=True, metadata_cache=self._plan_cache
        )
        save_fn, _preload_fn, save_args = writer.get_save_function_and_args()
        if save_args and pending.lease.serving is not None:
            # The lent slot's tensors travel as references into its file: no copy on the way.
            save_args = list(save_args)  # a copy
            save_args[1] = slot_refs.by_reference(save_args[1], pending.lease.serving)
        write = partial(nvrx_compat.write_then_hash, save_fn, str(pending.staging), dist.get_rank())
        # The capture already is the device-to-host copy; NVRx's preload would copy
        # again and make the loop wait for the worker to do it.
        request = core.AsyncRequest(
            write if save_fn else None, save_args, [], preload_fn=None, call_idx=call_idx
        )
        nvrx_compat.send(self._calls, request.freeze())
        pending.queued_at = time.perf_counter()
        return partial(self._finish, writer, metadata, dist_wrapper, pending, call_idx, save_fn is not None)

    def wait(self, until: Until) -> None:
        """At "staged", a save captured and planned while forward and backward ran is handed
        off (waiting for the planner if needed) and reported queued; at "step" (cheap, without
        collectives), a save whose finish ended is reported committed (the ranks may learn of
        it a step apart; each commit is reported once per rank)."""
        pending = self._pending
        if until == "committed":
            if self.warming_up:
                self._finish_warm_up()
            self._hand_off()  # no optimizer step follows (the last save, or the loop's last step)
            self._join_finish()
        elif until == "staged" and pending is not None and self._handoff is not None:
            with self.keepalive():  # may wait for a capture of the whole state
                started = time.perf_counter()
                self._hand_off()
                pending.record.blocked_s += time.perf_counter() - started
            self.on_queued(pending.record)
        elif until == "step" and pending is not None and self._finished is not None and self._finished.done():
            started = time.perf_counter()
            self._join_finish()
            pending.record.blocked_s += time.perf_counter() - started
        if until == "step":  # the state's layout is known after the first step: once
            self.prepare_captures()
            self.prepare_captures = lambda: None

    def _hand_off(self) -> None:
        hand_off, self._handoff = self._handoff, None
        if hand_off is not None:
            hand_off()

    def _queue_finish(self, pending: PendingSave, planned: Future[Callable[[], None]]) -> None:
        """The hand-off of a planned save: its finish queued on the planner thread."""
        try:
            finish = waiting.result(planned)  # planned and sent
        except Exception as exc:
            _release(pending)
            raise storage.CheckpointError(
                f"planning the checkpoint of step {pending.record.step} failed: {exc}"
            ) from exc
        assert self._finished is None and self._planner is not None  # the previous save committed first
        self._finished = self._planner.submit(finish)  # the next save's planning queues behind it

    def _finish(
        self, writer: Any, metadata: Any, dist_wrapper: Any, pending: PendingSave, call_idx: int, sent: bool
    ) -> None:
        """The planner thread, after the loop's hand-off, on every rank: wait for this rank's
        write, gather all ranks' write results over the writer's group (the request numbers
        must match), then rank 0 writes DCP's `.metadata` and commits (fsyncs, manifest,
        rename, retention). The loop learns of the commit in `wait("step")` or
        `wait("committed")`."""
        try:
            if sent and not nvrx_compat.wait_for_write(self._calls, call_idx, self._abandoned):
                return  # abandoned
        finally:
            # This rank's files are written (or never will be): the tier may overwrite the slot.
            _release(pending)
        gathered = dist_wrapper.gather_object((call_idx, writer.retrieve_write_results()))
        if not dist_wrapper.is_coordinator:
            return
        if (numbers := {number for number, _ in gathered}) != {call_idx}:
            raise RuntimeError(
                f"ranks finished different checkpoint requests ({sorted(numbers)}): "
                "every rank must save at the same steps"
            )
        all_results = [results for _, results in gathered]
        if failures := _get_failure_dict(all_results):
            raise CheckpointException("write", failures)
        with self._commit_lock:
            if self._abandoned.is_set():
                return
            self._committing = True
        writer.finish(metadata, all_results)  # DCP's .metadata: the checkpoint is readable
        storage.commit_files(pending.staging, pending.final, pending.record.step, pending.meta)
        pending.record.bytes_total = storage.checkpoint_bytes(pending.final)
        self._retain()

    def _join_finish(self) -> None:
        """Wait for the pending save's finish (on every rank: it ended in the same gather) and
        report the save committed, from the loop."""
        finished, self._finished = self._finished, None
        if finished is None:
            return
        pending, self._pending = self._pending, None
        assert pending is not None
        try:
            waiting.result(finished)  # may wait minutes for the previous write
        except Exception as exc:
            raise storage.CheckpointError(f"finishing a checkpoint failed: {exc}") from exc
        pending.record.write_s = time.perf_counter() - pending.queued_at
        self.on_commit(pending.record)

    def _finish_warm_up(self) -> None:
        """Collective: this rank's warm-up write, then every rank's; the scratch folder goes."""
        assert self._warm_up is not None
        with self.keepalive():  # the worker's start may take seconds on a busy node
            waiting.result(self._warm_up)
        waiting.barrier(self._group)
        self.warming_up, self._warm_up = False, None
        if dist.get_rank() == 0:
            shutil.rmtree(self.root / ".warm-up", ignore_errors=True)

    def _write_last(self, state: dict[str, Any], pending: PendingSave) -> None:
        """Collective: write the attempt's last save here, as a `sync` save is written (DCP,
        each shard hashed as written) but over the writer's group, and commit it. Any earlier
        save was committed before this one started (`CheckpointWriter.save`), and the state
        is the live one: nothing changed it since `save()`."""

        self._pending = None
        assert self._finished is None
        self._write_now(state, pending, self._group, loop_waits=False)

    def close(self, commit: bool = True) -> None:
        """Also stops the planner thread and the writer process.

        Without `commit` (`_abandon`), safe to call again after being interrupted half-way (an
        in-process restart raises asynchronously into the main thread): each step is re-checked,
        and the writer process is forgotten only once it is dead, so NVRx's `close()`/`__del__`
        never waits on a writer that can no longer answer."""
        if commit:
            super().close()
        else:
            self._abandon()
        if self._planner is not None:
            # Without `commit`, a planning still running ends on its own (a gather fails once the
            # peers' connections go).
            self._planner.close()
            self._planner = None
        if self._calls is not None:
            if commit:
                self._calls.close()
            else:  # results it may have posted stay in this attempt's queue (`nvrx_compat`, 5)
                nvrx_compat.forget(self._calls)
            self._calls = None
        if commit and self._group is not None:
            dist.destroy_process_group(self._group)
        self._group = None  # without `commit`, it is gone with the default group

    def _abandon(self) -> None:
        """The staging folder is never committed."""
        _release(self._pending)  # the save handed off, or still to be
        self._pending = self._handoff = None
        self.warming_up, self._warm_up = False, None
        with self._commit_lock:
            self._abandoned.set()
            committing = self._committing
        if self._finished is not None:
            # Waiting for the write, the finish stops within 50 ms; in the writer group's gather
            # it may wait for a peer's write, and ends when the peers' connections go down (the
            # restart's abort) or the gather completes, and an abandoned save is never
            # committed: the restart does not wait for it. A commit already in progress (rank 0, local file work,
            # atomic either way) is waited for: its retention must not delete a checkpoint
            # under the next attempt's resume.
            if committing:
                futures.wait([self._finished], timeout=30)
            self._finished = None


def _release(pending: PendingSave | None) -> None:
    if pending is not None and pending.lease is not None:
        pending.lease.release()


class Planner:
    """One daemon thread running the saves' planning in order: one started per save would
    make the loop wait for the interpreter lock it takes; a daemon, for a rank dying
    mid-plan must not be kept alive by it."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="rtp-ckpt-plan", daemon=True).start()

    def submit(self, job: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        self._jobs.put((job, future))
        return future

    def close(self) -> None:
        self._jobs.put(None)

    def _serve(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, future = item
            try:
                future.set_result(job())
            except BaseException as exc:  # raised where the future is waited for
                future.set_exception(exc)
