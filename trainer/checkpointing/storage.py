"""Distributed checkpoints in torch DCP format with an atomic commit and a verified manifest.

Layout of one checkpoint (a DCP folder, so N-rank saves load on M ranks or one process):

    step_<N>/            committed: renamed from step_<N>.tmp/ only after every rank wrote
      .metadata          DCP metadata (rank 0 writes it last inside dcp.save)
      __<r>_0.distcp     DCP shards: model + optimizer (the trained parameters: a LoRA run's adapters)
      rank_state/rank_<r>.pt   per-rank RNG states and loader position
      meta.json          step, config, scheduler state, world size
      manifest.json      every file above with its size and SHA-256
      COMMITTED          marker written last, before the rename

`latest_committed_checkpoint()` only ever returns a folder whose marker, DCP metadata and
manifest check out; a torn or tampered one is skipped with a warning naming the bad file.
This module holds the storage logic: folders, commit, manifest, retention, load. The
writers (`writer`, `nvrx_writer`) decide how a save reaches it, and the
manager (`manager`) when.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from trainer import waiting

log = logging.getLogger(__name__)

COMMIT_MARKER = "COMMITTED"
MANIFEST = "manifest.json"
META = "meta.json"
DCP_METADATA = ".metadata"
RANK_STATE_DIR = "rank_state"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the folder or file and why."""


