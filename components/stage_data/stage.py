"""Stage a source (S3 prefix or local folder) as an immutable, verified dataset snapshot.

`stage_dataset` is the step from top to bottom: parse and list the source, name the
snapshot after the listing, and either re-check the snapshot that already exists (an
unchanged prefix transfers nothing; a damaged file is fetched again) or build a new one:
files an interrupted attempt finished and files unchanged since `current` are kept
(hard-linked), everything else is downloaded in parallel (transfer.py) into
`.staging/<id>/` and verified, and the store commits the folder as `snapshots/<id>/` and
switches `current` (snapshot_store.py). In `repository` mode (an FSx data repository
association already shows the objects as files) nothing is copied: files are checked,
pre-loaded with `lfs hsm_restore` and hard-linked into the snapshot. What one stage works
with is carried by a `StageRun`; the modules beside this one each own one concern (source,
s3_clients, settings, transfer, fs_safety, snapshot_store, checksums, progress, lustre).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from components.layout import snapshot_root
from components.stage_data.checksums import verify_file_any_part_size
from components.stage_data.errors import StageError
from components.stage_data.fs_safety import SafeTree, check_free_space, link_or_copy
from components.stage_data.lustre import Lustre
from components.stage_data.progress import Progress
from components.stage_data.s3_clients import S3_CLIENTS, s3_client
from components.stage_data.settings import TransferSettings
from components.stage_data.snapshot_store import (
    MANIFEST_NAME,
    VERIFY_LOCAL,
    FileCheck,
    SnapshotStore,
    chunked,
    entry_object,
    finished_by_earlier_attempt,
    local_file_damage,
    relative_paths,
    results,
    snapshot_id,
)
from components.stage_data.source import (
    LocalFolderClient,
    Source,
    SourceObject,
    describe_all,
    describe_from_head,
    list_local_folder,
    list_objects,
    parse_s3_uri,
    parse_source,
)
from components.stage_data.transfer import Downloader, ObjectJob, run_downloads

# Names other code imports from here (pipelines/, benchmarks/, tests/) stay importable.
__all__ = [
    "MANIFEST_NAME",
    "MODES",
    "S3_CLIENTS",
    "VERIFY_LOCAL",
    "SourceObject",
    "StageError",
    "StageResult",
    "StageRun",
    "TransferSettings",
    "parse_s3_uri",
    "relative_paths",
    "s3_client",
    "snapshot_id",
    "stage_dataset",
]

log = logging.getLogger(__name__)

MODES = ("copy", "repository")


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


@dataclass(kw_only=True, slots=True)
class StageRun:
    """What one stage works with, built once by `stage_dataset` and handed to each of its steps."""

    source: Source
    """The parsed --source: `bucket` is the folder for a local source."""
    client: Any
    """Answers list/HEAD/GET: an S3 client from `s3_client`, or a `LocalFolderClient`."""
    settings: TransferSettings
    pool: ThreadPoolExecutor
    """The one pool every HEAD and GET of the stage runs on."""
    store: SnapshotStore
    snapshot_id: str
    paths: dict[str, str]
    """Each key's path relative to the snapshot folder."""
    lustre: Lustre
    verify_local: str
    """How files already on the volume are checked: "stat" (size + mtime) or "full" (re-hash)."""
    progress_stream: Any
    """Where the progress bar goes (None: stderr)."""
    started: float
    """time.perf_counter() when the stage began."""
    current_check: FileCheck | None = None
    """The size-and-mtime check of `current`'s files, started before the listing."""

    def fetch(
        self, objects_and_targets: list[tuple[SourceObject, Path]], *, stripe_large_files: bool
    ) -> dict[str, str]:
        """Download each object into its target, verified, with one progress display for them all.

        Returns key -> encryption for the objects whose GET showed an ETag that is no MD5.
        """
        objects = [obj for obj, _ in objects_and_targets]
        progress = Progress(sum(o.size for o in objects), len(objects), stream=self.progress_stream)
        downloader = Downloader(
            self.client,
            self.settings,
            on_bytes=progress.add_bytes,
            prepare_large_file=self.lustre.stripe_new_file if stripe_large_files else lambda path: None,
        )
        jobs = [ObjectJob(self.source.bucket, o.key, o.expectation(), t) for o, t in objects_and_targets]
        try:
            run_downloads(downloader, jobs, self.pool, progress)
        finally:
            progress.close()
        if downloader.size_only and self.source.kind == "s3":
            say_size_only_once(downloader.size_only)
        return downloader.encrypted

    def result(
        self,
        objects: list[SourceObject],
        *,
        bytes_downloaded: int,
        files_downloaded: int,
        files_reused: int,
        files_repaired: int,
    ) -> StageResult:
        folder = self.store.snapshot_dir(self.snapshot_id)
        return StageResult(
            snapshot_dir=str(folder),
            snapshot_id=self.snapshot_id,
            manifest_sha256=hashlib.sha256((folder / MANIFEST_NAME).read_bytes()).hexdigest(),
            files=len(objects),
            bytes_total=sum(o.size for o in objects),
            bytes_downloaded=bytes_downloaded,
            files_downloaded=files_downloaded,
            files_reused=files_reused,
            files_repaired=files_repaired,
            seconds=time.perf_counter() - self.started,
        )


