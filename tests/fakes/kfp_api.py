"""A FAKE of the Kubeflow Pipelines v2beta1 REST API, for testing `rtp`'s kfp.Client calls.

The real KFP API server cannot run on a development machine (it needs the Kubernetes
API, Argo Workflows, MySQL and object storage), so this is a small stand-in, served over
HTTP on 127.0.0.1 from a thread. It is not the real thing and runs no pipelines. What it
does do:

- keeps state: pipelines, pipeline versions, experiments, runs and recurring runs, with
  the API's name-uniqueness rules (409 ALREADY_EXISTS) and 404s for unknown ids;
- validates every request (path, query parameters, multipart fields, JSON body) and every
  response against the upstream swagger in tests/specs/kfp-v2beta1, rejecting
  unknown fields and wrong types with 400;
- parses every uploaded pipeline, and every inline `pipeline_spec`, strictly into kfp's
  `PipelineSpec` (and `PlatformSpec`) protos, and rejects run parameters the pipeline
  does not declare and cron expressions that are not 6 fields;
- checks a bearer token (401) and, in multi-user mode, the namespace (403);
- answers healthz as the API server does: the swagger's `multi_user` and `pipeline_store`
  plus `commit_sha` and `tag_name`, which the server's hand-written healthz handler adds
  (backend/src/apiserver/main.go) and the swagger does not declare; `tag_name` is the
  backend release a test chooses (None leaves it out);
- moves each run PENDING -> RUNNING -> a final state a test chooses, one step per GET.

Requests are recorded in `requests` so tests can assert what was (or was not) sent.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import threading
import uuid
from collections.abc import Callable
from email.parser import BytesParser
from email.policy import HTTP
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml
from google.protobuf import json_format
from kfp.pipeline_spec import pipeline_spec_pb2

from tests.fakes.swagger import SchemaMismatch, Swagger

# google.rpc.Code values, with the HTTP status grpc-gateway maps each to.
_CODES = {400: 3, 401: 16, 403: 7, 404: 5, 409: 6, 500: 13}
_FILTER_OPERATIONS = {1: "EQUALS", 2: "NOT_EQUALS", 9: "IS_SUBSTRING"}
_DESCRIPTORS = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")
_HEALTHZ_EXTRA_FIELDS = ("commit_sha", "tag_name")
"""String fields the API server's healthz handler writes beyond the swagger's response."""


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _timestamp(moment: dt.datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


EPOCH = "1970-01-01T00:00:00Z"


def parse_pipeline_document(spec: dict[str, Any], platform: dict[str, Any] | None = None) -> Any:
    """Strictly parse a pipeline spec (and platform spec) dict; unknown fields are errors."""
    try:
        parsed = json_format.ParseDict(spec, pipeline_spec_pb2.PipelineSpec(), ignore_unknown_fields=False)
        if platform:
            json_format.ParseDict(platform, pipeline_spec_pb2.PlatformSpec(), ignore_unknown_fields=False)
    except json_format.ParseError as exc:
        raise ApiError(400, f"invalid pipeline spec: {exc}") from None
    if not parsed.pipeline_info.name:
        raise ApiError(400, "invalid pipeline spec: pipelineInfo.name is empty")
    return parsed


class FakeKfpApi:
    """See the module docstring: a stateful, schema-checking fake, not the KFP API server."""

    def __init__(
        self,
        specs_dir: Path,
        token: str | None = None,
        namespaces: set[str] | None = None,
        clock: Callable[[], dt.datetime] | None = None,
        tag_name: str | None = "2.17.0",
    ) -> None:
        self.swagger = Swagger(specs_dir / "kfp_api_single_file.swagger.json")
        self.token = token
        """When set, every request must carry `Authorization: Bearer <token>`."""
        self.namespaces = namespaces
        """When set, the fake is multi-user: only these namespaces may be used (else 403)."""
        self.clock = clock or (lambda: dt.datetime.now(dt.UTC))
        self.tag_name = tag_name
        """The backend release healthz reports ('unknown' as a dev build does; None: no field)."""
        self.pipelines: dict[str, dict[str, Any]] = {}
        self.versions: dict[str, dict[str, Any]] = {}
        self.experiments: dict[str, dict[str, Any]] = {}
        self.runs: dict[str, dict[str, Any]] = {}
        self.recurring_runs: dict[str, dict[str, Any]] = {}
        self.requests: list[dict[str, Any]] = []
        self.errors: list[str] = []
        """Responses this fake produced that break the swagger: a bug in the fake."""
        self.run_outcome = "SUCCEEDED"
        """The state the next runs end in after two polls."""
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> str:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                status, payload = fake.handle(self.command, self.path, dict(self.headers.items()), body)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = do_PATCH = _serve

            def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self.url

    @property
    def url(self) -> str:
        assert self._server is not None, "start() the fake first"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # --- request handling ----------------------------------------------------------------

    def handle(self, method: str, raw_path: str, headers: dict[str, str], body: bytes) -> tuple[int, Any]:
        parts = urlsplit(raw_path)
        query = parse_qs(parts.query, keep_blank_values=True)
        record: dict[str, Any] = {"method": method, "path": parts.path, "query": query}
        with self._lock:
            self.requests.append(record)
            try:
                status, payload = 200, self._dispatch(method, parts.path, query, headers, body, record)
            except ApiError as exc:
                status, payload = exc.status, {"code": _CODES[exc.status], "message": str(exc), "details": []}
            except SchemaMismatch as exc:
                status, payload = 400, {"code": 3, "message": f"invalid request: {exc}", "details": []}
            record["status"] = status
            return status, payload

    def _dispatch(
        self,
        method: str,
        path: str,
        query: dict[str, list[str]],
        headers: dict[str, str],
        body: bytes,
        record: dict[str, Any],
    ) -> Any:
        lowered = {k.lower(): v for k, v in headers.items()}
        if self.token is not None and lowered.get("authorization") != f"Bearer {self.token}":
            raise ApiError(401, "Unauthenticated: request has no valid bearer token")
        found = self.swagger.match(method, path)
        if found is None:
            if self.swagger.path_exists(path):
                raise ApiError(400, f"method {method} is not allowed on {path}")
            raise ApiError(404, f"no such API path {path}")
        operation, path_args = found
        self.swagger.check_query(operation, query)
        args = {name: values[0] for name, values in query.items()}
        payload: Any = None
        if operation.parameters("formData"):
            payload = self._form(operation, lowered.get("content-type", ""), body)
        elif body.strip():
            try:
                payload = json.loads(body)
            except json.JSONDecodeError:
                raise ApiError(400, "request body is not JSON") from None
            body_parameters = list(operation.parameters("body").values())
            if not body_parameters:
                if payload not in ({}, None):
                    raise SchemaMismatch(f"{operation.template} takes no body")
            else:
                self.swagger.check(payload, body_parameters[0].get("schema", {}), "body")
        record["body"] = payload
        body_namespace = payload.get("namespace") if isinstance(payload, dict) else None
        self._check_namespace(args.get("namespace") or body_namespace)
        handler = getattr(self, "_op_" + operation.spec["operationId"], None)
        if handler is None:
            raise ApiError(400, f"the fake does not implement {operation.spec['operationId']}")
        response = handler(path_args, args, payload)
        try:
            declared = response
            if operation.spec["operationId"] == "HealthzService_GetHealthz":
                declared = {k: v for k, v in response.items() if k not in _HEALTHZ_EXTRA_FIELDS}
                for name in set(response) - set(declared):
                    if not isinstance(response[name], str):
                        raise SchemaMismatch(f"healthz field {name!r} must be a string")
            self.swagger.check(declared, self.swagger.response_schema(operation), "response")
        except SchemaMismatch as exc:  # a bug in this fake, not in the client
            self.errors.append(f"{operation.spec['operationId']}: {exc}")
            raise ApiError(500, f"fake produced an invalid response: {exc}") from None
        return response

    def _form(self, operation: Any, content_type: str, body: bytes) -> dict[str, Any]:
        if not content_type.startswith("multipart/form-data"):
            raise ApiError(400, f"{operation.template} needs multipart/form-data, got {content_type!r}")
        message = BytesParser(policy=HTTP).parsebytes(
            b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body
        )
        declared = operation.parameters("formData")
        fields: dict[str, Any] = {}
        for part in message.iter_parts():
            name = part.get_param("name", header="content-disposition")
            if name not in declared:
                raise SchemaMismatch(f"form field {name!r} is not accepted by {operation.template}")
            fields[name] = part.get_payload(decode=True)
        for name, parameter in declared.items():
            if parameter.get("required") and name not in fields:
                raise SchemaMismatch(f"form field {name!r} is required")
        return fields

    def _check_namespace(self, namespace: str | None) -> None:
        if self.namespaces is not None and namespace and namespace not in self.namespaces:
            raise ApiError(403, f"PermissionDenied: user cannot access namespace {namespace!r}")

    def _require_namespace(self, namespace: str | None, what: str) -> None:
        if self.namespaces is not None and not namespace:
            raise ApiError(400, f"Invalid input error: in multi-user mode, {what} requires a namespace")

    def _new_id(self) -> str:
        return str(uuid.UUID(int=next(self._ids)))

    def _now(self) -> str:
        return _timestamp(self.clock())

    # --- listing helpers -----------------------------------------------------------------

    @staticmethod
    def _filtered(items: list[dict[str, Any]], filter_json: str | None) -> list[dict[str, Any]]:
        if not filter_json:
            return items
        try:
            predicates = json.loads(filter_json).get("predicates", [])
        except (json.JSONDecodeError, AttributeError):
            raise ApiError(400, f"filter {filter_json!r} is not a JSON Filter") from None
        for predicate in predicates:
            operation = predicate.get("operation")
            operation = _FILTER_OPERATIONS.get(operation, operation)
            key = predicate.get("key")
            value = predicate.get("string_value", predicate.get("stringValue"))
            if operation not in ("EQUALS", "NOT_EQUALS", "IS_SUBSTRING") or value is None:
                raise ApiError(
                    400, f"the fake supports only string EQUALS/NOT_EQUALS/IS_SUBSTRING: {predicate}"
                )
            if operation == "EQUALS":
                items = [i for i in items if i.get(key) == value]
            elif operation == "NOT_EQUALS":
                items = [i for i in items if i.get(key) != value]
            else:
                items = [i for i in items if value in str(i.get(key, ""))]
        return items

    @staticmethod
    def _page(items: list[dict[str, Any]], args: dict[str, str], key: str) -> dict[str, Any]:
        sort_by = args.get("sort_by") or "created_at"
        field, _, direction = sort_by.partition(" ")
        # Creation order breaks ties between equal timestamps.
        ordered = sorted(enumerate(items), key=lambda pair: (str(pair[1].get(field, "")), pair[0]))
        if direction == "desc":
            ordered.reverse()
        rows = [item for _, item in ordered]
        start = int(args.get("page_token") or 0)
        size = int(args.get("page_size") or 20)
        page = rows[start : start + size]
        following = start + size if start + size < len(rows) else None
        return {key: page, "total_size": len(rows), "next_page_token": str(following) if following else ""}

    # --- health ---------------------------------------------------------------------------

    def _op_HealthzService_GetHealthz(self, path: dict, args: dict, body: Any) -> dict:
        answer = {"commit_sha": "0123456789abcdef0123456789abcdef01234567"}
        if self.tag_name is not None:
            answer["tag_name"] = self.tag_name
        return {**answer, "multi_user": self.namespaces is not None, "pipeline_store": "database"}

    # --- experiments ---------------------------------------------------------------------

    def _op_ExperimentService_CreateExperiment(self, path: dict, args: dict, body: Any) -> dict:
        name = (body or {}).get("display_name")
        if not name:
            raise ApiError(400, "Invalid input error: experiment display_name is required")
        namespace = body.get("namespace") or ""
        self._require_namespace(namespace, "creating an experiment")
        if any(e["display_name"] == name and e["namespace"] == namespace for e in self.experiments.values()):
            raise ApiError(409, f"Already exists: experiment {name!r}")
        experiment = {
            "experiment_id": self._new_id(),
            "display_name": name,
            "description": body.get("description") or "",
            "namespace": namespace,
            "created_at": self._now(),
            "storage_state": "AVAILABLE",
            "last_run_created_at": EPOCH,
        }
        self.experiments[experiment["experiment_id"]] = experiment
        return experiment

    def _op_ExperimentService_ListExperiments(self, path: dict, args: dict, body: Any) -> dict:
        self._require_namespace(args.get("namespace"), "listing experiments")
        items = [e for e in self.experiments.values() if e["namespace"] == (args.get("namespace") or "")]
        return self._page(self._filtered(items, args.get("filter")), args, "experiments")

    def _op_ExperimentService_GetExperiment(self, path: dict, args: dict, body: Any) -> dict:
        return self._get(self.experiments, path["experiment_id"], "experiment")

    @staticmethod
    def _get(table: dict[str, dict[str, Any]], key: str, what: str) -> dict[str, Any]:
        if key not in table:
            raise ApiError(404, f"Not found: {what} {key!r}")
        return table[key]

    # --- pipelines -----------------------------------------------------------------------

    def _create_pipeline(self, name: str, display_name: str, description: str, namespace: str) -> dict:
        if not name:
            raise ApiError(400, "Invalid input error: pipeline name is required")
        if any(p["name"] == name and p["namespace"] == namespace for p in self.pipelines.values()):
            raise ApiError(409, f"Already exists: a pipeline named {name!r} in namespace {namespace!r}")
        pipeline = {
            "pipeline_id": self._new_id(),
            "name": name,
            "display_name": display_name or name,
            "description": description,
            "namespace": namespace,
            "created_at": self._now(),
        }
        self.pipelines[pipeline["pipeline_id"]] = pipeline
        return pipeline

    def _create_version(self, pipeline_id: str, name: str, description: str, package: bytes) -> dict:
        self._get(self.pipelines, pipeline_id, "pipeline")
        if any(v["pipeline_id"] == pipeline_id and v["name"] == name for v in self.versions.values()):
            raise ApiError(409, f"Already exists: pipeline version {name!r}")
        try:
            documents = [d for d in yaml.safe_load_all(package) if d]
        except yaml.YAMLError as exc:
            raise ApiError(400, f"invalid pipeline package: {exc}") from None
        if not documents or not isinstance(documents[0], dict):
            raise ApiError(400, "invalid pipeline package: no pipeline spec document")
        platform = documents[1] if len(documents) > 1 else None
        parse_pipeline_document(documents[0], platform)
        version = {
            "pipeline_id": pipeline_id,
            "pipeline_version_id": self._new_id(),
            "name": name,
            "display_name": name,
            "description": description,
            "created_at": self._now(),
            "pipeline_spec": documents[0]
            if platform is None
            else {"pipeline_spec": documents[0], "platform_spec": platform},
        }
        self.versions[version["pipeline_version_id"]] = version
        return version

    def _op_PipelineService_CreatePipeline(self, path: dict, args: dict, body: Any) -> dict:
        body = body or {}
        return self._create_pipeline(
            body.get("name") or body.get("display_name") or "",
            body.get("display_name") or "",
            body.get("description") or "",
            body.get("namespace") or "",
        )

    def _op_UploadPipeline(self, path: dict, args: dict, body: Any) -> dict:
        name = args.get("name") or args.get("display_name") or ""
        pipeline = self._create_pipeline(
            name, args.get("display_name") or "", args.get("description") or "", args.get("namespace") or ""
        )
        try:
            self._create_version(
                pipeline["pipeline_id"], name, args.get("description") or "", body["uploadfile"]
            )
        except ApiError:
            del self.pipelines[pipeline["pipeline_id"]]
            raise
        return pipeline

    def _op_UploadPipelineVersion(self, path: dict, args: dict, body: Any) -> dict:
        if not args.get("pipelineid"):
            raise ApiError(400, "Invalid input error: pipelineid is required")
        name = args.get("name") or args.get("display_name")
        if not name:
            raise ApiError(400, "Invalid input error: pipeline version name is required")
        return self._create_version(
            args["pipelineid"], name, args.get("description") or "", body["uploadfile"]
        )

    def _op_PipelineService_ListPipelines(self, path: dict, args: dict, body: Any) -> dict:
        namespace = args.get("namespace") or ""
        items = [p for p in self.pipelines.values() if p["namespace"] in (namespace, "")]
        return self._page(self._filtered(items, args.get("filter")), args, "pipelines")

    def _op_PipelineService_GetPipeline(self, path: dict, args: dict, body: Any) -> dict:
        return self._get(self.pipelines, path["pipeline_id"], "pipeline")

    def _op_PipelineService_ListPipelineVersions(self, path: dict, args: dict, body: Any) -> dict:
        self._get(self.pipelines, path["pipeline_id"], "pipeline")
        items = [v for v in self.versions.values() if v["pipeline_id"] == path["pipeline_id"]]
        return self._page(self._filtered(items, args.get("filter")), args, "pipeline_versions")

    def _op_PipelineService_GetPipelineVersion(self, path: dict, args: dict, body: Any) -> dict:
        version = self._get(self.versions, path["pipeline_version_id"], "pipeline version")
        if version["pipeline_id"] != path["pipeline_id"]:
            raise ApiError(404, "Not found: the version belongs to another pipeline")
        return version

    # --- runs ----------------------------------------------------------------------------

    def _resolve_spec(self, body: dict[str, Any]) -> dict[str, Any]:
        """The pipeline spec a run or recurring run would execute, checked."""
        reference = body.get("pipeline_version_reference")
        inline = body.get("pipeline_spec")
        if bool(reference) == bool(inline):
            raise ApiError(
                400, "Invalid input error: give exactly one of pipeline_spec and pipeline_version_reference"
            )
        if reference:
            pipeline_id = reference.get("pipeline_id") or ""
            self._get(self.pipelines, pipeline_id, "pipeline")
            version_id = reference.get("pipeline_version_id")
            if version_id:
                version = self._op_PipelineService_GetPipelineVersion(
                    {"pipeline_id": pipeline_id, "pipeline_version_id": version_id}, {}, None
                )
            else:
                candidates = [v for v in self.versions.values() if v["pipeline_id"] == pipeline_id]
                if not candidates:
                    raise ApiError(400, "Invalid input error: the pipeline has no versions")
                version = candidates[-1]
            spec = version["pipeline_spec"]
            return spec.get("pipeline_spec", spec) if "platform_spec" in spec else spec
        if "pipeline_spec" in inline and "pipelineInfo" not in inline:
            parse_pipeline_document(inline["pipeline_spec"], inline.get("platform_spec"))
            return inline["pipeline_spec"]
        parse_pipeline_document(inline)
        return inline

    @staticmethod
    def _check_parameters(spec: dict[str, Any], runtime_config: dict[str, Any] | None) -> None:
        declared = spec.get("root", {}).get("inputDefinitions", {}).get("parameters", {})
        given = (runtime_config or {}).get("parameters") or {}
        unknown = sorted(set(given) - set(declared))
        if unknown:
            raise ApiError(400, f"Invalid input error: unknown pipeline parameters {unknown}")
        missing = [
            n
            for n, d in declared.items()
            if "defaultValue" not in d and not d.get("isOptional") and n not in given
        ]
        if missing:
            raise ApiError(400, f"Invalid input error: missing pipeline parameters {missing}")

    def _experiment_for(self, body: dict[str, Any]) -> str:
        experiment_id = body.get("experiment_id")
        if experiment_id:
            self._get(self.experiments, experiment_id, "experiment")
            return experiment_id
        default = [e for e in self.experiments.values() if e["display_name"] == "Default"]
        if default:
            return default[0]["experiment_id"]
        return self._op_ExperimentService_CreateExperiment({}, {}, {"display_name": "Default"})[
            "experiment_id"
        ]

    def _op_RunService_CreateRun(self, path: dict, args: dict, body: Any) -> dict:
        body = body or {}
        if not body.get("display_name"):
            raise ApiError(400, "Invalid input error: run display_name is required")
        spec = self._resolve_spec(body)
        self._check_parameters(spec, body.get("runtime_config"))
        experiment_id = self._experiment_for(body)
        self._check_namespace(self.experiments[experiment_id]["namespace"])
        now = self._now()
        run = {
            "run_id": self._new_id(),
            "experiment_id": experiment_id,
            "display_name": body["display_name"],
            "description": body.get("description") or "",
            "runtime_config": body.get("runtime_config") or {},
            "service_account": body.get("service_account") or "",
            "storage_state": "AVAILABLE",
            "created_at": now,
            "scheduled_at": now,
            "finished_at": EPOCH,
            "state": "PENDING",
            "state_history": [{"update_time": now, "state": "PENDING"}],
        }
        for key in ("pipeline_version_reference", "pipeline_spec"):
            if body.get(key):
                run[key] = body[key]
        run["_outcome"] = self.run_outcome
        self.runs[run["run_id"]] = run
        self.experiments[experiment_id]["last_run_created_at"] = now
        return self._public(run)

    @staticmethod
    def _public(record: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in record.items() if not k.startswith("_")}

    def _advance(self, run: dict[str, Any]) -> None:
        following = {"PENDING": "RUNNING", "RUNNING": run["_outcome"]}.get(run["state"])
        if following is None:
            return
        now = self._now()
        run["state"] = following
        run["state_history"].append({"update_time": now, "state": following})
        if following == run["_outcome"]:
            run["finished_at"] = now
            if following == "FAILED":
                run["error"] = {"code": 2, "message": "the fake marked this run failed", "details": []}

    def _op_RunService_GetRun(self, path: dict, args: dict, body: Any) -> dict:
        run = self._get(self.runs, path["run_id"], "run")
        self._advance(run)
        return self._public(run)

    def _op_RunService_ListRuns(self, path: dict, args: dict, body: Any) -> dict:
        items = list(self.runs.values())
        if args.get("experiment_id"):
            items = [r for r in items if r["experiment_id"] == args["experiment_id"]]
        else:
            self._require_namespace(args.get("namespace"), "listing runs without an experiment")
            namespace = args.get("namespace") or ""
            items = [r for r in items if self.experiments[r["experiment_id"]]["namespace"] == namespace]
        page = self._page(self._filtered(items, args.get("filter")), args, "runs")
        page["runs"] = [self._public(r) for r in page["runs"]]
        return page

    # --- recurring runs --------------------------------------------------------------------

    @staticmethod
    def _check_trigger(trigger: dict[str, Any] | None) -> None:
        trigger = trigger or {}
        if bool(trigger.get("cron_schedule")) == bool(trigger.get("periodic_schedule")):
            raise ApiError(
                400,
                "Invalid input error: the trigger needs exactly one of cron_schedule and periodic_schedule",
            )
        if trigger.get("cron_schedule"):
            cron = trigger["cron_schedule"].get("cron") or ""
            # The scheduler parses with seconds first (robfig/cron); 5 fields are an error there.
            if cron.lower() not in _DESCRIPTORS and len(cron.split()) != 6:
                raise ApiError(400, f"Invalid input error: cron {cron!r} must have 6 fields (seconds first)")
        else:
            interval = int(trigger["periodic_schedule"].get("interval_second") or 0)
            if interval < 1:
                raise ApiError(400, "Invalid input error: interval_second must be positive")

    @staticmethod
    def _stored_trigger(trigger: dict[str, Any]) -> dict[str, Any]:
        """The trigger as the server echoes it: protobuf JSON writes int64 as a string."""
        stored = json.loads(json.dumps(trigger))
        periodic = stored.get("periodic_schedule")
        if periodic and periodic.get("interval_second") is not None:
            periodic["interval_second"] = str(int(periodic["interval_second"]))
        return stored

    def _op_RecurringRunService_CreateRecurringRun(self, path: dict, args: dict, body: Any) -> dict:
        body = body or {}
        if not body.get("display_name"):
            raise ApiError(400, "Invalid input error: recurring run display_name is required")
        concurrency = int(body.get("max_concurrency") or 0)
        if not 1 <= concurrency <= 10:
            raise ApiError(400, f"Invalid input error: max_concurrency {concurrency} is outside [1, 10]")
        self._check_trigger(body.get("trigger"))
        spec = self._resolve_spec(body)
        self._check_parameters(spec, body.get("runtime_config"))
        experiment_id = self._experiment_for(body)
        namespace = self.experiments[experiment_id]["namespace"]
        self._check_namespace(namespace)
        enabled = body.get("mode", "ENABLE") != "DISABLE"
        now = self._now()
        recurring = {
            "recurring_run_id": self._new_id(),
            "display_name": body["display_name"],
            "description": body.get("description") or "",
            "runtime_config": body.get("runtime_config") or {},
            "service_account": body.get("service_account") or "",
            "max_concurrency": str(concurrency),
            "trigger": self._stored_trigger(body["trigger"]),
            "mode": "ENABLE" if enabled else "DISABLE",
            "status": "ENABLED" if enabled else "DISABLED",
            "no_catchup": bool(body.get("no_catchup")),
            "experiment_id": experiment_id,
            "namespace": namespace,
            "created_at": now,
            "updated_at": now,
        }
        for key in ("pipeline_version_reference", "pipeline_spec"):
            if body.get(key):
                recurring[key] = body[key]
        self.recurring_runs[recurring["recurring_run_id"]] = recurring
        return recurring

    def _op_RecurringRunService_GetRecurringRun(self, path: dict, args: dict, body: Any) -> dict:
        return self._get(self.recurring_runs, path["recurring_run_id"], "recurring run")

    def _op_RecurringRunService_ListRecurringRuns(self, path: dict, args: dict, body: Any) -> dict:
        items = list(self.recurring_runs.values())
        if args.get("experiment_id"):
            items = [r for r in items if r["experiment_id"] == args["experiment_id"]]
        if args.get("namespace") is not None and not args.get("experiment_id"):
            items = [r for r in items if r["namespace"] == args["namespace"]]
        return self._page(self._filtered(items, args.get("filter")), args, "recurringRuns")

    def _set_enabled(self, recurring_run_id: str, enabled: bool) -> dict:
        recurring = self._get(self.recurring_runs, recurring_run_id, "recurring run")
        recurring["mode"] = "ENABLE" if enabled else "DISABLE"
        recurring["status"] = "ENABLED" if enabled else "DISABLED"
        recurring["updated_at"] = self._now()
        return {}

    def _op_RecurringRunService_EnableRecurringRun(self, path: dict, args: dict, body: Any) -> dict:
        return self._set_enabled(path["recurring_run_id"], True)

    def _op_RecurringRunService_DisableRecurringRun(self, path: dict, args: dict, body: Any) -> dict:
        return self._set_enabled(path["recurring_run_id"], False)

    def _op_RecurringRunService_DeleteRecurringRun(self, path: dict, args: dict, body: Any) -> dict:
        self._get(self.recurring_runs, path["recurring_run_id"], "recurring run")
        del self.recurring_runs[path["recurring_run_id"]]
        return {}

    # --- test helpers ----------------------------------------------------------------------

    def sent(self, method: str, path_prefix: str = "/apis/v2beta1/") -> list[dict[str, Any]]:
        """Requests received with this method under this path prefix."""
        return [r for r in self.requests if r["method"] == method and r["path"].startswith(path_prefix)]
