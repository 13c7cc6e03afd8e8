"""The fast checkpoint tier: each rank's own shard of the training state, every few steps,
in process memory and in a node-local folder.

The durable DCP checkpoint on the shared volume is written every `checkpoint.every_steps`
steps; a fault used to throw away every step since. The fast tier keeps, every
`checkpoint.local_every_steps` steps (default: every step), a copy of what this rank needs
to continue exactly: its local shards of the parameters and of the optimizer state, the
optimizer's hyper-parameters, the scheduler, the RNG state and the step. It is a host copy
of the shards each rank already holds (no collective, no planning), so it costs a memory
copy per step.

- An **in-process restart** (the process lives on) resumes from the copy in memory.
- A **worker-group restart** (ft_launcher, after a rank was killed) resumes from the copy
  a background thread wrote to `checkpoint.local_dir` (node-local: /dev/shm by default,
  which survives the processes but not the node). Each rank keeps its two newest files,
  so a rank killed while writing one still has the previous step.

On resume the ranks agree (one all-gather) on the newest step every rank holds; it is used
only when it is newer than the latest committed durable checkpoint, belongs to the same
run (same checkpoint folder, model and world size) and was taken after that checkpoint's
step. Otherwise the durable checkpoint is loaded, as before. The durable checkpoint stays
the recovery point for losing the whole job or a node, and the only thing validate and
register read. Files hold raw tensor bytes after a header read with
`torch.load(weights_only=True)` (`write_snapshot_file`).

- A rank whose **node is gone** (a pod rescheduled elsewhere, /dev/shm empty) resumes
  from a peer's replica when `checkpoint.local_replicas` is set: every file is also sent to
  ranks on other nodes (trainer/checkpointing/replicas.py). NVRx's LocalCheckpointManager
  replicates too, but needs CUDA tensors in 0.4.1.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import pickle
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.checkpointing import replicas as peer_copies

log = logging.getLogger(__name__)

_FILE = re.compile(r"^rank_(\d+)_step_(\d+)\.pt$")
_KEEP_FILES = 2
_memory: dict[str, dict[str, Any]] = {}
"""Per run key: this process's newest capture (survives an in-process restart)."""


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


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class LocalTier:
    """One per attempt and rank. `capture()` after an optimizer step; `restore()` at start."""

    def __init__(
        self,
        *,
        every_steps: int,
        local_dir: str,
        checkpoint_dir: str | Path,
        identity: dict[str, Any],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        replicas: int = 0,
    ) -> None:
        self.every_steps = every_steps
        self.key = run_key(checkpoint_dir)
        self.folder = local_folder(local_dir, checkpoint_dir)
        self.identity = identity
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.rank = dist.get_rank()
        self.params = list(model.parameters())
        self._buffers: list[dict[str, Any] | None] = [None, None]
        self._slot = 0
        self._writing: int | None = None  # the slot the file thread is writing
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queued: int | None = None
        self._closed = False
        self._flush = True
        self._stream: Any = None
        self._copier: ThreadPoolExecutor | None = None
        self._copy: Future[None] | None = None
        self._copied: Any = None  # CUDA: the event after the newest capture's copies
        self._thread: threading.Thread | None = None
        self._files_allowed = threading.Event()  # cleared while a durable snapshot copies
        self._files_allowed.set()
        self.captures = 0
        self.write_errors = 0
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
        return self.every_steps > 0

    # ---- capture ---------------------------------------------------------------------

    def capture(self, step: int, durable_step: int) -> bool:
        """Not collective. Copy this rank's state after step `step` if it is a capture step;
        `durable_step`: the newest durable checkpoint step this attempt knows of."""
        if not self.enabled or step % self.every_steps:
            return False
        with self._lock:
            slot = self._slot
            if self._writing == slot:  # the file thread still writes this buffer: skip one
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
        if self._cuda_stream() is not None:  # the copies are only queued: no thread needed
            self._fill(slot, meta)
        else:
            if self._copier is None:
                self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rtp-local-copy")
            self._copy = self._copier.submit(self._fill, slot, meta)
        self._ensure_thread()
        return True

    def _fill(self, slot: int, meta: dict[str, Any]) -> None:
        with self._lock:  # the file thread starts no write of a buffer while it is filled
            snapshot = self._copy_into(self._buffers[slot], meta)
            self._buffers[slot] = snapshot
            _memory[self.key] = snapshot  # complete: what an in-process restart resumes from
            self.captures += 1
            self._queued = slot  # the newest capture is the next file written
            self._wake.notify()

    def wait_copy(self) -> float:
        """Wait for the copy started by the last `capture()` (CPU); returns the seconds waited."""
        copy, self._copy = self._copy, None
        if copy is None:
            return 0.0
        started = time.perf_counter()
        copy.result()
        return time.perf_counter() - started

    def _copy_into(self, buffer: dict[str, Any] | None, meta: dict[str, Any]) -> dict[str, Any]:
        """Copy the shards into `buffer` (host memory; allocated on first use). On CUDA the
        copies are queued on a side stream into pinned memory and overlap the next step's
        forward and backward; `before_optimizer_step()` orders the optimizer after them and
        the file thread waits for them."""
        cuda = self._cuda_stream()
        with torch.no_grad(), torch.cuda.stream(cuda) if cuda is not None else contextlib.nullcontext():
            if cuda is not None:
                cuda.wait_stream(torch.cuda.current_stream())
            params = self._copy_list(
                None if buffer is None else buffer["params"], [_local(p) for p in self.params]
            )
            optim = []
            old_states = [None] * len(self.params) if buffer is None else buffer["optim"]
            for old, p in zip(old_states, self.params, strict=True):
                state = self.optimizer.state.get(p, {})
                if old is None or old.keys() != state.keys():
                    old = {
                        k: (self._host_copy(_local(v)) if torch.is_tensor(v) else v) for k, v in state.items()
                    }
                else:
                    for k, v in state.items():
                        if torch.is_tensor(v):
                            old[k].copy_(_local(v), non_blocking=cuda is not None)
                        else:
                            old[k] = v
                optim.append(old)
            if cuda is not None:
                self._copied = torch.cuda.Event()
                self._copied.record(cuda)
        return {**meta, "params": params, "optim": optim}

    def _cuda_stream(self) -> Any:
        if not (self.params and self.params[0].is_cuda):
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def _host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_cuda:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
            host.copy_(tensor.detach(), non_blocking=True)
            return host
        return tensor.detach().clone()

    def _copy_list(
        self, targets: list[torch.Tensor] | None, sources: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        if targets is None:
            return [self._host_copy(t) for t in sources]
        for target, source in zip(targets, sources, strict=True):
            target.copy_(source, non_blocking=source.is_cuda)
        return targets

    def before_optimizer_step(self) -> float:
        """The optimizer must not change the weights before the copies read them: on CPU
        wait for the copy thread, on CUDA make the compute stream wait on the copy stream
        (the host waits for nothing). Returns the seconds the loop waited."""
        if self._copied is not None:
            torch.cuda.current_stream().wait_event(self._copied)
        return self.wait_copy()

    def _wait_copied(self) -> None:
        event = self._copied
        if event is not None:
            event.synchronize()

    # ---- node-local files -----------------------------------------------------------

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._thread = threading.Thread(target=self._write_loop, name="rtp-local-tier", daemon=True)
            self._thread.start()

    def hold_files(self) -> None:
        """A durable save is copying the state (an async save's snapshot, beside the next
        step's forward and backward, which the optimizer waits for): no new file is started
        until `release_files()` — when the copy is complete, at the latest before the next
        optimizer step. Both compete for the same cores and memory bandwidth."""
        self._files_allowed.clear()

    def release_files(self) -> None:
        self._files_allowed.set()

    def _write_loop(self) -> None:
        while True:
            self._files_allowed.wait(timeout=30)  # never stuck: at worst a file competes
            with self._lock:
                while self._queued is None and not self._closed:
                    self._wake.wait()
                if not self._closed and not self._files_allowed.is_set():
                    continue  # a durable snapshot started meanwhile: after it, the newest
                if self._closed and (self._queued is None or not self._flush):
                    return
                slot, self._queued = self._queued, None
                assert slot is not None  # closed with nothing queued returned above
                self._writing = slot
                snapshot = self._buffers[slot]
            try:
                self._write_file(snapshot)
            except Exception as exc:  # a full /dev/shm must not stop training
                self.write_errors += 1
                if self.write_errors == 1:
                    log.warning("fast checkpoint tier: cannot write to %s: %s", self.folder, exc)
            finally:
                with self._lock:
                    self._writing = None

    def _write_file(self, snapshot: dict[str, Any] | None) -> None:
        if snapshot is None:
            return
        self._wait_copied()
        final = self.folder / f"rank_{self.rank}_step_{snapshot['step']}.pt"
        temporary = final.with_name(f".{final.name}.tmp")
        write_snapshot_file(temporary, snapshot)
        os.replace(temporary, final)
        for holder in self.sends_to:
            if holder not in self._holders:
                continue
            try:
                peer_copies.send_replica(
                    self._holders[holder], self._token, self.rank, snapshot["step"], final
                )
                self.replicas_sent += 1
            except (OSError, ValueError) as exc:  # a peer restarting must not stop training
                self.replica_errors += 1
                if self.replica_errors == 1:
                    log.warning("fast checkpoint tier: cannot send a copy to rank %d: %s", holder, exc)
        mine = sorted(
            (int(m.group(2)), path)
            for path in self.folder.iterdir()
            if (m := _FILE.match(path.name)) and int(m.group(1)) == self.rank
        )
        for _, old in mine[:-_KEEP_FILES]:
            old.unlink(missing_ok=True)

    def close(self, discard: bool = False, flush: bool = True) -> None:
        """Stop the file thread (not collective), after writing the newest capture unless
        `flush` is off (an in-process restart: the copy in memory is what it resumes from).
        `discard`: the attempt ended with a committed durable checkpoint of its last step,
        so this rank's copies are of no further use: free the memory and /dev/shm they hold."""
        with contextlib.suppress(Exception):
            self.wait_copy()
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None
        self.release_files()
        with self._lock:
            self._closed = True
            self._flush = flush and not discard
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
        if discard:
            _memory.pop(self.key, None)
            self._buffers = [None, None]
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
            own = _FILE.match(name)
            held = peer_copies.REPLICA_FILE.match(name)
            if (own and int(own.group(1)) == self.rank) or (held and int(held.group(3)) == self.rank):
                (self.folder / name).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.folder.rmdir()

    # ---- restore -------------------------------------------------------------------

    def _candidates(self) -> dict[int, str]:
        """step -> where this rank holds it ("memory" or a file path), matching this run."""
        found: dict[int, str] = {}
        if self.folder.is_dir():
            for path in self.folder.iterdir():
                match = _FILE.match(path.name)
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

        def holders(owner: int, step: int) -> list[int]:
            return [r for r in range(world) if step in gathered[r]["held"].get(owner, ())]

        steps = {s for g in gathered for s in g["own"]}
        steps |= {s for g in gathered for held_steps in g["held"].values() for s in held_steps}
        usable = sorted(
            (
                s
                for s in steps
                if s > durable_step and all(s in gathered[o]["own"] or holders(o, s) for o in range(world))
            ),
            reverse=True,
        )
        for step in usable:
            snapshot, problem = self._read(mine[step]) if step in mine else (None, None)
            ok = problem is None and snapshot is not None and self._matches(snapshot, durable_step)
            own_ok: list[Any] = [None] * world
            dist.all_gather_object(own_ok, bool(ok))
            # A rank whose own copy is missing or unreadable takes a peer's replica.
            source: int | None = None
            for owner in range(world):
                peers = holders(owner, step)
                if own_ok[owner] or not peers:
                    continue
                if self.rank == peers[0]:
                    payload = _read_bytes(held[owner][step])
                    dist.send_object_list([payload], dst=owner)
                elif self.rank == owner:
                    received: list[Any] = [None]
                    dist.recv_object_list(received, src=peers[0])
                    snapshot, problem = _load_bytes(received[0], f"rank {peers[0]}'s replica")
                    ok = problem is None and snapshot is not None and self._matches(snapshot, durable_step)
                    source = peers[0]
            verdicts: list[Any] = [None] * world
            dist.all_gather_object(verdicts, (bool(ok), source))
            if all(good for good, _ in verdicts):
                assert snapshot is not None
                self._load(snapshot)
                _memory[self.key] = snapshot
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
        return _load_bytes(_read_bytes(Path(where)), where)

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


def _read_bytes(path: Path) -> bytearray | None:
    try:
        with path.open("rb", buffering=0) as handle:
            data = bytearray(os.fstat(handle.fileno()).st_size)
            handle.readinto(data)
            return data
    except OSError:
        return None


def _load_bytes(payload: bytes | bytearray | None, where: str) -> tuple[dict[str, Any] | None, str | None]:
    if payload is None:
        return None, f"{where} could not be read"
    try:
        return read_snapshot_bytes(payload), None
    except (OSError, RuntimeError, ValueError, pickle.UnpicklingError, EOFError) as exc:
        return None, f"{where}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"


# ---- the file format ------------------------------------------------------------------
#
# A fast-tier file is written every step beside training, so its writer must leave the
# interpreter to the loop. torch.save holds the GIL while it writes the tensors' bytes: a
# thread saving 300 MB in a loop cut a pure-Python loop beside it to 41% of its speed, with
# stalls of 57 ms (raw writes: no slowdown, stalls under 3 ms). So the tensors' bytes are
# written with plain file writes, which release the GIL, after a small header that holds
# everything else (saved with torch.save, read back with `weights_only=True`):
#
#   MAGIC | header length (8 bytes) | header | tensor bytes, each at a 64-byte boundary
#
# The header records each tensor's dtype, shape and place; a file of another length (torn,
# or not ours) is refused.

_MAGIC = b"RTPTIER1"
_TENSOR_KEY = "__rtp_tensor__"
_ALIGN = 64


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def write_snapshot_file(path: Path, snapshot: dict[str, Any]) -> None:
    tensors: list[torch.Tensor] = []

    def strip(value: Any) -> Any:
        if torch.is_tensor(value):
            tensors.append(value.detach().contiguous())
            return {_TENSOR_KEY: len(tensors) - 1}
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(strip(v) for v in value)
        return value

    skeleton = strip(snapshot)
    layout: list[tuple[str, list[int], int, int]] = []
    offset = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        layout.append((str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, nbytes))
        offset = _aligned(offset + nbytes)
    buffer = io.BytesIO()
    torch.save({"skeleton": skeleton, "tensors": layout, "size": offset}, buffer)
    header = buffer.getvalue()
    start = _aligned(len(_MAGIC) + 8 + len(header))
    with path.open("wb", buffering=0) as handle:
        handle.write(_MAGIC + len(header).to_bytes(8, "little") + header)
        handle.write(bytes(start - handle.tell()))
        for tensor, (_, _, place, nbytes) in zip(tensors, layout, strict=True):
            if nbytes:
                handle.seek(start + place)
                handle.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
        handle.truncate(start + offset)


def read_snapshot_bytes(payload: bytes | bytearray) -> dict[str, Any]:
    if payload[: len(_MAGIC)] != _MAGIC:
        raise ValueError("not a fast-tier file")
    length = int.from_bytes(payload[len(_MAGIC) : len(_MAGIC) + 8], "little")
    header = torch.load(io.BytesIO(payload[len(_MAGIC) + 8 : len(_MAGIC) + 8 + length]), weights_only=True)
    start = _aligned(len(_MAGIC) + 8 + length)
    if len(payload) != start + int(header["size"]):
        raise ValueError(f"{len(payload)} bytes where the header says {start + int(header['size'])}: torn")
    data = payload if isinstance(payload, bytearray) else bytearray(payload)  # the tensors share it
    tensors = []
    for dtype, shape, place, nbytes in header["tensors"]:
        kind = getattr(torch, dtype)
        count = nbytes // torch.empty((), dtype=kind).element_size()
        flat = (
            torch.frombuffer(data, dtype=kind, count=count, offset=start + place)
            if count
            else torch.empty(0, dtype=kind)
        )
        tensors.append(flat.reshape(shape))

    def fill(value: Any) -> Any:
        if isinstance(value, dict):
            if len(value) == 1 and _TENSOR_KEY in value:
                return tensors[value[_TENSOR_KEY]]
            return {k: fill(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(fill(v) for v in value)
        return value

    snapshot = fill(header["skeleton"])
    if not isinstance(snapshot, dict):
        raise ValueError("not a fast-tier snapshot")
    return snapshot
