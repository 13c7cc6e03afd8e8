"""How the validate and register steps talk to MLflow: which server, and what to do when it fails.

The tracking server and its credentials come only from MLflow's standard environment
variables (MLFLOW_TRACKING_URI, MLFLOW_TRACKING_TOKEN or MLFLOW_TRACKING_USERNAME/PASSWORD;
on a cluster a Kubernetes secret fills them in), never from pipeline parameters, so they
do not show up in the compiled pipeline or the KFP UI. Every call that reaches the server
goes through `call_with_retries`: an unreachable server, a timeout or a 5xx answer is
retried with exponential backoff, and when the attempts run out the step fails with a
`RegistryUnavailable` that names the server and says what to check. Other errors (a
missing alias, a bad request) are not retried: retrying cannot fix them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
# MLflow error codes a retry can cure: the server was down, overloaded or failed inside.
_TRANSIENT_CODES = ("INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED", "ABORTED")


class RegistryUnavailable(RuntimeError):
    """MLflow did not answer (or kept failing) after every retry; the message says what to check."""


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    attempts: int = 6
    """Calls in total before giving up (1 = no retry)."""
    first_delay_s: float = 2.0
    """Wait after the first failure; doubles after each further one."""
    max_delay_s: float = 30.0
    """Upper bound of one wait."""

    def delays_s(self) -> list[float]:
        """The waits between attempts, in order (attempts - 1 of them)."""
        return [min(self.max_delay_s, self.first_delay_s * 2**i) for i in range(max(0, self.attempts - 1))]


def tracking_uri_is_configured() -> bool:
    """MLFLOW_TRACKING_URI is set, or mlflow.set_tracking_uri() was called (the CLI's --mlflow-uri)."""
    from mlflow.tracking._tracking_service.utils import is_tracking_uri_set

    return bool(is_tracking_uri_set())


def tracking_uri() -> str:
    import mlflow

    return str(mlflow.get_tracking_uri())


def is_transient(exc: BaseException) -> bool:
    """True when the failure says the server was unreachable, slow or failing (5xx), not that the
    request was wrong."""
    import requests
    from mlflow.exceptions import MlflowException

    if isinstance(exc, requests.exceptions.ConnectionError | requests.exceptions.Timeout | ConnectionError):
        return True
    if isinstance(exc, requests.exceptions.HTTPError) and exc.response is not None:
        return exc.response.status_code >= 500 or exc.response.status_code == 429
    if isinstance(exc, MlflowException):
        return exc.error_code in _TRANSIENT_CODES
    return False


def call_with_retries(
    what: str,
    func: Callable[[], T],
    policy: RetryPolicy | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Run `func`; retry transient MLflow failures per `policy`, then raise RegistryUnavailable.

    `what` names the operation for the log and the final error ("register a model version").
    Operations retried here must be safe to repeat: the register step makes creation
    idempotent by looking for the version first.
    """
    policy = policy or RetryPolicy()
    delays = policy.delays_s()
    started = time.monotonic()
    for attempt in range(1, policy.attempts + 1):
        try:
            return func()
        except Exception as exc:
            if not is_transient(exc):
                raise
            if attempt == policy.attempts:
                raise RegistryUnavailable(
                    f"MLflow at {tracking_uri()} failed to {what} after {policy.attempts} attempts over "
                    f"{time.monotonic() - started:.0f} s: {_first_line(exc)}. Check that the server is up "
                    f"and that {TRACKING_URI_ENV} (and its credentials) point at it, then retry the step."
                ) from exc
            delay = delays[attempt - 1]
            log.warning(
                "MLflow failed to %s (attempt %d of %d): %s; retrying in %.1f s",
                what,
                attempt,
                policy.attempts,
                _first_line(exc),
                delay,
            )
            sleep(delay)
    raise AssertionError("unreachable")  # the loop either returns or raises


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]
