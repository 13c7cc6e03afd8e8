"""How hard and how patiently staging talks to S3: `TransferSettings` and the retry loop it drives.

`TransferSettings` holds the knobs of one stage (requests in flight, when an object is
downloaded in ranges and how big they are, how many attempts a request and a verification
get, the backoff between them) with defaults that suit one pod staging onto FSx; the
default worker count follows the CPUs the process may use. `with_retries` runs one request
again when it failed with throttling (503 SlowDown), a 5xx or a dropped or stalled
connection, after an exponential backoff with full jitter; any other failure is raised at
once.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from components.stage_data.checksums import MIB

log = logging.getLogger(__name__)
T = TypeVar("T")

RETRYABLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "503",
        "500",
        "502",
        "504",
    }
)


def usable_cpus() -> int:
    """CPUs this process may use: its affinity, capped by a cgroup v2 CPU quota (a pod's limit)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return cpus


def default_max_workers() -> int:
    """Four requests in flight per usable CPU, 8 to 32.

    The downloads run in Python threads: past a few per core they add no throughput (each
    request needs the GIL for its headers and bookkeeping) but cost CPU in GIL hand-offs
    (docs/staging.md).
    """
    return min(32, max(8, 4 * usable_cpus()))


@dataclass(frozen=True, slots=True)
class TransferSettings:
    """How hard to push the endpoint. Defaults suit one pod staging onto FSx."""

    max_workers: int = field(default_factory=default_max_workers)
    multipart_threshold_bytes: int = 64 * MIB
    part_size_bytes: int = 16 * MIB
    request_attempts: int = 6
    verify_attempts: int = 3
    backoff_base_s: float = 0.25
    backoff_max_s: float = 20.0
    read_chunk_bytes: int = 1 * MIB


def is_retryable(exc: BaseException) -> bool:
    """Throttling, server errors and dropped or stalled connections are worth another try."""
    from botocore.exceptions import (
        ClientError,
        ConnectionClosedError,
        ConnectTimeoutError,
        EndpointConnectionError,
        IncompleteReadError,
        ReadTimeoutError,
        ResponseStreamingError,
    )

    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return error.get("Code", "") in RETRYABLE_CODES or int(status or 0) >= 500
    if isinstance(
        exc,
        ConnectionClosedError
        | ConnectTimeoutError
        | EndpointConnectionError
        | IncompleteReadError
        | ReadTimeoutError
        | ResponseStreamingError,
    ):
        return True
    from urllib3.exceptions import HTTPError as Urllib3Error  # ships with botocore

    return isinstance(exc, ConnectionError | TimeoutError | Urllib3Error)


def backoff_s(attempt: int, base_s: float, max_s: float, rng: random.Random | None = None) -> float:
    """Full-jitter exponential backoff: uniform in [0, min(max, base * 2**attempt)]."""
    return (rng or random).uniform(0, min(max_s, base_s * 2**attempt))


def with_retries(
    what: str,
    call: Callable[[], T],
    settings: TransferSettings,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    for attempt in range(settings.request_attempts):
        try:
            return call()
        except Exception as exc:
            if not is_retryable(exc) or attempt == settings.request_attempts - 1:
                raise
            delay = backoff_s(attempt, settings.backoff_base_s, settings.backoff_max_s)
            log.warning(
                "%s: %s; retrying in %.2f s (%d/%d)", what, exc, delay, attempt + 1, settings.request_attempts
            )
            sleep(delay)
    raise AssertionError("unreachable")
