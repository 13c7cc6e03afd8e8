"""The one place S3 clients are made: `s3_client(endpoint_url, kind=...)`.

Every client takes its credentials from botocore's standard chain (IRSA on EKS, environment,
profile, instance role; the lean client reads static keys from the environment itself, as
that chain would first) and the same endpoint handling (an `--endpoint-url` is addressed
path-style). `kind` picks how much of the AWS SDK stands behind it:

- `"boto3"` (the default): a full boto3 client, for writing (`create_bucket`, `upload_file`
  in prepare-data, the demo's embedded S3, tests and benchmarks);
- `"botocore"`: botocore alone (no boto3/s3transfer import: a shorter start-up) with a
  fast timestamp parser: `rtp stage --s3-client botocore`;
- `"lean"`: `LeanS3Client` (lean_s3.py), rtp's own SigV4 signer (sigv4.py) over a small
  HTTP/1.1 keep-alive pool (http_pool.py): what `rtp stage` reads with by default.

botocore's own retries stay on (standard mode) for the botocore-based kinds; downloads add
their own backoff with jitter on top (settings.with_retries), because a stalled body is not
something botocore retries.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from components.stage_data.errors import StageError

S3_CLIENTS = ("lean", "botocore")  # what `rtp stage --s3-client` reads with; see lean_s3.py
CLIENT_KINDS = ("boto3", *S3_CLIENTS)


def s3_client(endpoint_url: str | None = None, max_pool_connections: int = 64, *, kind: str = "boto3") -> Any:
    """An S3 client of `kind` (one of CLIENT_KINDS) for `endpoint_url` (None or "": AWS)."""
    if kind == "lean":
        from components.stage_data.lean_s3 import LeanS3Client

        return LeanS3Client(endpoint_url, max_pool_connections=max_pool_connections)
    if kind not in CLIENT_KINDS:
        raise StageError(f"S3 client kind {kind!r} is not one of {', '.join(CLIENT_KINDS)}")
    options = {
        "endpoint_url": endpoint_url or None,
        "config": _client_config(endpoint_url, max_pool_connections),
    }
    if kind == "botocore":
        import botocore.session

        session = botocore.session.get_session()
        session.get_component("response_parser_factory").set_parser_defaults(
            timestamp_parser=parse_s3_timestamp
        )
        return session.create_client("s3", **options)
    import boto3

    # A fresh session: the credential chain is resolved now, not cached from an earlier client.
    return boto3.session.Session().client("s3", **options)


def _client_config(endpoint_url: str | None, max_pool_connections: int) -> Any:
    from botocore.config import Config

    return Config(
        retries={"max_attempts": 6, "mode": "standard"},
        max_pool_connections=max_pool_connections,
        connect_timeout=10,
        read_timeout=30,
        tcp_keepalive=True,
        s3={"addressing_style": "path"} if endpoint_url else {},
    )


_MONTHS = {m: i for i, m in enumerate(("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct",
                                        "Nov", "Dec"), start=1)}  # fmt: skip


def parse_s3_timestamp(value: str) -> datetime:
    """S3's two timestamp spellings, parsed without dateutil; anything else goes to botocore's parser.

    botocore parses every timestamp (each listed object's LastModified, each GET's
    Last-Modified header) with dateutil: for thousands of small objects, the largest CPU cost
    of a stage after the HTTP exchange itself (docs/staging.md).
    """
    try:
        if value.endswith("Z") and "T" in value:  # 2026-11-30T01:42:00.123Z (XML listings)
            return datetime.fromisoformat(value[:-1]).replace(tzinfo=UTC)
        if value.endswith(" GMT"):  # Sun, 30 Nov 2026 01:42:00 GMT (HTTP headers)
            _, day, month, year, clock, _ = value.split(" ")
            hour, minute, second = clock.split(":")
            return datetime(int(year), _MONTHS[month], int(day), int(hour), int(minute), int(second),
                            tzinfo=UTC)  # fmt: skip
    except (ValueError, KeyError):
        pass
    from botocore.utils import parse_timestamp

    return parse_timestamp(value)
