"""The fast tier's buffers: where a rank's capture lives, how the state maps onto it, and the
cache an in-process restart resumes from.

Each rank has two slot files in the local folder (`<local_dir>/<run key>/`), mapped into its
memory. A capture is copied into the older slot, then a small header file names the slot
and describes the capture (`tier_format`); the header of a slot is removed before the slot
is overwritten. A `Plan` is one layout of the state (which tensors, in which order, at
which offsets); a `Slot` is one mapped file of that layout. `CaptureCache` holds the newest
complete capture per run in this process; the resilience layer owns one per process, so
an in-process restart finds it.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from trainer.checkpointing import tier_format as fmt
from trainer.checkpointing.replicas import folder_names

MADV_POPULATE_WRITE = 23
"""Linux >= 5.14 (Python 3.11's mmap module does not name it)."""
HEAD_FILE = re.compile(r"^rank_(\d+)_step_(\d+)_slot_([01])\.head$")
"""A capture's header: its rank, step and slot."""


def head_name(rank: int, step: int, slot: int) -> str:
    return f"rank_{rank}_step_{step}_slot_{slot}.head"


def slot_name(rank: int, slot: int) -> str:
    return f"rank_{rank}_slot_{slot}.data"


def own_heads(folder: Path, rank: int) -> list[tuple[int, int]]:
    """(step, slot) of each capture header of `rank`'s in `folder`."""
    matches = [HEAD_FILE.match(name) for name in folder_names(folder)]
    return [(int(m[2]), int(m[3])) for m in matches if m and int(m[1]) == rank]


def default_local_root() -> Path:
    """Node-local and memory-backed where there is one (a pod's /dev/shm)."""
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())) / "rtp-local"


def run_key(checkpoint_dir: str | Path) -> str:
    """One run's name in the local folder: its checkpoint folder, hashed."""
    return hashlib.sha256(str(Path(checkpoint_dir).resolve()).encode()).hexdigest()[:16]


def local_folder(local_dir: str, checkpoint_dir: str | Path) -> Path:
    return (Path(local_dir) if local_dir else default_local_root()) / run_key(checkpoint_dir)


def forget_run(local_dir: str, checkpoint_dir: str | Path) -> None:
    """A new run starts in this checkpoint folder: drop the fast tier files of the previous one."""
    shutil.rmtree(local_folder(local_dir, checkpoint_dir), ignore_errors=True)


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself, not `to_local()`'s autograd view: this
    runs for every tensor at every capture, off the training thread), else the tensor."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


class CaptureCache:
    """This process's complete captures per run key, by the slot each lives in (None: in
    process memory only, e.g. read from a file or a replica). While a durable save holds one
    slot the other is overwritten capture after capture, so both are kept: the held one is
    what an in-process restart falls back to when the other is torn."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._captures: dict[str, dict[int | None, dict[str, Any]]] = {}

    def newest(self, key: str) -> tuple[int | None, dict[str, Any] | None]:
        """(the slot it lives in, the newest complete capture of the run), or (None, None)."""
        with self._lock:
            held = self._captures.get(key) or {}
            return max(held.items(), key=lambda item: int(item[1]["step"]), default=(None, None))

    def get(self, key: str) -> dict[str, Any] | None:
        return self.newest(key)[1]

    def put(self, key: str, capture: dict[str, Any], slot: int | None) -> None:
        """A complete capture in `slot`; one outside the slots replaces every other."""
        with self._lock:
            held = {} if slot is None else self._captures.get(key, {})
            self._captures[key] = {**{s: c for s, c in held.items() if s is not None}, slot: capture}

    def drop(self, key: str, slot: int | None = None) -> None:
        """Forget the run's captures (only the one in `slot`, when given: about to be overwritten)."""
        with self._lock:
            if slot is None:
                self._captures.pop(key, None)
            else:
                self._captures.get(key, {}).pop(slot, None)


@dataclass(slots=True)
class Plan:
    """One layout of the state: the shards to copy, the skeleton over their indices, where
    the meta's tensors (new objects at every capture) go, and the header's static section
    (written once per layout)."""

    sources: list[torch.Tensor]
    skeleton: dict[str, Any]
    dynamic_index: dict[str, int]
    layout: list[tuple[str, list[int], int, int]]
    size: int
    static: bytes


