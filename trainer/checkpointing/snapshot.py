"""Host snapshots of the training state, copied while the next step's forward and backward run.

An asynchronous save must write the values of the step it was asked for while the loop
trains on. Only `optimizer.step()` changes what a checkpoint holds: it updates parameters
and optimizer state in place; forward and backward only read them (gradients are not
saved). So `HostSnapshot.start()` begins copying the state dict into host buffers and
returns at once, the loop runs the next step's forward and backward, and `wait()`, called
just before the next `optimizer.step()`, is the only point where the loop may wait for the
copy. The copy reads exactly the tensors the optimizer mutates: with FSDP2 the state dict's
DTensors wrap the sharded parameters' local tensors and the optimizer's state tensors.

- CPU: a background thread (one per snapshot object, started once: a thread started per
  save would make the loop wait for the interpreter lock it takes) copies the tensors
  (tensor copies release the GIL, so the thread runs beside forward and backward). It runs
  no collectives, so it cannot interleave with the loop's.
- CUDA: the background thread queues device-to-host copies into pinned host buffers on a
  side stream that first waits for an event recorded after the step's kernels, and waits
  for them. The training thread only records that event.

A caller may pass work to run in that thread once the copy is complete (the NVRx writer
plans the DCP write there when that needs no collectives).

A caller may also lend it the fast tier's capture of the same step (`local_tier.Lease`):
the tensors the capture holds are then taken from its slot instead of copied again, so a
save step copies the state to host once; only what the capture lacks is copied here.

Buffers are allocated once (by the first save's thread) in shared memory,
so the writer process reads them without another copy, and are reused: the caller must not
start a snapshot before the previous save's write finished. Non-tensor values (learning
rates in param_groups, ...) are taken from the state dict at `start()`.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

if TYPE_CHECKING:
    from trainer.checkpointing.local_tier import Lease


def share_snapshots_by_file_name() -> None:
    """Hand shared tensors to other processes by shared-memory file name.

    With torch's default `file_descriptor` strategy every storage of every save travels as
    a file descriptor through a socket served by a thread of the training process; with
    `file_system` the writer opens the shared memory by name, which makes the background
    write faster (docs/checkpointing.md). Set when the async mode starts.
    """
    torch.multiprocessing.set_sharing_strategy("file_system")


class HostSnapshot:
    """Reusable shared-memory host buffers for one state dict layout, and the copy into them."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] | None = None
        self._layout: list[tuple[torch.Size, torch.dtype, type, str]] | None = None
        self._done: threading.Event | None = None
        self._outcome: dict[str, Any] = {}
        self._stream: Any = None
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # A daemon: a rank that dies mid-copy must not be kept alive by it.
        self._worker = threading.Thread(target=self._serve, name="rtp-ckpt-snapshot", daemon=True)
        self._worker.start()

    @property
    def in_flight(self) -> bool:
        """A copy was started and `wait()` has not yet returned for it."""
        return self._done is not None

    def start(
        self,
        state: dict[str, Any],
        after_copy: Callable[[dict[str, Any]], Any] | None = None,
        lease: Lease | None = None,
    ) -> None:
        """Begin copying `state`'s tensors into host buffers, in the background.

        `wait()` returns the snapshot (`state` over the buffers), or, with `after_copy`,
        what `after_copy(snapshot)` returned: it runs in the background once the copy is
        complete and must not run collectives on the loop's process group (the loop runs
        its own meanwhile). The first snapshot of a layout also allocates the buffers, in
        the background as well. `lease`: the fast tier's capture of this state, read
        instead of copied once its copy is complete (released here if it cannot serve)."""
        if self.in_flight:
            raise RuntimeError("HostSnapshot.start() while the previous copy is in flight; call wait()")
        leaves, spec = tree_flatten(state)
        tensors = [leaf.detach() for leaf in leaves if isinstance(leaf, torch.Tensor)]
        step_done = None
        if any(t.is_cuda for t in tensors):
            # The copy must see the finished step: order it after everything queued so far.
            step_done = torch.cuda.Event()
            step_done.record()
        self._outcome = {}
        self._done = threading.Event()
        self._jobs.put((leaves, spec, tensors, step_done, after_copy, lease, self._outcome, self._done))

    def prepare(self, state: dict[str, Any]) -> None:
        """Allocate the buffers for `state`'s layout in the background (no copy), so that
        the first `start()` finds them. Later jobs queue behind it."""
        leaves, _ = tree_flatten(state)
        tensors = [leaf.detach() for leaf in leaves if isinstance(leaf, torch.Tensor)]
        self._jobs.put(("prepare", tensors))

    def wait(self) -> Any:
        """Block until the copy started by `start()` is complete; see `start()` for the result."""
        done, self._done = self._done, None
        if done is None:
            raise RuntimeError("HostSnapshot.wait() without start()")
        done.wait()
        outcome, self._outcome = self._outcome, {}
        if "error" in outcome:
            raise RuntimeError("taking the checkpoint snapshot failed") from outcome["error"]
        return outcome["result"]

    def discard(self) -> None:
        """Forget a copy in flight without raising (its save is being abandoned, e.g. before
        an in-process restart). It ends on its own within the copy time and is waited for."""
        done, self._done = self._done, None
        if done is not None:
            done.wait(timeout=10)
        self._outcome = {}

    def close(self) -> None:
        """End the background thread (after the copy in flight, if any)."""
        self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            if job[0] == "prepare":
                # A failure here is met again, and reported, by the first save's allocation.
                with contextlib.suppress(Exception):
                    self._buffers_for(job[1])
                continue
            leaves, spec, tensors, step_done, after_copy, lease, outcome, done = job
            try:
                self._copy_in_background(leaves, spec, tensors, lease, step_done, after_copy, outcome)
            finally:
                done.set()

    def _copy_in_background(
        self,
        leaves: list[Any],
        spec: Any,
        tensors: list[torch.Tensor],
        lease: Lease | None,
        step_done: Any,
        after_copy: Callable[[dict[str, Any]], Any] | None,
        outcome: dict[str, Any],
    ) -> None:
        try:
            lent = _borrow(tensors, lease)
            missing = [t for t, host in zip(tensors, lent, strict=True) if host is None]
            own = iter(self._buffers_for(missing) if missing else [])
            buffers = [host if host is not None else next(own) for host in lent]
            pairs = [
                (_local(s), _local(t))
                for s, t, host in zip(tensors, buffers, lent, strict=True)
                if host is None
            ]
            if pairs and step_done is not None:
                self._copy_from_device(pairs, step_done)
            elif pairs:
                # One call for all tensors: the interpreter lock is taken back once, not
                # once per tensor from the training thread.
                with torch.no_grad():
                    torch._foreach_copy_([target for _, target in pairs], [source for source, _ in pairs])
            filled = iter(buffers)
            snapshot = tree_unflatten(
                [next(filled) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec
            )
            outcome["result"] = after_copy(snapshot) if after_copy is not None else snapshot
        except BaseException as exc:  # re-raised by wait() on the training thread
            outcome["error"] = exc

    @property
    def buffer_bytes(self) -> int:
        """Host memory its buffers hold now."""
        return sum(_local(b).numel() * _local(b).element_size() for b in self._buffers or [])

    def _buffers_for(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The host buffers for `tensors`' layout, allocated when it is new."""
        layout = [(t.shape, t.dtype, type(t), t.device.type) for t in tensors]
        if self._buffers is None or layout != self._layout:
            self._buffers = None  # a failed allocation leaves none, not the old layout's
            self._buffers = [_new_host_buffer(t) for t in tensors]
            self._layout = layout
        return self._buffers

    def _copy_from_device(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], step_done: Any) -> None:
        """Copies on a side stream after `step_done`; this thread waits, the loop does not."""
        device = next(source.device for source, _ in pairs if source.is_cuda)
        with torch.cuda.device(device):  # the current device is per thread
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            with torch.no_grad(), torch.cuda.stream(self._stream):
                self._stream.wait_event(step_done)
                for source, target in pairs:
                    target.copy_(source, non_blocking=source.is_cuda)
            self._stream.synchronize()


def _borrow(tensors: list[torch.Tensor], lease: Lease | None) -> list[torch.Tensor | None]:
    """Per tensor, its host copy in the lent capture's slot (None: to be copied). Matched by
    the local shard's address, shape and dtype: the state dict's tensors are views of the
    very shards the capture copied. A lease that cannot serve (its copy failed, or its slot
    lives in process memory, which no writer process can map) is released."""
    if lease is None:
        return [None] * len(tensors)
    try:
        slot = lease.wait()
    except Exception:  # the capture failed: this save copies (the failure is the tier's to report)
        slot = None
    if slot is None or slot.path is None or slot.plan is None:
        lease.release()
        return [None] * len(tensors)
    lease.serving = slot
    held = {
        (s.data_ptr(), tuple(s.shape), s.dtype): host
        for s, host in zip(slot.plan.sources, slot.tensors, strict=False)
        if s.numel()
    }
    lent: list[torch.Tensor | None] = []
    for value in tensors:
        local = _local(value)
        host = held.get((local.data_ptr(), tuple(local.shape), local.dtype)) if local.numel() else None
        if host is not None and isinstance(value, DTensor):
            host = DTensor(host, value._spec, requires_grad=False)  # built directly: off the training thread
        lent.append(host)
    return lent


def _local(value: torch.Tensor) -> torch.Tensor:
    """The plain tensor to copy: a DTensor's local shard (DTensor dispatch would be slower,
    and is not meant to run off the training thread)."""
    return value._local_tensor if isinstance(value, DTensor) else value


def _new_host_buffer(value: torch.Tensor) -> torch.Tensor:
    """An empty, compact host tensor shaped like `value` (like its local shard for a
    DTensor) in shared memory, pinned when `value` is on a GPU.

    Compact also for FSDP2's sharded parameters, which are views into padded buffers. A
    DTensor buffer is a DTensor with the same mesh, placements and global shape over a host
    local tensor: the form DCP plans and writes like any other shard (torch's own
    `dcp.async_save` stages the same way)."""
    local = _local(value)
    host = torch.empty(local.shape, dtype=local.dtype).share_memory_()
    if local.is_cuda and host.numel() > 0:
        _pin(host)
    if isinstance(value, DTensor):
        # Built directly (no DTensor op): this runs off the training thread.
        return DTensor(host, value._spec, requires_grad=False)
    return host


def _pin(host: torch.Tensor) -> None:
    """Page-lock a shared-memory tensor so that device-to-host copies into it are
    asynchronous (`pin_memory()` would allocate new, unshared memory)."""
    storage = host.untyped_storage()
    pin_host_range(host, storage.data_ptr(), storage.nbytes())


def pin_host_range(owner: object, pointer: int, size: int) -> bool:
    """Page-lock `size` bytes of host memory at `pointer` (for every device: flag 1,
    "portable") until `owner` is collected; False if CUDA refused (still correct, only
    slower: copies then go through staging memory)."""
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(pointer, size, 1)) != 0:
        return False
    weakref.finalize(owner, cudart.cudaHostUnregister, pointer)
    return True
