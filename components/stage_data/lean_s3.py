"""A lean S3 reader for staging: SigV4-signed LIST, HEAD and GET over a small keep-alive pool.

botocore spends CPU on every request before and after the bytes move (endpoint rules, a
dozen event hooks, header parsing into a modelled response, dateutil timestamps), and its
client is slow to build (it loads the whole S3 model); docs/staging.md has the figures. For
a prefix of thousands of small objects, on the same cores as everything else, that overhead
*is* the stage. This client answers only the three calls staging makes: its own SigV4
signer with the day's key cached (sigv4.py; keys from the environment, or botocore's
credential chain for IRSA, profiles and instance roles, refreshed as botocore refreshes
them) over a small HTTP/1.1 keep-alive pool (http_pool.py). It mimics the slice of the
botocore client API that staging uses (`get_object`, `head_object`,
`get_paginator("list_objects_v2")`) and raises botocore's `ClientError` /
`EndpointConnectionError` / `NoCredentialsError`, so retries and messages are shared with
the botocore path (`rtp stage --s3-client botocore`). It is made by
`s3_clients.s3_client(kind="lean")`.

Addressing: an `--endpoint-url` is used path-style (`<endpoint>/<bucket>/<key>`), as the
botocore client is configured for it; on AWS, virtual-hosted style on the regional
endpoint, following S3's `x-amz-bucket-region` answer once when the bucket lives in
another region.
"""

from __future__ import annotations

import functools
import re
import threading
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from components.stage_data.http_pool import ConnectFailed, Pool
from components.stage_data.settings import TransferSettings, with_retries
from components.stage_data.sigv4 import CredentialSource, Signer, canonical_query, region_from_environment

S3_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
_DNS_BUCKET = re.compile(r"^[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$")  # no dots: TLS wildcard must match
_CHECKSUM_HEADERS = {"CRC32": "x-amz-checksum-crc32", "CRC32C": "x-amz-checksum-crc32c",
                     "SHA256": "x-amz-checksum-sha256"}  # fmt: skip


def error_from_response(status: int, body: bytes, headers: Any, operation: str) -> Any:
    """botocore's ClientError for an S3 error answer (XML body, or only a status for HEAD)."""
    from botocore.exceptions import ClientError

    code, message = str(status), ""
    if body:
        try:
            root = ET.fromstring(body)
            code = root.findtext("Code") or code
            message = root.findtext("Message") or ""
        except ET.ParseError:
            message = body[:200].decode(errors="replace")
    elif status == 404:
        code = "404"
    response = {
        "Error": {"Code": code, "Message": message},
        "ResponseMetadata": {"HTTPStatusCode": status, "HTTPHeaders": dict(headers or {})},
    }
    return ClientError(response, operation)


def _url_decoded(key: str) -> str:
    """A listed key with encoding-type=url: most escape only their slashes (`%2F`), which a
    replace decodes faster than `unquote`'s general path, run once per listed key."""
    plain = key.replace("%2F", "/")
    return plain if "%" not in plain else unquote(key)


def parse_list_page(body: bytes) -> dict[str, Any]:
    """A ListObjectsV2 answer (with encoding-type=url) as botocore would page it."""
    root = ET.fromstring(body)
    url_encoded = (root.findtext(f"{S3_NS}EncodingType") or "") == "url"
    contents = []
    for item in root.iter(f"{S3_NS}Contents"):
        key = item.findtext(f"{S3_NS}Key") or ""
        contents.append(
            {
                "Key": _url_decoded(key) if url_encoded else key,
                "Size": int(item.findtext(f"{S3_NS}Size") or 0),
                "ETag": item.findtext(f"{S3_NS}ETag") or "",
                "ChecksumAlgorithm": [e.text for e in item.iter(f"{S3_NS}ChecksumAlgorithm") if e.text],
            }
        )
    return {
        "Contents": contents,
        "IsTruncated": (root.findtext(f"{S3_NS}IsTruncated") or "false").lower() == "true",
        "NextContinuationToken": root.findtext(f"{S3_NS}NextContinuationToken") or "",
    }


class _Body:
    """The streaming body of a GET; its connection goes back to the pool once read to the end."""

    def __init__(self, response: Any) -> None:
        self._response = response

    def iter_chunks(self, chunk_size: int) -> Iterator[bytes]:
        try:
            yield from self._response.stream(chunk_size)
        finally:
            self._response.release_conn()  # closed, unless read to its end