def plan_state(
    params: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    meta: dict[str, Any],
    previous: Plan | None,
) -> tuple[Plan, bool]:
    """What a capture copies: the shards (the same tensor objects at every capture: the
    optimizer updates them in place), then the meta's tensors (the RNG states). Returns the
    plan and whether it may be reused; `previous` when its shards are still the state's."""
    state = optimizer.state
    values = [value for p in params for value in state.get(p, {}).values()]
    sources = [*map(local_shard, params), *(local_shard(v) for v in values if torch.is_tensor(v))]
    stable = all(map(torch.is_tensor, values))  # else a plain value in the state: it goes in the skeleton
    if stable and previous is not None and list(map(id, previous.sources)) == list(map(id, sources)):
        return previous, True  # the same tensor objects (both lists hold them: ids are theirs)
    index = iter(range(len(params), len(sources)))  # the optimizer state's, after the shards'
    optim = [
        {k: {fmt.TENSOR_KEY: next(index)} if torch.is_tensor(v) else v for k, v in state.get(p, {}).items()}
        for p in params
    ]
    skeleton = {"params": [{fmt.TENSOR_KEY: i} for i in range(len(params))], "optim": optim}
    names = [k for k, v in meta.items() if torch.is_tensor(v)]
    dynamic_index = {k: len(sources) + i for i, k in enumerate(names)}
    layout = fmt.layout_of([*sources, *(meta[k] for k in names)])
    size = fmt.aligned(layout[-1][2] + layout[-1][3]) if layout else 0
    static = fmt.static_section(skeleton, layout, size)
    return Plan(sources, skeleton, dynamic_index, layout, size, static), stable


class Slot:
    """One slot: the capture's tensors, views into a mapped slot file (or, when the file
    cannot be made, into process memory: in-process restarts still work)."""

    def __init__(self, path: Path | None, layout: list[tuple[str, list[int], int, int]], size: int) -> None:
        import mmap

        self.path, self.layout, self.size = path, layout, size
        self.head: Path | None = None  # the header of the capture it holds, if written
        self.step: int | None = None
        self.plan: Plan | None = None
        self.filled: Any = None  # the plan's skeleton over this slot's tensors
        self.data: Any = bytearray(max(size, 1) if path is None else 1)
        if path is not None:
            with path.open("a+b") as handle:
                handle.truncate(size)
                if size:
                    # Reserve the pages now: a full tmpfs makes this fail with ENOSPC here,
                    # instead of a SIGBUS at the first write into the mapping.
                    os.posix_fallocate(handle.fileno(), 0, size)
                    self.data = mmap.mmap(handle.fileno(), size, mmap.MAP_SHARED)
                    # Fault the pages in now, content unchanged: a fresh tmpfs page is zeroed
                    # at its first touch, which would otherwise land in the first capture's
                    # copy, one the loop waits for. Through ctypes, which lets go of the
                    # interpreter lock (mmap.madvise keeps it). Refused by kernels older than
                    # 5.14: the first copy pays then.
                    libc = ctypes.CDLL(None, use_errno=True)
                    libc.madvise(ctypes.c_void_p(self.address()), ctypes.c_size_t(size), MADV_POPULATE_WRITE)
        self.tensors = [fmt.view(self.data, *entry) for entry in layout]  # (dtype, shape, place, bytes)

    def address(self) -> int:
        """Where the mapping starts in this process's memory."""
        return ctypes.addressof(ctypes.c_char.from_buffer(self.data))

    def pin(self) -> None:
        """Page-lock the mapping (for every device: flag 1, "portable") until the slot is
        collected, so that device-to-host copies into it are asynchronous. If CUDA refuses,
        copies are still correct, only slower (they then go through staging memory)."""
        import weakref

        cudart = torch.cuda.cudart()
        if self.size and int(cudart.cudaHostRegister(self.address(), self.size, 1)) == 0:
            weakref.finalize(self, cudart.cudaHostUnregister, self.address())


def gib(n: int | None) -> str:
    return "an unknown amount" if n is None else f"{n / 2**30:.2f} GiB"


def free_bytes(folder: Path) -> int | None:
    for where in (folder, *folder.parents):
        with contextlib.suppress(OSError):
            return shutil.disk_usage(where).free
    return None


def non_finite(snapshot: dict[str, Any]) -> str | None:
    """What of a capture is not finite (NaN or Inf in a weight or optimizer tensor), or None;
    a peer's copy is checked before it is trained on (a rank that computed garbage, or a
    copy corrupted on the way)."""
    for kind in ("params", "optim"):
        for index, entry in enumerate(snapshot[kind]):
            for value in entry.values() if isinstance(entry, dict) else [entry]:
                if torch.is_tensor(value) and value.is_floating_point() and not torch.isfinite(value).all():
                    return f"{kind} tensor {index} holds NaN or Inf"
    return None


def mesh_grid(params: Sequence[torch.Tensor]) -> list[list[int]] | None:
    """An HSDP state's (replicate, shard) grid of ranks; None for FSDP or an unsharded state."""
    mesh = next((p.device_mesh for p in params if isinstance(p, DTensor)), None)
    return mesh.mesh.tolist() if mesh is not None and mesh.ndim == 2 else None


def forget_rank(folder: Path, rank: int) -> None:
    """Remove what `rank` keeps in the node-local folder, its own captures and the replicas
    it holds: what a node that is replaced takes with it (the `node-loss` drill), and what a
    rank's copies of no further use hold (`LocalTier.close`). One listing: the other ranks
    delete theirs at the same time, and the folder may be gone by the time this rank looks."""
    mine = re.compile(rf"^(rank_{rank}_|replica_rank_\d+_step_\d+_on_{rank}\.pt$)")
    for name in folder_names(folder):
        if mine.match(name):
            (folder / name).unlink(missing_ok=True)
