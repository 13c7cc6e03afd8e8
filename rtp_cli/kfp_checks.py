"""Pure logic behind `rtp upload | run | schedule | runs`: no network, no files, no clock.

It reads the pipeline's parameters from the compiled spec and checks `k=v` arguments
against them (name, type, allowed values), converts cron expressions to the 6-field form
the KFP scheduler parses (seconds first), parses intervals, names pipeline versions,
resolves the API token and namespace from flags, environment and files handed in, checks
the backend's release (healthz's tag, else the API server's image tag) against the oldest
one the compiled pipeline runs on and the oldest that honours its retries, and formats
the runs table. Everything here raises `KfpError` with a message that says what
was wrong and what to do, before any request is sent.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trainer.arguments import PIPELINE_SETTINGS
from trainer.config import PRESETS, named_settings


class KfpError(Exception):
    """A command against the KFP API cannot go ahead; the message says what to do."""


ENDPOINT_ENV = "KF_PIPELINES_ENDPOINT"
"""KFP API URL when --host is not given; the same variable kfp.Client reads."""
TOKEN_ENV = "KF_PIPELINES_TOKEN"
"""Bearer token for the KFP API (multi-user Kubeflow), when --token is not given."""
TOKEN_PATH_ENV = "KF_PIPELINES_SA_TOKEN_PATH"
"""Where a projected service-account token lives; the same variable kfp.Client reads."""
DEFAULT_TOKEN_PATH = "/var/run/secrets/kubeflow/pipelines/token"
"""The path Kubeflow's PodDefault mounts a pipelines-audience token at inside a cluster."""
NAMESPACE_ENV = "KF_PIPELINES_NAMESPACE"
"""Profile namespace for multi-user Kubeflow, when --namespace is not given."""
SERVICE_ACCOUNT_NAMESPACE_PATH = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

PARAMETER_CHOICES: dict[str, tuple[str, ...]] = {
    "preset": tuple(PRESETS),
    **{
        param: setting.choices
        for param, setting in named_settings().items()
        if param in PIPELINE_SETTINGS and setting.choices
    },
}
"""Pipeline parameters typed STRING in the spec that only take some values."""
POSITIVE_PARAMETERS = ("steps", "nproc")

TERMINAL_RUN_STATES = ("SUCCEEDED", "SKIPPED", "FAILED", "CANCELED")
"""Runs in these states never change again. (kfp.Client.wait_for_run_completion stops
only on succeeded/failed/skipped/error, so a canceled run would keep it waiting.)"""


# --- pipeline parameters -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PipelineParameter:
    name: str
    parameter_type: str
    """The IR type: STRING, NUMBER_INTEGER, NUMBER_DOUBLE, BOOLEAN, LIST or STRUCT."""
    default: Any
    description: str


def pipeline_parameters(pipeline_spec: Mapping[str, Any]) -> dict[str, PipelineParameter]:
    """The root parameters of a compiled pipeline (the first YAML document, as a dict)."""
    definitions = pipeline_spec.get("root", {}).get("inputDefinitions", {}).get("parameters", {})
    return {
        name: PipelineParameter(
            name=name,
            parameter_type=definition.get("parameterType", "STRING"),
            default=definition.get("defaultValue"),
            description=definition.get("description", ""),
        )
        for name, definition in definitions.items()
    }


_TRUE = {"true", "1", "yes"}
_FALSE = {"false", "0", "no"}
_TYPE_WORDS = {
    "STRING": "a string",
    "NUMBER_INTEGER": "an integer",
    "NUMBER_DOUBLE": "a number",
    "BOOLEAN": "true or false",
    "LIST": "a JSON list",
    "STRUCT": "a JSON object",
}


