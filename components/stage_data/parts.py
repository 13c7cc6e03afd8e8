"""Staging across workers: N parts each fetch a share of the listing, one finisher commits.

`stage_part(index, count)` lists the source like a single stage, takes its share of the
objects (`assign_parts`: the largest first, each to the part with the fewest bytes so far, so
a few big objects do not all land on one worker, and every worker computes the same split
from the same listing), fetches and verifies it into the shared `.staging/<id>/` folder,
makes its files durable from its own node (`syncfs`: another node's sync cannot flush them)
and writes a part record `.staging/<id>.parts/<index>-of-<count>.json`. A part that failed
is retried alone: it keeps the files it had finished. `finish_stage(count)` lists again,
requires a record of the same snapshot from every part, checks that they cover the listing
and that each file is on the volume, and commits the snapshot (manifest, `current`) as a
single stage does; an unchanged prefix is re-checked there, and the parts do nothing.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import json
import os
import stat
from pathlib import Path
from typing import Any

from components.stage_data.errors import StageError
from components.stage_data.fs_safety import fsync_dir, sync_filesystem
from components.stage_data.snapshot_store import chunked, entry_object, manifest_entry, read_manifest, results
from components.stage_data.source import SourceObject
from components.stage_data.stage import (
    StageResult,
    download_all,
    keep_what_is_already_there,
    open_stage,
    recheck_snapshot,
)

PART_RECORD_VERSION = 1


def assign_parts(objects: list[SourceObject], count: int) -> list[list[SourceObject]]:
    """The objects of each of `count` parts: balanced by bytes, the same on every worker."""
    parts: list[list[SourceObject]] = [[] for _ in range(count)]
    loads = [(0, index) for index in range(count)]
    for obj in sorted(objects, key=lambda o: (-o.size, o.key)):
        load, index = heapq.heappop(loads)
        parts[index].append(obj)
        heapq.heappush(loads, (load + obj.size, index))
    return parts


def _check_part(index: int, count: int) -> None:
    if count < 1 or not 0 <= index < count:
        raise StageError(f"part {index} of {count}: give 0 <= part < parts, with parts >= 1")


def _records_dir(run: Any) -> Path:
    return run.store.staging_dir(run.snapshot_id).with_name(f"{run.snapshot_id}.parts")


def _record_path(run: Any, index: int, count: int) -> Path:
    return _records_dir(run) / f"{index}-of-{count}.json"


def stage_part(
    source: str, fsx_mount_path: str, dataset_name: str, index: int, count: int, **options: Any
) -> dict[str, Any]:
    """Fetch part `index` of `count` of the snapshot into its staging folder and record it;
    returns the record (`already_staged` when the snapshot exists: the finisher re-checks it)."""
    _check_part(index, count)
    with open_stage(source, fsx_mount_path, dataset_name, **options) as (run, objects):
        if read_manifest(run.store.snapshot_dir(run.snapshot_id)) is not None:
            return {"snapshot_id": run.snapshot_id, "part": index, "parts": count, "already_staged": True}
        mine = assign_parts(objects, count)[index]
        tree = run.store.staging_tree(run.snapshot_id)
        todo, reused = keep_what_is_already_there(run, mine, tree, link_from_current=True)
        downloaded, fetched = download_all(run, todo, tree)
        described = {o.key: o for o in fetched}
        sync_filesystem(tree.root)  # this node's writes durable before the record says done
        record = {
            "version": PART_RECORD_VERSION,
            "snapshot_id": run.snapshot_id,
            "part": index,
            "parts": count,
            "bytes_downloaded": downloaded,
            "files_downloaded": len(fetched),
            "files_reused": reused,
            "files": [manifest_entry(described.get(o.key, o), run.paths[o.key], 0) for o in mine],
        }
        folder = _records_dir(run)
        folder.mkdir(exist_ok=True)
        path = _record_path(run, index, count)
        staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        staging.write_text(json.dumps(record))
        with staging.open("rb") as handle:
            os.fsync(handle.fileno())
        os.replace(staging, path)
        fsync_dir(folder)
        return record


def _staged(
    staging: str, paths: dict[str, str], items: list[tuple[str, SourceObject]]
) -> tuple[list[tuple[str, str]], dict[str, int]]:
    """(path, key) of each item whose staged file is absent, not a regular file or of another
    size, and the others' modification times by key: one `lstat` each (a metadata round trip
    on FSx, so `chunked` may spread them, and the commit reads no file's again)."""
    bad, mtimes = [], {}
    for key, obj in items:
        path = os.path.join(staging, paths[key])
        try:
            info = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            bad.append((path, key))
            continue
        if not stat.S_ISREG(info.st_mode) or info.st_size != obj.size:
            bad.append((path, key))
        else:
            mtimes[key] = info.st_mtime_ns
    return bad, mtimes


def finish_stage(
    source: str, fsx_mount_path: str, dataset_name: str, count: int, **options: Any
) -> StageResult:
    """Commit the snapshot the `count` parts fetched (or re-check the existing one)."""
    _check_part(0, count)
    with open_stage(source, fsx_mount_path, dataset_name, **options, check_current=True) as (run, objects):
        rechecked = recheck_snapshot(run)
        if rechecked is not None:
            return rechecked
        records = []
        for index in range(count):
            path = _record_path(run, index, count)
            if not path.is_file():
                raise StageError(
                    f"part {index} of {count} of snapshot {run.snapshot_id} has no record ({path}): it did not "
                    "finish, or it listed another snapshot because the source changed meanwhile; run that part "
                    "again (it keeps what it fetched), then finish"
                )
            records.append(json.loads(path.read_text()))
        described = {e["key"]: entry_object(e) for record in records for e in record["files"]}
        listed = {o.key: o for o in objects}
        if described.keys() != listed.keys() or any(
            (d.size, d.etag) != (listed[k].size, listed[k].etag) for k, d in described.items()
        ):
            raise StageError(
                f"the {count} parts' records do not cover the listing of snapshot {run.snapshot_id}: stage "
                "every part again with the same number of parts"
            )
        staging = str(run.store.staging_dir(run.snapshot_id))
        check = functools.partial(_staged, staging, run.paths)
        bad: list[tuple[str, str]] = []
        mtimes: dict[str, int] = {}
        for chunk_bad, chunk_mtimes in results(chunked(check, list(described.items()), run.pool)):
            bad += chunk_bad
            mtimes |= chunk_mtimes
        if bad:
            owner = {e["key"]: r["part"] for r in records for e in r["files"]}
            rerun = ", ".join(str(i) for i in sorted({owner[key] for _, key in bad}))
            more = f" and {len(bad) - 1} more file(s) are" if len(bad) > 1 else " is"
            raise StageError(
                f"{bad[0][0]} (s3 key {bad[0][1]}){more} missing or incomplete: run part(s) {rerun} of "
                f"{count} again (each keeps what is intact), then finish"
            )
        run.store.commit(
            run.snapshot_id, source, [described[o.key] for o in objects], run.paths, mtimes=mtimes
        )
        for index in range(count):
            _record_path(run, index, count).unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # a stray temporary of a killed part stays
            _records_dir(run).rmdir()
    return run.result(
        objects,
        bytes_downloaded=sum(r["bytes_downloaded"] for r in records),
        files_downloaded=sum(r["files_downloaded"] for r in records),
        files_reused=sum(r["files_reused"] for r in records),
        files_repaired=0,
    )