@contextlib.contextmanager
def open_stage(
    source: str,
    fsx_mount_path: str,
    dataset_name: str,
    endpoint_url: str | None = None,
    max_workers: int | None = None,
    client: Any = None,
    *,
    settings: TransferSettings | None = None,
    mode: str = "copy",
    verify_local: str = "stat",
    progress_stream: Any = None,
    s3_client_kind: str = "lean",
    collection: str = "datasets",
    check_current: bool = False,
) -> Iterator[tuple[StageRun, list[SourceObject]]]:
    """Check the arguments, list the source, name the snapshot and open its store: the
    `StageRun` and the listed objects, for the time of the block (its pool stays open).

    With `check_current`, the files of the snapshot `current` points at are checked (size
    and mtime) on the pool while the source is listed: an unchanged source re-checks
    exactly them, and a changed one links the intact ones. Their keys split the listing
    into key ranges listed in parallel on the pool (`source.list_objects`)."""
    started = time.perf_counter()
    if mode not in MODES:
        raise StageError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    if verify_local not in VERIFY_LOCAL:
        raise StageError(f"verify_local {verify_local!r} is not one of {', '.join(VERIFY_LOCAL)}")
    if s3_client_kind not in S3_CLIENTS:
        raise StageError(f"s3_client_kind {s3_client_kind!r} is not one of {', '.join(S3_CLIENTS)}")
    settings = settings or (TransferSettings(max_workers=max_workers) if max_workers else TransferSettings())
    parsed = parse_source(source)
    with ThreadPoolExecutor(max_workers=settings.max_workers, thread_name_prefix="stage") as pool:
        try:
            current_check = (
                _start_current_check(fsx_mount_path, collection, dataset_name, pool)
                if check_current
                else None
            )
            if parsed.kind == "local":
                client = LocalFolderClient()
                objects = list_local_folder(parsed.bucket)
            else:
                if client is None:
                    client = s3_client(endpoint_url, settings.max_workers + 8, kind=s3_client_kind)
                # The current snapshot's keys split the listing into ranges listed at once.
                known = sorted(e["key"] for e in current_check.manifest["files"]) if current_check else []
                objects = list_objects(client, parsed.bucket, parsed.prefix, known, pool)
            paths = relative_paths((o.key for o in objects), parsed.prefix)
            store = SnapshotStore.open(fsx_mount_path, dataset_name, collection)
            lustre = Lustre()
            lustre.check_destination(store.root)
        except BaseException:
            pool.shutdown(cancel_futures=True)  # an error is reported without waiting for the check
            raise
        yield (
            StageRun(
                source=parsed,
                client=client,
                settings=settings,
                pool=pool,
                store=store,
                snapshot_id=snapshot_id(objects),
                paths=paths,
                lustre=lustre,
                verify_local=verify_local,
                progress_stream=progress_stream,
                started=started,
                current_check=current_check,
            ),
            objects,
        )


def _start_current_check(
    fsx_mount_path: str, collection: str, dataset_name: str, pool: ThreadPoolExecutor
) -> FileCheck | None:
    """The size-and-mtime check of `current`'s files, started on `pool` (None: no `current`).
    Reads only: the store is opened (and checked) after the listing."""
    root = snapshot_root(fsx_mount_path, collection, dataset_name)
    if root.is_symlink():
        return None  # SnapshotStore.open refuses it
    store = SnapshotStore(root)
    current = store.current_snapshot()
    return None if current is None else store.start_check(current, "stat", pool)


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
    collection: str = "datasets",
) -> StageResult:
    """Stage `source` (s3://bucket/prefix or a local folder) as a snapshot of dataset `dataset_name`
    (or, with collection="models", of the model folder of that name)."""
    with open_stage(
        source, fsx_mount_path, dataset_name, endpoint_url, max_workers, client, settings=settings, mode=mode,
        verify_local=verify_local, progress_stream=progress_stream, s3_client_kind=s3_client_kind,
        collection=collection, check_current=True,
    ) as (run, objects):  # fmt: skip
        snap, store = run.snapshot_id, run.store
        rechecked = recheck_snapshot(run)
        if rechecked is not None:
            return rechecked

        tree = store.staging_tree(snap)
        todo, reused = keep_what_is_already_there(run, objects, tree, link_from_current=mode == "copy")
        if mode == "repository":
            fetched = _link_from_repository(run, Path(repository_dir), todo, tree)
            downloaded, downloaded_files = 0, len(fetched)
        else:
            downloaded, fetched = download_all(run, todo, tree)
            downloaded_files = len(fetched)
        described = {o.key: o for o in fetched}
        store.commit(snap, source, [described.get(o.key, o) for o in objects], run.paths, run.pool)
    return run.result(
        objects,
        bytes_downloaded=downloaded,
        files_downloaded=downloaded_files,
        files_reused=reused,
        files_repaired=0,
    )


