"""What S3 promises about an object's bytes, and checking a downloaded file against it.

Pure logic, no I/O beyond reading the local file: S3 describes a body by its ETag (the MD5
of the body for a single-part upload; the MD5 of the concatenated binary part MD5s,
suffixed `-<parts>`, for a multipart upload) and, when the uploader asked for one, an
additional checksum (CRC32, CRC32C or SHA-256), either of the full object or composite
(the checksum of the concatenated part checksums, suffixed `-<parts>`). `Expectation`
holds what the listing and HEAD said; `Digester` computes the matching digests of a body
part by part, so a ranged download whose ranges are the upload's parts verifies without
a second pass.

An ETag is an MD5 only for unencrypted and SSE-S3 objects: with SSE-KMS, DSSE-KMS or SSE-C
it is an opaque value, and some S3-compatible servers give ETags that are not hex at all.
`etag_encryption` reads which case a GET/HEAD answer is; such an object is checked by its
additional checksum when it has one, else by its size alone (`Digester.checks_content`).
"""

from __future__ import annotations

import base64
import hashlib
import re
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

MIB = 2**20
ADDITIONAL_ALGORITHMS = ("SHA256", "CRC32C", "CRC32")  # preference order when several are present
# x-amz-server-side-encryption values whose objects' ETags are not the MD5 of the body.
_OPAQUE_ETAG_ENCRYPTIONS = {"aws:kms": "SSE-KMS", "aws:kms:dsse": "DSSE-KMS"}


class _Crc32:
    def __init__(self) -> None:
        self.value = 0

    def update(self, data: bytes | memoryview) -> None:
        self.value = zlib.crc32(data, self.value)

    def digest(self) -> bytes:
        return self.value.to_bytes(4, "big")


class _Crc32c:
    def __init__(self) -> None:
        import google_crc32c  # C-accelerated; ships with the project's dependencies

        self._impl = google_crc32c.Checksum()

    def update(self, data: bytes | memoryview) -> None:
        self._impl.update(bytes(data))

    def digest(self) -> bytes:
        return bytes(self._impl.digest())


def _new_hasher(algorithm: str) -> Any:
    if algorithm == "MD5":
        return hashlib.md5(usedforsecurity=False)
    if algorithm == "SHA256":
        return hashlib.sha256()
    if algorithm == "CRC32":
        return _Crc32()
    if algorithm == "CRC32C":
        return _Crc32c()
    raise ValueError(f"unsupported checksum algorithm {algorithm}")


def crc32c_available() -> bool:
    try:
        import google_crc32c  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class Expectation:
    """What S3 said about an object: size, ETag, and optionally an additional checksum."""

    size: int
    etag: str
    algorithm: str = ""  # "SHA256" | "CRC32C" | "CRC32" | ""
    checksum: str = ""  # base64, possibly "-<parts>" for a composite checksum
    part_size: int = 0  # upload part size when multipart (0 = unknown or single part)
    encryption: str = ""  # "SSE-KMS" | "DSSE-KMS" | "SSE-C" when that makes the ETag no MD5

    @property
    def etag_parts(self) -> int:
        """Number of upload parts an MD5 ETag says (0 for a single-part one, or an ETag that is no MD5)."""
        if self.encryption:
            return 0
        head, dash, parts = self.etag.partition("-")
        return int(parts) if dash and parts.isdigit() and is_md5_hex(head) else 0

    @property
    def upload_parts(self) -> int:
        """Number of upload parts the ETag's "-<parts>" says, whether or not the ETag is an MD5."""
        _, dash, parts = self.etag.partition("-")
        return int(parts) if dash and parts.isdigit() else 0

    @property
    def etag_is_md5(self) -> bool:
        """Whether the ETag is an MD5 of the body (single part) or of its part MD5s (multipart)."""
        return not self.encryption and (self.etag_parts > 0 or is_md5_hex(self.etag))

    def why_size_only(self) -> str:
        """Why the ETag cannot check the body ('' when it can)."""
        if self.encryption:
            return f"{self.encryption}-encrypted: its ETag is not an MD5 of the data"
        if not self.etag_is_md5:
            return f"its ETag {self.etag!r} is not an MD5"
        return ""

    @property
    def checksum_is_composite(self) -> bool:
        return "-" in self.checksum

    def part_ranges(self) -> list[tuple[int, int]]:
        """(offset, length) of each upload part, from `part_size`; one range when unknown."""
        return split_ranges(self.size, self.part_size) if self.part_size else [(0, self.size)]

    def needs_parts(self) -> bool:
        return self.etag_parts > 0 or self.checksum_is_composite

    def checkable(self) -> bool:
        """Whether a body can be checked beyond its size."""
        if self.algorithm and (self.algorithm != "CRC32C" or crc32c_available()):
            return not self.checksum_is_composite or self.part_size > 0
        if self.etag_parts:
            return self.part_size > 0
        return self.etag_is_md5


