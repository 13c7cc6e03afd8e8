"""Moving bytes from S3 into files: whole and ranged downloads, verified, renamed only when right.

Every object becomes one or more work items run by one thread pool (`run_downloads`): a
small object is one GET; a large one is split into ranges (the upload's own parts when S3
says how big they were, so per-part MD5s verify a multipart ETag without a second pass)
written in place with `pwrite` into a preallocated `<name>.part`. A sidecar
`<name>.part.ranges` records each finished range and its digests, so a killed stage
resumes a large object where it stopped (each recorded range is re-hashed from disk first,
and fetched again if its bytes no longer match). The thread that finishes an object's last
range verifies it and renames it to its final name; nothing unverified ever carries a
final name. An object whose GET shows an encryption that makes its ETag no MD5 (SSE-KMS,
DSSE-KMS, SSE-C) is checked by its additional checksum, or else by size; the downloader
keeps the keys checked by size alone (`size_only`) so the stage can say so once. Nothing is fsynced file by file or range by range: the stage makes everything
durable with one `syncfs` of the destination before the snapshot is committed
(fs_safety.sync_filesystem). Each request is retried as settings.with_retries decides.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from components.stage_data.checksums import (
    Digester,
    Expectation,
    etag_encryption,
    plausible_part_sizes,
    read_chunks,
    split_ranges,
    verify_file,
    verify_file_any_part_size,
)
from components.stage_data.errors import StageError, VerificationError
from components.stage_data.fs_safety import (
    NO_SPACE_ERRNOS,
    create_fresh,
    disk_full_as_stage_error,
    open_no_follow,
    write_all,
)
from components.stage_data.progress import Progress
from components.stage_data.settings import TransferSettings, with_retries

log = logging.getLogger(__name__)

IN_MEMORY_BYTES = 8 * 2**20
"""Small objects up to this size are verified in memory and written once, under their final name."""


def with_response_checksum(expectation: Expectation, response: dict[str, Any]) -> Expectation:
    """Take the additional checksum from a GET/HEAD answer; drop the algorithm if none came."""
    if not expectation.algorithm or expectation.checksum:
        return expectation
    value = response.get(f"Checksum{expectation.algorithm}", "")
    if value:
        return replace(expectation, checksum=value)
    return replace(expectation, algorithm="")


def with_response_encryption(expectation: Expectation, response: dict[str, Any]) -> Expectation:
    """Mark the ETag as no MD5 when the GET/HEAD answer names SSE-KMS, DSSE-KMS or SSE-C."""
    encryption = etag_encryption(response)
    if not encryption or expectation.encryption:
        return expectation
    return replace(expectation, encryption=encryption)


# ---------------------------------------------------------------- one object


@dataclass
class ObjectJob:
    """One object being staged: where it goes, what it must match, how its ranges stand."""

    bucket: str
    key: str
    expectation: Expectation
    target: Path
    ranges: list[tuple[int, int]] = field(default_factory=list)
    parallel: bool = False
    done_ranges: dict[int, dict[str, str]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    attempts_left: int = 0
    part_size_guessed: bool = False  # ranges follow a guessed upload part size (see Downloader.plan)

    partial: Path = field(init=False)
    sidecar: Path = field(init=False)

    def __post_init__(self) -> None:
        self.partial = Path(f"{self.target}.part")  # made once: pathlib costs show per small object
        self.sidecar = Path(f"{self.target}.part.ranges")

    def pending_ranges(self) -> list[int]:
        return [i for i in range(len(self.ranges)) if i not in self.done_ranges]


def verification_exhausted(job: ObjectJob, attempts: int, reason: str = "") -> StageError:
    detail = f" ({reason})" if reason else ""
    return StageError(
        f"s3://{job.bucket}/{job.key} did not match its size/checksum after {attempts} attempts{detail}: "
        "the object may be changing or the network corrupting data; re-run the stage"
    )


class Downloader:
    """Runs object and range downloads for one stage; `on_bytes` reports progress."""

    def __init__(
        self,
        client: Any,
        settings: TransferSettings,
        on_bytes: Callable[[int], None] = lambda n: None,
        prepare_large_file: Callable[[Path], None] = lambda path: None,
    ) -> None:
        self.client = client
        self.settings = settings
        self.on_bytes = on_bytes
        self.prepare_large_file = prepare_large_file
        self.size_only: dict[str, str] = {}
        """Key -> why only its size could be checked (an ETag that is no MD5, no additional checksum)."""
        self.encrypted: dict[str, str] = {}
        """Key -> the encryption its GET showed (SSE-KMS, ...): the manifest records it."""
        self._lock = threading.Lock()

    def _verified(self, job: ObjectJob) -> None:
        """Record what a verified object taught: its encryption, and whether only its size was checked."""
        exp = job.expectation
        with self._lock:
            if exp.encryption:
                self.encrypted[job.key] = exp.encryption
            if not Digester(exp).checks_content:
                self.size_only[job.key] = exp.why_size_only() or "nothing but its size to check"

    # -- planning

    def plan(self, job: ObjectJob) -> None:
        """Decide whole vs ranged, pick ranges, and pick up a previous attempt's finished ranges."""
        exp = job.expectation
        job.attempts_left = self.settings.verify_attempts
        if exp.size < self.settings.multipart_threshold_bytes:
            job.parallel = False
            job.ranges = [(0, exp.size)]
            return
        job.parallel = True
        if exp.needs_parts() and not exp.part_size:
            # The server did not say the upload's part size (Ceph RGW 16 ignores HEAD
            # ?partNumber=1). Ranges at the likeliest part size let the per-range MD5s check
            # the multipart ETag without reading the file again; a wrong guess costs only
            # the re-read that verification would have needed anyway (finish_ranged).
            parts = exp.etag_parts or int(exp.checksum.rpartition("-")[2] or 0)
            guesses = plausible_part_sizes(exp.size, parts)
            if guesses:
                job.expectation = exp = replace(exp, part_size=guesses[0])
                job.part_size_guessed = True
        part = exp.part_size if exp.needs_parts() and exp.part_size else self.settings.part_size_bytes
        job.ranges = split_ranges(exp.size, part)
        job.done_ranges = self._resume_ranges(job)

    def _resume_ranges(self, job: ObjectJob) -> dict[int, dict[str, str]]:
        if not (job.partial.is_file() and job.sidecar.is_file()):
            return {}
        if job.partial.stat().st_size != job.expectation.size:
            return {}
        done: dict[int, dict[str, str]] = {}
        for line in job.sidecar.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                break  # a torn last line
            if record.get("ranges") != len(job.ranges) or record.get("etag") != job.expectation.etag:
                return {}  # a different object version or part layout: start over
            index = int(record["index"])
            # Ranges are not fsynced one by one: after a crash the record may have outlived
            # the bytes, so a range counts as done only if the disk still holds what was hashed.
            if 0 <= index < len(job.ranges) and self._range_on_disk(job, index, record["digests"]):
                done[index] = record["digests"]
        if done:
            log.info("resuming %s: %d of %d ranges already on disk", job.key, len(done), len(job.ranges))
        return done

    @staticmethod
    def _range_on_disk(job: ObjectJob, index: int, digests: dict[str, str]) -> bool:
        offset, length = job.ranges[index]
        hashers = Digester(job.expectation).part_hashers()
        if set(hashers) != set(digests):
            return False
        for chunk in read_chunks(job.partial, offset, length):
            for hasher in hashers.values():
                hasher.update(chunk)
        return all(hasher.digest().hex() == digests[name] for name, hasher in hashers.items())

    # -- small objects

    def fetch_wholes(self, jobs: list[ObjectJob]) -> int:
        return sum(self.fetch_whole(job) for job in jobs)

    def fetch_whole(self, job: ObjectJob) -> int:
        """Download a small object in one GET, verify it, and give it its final name."""
        for attempt in range(1, self.settings.verify_attempts + 1):
            reason = self._fetch_whole_once(job)
            if not reason:
                self._verified(job)
                return job.expectation.size
            log.warning(
                "s3://%s/%s failed verification (%s), attempt %d/%d",
                job.bucket,
                job.key,
                reason,
                attempt,
                self.settings.verify_attempts,
            )
        job.partial.unlink(missing_ok=True)
        raise verification_exhausted(job, self.settings.verify_attempts)

    def _get(self, job: ObjectJob, byte_range: tuple[int, int] | None = None) -> Any:
        params: dict[str, Any] = {"Bucket": job.bucket, "Key": job.key}
        if job.expectation.etag:
            params["IfMatch"] = f'"{job.expectation.etag}"'  # a changed object fails instead of mixing
        if job.expectation.algorithm and byte_range is None:
            params["ChecksumMode"] = "ENABLED"
        if byte_range is not None:
            offset, length = byte_range
            params["Range"] = f"bytes={offset}-{offset + length - 1}"
        return self.client.get_object(**params)

    def _fetch_whole_once(self, job: ObjectJob) -> str:
        """One verified download of a small object; '' when it has its final name, else why not.

        An object of up to IN_MEMORY_BYTES is held in memory until verified and then written
        under its final name (one file created, no rename: on Lustre each is a metadata
        round trip); a larger one, or a small multipart upload (checked part by part from the
        file), goes through `<name>.part`. Either way a resumed stage re-hashes what it finds.
        """
        from botocore.exceptions import ClientError

        exp = job.expectation
        digester = Digester(exp)
        written = 0
        in_memory = exp.size <= IN_MEMORY_BYTES and not exp.needs_parts()
        held: list[bytes] = []

        def attempt() -> None:
            nonlocal written, digester, exp
            written = 0
            held.clear()
            response = self._get(job) if job.expectation.size else None
            exp = with_response_checksum(job.expectation, response or {})
            exp = job.expectation = with_response_encryption(exp, response or {})
            digester = Digester(exp)
            fd = -1 if in_memory else open_no_follow(job.partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:

                def chunks() -> Any:
                    nonlocal written
                    if response is None:
                        return
                    for chunk in response["Body"].iter_chunks(self.settings.read_chunk_bytes):
                        if in_memory:
                            held.append(chunk)
                        else:
                            write_all(fd, chunk)
                        written += len(chunk)
                        self.on_bytes(len(chunk))
                        yield chunk

                digester.add_part(chunks())
                # No fsync here: see sync_filesystem, called once before the snapshot commits.
            finally:
                if fd >= 0:
                    os.close(fd)

        try:
            with disk_full_as_stage_error(job.partial):
                with_retries(f"GET s3://{job.bucket}/{job.key}", attempt, self.settings)
        except ClientError as exc:
            raise self._client_error(job, exc) from exc
        except Exception as exc:
            if type(exc).__name__ == "FlexibleChecksumError":  # botocore's own check of the stream
                return str(exc)
            raise
        if written != exp.size:
            return f"got {written} bytes, expected {exp.size}"
        if in_memory:
            reason = digester.mismatch()
            if not reason:
                with disk_full_as_stage_error(job.target):
                    fd = create_fresh(job.target)
                    try:
                        for chunk in held:
                            write_all(fd, chunk)
                    finally:
                        os.close(fd)
            return reason
        # A small multipart upload was hashed as one part above; check it part by part.
        reason = verify_file_any_part_size(job.partial, exp) if exp.needs_parts() else digester.mismatch()
        if reason:
            return reason
        os.replace(job.partial, job.target)
        return ""

    def _client_error(self, job: ObjectJob, exc: Any) -> StageError:
        code = exc.response.get("Error", {}).get("Code", "")
        if code in ("PreconditionFailed", "412"):
            return StageError(
                f"s3://{job.bucket}/{job.key} changed while it was being staged (its ETag no longer "
                "matches the listing): re-run the stage once writers to the prefix are done"
            )
        if code in ("NoSuchKey", "404"):
            return StageError(
                f"s3://{job.bucket}/{job.key} was deleted while it was being staged: re-run the stage"
            )
        message = str(exc.response.get("Error", {}).get("Message", ""))
        if code == "InvalidRequest" and "Server Side Encryption" in message:
            return StageError(
                f"s3://{job.bucket}/{job.key} is encrypted with a customer-provided key (SSE-C), which "
                "rtp stage does not hold: copy the data to a prefix encrypted with SSE-S3 or SSE-KMS"
            )
        if code in ("AccessDenied", "403"):
            return StageError(
                f"reading s3://{job.bucket}/{job.key} was denied: grant s3:GetObject on the prefix to "
                "the pod's service account (IRSA) or your AWS profile"
            )
        return StageError(f"GET s3://{job.bucket}/{job.key} failed: {exc}")

    # -- large objects

    def open_partial(self, job: ObjectJob) -> None:
        if job.done_ranges and job.partial.is_file():
            return
        job.partial.unlink(missing_ok=True)
        job.sidecar.unlink(missing_ok=True)
        self.prepare_large_file(job.partial)  # e.g. a Lustre stripe layout, set before any data
        fd = open_no_follow(job.partial, os.O_WRONLY | os.O_CREAT)
        try:
            with disk_full_as_stage_error(job.partial, (*NO_SPACE_ERRNOS, errno.EFBIG)):
                os.ftruncate(fd, job.expectation.size)
        finally:
            os.close(fd)

    def fetch_range(self, job: ObjectJob, index: int) -> bool:
        """Download one range in place; True when this was the object's last missing range."""
        from botocore.exceptions import ClientError

        offset, length = job.ranges[index]
        digester = Digester(job.expectation)

        def attempt() -> dict[str, bytes]:
            hashers = digester.part_hashers()
            response = self._get(job, (offset, length))
            if etag_encryption(response):
                with job.lock:  # every range of the object answers alike; finish_ranged reads it
                    job.expectation = with_response_encryption(job.expectation, response)
            fd = open_no_follow(job.partial, os.O_WRONLY)
            position = offset
            try:
                for chunk in response["Body"].iter_chunks(self.settings.read_chunk_bytes):
                    if position + len(chunk) > offset + length:
                        raise VerificationError(f"range {index} returned more than {length} bytes")
                    os.pwrite(fd, chunk, position)
                    for hasher in hashers.values():
                        hasher.update(chunk)
                    position += len(chunk)
                    self.on_bytes(len(chunk))
            finally:
                os.close(fd)
            if position != offset + length:
                raise VerificationError(f"range {index} returned {position - offset} of {length} bytes")
            return {name: h.digest() for name, h in hashers.items()}

        try:
            with disk_full_as_stage_error(job.partial):
                try:
                    digests = with_retries(
                        f"GET s3://{job.bucket}/{job.key} range {index}", attempt, self.settings
                    )
                except VerificationError:
                    digests = with_retries(
                        f"GET s3://{job.bucket}/{job.key} range {index}", attempt, self.settings
                    )
        except ClientError as exc:
            raise self._client_error(job, exc) from exc
        except VerificationError as exc:
            raise StageError(f"s3://{job.bucket}/{job.key}: {exc}; re-run the stage") from exc
        digest_hex = {name: value.hex() for name, value in digests.items()}
        record: dict[str, Any] = {
            "index": index,
            "ranges": len(job.ranges),
            "etag": job.expectation.etag,
            "digests": digest_hex,
        }
        with job.lock:
            with job.sidecar.open("a") as handle:
                handle.write(json.dumps(record) + "\n")
            job.done_ranges[index] = digest_hex
            return len(job.done_ranges) == len(job.ranges)

    def finish_ranged(self, job: ObjectJob) -> str:
        """Verify a fully written ranged download; rename it on success. '' or why not."""
        exp = job.expectation
        if exp.needs_parts() and exp.part_size:
            digester = Digester(exp)
            for index in range(len(job.ranges)):
                digester.add_part_digests({k: bytes.fromhex(v) for k, v in job.done_ranges[index].items()})
            reason = digester.mismatch(parallel_parts=True)
            if reason and job.part_size_guessed:
                reason = verify_file_any_part_size(job.partial, replace(exp, part_size=0))
            elif not reason and exp.algorithm and not exp.checksum_is_composite:
                reason = verify_file(job.partial, exp)  # a full-object checksum needs the whole body
        else:
            reason = verify_file_any_part_size(job.partial, exp)
        if reason:
            job.partial.unlink(missing_ok=True)
            job.sidecar.unlink(missing_ok=True)
            job.done_ranges.clear()
            return reason
        os.replace(job.partial, job.target)
        job.sidecar.unlink(missing_ok=True)
        self._verified(job)
        return ""


# ---------------------------------------------------------------- scheduling


def run_downloads(downloader: Downloader, jobs: list[ObjectJob], pool: Executor, progress: Progress) -> None:
    """Run every job's GETs on the pool; ranged jobs are finished by whoever ends their last range.

    Finished work items come back through a queue (each future's done-callback puts it
    there): `concurrent.futures.wait` over thousands of pending futures re-registers a
    waiter on every one of them per call, which costs more CPU than the small GETs do.
    """
    finished: queue.SimpleQueue[tuple[Future[Any], str, Any]] = queue.SimpleQueue()
    pending: set[Future[Any]] = set()
    small: list[ObjectJob] = []
    per_batch = max(1, min(32, len(jobs) // (8 * downloader.settings.max_workers)))

    def submit(kind: str, job: Any, call: Any, *args: Any) -> None:
        future = pool.submit(call, job, *args)
        pending.add(future)
        future.add_done_callback(lambda f: finished.put((f, kind, job)))

    def start(job: ObjectJob) -> None:
        downloader.plan(job)
        if not job.parallel:
            small.append(job)  # small objects go in batches: one work item for several GETs
            if len(small) >= per_batch:
                submit("whole", small[:], downloader.fetch_wholes)
                small.clear()
            return
        downloader.open_partial(job)
        todo = job.pending_ranges()
        if not todo:
            submit("finish", job, downloader.finish_ranged)
        for index in todo:
            submit("range", job, downloader.fetch_range, index)

    for job in jobs:
        start(job)
    if small:
        submit("whole", small[:], downloader.fetch_wholes)
        small.clear()
    try:
        while pending:
            future, kind, job = finished.get()
            pending.discard(future)
            value = future.result()  # re-raises StageError from the worker
            if kind == "whole":
                progress.add_file(len(job))
            elif kind == "range" and value:
                submit("finish", job, downloader.finish_ranged)
            elif kind == "finish":
                if not value:
                    progress.add_file()
                    continue
                job.attempts_left -= 1
                log.warning("s3://%s/%s failed verification (%s)", job.bucket, job.key, value)
                if job.attempts_left <= 0:
                    raise verification_exhausted(job, downloader.settings.verify_attempts, value)
                attempts = job.attempts_left
                start(job)
                job.attempts_left = attempts
    except BaseException:
        for future in pending:
            future.cancel()
        raise
