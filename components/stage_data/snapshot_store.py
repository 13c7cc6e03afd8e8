"""The dataset folder as a store of immutable snapshots: ids, manifests, commits, `current`, re-checks.

Under `<mount>/rtp/datasets/<name>/`, `snapshots/<id>/` holds complete snapshots (each with
its `manifest.json`), `.staging/<id>/` the one being built, and `current` points at the
latest. A snapshot id hashes the source listing (key, size, ETag), so an unchanged source
maps to a snapshot that already exists; keys map to relative paths that can neither leave
the folder nor collide. `SnapshotStore.commit` makes a staged folder durable (one
`syncfs`), writes and fsyncs its manifest, renames it to `snapshots/<id>/` and switches
`current` atomically (symlink + rename), so readers of an older snapshot are never
disturbed. `SnapshotStore.recheck` checks an existing snapshot's files against its
manifest (size and mtime, or a full re-hash) and has the caller fetch damaged ones again.
Nothing here talks to S3.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import posixpath
import stat
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from components.layout import snapshot_root
from components.stage_data.checksums import verify_file_any_part_size
from components.stage_data.errors import StageError
from components.stage_data.fs_safety import SafeTree, create_folder, fsync_dir, sync_filesystem
from components.stage_data.source import SourceObject

MANIFEST_NAME = "manifest.json"  # trainer.data.MANIFEST_NAME (not imported: it pulls in torch)
TEMP_SUFFIXES = (".part", ".part.ranges")
VERIFY_LOCAL = ("stat", "full")

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")


# ---------------------------------------------------------------- pure: ids, paths, manifests


def relative_paths(keys: Iterable[str], prefix: str) -> dict[str, str]:
    """Map each key to a safe relative path under the snapshot; refuse escapes and clashes."""
    mapping: dict[str, str] = {}
    seen: dict[str, str] = {}
    strip = prefix if prefix.endswith("/") or not prefix else prefix.rsplit("/", 1)[0] + "/"
    for key in keys:
        rest = key[len(strip) :] if key.startswith(strip) else key
        # normpath changes only keys with '//', a '.' or '..' part, or a trailing '/'
        plain = rest and "//" not in rest and "/." not in rest and rest[0] != "." and rest[-1] != "/"
        normalized = rest if plain else posixpath.normpath(rest)
        parts = normalized.split("/")
        if (
            rest.startswith("/")
            or normalized.startswith("..")
            or normalized in (".", "")
            or "\x00" in rest
            or ".." in rest.split("/")
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


def entry_object(entry: dict[str, Any]) -> SourceObject:
    """The source object a manifest entry records."""
    return SourceObject(
        entry["key"],
        int(entry["size"]),
        entry["etag"],
        entry.get("checksum_algorithm", ""),
        entry.get("checksum", ""),
        int(entry.get("part_size", 0)),
        entry.get("encryption", ""),
    )


def manifest_entry(obj: SourceObject, path: str, mtime_ns: int) -> dict[str, Any]:
    entry: dict[str, Any] = {"key": obj.key, "size": obj.size, "etag": obj.etag, "path": path}
    if obj.checksum_algorithm and obj.checksum:
        entry |= {"checksum_algorithm": obj.checksum_algorithm, "checksum": obj.checksum}
    if obj.part_size:
        entry["part_size"] = obj.part_size
    if obj.encryption:
        entry["encryption"] = obj.encryption
    entry["mtime_ns"] = mtime_ns
    return entry


def manifest_text(manifest: dict[str, Any]) -> str:
    """The manifest as JSON with one file entry per line: readable and diffable, yet written by
    json's C encoder (`indent=` would switch to the much slower pure-Python one)."""
    head = {k: v for k, v in manifest.items() if k != "files"}
    lines = [json.dumps(entry, separators=(",", ":")) for entry in manifest["files"]]
    opening = json.dumps(head)[:-1] + ", " if head else "{"
    return opening + '"files": [\n' + ",\n".join(lines) + "\n]}\n"


# ---------------------------------------------------------------- checking files on disk


def local_file_damage(folder: Path, entry: dict[str, Any], verify_local: str) -> str:
    """'' when the snapshot file still is what the manifest says, else what is wrong. One
    lstat per file: a no-change re-stage runs this for every file of the snapshot."""
    path = os.path.join(folder, entry["path"])
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return "missing"
    if not stat.S_ISREG(info.st_mode):  # a symlink's lstat is not a regular file either
        return "not a regular file"
    if info.st_size != int(entry["size"]):
        return f"size {info.st_size} != {entry['size']}"
    if verify_local == "full":
        return verify_file_any_part_size(Path(path), entry_object(entry).expectation())
    if "mtime_ns" in entry and info.st_mtime_ns != int(entry["mtime_ns"]):
        return "modified since it was staged (mtime changed)"
    return ""