def etag_encryption(response: dict[str, Any]) -> str:
    """The encryption a GET/HEAD answer names that makes the object's ETag no MD5, or ''.

    S3 documents that objects encrypted with SSE-KMS, DSSE-KMS or SSE-C (customer key) have
    ETags that are not an MD5 digest of the object data; SSE-S3 (AES256) ones still are.
    """
    if response.get("SSECustomerAlgorithm"):
        return "SSE-C"
    return _OPAQUE_ETAG_ENCRYPTIONS.get(str(response.get("ServerSideEncryption", "")), "")


_MD5_HEX = re.compile(r"[0-9a-fA-F]{32}")


def is_md5_hex(value: str) -> bool:
    return _MD5_HEX.fullmatch(value) is not None


def split_ranges(size: int, part_size: int) -> list[tuple[int, int]]:
    if size == 0:
        return [(0, 0)]
    return [(offset, min(part_size, size - offset)) for offset in range(0, size, part_size)]


def plausible_part_sizes(size: int, parts: int) -> list[int]:
    """Part sizes (whole MiB, common choices first) that split `size` bytes into `parts` parts."""
    common = [8, 5, 16, 15, 32, 64, 10, 100, 128, 256, 512, 1024]
    fits = [m * MIB for m in common if (parts - 1) * m * MIB < size <= parts * m * MIB]
    return fits


