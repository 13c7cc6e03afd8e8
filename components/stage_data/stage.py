"""Stage a source (S3 prefix or local folder) as an immutable, verified dataset snapshot.

The snapshot id is a hash of the source listing (key, size, ETag), so an unchanged prefix
maps to a snapshot that already exists and nothing is transferred (its files are only
checked against the manifest's size and mtime, or fully re-hashed with `verify_local=
"full"`; a damaged file is re-fetched). Files unchanged since the `current` snapshot are
hard-linked from it. Everything else is downloaded in parallel (ranged for large objects)
into `.staging/<id>/` under temporary names, verified against S3's checksums and renamed
(made durable all at once, by one `syncfs` of the destination);
the folder becomes `snapshots/<id>/` only when complete and durable, and `current` switches
atomically, so readers of an older snapshot are never disturbed. A killed stage resumes
from what is complete (files and ranges left by it are re-hashed, not trusted by size). In `repository` mode (an FSx data repository association already
shows the objects as files) nothing is copied: files are checked, pre-loaded with
`lfs hsm_restore` and hard-linked into the snapshot.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import posixpath
import queue
import shutil
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from components.layout import dataset_root
from components.stage_data.checksums import Expectation, verify_file_any_part_size
from components.stage_data.lustre import Lustre
from components.stage_data.progress import Progress
from components.stage_data.source import (
    LocalFolderClient,
    SourceObject,
    describe_object,
    list_local_folder,
    list_objects,
    parse_s3_uri,
    parse_source,
    s3_client,
    staging_client,
)
from components.stage_data.transfer import (
    Downloader,
    ObjectJob,
    SafeTree,
    StageError,
    TransferSettings,
    fsync_dir,
    sync_filesystem,
)

MANIFEST_NAME = "manifest.json"  # trainer.data.MANIFEST_NAME (not imported: it pulls in torch)

__all__ = [
    "SourceObject",
    "StageError",
    "StageResult",
    "TransferSettings",
    "parse_s3_uri",
    "relative_paths",
    "s3_client",
    "snapshot_id",
    "stage_dataset",
]

log = logging.getLogger(__name__)

MODES = ("copy", "repository")
S3_CLIENTS = ("lean", "botocore")  # see components/stage_data/lean_s3.py
VERIFY_LOCAL = ("stat", "full")
TEMP_SUFFIXES = (".part", ".part.ranges")


@dataclass(frozen=True, slots=True)
class StageResult:
    snapshot_dir: str
    snapshot_id: str
    manifest_sha256: str
    files: int
    bytes_total: int
    bytes_downloaded: int
    files_downloaded: int
    files_reused: int
    files_repaired: int
    seconds: float

    @property
    def mib_per_s(self) -> float:
        return self.bytes_downloaded / 2**20 / max(self.seconds, 1e-6)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mib_per_s": round(self.mib_per_s, 3)}


# ---------------------------------------------------------------- pure planning


def relative_paths(keys: Iterable[str], prefix: str) -> dict[str, str]:
    """Map each key to a safe relative path under the snapshot; refuse escapes and clashes."""
    mapping: dict[str, str] = {}
    seen: dict[str, str] = {}
    strip = prefix if prefix.endswith("/") or not prefix else prefix.rsplit("/", 1)[0] + "/"
    for key in keys:
        rest = key[len(strip) :] if key.startswith(strip) else key
        normalized = posixpath.normpath(rest)
        parts = normalized.split("/")
        if (
            rest.startswith("/")
            or normalized.startswith("..")
            or normalized in (".", "")
            or "\x00" in rest
            or any(p in ("..",) for p in rest.split("/"))
        ):
            raise StageError(f"S3 key {key!r} would be written outside the dataset folder; rename it")
        if normalized == MANIFEST_NAME or any(p.endswith(TEMP_SUFFIXES) for p in parts):
            raise StageError(f"S3 key {key!r} collides with a name staging uses itself; rename it")
        folded = normalized.lower()
        if folded in seen:
            raise StageError(f"S3 keys {seen[folded]!r} and {key!r} map to the same file; rename one")
        seen[folded] = key
        mapping[key] = normalized
    # A key that is also another key's folder ("a" and "a/b") cannot both be files.
    folders = {posixpath.dirname(p).lower() for p in mapping.values()}
    for key, path in mapping.items():
        if path.lower() in folders:
            raise StageError(f"S3 key {key!r} is both a file and the folder of other keys; rename it")
    return mapping


def snapshot_id(objects: list[SourceObject]) -> str:
    listing = "".join(f"{o.key}\t{o.size}\t{o.etag}\n" for o in sorted(objects, key=lambda o: o.key))
    return hashlib.sha256(listing.encode()).hexdigest()[:16]


def _entry_expectation(entry: dict[str, Any]) -> Expectation:
    return Expectation(
        int(entry["size"]),
        entry["etag"],
        entry.get("checksum_algorithm", ""),
        entry.get("checksum", ""),
        int(entry.get("part_size", 0)),
    )


def local_file_damage(folder: Path, entry: dict[str, Any], verify_local: str) -> str:
    """'' when the snapshot file still is what the manifest says, else what is wrong."""
    path = folder / entry["path"]
    try:
        info = path.lstat()
    except FileNotFoundError:
        return "missing"
    if not path.is_file() or path.is_symlink():
        return "not a regular file"
    if info.st_size != int(entry["size"]):
        return f"size {info.st_size} != {entry['size']}"
    if verify_local == "full":
        return verify_file_any_part_size(path, _entry_expectation(entry))
    if "mtime_ns" in entry and info.st_mtime_ns != int(entry["mtime_ns"]):
        return "modified since it was staged (mtime changed)"
    return ""


# ---------------------------------------------------------------- I/O


def _read_manifest(folder: Path) -> dict[str, Any] | None:
    path = folder / MANIFEST_NAME
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def manifest_text(manifest: dict[str, Any]) -> str:
    """The manifest as JSON with one file entry per line: readable and diffable, yet written by
    json's C encoder (`indent=` would switch to the pure-Python one, ~10x slower for big listings)."""
    head = {k: v for k, v in manifest.items() if k != "files"}
    lines = [json.dumps(entry, separators=(",", ":")) for entry in manifest["files"]]
    opening = json.dumps(head)[:-1] + ", " if head else "{"
    return opening + '"files": [\n' + ",\n".join(lines) + "\n]}\n"


