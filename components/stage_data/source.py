"""Where a dataset comes from: an S3 prefix (AWS or any S3-compatible endpoint) or a local folder.

Lists the source into `SourceObject`s (key, size, ETag, any additional checksum) and turns
S3's errors into messages that say which problem it is and what to do; HEADs the objects
whose verification needs more than the listing (`describe_all`). The S3 client it is given
comes from `s3_clients.s3_client`. A local folder is served through `LocalFolderClient`,
which answers the few S3 calls staging makes, so both sources share one download path.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from components.stage_data.checksums import ADDITIONAL_ALGORITHMS, Expectation, etag_encryption
from components.stage_data.errors import StageError
from components.stage_data.settings import TransferSettings, with_retries

LOCAL_ETAG_PREFIX = "local:"


@dataclass(frozen=True, slots=True)
class SourceObject:
    key: str
    size: int
    etag: str
    checksum_algorithm: str = ""
    checksum: str = ""
    part_size: int = 0
    encryption: str = ""  # set once a GET/HEAD showed an encryption whose ETag is no MD5

    def expectation(self) -> Expectation:
        return Expectation(
            self.size, self.etag, self.checksum_algorithm, self.checksum, self.part_size, self.encryption
        )


@dataclass(frozen=True, slots=True)
class Source:
    """A parsed --source: `bucket` is the folder for a local source."""

    uri: str
    kind: str  # "s3" | "local"
    bucket: str
    prefix: str


def parse_s3_uri(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://"):
        raise StageError(f"source {uri!r} is not an S3 URI: write it as s3://bucket/prefix")
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    if not bucket:
        raise StageError(f"source {uri!r} has no bucket name: write it as s3://bucket/prefix")
    return bucket, prefix


def parse_source(uri: str) -> Source:
    if uri.startswith("s3://"):
        bucket, prefix = parse_s3_uri(uri)
        return Source(uri, "s3", bucket, prefix)
    if uri.startswith("file://") or uri.startswith("/") or uri.startswith("."):
        folder = Path(uri[len("file://") :] if uri.startswith("file://") else uri).resolve()
        if not folder.is_dir():
            raise StageError(f"source folder {folder} does not exist: check the path")
        return Source(uri, "local", str(folder), "")
    raise StageError(f"source {uri!r} is neither s3://bucket/prefix nor a local folder (absolute path)")


LIST_PAGE_KEYS = 1000
"""The most keys one ListObjectsV2 answer holds."""


def list_objects(
    client: Any, bucket: str, prefix: str, known_keys: Sequence[str] = (), pool: Executor | None = None
) -> list[SourceObject]:
    """Every object under `prefix`, in key order. `known_keys`: a sorted earlier listing (the
    current snapshot's keys); its every `LIST_PAGE_KEYS`-th key bounds a key range, and the
    ranges are listed at once on `pool`, one page each while the source is unchanged, instead
    of one page after another. Any source is listed completely: a range reads on until its
    bound."""
    bounds = key_ranges(known_keys, prefix) if pool is not None else [("", None)]
    try:
        if len(bounds) == 1:
            items = _list_range(client, bucket, prefix, *bounds[0])
        else:
            assert pool is not None
            ranges = [pool.submit(_list_range, client, bucket, prefix, *bound) for bound in bounds]
            items = [item for listed in ranges for item in listed.result()]
    except Exception as exc:
        error = _listing_error(exc, bucket, prefix)
        if error is None:
            raise
        raise error from exc
    objects = []
    for item in items:
        if item["Key"].endswith("/"):
            continue  # "folder" placeholder objects carry no data
        algorithms = [a for a in ADDITIONAL_ALGORITHMS if a in item.get("ChecksumAlgorithm", [])]
        objects.append(
            SourceObject(
                item["Key"],
                int(item["Size"]),
                item.get("ETag", "").strip('"'),
                checksum_algorithm=algorithms[0] if algorithms else "",
            )
        )
    if not objects:
        raise StageError(f"s3://{bucket}/{prefix} holds no objects: check the prefix (it is case-sensitive)")
    return objects


def key_ranges(known_keys: Sequence[str], prefix: str) -> list[tuple[str, str | None]]:
    """(after, up to) key ranges covering every key once: bounded by every `LIST_PAGE_KEYS`-th
    of `known_keys` under `prefix` ("": from the start, None: to the end). Keys compare as S3
    orders them: UTF-8 bytes, which is code point order."""
    under = [key for key in known_keys if key.startswith(prefix)]
    cuts = under[LIST_PAGE_KEYS - 1 :: LIST_PAGE_KEYS]
    return list(zip(["", *cuts], [*cuts, None], strict=True))


def _list_range(client: Any, bucket: str, prefix: str, after: str, upto: str | None) -> list[dict[str, Any]]:
    """The listed items with `after` < key <= `upto`, in order."""
    items: list[dict[str, Any]] = []
    pages = client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=prefix, **({"StartAfter": after} if after else {})
    )
    for page in pages:
        contents = page.get("Contents", [])
        if upto is None:
            items += contents
            continue
        for item in contents:
            if item["Key"] > upto:
                return items
            items.append(item)
        if contents and contents[-1]["Key"] == upto:
            return items  # the range is complete: later keys are larger
    return items


def _listing_error(exc: Exception, bucket: str, prefix: str) -> StageError | None:
    """What a failed listing tells the user (None: not an S3 or connection error to explain).
    botocore's exceptions are imported here only: a listing that succeeds needs none of them."""
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    if isinstance(exc, ClientError):
        code = exc.response.get("Error", {}).get("Code", "")
        if code == "NoSuchBucket":
            return StageError(f"bucket {bucket!r} does not exist: check the source URI and endpoint")
        if code in (
            "AccessDenied",
            "403",
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
            "AllAccessDisabled",
        ):
            return StageError(
                f"access to s3://{bucket}/{prefix} denied ({code}): give the pod's service account "
                "(IRSA) or your AWS profile s3:ListBucket and s3:GetObject on it"
            )
        return StageError(f"listing s3://{bucket}/{prefix} failed: {exc}")
    if isinstance(exc, NoCredentialsError):
        return StageError(
            "no AWS credentials found: use IRSA on EKS, or AWS_PROFILE / AWS_ACCESS_KEY_ID locally"
        )
    if isinstance(exc, EndpointConnectionError):
        return StageError(f"cannot reach the S3 endpoint: {exc}; check --endpoint-url")
    return None


def describe_object(client: Any, bucket: str, obj: SourceObject, settings: TransferSettings) -> SourceObject:
    """Fill in the upload part size of a multipart object and its additional checksum (HEAD).

    HEAD with PartNumber=1 answers with the first part's length, which is the part size of
    every part but the last. A server that does not support it leaves part_size 0, and the
    file is then checked against the usual part sizes.
    """
    from botocore.exceptions import ClientError

    found = obj
    if obj.checksum_algorithm:
        head = with_retries(
            f"HEAD s3://{bucket}/{obj.key}",
            lambda: client.head_object(Bucket=bucket, Key=obj.key, ChecksumMode="ENABLED"),
            settings,
        )
        value = head.get(f"Checksum{obj.checksum_algorithm}", "")
        found = replace(
            found,
            checksum=value,
            checksum_algorithm=obj.checksum_algorithm if value else "",
            encryption=etag_encryption(head),
        )
    exp = found.expectation()
    # The part size matters for a multipart ETag that is an MD5, and for a checksum that may be
    # composite even when the ETag is no MD5 (SSE-KMS): "-<parts>" still counts the parts.
    if exp.needs_parts() or (exp.algorithm and exp.upload_parts):
        try:
            head = with_retries(
                f"HEAD s3://{bucket}/{obj.key} part 1",
                lambda: client.head_object(Bucket=bucket, Key=obj.key, PartNumber=1),
                settings,
            )
            part = int(head.get("ContentLength", 0))
            if head.get("PartsCount") and 0 < part <= obj.size:
                found = replace(found, part_size=part)
        except ClientError:
            pass
    return found


def describe_from_head(
    client: Any, bucket: str, obj: SourceObject, settings: TransferSettings
) -> SourceObject:
    """`obj` with what its HEAD says beyond the listing: the encryption that makes its ETag no
    MD5 (SSE-KMS, DSSE-KMS, SSE-C) and its additional checksum."""
    head = with_retries(
        f"HEAD s3://{bucket}/{obj.key}",
        lambda: client.head_object(Bucket=bucket, Key=obj.key, ChecksumMode="ENABLED"),
        settings,
    )
    found = replace(obj, encryption=etag_encryption(head))
    if obj.checksum_algorithm and not obj.checksum:
        value = head.get(f"Checksum{obj.checksum_algorithm}", "")
        found = replace(found, checksum=value, checksum_algorithm=obj.checksum_algorithm if value else "")
    return found


def describe_all(
    client: Any, bucket: str, objects: list[SourceObject], pool: Executor, settings: TransferSettings
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


class _LocalBody:
    def __init__(self, path: Path, offset: int, length: int) -> None:
        self.path, self.offset, self.length = path, offset, length

    def iter_chunks(self, chunk_size: int) -> Any:
        fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            position, left = self.offset, self.length
            while left > 0:
                data = os.pread(fd, min(chunk_size, left), position)
                if not data:
                    break
                position += len(data)
                left -= len(data)
                yield data
        finally:
            os.close(fd)


class LocalFolderClient:
    """Answers `get_object` for files under a folder: a local source stages like S3."""

    def get_object(self, Bucket: str, Key: str, Range: str = "", **_: Any) -> dict[str, Any]:
        path = Path(Bucket) / Key
        size = path.stat().st_size
        offset, length = 0, size
        if Range:
            start, _sep, end = Range.removeprefix("bytes=").partition("-")
            offset, length = int(start), int(end) - int(start) + 1
        return {"Body": _LocalBody(path, offset, length)}


def list_local_folder(folder: str) -> list[SourceObject]:
    """Regular files under `folder` (symlinks are skipped, never followed)."""
    root = Path(folder)
    objects = []
    for current, dirs, files in os.walk(root, followlinks=False):
        dirs.sort()
        for name in sorted(files):
            path = Path(current) / name
            info = path.lstat()
            if not path.is_file() or path.is_symlink():
                continue
            key = path.relative_to(root).as_posix()
            objects.append(SourceObject(key, info.st_size, f"{LOCAL_ETAG_PREFIX}{info.st_mtime_ns}"))
    if not objects:
        raise StageError(f"source folder {folder} holds no files")
    return objects
