"""The fast checkpoint tier: each rank's own shard of the training state, every few steps,
in process memory and in a node-local folder.

The durable DCP checkpoint on the shared volume is written every `checkpoint.every_steps`
steps; without it, a fault throws away every step since. The fast tier keeps, every
`checkpoint.local_every_steps` steps, a copy of what this rank needs to continue exactly:
its local shards of the parameters and of the optimizer state, the optimizer's
hyper-parameters, the scheduler, the RNG state and the step. It is a host copy of the
shards each rank already holds (no collective, no planning), so it costs a memory copy
per capture. The interval is a step count, or chosen from a copy budget (`budget`, and
`auto` on CUDA, where a copy of a 1B model's state is a device-to-host transfer longer than
a step): the ranks time their copies and steps over an attempt's first steps and agree on
the shortest interval whose copies fit `COPY_BUDGET_PCT` of the loop's time. `auto` on CPU
copies every step.

- An **in-process restart** (the process lives on) resumes from the copy in memory.
- A **worker-group restart** (ft_launcher, after a rank was killed) resumes from the same
  copy on file: the copy *is* a file. Each rank has two slot files in `checkpoint.local_dir`
  (node-local: /dev/shm by default, which survives the processes but not the node), mapped
  into its memory; a capture copies the shards straight into the older slot and then writes
  a small header file that names the slot and describes the capture. The header of a slot
  is removed before the slot is overwritten, so a rank killed while copying leaves the
  other slot's capture, which still has its header.

A capture copies straight into a mapped slot: the state's bytes move once per step, with no
file thread beside the loop and the durable writer (docs/fault-tolerance.md).

On resume the ranks agree (one all-gather) on the newest step every rank holds; it is used
only when it is newer than the latest committed durable checkpoint, belongs to the same
run (same checkpoint folder, model and world size) and was taken after that checkpoint's
step. Otherwise the durable checkpoint is loaded, as before. The durable checkpoint stays
the recovery point for losing the whole job or a node, and the only thing validate and
register read. A header file followed by its slot's bytes is the single-file format of
`tier_format.write_snapshot_file` (raw tensor bytes after a header read with
`torch.load(weights_only=True)`): what replicas are sent as and what `read_snapshot_bytes` reads.

- A rank whose **node is gone** (a pod rescheduled elsewhere, /dev/shm empty) resumes
  from a peer's replica when `checkpoint.local_replicas` is set: every capture is also sent to
  ranks on other nodes (trainer/checkpointing/replicas.py). NVRx's LocalCheckpointManager
  replicates too, but needs CUDA tensors in 0.4.1.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import operator
import os
import re
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.checkpointing import replicas as peer_copies
from trainer.checkpointing import tier_format as fmt
from trainer.checkpointing import tier_restore
from trainer.checkpointing.tier_interval import CaptureInterval

log = logging.getLogger(__name__)

_HEAD = re.compile(r"^rank_(\d+)_step_(\d+)_slot_([01])\.head$")
"""A capture's header: its rank, step and slot."""
_SLOT = re.compile(r"^rank_(\d+)_slot_[01]\.data$")
PREPARE_AHEAD_BYTES = 64 << 20
"""Slots this large or larger are made by the copy thread while the loop goes on (reserving
and, on CUDA, page-locking GBs takes seconds); captures are skipped until both exist.
Smaller ones are made by the first capture into them (milliseconds)."""
_memory: dict[str, dict[str, Any]] = {}
"""Per run key: this process's newest capture (survives an in-process restart)."""
_newest_slot: dict[str, int] = {}
"""Per run key: the slot `_memory`'s capture lives in (the next attempt fills the other)."""


def head_name(rank: int, step: int, slot: int) -> str:
    return f"rank_{rank}_step_{step}_slot_{slot}.head"


def slot_name(rank: int, slot: int) -> str:
    return f"rank_{rank}_slot_{slot}.data"


def default_local_root() -> Path:
    """Node-local and memory-backed where there is one (a pod's /dev/shm)."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / "rtp-local"
    import tempfile

    return Path(tempfile.gettempdir()) / "rtp-local"


def run_key(checkpoint_dir: str | Path) -> str:
    """One run's name in the local folder: its checkpoint folder, hashed."""
    return hashlib.sha256(str(Path(checkpoint_dir).resolve()).encode()).hexdigest()[:16]