def _write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    tmp = folder / f".{MANIFEST_NAME}.tmp"
    with tmp.open("w") as handle:
        handle.write(manifest_text(manifest))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, folder / MANIFEST_NAME)
    fsync_dir(folder)


def _switch_current(root: Path, snapshot: str) -> None:
    link = root / "current"
    tmp = root / f".current.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(Path("snapshots") / snapshot, tmp)
    os.replace(tmp, link)
    fsync_dir(root)


def _previous_files(current: Path) -> dict[tuple[str, int, str], tuple[Path, dict[str, Any]]]:
    manifest = _read_manifest(current) if current.is_dir() else None
    if manifest is None:
        return {}
    return {
        (e["key"], int(e["size"]), e["etag"]): (current.resolve() / e["path"], e) for e in manifest["files"]
    }


def _left_by_earlier_attempt(target: Path, obj: SourceObject) -> bool:
    """Whether an interrupted attempt already finished this file (only verified files get final names).

    Files are not fsynced one by one (one syncfs covers them at commit), so after a crash a
    file may have its final name but not its bytes: it is re-hashed, which reads the disk but
    downloads nothing.
    """
    if not target.is_file() or target.is_symlink() or target.stat().st_size != obj.size:
        return False
    expectation = obj.expectation()
    if expectation.algorithm and not expectation.checksum:  # the listing names it, only a GET gives it
        expectation = replace(expectation, algorithm="")
    if not expectation.checkable() and not expectation.needs_parts():
        return False  # nothing to check it against: fetch it again
    return not verify_file_any_part_size(target, expectation)


def _check_free_space(folder: Path, needed_bytes: int) -> None:
    free = shutil.disk_usage(folder).free
    if needed_bytes > free:
        raise StageError(
            f"the destination has {free / 2**30:.2f} GiB free but this stage needs {needed_bytes / 2**30:.2f} GiB: "
            "free space on the volume, grow the FSx file system, or stage a smaller prefix"
        )


def _link_or_copy(old: Path, target: Path) -> None:
    try:
        os.link(old, target, follow_symlinks=False)
    except OSError as exc:
        if exc.errno == errno.EEXIST:
            target.unlink()
            os.link(old, target, follow_symlinks=False)
        else:
            shutil.copy2(old, target, follow_symlinks=False)