def frozen_parameter_names(model: nn.Module) -> set[str]:
    """Every name of every frozen parameter (a LoRA run's base), tied aliases included."""
    return {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def trained_state_options(model: nn.Module) -> StateDictOptions:
    """What a checkpoint holds of the model: the parameters training changes. A LoRA run's
    frozen base is left out (it is read from its model folder at every start; meta.json's
    `adapters` names it); loading is strict where nothing is frozen."""
    return StateDictOptions(ignore_frozen_params=True, strict=not frozen_parameter_names(model))


def trained_model_state(model_state: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """`model_state` (from `trained_state_options`) without a frozen tied alias: torch 2.13's
    ignore_frozen_params drops the names `named_parameters()` gives, which lists a tied weight
    under its first name only, so a frozen tied head (`lm_head.weight`) would stay."""
    frozen = frozen_parameter_names(model)
    return {key: value for key, value in model_state.items() if key not in frozen}


def training_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """{"model": ..., "optim": ...}: what a checkpoint holds, as sharded tensors (views of the
    live parameters and optimizer state, not copies)."""
    model_state, optim_state = get_state_dict(model, optimizer, options=trained_state_options(model))
    return {"model": trained_model_state(model_state, model), "optim": optim_state}


def _load_training_state(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Collective: `training_state_dict`'s tensors read from the checkpoint at `path`, set."""
    state, group = training_state_dict(model, optimizer), dist.group.WORLD
    # In a thread: DCP's collectives wait inside C for the slowest rank's read (trainer/waiting.py).
    # On this attempt's group, bound now: on none, a load an in-process restart interrupts would
    # run its last gather on the next attempt's group (resolved when it runs).
    waiting.off_main_thread("rtp-ckpt-load", dcp.load, state, checkpoint_id=str(path), process_group=group)
    options = trained_state_options(model)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options
    )


def committed_steps(root: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every folder that looks committed, newest first (not verified)."""
    base = Path(root)
    children = base.iterdir() if base.is_dir() else []
    found = [(int(m.group(1)), c) for c in children if (m := _STEP_DIR.match(c.name)) and c.is_dir()]
    return sorted(found, reverse=True)


def sha256_file(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def verify_checkpoint(path: str | Path, verify_hashes: bool = False) -> None:
    """Raise CheckpointError naming the first problem: marker, DCP metadata, manifest, a file."""
    folder = Path(path)
    for required in (COMMIT_MARKER, DCP_METADATA, MANIFEST, META):
        if not (folder / required).is_file():
            raise CheckpointError(f"{folder / required} is missing: the checkpoint is incomplete")
    try:
        entries = json.loads((folder / MANIFEST).read_text())["files"]
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"{folder / MANIFEST} is unreadable: {exc}") from exc
    for entry in entries:
        file_path = folder / entry["path"]
        if not file_path.is_file():
            raise CheckpointError(f"{file_path} is listed in the manifest but missing")
        if (size := file_path.stat().st_size) != entry["size"]:
            raise CheckpointError(f"{file_path} has {size} bytes, the manifest says {entry['size']}")
        if verify_hashes and sha256_file(file_path) != entry["sha256"]:
            raise CheckpointError(f"{file_path} does not match its SHA-256 in the manifest")


def latest_committed_checkpoint(root: str | Path, verify_hashes: bool = False) -> Path | None:
    """The newest checkpoint under `root` that verifies; older ones are tried in turn."""
    for _, folder in committed_steps(root):
        try:
            verify_checkpoint(folder, verify_hashes=verify_hashes)
            return folder
        except CheckpointError as exc:
            log.warning("skipping checkpoint %s: %s", folder, exc)
    return None


def manifest_sha256(path: str | Path) -> str:
    """SHA-256 of a committed checkpoint's manifest.json: names every file's size and SHA-256,
    so it identifies the whole checkpoint. The train step publishes it with its output."""
    manifest = Path(path) / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(f"{manifest} is missing: {path} is not a committed checkpoint")
    return hashlib.sha256(manifest.read_bytes()).hexdigest()


def verify_published(path: str | Path, expected_manifest_sha256: str) -> None:
    """Before anything in `path` is loaded: its manifest is the one the train step published
    and every file matches the manifest (size and SHA-256). Files on the shared volume can
    change after training; this makes a swapped or tampered checkpoint fail before any of it
    (DCP metadata included) is read."""
    if not expected_manifest_sha256:
        raise CheckpointError(f"no published manifest SHA-256 for {path}: cannot verify it before loading")
    if (got := manifest_sha256(path)) != expected_manifest_sha256:
        raise CheckpointError(
            f"{path} is not the checkpoint the train step published: its manifest SHA-256 is {got}, "
            f"expected {expected_manifest_sha256}"
        )
    verify_checkpoint(path, verify_hashes=True)


def read_meta(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / META).read_text())


def _write_durable(path: Path, data: bytes) -> None:
    with path.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


HASH_SIDECAR = ".sha256"


def write_hash_sidecars(staging: str | Path, rank: int) -> None:
    """Hash this rank's DCP shards into `<file>.sha256` files, beside them.

    Every rank runs it right after its shards are written (the async writers in their
    background thread), so the commit on rank 0 reads sidecars instead of re-reading every
    rank's shards on the training thread while the other ranks wait at its barrier. A shard
    written through `ShardWriter` already has its sidecar and is not read back.
    """
    for shard in Path(staging).glob(f"__{rank}_*.distcp"):
        sidecar = shard.with_name(shard.name + HASH_SIDECAR)
        if not sidecar.is_file():
            sidecar.write_text(sha256_file(shard))


class ShardWriter(io.BufferedWriter):
    """A DCP shard written from its start that hashes its bytes on their way to the file, so
    the shard is never read back to be hashed; closed without an error, it leaves its
    `.sha256` sidecar (an error leaves none: `write_hash_sidecars` then reads the file)."""

    def __init__(self, path: str | os.PathLike[str], mode: str = "wb") -> None:
        if mode != "wb":
            raise ValueError(f"ShardWriter writes a shard whole, from its start (mode 'wb'), not {mode!r}")
        super().__init__(io.FileIO(path, "wb"))
        self.path = Path(path)
        self._digest = hashlib.sha256()

    def write(self, data: Any) -> int:
        self._digest.update(data)
        return super().write(data)

    def seekable(self) -> bool:
        return False  # a seek would leave the digest behind what the file holds

    def close(self) -> None:
        """DCP's writer closes its stream inside the `with` block that owns the file: only a
        flush here; the file is closed, and its sidecar written, when that block ends."""
        self.flush()

    def __exit__(self, error_type: type[BaseException] | None, *_: Any) -> None:
        super().close()
        if error_type is None:
            self.path.with_name(self.path.name + HASH_SIDECAR).write_text(self._digest.hexdigest())


@contextlib.contextmanager
def shard_records_without_crc32() -> Any:
    """torch.save skips each record's zip CRC-32 inside: torch.load never checks it, and the
    manifest's SHA-256 covers every byte of the shard."""
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(previous)


def _build_manifest(folder: Path) -> dict[str, Any]:
    """Sizes and SHA-256 of every file; a shard's hash comes from its sidecar when present
    (the sidecars are then removed: they are not part of the checkpoint)."""
    files = []
    for file_path in sorted(p for p in folder.rglob("*") if p.is_file()):
        relative = file_path.relative_to(folder).as_posix()
        if relative in (MANIFEST, COMMIT_MARKER) or relative.endswith(HASH_SIDECAR):
            continue
        sidecar = file_path.with_name(file_path.name + HASH_SIDECAR)
        digest = sidecar.read_text().strip() if sidecar.is_file() else sha256_file(file_path)
        files.append({"path": relative, "size": file_path.stat().st_size, "sha256": digest})
    for sidecar in folder.rglob(f"*{HASH_SIDECAR}"):  # hashed above, each beside its file
        sidecar.unlink()
    return {"version": 1, "files": files}


def rank_state(extra: dict[str, Any]) -> dict[str, Any]:
    """This rank's RNG states now, with `extra` (its loader position): its file in a save."""
    state = {"torch_rng": torch.get_rng_state(), **extra}
    if torch.cuda.is_available():
        state["cuda_rng"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """The RNG states `rank_state` took (a save's rank file, a fast-tier capture)."""
    torch.set_rng_state(state["torch_rng"])
    if "cuda_rng" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng"])


def staging_paths(root: str | Path, step: int) -> tuple[Path, Path]:
    """(staging, final) folders of step `step`'s save."""
    final = Path(root) / f"step_{step}"
    return final.with_name(final.name + ".tmp"), final


def prepare_staging(
    root: str | Path, step: int, state: dict[str, Any], *, group: dist.ProcessGroup | None = None
) -> tuple[Path, Path]:
    """Collective over `group` (default: all ranks): an empty `step_<N>.tmp/` with this
    rank's RNG/loader state in it (`state`, taken at the save's step with `rank_state`).

    Returns (staging, final). A leftover staging folder (a save that died) is discarded,
    and so is a committed folder of the same step (re-saving after resuming from older).
    """
    rank = dist.get_rank()
    staging, final = staging_paths(root, step)
    if rank == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            shutil.rmtree(staging)
        if final.exists():
            remove_committed(final)
        (staging / RANK_STATE_DIR).mkdir(parents=True)
    waiting.barrier(group)
    torch.save(state, staging / RANK_STATE_DIR / f"rank_{rank}.pt")
    return staging, final


def commit(staging: Path, final: Path, step: int, meta: dict[str, Any]) -> int:
    """Collective, after every rank's DCP write finished: make the checkpoint visible.

    Rank 0 writes meta.json, the SHA-256 manifest and the marker, then renames the folder;
    the barriers make sure no rank reads or deletes around a half-committed folder.
    Returns the checkpoint's size in bytes.
    """
    waiting.barrier()
    if dist.get_rank() == 0:
        commit_files(staging, final, step, meta)
    waiting.barrier()
    return checkpoint_bytes(final)


def commit_files(staging: Path, final: Path, step: int, meta: dict[str, Any]) -> None:
    """Rank 0's part of the commit, no collectives: meta.json, manifest, marker, rename.

    Only once every rank's shards and DCP's `.metadata` are written and durable."""
    full_meta = {**meta, "step": step, "world_size": dist.get_world_size(), "saved_at": time.time()}
    _write_durable(staging / META, json.dumps(full_meta, indent=2, sort_keys=True).encode())
    manifest = _build_manifest(staging)
    _write_durable(staging / MANIFEST, json.dumps(manifest, indent=2).encode())
    _write_durable(staging / COMMIT_MARKER, f"step {step}\n".encode())
    os.replace(staging, final)
    parent = os.open(final.parent, os.O_RDONLY)  # the rename itself made durable
    try:
        os.fsync(parent)
    finally:
        os.close(parent)


def checkpoint_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


_DELETING = ".deleting"


def remove_committed(folder: Path) -> None:
    """Delete a committed checkpoint: one rename takes it out of the committed set first, so
    a process killed halfway leaves a `step_<N>.deleting` folder (removed by the next
    retention), never a torn `step_<N>` that still looks committed."""
    doomed = folder.with_name(folder.name + _DELETING)
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(folder, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def apply_retention(root: str | Path, keep_last: int, keep_every: int = 0) -> list[Path]:
    """Delete committed checkpoints beyond the newest `keep_last`, except every
    `keep_every`-th step (0 = none); never touches the newest one or *.tmp folders."""
    removed = [f for s, f in committed_steps(root)[max(1, keep_last) :] if keep_every <= 0 or s % keep_every]
    for folder in removed:
        with contextlib.suppress(OSError):
            remove_committed(folder)
    for leftover in Path(root).glob(f"step_*{_DELETING}"):  # a deletion a kill interrupted
        shutil.rmtree(leftover, ignore_errors=True)
    return removed


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Collective: restore model and optimizer shards and this rank's RNG; return meta + rank state."""
    folder = Path(path)
    _load_training_state(folder, model, optimizer)
    rank_file = folder / RANK_STATE_DIR / f"rank_{dist.get_rank()}.pt"
    rank_state: dict[str, Any] = {}
    if rank_file.is_file():  # absent when resharding to more ranks than were saved
        # The shared volume is writable by every pod of the namespace: never unpickle
        # arbitrary objects from it. A rank's state is tensors and numbers only.
        try:
            rank_state = torch.load(rank_file, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise CheckpointError(
                f"{rank_file} holds more than tensors and numbers; refusing to unpickle it "
                f"({str(exc).splitlines()[0]})"
            ) from None
        restore_rng(rank_state)
    return {"meta": read_meta(folder), "rank_state": rank_state}


def load_parent_state(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Collective: a warm start's weights and AdamW moments from the parent's checkpoint; the
    optimizer's hyperparameters (lr, warm-up start) stay this run's, and no RNG is restored."""
    fresh_groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    _load_training_state(path, model, optimizer)
    for group, fresh in zip(optimizer.param_groups, fresh_groups, strict=True):
        group.update(fresh)


def load_model_weights(path: str | Path, model: nn.Module) -> None:
    """Load the model part of a DCP checkpoint into a plain module, in one process, no group.
    Frozen parameters (a LoRA run's base, already in `model`) are not in it and stay."""
    frozen = frozen_parameter_names(model)
    state = {"model": {k: v for k, v in model.state_dict().items() if k not in frozen}}
    try:
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    except Exception as exc:  # DCP raises a bare CheckpointException listing rank errors
        raise CheckpointError(f"cannot load model weights from {path}: {exc}") from exc
    model.load_state_dict(state["model"], strict=not frozen)
