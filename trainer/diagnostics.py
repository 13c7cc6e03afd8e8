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
  says which ranks stopped at which collective.

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
    """The flight recorder's dump into `folder` (written whole, then renamed); False when
    there is none or it could not be written (logged)."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace  # type: ignore[attr-defined]

        trace = _with_group_config(_dump_fr_trace())
    except Exception as exc:  # not recording, or a torch without it: the stacks are still there
        log.info("no flight recorder dump for rank %d: %s", rank, exc)
        return False
    staging = folder / f".{FR_PREFIX}{rank}.partial"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        staging.write_bytes(trace)
        staging.replace(folder / f"{FR_PREFIX}{rank}")  # the analyzer never reads half a file
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