def _describe_all(
    client: Any,
    bucket: str,
    objects: list[SourceObject],
    pool: ThreadPoolExecutor,
    settings: TransferSettings,
) -> list[SourceObject]:
    """HEAD the objects whose verification needs more than the listing (multipart, large + checksum)."""
    need = [
        i
        for i, o in enumerate(objects)
        if "-" in o.etag or (o.checksum_algorithm and o.size >= settings.multipart_threshold_bytes)
    ]
    described = list(objects)
    futures = {i: pool.submit(describe_object, client, bucket, objects[i], settings) for i in need}
    for i, future in futures.items():
        described[i] = future.result()
    return described


def _run_downloads(
    downloader: Downloader, jobs: list[ObjectJob], pool: ThreadPoolExecutor, progress: Progress
) -> None:
    """Run every job's GETs on the pool; ranged jobs are finished by whoever ends their last range.

    Finished work items come back through a queue (each future's done-callback puts it
    there): `concurrent.futures.wait` over thousands of pending futures re-registers a
    waiter on every one of them per call, which costs more CPU than the small GETs do.
    """
    finished: queue.SimpleQueue[tuple[Future[Any], str, ObjectJob]] = queue.SimpleQueue()
    pending: set[Future[Any]] = set()

    def submit(kind: str, job: ObjectJob, call: Any, *args: Any) -> None:
        future = pool.submit(call, job, *args)
        pending.add(future)
        future.add_done_callback(lambda f: finished.put((f, kind, job)))

    def start(job: ObjectJob) -> None:
        downloader.plan(job)
        if not job.parallel:
            submit("whole", job, downloader.fetch_whole)
            return
        downloader.open_partial(job)
        todo = job.pending_ranges()
        if not todo:
            submit("finish", job, downloader.finish_ranged)
        for index in todo:
            submit("range", job, downloader.fetch_range, index)

    for job in jobs:
        start(job)
    try:
        while pending:
            future, kind, job = finished.get()
            pending.discard(future)
            value = future.result()  # re-raises StageError from the worker
            if kind == "whole":
                progress.add_file()
            elif kind == "range" and value:
                submit("finish", job, downloader.finish_ranged)
            elif kind == "finish":
                if not value:
                    progress.add_file()
                    continue
                job.attempts_left -= 1
                log.warning("s3://%s/%s failed verification (%s)", job.bucket, job.key, value)
                if job.attempts_left <= 0:
                    raise StageError(
                        f"s3://{job.bucket}/{job.key} did not match its size/checksum after "
                        f"{downloader.settings.verify_attempts} attempts ({value}): the object may be "
                        "changing or the network corrupting data; re-run the stage"
                    )
                attempts = job.attempts_left
                start(job)
                job.attempts_left = attempts
    except BaseException:
        for future in pending:
            future.cancel()
        raise