class LeanS3Client:
    def __init__(self, endpoint_url: str | None = None, max_pool_connections: int = 64) -> None:
        self._credentials = CredentialSource()
        self._region = region_from_environment()
        self._endpoint_url = (endpoint_url or "").rstrip("/")
        self._bucket_regions: dict[str, str] = {}
        self._signers: dict[str, Signer] = {}
        self._addresses: dict[str, tuple[str, str, int, str, str]] = {}
        self._lock = threading.Lock()
        self._pool = Pool(maxsize=max_pool_connections, connect_timeout_s=10, read_timeout_s=30)

    # -- plumbing

    def _base(self, bucket: str) -> str:
        if self._endpoint_url:
            return f"{self._endpoint_url}/{bucket}"
        region = self._bucket_regions.get(bucket, self._region)
        if _DNS_BUCKET.match(bucket):
            return f"https://{bucket}.s3.{region}.amazonaws.com"
        return f"https://s3.{region}.amazonaws.com/{bucket}"

    def _address(self, bucket: str) -> tuple[str, str, int, str, str]:
        """(scheme, host, port, netloc, path) of the bucket's base URL, parsed once per base."""
        base = self._base(bucket)
        found = self._addresses.get(base)
        if found is None:
            parts = urlsplit(base)
            scheme = parts.scheme or "http"
            host = parts.hostname or ""
            port = parts.port or (443 if scheme == "https" else 80)
            netloc = host if parts.port is None else f"{host}:{parts.port}"
            found = self._addresses[base] = (scheme, host, port, netloc, parts.path)
        return found

    def _signer(self, region: str) -> Signer:
        signer = self._signers.get(region)
        if signer is None:
            with self._lock:
                signer = self._signers.setdefault(region, Signer(region))
        return signer

    def _request(
        self,
        method: str,
        bucket: str,
        key: str,
        query: dict[str, str],
        headers: dict[str, str],
        operation: str,
        stream: bool,
    ) -> Any:
        if not self._credentials.found:
            from botocore.exceptions import NoCredentialsError  # imported on errors only

            raise NoCredentialsError()
        for _redirect in range(2):
            scheme, host, port, netloc, base_path = self._address(bucket)
            path = f"{base_path}/{quote(key, safe='/~')}"
            query_text = canonical_query(query)
            region = self._bucket_regions.get(bucket, self._region)
            signed = self._signer(region).sign(
                method, netloc, path, query_text, headers, self._credentials.keys()
            )
            target = f"{path}?{query_text}" if query_text else path
            try:
                response = self._pool.request(method, scheme, host, port, target, {"Host": netloc, **signed})
            except ConnectFailed as exc:
                from botocore.exceptions import EndpointConnectionError

                raise EndpointConnectionError(endpoint_url=f"{scheme}://{netloc}{path}", error=exc) from exc
            if response.status < 300:
                if not stream:
                    response.release_conn()  # a HEAD: headers only
                return response
            body = response.read() if method != "HEAD" else b""
            response.release_conn()
            moved = response.headers.get("x-amz-bucket-region", "")
            if not self._endpoint_url and moved and moved != region and _redirect == 0:
                with self._lock:
                    self._bucket_regions[bucket] = moved
                continue
            raise error_from_response(response.status, body, response.headers, operation)
        raise AssertionError("unreachable")

    @staticmethod
    def _described(response: Any) -> dict[str, Any]:
        answer: dict[str, Any] = {
            "ContentLength": int(response.headers.get("content-length", 0)),
            "ETag": response.headers.get("etag", ""),
        }
        # The encryption decides whether the ETag is an MD5 (checksums.etag_encryption).
        if response.headers.get("x-amz-server-side-encryption"):
            answer["ServerSideEncryption"] = response.headers["x-amz-server-side-encryption"]
        if response.headers.get("x-amz-server-side-encryption-customer-algorithm"):
            answer["SSECustomerAlgorithm"] = response.headers[
                "x-amz-server-side-encryption-customer-algorithm"
            ]
        if response.headers.get("x-amz-mp-parts-count"):
            answer["PartsCount"] = int(response.headers["x-amz-mp-parts-count"])
        for algorithm, header in _CHECKSUM_HEADERS.items():
            if response.headers.get(header):
                answer[f"Checksum{algorithm}"] = response.headers[header]
        return answer

    # -- the botocore client API slice that staging uses

    def get_object(
        self, Bucket: str, Key: str, IfMatch: str = "", Range: str = "", ChecksumMode: str = ""
    ) -> dict[str, Any]:
        headers = {}
        if IfMatch:
            headers["If-Match"] = IfMatch
        if Range:
            headers["Range"] = Range
        if ChecksumMode:
            headers["x-amz-checksum-mode"] = ChecksumMode
        response = self._request("GET", Bucket, Key, {}, headers, "GetObject", stream=True)
        return {**self._described(response), "Body": _Body(response)}

    def head_object(
        self, Bucket: str, Key: str, ChecksumMode: str = "", PartNumber: int = 0
    ) -> dict[str, Any]:
        headers = {"x-amz-checksum-mode": ChecksumMode} if ChecksumMode else {}
        query = {"partNumber": str(PartNumber)} if PartNumber else {}
        return self._described(self._request("HEAD", Bucket, Key, query, headers, "HeadObject", stream=False))

    def list_objects_v2(
        self, Bucket: str, Prefix: str = "", ContinuationToken: str = "", StartAfter: str = ""
    ) -> dict[str, Any]:
        query = {"list-type": "2", "encoding-type": "url", "prefix": Prefix}
        if ContinuationToken:
            query["continuation-token"] = ContinuationToken
        elif StartAfter:  # S3 ignores it beside a continuation token
            query["start-after"] = StartAfter
        response = self._request("GET", Bucket, "", query, {}, "ListObjectsV2", stream=True)
        return parse_list_page(response.read())

    def get_paginator(self, operation: str) -> _ListPaginator:
        if operation != "list_objects_v2":
            raise NotImplementedError(operation)
        return _ListPaginator(self)


class _ListPaginator:
    def __init__(self, client: LeanS3Client) -> None:
        self._client = client

    def paginate(self, Bucket: str, Prefix: str = "", StartAfter: str = "") -> Iterator[dict[str, Any]]:
        token = ""
        while True:
            page = with_retries(
                f"LIST s3://{Bucket}/{Prefix}",
                functools.partial(
                    self._client.list_objects_v2,
                    Bucket=Bucket,
                    Prefix=Prefix,
                    ContinuationToken=token,
                    StartAfter=StartAfter,
                ),
                TransferSettings(),
            )
            yield page
            if not page["IsTruncated"] or not page["NextContinuationToken"]:
                return
            token = page["NextContinuationToken"]