CHECK_CHUNK_FILES = 256
"""Files per chunk of `chunked` work (checks, keeps, manifest mtimes)."""
SLOW_CHECK_S = 200e-6
"""Mean time per file of the first chunk above which the other chunks are checked in
parallel: a metadata round trip to a network file system's servers (FSx, or a whole read
with `verify_local=full`). Local stats take microseconds, and pool threads running them
would only contend with the listing for the interpreter lock (docs/staging.md)."""


def chunked(work: Callable[[list[T]], R], items: list[T], pool: Executor | None) -> list[R | Future[R]]:
    """`work` over `items` in chunks of CHECK_CHUNK_FILES, each chunk's result or its future:
    the first chunk here, the others here too where it took under SLOW_CHECK_S per item (or
    there is no pool), else submitted to `pool` at once (not waited for: `results`)."""
    chunks = [items[i : i + CHECK_CHUNK_FILES] for i in range(0, len(items), CHECK_CHUNK_FILES)]
    if not chunks:
        return []
    started = time.perf_counter()
    first = work(chunks[0])
    if pool is None or time.perf_counter() - started <= SLOW_CHECK_S * len(chunks[0]):
        return [first, *(work(chunk) for chunk in chunks[1:])]
    return [first, *(pool.submit(work, chunk) for chunk in chunks[1:])]


def results(parts: list[R | Future[R]]) -> list[R]:
    """`chunked`'s results, waited for."""
    return [part.result() if isinstance(part, Future) else part for part in parts]


def damaged_files(
    folder: Path, verify_local: str, entries: list[dict[str, Any]]
) -> list[tuple[dict[str, Any], str]]:
    """(entry, what is wrong) for each of `entries` whose file is not what the manifest says."""
    return [
        (entry, reason) for entry in entries if (reason := local_file_damage(folder, entry, verify_local))
    ]


class FileCheck:
    """Every file of one snapshot checked against its manifest (inline without a pool, else
    `chunked` in one pool task). A re-stage starts it on `current` while the source is
    being listed."""

    def __init__(
        self, snap: str, folder: Path, manifest: dict[str, Any], verify_local: str, pool: Executor | None
    ) -> None:
        self.snap, self.manifest, self.verify_local = snap, manifest, verify_local
        check = functools.partial(damaged_files, folder, verify_local)
        self.parallel = False
        self._started: Future[list[Any]] | None = None
        if pool is None:
            self._done = [check(manifest["files"])]
        else:
            self._started = pool.submit(chunked, check, manifest["files"], pool)

    def damaged(self) -> list[tuple[dict[str, Any], str]]:
        """Waits for the check; the damaged files in manifest order."""
        if self._started is not None:
            parts, self._started = self._started.result(), None
            self.parallel = any(isinstance(part, Future) for part in parts)
            self._done = results(parts)
        return [found for chunk in self._done for found in chunk]


def finished_by_earlier_attempt(target: Path, obj: SourceObject) -> bool:
    """Whether an interrupted attempt already finished this file.

    A final name is given only to verified bytes, but files are not fsynced one by one (one
    syncfs covers them at commit), and a small object's verified bytes are written under
    their final name (transfer.IN_MEMORY_BYTES): after a crash or a kill a file may have its
    final name but not all its bytes. So it is re-hashed, which reads the disk but downloads
    nothing; one that cannot be checked beyond its size is fetched again.
    """
    if not target.is_file() or target.is_symlink() or target.stat().st_size != obj.size:
        return False
    expectation = obj.expectation()
    if expectation.algorithm and not expectation.checksum:  # the listing names it, only a GET gives it
        expectation = replace(expectation, algorithm="")
    if not expectation.checkable() and not expectation.needs_parts():
        return False  # nothing to check it against: fetch it again
    return not verify_file_any_part_size(target, expectation)


# ---------------------------------------------------------------- the store


def read_manifest(folder: Path) -> dict[str, Any] | None:
    path = folder / MANIFEST_NAME
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def _write_manifest(folder: Path, manifest: dict[str, Any], tmp_dir: Path) -> None:
    """Write `folder/manifest.json` atomically, through a temporary file in `tmp_dir`.

    The temporary lives outside the snapshot folder: any name inside it may be an S3 key's
    (a key `.manifest.json.tmp` would otherwise be overwritten and renamed away).
    """
    tmp = tmp_dir / f".{folder.name}.{MANIFEST_NAME}.{os.getpid()}.tmp"
    with tmp.open("w") as handle:
        handle.write(manifest_text(manifest))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, folder / MANIFEST_NAME)
    fsync_dir(folder)


Refetch = Callable[[list[tuple[SourceObject, Path]]], object]
"""Fetches each object again into its path (which does not exist when called)."""


