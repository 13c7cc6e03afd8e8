"""How a durable save's tensors that live in a fast-tier slot reach the writer process: as
references into the slot file, not as tensors.

torch's pickling of a tensor for another process moves its storage into new shared memory
(a full copy, and the slot's view would no longer see the slot). A slot is already a file
in shared memory, so the training process sends `(file, offset, dtype, shape)` and the
writer maps the file itself. Only the write buckets of NVRx's `FileSystemWriterAsync`
(`[(path, file name, (bytes items, [(item, tensor)]))]`) are rewritten; anything else
travels as before.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from typing import Any

import torch

from trainer.checkpointing.tier_slots import Slot


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
    path = str(slot.path)

    def ref(tensor: Any) -> Any:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu" or not tensor.is_contiguous():
            return tensor
        start = tensor.data_ptr() - base
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0 or start < 0 or start + nbytes > slot.size:
            return tensor
        return SlotRef(path, start, tensor.dtype, tuple(tensor.shape), nbytes)

    return [
        (file_path, name, (bytes_data, [(item, ref(tensor)) for item, tensor in tensor_data]))
        for file_path, name, (bytes_data, tensor_data) in buckets
    ]


def resolve(buckets: list[Any]) -> list[Any]:
    """In the writer process: every `SlotRef` back to a tensor over the slot file, each file
    mapped once (shared, populated: the write reads all of it)."""
    mappings: dict[str, mmap.mmap] = {}

    def tensor(value: Any) -> Any:
        if not isinstance(value, SlotRef):
            return value
        data = mappings.get(value.path)
        if data is None:
            fd = os.open(value.path, os.O_RDWR)
            try:
                data = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            finally:
                os.close(fd)
            mappings[value.path] = data
        count = value.nbytes // torch.empty((), dtype=value.dtype).element_size()
        return torch.frombuffer(data, dtype=value.dtype, count=count, offset=value.offset).reshape(
            value.shape
        )

    return [
        (file_path, name, (bytes_data, [(item, tensor(value)) for item, value in tensor_data]))
        for file_path, name, (bytes_data, tensor_data) in buckets
    ]