@dataclass
class Digester:
    """Digests of one body, fed part by part (parts are the upload's parts when multipart)."""

    expectation: Expectation
    _algorithms: list[str] = field(init=False)
    _part_digests: dict[str, list[bytes]] = field(init=False)

    def __post_init__(self) -> None:
        exp = self.expectation
        self._algorithms = []
        if exp.etag_is_md5:
            self._algorithms.append("MD5")
        if exp.algorithm and (exp.algorithm != "CRC32C" or crc32c_available()):
            self._algorithms.append(exp.algorithm)
        self._part_digests = {a: [] for a in self._algorithms}
        self._whole: dict[str, Any] = {}  # the first part's hashers, then fed every later part

    @property
    def checks_content(self) -> bool:
        """Whether anything beyond the size is checked (an MD5 ETag or an additional checksum)."""
        return bool(self._algorithms)

    def add_part(self, chunks: Iterable[bytes | memoryview]) -> None:
        """Feed one whole part (in order), chunk by chunk."""
        hashers = {a: _new_hasher(a) for a in self._algorithms}
        wholes = list(self._whole.values())
        for chunk in chunks:
            for hasher in hashers.values():
                hasher.update(chunk)
            for hasher in wholes:
                hasher.update(chunk)
        for algorithm, hasher in hashers.items():
            self._part_digests[algorithm].append(hasher.digest())  # digest() does not end a hasher
        if not self._whole:
            self._whole = hashers

    def add_part_digests(self, digests: dict[str, bytes]) -> None:
        """Record a part's digests computed elsewhere (parallel ranged download)."""
        for algorithm in self._algorithms:
            self._part_digests[algorithm].append(digests[algorithm])

    def _whole_digest(self, algorithm: str) -> bytes:
        return bytes((self._whole.get(algorithm) or _new_hasher(algorithm)).digest())

    def part_hashers(self) -> dict[str, Any]:
        return {a: _new_hasher(a) for a in self._algorithms}

    def mismatch(self, parallel_parts: bool = False) -> str:
        """'' when the body matches every expectation it can be checked against, else why not.

        With `parallel_parts`, only per-part digests were recorded: whole-object digests
        (single-part MD5, full-object checksums) must be checked by `verify_file` instead.
        """
        exp = self.expectation
        if "MD5" in self._algorithms:
            parts = self._part_digests["MD5"]
            if exp.etag_parts:
                if len(parts) != exp.etag_parts:
                    return f"ETag says {exp.etag_parts} parts, the download had {len(parts)}"
                composite = hashlib.md5(b"".join(parts), usedforsecurity=False).hexdigest()
                if f"{composite}-{exp.etag_parts}" != exp.etag:
                    return f"multipart MD5 {composite}-{exp.etag_parts} != ETag {exp.etag}"
            elif not parallel_parts:
                got = self._whole_digest("MD5").hex()
                if got != exp.etag:
                    return f"MD5 {got} != ETag {exp.etag}"
        if exp.algorithm in self._algorithms:
            if exp.checksum_is_composite:
                parts = self._part_digests[exp.algorithm]
                hasher = _new_hasher(exp.algorithm)
                hasher.update(b"".join(parts))
                got = f"{base64.b64encode(hasher.digest()).decode()}-{len(parts)}"
            elif parallel_parts:
                return ""
            else:
                got = base64.b64encode(self._whole_digest(exp.algorithm)).decode()
                parts = self._part_digests[exp.algorithm]
                if got != exp.checksum and exp.upload_parts and len(parts) == exp.upload_parts:
                    # Some servers (moto 5) give a multipart object's composite checksum
                    # without its "-<parts>" suffix: accept it as the composite it is.
                    hasher = _new_hasher(exp.algorithm)
                    hasher.update(b"".join(parts))
                    if base64.b64encode(hasher.digest()).decode() == exp.checksum:
                        got = exp.checksum
            if got != exp.checksum:
                return f"{exp.algorithm} {got} != {exp.checksum}"
        return ""


def read_chunks(path: Path, offset: int, length: int, chunk: int = 4 * MIB) -> Iterable[bytes]:
    with path.open("rb") as handle:
        handle.seek(offset)
        left = length
        while left > 0:
            data = handle.read(min(chunk, left))
            if not data:
                raise OSError(f"{path} ended {left} bytes early")
            left -= len(data)
            yield data


def verify_file(path: Path, expectation: Expectation, part_size: int | None = None) -> str:
    """Check a whole local file; '' when it matches, else why not. Reads the file once."""
    size = path.stat().st_size
    if size != expectation.size:
        return f"size {size} != {expectation.size}"
    exp = expectation
    if part_size is not None and part_size != exp.part_size:
        exp = replace(exp, part_size=part_size)
    digester = Digester(exp)
    if not digester.checks_content:
        return ""  # only the size can be checked, and it matched
    for offset, length in exp.part_ranges():
        digester.add_part(read_chunks(path, offset, length))
    return digester.mismatch()


def verify_file_any_part_size(path: Path, expectation: Expectation) -> str:
    """Like `verify_file`, trying plausible part sizes when the upload's is unknown."""
    composite_maybe = bool(expectation.algorithm and expectation.upload_parts)  # moto omits "-<parts>"
    if expectation.part_size or not (expectation.needs_parts() or composite_maybe):
        return verify_file(path, expectation)
    parts = (
        expectation.etag_parts
        or int(expectation.checksum.rpartition("-")[2] or 0)
        or expectation.upload_parts
    )
    reasons = []
    for candidate in plausible_part_sizes(expectation.size, parts):
        reason = verify_file(path, expectation, part_size=candidate)
        if not reason:
            return ""
        reasons.append(reason)
    return reasons[0] if reasons else f"cannot tell the part size of a {parts}-part upload"
