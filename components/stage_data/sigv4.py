"""AWS Signature Version 4 for the bodiless S3 requests staging makes (GET, HEAD, LIST).

The derived signing key depends only on the secret, the day, the region and the service,
so it is computed once a day per region instead of with four HMACs per request; the
canonical request is built from parts the caller already has. The result is the
`Authorization` header botocore's `S3SigV4Auth` computes for the same request
(tests/unit/test_stage_sigv4.py checks them against each other).

Credentials: static keys in the environment are read directly, as botocore's chain would
take them first, so a stage with such keys never imports botocore's session; any other
source (IRSA web identity, profile, container or instance role) goes through botocore's
chain, which also refreshes temporary credentials.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
UNSIGNED = frozenset(("authorization", "connection", "expect", "user-agent", "keep-alive", "te"))


@dataclass(frozen=True, slots=True)
class Keys:
    access_key: str
    secret_key: str
    token: str = ""


class CredentialSource:
    """The current keys: from the environment, or from botocore's chain (refreshed by it)."""

    def __init__(self, environ: Any = os.environ) -> None:
        self._static: Keys | None = None
        self._chain: Any = None
        if environ.get("AWS_ACCESS_KEY_ID") and environ.get("AWS_SECRET_ACCESS_KEY"):
            self._static = Keys(
                environ["AWS_ACCESS_KEY_ID"],
                environ["AWS_SECRET_ACCESS_KEY"],
                environ.get("AWS_SESSION_TOKEN", ""),
            )
        else:
            import botocore.session

            self._chain = botocore.session.get_session().get_credentials()

    @property
    def found(self) -> bool:
        return self._static is not None or self._chain is not None

    def keys(self) -> Keys:
        if self._static is not None:
            return self._static
        frozen = self._chain.get_frozen_credentials()
        return Keys(frozen.access_key, frozen.secret_key, frozen.token or "")


def region_from_environment(environ: Any = os.environ) -> str:
    """The region botocore would use: AWS_DEFAULT_REGION, else the profile's, else us-east-1."""
    if environ.get("AWS_DEFAULT_REGION"):
        return str(environ["AWS_DEFAULT_REGION"])
    import botocore.session

    return botocore.session.get_session().get_config_variable("region") or "us-east-1"


def encode(value: str) -> str:
    """RFC 3986 encoding as SigV4 wants it for query names and values (`/` encoded too)."""
    return quote(value, safe="-_.~")


def canonical_query(query: dict[str, str]) -> str:
    return "&".join(f"{encode(k)}={encode(v)}" for k, v in sorted(query.items()))


class Signer:
    """Signs S3 requests for one region; thread-safe, with the day's key cached."""

    def __init__(self, region: str, service: str = "s3") -> None:
        self.region = region
        self.service = service
        self._lock = threading.Lock()
        self._key: tuple[str, str, bytes] = ("", "", b"")  # (secret, day, derived key)

    def _signing_key(self, secret: str, day: str) -> bytes:
        cached_secret, cached_day, key = self._key
        if cached_secret == secret and cached_day == day:
            return key
        key = hmac.digest(("AWS4" + secret).encode(), day.encode(), "sha256")
        for part in (self.region, self.service, "aws4_request"):
            key = hmac.digest(key, part.encode(), "sha256")
        with self._lock:
            self._key = (secret, day, key)
        return key

    def sign(
        self,
        method: str,
        host: str,
        path: str,
        query: str,
        headers: dict[str, str],
        keys: Keys,
        now: float | None = None,
        amz_date: str = "",
    ) -> dict[str, str]:
        """`headers` plus host, date, payload hash, token and Authorization for an empty body.

        `path` is already URI-encoded (S3 keys are not encoded twice); `query` is
        `canonical_query(...)` of the request's parameters, the same string the URL carries.
        """
        amz_date = amz_date or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
        day = amz_date[:8]
        signed = {name.lower(): " ".join(str(value).split()) for name, value in headers.items()}
        signed = {name: value for name, value in signed.items() if name not in UNSIGNED}
        signed["host"] = host
        signed["x-amz-date"] = amz_date
        signed["x-amz-content-sha256"] = EMPTY_SHA256
        if keys.token:
            signed["x-amz-security-token"] = keys.token
        names = sorted(signed)
        signed_headers = ";".join(names)
        canonical = "\n".join(
            (method, path, query, "".join(f"{n}:{signed[n]}\n" for n in names), signed_headers, EMPTY_SHA256)
        )
        scope = f"{day}/{self.region}/{self.service}/aws4_request"
        to_sign = f"AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        signature = hmac.new(self._signing_key(keys.secret_key, day), to_sign.encode(), "sha256").hexdigest()
        out = dict(headers)
        out.update({k: signed[k] for k in ("x-amz-date", "x-amz-content-sha256")})
        if keys.token:
            out["x-amz-security-token"] = keys.token
        out["Authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={keys.access_key}/{scope}, "
            f"SignedHeaders={signed_headers}, Signature={signature}"
        )
        return out