def stage_dataset(
    source: str,
    fsx_mount_path: str,
    dataset_name: str,
    endpoint_url: str | None = None,
    max_workers: int | None = None,
    client: Any = None,
    *,
    settings: TransferSettings | None = None,
    mode: str = "copy",
    repository_dir: str = "",
    verify_local: str = "stat",
    progress_stream: Any = None,
    s3_client_kind: str = "lean",
) -> StageResult:
    """Stage `source` (s3://bucket/prefix or a local folder) as a snapshot of dataset `dataset_name`."""
    started = time.perf_counter()
    if mode not in MODES:
        raise StageError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    if verify_local not in VERIFY_LOCAL:
        raise StageError(f"verify_local {verify_local!r} is not one of {', '.join(VERIFY_LOCAL)}")
    if s3_client_kind not in S3_CLIENTS:
        raise StageError(f"s3_client_kind {s3_client_kind!r} is not one of {', '.join(S3_CLIENTS)}")
    settings = settings or (TransferSettings(max_workers=max_workers) if max_workers else TransferSettings())
    parsed = parse_source(source)
    if parsed.kind == "local":
        client = LocalFolderClient()
        objects = list_local_folder(parsed.bucket)
    else:
        if client is None and s3_client_kind == "lean":
            from components.stage_data.lean_s3 import LeanS3Client

            client = LeanS3Client(endpoint_url, max_pool_connections=settings.max_workers + 8)
        client = client or staging_client(endpoint_url, max_pool_connections=settings.max_workers + 8)
        objects = list_objects(client, parsed.bucket, parsed.prefix)
    paths = relative_paths((o.key for o in objects), parsed.prefix)
    snap = snapshot_id(objects)
    root = dataset_root(fsx_mount_path, dataset_name)
    if root.is_symlink():
        raise StageError(
            f"{root} is a symlink; staging never follows links: point --fsx-mount-path at the volume"
        )
    root.mkdir(parents=True, exist_ok=True)
    lustre = Lustre()
    lustre.say_once_if_absent()
    final = root / "snapshots" / snap

    with ThreadPoolExecutor(max_workers=settings.max_workers, thread_name_prefix="stage") as pool:
        existing = _read_manifest(final)
        if existing is not None:
            return _recheck_snapshot(
                parsed.bucket,
                client,
                pool,
                settings,
                root,
                final,
                snap,
                existing,
                verify_local,
                started,
                progress_stream,
            )

        staging = root / ".staging" / snap
        tree = SafeTree(root)
        tree.ensure_dir(staging)
        tree = SafeTree(staging)
        previous = _previous_files(root / "current")
        todo: list[SourceObject] = []
        reused = 0
        for obj in objects:
            target = tree.target(paths[obj.key])
            if _left_by_earlier_attempt(target, obj):
                reused += 1
                continue
            old = previous.get((obj.key, obj.size, obj.etag))
            if (
                old is not None
                and mode == "copy"
                and not local_file_damage(old[0].parent, {**old[1], "path": old[0].name}, "stat")
            ):
                _link_or_copy(old[0], target)
                reused += 1
                continue
            todo.append(obj)

        if mode == "repository":
            downloaded_files = _link_from_repository(
                Path(repository_dir), todo, paths, tree, lustre, verify_local
            )
            downloaded, fetched = 0, todo
        else:
            downloaded, fetched = _download_all(
                parsed.bucket, client, pool, settings, todo, paths, tree, lustre, progress_stream, staging
            )
            downloaded_files = len(fetched)
        described = {o.key: o for o in fetched}
        entries = []
        for obj in sorted(objects, key=lambda o: o.key):
            obj = described.get(obj.key, obj)
            target = staging / paths[obj.key]
            entry: dict[str, Any] = {
                "key": obj.key,
                "size": obj.size,
                "etag": obj.etag,
                "path": paths[obj.key],
            }
            if obj.checksum_algorithm and obj.checksum:
                entry |= {"checksum_algorithm": obj.checksum_algorithm, "checksum": obj.checksum}
            if obj.part_size:
                entry["part_size"] = obj.part_size
            entry["mtime_ns"] = target.stat().st_mtime_ns
            entries.append(entry)
        sync_filesystem(staging)  # every file durable before the snapshot can become `current`
        manifest = {
            "source": source,
            "snapshot_id": snap,
            "staged_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "files_count": len(entries),
            "bytes_total": sum(o.size for o in objects),
            "files": entries,
        }
        _write_manifest(staging, manifest)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging, final)
        fsync_dir(final.parent)
        _switch_current(root, snap)
    return _result(final, snap, objects, downloaded, downloaded_files, reused, 0, started)


def _download_all(
    bucket: str,
    client: Any,
    pool: ThreadPoolExecutor,
    settings: TransferSettings,
    todo: list[SourceObject],
    paths: dict[str, str],
    tree: SafeTree,
    lustre: Lustre,
    progress_stream: Any,
    folder: Path,
) -> tuple[int, list[SourceObject]]:
    total = sum(o.size for o in todo)
    _check_free_space(folder, total)
    described = (
        _describe_all(client, bucket, todo, pool, settings)
        if not isinstance(client, LocalFolderClient)
        else todo
    )
    log.info("staging: %d objects to download (%.1f MiB)", len(described), total / 2**20)
    progress = Progress(total, len(described), stream=progress_stream)
    downloader = Downloader(
        client, settings, on_bytes=progress.add_bytes, prepare_large_file=lustre.stripe_new_file
    )
    jobs = [ObjectJob(bucket, o.key, o.expectation(), tree.target(paths[o.key])) for o in described]
    try:
        _run_downloads(downloader, jobs, pool, progress)
    finally:
        progress.close()
    return total, described


