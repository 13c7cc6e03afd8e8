"""The I/O half of `rtp upload | run | schedule | runs`: thin calls through `kfp.Client`.

Each function does one operation against the KFP v2beta1 API and returns plain data;
the decisions (parameter checks, cron form, version names, token choice) live in
`rtp_cli.kfp_checks`. API failures become `KfpError` with a one-line message saying what to
do: 401 and 403 name the token source and namespace, an unreachable host names the URL, TLS
and protocol failures say which (`transport_failure`), and an answer that is not the API's
JSON says so. `connect` keeps the backend's release from its health answer (`tag_name`, which
the API server writes beside the swagger's fields) for the version check; when that names no
release, `api_server_image` reads the API server's image through the Kubernetes API.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import io
import json
import logging
import os
import re
import ssl
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rtp_cli import kfp_checks
from rtp_cli.kfp_checks import KfpError

log = logging.getLogger(__name__)

_PAGE_SIZE = 100


# --- the compiled package -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Package:
    path: Path
    spec: dict[str, Any]
    """The first YAML document: the PipelineSpec as a dict."""
    sha256: str


def load_package(path: str | Path) -> Package:
    file = Path(path)
    try:
        data = file.read_bytes()
        documents = [d for d in yaml.safe_load_all(data) if d]
    except OSError as exc:
        raise KfpError(f"cannot read the pipeline package {file}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise KfpError(f"{file} is not a compiled pipeline (YAML error: {exc})") from None
    if not documents or not isinstance(documents[0], dict) or "root" not in documents[0]:
        raise KfpError(f"{file} is not a compiled KFP pipeline; make one with `rtp compile`")
    return Package(file, documents[0], hashlib.sha256(data).hexdigest())


def compile_package(folder: Path, image: str) -> Package:
    from pipelines.pipeline import compile_pipeline

    return load_package(compile_pipeline(str(folder / "pipeline.yaml"), image=image))


# --- connection -----------------------------------------------------------------------------


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


@dataclass(slots=True)
class Connection:
    host: str
    ui_host: str
    namespace: str | None
    token_source: str
    client: Any = field(repr=False)
    backend_tag: str | None = None
    """The backend's release as healthz's `tag_name` gives it (None when it gives none)."""


_CHECK_HOST = (
    "check that --host is the KFP API (e.g. `kubectl port-forward -n kubeflow svc/ml-pipeline 8888:8888` "
    "then --host http://127.0.0.1:8888)"
)


def _one_line(text: Any, limit: int = 200) -> str:
    line = re.sub(r"\s+", " ", str(text)).strip()
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _causes(exc: BaseException) -> list[BaseException]:
    """The exception and what it wraps: urllib3 keeps the cause in `reason` and `args`."""
    found: list[BaseException] = []
    stack: list[Any] = [exc]
    while stack and len(found) < 20:
        item = stack.pop()
        if not isinstance(item, BaseException) or any(item is seen for seen in found):
            continue
        found.append(item)
        stack += [getattr(item, "reason", None), item.__cause__, item.__context__, *item.args]
    return found


def transport_failure(host: str, exc: BaseException, doing: str) -> str:
    """One line for a request that got no HTTP answer: what went wrong, what to do."""
    import http.client

    causes = _causes(exc)
    text = " ".join(str(cause) for cause in causes)
    other_scheme = re.sub(r"^https?://", "", host)
    if (
        any(isinstance(c, ssl.SSLCertVerificationError) for c in causes)
        or "CERTIFICATE_VERIFY_FAILED" in text
    ):
        detail = next(
            (
                c.verify_message
                for c in causes
                if isinstance(c, ssl.SSLCertVerificationError) and c.verify_message
            ),
            "certificate verify failed",
        )
        return (
            f"the TLS certificate of {host} could not be verified ({detail}) while {doing}: if the cluster "
            "uses its own CA, point SSL_CERT_FILE at its bundle; or reach the API through "
            "`kubectl port-forward -n kubeflow svc/ml-pipeline 8888:8888` and --host http://127.0.0.1:8888"
        )
    if any(isinstance(c, ssl.SSLError) for c in causes) or "SSLError" in text:
        if re.search(r"WRONG_VERSION_NUMBER|wrong version number|record layer failure|HTTP_REQUEST", text):
            return (
                f"{host} does not speak TLS (its answer to the TLS handshake was plain data) while {doing}: "
                f"it looks like a plain-http server; use --host http://{other_scheme}"
            )
        reason = next((c for c in causes if isinstance(c, ssl.SSLError)), exc)
        return f"TLS with {host} failed ({_one_line(reason)}) while {doing}: check --host and that it serves https"
    if any(isinstance(c, (http.client.HTTPException, ConnectionResetError)) for c in causes):
        # RemoteDisconnected is a BadStatusLine: no answer at all, or not an HTTP one.
        reason = next(c for c in causes if isinstance(c, (http.client.HTTPException, ConnectionResetError)))
        return (
            f"{host} answered with something that is not HTTP, or closed the connection without an answer "
            f"({type(reason).__name__}: {_one_line(reason, 80)}), while {doing}: {_CHECK_HOST}"
            + (f"; if it serves TLS, use --host https://{other_scheme}" if host.startswith("http://") else "")
        )
    return f"cannot reach the KFP API at {host} ({type(exc).__name__}) while {doing}: {_CHECK_HOST}"


def not_the_api_message(host: str, doing: str, why: str) -> str:
    return (
        f"the answer of {host} while {doing} is not the KFP API's JSON ({_one_line(why, 120)}): {_CHECK_HOST}"
    )


@contextlib.contextmanager
def api_errors(host: str, token_source: str, namespace: str | None, doing: str) -> Iterator[None]:
    """Turn kfp_server_api and connection failures into an KfpError that says what to do."""
    import kfp_server_api
    import urllib3

    try:
        yield
    except kfp_server_api.ApiException as exc:
        if exc.status in (401, 403):
            raise KfpError(
                kfp_checks.auth_failure_message(exc.status, host, token_source, namespace)
            ) from None
        if not exc.status:  # kfp_server_api's own wrapping of an SSL error: no answer at all
            raise KfpError(transport_failure(host, exc, doing)) from None
        try:
            answer = json.loads(exc.body)
        except (TypeError, ValueError):
            raise KfpError(
                not_the_api_message(host, doing, f"{exc.status} {exc.reason}: {exc.body!r}")
            ) from None
        detail = answer.get("message", exc.body) if isinstance(answer, dict) else exc.body
        raise KfpError(
            f"{doing} failed: the KFP API answered {exc.status} {exc.reason}: {_one_line(detail, 500)}"
        ) from None
    except urllib3.exceptions.HTTPError as exc:
        raise KfpError(transport_failure(host, exc, doing)) from None
    except (ValueError, TypeError, AttributeError, KeyError) as exc:
        # kfp_server_api could not read the answer into the API's types.
        raise KfpError(not_the_api_message(host, doing, f"{type(exc).__name__}: {exc}")) from None


def _health(host: str, body: bytes) -> dict[str, Any]:
    """The healthz answer, which every KFP API gives as a JSON object."""
    try:
        health = json.loads(body)
    except ValueError:
        health = None
    if not isinstance(health, dict):
        raise KfpError(not_the_api_message(host, "checking the API's health", repr(body[:80])))
    return health


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # kfp.Client prints its own "details" links and warns about SDK/server versions; rtp
    # prints one line per outcome instead.
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def connect(
    host: str | None,
    token_file: str | None = None,
    namespace: str | None = None,
    ui_host: str | None = None,
    environ: dict[str, str] | None = None,
    insecure: bool = False,
) -> Connection:
    """Check the API answers (once: kfp.Client itself retries healthz for 25 s) and build a client."""
    import kfp
    import kfp_server_api

    environ = dict(os.environ) if environ is None else environ
    host = (host or environ.get(kfp_checks.ENDPOINT_ENV) or "").rstrip("/")
    if not host:
        raise KfpError(
            f"no KFP API URL: pass --host (e.g. http://127.0.0.1:8888) or set ${kfp_checks.ENDPOINT_ENV}"
        )
    if not host.startswith(("http://", "https://")):
        raise KfpError(f"--host {host!r} must start with http:// or https://")
    bearer, token_source = kfp_checks.resolve_token(token_file, environ, _read_text)
    kfp_checks.check_token_transport(host, bearer is not None, insecure)
    namespace = kfp_checks.resolve_namespace(namespace, environ, _read_text)
    config = kfp_server_api.Configuration(host=host)
    if bearer:
        config.api_key["authorization"] = bearer
        config.api_key_prefix["authorization"] = "Bearer"
    if not log.isEnabledFor(logging.DEBUG):  # urllib3 warns on each retry: rtp prints one line
        logging.getLogger("urllib3").setLevel(logging.ERROR)
    with api_errors(host, token_source, namespace, "checking the API's health"):
        answer = kfp_server_api.HealthzServiceApi(
            kfp_server_api.ApiClient(config)
        ).healthz_service_get_healthz(_preload_content=False)
    health = _health(host, answer.data)
    if health.get("multi_user") and not namespace:
        raise KfpError(
            f"the Kubeflow Pipelines at {host} is multi-user: pass your profile namespace with "
            f"--namespace or ${kfp_checks.NAMESPACE_ENV}"
        )
    with _quiet(), api_errors(host, token_source, namespace, "connecting"):
        # A namespace other than kfp's placeholder 'kubeflow' also stops the client from
        # probing healthz again; every call below passes the namespace explicitly anyway.
        client = kfp.Client(
            host=host, existing_token=bearer, namespace=namespace or "kubeflow", ui_host=ui_host
        )
    tag = health.get("tag_name")
    return Connection(
        host,
        (ui_host or host).rstrip("/"),
        namespace,
        token_source,
        client,
        backend_tag=tag if isinstance(tag, str) else None,
    )


def api_server_image(
    namespace: str = kfp_checks.API_SERVER_NAMESPACE, timeout_s: float = 5.0
) -> tuple[str | None, str]:
    """The image of the KFP API server's container (Deployment `ml-pipeline`), read through
    the Kubernetes API with the local kubeconfig ($KUBECONFIG, ~/.kube/config) or, inside a
    pod, its service account: (image, '') or (None, why it could not be read). Release
    images of KFP 2.5.0-2.15.x answer healthz with `tag_name: unknown`; their image tag is
    where the release is still written."""
    import urllib3
    from kubernetes import client, config

    where = f"deployment {namespace}/{kfp_checks.API_SERVER_DEPLOYMENT}"
    configuration = client.Configuration()
    try:
        try:
            # Read now: the client reads $KUBECONFIG once, when it is first imported.
            kubeconfig = os.environ.get("KUBECONFIG") or None
            config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        except (config.ConfigException, OSError):
            config.load_incluster_config(client_configuration=configuration)
    except (config.ConfigException, OSError):
        return None, "no kubeconfig and not in a pod, so the Kubernetes API was not asked"
    configuration.retries = False  # one try: this only refines a warning
    try:
        with client.ApiClient(configuration) as api:
            deployment = client.AppsV1Api(api).read_namespaced_deployment(
                kfp_checks.API_SERVER_DEPLOYMENT, namespace, _request_timeout=timeout_s
            )
    except client.ApiException as exc:
        return None, f"the Kubernetes API answered {exc.status} {exc.reason} for {where}"
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        return None, f"the Kubernetes API at {configuration.host} did not answer ({type(exc).__name__})"
    containers = deployment.spec.template.spec.containers or []
    for container in containers:
        if container.name == kfp_checks.API_SERVER_CONTAINER:
            return container.image, ""
    return None, f"{where} has no container {kfp_checks.API_SERVER_CONTAINER!r}"


@contextlib.contextmanager
def _call(conn: Connection, doing: str) -> Iterator[None]:
    with _quiet(), api_errors(conn.host, conn.token_source, conn.namespace, doing):
        yield


# --- pipelines and versions ----------------------------------------------------------------


def _equals_filter(key: str, value: str) -> str:
    return json.dumps({"predicates": [{"operation": "EQUALS", "key": key, "string_value": value}]})


def find_pipeline(conn: Connection, name: str) -> dict[str, Any] | None:
    with _call(conn, f"looking up pipeline {name!r}"):
        response = conn.client.list_pipelines(
            filter=_equals_filter("display_name", name), page_size=_PAGE_SIZE, namespace=conn.namespace
        )
    matches = [p.to_dict() for p in response.pipelines or [] if name in (p.display_name, p.name)]
    if len(matches) > 1:
        raise KfpError(f"{len(matches)} pipelines are named {name!r}; pass --name to pick a unique one")
    return matches[0] if matches else None


def list_versions(conn: Connection, pipeline_id: str) -> list[dict[str, Any]]:
    """Every version of a pipeline, newest first."""
    versions: list[dict[str, Any]] = []
    token = ""
    while True:
        with _call(conn, "listing pipeline versions"):
            response = conn.client.list_pipeline_versions(
                pipeline_id, page_token=token, page_size=_PAGE_SIZE, sort_by="created_at desc"
            )
        versions += [v.to_dict() for v in response.pipeline_versions or []]
        token = response.next_page_token or ""
        if not token:
            return versions


def find_version(conn: Connection, pipeline_id: str, name: str) -> dict[str, Any] | None:
    """A version by name, or the newest one for `latest`."""
    versions = list_versions(conn, pipeline_id)
    if name == "latest":
        return versions[0] if versions else None
    return next((v for v in versions if name in (v.get("name"), v.get("display_name"))), None)


@dataclass(frozen=True, slots=True)
class UploadResult:
    action: str
    """created (new pipeline), new-version, or unchanged (this version was already there)."""
    pipeline_id: str
    version_id: str
    version_name: str


def upload(
    conn: Connection, package: Package, name: str, version_name: str, description: str
) -> UploadResult:
    """Upload `package` as version `version_name` of pipeline `name`, creating the pipeline
    if needed. The same version with the same spec hash is a no-op; with another hash it is
    an error, since KFP versions are immutable."""
    import kfp_server_api

    pipeline = find_pipeline(conn, name)
    action = "new-version"
    if pipeline is None:
        # Created empty, then given its first version: that way the first version carries
        # the version name too (an upload names it after the pipeline).
        with _call(conn, f"creating pipeline {name!r}"):
            created = conn.client.pipelines.pipeline_service_create_pipeline(
                pipeline=kfp_server_api.V2beta1Pipeline(
                    name=name,
                    display_name=name,
                    description=pipeline_description(package),
                    namespace=conn.namespace,
                )
            )
        pipeline = created.to_dict()
        action = "created"
    else:
        existing = find_version(conn, pipeline["pipeline_id"], version_name)
        if existing is not None:
            if kfp_checks.spec_sha256_in(existing.get("description")) == package.sha256:
                return UploadResult(
                    "unchanged", pipeline["pipeline_id"], existing["pipeline_version_id"], version_name
                )
            raise KfpError(
                f"pipeline {name!r} already has a version {version_name!r} with a different spec; "
                "versions cannot change: pass a new --version (or commit your change for a new default name)"
            )
    with _call(conn, f"uploading version {version_name!r} of pipeline {name!r}"):
        version = conn.client.upload_pipeline_version(
            str(package.path),
            pipeline_version_name=version_name,
            pipeline_id=pipeline["pipeline_id"],
            description=description,
        )
    return UploadResult(action, pipeline["pipeline_id"], version.pipeline_version_id, version_name)


def pipeline_description(package: Package) -> str:
    return str(package.spec.get("pipelineInfo", {}).get("description", ""))[:1000]


def version_spec(version: dict[str, Any]) -> dict[str, Any]:
    """The PipelineSpec dict of a version as the API returns it (bare, or with a platform spec)."""
    spec = version.get("pipeline_spec") or {}
    return spec.get("pipeline_spec", spec) if "platform_spec" in spec else spec


# --- runs -----------------------------------------------------------------------------------


def ensure_experiment(conn: Connection, name: str) -> str:
    with _call(conn, f"finding or creating experiment {name!r}"):
        return conn.client.create_experiment(name, namespace=conn.namespace).experiment_id


def start_run(
    conn: Connection,
    experiment_id: str,
    display_name: str,
    parameters: dict[str, Any],
    package: Package | None = None,
    pipeline_id: str | None = None,
    version_id: str | None = None,
) -> str:
    with _call(conn, f"starting run {display_name!r}"):
        run = conn.client.run_pipeline(
            experiment_id=experiment_id,
            job_name=display_name,
            pipeline_package_path=str(package.path) if package else None,
            params=parameters,
            pipeline_id=pipeline_id,
            version_id=version_id,
        )
    return str(run.run_id)


def wait_for_run(
    conn: Connection,
    run_id: str,
    timeout_s: float,
    poll_s: float,
    on_state: Callable[[str], None] = lambda state: None,
) -> dict[str, Any]:
    """Poll until the run reaches a terminal state; report each new state to `on_state`."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        with _call(conn, f"reading run {run_id}"):
            run = conn.client.get_run(run_id).to_dict()
        state = run.get("state") or "RUNTIME_STATE_UNSPECIFIED"
        if state != last:
            on_state(state)
            last = state
        if state in kfp_checks.TERMINAL_RUN_STATES:
            return run
        if time.monotonic() > deadline:
            raise KfpError(
                f"run {run_id} is still {state} after {timeout_s:.0f} s; raise --timeout-s or look in the UI"
            )
        time.sleep(poll_s)


