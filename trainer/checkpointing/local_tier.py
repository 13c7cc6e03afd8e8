"""The host-state engine: each rank's shards copied to host once, beside forward and
backward, read by the fast checkpoint tier and by durable saves (docs/fault-tolerance.md).

A capture is a host copy of the shards each rank already holds (parameters, optimizer
state, hyper-parameters, scheduler, RNG, step): no collective, no planning. Its interval is
a step count or chosen from a copy budget (`tier_interval`). An in-process restart resumes
from the copy in memory (`tier_slots.CaptureCache`, owned by the resilience layer); a
worker-group restart from the same copy on file, since the copy *is* a mapped slot file
(`tier_slots`). On resume the ranks agree (one all-gather) on the newest step every rank
holds, itself or as a peer's replica (`tier_restore`, `replicas`); it is used only when it
is newer than the latest committed durable checkpoint and belongs to the same run. The
durable checkpoint stays the recovery point for losing the job or a node, and the only
thing validate and register read.

A durable save of the `async` mode writes from the capture of its step, lent to it
(`capture_for_save`, `Lease`); with the tier off (interval 0) the engine captures only
for saves, into one slot, and publishes nothing for recovery.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer import env
from trainer.checkpointing import replicas as peer_copies
from trainer.checkpointing import storage, tier_restore, tier_resume
from trainer.checkpointing import tier_format as fmt
from trainer.checkpointing import tier_slots as slots
from trainer.checkpointing.slot_refs import Lease
from trainer.checkpointing.tier_interval import CaptureInterval
from trainer.config import CheckpointConfig

log = logging.getLogger(__name__)

PREPARE_AHEAD_BYTES = 64 << 20
"""Slots this large or larger are made by the copy thread while the loop goes on (reserving
and, on CUDA, page-locking GBs takes seconds); captures are skipped until both exist.
Smaller ones are made by the first capture into them (milliseconds)."""
forget_run = slots.forget_run  # what the launcher and tests call at a new run's start


class LocalTier:
    """One per attempt and rank. `capture()` after an optimizer step; `restore()` at start.
    `identity`: what a capture must match besides the run (the model, its adapters); the
    world size and the mesh's layout are added here."""

    def __init__(
        self,
        settings: CheckpointConfig,
        checkpoint_dir: str | Path,
        identity: dict[str, Any],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        cache: slots.CaptureCache | None = None,
    ) -> None:
        # What training changes (a LoRA run's adapters): frozen parameters are the same at
        # every step and are read from the model folder again by every attempt.
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._cuda = bool(self.params and self.params[0].is_cuda)
        self.schedule = CaptureInterval(settings.local_every_steps, self._cuda, self.wait_copy)
        self.key = slots.run_key(checkpoint_dir)
        self.folder = slots.local_folder(settings.local_dir, checkpoint_dir)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.rank = dist.get_rank()
        # What survives an in-process restart; a new cache is what a new process has.
        self.cache = cache if cache is not None else slots.CaptureCache()
        self._slots: list[slots.Slot | None] = [None, None]
        # The next capture's slot: not the newest capture's (0 when there is none).
        self.next_slot = int(self.cache.newest(self.key)[0] == 0)
        self._held: int | None = None  # the slot a durable save writes from (`capture_for_save`)
        self._lock = threading.Lock()
        # CUDA: the side stream of the copies.
        self._stream: Any = torch.cuda.Stream(device=self.params[0].device) if self._cuda else None
        # The copy thread (started by the first job): captures, and large slots made ahead.
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rtp-local-copy")
        self._copy: Future[None] | None = None
        self._preparing: Future[None] | None = None  # large slots made ahead (`_slots_ready`)
        self._copied = threading.Event()  # the loop may change the weights again
        self._cuda_copied: Any = None  # CUDA: the event after the newest capture's copies
        self._cuda_copy_began: Any = None  # CUDA: the event before them (to time the transfer)
        self._plan: slots.Plan | None = None
        self.captures = self.write_errors = 0
        self.host_bytes = 0  # what its slots held at most
        self.checksum_s = 0.0  # spent checksumming captures for their files
        self._memory_only_said = False
        world = dist.get_world_size()
        local_world = env.local_world_size(default=world)
        grid = slots.mesh_grid(self.params)  # HSDP's (replicate, shard) grid of ranks
        # What a capture must match too: a capture under another mesh holds other shards.
        layout = [len(grid), len(grid[0])] if grid else [world]
        self.identity = {**identity, "world_size": world, "layout": layout}
        self.twins = tier_restore.twins_of(grid or [])  # HSDP: who holds this rank's state too
        self.sends_to, self.holds_for = peer_copies.peers(
            self.rank, world, local_world, settings.local_replicas if self.enabled else 0
        )
        self.listen_host = peer_copies.listen_host(world, local_world) if self.holds_for else ""
        self.receiver: peer_copies.ReplicaReceiver | None = None
        self.sender = peer_copies.ReplicaSender(self.rank, self._lock, self.slot)
        self.restored_from: dict[int, int] = {}  # after restore(): owner -> the peer it came from

    @property
    def enabled(self) -> bool:
        return self.schedule.interval > 0

    # ---- capture ---------------------------------------------------------------------

    def capture(self, step: int, durable_step: int) -> bool:
        """Copy this rank's state after step `step` if it is a capture step; `durable_step`:
        the newest durable checkpoint step this attempt knows of. Not collective, except at
        the one step of an attempt where the ranks agree on a budget's interval (every rank
        calls it at every step)."""
        return self.enabled and self.schedule.maybe_capture(step, lambda: self._capture(step, durable_step))

    def capture_for_save(self, step: int, durable_step: int) -> Lease | None:
        """Capture step `step` (a durable save's) whatever the interval, also with the tier
        off, and lend the slot to that save: it is not overwritten until the lease is
        released, so the save writes from it without another copy of the state. None only
        while an earlier save still holds a slot."""
        with self._lock:
            if self._held is not None:
                return None
        if not self.schedule.maybe_capture(
            step, lambda: self._capture(step, durable_step, hold=True), force=True
        ):
            raise RuntimeError(f"the host capture of step {step} for its checkpoint was not taken")
        # Set by that capture; only this lease releases it.
        assert self._held is not None and self._copy is not None
        return Lease(self, self._held, self._copy)

    def slot(self, index: int) -> slots.Slot | None:
        """The mapping of slot `index` (None until made)."""
        return self._slots[index]

    def release_slot(self, slot: int) -> None:
        with self._lock:
            if self._held == slot:
                self._held = None

    def _capture(self, step: int, durable_step: int, hold: bool = False) -> bool:
        """Queue the copy of this rank's state after step `step` (False: skipped). `hold`:
        the slot stays the save's until `release_slot`."""
        with self._lock:
            slot = self.next_slot if self.enabled else 0  # saves only: one slot is enough
            if self._held == slot:  # a save still writes from it: overwrite the newer one
                slot = 1 - slot
            if self.sender.reading(slot):  # the sender still reads this slot: skip one
                if not hold:
                    return False
                slot = 1 - slot  # a save's capture is not skipped: the newer one goes
                self.sender.reading(slot)
            if hold:
                self._held = slot
        # What changes outside the optimizer step is taken now; the shards are copied
        # beside the next step's forward and backward (they change only in its optimizer
        # step, which `before_optimizer_step()` holds until the copy is complete).
        meta = self._meta(step, durable_step)
        # CUDA: the copies must see the finished step.
        step_done = torch.cuda.current_stream().record_event() if self._cuda else None
        self.wait_copy()  # the previous capture's header is written (it runs in the same thread)
        # The walk over the state runs here, between steps: in the copy thread it would
        # compete with the training thread for the interpreter lock.
        plan = self._plan_for(meta)
        if not self._slots_ready(plan, wait=hold):
            self.next_slot = slot  # not taken (never a save's: `wait`): the next capture fills it
            return False
        self.next_slot = 1 - slot
        self._copied.clear()
        self._copy = self._copier.submit(self._capture_into, slot, meta, plan, step_done)
        return True

    def prepare_for_saves(self) -> None:
        """Not collective, after the first optimizer step: with the tier off, the slot the
        saves are captured into is made ahead, while training goes on."""
        if not self.enabled and self.params:
            self._slots_ready(self._plan_for(self._meta(0, 0)), wait=False)

    def wait_prepared(self, timeout: float | None = None) -> None:
        """Wait for the large slots being made ahead, if any (raises what failed)."""
        if (preparing := self._preparing) is not None:
            preparing.result(timeout)

    def _meta(self, step: int, durable_step: int) -> dict[str, Any]:
        meta = {
            "step": step,
            "durable_step": durable_step,
            "identity": dict(self.identity),
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
            "scheduler": self.scheduler.state_dict(),
        }
        return storage.rank_state(meta)  # with the RNG states

    def _slots_ready(self, plan: slots.Plan, wait: bool) -> bool:
        """Whether a capture of `plan` may be queued now: its slot is made by the capture
        itself when small; large slots (`PREPARE_AHEAD_BYTES`) are prepared ahead by the
        copy thread, and captures wait (skipped, the loop does not) until then, except a
        save's (`wait`). The loop would otherwise wait for the reservation in
        `before_optimizer_step()`: seconds for 12 GB slots, more with page-locking."""
        if plan.size < PREPARE_AHEAD_BYTES:
            return True
        if self._preparing is not None and not self._preparing.done():
            return wait  # a save's capture queues behind it (one copy thread)
        self.wait_prepared()  # done: raises what failed in the thread
        if all(s is not None and s.layout == plan.layout for s in self._slots[: 2 if self.enabled else 1]):
            return True
        self._preparing = self._copier.submit(self._prepare_slots, plan)
        return wait

    def _prepare_slots(self, plan: slots.Plan) -> None:
        """The copy thread: map both slots for `plan` without touching what they hold (an
        earlier attempt's capture and its header stay usable until the slot is overwritten:
        its headers are removed then, see `_slot_for`)."""
        for slot in range(2 if self.enabled else 1):
            if slot != self._held:  # the slot a save reads is remapped once released
                self._map_slot(slot, plan)

    def _capture_into(self, slot: int, meta: dict[str, Any], plan: slots.Plan, step_done: Any) -> None:
        """The copy thread: copy the state into `slot`, then write its header."""
        # The meta with each of its tensors replaced by its index in the slot.
        dynamic = {**meta, **{k: {fmt.TENSOR_KEY: i} for k, i in plan.dynamic_index.items()}}
        try:
            self.cache.drop(self.key, slot)  # only after a failed capture: about to be overwritten
            target = self._slot_for(slot, plan)
            sources = [*plan.sources, *(meta[k] for k in plan.dynamic_index)]
            began = time.perf_counter()
            self._copy_into(target, sources, step_done)
            copy_s = time.perf_counter() - began
        finally:
            self._copied.set()  # also on failure: the loop must never wait forever
        if self._cuda_copied is not None:
            self._cuda_copied.synchronize()
            copy_s = self._cuda_copy_began.elapsed_time(self._cuda_copied) / 1e3  # the transfer itself
        if target.path is not None and self.enabled:  # a file other processes may read: checked when read
            began = time.perf_counter()
            sums = fmt.checksums(target.data)
            self.checksum_s += time.perf_counter() - began
            copy_s += time.perf_counter() - began  # part of what a capture costs
            try:
                target.head = self._write_head(slot, plan, {**dynamic, "checksums": sums})
                target.step = int(meta["step"])
            except OSError as exc:  # a full /dev/shm must not stop training
                self.write_errors += 1
                if self.write_errors == 1:
                    log.warning("fast checkpoint tier: cannot write to %s: %s", self.folder, exc)
        if self.schedule.measuring:
            self.schedule.copy_seconds.append(copy_s)
        if self.enabled:  # complete: what an in-process restart resumes from
            if target.filled is None:
                target.filled = fmt.fill(plan.skeleton, target.tensors)
            self.cache.put(self.key, {**fmt.fill(dynamic, target.tensors), **target.filled}, slot)
        with self._lock:
            self.captures += 1
            if target.head is not None and self.sends_to:
                self.sender.queue(slot)

    def _plan_for(self, meta: dict[str, Any]) -> slots.Plan:
        plan, reusable = slots.plan_state(self.params, self.optimizer, meta, self._plan)
        self._plan = plan if reusable else None  # one that is not is made again at every capture
        return plan

    def _slot_for(self, slot: int, plan: slots.Plan) -> slots.Slot:
        """The slot's mapping, made (again) when the state's layout is new, without the
        headers of what it held (an earlier attempt's too): it is overwritten from here on."""
        current = self._map_slot(slot, plan)
        if current.plan is not plan:
            current.plan, current.filled = plan, None
        self._drop_heads(slot)
        current.head = current.step = None
        return current

    def _drop_heads(self, slot: int) -> None:
        """Remove every header of `slot` in the folder (an earlier attempt's too)."""
        for step, held in slots.own_heads(self.folder, self.rank):
            if held == slot:
                (self.folder / slots.head_name(self.rank, step, slot)).unlink(missing_ok=True)

    def _map_slot(self, slot: int, plan: slots.Plan) -> slots.Slot:
        """`slot`'s mapping for `plan`, mapped (and on CUDA page-locked) again when the
        layout is new, its content unchanged: a header of this slot still names what it
        holds until it is overwritten (`_slot_for`), except when its size changes."""
        current = self._slots[slot]
        if current is not None and current.layout == plan.layout:
            return current
        path = self.folder / slots.slot_name(self.rank, slot)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            if path.exists() and path.stat().st_size != plan.size:
                # Resizing it invalidates what it held (and a mapping of it still in use).
                self.cache.drop(self.key, slot)
                self._drop_heads(slot)
            made = slots.Slot(path, plan.layout, plan.size)
        except OSError as exc:  # no room for the file: keep the copy in memory only
            path.unlink(missing_ok=True)
            if not self._memory_only_said:
                self._memory_only_said = True
                log.warning(
                    "fast checkpoint tier: cannot make %s (%s): it needs %s for two slots of "
                    "this rank's state, %s free there. The captures stay in this process's "
                    "memory: an in-process restart still resumes from them, a restart of the "
                    "rank's processes resumes from the durable checkpoint instead. Give the "
                    "pod a larger /dev/shm (emptyDir, medium Memory, sizeLimit), or set "
                    "checkpoint.local_dir to a larger node-local folder.",
                    path,
                    exc.strerror or exc,
                    slots.gib(2 * plan.size),
                    slots.gib(slots.free_bytes(self.folder)),
                )
            made = slots.Slot(None, plan.layout, plan.size)
        if self._cuda:
            made.pin()
        self._slots[slot] = made
        self.host_bytes = max(self.host_bytes, sum(s.size for s in self._slots if s is not None))
        return made

    def _copy_into(self, target: slots.Slot, sources: list[torch.Tensor], step_done: Any) -> None:
        """CPU: copy here. CUDA: queue the copies on a side stream after `step_done` (into
        page-locked memory they do not block this thread); the optimizer step waits for
        them on the GPU, the header waits for them here."""
        # One call for all tensors: this thread takes the interpreter lock back once, not
        # once per tensor (each time waiting for the training thread to let it go).
        with torch.no_grad():
            if step_done is None:
                torch._foreach_copy_(target.tensors, sources)
                return
            with torch.cuda.device(self.params[0].device), torch.cuda.stream(self._stream):
                self._stream.wait_event(step_done)
                self._cuda_copy_began = self._stream.record_event(torch.cuda.Event(enable_timing=True))
                torch._foreach_copy_(target.tensors, sources, non_blocking=True)
                self._cuda_copied = self._stream.record_event(torch.cuda.Event(enable_timing=True))

    def _write_head(self, slot: int, plan: slots.Plan, dynamic: dict[str, Any]) -> Path:
        final = self.folder / slots.head_name(self.rank, int(dynamic["step"]), slot)
        temporary = final.with_name(f".{final.name}.tmp")
        temporary.write_bytes(fmt.header_bytes(plan.static, dynamic))
        os.replace(temporary, final)
        return final

    def wait_copy(self) -> None:
        """Wait for the last `capture()`'s thread to finish (its header written; raises what failed)."""
        copy, self._copy = self._copy, None
        if copy is not None:
            copy.result()

    def before_optimizer_step(self) -> float:
        """The optimizer must not change the weights before the copies read them: on CPU
        wait for the copy, on CUDA make the compute stream wait on the copy stream (the host
        waits only for the copies to be queued). Returns the seconds the loop waited."""
        if self._copy is None:
            return 0.0
        started = time.perf_counter()
        self._copied.wait()
        if self._cuda_copied is not None:
            torch.cuda.current_stream().wait_event(self._cuda_copied)
        if self._copy.done():
            self.wait_copy()  # raises what failed in the thread
        return time.perf_counter() - started

    def close(self, discard: bool = False, flush: bool = True) -> None:
        """Stop the threads (not collective); the newest capture's header is written either
        way, and its copy is sent to the peers unless `flush` is off (an in-process restart:
        the copy in memory is what it resumes from). `discard`: the attempt ended with a
        committed durable checkpoint of its last step, so this rank's copies are of no
        further use: free the memory and /dev/shm they hold."""
        with contextlib.suppress(Exception):
            self.wait_copy()
        self._copier.shutdown(wait=True)  # safe to repeat
        self.sender.close(flush=flush and not discard)
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
        if discard or not self.enabled:  # saves only: nothing to recover from
            self.cache.drop(self.key)
            self._slots = [None, None]
            # This rank's files and the replicas it holds; the last rank out removes the folder.
            slots.forget_rank(self.folder, self.rank)
            with contextlib.suppress(OSError):
                self.folder.rmdir()

    # ---- restore -------------------------------------------------------------------

    restore = tier_resume.restore
    """`restore(durable_step)`, collective: if every rank's state after the same step newer
    than `durable_step` is held (by the rank itself, or as a peer's replica), load the newest
    such into model, optimizer, scheduler and RNG and return its step; else None (load the
    durable checkpoint). Also starts this attempt's replica receiver and learns its peers'."""