def _link_from_repository(
    repository: Path,
    todo: list[SourceObject],
    paths: dict[str, str],
    tree: SafeTree,
    lustre: Lustre,
    verify_local: str,
) -> int:
    """Data-repository mode: the objects are already files under `repository`; check, pre-load, link."""
    if not repository.is_dir():
        raise StageError(
            f"repository folder {repository} does not exist: give the FSx path that the data repository "
            "association links to the source prefix"
        )
    files = [(o, repository / paths[o.key]) for o in todo]
    for obj, path in files:
        if path.is_symlink() or not path.is_file():
            raise StageError(f"{path} (for s3 key {obj.key}) is missing from the data repository folder")
        if path.stat().st_size != obj.size:
            raise StageError(f"{path} is {path.stat().st_size} bytes but s3 key {obj.key} is {obj.size}")
    lustre.hsm_restore([p for _, p in files])
    for obj, path in files:
        if verify_local == "full":
            reason = verify_file_any_part_size(path, obj.expectation())
            if reason:
                raise StageError(
                    f"{path} does not match s3 key {obj.key} ({reason}): re-import the repository"
                )
        target = tree.target(paths[obj.key])
        try:
            os.link(path, target, follow_symlinks=False)
        except FileExistsError:
            pass
        except OSError as exc:
            raise StageError(
                f"cannot hard-link {path} into the snapshot ({exc.strerror}): the repository folder must be on "
                "the same file system as --fsx-mount-path"
            ) from exc
    return len(files)


def _recheck_snapshot(
    bucket: str,
    client: Any,
    pool: ThreadPoolExecutor,
    settings: TransferSettings,
    root: Path,
    final: Path,
    snap: str,
    manifest: dict[str, Any],
    verify_local: str,
    started: float,
    progress_stream: Any,
) -> StageResult:
    """The snapshot exists: transfer nothing unless a file in it was damaged, then re-fetch that one."""
    damaged = []
    for entry in manifest["files"]:
        reason = local_file_damage(final, entry, verify_local)
        if reason:
            log.warning("%s in snapshot %s: %s; fetching it again", entry["path"], snap, reason)
            damaged.append(entry)
    downloaded = 0
    if damaged:
        tree = SafeTree(final)
        objects = [
            SourceObject(
                e["key"],
                int(e["size"]),
                e["etag"],
                e.get("checksum_algorithm", ""),
                e.get("checksum", ""),
                int(e.get("part_size", 0)),
            )
            for e in damaged
        ]
        progress = Progress(sum(o.size for o in objects), len(objects), stream=progress_stream)
        downloader = Downloader(client, settings, on_bytes=progress.add_bytes)
        jobs = []
        for obj, entry in zip(objects, damaged, strict=True):
            target = tree.target(entry["path"])
            target.unlink(missing_ok=True)  # break a hard link shared with other snapshots first
            jobs.append(ObjectJob(bucket, obj.key, obj.expectation(), target))
        try:
            _run_downloads(downloader, jobs, pool, progress)
        finally:
            progress.close()
        for entry in damaged:
            entry["mtime_ns"] = (final / entry["path"]).stat().st_mtime_ns
        sync_filesystem(final)
        _write_manifest(final, manifest)
        downloaded = sum(o.size for o in objects)
    else:
        log.info("snapshot %s already staged and intact: nothing to transfer", snap)
    _switch_current(root, snap)
    listed = [SourceObject(e["key"], int(e["size"]), e["etag"]) for e in manifest["files"]]
    return _result(
        final, snap, listed, downloaded, len(damaged), len(listed) - len(damaged), len(damaged), started
    )


def _result(
    folder: Path,
    snap: str,
    objects: list[SourceObject],
    downloaded: int,
    downloaded_files: int,
    reused: int,
    repaired: int,
    started: float,
) -> StageResult:
    return StageResult(
        snapshot_dir=str(folder),
        snapshot_id=snap,
        manifest_sha256=hashlib.sha256((folder / MANIFEST_NAME).read_bytes()).hexdigest(),
        files=len(objects),
        bytes_total=sum(o.size for o in objects),
        bytes_downloaded=downloaded,
        files_downloaded=downloaded_files,
        files_reused=reused,
        files_repaired=repaired,
        seconds=time.perf_counter() - started,
    )