def _convert(parameter: PipelineParameter, text: str) -> Any:
    kind = parameter.parameter_type
    wrong = KfpError(
        f"parameter {parameter.name}={text!r} is not {_TYPE_WORDS.get(kind, kind)} "
        f"(its type is {kind}; default {parameter.default!r})"
    )
    if kind == "NUMBER_INTEGER":
        if not re.fullmatch(r"[+-]?\d+", text.strip()):
            raise wrong
        return int(text)
    if kind == "NUMBER_DOUBLE":
        try:
            value = float(text)
        except ValueError:
            raise wrong from None
        if not math.isfinite(value):
            raise wrong
        return value
    if kind == "BOOLEAN":
        lowered = text.strip().lower()
        if lowered in _TRUE | _FALSE:
            return lowered in _TRUE
        raise wrong
    if kind in ("LIST", "STRUCT"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            raise wrong from None
        if not isinstance(value, list if kind == "LIST" else dict):
            raise wrong
        return value
    return text


def parse_parameter_arguments(
    arguments: Sequence[str], parameters: Mapping[str, PipelineParameter]
) -> dict[str, Any]:
    """Turn `--param k=v` items into typed run parameters, or say which one is wrong.

    Unknown names, values of the wrong type, values outside a parameter's choices and
    repeated names are errors that name the parameter and what it accepts.
    """
    values: dict[str, Any] = {}
    for item in arguments:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise KfpError(f"--param {item!r} must look like name=value, e.g. --param steps=200")
        if name not in parameters:
            raise KfpError(
                f"unknown pipeline parameter {name!r}; the pipeline takes: {', '.join(sorted(parameters))}"
            )
        if name in values:
            raise KfpError(f"parameter {name!r} is given twice")
        values[name] = check_allowed_value(name, _convert(parameters[name], text))
    from components.check_run.parameters import RunParameterError, check_run_parameters

    try:  # the whole run as the pipeline's first step will see it, defaults included
        check_run_parameters({name: p.default for name, p in parameters.items()} | values)
    except RunParameterError as exc:
        raise KfpError(f"the run's parameters are wrong: {exc}") from None
    return values


def check_allowed_value(name: str, value: Any) -> Any:
    """`value` when parameter `name` may take it, else an KfpError listing what it may take."""
    choices = PARAMETER_CHOICES.get(name)
    if choices and value not in choices:
        raise KfpError(f"parameter {name}={value!r} is not allowed; choose one of: {', '.join(choices)}")
    if name in POSITIVE_PARAMETERS and value < 1:
        raise KfpError(f"parameter {name}={value} must be at least 1")
    return value


# --- schedules ----------------------------------------------------------------------------

_MONTHS = ["JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC"]
_DAYS = ["SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"]


@dataclass(frozen=True, slots=True)
class _CronField:
    label: str
    low: int
    high: int
    names: tuple[str, ...] = ()
    name_base: int = 0
    question_mark: bool = False


_KFP_CRON_FIELDS = (
    _CronField("second", 0, 59),
    _CronField("minute", 0, 59),
    _CronField("hour", 0, 23),
    _CronField("day of month", 1, 31, question_mark=True),
    _CronField("month", 1, 12, tuple(_MONTHS), name_base=1),
    _CronField("day of week", 0, 6, tuple(_DAYS), question_mark=True),
)
_DESCRIPTORS = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")


def _cron_value(field: _CronField, text: str, expression: str) -> int:
    upper = text.upper()
    if upper in field.names:
        return field.names.index(upper) + field.name_base
    if not text.isdigit():
        allowed = f"{field.low}-{field.high}" + (f" or {'/'.join(field.names)}" if field.names else "")
        raise KfpError(f"cron {expression!r}: {field.label} {text!r} is not a value ({allowed})")
    value = int(text)
    if not field.low <= value <= field.high:
        hint = "; use 0 for Sunday" if field.label == "day of week" and value == 7 else ""
        raise KfpError(
            f"cron {expression!r}: {field.label} {value} is outside {field.low}-{field.high}{hint}"
        )
    return value


def _check_cron_field(field: _CronField, text: str, expression: str) -> None:
    for item in text.split(","):
        base, slash, step = item.partition("/")
        if slash and (not step.isdigit() or int(step) < 1):
            raise KfpError(f"cron {expression!r}: {field.label} step {step!r} must be a positive integer")
        if base == "*" or (base == "?" and field.question_mark and not slash):
            continue
        if base == "?":
            raise KfpError(f"cron {expression!r}: '?' is allowed only in day of month and day of week")
        low_text, dash, high_text = base.partition("-")
        low = _cron_value(field, low_text, expression)
        if dash and low > _cron_value(field, high_text, expression):
            raise KfpError(f"cron {expression!r}: {field.label} range {base!r} runs backwards")


def kfp_cron(expression: str) -> str:
    """The 6-field cron (seconds first) the KFP scheduler parses, from a 5- or 6-field one.

    The common 5-field form `minute hour day month weekday` gains a leading `0` (on the
    minute). Descriptors such as `@daily` pass through; `@every` does not (use --interval).
    """
    text = " ".join(expression.split())
    if text.lower() in _DESCRIPTORS:
        return text.lower()
    if text.lower().startswith("@every"):
        raise KfpError(f"cron {expression!r}: use --interval instead of @every, e.g. --interval 6h")
    fields = text.split(" ")
    if len(fields) == 5:
        fields = ["0", *fields]
    if len(fields) != 6:
        raise KfpError(
            f"cron {expression!r} has {len(fields)} fields; give 5 (minute hour day-of-month month "
            "day-of-week, e.g. '0 3 * * *' for 03:00 daily) or 6 with seconds first"
        )
    for field, part in zip(_KFP_CRON_FIELDS, fields, strict=True):
        _check_cron_field(field, part, expression)
    return " ".join(fields)


_INTERVAL_UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def interval_seconds(text: str) -> int:
    """Seconds in an interval written like `90s`, `30m`, `6h`, `1d` or `1h30m`."""
    parts = re.findall(r"(\d+)([smhd])", text.strip().lower())
    if not parts or "".join(n + u for n, u in parts) != text.strip().lower():
        raise KfpError(f"interval {text!r} must look like 30m, 6h, 1d or 1h30m")
    seconds = sum(int(n) * _INTERVAL_UNITS_S[u] for n, u in parts)
    if seconds < 1:
        raise KfpError(f"interval {text!r} must be at least 1s")
    return seconds


def check_max_concurrency(value: int) -> int:
    if not 1 <= value <= 10:
        raise KfpError(f"--max-concurrency {value} must be within 1-10 (the KFP API's range)")
    return value


# --- pipeline versions ----------------------------------------------------------------------

_DIGEST_IN_DESCRIPTION = re.compile(r"spec sha256:([0-9a-f]{64})")


def default_version_name(package_version: str, commit: str, dirty: bool, spec_sha256: str) -> str:
    """`<package version>-<commit>`; a tree with uncommitted changes adds the spec's hash, so
    a changed pipeline never reuses the name of the committed one."""
    name = package_version
    if commit:
        name += f"-{commit[:7]}"
    if dirty or not commit:
        name += f"-dirty-{spec_sha256[:8]}" if commit else f"-{spec_sha256[:8]}"
    return name


def version_description(package_version: str, commit: str, spec_sha256: str) -> str:
    """Shown in the UI under the version; the spec hash lets a re-upload be recognised."""
    return f"rtp {package_version} · commit {commit or 'unknown'} · spec sha256:{spec_sha256}"


def spec_sha256_in(description: str | None) -> str | None:
    match = _DIGEST_IN_DESCRIPTION.search(description or "")
    return match.group(1) if match else None


# --- auth ----------------------------------------------------------------------------------


def resolve_token(
    token_file: str | None, environ: Mapping[str, str], read_file: Callable[[str], str | None]
) -> tuple[str | None, str]:
    """The bearer token and where it came from: the file named by --token-file, then
    $KF_PIPELINES_TOKEN, then the file at $KF_PIPELINES_SA_TOKEN_PATH (default the in-cluster
    projected token). Never a command-line value: argv is visible to every user of the host."""
    if token_file:
        text = read_file(token_file)
        if not text or not text.strip():
            raise KfpError(f"--token-file {token_file}: no such file, or it is empty")
        return text.strip(), f"--token-file {token_file}"
    if environ.get(TOKEN_ENV, "").strip():
        return environ[TOKEN_ENV].strip(), f"${TOKEN_ENV}"
    path = environ.get(TOKEN_PATH_ENV) or DEFAULT_TOKEN_PATH
    text = read_file(path)
    if text and text.strip():
        return text.strip(), path
    return None, "no token"


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def check_token_transport(host: str, has_token: bool, insecure: bool) -> None:
    """Refuse to send a bearer token in clear text to another machine: plain http is fine
    only on loopback (a `kubectl port-forward`) or when the user says --insecure."""
    from urllib.parse import urlparse

    parsed = urlparse(host)
    hostname = (parsed.hostname or "").lower()
    loopback = hostname in LOOPBACK_HOSTS or hostname.startswith("127.")
    if has_token and parsed.scheme == "http" and not loopback and not insecure:
        raise KfpError(
            f"refusing to send a bearer token over plain http to {host}: use https, a port-forward "
            "to 127.0.0.1, or pass --insecure if this network is trusted"
        )


def resolve_namespace(
    flag: str | None, environ: Mapping[str, str], read_file: Callable[[str], str | None]
) -> str | None:
    """--namespace, then $KF_PIPELINES_NAMESPACE, then the pod's own namespace in a cluster."""
    if flag:
        return flag.strip()
    if environ.get(NAMESPACE_ENV, "").strip():
        return environ[NAMESPACE_ENV].strip()
    text = read_file(SERVICE_ACCOUNT_NAMESPACE_PATH)
    return text.strip() if text and text.strip() else None


def auth_failure_message(status: int, host: str, token_source: str, namespace: str | None) -> str:
    if status == 401:
        got = f"a token from {token_source}" if token_source != "no token" else "no token"
        return (
            f"the KFP API at {host} refused the request as unauthenticated (401) with {got}: "
            f"pass a valid bearer token with --token-file or ${TOKEN_ENV} "
            "(e.g. `kubectl create token <service-account> -n <namespace> --audience pipelines.kubeflow.org`)"
        )
    where = f"namespace {namespace!r}" if namespace else "the default namespace"
    return (
        f"the KFP API at {host} denied access to {where} (403): pass your profile namespace with "
        f"--namespace or ${NAMESPACE_ENV}, and check the token's identity is a contributor there"
    )


# --- the backend's version -------------------------------------------------------------------

MIN_BACKEND_VERSION = (2, 5, 0)
"""The oldest KFP backend whose v2 driver reads the platform-spec fields the compiled
pipeline uses for run-time settings (`nodeSelectorJson`, `tolerationJson`,
`pvcNameParameter`, `secretNameParameter`); an older driver rejects or ignores them."""
SUB_DAG_RETRY_VERSION = (2, 14, 0)
"""The first KFP backend that honours `set_retry` on a task inside a sub-DAG (an exit
handler, a `dsl.If`): before it the workflow compiler read retry policies of the root DAG's
tasks only (backend/src/v2/compiler/argocompiler/container.go, getTaskRetryPolicySpec; fixed
by kubeflow/pipelines#11908 for #11288), so such a task runs once, silently."""
UNKNOWN_TAG_RELEASES = "2.5.0-2.15.x"
"""Releases whose published API server image answers healthz with `tag_name: unknown` (the
image is built without its TAG_NAME build argument): their version must come from elsewhere."""
API_SERVER_NAMESPACE = "kubeflow"
API_SERVER_DEPLOYMENT = "ml-pipeline"
API_SERVER_CONTAINER = "ml-pipeline-api-server"
"""Where the KFP manifests (kubeflow/pipelines manifests/kustomize/base/pipeline) run the API
server, whose image tag names its release (ghcr.io/kubeflow/kfp-api-server:2.5.0)."""

_RELEASE_TAG = re.compile(r"v?(\d+)\.(\d+)\.(\d+)(?:[-+.][0-9A-Za-z.+-]*)?")


def _dotted(version: tuple[int, int, int]) -> str:
    return ".".join(map(str, version))


def release_version(tag_name: str | None) -> tuple[int, int, int] | None:
    """The release in healthz's `tag_name` ('2.5.0', 'v2.14.3', '2.5.0-rc.1'), or None when
    it names no release (a development build says 'unknown', a branch or a commit)."""
    found = _RELEASE_TAG.fullmatch((tag_name or "").strip())
    return (int(found[1]), int(found[2]), int(found[3])) if found else None


def image_release(image: str | None) -> tuple[int, int, int] | None:
    """The release an image reference is tagged with ('ghcr.io/kubeflow/kfp-api-server:2.5.0',
    'gcr.io/ml-pipeline/api-server:2.0.5@sha256:...'); None for a digest only, `latest` or no tag."""
    name = (image or "").strip().split("@", 1)[0]
    _, colon, tag = name.rpartition(":")
    if not colon or "/" in tag:  # no tag, or the colon was a registry's port
        return None
    return release_version(tag)


@dataclass(frozen=True, slots=True)
class BackendEvidence:
    """What was learnt about the backend's release before a pipeline is submitted to it."""

    tag_name: str | None
    """healthz's `tag_name` (None when the answer has none)."""
    image: str | None = None
    """The API server's image, read through the Kubernetes API when the tag names no release."""
    image_problem: str = ""
    """Why the image could not be read (no kubeconfig, 403, no such deployment...)."""

    def version(self) -> tuple[tuple[int, int, int] | None, str]:
        """The release and where it was read, or (None, '') when neither names one."""
        found = release_version(self.tag_name)
        if found:
            return found, f"healthz tag_name {self.tag_name!r}"
        found = image_release(self.image)
        if found:
            return found, f"API server image {self.image}"
        return None, ""


def retried_sub_dag_tasks(pipeline_spec: Mapping[str, Any]) -> list[str]:
    """Tasks of a compiled pipeline that have a retry policy and sit in a sub-DAG (not the
    root): those a backend before SUB_DAG_RETRY_VERSION runs once."""
    return sorted(
        name
        for component in (pipeline_spec.get("components") or {}).values()
        for name, task in ((component.get("dag") or {}).get("tasks") or {}).items()
        if task.get("retryPolicy")
    )


def check_backend_version(
    host: str, evidence: BackendEvidence, retried_tasks: Sequence[str] = ()
) -> str | None:
    """Refuse a backend older than MIN_BACKEND_VERSION; a one-line warning (to print) when
    its version cannot be read or when it would drop the retries of `retried_tasks`
    (`retried_sub_dag_tasks`); None when it runs the pipeline as compiled."""
    needed = _dotted(MIN_BACKEND_VERSION)
    retry_needed = _dotted(SUB_DAG_RETRY_VERSION)
    retried = ", ".join(retried_tasks)
    found, source = evidence.version()
    if found is None:
        image = (
            f"the API server image {evidence.image!r} names no release"
            if evidence.image
            else f"its image could not be read ({evidence.image_problem or 'not tried'})"
        )
        retries = (
            f", and the retries of {retried} need {retry_needed} or later (an older backend runs them once)"
            if retried
            else ""
        )
        return (
            f"cannot tell the Kubeflow Pipelines version at {host}: healthz tag_name {evidence.tag_name!r} "
            f"(releases {UNKNOWN_TAG_RELEASES} and development builds say 'unknown') and {image}; "
            f"rtp's pipeline needs {needed} or later{retries}; going on"
        )
    if found < MIN_BACKEND_VERSION:
        raise KfpError(
            f"the Kubeflow Pipelines backend at {host} is {_dotted(found)} ({source}) but rtp's pipeline "
            f"needs {needed} or later (older drivers reject or ignore its PVC, secret, node selector and "
            f"toleration parameters): upgrade Kubeflow Pipelines to {needed}+ (docs/eks.md, step 2)"
        )
    if retried and found < SUB_DAG_RETRY_VERSION:
        return (
            f"the Kubeflow Pipelines backend at {host} is {_dotted(found)} ({source}): it drops the retries "
            f"of {retried} (tasks inside the exit handler and condition; retries there need {retry_needed}, "
            "kubeflow/pipelines#11908), so each runs once and their own S3 and MLflow retries are all "
            f"they get; upgrade to {retry_needed}+ for pod-level retries; going on"
        )
    return None


# --- runs --------------------------------------------------------------------------------


def run_link(ui_host: str, run_id: str) -> str:
    return f"{ui_host.rstrip('/')}/#/runs/details/{run_id}"


def _as_datetime(value: Any) -> dt.datetime | None:
    if value is None or value == "":
        return None
    if isinstance(value, dt.datetime):
        moment = value
    else:
        try:
            moment = dt.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
        except ValueError:
            return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    # The API reports unset times as the Unix epoch.
    return None if moment.year <= 1970 else moment


def run_duration_s(run: Mapping[str, Any], now: dt.datetime) -> float | None:
    """Seconds from creation to finish (or to `now` while the run is still going)."""
    created = _as_datetime(run.get("created_at"))
    if created is None:
        return None
    finished = _as_datetime(run.get("finished_at"))
    if finished is None and run.get("state") in TERMINAL_RUN_STATES:
        return None
    return max(0.0, ((finished or now) - created).total_seconds())


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


RUN_METRIC_COLUMNS = ("train_loss", "holdout_loss", "decision", "model_version", "parent")


def metrics_from_step_records(records: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Key numbers of one run from its steps/<step>.json records on the shared volume."""
    train = records.get("train", {})
    validate = records.get("validate", {})
    register = records.get("register", {})
    parent = records.get("stage_model", {}).get("registry") or {}
    return {
        "train_loss": train.get("final_loss"),
        "holdout_loss": validate.get("holdout_loss"),
        "decision": validate.get("decision"),
        "model_version": register.get("version"),
        # The registered version the run started from (a models:/ model source).
        "parent": f"v{parent['version']}" if parent.get("version") else None,
    }


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def format_runs_table(
    runs: Iterable[Mapping[str, Any]],
    now: dt.datetime,
    metrics: Mapping[str, Mapping[str, Any]] | None = None,
) -> str:
    """One line per run: name, state, start, duration, and the key metrics when known."""
    header = ["run", "state", "created", "duration", *RUN_METRIC_COLUMNS, "run id"]
    rows = [header]
    for run in runs:
        created = _as_datetime(run.get("created_at"))
        numbers = (metrics or {}).get(run.get("run_id", ""), {})
        rows.append(
            [
                str(run.get("display_name") or "-"),
                str(run.get("state") or "-"),
                created.strftime("%Y-%m-%d %H:%M") if created else "-",
                format_duration(run_duration_s(run, now)),
                *(_cell(numbers.get(column)) for column in RUN_METRIC_COLUMNS),
                str(run.get("run_id") or "-"),
            ]
        )
    if len(rows) == 1:
        return "no runs"
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )
