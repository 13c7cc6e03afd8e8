"""The fast tier's single-file format (pure: bytes in, state out; no process group).

A capture's bytes are raw tensor bytes (copied into a mapped slot, whose file is the
capture's file: torch.save would hold the GIL while it writes tensor bytes, stalling the
training thread). Everything else is in a header of
two sections saved with torch.save and read back with `weights_only=True`:

  MAGIC | static section | capture section | padding | tensor bytes, each at a 64-byte boundary

where a section is its length (8 bytes) and its torch.save bytes. The static section (the
skeleton of parameters and optimizer state over tensor indices, each tensor's dtype, shape
and place, the total size) stays the same while the layout does and is made once; the
capture section (step, scheduler, hyper-parameters, the RNG states' indices, the tensor
bytes' checksums, ...) is the only part pickled at every capture. A file of another length
(torn, or not ours), or whose tensor bytes do not match the checksums recorded at capture
(flipped bits at rest or on the way from a peer), is refused.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch

_MAGIC = b"RTPTIER3"
TENSOR_KEY = "__rtp_tensor__"
_ALIGN = 64
CHECKSUM_CHUNK = 64 * 2**20
"""The tensor bytes are checksummed in pieces this large (a multiple of 8)."""
Layout = list[tuple[str, list[int], int, int]]
"""(dtype, shape, place, bytes) of each tensor of a file."""


def aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def layout_of(tensors: list[torch.Tensor]) -> Layout:
    """(dtype, shape, place, bytes) of each tensor, each place at a 64-byte boundary."""
    layout = []
    offset = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        layout.append((str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, nbytes))
        offset = aligned(offset + nbytes)
    return layout


def _section(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return len(buffer.getvalue()).to_bytes(8, "little") + buffer.getvalue()


def static_section(skeleton: dict[str, Any], layout: Layout, size: int) -> bytes:
    """The header's part that stays the same while the layout does (made once per layout)."""
    return _section({"skeleton": skeleton, "tensors": layout, "size": size})


def header_bytes(static: bytes, dynamic: dict[str, Any]) -> bytes:
    """Everything of a file before its tensor bytes (which start at a 64-byte boundary)."""
    prefix = _MAGIC + static + _section(dynamic)
    return prefix + bytes(aligned(len(prefix)) - len(prefix))


def checksums(data: Any, start: int = 0) -> list[int]:
    """A checksum of each `CHECKSUM_CHUNK` of `data` from `start` (a mapped slot, a file's
    bytes): the wrapping 64-bit sum of its 8-byte words. Any flipped bits within a word, and
    zeroed or torn pages that did not sum to zero, change it; words swapped within a chunk
    do not. A sum, not a CRC: torch computes it at memory speed on the cores it has."""
    count = (len(data) - start) // 8  # slots and files end at a 64-byte boundary
    if count <= 0:
        return []
    words = torch.frombuffer(data, dtype=torch.int64, count=count, offset=start)
    per_chunk = CHECKSUM_CHUNK // 8
    return [int(words[i : i + per_chunk].sum()) for i in range(0, count, per_chunk)]


def fill(value: Any, tensors: list[torch.Tensor]) -> Any:
    """The skeleton with each tensor index replaced by its tensor."""
    if isinstance(value, dict):
        if len(value) == 1 and TENSOR_KEY in value:
            return tensors[value[TENSOR_KEY]]
        return {k: fill(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(fill(v, tensors) for v in value)
    return value


def read_snapshot_bytes(payload: bytes | bytearray) -> dict[str, Any]:
    if payload[: len(_MAGIC)] != _MAGIC:
        raise ValueError("not a fast-tier file")
    sections = []
    place = len(_MAGIC)
    for _ in range(2):  # the static section, then the capture's own
        length = int.from_bytes(payload[place : place + 8], "little")
        if place + 8 + length > len(payload):
            raise ValueError("the header is cut short: torn")
        sections.append(torch.load(io.BytesIO(payload[place + 8 : place + 8 + length]), weights_only=True))
        place += 8 + length
    static, dynamic = sections
    start = aligned(place)
    if len(payload) != start + int(static["size"]):
        raise ValueError(f"{len(payload)} bytes where the header says {start + int(static['size'])}: torn")
    data = payload if isinstance(payload, bytearray) else bytearray(payload)  # the tensors share it
    expected = dynamic.pop("checksums", None)
    if expected is None:
        raise ValueError("no checksums in the header: not a capture of this version")
    if checksums(data, start) != expected:
        raise ValueError("the tensor bytes do not match the checksums taken at capture: corrupted")
    tensors = [view(data, dtype, shape, start + at, nbytes) for dtype, shape, at, nbytes in static["tensors"]]
    snapshot = fill({**dynamic, **static["skeleton"]}, tensors)
    if not isinstance(snapshot, dict):
        raise ValueError("not a fast-tier snapshot")
    return snapshot


def view(data: Any, dtype: str | torch.dtype, shape: list[int], place: int, nbytes: int) -> torch.Tensor:
    kind = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)
    if not nbytes:
        return torch.empty(shape, dtype=kind)
    return torch.frombuffer(data, dtype=kind, count=nbytes // kind.itemsize, offset=place).reshape(shape)


def read_bytes(*paths: Path) -> bytearray | None:
    """The files' bytes, one after the other (None if one cannot be read)."""
    try:
        sizes = [path.stat().st_size for path in paths]
        data = bytearray(sum(sizes))
        view = memoryview(data)
        offset = 0
        for path, size in zip(paths, sizes, strict=True):
            with path.open("rb", buffering=0) as handle:
                got = handle.readinto(view[offset : offset + size])
            if got != size:
                return None  # changed while read
            offset += size
        return data
    except OSError:
        return None


def load_bytes(payload: bytes | bytearray | None, where: str) -> tuple[dict[str, Any] | None, str | None]:
    if payload is None:
        return None, f"{where} could not be read"
    try:
        return read_snapshot_bytes(payload), None
    except (OSError, RuntimeError, ValueError, pickle.UnpicklingError, EOFError) as exc:
        return None, f"{where}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