def recent_runs(conn: Connection, experiment_id: str | None, limit: int) -> list[dict[str, Any]]:
    with _call(conn, "listing runs"):
        response = conn.client.list_runs(
            page_size=limit, sort_by="created_at desc", experiment_id=experiment_id, namespace=conn.namespace
        )
    return [r.to_dict() for r in response.runs or []]


def find_experiment(conn: Connection, name: str) -> str | None:
    with _call(conn, f"looking up experiment {name!r}"):
        response = conn.client.list_experiments(
            filter=_equals_filter("display_name", name), page_size=_PAGE_SIZE, namespace=conn.namespace
        )
    matches = [e.experiment_id for e in response.experiments or [] if e.display_name == name]
    return matches[0] if matches else None


def step_records(mount: str | Path, run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The steps/<step>.json records a run left on the shared volume (empty when absent)."""
    parameters = (run.get("runtime_config") or {}).get("parameters") or {}
    folder = Path(mount) / "rtp" / "runs" / (parameters.get("run_name") or run.get("run_id") or "")
    records: dict[str, dict[str, Any]] = {}
    for file in sorted((folder / "steps").glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            records[file.stem] = json.loads(file.read_text())
    return records


# --- recurring runs ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Schedule:
    name: str
    experiment_id: str
    pipeline_id: str
    version_id: str
    parameters: dict[str, Any]
    cron: str | None
    interval_s: int | None
    max_concurrency: int
    no_catchup: bool
    description: str = ""


def find_recurring_runs(conn: Connection, experiment_id: str, name: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    token = ""
    while True:
        with _call(conn, "listing recurring runs"):
            response = conn.client.list_recurring_runs(
                page_token=token, page_size=_PAGE_SIZE, experiment_id=experiment_id
            )
        found += [r.to_dict() for r in response.recurring_runs or [] if r.display_name == name]
        token = response.next_page_token or ""
        if not token:
            return found


def same_schedule(existing: dict[str, Any], wanted: Schedule) -> bool:
    """Whether a recurring run already does what `wanted` asks (enabled state aside)."""
    trigger = existing.get("trigger") or {}
    cron = (trigger.get("cron_schedule") or {}).get("cron")
    interval = (trigger.get("periodic_schedule") or {}).get("interval_second")
    reference = existing.get("pipeline_version_reference") or {}
    return (
        cron == wanted.cron
        and (int(interval) if interval else None) == wanted.interval_s
        and reference.get("pipeline_id") == wanted.pipeline_id
        and reference.get("pipeline_version_id") == wanted.version_id
        and ((existing.get("runtime_config") or {}).get("parameters") or {}) == wanted.parameters
        and int(existing.get("max_concurrency") or 0) == wanted.max_concurrency
        and bool(existing.get("no_catchup")) == wanted.no_catchup
    )


def create_recurring_run(conn: Connection, schedule: Schedule, enabled: bool) -> str:
    with _call(conn, f"creating recurring run {schedule.name!r}"):
        created = conn.client.create_recurring_run(
            experiment_id=schedule.experiment_id,
            job_name=schedule.name,
            description=schedule.description or None,
            cron_expression=schedule.cron,
            interval_second=schedule.interval_s,
            max_concurrency=schedule.max_concurrency,
            no_catchup=schedule.no_catchup,
            params=schedule.parameters,
            pipeline_id=schedule.pipeline_id,
            version_id=schedule.version_id,
            enabled=enabled,
        )
    return str(created.recurring_run_id)


def set_recurring_run_enabled(conn: Connection, recurring_run_id: str, enabled: bool) -> None:
    with _call(conn, f"{'enabling' if enabled else 'disabling'} recurring run {recurring_run_id}"):
        if enabled:
            conn.client.enable_recurring_run(recurring_run_id)
        else:
            conn.client.disable_recurring_run(recurring_run_id)


def delete_recurring_run(conn: Connection, recurring_run_id: str) -> None:
    with _call(conn, f"deleting recurring run {recurring_run_id}"):
        conn.client.delete_recurring_run(recurring_run_id)


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)