class SnapshotStore:
    """One dataset's folder: `snapshots/<id>/`, `.staging/<id>/` and `current`."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @classmethod
    def open(cls, fsx_mount_path: str, dataset_name: str, collection: str = "datasets") -> SnapshotStore:
        root = snapshot_root(fsx_mount_path, collection, dataset_name)
        if root.is_symlink():
            raise StageError(
                f"{root} is a symlink; staging never follows links: point --fsx-mount-path at the volume"
            )
        create_folder(root, fsx_mount_path)
        return cls(root)

    def snapshot_dir(self, snap: str) -> Path:
        return self.root / "snapshots" / snap

    def staging_dir(self, snap: str) -> Path:
        return self.root / ".staging" / snap

    def staging_tree(self, snap: str) -> SafeTree:
        """The staging folder of `snap`, created (links refused) and ready to be written into."""
        staging = self.staging_dir(snap)
        SafeTree(self.root).ensure_dir(staging)
        return SafeTree(staging)

    def current_snapshot(self) -> str | None:
        """The id `current` points at, if any."""
        try:
            return posixpath.basename(os.readlink(self.root / "current"))
        except OSError:
            return None

    def start_check(self, snap: str, verify_local: str, pool: Executor | None) -> FileCheck | None:
        """Start checking snapshot `snap`'s files (None: it has no manifest)."""
        folder = self.snapshot_dir(snap)
        manifest = read_manifest(folder)
        return None if manifest is None else FileCheck(snap, folder, manifest, verify_local, pool)

    def previous_files(self) -> dict[tuple[str, int, str], tuple[Path, dict[str, Any]]]:
        """The `current` snapshot's files by (key, size, ETag): candidates to hard-link."""
        current = self.root / "current"
        manifest = read_manifest(current) if current.is_dir() else None
        if manifest is None:
            return {}
        folder = current.resolve()  # once: per file it is a walk of stats (round trips on FSx)
        return {(e["key"], int(e["size"]), e["etag"]): (folder / e["path"], e) for e in manifest["files"]}

    def commit(
        self,
        snap: str,
        source_uri: str,
        objects: list[SourceObject],
        paths: dict[str, str],
        pool: Executor | None = None,
        mtimes: dict[str, int] | None = None,
    ) -> Path:
        """Turn the complete `.staging/<snap>/` into `snapshots/<snap>/` and make it `current`
        (the files' modification times by key from `mtimes`, else read by `chunked` on `pool`)."""
        staging = self.staging_dir(snap)

        def entries_of(chunk: list[SourceObject]) -> list[dict[str, Any]]:
            return [
                manifest_entry(
                    obj,
                    paths[obj.key],
                    mtimes[obj.key] if mtimes is not None else (staging / paths[obj.key]).stat().st_mtime_ns,
                )
                for obj in chunk
            ]

        ordered = sorted(objects, key=lambda o: o.key)
        entries = [entry for part in results(chunked(entries_of, ordered, pool)) for entry in part]
        sync_filesystem(staging)  # every file durable before the snapshot can become `current`
        manifest = {
            "source": source_uri,
            "snapshot_id": snap,
            "staged_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "files_count": len(entries),
            "bytes_total": sum(o.size for o in objects),
            "files": entries,
        }
        _write_manifest(staging, manifest, self.root)
        final = self.snapshot_dir(snap)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging, final)
        fsync_dir(final.parent)
        self.switch_current(snap)
        return final

    def switch_current(self, snap: str) -> None:
        link = self.root / "current"
        tmp = self.root / f".current.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        os.symlink(Path("snapshots") / snap, tmp)
        os.replace(tmp, link)
        fsync_dir(self.root)

    def recheck(self, check: FileCheck, refetch: Refetch) -> list[SourceObject]:
        """The snapshot exists: fetch again only the files in it that were damaged; returns those."""
        snap, manifest = check.snap, check.manifest
        final = self.snapshot_dir(snap)
        damaged = []
        for entry, reason in check.damaged():
            log.warning("%s in snapshot %s: %s; fetching it again", entry["path"], snap, reason)
            damaged.append(entry)
        repaired = [entry_object(e) for e in damaged]
        if damaged:
            tree = SafeTree(final)
            targets = []
            for obj, entry in zip(repaired, damaged, strict=True):
                target = tree.target(entry["path"])
                target.unlink(missing_ok=True)  # break a hard link shared with other snapshots first
                targets.append((obj, target))
            refetch(targets)
            for entry in damaged:
                entry["mtime_ns"] = (final / entry["path"]).stat().st_mtime_ns
            sync_filesystem(final)
            _write_manifest(final, manifest, self.root)
        else:
            log.info("snapshot %s already staged and intact: nothing to transfer", snap)
        self.switch_current(snap)
        return repaired
