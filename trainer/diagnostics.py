"""What a rank leaves behind when an attempt is torn down: where each thread was, and the
recent collectives of its process groups.

Every rank records its collectives in torch's flight recorder (`enable_flight_recorder`,
before the process group exists: NCCL on GPUs, gloo on CPU). When the in-process layer
tears an attempt down (an exception, or a hang its watchdog noticed), each rank writes,
before its process groups are destroyed, into `<workdir>/diagnostics/<attempt>/`:

- `stacks_rank_<r>.txt`: every thread's Python stack (a hung rank's main thread shows
  where it stopped);
- `fr_rank_<r>`: the flight recorder's dump (a pickle), which torch's analyzer reads:
  `python -m torch.distributed.flight_recorder.fr_trace <folder> --prefix fr_rank_`
  says which ranks stopped at which collective. torch keeps two recorders: ProcessGroupNCCL
  records into its own (`_dump_nccl_trace`, CUDA builds only), gloo into the CPU one
  (`_dump_fr_trace`). On a GPU rank `fr_rank_<r>` is the NCCL one — the training
  collectives — and the gloo one (flags, object collectives, the checkpoint writers' groups)
  lies beside it as `fr_gloo_rank_<r>` (`--prefix fr_gloo_rank_`); on CPU `fr_rank_<r>` is
  gloo's. Each is written only where this torch has it.

Writing never fails the restart: a problem is logged and the restart goes on.
"""

from __future__ import annotations

import faulthandler
import logging
import os
from collections.abc import MutableMapping
from pathlib import Path

log = logging.getLogger(__name__)

FLIGHT_RECORDER_ENTRIES = 2000
"""Collectives kept per process (a ring buffer): a few steps of FSDP's per-layer collectives."""
FLIGHT_RECORDER_ENV = "TORCH_FR_BUFFER_SIZE"
"""torch's name for the buffer size. Its older NCCL-only name, TORCH_NCCL_TRACE_BUFFER_SIZE, is
still read (and a value a user gave there is kept) but torch warns once per rank when it is set."""
DEPRECATED_FLIGHT_RECORDER_ENV = "TORCH_NCCL_TRACE_BUFFER_SIZE"
FR_PREFIX = "fr_rank_"
"""The dump torch's analyzer reads by default: NCCL's on a GPU rank, gloo's on CPU."""
GLOO_FR_PREFIX = "fr_gloo_rank_"
"""On a GPU rank: the gloo half of the `cpu:gloo,cuda:nccl` group, beside the NCCL dump."""
STACKS_PREFIX = "stacks_rank_"
KEEP_TEARDOWNS = 5
"""Teardown folders kept per run (rank 0 removes older ones, `prune`): a dump per rank each, so a
long run on many ranks must not pile them up on the shared volume."""


def enable_flight_recorder(environ: MutableMapping[str, str] = os.environ) -> None:
    """Record collectives from the next process group on, unless the user chose a size."""
    if not environ.get(FLIGHT_RECORDER_ENV) and not environ.get(DEPRECATED_FLIGHT_RECORDER_ENV):
        environ[FLIGHT_RECORDER_ENV] = str(FLIGHT_RECORDER_ENTRIES)


def diagnostics_dir(workdir: str | Path, attempt: str) -> Path:
    return Path(workdir) / "diagnostics" / attempt


def dump_stacks(folder: Path, rank: int) -> bool:
    """Every thread's Python stack into `folder`; False when it could not be written (logged)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"{STACKS_PREFIX}{rank}.txt", "w") as handle:
            faulthandler.dump_traceback(file=handle, all_threads=True)
    except OSError as exc:
        log.warning("could not write this rank's stacks into %s: %s", folder, exc)
        return False
    return True


def dump_flight_recorder(folder: Path, rank: int) -> bool:
    """The flight recorders' dumps into `folder` (each written whole, then renamed): NCCL's
    as `fr_rank_<rank>` with gloo's beside it when the rank trains on CUDA (the device rule of
    trainer/parallelize.py), else gloo's as `fr_rank_<rank>`. False when none could be
    written (logged)."""
    import torch

    nccl = _recorder_dump("_dump_nccl_trace", rank) if torch.cuda.is_available() else None
    gloo = _recorder_dump("_dump_fr_trace", rank)
    dumps = {FR_PREFIX: nccl, GLOO_FR_PREFIX: gloo} if nccl is not None else {FR_PREFIX: gloo}
    wrote = False
    for prefix, trace in dumps.items():
        if trace is not None:
            wrote = _write_whole(folder, f"{prefix}{rank}", trace) or wrote
    return wrote


def _recorder_dump(name: str, rank: int) -> bytes | None:
    """One recorder's dump with its group table, or None: a torch without `name` (a CPU build
    has no `_dump_nccl_trace`, an older torch no `_dump_fr_trace`), or not recording."""
    import torch

    dump = getattr(torch._C._distributed_c10d, name, None)
    if dump is None:
        return None
    try:
        return _with_group_config(dump())
    except Exception as exc:  # not recording: the stacks are still there
        log.info("no %s dump for rank %d: %s", name, rank, exc)
        return None


def _write_whole(folder: Path, name: str, data: bytes) -> bool:
    staging = folder / f".{name}.partial"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        staging.write_bytes(data)
        staging.replace(folder / name)  # the analyzer never reads half a file
    except OSError as exc:
        log.warning("could not write this rank's flight recorder dump into %s: %s", folder, exc)
        return False
    return True


def _with_group_config(trace: bytes) -> bytes:
    """The dump with its process groups' names and ranks: NCCL registers them with the
    recorder, gloo does not, and torch's analyzer needs them; taken from torch's own table."""
    import pickle

    from torch.distributed import distributed_c10d as c10d

    dump = pickle.loads(trace)
    if any(dump.get("pg_config") or {}):
        return trace
    dump["pg_config"] = {
        name: {
            "name": name,
            "desc": getattr(group, "group_desc", "undefined"),
            "ranks": str(sorted(c10d._world.pg_group_ranks.get(group, {}))),
        }
        for group, name in c10d._world.pg_names.items()
    }
    return pickle.dumps(dump)


def prune(folder: Path, keep: int = KEEP_TEARDOWNS) -> None:
    """Remove all but the `keep` newest teardown folders beside `folder` (by modification
    time); rank 0 calls it, once the peers are released."""
    import shutil

    root = folder.parent
    try:
        folders = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    except OSError:  # none yet, or the volume does not answer: nothing to prune
        return
    for old in folders[: max(0, len(folders) - keep)]:
        shutil.rmtree(old, ignore_errors=True)
