"""How a durable save reads the host-state engine's capture of its step: a `Lease` on the
slot (not overwritten until released), the state dict over the slot's tensors, and the
slot's tensors sent to the writer process as references into the slot file.

torch's pickling of a tensor for another process moves its storage into new shared memory
(a full copy, and the slot's view would no longer see the slot). A slot is already a file
in shared memory, so the training process sends `(file, offset, dtype, shape)` and the
writer maps the file itself. Only the write buckets of NVRx's `FileSystemWriterAsync`
(`[(path, file name, (bytes items, [(item, tensor)]))]`) are rewritten; anything else
travels as before.
"""

from __future__ import annotations

import mmap
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from trainer.checkpointing import tier_format as fmt
from trainer.checkpointing import tier_slots as slots
from trainer.checkpointing.tier_slots import Slot

if TYPE_CHECKING:
    from trainer.checkpointing.local_tier import LocalTier


@dataclass(frozen=True, slots=True)
class SlotRef:
    path: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


def by_reference(buckets: list[Any], slot: Slot | None) -> list[Any]:
    """`buckets` with every contiguous host tensor inside `slot`'s file mapping replaced by a
    `SlotRef` (unchanged when there is no file-backed slot)."""
    if slot is None or slot.path is None or not slot.size:
        return buckets
    base = slot.address()

    def ref(tensor: Any) -> Any:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu" or not tensor.is_contiguous():
            return tensor
        start, nbytes = tensor.data_ptr() - base, tensor.numel() * tensor.element_size()
        inside = nbytes and start >= 0 and start + nbytes <= slot.size
        return SlotRef(str(slot.path), start, tensor.dtype, tuple(tensor.shape), nbytes) if inside else tensor

    return [
        (where, name, (data, [(item, ref(t)) for item, t in items])) for where, name, (data, items) in buckets
    ]


def resolve(buckets: list[Any]) -> list[Any]:
    """In the writer process: every `SlotRef` back to a tensor over the slot file, each file
    mapped once (shared, populated: the write reads all of it)."""
    mappings: dict[str, mmap.mmap] = {}

    def tensor(value: Any) -> Any:
        if not isinstance(value, SlotRef):
            return value
        if value.path not in mappings:
            with open(value.path, "r+b", buffering=0) as handle:
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                mappings[value.path] = mmap.mmap(handle.fileno(), 0, flags=flags)
        return fmt.view(mappings[value.path], value.dtype, list(value.shape), value.offset, value.nbytes)

    return [
        (where, name, (data, [(item, tensor(t)) for item, t in items]))
        for where, name, (data, items) in buckets
    ]


class Lease:
    """A capture lent to a durable save: `wait()` for its copy, `release()` once written."""

    def __init__(self, tier: LocalTier, slot: int, copy: Future[None]) -> None:
        self._tier = tier
        self.slot = slot
        self._copy = copy
        self.serving: Slot | None = None  # set by the save that reads the slot
        self.released = False

    def wait(self) -> Slot:
        """The slot holding the complete capture (raises what failed the copy)."""
        self._copy.result()
        target = self._tier.slot(self.slot)
        assert target is not None
        return target

    def release(self) -> None:
        """The save no longer reads the slot (written, failed or abandoned); idempotent."""
        self.serving = None
        if not self.released:  # a later save may hold the same slot by now
            self._tier.release_slot(self.slot)
        self.released = True

    def state_over(self, state: dict[str, Any]) -> dict[str, Any]:
        """`state` (a state dict of the captured step) with each tensor replaced by its copy
        in the slot, matched by the local shard's address, shape and dtype: the state dict's
        tensors are views of the shards the capture copied. One the capture lacks is copied
        here, as is every tensor of a slot in memory only (the writer process reads it as a copy)."""
        from torch.distributed.tensor import DTensor
        from torch.utils._pytree import tree_map_only

        slot = self.wait()
        self.serving = slot if slot.path is not None else None
        assert slot.plan is not None
        held = {
            (s.data_ptr(), tuple(s.shape), s.dtype): host
            for s, host in zip(slot.plan.sources, slot.tensors, strict=False)
            if s.numel()
        }

        def host_copy(value: torch.Tensor) -> torch.Tensor:
            local = slots.local_shard(value)
            host = held.get((local.data_ptr(), tuple(local.shape), local.dtype))
            if host is None or slot.path is None:
                host = local.detach().to("cpu", copy=True)
            # A DTensor is built directly: this runs off the training thread.
            return DTensor(host, value._spec, requires_grad=False) if isinstance(value, DTensor) else host

        return tree_map_only(torch.Tensor, host_copy, state)
