"""How the validate and register steps talk to MLflow: which server, and what to do when it fails.

The tracking server and its credentials come only from MLflow's standard environment
variables (MLFLOW_TRACKING_URI, MLFLOW_TRACKING_TOKEN or MLFLOW_TRACKING_USERNAME/PASSWORD;
on a cluster a Kubernetes secret fills them in, `MLFLOW_SECRET_KEYS`), never from pipeline
parameters, so they do not show up in the compiled pipeline, the KFP UI or a training
job's manifest. Every call that reaches the server goes through `call_with_retries`: an
unreachable server, a timeout or a 5xx answer is retried with exponential backoff, and
when the attempts run out the step fails with a `RegistryUnavailable` that names the
server and says what to check. Other errors (a missing alias, a bad request) are not
retried: retrying cannot fix them.

A step's calls share one overall deadline (`RetryPolicy.deadline_s`, counted from the
step's first call inside `step_deadline`): MLflow's own HTTP retries are switched off and
its HTTP timeout is capped by the time left while our loop runs, so an unreachable server
fails the step within the deadline instead of stacking two layers of backoff. Model names
are checked (`check_model_name`) before they reach a search filter, and credentials in a
tracking URI (`https://user:password@host`) never reach a message or a file: everything
that shows a URI or an error text passes it through `redact_credentials`.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from trainer.env import strip_secret_newlines

log = logging.getLogger(__name__)

T = TypeVar("T")

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
DEFAULT_MLFLOW_SECRET = "mlflow-credentials"
"""The Kubernetes secret (pipeline parameter `mlflow_secret_name`) that holds the settings below."""
MLFLOW_SECRET_KEYS = {
    # secret key -> environment variable the MLflow client reads. One mapping for both ways
    # the secret reaches a pod: kfp-kubernetes for the pipeline's steps (pipelines.platform)
    # and secretKeyRef entries for a training job's pods (components.train.jobs).
    "tracking_uri": TRACKING_URI_ENV,
    "username": "MLFLOW_TRACKING_USERNAME",
    "password": "MLFLOW_TRACKING_PASSWORD",
}
# MLflow error codes a retry can cure: the server was down, overloaded or failed inside.
_TRANSIENT_CODES = ("INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED", "ABORTED")
# MLflow's own HTTP retry and timeout settings (mlflow.environment_variables): retries are
# ours (call_with_retries), so MLflow's are off while our loop runs, and its timeout is
# capped by the deadline's time left.
_MLFLOW_MAX_RETRIES_ENV = "MLFLOW_HTTP_REQUEST_MAX_RETRIES"
_MLFLOW_TIMEOUT_ENV = "MLFLOW_HTTP_REQUEST_TIMEOUT"
_MAX_HTTP_TIMEOUT_S = 120  # MLflow's default
_MIN_HTTP_TIMEOUT_S = 5  # near the deadline, a healthy server still gets time to answer
# A registered model name: it goes into search filters, URIs (models:/<name>/<version>)
# and file names. components/check_run checks the run parameter against the same pattern.
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,255}")
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]*@")


def redact_credentials(text: str) -> str:
    """`text` (a URI, or an error message holding URIs) with any `user:password@` shown as `***@`."""
    return _USERINFO.sub(lambda m: f"{m.group('scheme')}***@", text)


def check_model_name(name: str) -> str:
    """`name` when it is a valid registered model name, else ValueError saying what is allowed."""
    if not MODEL_NAME.fullmatch(name):
        raise ValueError(
            f"model name {name!r} must be letters, digits, '.', '_' or '-' (at most 256, starting "
            "with a letter or digit)"
        )
    return name


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
    deadline_s: float = 900.0
    """Wall time a step may spend on MLflow, every call and wait included (see `step_deadline`);
    past it, a failed call is not retried. Model uploads count: raise it for very large models."""

    def delays_s(self) -> list[float]:
        """The waits between attempts, in order (attempts - 1 of them)."""
        return [min(self.max_delay_s, self.first_delay_s * 2**i) for i in range(max(0, self.attempts - 1))]


def tracking_uri_is_configured() -> bool:
    """MLFLOW_TRACKING_URI is set, or mlflow.set_tracking_uri() was called (the CLI's --mlflow-uri)."""
    from mlflow.tracking._tracking_service.utils import is_tracking_uri_set

    strip_secret_newlines()  # before MLflow reads them: every step asks this first

    return bool(is_tracking_uri_set())


def tracking_uri() -> str:
    """The tracking URI, credentials redacted: fit for messages, logs and files."""
    import mlflow

    return redact_credentials(str(mlflow.get_tracking_uri()))


_deadline: contextvars.ContextVar[tuple[float, float] | None] = contextvars.ContextVar(
    "rtp_mlflow_deadline", default=None
)


@contextlib.contextmanager
def step_deadline(policy: RetryPolicy | None = None) -> Iterator[None]:
    """Every `call_with_retries` inside shares one deadline of `policy.deadline_s` from now.

    Nested uses keep the outer (earlier) deadline: a step's deadline is its first one.
    """
    strip_secret_newlines()
    if _deadline.get() is not None:
        yield
        return
    seconds = (policy or RetryPolicy()).deadline_s
    token = _deadline.set((time.monotonic() + seconds, seconds))
    try:
        yield
    finally:
        _deadline.reset(token)


@contextlib.contextmanager
def _mlflow_http_settings(timeout_s: float) -> Iterator[None]:
    """MLflow's own HTTP retries off and its timeout at most `timeout_s` (but not under a few
    seconds), restored afterwards."""
    saved = {name: os.environ.get(name) for name in (_MLFLOW_MAX_RETRIES_ENV, _MLFLOW_TIMEOUT_ENV)}
    os.environ[_MLFLOW_MAX_RETRIES_ENV] = "0"
    configured = int(saved[_MLFLOW_TIMEOUT_ENV] or _MAX_HTTP_TIMEOUT_S)
    os.environ[_MLFLOW_TIMEOUT_ENV] = str(
        max(min(_MIN_HTTP_TIMEOUT_S, configured), min(configured, int(timeout_s)))
    )
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


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
    deadline, deadline_s = _deadline.get() or (started + policy.deadline_s, policy.deadline_s)
    for attempt in range(1, policy.attempts + 1):
        try:
            with _mlflow_http_settings(deadline - time.monotonic()):
                return func()
        except Exception as exc:
            if not is_transient(exc):
                raise
            delay = delays[attempt - 1] if attempt < policy.attempts else 0.0
            out_of_time = time.monotonic() + delay + 1.0 > deadline  # no time left for another try
            if attempt == policy.attempts or out_of_time:
                stop = "reaching" if out_of_time else "within"
                raise RegistryUnavailable(
                    f"MLflow at {tracking_uri()} failed to {what} after {attempt} attempts over "
                    f"{time.monotonic() - started:.0f} s ({stop} the step's MLflow deadline of "
                    f"{deadline_s:.0f} s): {_first_line(exc)}. Check that the server is up and that "
                    f"{TRACKING_URI_ENV} (and its credentials) point at it, then retry the step."
                ) from exc
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
    text = redact_credentials(str(exc)).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]
