"""Copy an S3 prefix into an immutable, verified dataset snapshot on the shared volume.

The snapshot id is a hash of the source listing (key, size, ETag), so an unchanged prefix
maps to a snapshot that already exists and nothing is transferred; files that did not
change since the `current` snapshot are hard-linked from it instead of downloaded. Objects
land under `.staging/<id>/` with temporary names, are checked against their MD5 ETag,
fsynced and renamed; the folder becomes `snapshots/<id>/` only when complete, and the
`current` link switches atomically. An interrupted stage resumes from what is complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
import shutil
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from components.layout import dataset_root
from trainer.data import MANIFEST_NAME

log = logging.getLogger(__name__)


class StageError(RuntimeError):
    """Staging cannot go on; the message says what was wrong and what to do."""


@dataclass(frozen=True, slots=True)
class SourceObject:
    key: str
    size: int
    etag: str


@dataclass(frozen=True, slots=True)
class StageResult:
    snapshot_dir: str
    snapshot_id: str
    manifest_sha256: str
    files: int
    bytes_total: int
    bytes_downloaded: int
    files_reused: int
    seconds: float

    @property
    def mib_per_s(self) -> float:
        return self.bytes_downloaded / 2**20 / max(self.seconds, 1e-6)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mib_per_s": round(self.mib_per_s, 3)}


def parse_s3_uri(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://"):
        raise StageError(f"source {uri!r} is not an S3 URI: write it as s3://bucket/prefix")
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    if not bucket:
        raise StageError(f"source {uri!r} has no bucket name: write it as s3://bucket/prefix")
    return bucket, prefix


def relative_paths(keys: Iterable[str], prefix: str) -> dict[str, str]:
    """Map each key to a safe relative path under the snapshot; refuse escapes and clashes."""
    mapping: dict[str, str] = {}
    seen: dict[str, str] = {}
    strip = prefix if prefix.endswith("/") or not prefix else prefix.rsplit("/", 1)[0] + "/"
    for key in keys:
        rest = key[len(strip) :] if key.startswith(strip) else key
        normalized = posixpath.normpath(rest)
        if rest.startswith("/") or normalized.startswith("..") or normalized in (".", ""):
            raise StageError(f"S3 key {key!r} would be written outside the dataset folder; rename it")
        if normalized in (MANIFEST_NAME,):
            raise StageError(f"S3 key {key!r} collides with the snapshot's own {MANIFEST_NAME}; rename it")
        folded = normalized.lower()
        if folded in seen:
            raise StageError(f"S3 keys {seen[folded]!r} and {key!r} map to the same file; rename one")
        seen[folded] = key
        mapping[key] = normalized
    return mapping


def snapshot_id(objects: list[SourceObject]) -> str:
    listing = "".join(f"{o.key}\t{o.size}\t{o.etag}\n" for o in sorted(objects, key=lambda o: o.key))
    return hashlib.sha256(listing.encode()).hexdigest()[:16]


def s3_client(endpoint_url: str | None = None) -> Any:
    """A boto3 S3 client from the standard credential chain (IRSA, env, profile)."""
    import boto3
    from botocore.config import Config

    config = Config(
        retries={"max_attempts": 8, "mode": "adaptive"},
        max_pool_connections=32,
        s3={"addressing_style": "path"} if endpoint_url else {},
    )
    return boto3.client("s3", endpoint_url=endpoint_url or None, config=config)


def list_objects(client: Any, bucket: str, prefix: str) -> list[SourceObject]:
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    objects = []
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                if item["Key"].endswith("/"):
                    continue  # "folder" placeholder objects carry no data
                objects.append(SourceObject(item["Key"], int(item["Size"]), item["ETag"].strip('"')))
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code == "NoSuchBucket":
            raise StageError(f"bucket {bucket!r} does not exist: check the source URI and endpoint") from exc
        if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            raise StageError(
                f"access to s3://{bucket}/{prefix} denied ({code}): give the pod's service account "
                "(IRSA) or your AWS profile s3:ListBucket and s3:GetObject on it"
            ) from exc
        raise StageError(f"listing s3://{bucket}/{prefix} failed: {exc}") from exc
    except NoCredentialsError as exc:
        raise StageError(
            "no AWS credentials found: use IRSA on EKS, or AWS_PROFILE / AWS_ACCESS_KEY_ID locally"
        ) from exc
    except EndpointConnectionError as exc:
        raise StageError(f"cannot reach the S3 endpoint: {exc}; check --s3-endpoint-url") from exc
    if not objects:
        raise StageError(f"s3://{bucket}/{prefix} holds no objects: check the prefix (it is case-sensitive)")
    return objects


def _md5_matches(etag: str, digest: str) -> bool:
    # Multipart ETags ("<md5 of part md5s>-<parts>") are not a digest of the body; the
    # size check covers them here, and the composite check belongs to the staging issue.
    return "-" in etag or etag == digest


def _download(client: Any, bucket: str, obj: SourceObject, target: Path, attempts: int = 3) -> int:
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".part")
    for attempt in range(1, attempts + 1):
        digest = hashlib.md5(usedforsecurity=False)
        body = client.get_object(Bucket=bucket, Key=obj.key)["Body"]
        with partial.open("wb") as handle:
            for chunk in body.iter_chunks(1 << 20):
                digest.update(chunk)
                handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
        if partial.stat().st_size == obj.size and _md5_matches(obj.etag, digest.hexdigest()):
            os.replace(partial, target)
            return obj.size
        log.warning("s3://%s/%s failed verification (attempt %d/%d)", bucket, obj.key, attempt, attempts)
    partial.unlink(missing_ok=True)
    raise StageError(f"s3://{bucket}/{obj.key} did not match its size/ETag after {attempts} attempts")


def _previous_files(current: Path) -> dict[tuple[str, int, str], Path]:
    manifest = current / MANIFEST_NAME
    if not manifest.is_file():
        return {}
    entries = json.loads(manifest.read_text())["files"]
    return {(e["key"], int(e["size"]), e["etag"]): current / e["path"] for e in entries}


def _switch_current(root: Path, snapshot: str) -> None:
    link = root / "current"
    tmp = root / f".current.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(Path("snapshots") / snapshot, tmp)
    os.replace(tmp, link)


def stage_dataset(
    source: str,
    fsx_mount_path: str,
    dataset_name: str,
    endpoint_url: str | None = None,
    max_workers: int = 16,
    client: Any = None,
) -> StageResult:
    """Stage `source` (s3://bucket/prefix) as a snapshot of dataset `dataset_name`."""
    started = time.perf_counter()
    bucket, prefix = parse_s3_uri(source)
    client = client or s3_client(endpoint_url)
    objects = list_objects(client, bucket, prefix)
    paths = relative_paths((o.key for o in objects), prefix)
    snap = snapshot_id(objects)
    root = dataset_root(fsx_mount_path, dataset_name)
    final = root / "snapshots" / snap
    if (final / MANIFEST_NAME).is_file():
        log.info("snapshot %s already staged: nothing to transfer", snap)
        _switch_current(root, snap)
        return _result(final, snap, objects, 0, len(objects), started)

    staging = root / ".staging" / snap
    staging.mkdir(parents=True, exist_ok=True)
    previous = _previous_files(root / "current")
    todo: list[SourceObject] = []
    reused = 0
    for obj in objects:
        target = staging / paths[obj.key]
        if target.is_file() and target.stat().st_size == obj.size:
            reused += 1  # completed by an interrupted earlier attempt (renamed only when verified)
            continue
        old = previous.get((obj.key, obj.size, obj.etag))
        if old is not None and old.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(old, target)
            except OSError:
                shutil.copy2(old, target)
            reused += 1
            continue
        todo.append(obj)

    total = sum(o.size for o in todo)
    log.info("staging %s: %d objects to download (%d bytes), %d reused", source, len(todo), total, reused)
    downloaded = 0
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        futures = [pool.submit(_download, client, bucket, o, staging / paths[o.key]) for o in todo]
        for done, future in enumerate(futures, 1):
            downloaded += future.result()
            if done % 50 == 0 or done == len(futures):
                log.info("downloaded %d/%d objects, %.1f MiB", done, len(futures), downloaded / 2**20)

    manifest = {
        "source": source,
        "snapshot_id": snap,
        "files": [
            {"key": o.key, "size": o.size, "etag": o.etag, "path": paths[o.key]}
            for o in sorted(objects, key=lambda o: o.key)
        ],
    }
    with (staging / MANIFEST_NAME).open("w") as handle:
        json.dump(manifest, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(staging, final)
    _switch_current(root, snap)
    return _result(final, snap, objects, downloaded, reused, started)


def _result(
    folder: Path, snap: str, objects: list[SourceObject], downloaded: int, reused: int, started: float
) -> StageResult:
    return StageResult(
        snapshot_dir=str(folder),
        snapshot_id=snap,
        manifest_sha256=hashlib.sha256((folder / MANIFEST_NAME).read_bytes()).hexdigest(),
        files=len(objects),
        bytes_total=sum(o.size for o in objects),
        bytes_downloaded=downloaded,
        files_reused=reused,
        seconds=time.perf_counter() - started,
    )