def say_size_only_once(size_only: dict[str, str]) -> None:
    """One notice line per stage for the objects that could be checked by size alone."""
    key, why = next(iter(sorted(size_only.items())))
    others = f" and {len(size_only) - 1} more" if len(size_only) > 1 else ""
    log.warning(
        "notice: %s%s checked by size only (%s, and no additional checksum); upload with "
        "--checksum-algorithm SHA256 (or CRC32C) to have such objects verified in full",
        key,
        others,
        why,
    )


def keep_what_is_already_there(
    run: StageRun, objects: list[SourceObject], tree: SafeTree, *, link_from_current: bool
) -> tuple[list[SourceObject], int]:
    """Keep files an interrupted attempt finished and (copy mode) link those unchanged since
    `current`; returns the objects still to fetch and how many were kept. In chunks, on the
    pool where files are slow to check (on FSx each costs metadata round trips, a resumed
    one a re-hash)."""
    previous = run.store.previous_files() if link_from_current else {}
    checked = run.current_check
    damaged = (
        {entry["path"] for entry, _ in checked.damaged()}
        if checked is not None and checked.snap == run.store.current_snapshot()
        else None
    )

    def keep(chunk: list[SourceObject]) -> list[SourceObject]:
        todo = []
        for obj in chunk:
            target = tree.target(run.paths[obj.key])
            if finished_by_earlier_attempt(target, obj):
                continue
            old = previous.get((obj.key, obj.size, obj.etag))
            if old is not None and (
                old[1]["path"] not in damaged
                if damaged is not None
                else not local_file_damage(old[0].parent, {**old[1], "path": old[0].name}, "stat")
            ):
                link_or_copy(old[0], target)
                continue
            todo.append(obj)
        return todo

    todo = [obj for chunk_todo in results(chunked(keep, objects, run.pool)) for obj in chunk_todo]
    return todo, len(objects) - len(todo)


def download_all(run: StageRun, todo: list[SourceObject], tree: SafeTree) -> tuple[int, list[SourceObject]]:
    total = sum(o.size for o in todo)
    check_free_space(tree.root, total)
    described = (
        describe_all(run.client, run.source.bucket, todo, run.pool, run.settings)
        if not isinstance(run.client, LocalFolderClient)
        else todo
    )
    log.info("staging: %d objects to download (%.1f MiB)", len(described), total / 2**20)
    encrypted = run.fetch([(o, tree.target(run.paths[o.key])) for o in described], stripe_large_files=True)
    return total, [replace(o, encryption=encrypted.get(o.key, o.encryption)) for o in described]


def _link_from_repository(
    run: StageRun, repository: Path, todo: list[SourceObject], tree: SafeTree
) -> list[SourceObject]:
    """Data-repository mode: the objects are already files under `repository`; check, pre-load,
    link. Returns the objects as checked (with what a HEAD added)."""
    if not repository.is_dir():
        raise StageError(
            f"repository folder {repository} does not exist: give the FSx path that the data repository "
            "association links to the source prefix"
        )
    files = [(o, repository / run.paths[o.key]) for o in todo]
    for obj, path in files:
        if path.is_symlink() or not path.is_file():
            raise StageError(f"{path} (for s3 key {obj.key}) is missing from the data repository folder")
        if path.stat().st_size != obj.size:
            raise StageError(f"{path} is {path.stat().st_size} bytes but s3 key {obj.key} is {obj.size}")
    run.lustre.hsm_restore([p for _, p in files])
    checked = []
    for obj, path in files:
        if run.verify_local == "full":
            reason = verify_file_any_part_size(path, obj.expectation())
            if reason and run.source.kind == "s3":
                # The listing alone may mislead: an SSE-KMS/SSE-C ETag is no MD5, and a checksum
                # is only named. The object's HEAD says which, then the file is checked again.
                obj = describe_from_head(run.client, run.source.bucket, obj, run.settings)
                reason = verify_file_any_part_size(path, obj.expectation())
            if reason:
                raise StageError(
                    f"{path} does not match s3 key {obj.key} ({reason}): re-import the repository"
                )
        target = tree.target(run.paths[obj.key])
        try:
            os.link(path, target, follow_symlinks=False)
        except FileExistsError:
            pass
        except OSError as exc:
            raise StageError(
                f"cannot hard-link {path} into the snapshot ({exc.strerror}): the repository folder must be on "
                "the same file system as --fsx-mount-path"
            ) from exc
        checked.append(obj)
    return checked


def recheck_snapshot(run: StageRun) -> StageResult | None:
    """The snapshot exists: transfer nothing unless a file in it was damaged, then re-fetch
    that one. None when it does not exist."""
    check = run.current_check
    if check is None or check.snap != run.snapshot_id or check.verify_local != run.verify_local:
        check = run.store.start_check(run.snapshot_id, run.verify_local, run.pool)
    if check is None:
        return None
    repaired = run.store.recheck(check, lambda targets: run.fetch(targets, stripe_large_files=False))
    listed = [entry_object(e) for e in check.manifest["files"]]
    return run.result(
        listed,
        bytes_downloaded=sum(o.size for o in repaired),
        files_downloaded=len(repaired),
        files_reused=len(listed) - len(repaired),
        files_repaired=len(repaired),
    )