def local_folder(local_dir: str, checkpoint_dir: str | Path) -> Path:
    return (Path(local_dir) if local_dir else default_local_root()) / run_key(checkpoint_dir)


def forget_run(local_dir: str, checkpoint_dir: str | Path) -> None:
    """A new run starts in this checkpoint folder: drop the fast tier of the previous one."""
    import shutil

    shutil.rmtree(local_folder(local_dir, checkpoint_dir), ignore_errors=True)
    _memory.pop(run_key(checkpoint_dir), None)
    _newest_slot.pop(run_key(checkpoint_dir), None)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself, not `to_local()`'s autograd view: this
    runs for every tensor at every capture, off the training thread), else the tensor."""
    from torch.distributed.tensor import DTensor

    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


@dataclass(slots=True)
class _Plan:
    """One layout of the state: the shards to copy, the skeleton over their indices, where
    the meta's tensors (new objects at every capture) go, and the header's static section
    (written once per layout)."""

    sources: list[torch.Tensor]
    skeleton: dict[str, Any]
    dynamic_index: dict[str, int]
    layout: list[tuple[str, list[int], int, int]]
    size: int
    static: bytes


class _Slot:
    """One slot: the capture's tensors, views into a mapped slot file (or, when the file
    cannot be made, into process memory: in-process restarts still work)."""

    def __init__(self, path: Path | None, layout: list[tuple[str, list[int], int, int]], size: int) -> None:
        self.path = path
        self.layout = layout
        self.size = size
        self.head: Path | None = None  # the header of the capture it holds, if written
        self.step: int | None = None
        self.plan: _Plan | None = None
        self.filled: Any = None  # the plan's skeleton over this slot's tensors
        self.stale_heads = False  # headers of what it held before may still name it
        data: Any
        if path is None:
            data = bytearray(max(size, 1))
        else:
            with path.open("a+b") as handle:
                handle.truncate(size)
                if size:
                    # Reserve the pages now: a full tmpfs makes this fail with ENOSPC here,
                    # instead of a SIGBUS at the first write into the mapping.
                    os.posix_fallocate(handle.fileno(), 0, size)
                data = mmap.mmap(handle.fileno(), max(size, 1), mmap.MAP_SHARED) if size else bytearray(1)
        self.data = data
        self.tensors = [fmt.view(data, dtype, shape, place, nbytes) for dtype, shape, place, nbytes in layout]

    def pin(self) -> None:
        """Page-lock the mapping, so that device-to-host copies into it are asynchronous."""
        import ctypes

        from trainer.checkpointing.snapshot import pin_host_range

        if self.size:
            pin_host_range(self, ctypes.addressof(ctypes.c_char.from_buffer(self.data)), self.size)


class LocalTier:
    """One per attempt and rank. `capture()` after an optimizer step; `restore()` at start."""

    def __init__(
        self,
        *,
        every_steps: int | str,
        local_dir: str,
        checkpoint_dir: str | Path,
        identity: dict[str, Any],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        replicas: int = 0,
        copy_budget_pct: float | None = None,
    ) -> None:
        self.params = list(model.parameters())
        self.schedule = CaptureInterval(
            every_steps, bool(self.params and self.params[0].is_cuda), copy_budget_pct
        )
        self.key = run_key(checkpoint_dir)
        self.folder = local_folder(local_dir, checkpoint_dir)
        self.identity = identity
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.rank = dist.get_rank()
        self._slots: list[_Slot | None] = [None, None]
        self._slot = 1 - _newest_slot.get(self.key, 1)  # the next capture's: not the newest one's
        self._sending: int | None = None  # the slot the sender thread reads
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queued: int | None = None  # the newest capture not yet sent to the peers
        self._closed = False
        self._flush = True
        self._stream: Any = None
        self._copier: ThreadPoolExecutor | None = None
        self._copy: Future[None] | None = None
        self._preparing: Future[None] | None = None  # large slots made ahead (`_slots_ready`)
        self._copied = threading.Event()  # the loop may change the weights again
        self._cuda_copied: Any = None  # CUDA: the event after the newest capture's copies
        self._cuda_copy_began: Any = None  # CUDA: the event before them (to time the transfer)
        self._sender: threading.Thread | None = None
        self._plan: _Plan | None = None
        self.captures = 0
        self.write_errors = 0
        self._memory_only_said = False
        world = dist.get_world_size()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        self.sends_to, self.holds_for = peer_copies.peers(
            self.rank, world, local_world, replicas if self.enabled else 0
        )
        self._listen_host = peer_copies.listen_host(world, local_world) if self.holds_for else ""
        self._receiver: peer_copies.ReplicaReceiver | None = None
        self._holders: dict[int, tuple[str, int]] = {}  # rank -> its receiver's address
        self._token = b""
        self.replicas_sent = 0
        self.replica_errors = 0
        self.restored_from: dict[int, int] = {}  # after restore(): owner -> the peer it came from

    @property
    def enabled(self) -> bool:
        return self.schedule.interval > 0

    @property
    def interval(self) -> int:
        return self.schedule.interval

    @property
    def interval_reason(self) -> str:
        return self.schedule.reason

    @property
    def measured(self) -> dict[str, float]:
        return self.schedule.measured

    def summary(self) -> dict[str, Any]:
        """The summary's fields of the interval: what it is, why, and what it was chosen on."""
        return self.schedule.summary()

    # ---- capture ---------------------------------------------------------------------

    def capture(self, step: int, durable_step: int) -> bool:
        """Copy this rank's state after step `step` if it is a capture step; `durable_step`:
        the newest durable checkpoint step this attempt knows of. Not collective, except at
        the one step of an attempt where the ranks agree on a budget's interval (every rank
        calls it at every step)."""
        if not self.enabled:
            return False
        if self.schedule.measuring:
            return self.schedule.measure(step, lambda: self._capture(step, durable_step), self.wait_copy)
        return step % self.interval == 0 and self._capture(step, durable_step)

    def _capture(self, step: int, durable_step: int) -> bool:
        """Queue the copy of this rank's state after step `step` (False: skipped)."""
        with self._lock:
            slot = self._slot
            if self._sending == slot:  # the sender still reads this slot: skip one
                return False
            self._slot = 1 - slot
        # What changes outside the optimizer step is taken now; the shards are copied
        # beside the next step's forward and backward (they change only in its optimizer
        # step, which `before_optimizer_step()` holds until the copy is complete).
        meta = {
            "step": step,
            "durable_step": durable_step,
            "identity": dict(self.identity),
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
            "scheduler": self.scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            meta["cuda_rng"] = torch.cuda.get_rng_state()
        step_done = None
        if self.params and self.params[0].is_cuda:
            step_done = torch.cuda.Event()  # the copies must see the finished step
            step_done.record()
        if self._copier is None:
            self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rtp-local-copy")
        self.wait_copy()  # the previous capture's header is written (it runs in the same thread)
        # The walk over the state runs here, between steps: in the copy thread it would
        # compete with the training thread for the interpreter lock.
        plan = self._plan_for(meta)
        if not self._slots_ready(plan):
            with self._lock:
                self._slot = slot  # not taken: the next capture fills it
            return False
        self._copied.clear()
        self._copy = self._copier.submit(self._capture_into, slot, meta, plan, step_done)
        return True

    def _slots_ready(self, plan: _Plan) -> bool:
        """Whether a capture of `plan` may be queued now: its slot is made by the capture
        itself when small; large slots (`PREPARE_AHEAD_BYTES`) are prepared ahead, both at
        once, by the copy thread, and captures wait (skipped, the loop does not) until then.
        The loop would otherwise wait for the reservation in `before_optimizer_step()`: two
        12 GB slots at 1B parameters are seconds each, and more with page-locking."""
        if plan.size < PREPARE_AHEAD_BYTES:
            return True
        preparing = self._preparing
        if preparing is not None:
            if not preparing.done():
                return False
            self._preparing = None
            preparing.result()  # raises what failed in the thread
        if all(s is not None and s.layout == plan.layout for s in self._slots):
            return True
        assert self._copier is not None
        self._preparing = self._copier.submit(self._prepare_slots, plan)
        return False

    def _prepare_slots(self, plan: _Plan) -> None:
        """The copy thread: map both slots for `plan` without touching what they hold (an
        earlier attempt's capture and its header stay usable until the slot is overwritten:
        its headers are removed then, see `_slot_for`)."""
        for slot in (0, 1):
            current = self._slots[slot]
            if current is None or current.layout != plan.layout:
                self._slots[slot] = self._make_slot(slot, plan, drop_heads=False)

    def _capture_into(self, slot: int, meta: dict[str, Any], plan: _Plan, step_done: Any) -> None:
        """The copy thread: copy the state into `slot`, then write its header."""
        dynamic = {k: v for k, v in meta.items() if k not in plan.dynamic_index}
        dynamic.update({k: {fmt.TENSOR_KEY: i} for k, i in plan.dynamic_index.items()})
        try:
            with self._lock:
                if _newest_slot.get(self.key) == slot:  # only after a failed capture
                    _memory.pop(self.key, None)  # about to be overwritten: not a copy any more
                    _newest_slot.pop(self.key, None)
            target = self._slot_for(slot, plan)
            if target.head is not None:  # the slot's capture is overwritten from here on
                target.head.unlink(missing_ok=True)
                target.head = target.step = None
            sources = [*plan.sources, *(meta[k] for k in plan.dynamic_index)]
            began = time.perf_counter()
            self._copy_into(target, sources, step_done)
            copy_s = time.perf_counter() - began
        finally:
            self._copied.set()  # also on failure: the loop must never wait forever
        if self._cuda_copied is not None:
            self._cuda_copied.synchronize()
            copy_s = self._cuda_copy_began.elapsed_time(self._cuda_copied) / 1e3  # the transfer itself
        if self.schedule.measuring:
            self.schedule.record_copy(copy_s)
        if target.filled is None:
            target.filled = fmt.fill(plan.skeleton, target.tensors)
        captured = {**fmt.fill(dynamic, target.tensors), **target.filled}
        if target.path is not None:
            try:
                target.head = self._write_head(slot, plan, dynamic)
                target.step = int(meta["step"])
            except OSError as exc:  # a full /dev/shm must not stop training
                self._write_failed(exc)
        with self._lock:
            _memory[self.key] = captured  # complete: what an in-process restart resumes from
            _newest_slot[self.key] = slot
            self.captures += 1
            if target.head is not None and self.sends_to:
                self._queued = slot
                self._wake.notify()
        if self.sends_to:
            self._ensure_sender()

    def _plan_for(self, meta: dict[str, Any]) -> _Plan:
        """What a capture copies: the shards (the same tensor objects at every capture: the
        optimizer updates them in place), then the meta's tensors (the RNG states). The
        previous capture's plan when its shards are still the state's tensors."""
        state = self.optimizer.state
        sources = [_local(p) for p in self.params]
        stable = True
        for p in self.params:
            for value in state.get(p, {}).values():
                if torch.is_tensor(value):
                    sources.append(_local(value))
                else:
                    stable = False  # a plain value in the state: it goes in the skeleton
        plan = self._plan
        if (
            plan is not None
            and stable
            and len(plan.sources) == len(sources)
            and all(map(operator.is_, plan.sources, sources))
        ):
            return plan
        index = iter(range(len(sources)))
        skeleton = {
            "params": [{fmt.TENSOR_KEY: next(index)} for _ in self.params],
            "optim": [
                {
                    k: {fmt.TENSOR_KEY: next(index)} if torch.is_tensor(v) else v
                    for k, v in state.get(p, {}).items()
                }
                for p in self.params
            ],
        }
        names = [k for k, v in meta.items() if torch.is_tensor(v)]
        dynamic_index = {k: len(sources) + i for i, k in enumerate(names)}
        layout = fmt.layout_of([*sources, *(meta[k] for k in names)])
        size = fmt.aligned(layout[-1][2] + layout[-1][3]) if layout else 0
        plan = _Plan(
            sources, skeleton, dynamic_index, layout, size, fmt.static_section(skeleton, layout, size)
        )
        if stable:
            self._plan = plan
        return plan

    def _slot_for(self, slot: int, plan: _Plan) -> _Slot:
        """The slot's mapping, made (again) when the state's layout is new."""
        current = self._slots[slot]
        if current is not None and current.layout == plan.layout:
            if current.plan is not plan:
                current.plan, current.filled = plan, None
            if current.stale_heads:  # prepared ahead: its old headers go before the overwrite
                self._drop_heads(slot)
                current.stale_heads = False
            return current
        made = self._make_slot(slot, plan, drop_heads=True)
        self._slots[slot] = made
        return made

    def _drop_heads(self, slot: int) -> None:
        """Remove every header of `slot` in the folder (an earlier attempt's too)."""
        for name in os.listdir(self.folder):
            match = _HEAD.match(name)
            if match and int(match.group(1)) == self.rank and int(match.group(3)) == slot:
                (self.folder / name).unlink(missing_ok=True)

    def _make_slot(self, slot: int, plan: _Plan, drop_heads: bool) -> _Slot:
        """Map (and on CUDA page-lock) `slot` for `plan`. `drop_heads`: the capture a header
        names must be what the slot holds, so any header of this slot goes before the file
        is touched; else (prepared ahead) that happens before the first overwrite."""
        layout, size = plan.layout, plan.size
        path = self.folder / slot_name(self.rank, slot)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            if drop_heads:
                self._drop_heads(slot)
            elif path.exists() and path.stat().st_size != size:
                # Resizing it invalidates what it held (and a mapping of it still in use).
                with self._lock:
                    if _newest_slot.get(self.key) == slot:
                        _memory.pop(self.key, None)
                        _newest_slot.pop(self.key, None)
                self._drop_heads(slot)
            made = _Slot(path, layout, size)
            made.stale_heads = not drop_heads
        except OSError as exc:  # no room for the file: keep the copy in memory only
            self.write_errors += 1
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
                    _gib(2 * size),
                    _gib(_free_bytes(self.folder)),
                )
            made = _Slot(None, layout, size)
        if self.params and self.params[0].is_cuda:
            made.pin()
        made.plan = plan
        return made

    def _copy_into(self, target: _Slot, sources: list[torch.Tensor], step_done: Any) -> None:
        """CPU: copy here. CUDA: queue the copies on a side stream after `step_done` (into
        page-locked memory they do not block this thread); the optimizer step waits for
        them on the GPU, the header waits for them here."""
        # One call for all tensors: this thread takes the interpreter lock back once, not
        # once per tensor (each time waiting for the training thread to let it go).
        with torch.no_grad():
            if step_done is None:
                torch._foreach_copy_(target.tensors, sources)
                return
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=self.params[0].device)
            with torch.cuda.device(self.params[0].device), torch.cuda.stream(self._stream):
                self._stream.wait_event(step_done)
                began = torch.cuda.Event(enable_timing=True)
                began.record(self._stream)
                torch._foreach_copy_(target.tensors, sources, non_blocking=True)
                copied = torch.cuda.Event(enable_timing=True)
                copied.record(self._stream)
                self._cuda_copy_began, self._cuda_copied = began, copied

    def _write_head(self, slot: int, plan: _Plan, dynamic: dict[str, Any]) -> Path:
        final = self.folder / head_name(self.rank, int(dynamic["step"]), slot)
        temporary = final.with_name(f".{final.name}.tmp")
        temporary.write_bytes(fmt.header_bytes(plan.static, dynamic))
        os.replace(temporary, final)
        return final

    def _write_failed(self, exc: BaseException) -> None:
        self.write_errors += 1
        if self.write_errors == 1:
            log.warning("fast checkpoint tier: cannot write to %s: %s", self.folder, exc)

    def wait_copy(self) -> float:
        """Wait for the last `capture()`'s thread to finish (its header written); returns
        the seconds waited."""
        copy, self._copy = self._copy, None
        if copy is None:
            return 0.0
        started = time.perf_counter()
        copy.result()
        return time.perf_counter() - started

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

    # ---- peer replicas ---------------------------------------------------------------

    def _ensure_sender(self) -> None:
        if self._sender is None:
            self._sender = threading.Thread(target=self._send_loop, name="rtp-local-tier-send", daemon=True)
            self._sender.start()

    def _send_loop(self) -> None:
        while True:
            with self._lock:
                while self._queued is None and not self._closed:
                    self._wake.wait()
                if self._closed and (self._queued is None or not self._flush):
                    return
                slot, self._queued = self._queued, None
                assert slot is not None
                self._sending = slot
                target = self._slots[slot]
            try:
                if target is not None and target.head is not None and target.path is not None:
                    self._send(target)
            finally:
                with self._lock:
                    self._sending = None

    def _send(self, target: _Slot) -> None:
        """The slot's capture, as one file (header, then the slot's bytes), to every holder."""
        assert target.head is not None and target.path is not None and target.step is not None
        for holder in self.sends_to:
            if holder not in self._holders:
                continue
            try:
                peer_copies.send_replica(
                    self._holders[holder], self._token, self.rank, target.step, [target.head, target.path]
                )
                self.replicas_sent += 1
            except (OSError, ValueError) as exc:  # a peer restarting must not stop training
                self.replica_errors += 1
                if self.replica_errors == 1:
                    log.warning("fast checkpoint tier: cannot send a copy to rank %d: %s", holder, exc)

    def close(self, discard: bool = False, flush: bool = True) -> None:
        """Stop the threads (not collective); the newest capture's header is written either
        way, and its copy is sent to the peers unless `flush` is off (an in-process restart:
        the copy in memory is what it resumes from). `discard`: the attempt ended with a
        committed durable checkpoint of its last step, so this rank's copies are of no
        further use: free the memory and /dev/shm they hold."""
        with contextlib.suppress(Exception):
            self.wait_copy()
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None
        with self._lock:
            self._closed = True
            self._flush = flush and not discard
            self._wake.notify()
        if self._sender is not None:
            self._sender.join(timeout=30)
            self._sender = None
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
        if discard:
            _memory.pop(self.key, None)
            _newest_slot.pop(self.key, None)
            self._slots = [None, None]
            self._delete_files()

    def _delete_files(self) -> None:
        """This rank's files and the replicas it holds; the last rank out removes the folder.
        One listing: the other ranks delete theirs at the same time, and the folder may be
        gone by the time this rank looks again."""
        try:
            names = [entry.name for entry in os.scandir(self.folder)]
        except FileNotFoundError:
            return
        for name in names:
            own = _HEAD.match(name) or _SLOT.match(name)
            held = peer_copies.REPLICA_FILE.match(name)
            if (own and int(own.group(1)) == self.rank) or (held and int(held.group(3)) == self.rank):
                (self.folder / name).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.folder.rmdir()

    # ---- restore -------------------------------------------------------------------

    def _candidates(self) -> dict[int, str]:
        """step -> where this rank holds it ("memory" or a header path), matching this run."""
        found: dict[int, str] = {}
        if self.folder.is_dir():
            for path in self.folder.iterdir():
                match = _HEAD.match(path.name)
                if match and int(match.group(1)) == self.rank:
                    found[int(match.group(2))] = str(path)
        memory = _memory.get(self.key)
        if memory is not None and memory["identity"] == self.identity:
            found[int(memory["step"])] = "memory"
        return found

    def restore(self, durable_step: int) -> int | None:
        """Collective: if every rank's state after the same step newer than `durable_step` is
        held (by the rank itself, or as a peer's replica), load the newest such into model,
        optimizer, scheduler and RNG and return its step; else None (load the durable
        checkpoint). Also starts this attempt's replica receiver and learns its peers'."""
        import secrets

        mine = self._candidates() if self.enabled else {}
        held = peer_copies.held_replicas(self.folder, self.rank, self.holds_for)
        if self.holds_for and self._receiver is None:
            self._token = secrets.token_bytes(32) if self.rank == 0 else b""
        info = {
            "own": sorted(mine),
            "held": {owner: sorted(steps) for owner, steps in held.items()},
            "token": self._token,
            "holds": bool(self.holds_for),
        }
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, info)
        self._start_replication(gathered)
        world = len(gathered)
        usable = tier_restore.restorable_steps(gathered, durable_step)
        for step in usable:
            snapshot, problem = self._read(mine[step]) if step in mine else (None, None)
            ok = problem is None and snapshot is not None and self._matches(snapshot, durable_step)
            own_ok: list[Any] = [None] * world
            dist.all_gather_object(own_ok, bool(ok))
            # A rank whose own copy is missing or unreadable takes a peer's replica.
            source: int | None = None
            for owner in range(world):
                peers = tier_restore.replica_holders(gathered, owner, step)
                if own_ok[owner] or not peers:
                    continue
                if self.rank == peers[0]:
                    payload = fmt.read_bytes(held[owner][step])
                    dist.send_object_list([payload], dst=owner)
                elif self.rank == owner:
                    received: list[Any] = [None]
                    dist.recv_object_list(received, src=peers[0])
                    snapshot, problem = fmt.load_bytes(received[0], f"rank {peers[0]}'s replica")
                    ok = problem is None and snapshot is not None and self._matches(snapshot, durable_step)
                    source = peers[0]
            verdicts: list[Any] = [None] * world
            dist.all_gather_object(verdicts, (bool(ok), source))
            if all(good for good, _ in verdicts):
                assert snapshot is not None
                self._load(snapshot)
                _memory[self.key] = snapshot
                if source is None and (match := _HEAD.match(Path(mine[step]).name)):
                    self._slot = 1 - int(match.group(3))  # the first capture keeps this one
                self.restored_from = {r: peer for r, (_, peer) in enumerate(verdicts) if peer is not None}
                return step
            if problem:
                log.warning("fast checkpoint tier: rank %d: step %d unusable: %s", self.rank, step, problem)
        return None

    def _start_replication(self, gathered: list[Any]) -> None:
        """After the restore's all-gather: this attempt's receiver runs, the senders know
        where their holders listen. Not collective beyond that all-gather."""
        if not any(g["holds"] for g in gathered):  # the same on every rank
            return
        self._token = gathered[0]["token"]
        if self.holds_for and self._receiver is None:
            self._receiver = peer_copies.ReplicaReceiver(
                self.folder, self.rank, self.holds_for, self._token, self._listen_host
            )
        addresses: list[Any] = [None] * len(gathered)
        dist.all_gather_object(addresses, self._receiver.address if self._receiver else None)
        self._holders = {r: tuple(a) for r, a in enumerate(addresses) if a is not None and r in self.sends_to}

    def _read(self, where: str) -> tuple[dict[str, Any] | None, str | None]:
        if where == "memory":
            return _memory.get(self.key), None
        head = Path(where)
        match = _HEAD.match(head.name)
        assert match is not None
        data = fmt.read_bytes(head, head.with_name(slot_name(self.rank, int(match.group(3)))))
        return fmt.load_bytes(data, where)

    def _matches(self, snapshot: dict[str, Any], durable_step: int) -> bool:
        if snapshot.get("identity") != self.identity:
            return False
        if int(snapshot.get("durable_step", -1)) > durable_step:
            return False  # taken after a durable checkpoint that is gone: another run's
        shapes = [tuple(t.shape) for t in snapshot["params"]]
        return shapes == [tuple(_local(p).shape) for p in self.params]

    def _load(self, snapshot: dict[str, Any]) -> None:
        from torch.distributed.tensor import DTensor

        if torch.cuda.is_available():
            torch.cuda.synchronize()  # a copy in memory may still have been in flight
        with torch.no_grad():
            for p, saved in zip(self.params, snapshot["params"], strict=True):
                _local(p).copy_(saved)
            for p, saved in zip(self.params, snapshot["optim"], strict=True):
                state: dict[str, Any] = {}
                for k, v in saved.items():
                    if torch.is_tensor(v) and isinstance(p, DTensor) and v.shape == _local(p).shape:
                        state[k] = DTensor.from_local(
                            v.to(_local(p).device, copy=True),
                            p.device_mesh,
                            p.placements,
                            run_check=False,
                            shape=p.shape,
                            stride=p.stride(),
                        )
                    elif torch.is_tensor(v):
                        state[k] = v.clone().to(_local(p).device)
                    else:
                        state[k] = v
                if state:
                    self.optimizer.state[p] = state
        for group, saved_group in zip(self.optimizer.param_groups, snapshot["groups"], strict=True):
            group.update(saved_group)
        self.scheduler.load_state_dict(snapshot["scheduler"])
        torch.set_rng_state(snapshot["torch_rng"])
        if "cuda_rng" in snapshot and torch.cuda.is_available():
            torch.cuda.set_rng_state(snapshot["cuda_rng"])


def _gib(n: int | None) -> str:
    return "an unknown amount" if n is None else f"{n / 2**30:.2f} GiB"


def _free_bytes(folder: Path) -> int | None:
    for where in (folder, *folder.parents):
        try:
            return shutil.disk_usage(where).free
        except OSError:
            continue
    return None
