"""Run one training job on Kubernetes: create it, watch it, show rank 0's log, clean up.

`run_job` creates a PyTorchJob or TrainJob manifest (from `jobs`) with the `kubernetes`
client, polls the job's conditions every `poll_interval_s`, copies new lines of the rank-0
pod's log into this process's output, watches the job's pods and their events for a pod
that will never get anywhere (`pod_health`: unschedulable, a volume that does not mount,
a bad image, a crash loop, an init container waiting too long), and returns once the
engine reports success. It raises `JobFailed` when the engine reports failure, `PodStuck`
with the reason when a pod is stuck, and `JobTimedOut` after `timeout_s`; on either, and
on SIGTERM (a terminated KFP run deletes the component's pod), it deletes the job so no
GPU pods outlive the run. Transient API errors while reading the status are retried with
backoff and never delete the job. `delete_run_jobs` is the pipeline's exit-handler
cleanup: it deletes the jobs rtp created for a run (managed-by=rtp and the run-id label),
never by label alone. A KFP Terminate runs no exit handler (kubeflow/pipelines#6101), so
`step_pod_owner` gives each job an ownerReference to the train step's own pod, and
Kubernetes' garbage collector deletes the job when that pod is deleted. Status parsing and
label selectors are pure functions; all API calls go through an `ApiClient` the caller
passes (tests pass one pointed at a fake API server) or the pod's in-cluster configuration.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from components.train.job_scale import job_scale
from components.train.jobs import (
    GPU_RESOURCE,
    ISTIO_INJECT_ANNOTATION,
    JOB_KINDS,
    MANAGED_BY_LABEL,
    MANAGED_BY_RTP,
    RUN_ID_LABEL,
    JobKind,
    job_kind_of,
    run_id_label_value,
)
from components.train.pod_health import DEFAULT_PENDING_TIMEOUT_S, stuck_reason, unhealthy_node
from trainer.launch import TrainingFailed

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
POD_NAME_ENV, POD_NAMESPACE_ENV, POD_UID_ENV = "POD_NAME", "POD_NAMESPACE", "POD_UID"
"""The train step's own pod, from the downward API (the compiled pipeline sets them:
pipelines.pipeline); KFP's own KFP_POD_NAME/KFP_POD_UID and HOSTNAME are the fallbacks."""


class JobFailed(TrainingFailed):
    """The training engine reported the job failed, or the job could not be created."""


class JobTimedOut(JobFailed):
    """The job did not finish within the step's timeout; it has been deleted."""


class PodStuck(JobFailed):
    """A pod of the job cannot start or run (see `pod_health`); the job has been deleted."""


@dataclass(frozen=True)
class JobRef:
    kind: str
    group: str
    version: str
    plural: str
    namespace: str
    name: str

    @classmethod
    def of(cls, manifest: dict[str, Any]) -> JobRef:
        job_kind = job_kind_of(manifest["kind"])
        if job_kind is None:
            supported = ", ".join(k.kind for k in JOB_KINDS.values())
            raise JobFailed(f"cannot run a {manifest['kind']}: only {supported} are supported")
        group, version = job_kind.group_version
        meta = manifest["metadata"]
        return cls(job_kind.kind, group, version, job_kind.plural, meta["namespace"], meta["name"])

    @property
    def job_kind(self) -> JobKind:
        job_kind = job_kind_of(self.kind)
        assert job_kind is not None  # checked in `of`
        return job_kind


def job_outcome(kind: str, status: dict[str, Any] | None) -> tuple[str | None, str]:
    """('succeeded' | 'failed' | None, message) from a job's status conditions."""
    for condition in (status or {}).get("conditions") or []:
        if condition.get("status") != "True":
            continue
        if condition.get("type") == _success_condition(kind):
            return "succeeded", condition.get("message", "")
        if condition.get("type") == "Failed":
            return "failed", condition.get("message") or condition.get("reason", "")
    return None, ""


def _success_condition(kind: str) -> str:
    job_kind = job_kind_of(kind)
    if job_kind is None:
        raise JobFailed(f"no job type has kind {kind!r}")
    return job_kind.success_condition


def rank0_pod_selector(ref: JobRef) -> tuple[str, str]:
    """(label selector, container) of the pod that runs node 0, whose ranks include rank 0."""
    return ref.job_kind.rank0_pod_selector(ref.name), ref.job_kind.container


def in_cluster_api_client() -> Any:
    """An ApiClient for the pod's service account (the KFP step runs inside the cluster)."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException as exc:
        raise JobFailed(
            f"not running inside a Kubernetes pod ({exc}); the pytorchjob and trainjob launchers "
            "only work in a pipeline run on a cluster, use launcher=inpod elsewhere"
        ) from exc
    return client.ApiClient()


def pod_namespace(default: str = "") -> str:
    """The namespace to create jobs in: the given one, else this pod's own namespace."""
    if default:
        return default
    if SERVICE_ACCOUNT_NAMESPACE_FILE.is_file():
        return SERVICE_ACCOUNT_NAMESPACE_FILE.read_text().strip()
    raise JobFailed("no job namespace given and this is not a pod: set job_namespace")


def _api_error(exc: Exception) -> str:
    body = getattr(exc, "body", "") or ""
    try:
        import json

        return json.loads(body).get("message", body)
    except (ValueError, AttributeError):
        return str(body) or str(exc)


def job_pods_selector(ref: JobRef) -> str:
    """The label selector of every pod of the job (all replicas, all nodes)."""
    return ref.job_kind.pods_selector(ref.name)


def _allowed_crash_restarts(manifest: dict[str, Any]) -> int:
    """Container restarts the engine may still retry: the PyTorchJob's backoffLimit; a
    TrainJob (whose runtime owns its failure policy) gets job_scale's backoff_limit for its
    GPU count, the value a PyTorchJob of that shape gets."""
    run_policy = manifest.get("spec", {}).get("runPolicy", {})
    if "backoffLimit" in run_policy:
        return int(run_policy["backoffLimit"])
    limits = manifest.get("spec", {}).get("trainer", {}).get("resourcesPerNode", {}).get("limits", {})
    return job_scale(int(limits.get(GPU_RESOURCE, 0))).backoff_limit


def is_suspended(job: dict[str, Any]) -> bool:
    """Whether the job is held back on purpose (Kueue suspends a job until its quota admits
    it: a PyTorchJob's `runPolicy.suspend`, a TrainJob's `suspend`), so it has no pods yet."""
    spec = job.get("spec") or {}
    if spec.get("suspend") or (spec.get("runPolicy") or {}).get("suspend"):
        return True
    conditions = (job.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Suspended" and c.get("status") == "True" for c in conditions)


def job_nodes(manifest: dict[str, Any]) -> int:
    """How many nodes (pods) the job runs on."""
    spec = manifest.get("spec", {})
    if "pytorchReplicaSpecs" in spec:
        return sum(int(r.get("replicas", 1)) for r in spec["pytorchReplicaSpecs"].values())
    return int(spec.get("trainer", {}).get("numNodes", 1))


def step_pod_owner(
    api_client: Any, job_namespace: str, environ: Mapping[str, str] | None = None
) -> dict[str, str] | None:
    """An ownerReference to this step's own pod for a job in `job_namespace`, or None.

    None outside a pod, when the pod cannot be read, and when the job goes to another
    namespace: Kubernetes looks an owner up in its dependent's namespace only, so the
    garbage collector would delete such a job at once (the exit handler still deletes it).
    """
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    env = os.environ if environ is None else environ
    name = env.get(POD_NAME_ENV) or env.get("KFP_POD_NAME") or env.get("HOSTNAME", "")
    namespace = env.get(POD_NAMESPACE_ENV, "")
    if not namespace and SERVICE_ACCOUNT_NAMESPACE_FILE.is_file():
        namespace = SERVICE_ACCOUNT_NAMESPACE_FILE.read_text().strip()
    if not name or not namespace:
        return None  # not a pod: nothing can own the job
    if namespace != job_namespace:
        log.warning(
            "the job goes to namespace %s, this pod runs in %s: no ownerReference (it must be in the "
            "job's namespace), so a terminated run leaves the job to the exit handler and its deadline",
            job_namespace,
            namespace,
        )
        return None
    uid = env.get(POD_UID_ENV) or env.get("KFP_POD_UID", "")
    if not uid:
        try:
            uid = client.CoreV1Api(api_client).read_namespaced_pod(name, namespace).metadata.uid
        except ApiException as exc:
            log.warning(
                "cannot read this pod %s/%s (%s): the job gets no ownerReference; the Role needs `get` on pods",
                namespace,
                name,
                _api_error(exc),
            )
            return None
    return {"apiVersion": "v1", "kind": "Pod", "name": name, "uid": uid}


class _PodWatcher:
    """Lists the job's pods (and the events about a pod that is not running) every poll and
    raises PodStuck with the reason when one will never get the job anywhere."""

    def __init__(
        self, core: Any, ref: JobRef, pending_timeout_s: float, crash_restarts: int,
        replacer: _NodeReplacer | None = None,
    ) -> None:  # fmt: skip
        self.core, self.ref = core, ref
        self.selector = job_pods_selector(ref)
        self.pending_timeout_s, self.crash_restarts = pending_timeout_s, crash_restarts
        self.replacer = replacer
        self.events_readable = True
        self.warned_sidecar = False
        self.podless_since: float | None = None
        """When the watch first saw the job, not suspended, without a single pod."""

    def _events(self, pod_name: str) -> list[dict[str, Any]]:
        from kubernetes.client.exceptions import ApiException

        if not self.events_readable:
            return []
        try:
            events = self.core.list_namespaced_event(
                self.ref.namespace, field_selector=f"involvedObject.kind=Pod,involvedObject.name={pod_name}"
            ).items
        except ApiException as exc:
            if exc.status == 403:  # an older Role without `events`: diagnose from pod status alone
                log.warning("cannot list events (%s): add `events` to the Role (deploy/eks)", _api_error(exc))
                self.events_readable = False
            return []
        return [self.core.api_client.sanitize_for_serialization(event) for event in events]

    def check(self, job: dict[str, Any]) -> None:
        from datetime import UTC, datetime

        from kubernetes.client.exceptions import ApiException

        try:
            pods = self.core.list_namespaced_pod(self.ref.namespace, label_selector=self.selector).items
        except Exception as exc:
            if not isinstance(exc, ApiException) and not is_transient(exc):
                raise
            log.debug("could not list the job's pods: %s", _api_error(exc))
            return
        if not pods:
            self._check_podless(job)
            return
        self.podless_since = None
        now = datetime.now(UTC)
        for item in pods:
            pod = self.core.api_client.sanitize_for_serialization(item)
            self._warn_about_sidecars(pod)
            verdict = unhealthy_node(pod)
            if verdict is not None:
                if self.replacer is None:
                    raise PodStuck(unhealthy_message(self.ref, pod, *verdict, "node_replacements is 0"))
                self.replacer.replace(pod, *verdict)  # PodStuck when it cannot
                continue
            status = pod.get("status") or {}
            settled = status.get("phase") in ("Running", "Succeeded") and all(
                "waiting" not in (c.get("state") or {}) for c in status.get("containerStatuses") or []
            )
            events = [] if settled else self._events(pod["metadata"]["name"])
            reason = stuck_reason(
                pod,
                events,
                now=now,
                pending_timeout_s=self.pending_timeout_s,
                crash_restarts=self.crash_restarts,
            )
            if reason:
                raise PodStuck(
                    f"{self.ref.kind} {self.ref.namespace}/{self.ref.name}: {reason}; the job was deleted"
                )

    def _check_podless(self, job: dict[str, Any]) -> None:
        """PodStuck when the job has had no pod for `pending_timeout_s` (at once when the API
        server refused its pods for the namespace's Pod Security level, which waiting cannot
        change), quoting the engine's FailedCreate events. A suspended job (queued by Kueue)
        has no pods by design and is left to job_timeout_s."""
        if is_suspended(job):
            self.podless_since = None
            return
        now = time.monotonic()
        self.podless_since = now if self.podless_since is None else self.podless_since
        waited_s = now - self.podless_since
        refusals = self._creation_refusals()
        pod_security = any("violates PodSecurity" in message for message in refusals)
        if waited_s < self.pending_timeout_s and not pod_security:
            return
        ref = self.ref
        said = "; ".join(refusals[:2]) if refusals else "no FailedCreate event was found"
        hint = (
            "the namespace's Pod Security level refuses the job's pods (Kubeflow 1.11 enforces "
            "`baseline` on profile namespaces, which refuses the IPC_LOCK capability of EFA pods): "
            "run the job in a namespace that admits them (job_namespace; docs/eks.md, "
            '"Jobs in another namespace")'
            if pod_security
            else f"check the {ref.job_kind.engine}'s controller log and the namespace's quotas and "
            "admission policies"
        )
        raise PodStuck(
            f"{ref.kind} {ref.namespace}/{ref.name} has no pod after {waited_s:.0f} s "
            f"(job_pending_timeout_s {self.pending_timeout_s:.0f}): {said}; {hint}; the job was deleted"
        )

    def _creation_refusals(self) -> list[str]:
        """The messages of the Warning events that say the job's pods could not be created:
        `FailedCreatePod` on a PyTorchJob (Training Operator), `FailedCreate` on the batch
        Jobs a TrainJob's JobSet creates (named after the job)."""
        from kubernetes.client.exceptions import ApiException

        if not self.events_readable:
            return []
        try:
            events = self.core.list_namespaced_event(self.ref.namespace, field_selector="type=Warning").items
        except Exception as exc:
            if isinstance(exc, ApiException) and exc.status == 403:
                log.warning("cannot list events (%s): add `events` to the Role (deploy/eks)", _api_error(exc))
                self.events_readable = False
            elif not isinstance(exc, ApiException) and not is_transient(exc):
                raise
            return []
        name = self.ref.name
        refusals = []
        for event in events:
            involved = event.involved_object
            ours = involved.name == name or (
                involved.kind in ("Job", "JobSet") and involved.name.startswith(f"{name}-")
            )
            if ours and event.reason in ("FailedCreate", "FailedCreatePod"):
                refusals.append(f"{involved.kind} {involved.name}: {event.reason}: {event.message}")
        return refusals

    def _warn_about_sidecars(self, pod: dict[str, Any]) -> None:
        names = [c.get("name") for c in pod.get("spec", {}).get("containers") or []]
        if "istio-proxy" in names and not self.warned_sidecar:
            self.warned_sidecar = True
            log.warning(
                "pod %s has an istio-proxy sidecar despite %s=false: the master pod may never "
                "reach Succeeded; see docs/eks.md (Istio)",
                pod["metadata"]["name"],
                ISTIO_INJECT_ANNOTATION,
            )


def unhealthy_message(ref: JobRef, pod: dict[str, Any], node: str, reasons: str, why_not: str) -> str:
    return (
        f"{ref.kind} {ref.namespace}/{ref.name}: node {node or '?'} of pod {pod['metadata']['name']} failed "
        f"the node check ({reasons}) and the pod was not moved ({why_not}); the job was deleted. "
        f"Cordon the node (kubectl cordon {node or 'NODE'}) or fix it, then rerun: the run resumes"
    )


class _NodeReplacer:
    """Moves a pod whose node failed the node check onto another node: patches the job so
    that pods created from now on avoid every node found unhealthy (the operator builds a
    replaced pod from the job's current template), then deletes the pod. At most
    `max_replacements` nodes; past that, or where the job kind cannot be patched
    (`JobKind.avoiding` is None) or the Role does not allow it, PodStuck."""

    def __init__(
        self, custom: Any, core: Any, ref: JobRef, manifest: dict[str, Any], max_replacements: int
    ) -> None:
        self.custom, self.core, self.ref, self.manifest = custom, core, ref, manifest
        self.max_replacements = max_replacements
        self.avoided: list[str] = []
        self.moved: set[str] = set()  # pod uids already deleted

    def replace(self, pod: dict[str, Any], node: str, reasons: str) -> None:
        from kubernetes.client.exceptions import ApiException

        meta = pod["metadata"]
        if meta.get("uid", meta["name"]) in self.moved:
            return  # deleted, not yet gone
        ref, avoiding = self.ref, self.ref.job_kind.avoiding
        if avoiding is None:
            raise PodStuck(
                unhealthy_message(
                    ref, pod, node, reasons, f"a {ref.kind}'s pod template cannot change while it runs"
                )
            )
        if not node:
            raise PodStuck(unhealthy_message(ref, pod, node, reasons, "the pod names no node"))
        if node in self.avoided:
            why = "its replacement came back to it: the job's node affinity did not keep it off"
            raise PodStuck(unhealthy_message(ref, pod, node, reasons, why))
        if len(self.avoided) >= self.max_replacements:
            raise PodStuck(
                unhealthy_message(
                    ref,
                    pod,
                    node,
                    reasons,
                    f"{len(self.avoided)} nodes were already replaced: {', '.join(self.avoided)}",
                )
            )
        avoided = sorted({*self.avoided, node})
        try:
            self.custom.patch_namespaced_custom_object(
                ref.group,
                ref.version,
                ref.namespace,
                ref.plural,
                ref.name,
                avoiding(self.manifest, avoided),
                field_validation=STRICT_FIELDS,
            )
            self.core.delete_namespaced_pod(meta["name"], ref.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return  # the pod (or the job) is already gone: the next poll sees what replaced it
            role = f"; the Role needs `patch` on {ref.plural} and `delete` on pods (deploy/eks)"
            why = f"{_api_error(exc)}{role if exc.status == 403 else ''}"
            raise PodStuck(unhealthy_message(ref, pod, node, reasons, why)) from exc
        self.avoided = avoided
        self.moved.add(meta.get("uid", meta["name"]))
        log.warning(
            "node %s failed the node check (%s): pod %s was deleted and its replacement avoids %s "
            "(%d of %d node replacements)",
            node, reasons, meta["name"], ", ".join(avoided), len(avoided), self.max_replacements,
        )  # fmt: skip


class _LogFollower:
    """Prints the lines of the rank-0 pod's log that it has not printed yet."""

    def __init__(self, core: Any, ref: JobRef, write: Callable[[str], None]) -> None:
        self.core, self.ref, self.write = core, ref, write
        self.selector, self.container = rank0_pod_selector(ref)
        self.pod = ""
        self.printed = 0

    def poll(self) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            pods = self.core.list_namespaced_pod(self.ref.namespace, label_selector=self.selector).items
            if not pods:
                return
            pod = pods[0].metadata.name
            if pod != self.pod:  # first pod, or a replacement after a restart
                self.pod, self.printed = pod, 0
                self.write(f"--- log of {pod} (rank 0) ---")
            text = self.core.read_namespaced_pod_log(pod, self.ref.namespace, container=self.container)
        except Exception as exc:
            # 400 while the container is still being created, or an API hiccup: logs are best effort.
            if not isinstance(exc, ApiException) and not is_transient(exc):
                raise
            log.debug("rank-0 log not available yet: %s", _api_error(exc))
            return
        lines = text.splitlines()
        for line in lines[self.printed :]:
            self.write(line)
        self.printed = max(self.printed, len(lines))


class _SigtermFlag:
    """Set by SIGTERM while a job is watched; the loop looks at it between API calls. A handler
    that raised instead would unwind whatever the main thread was in (a lock half taken, an
    HTTP answer half read) and could leave, e.g., the logging module's lock held for good."""

    def __init__(self) -> None:
        self.arrived = False

    def wait(self, seconds: float) -> bool:
        """Sleep up to `seconds`, less once SIGTERM arrives; True when it has."""
        deadline = time.monotonic() + seconds
        while not self.arrived and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, 0.1))
        return self.arrived


@contextlib.contextmanager
def _sigterm_flag() -> Iterator[_SigtermFlag]:
    flag = _SigtermFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def on_term(signum: int, frame: Any) -> None:
        flag.arrived = True  # no lock, no raise: safe wherever the main thread is

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGTERM, previous)


def delete_job(api_client: Any, ref: JobRef) -> bool:
    """Delete the job and its pods; False when it was already gone."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    custom = client.CustomObjectsApi(api_client)
    try:
        custom.delete_namespaced_custom_object(
            ref.group, ref.version, ref.namespace, ref.plural, ref.name,
            body=client.V1DeleteOptions(propagation_policy="Background"),
        )  # fmt: skip
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise JobFailed(f"could not delete {ref.kind} {ref.namespace}/{ref.name}: {_api_error(exc)}") from exc
    log.info("deleted %s %s/%s", ref.kind, ref.namespace, ref.name)
    return True


STRICT_FIELDS = "Strict"
"""fieldValidation for every job rtp creates or patches: without it an API server (default
Warn since Kubernetes 1.23) drops the fields an older engine's CRD lacks and keeps the rest,
so the pods would silently run without their volumes, node selector or tolerations."""


def older_engine_message(ref: JobRef, server_message: str) -> str:
    """One line for a job the API server refused because its CRD lacks fields rtp sets."""
    fields = re.findall(r'unknown field "([^"]+)"', server_message) or [server_message]
    return (
        f"the cluster's {ref.job_kind.engine} is older than rtp's {ref.kind} needs: its CRD has no "
        f"{', '.join(fields)}; install {ref.job_kind.engine} {ref.job_kind.oldest_engine} or later in place "
        "of the one the cluster runs, or pick another launcher (docs/eks.md, step 4)"
    )


def _create(custom: Any, ref: JobRef, manifest: dict[str, Any], api_client: Any) -> None:
    from kubernetes.client.exceptions import ApiException

    args = (ref.group, ref.version, ref.namespace, ref.plural)
    try:
        custom.create_namespaced_custom_object(*args, manifest, field_validation=STRICT_FIELDS)
        return
    except ApiException as exc:
        if exc.status == 404:
            raise JobFailed(
                f"the cluster has no {ref.kind} resource ({ref.group}/{ref.version}): install the "
                f"{ref.job_kind.engine} "
                "or pick another launcher (docs/eks.md)"
            ) from exc
        if exc.status == 400 and "unknown field" in _api_error(exc):
            raise JobFailed(older_engine_message(ref, _api_error(exc))) from exc
        if exc.status != 409:
            raise JobFailed(f"the API server rejected {ref.kind} {ref.name}: {_api_error(exc)}") from exc
    # 409: an earlier attempt of this task created it. Keep watching a live job; replace
    # a finished one so a retried task trains (and resumes from its checkpoints) again.
    existing = custom.get_namespaced_custom_object(*args, ref.name)
    outcome, _ = job_outcome(ref.kind, existing.get("status"))
    if outcome is None:
        log.info("%s %s already exists and is running: watching it", ref.kind, ref.name)
        return
    delete_job(api_client, ref)
    for _ in range(60):
        try:
            custom.create_namespaced_custom_object(*args, manifest, field_validation=STRICT_FIELDS)
            return
        except ApiException as exc:
            if exc.status != 409:
                raise JobFailed(f"could not recreate {ref.kind} {ref.name}: {_api_error(exc)}") from exc
            time.sleep(1)
    raise JobFailed(f"{ref.kind} {ref.name} from an earlier attempt was not deleted within 60 s")


TRANSIENT_STATUSES = frozenset({0, 408, 429, 500, 502, 503, 504})
"""API answers worth asking again (0: no HTTP answer at all)."""
STATUS_READ_GRACE_S = 600.0
"""How long reading a job's status may keep failing transiently before the step gives up
(without deleting the job: a multi-day run must not die of an API server restart)."""


def is_transient(exc: BaseException) -> bool:
    """An API server hiccup (overload, restart, network), not an answer about the job."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    if isinstance(exc, ApiException):
        return (exc.status or 0) in TRANSIENT_STATUSES
    return isinstance(exc, HTTPError | ConnectionError | TimeoutError)


class StatusUnknown(JobFailed):
    """The job's status could not be read for longer than the grace period; the job was left
    running (the pipeline's exit handler deletes it if the run fails)."""


def run_job(
    manifest: dict[str, Any],
    *,
    api_client: Any,
    timeout_s: float,
    poll_interval_s: float = 10.0,
    write: Callable[[str], None] | None = None,
    status_read_grace_s: float = STATUS_READ_GRACE_S,
    pending_timeout_s: float = DEFAULT_PENDING_TIMEOUT_S,
    crash_restarts: int | None = None,
    node_replacements: int | None = None,
) -> dict[str, Any]:
    """Create the job, wait for it and return its final object. The job is deleted only
    when it is known to have failed, to be stuck (a pod unschedulable or waiting for
    `pending_timeout_s`, a volume that does not mount, a bad image, a crash loop past
    `crash_restarts`, by default the job's own allowance), timed out, or the step was terminated;
    transient errors reading its status are retried with backoff for up to `status_read_grace_s`.
    A pod whose node fails the node check is moved to another node, for up to
    `node_replacements` nodes (by default the job's node count; 0: the job fails instead)."""
    from kubernetes import client

    write = write or (lambda line: print(line, file=sys.stdout, flush=True))
    ref = JobRef.of(manifest)
    custom = client.CustomObjectsApi(api_client)
    core = client.CoreV1Api(api_client)
    allowed = crash_restarts if crash_restarts is not None else _allowed_crash_restarts(manifest)
    replacements = node_replacements if node_replacements is not None else job_nodes(manifest)
    replacer = _NodeReplacer(custom, core, ref, manifest, replacements) if replacements > 0 else None
    watch = _JobWatch(
        custom, ref, _LogFollower(core, ref, write),
        _PodWatcher(core, ref, pending_timeout_s, allowed, replacer),
        timeout_s, poll_interval_s, status_read_grace_s,
    )  # fmt: skip
    _create(custom, ref, manifest, api_client)
    write(f"created {ref.kind} {ref.namespace}/{ref.name}; waiting up to {timeout_s:.0f} s")
    try:
        with _sigterm_flag() as terminated:
            while True:
                job, wait_s = watch.tick()
                if job is not None:
                    write(f"{ref.kind} {ref.name} succeeded")
                    return job
                if terminated.wait(wait_s):
                    write(f"SIGTERM: deleting {ref.kind} {ref.name}")
                    raise JobFailed(f"terminated while {ref.kind} {ref.name} ran; the job was deleted")
    except _KEEP_THE_JOB:
        raise
    except JobFailed:  # the one clean-up rule: failed, stuck, late, unreadable or cancelled
        with contextlib.suppress(JobFailed):
            delete_job(api_client, ref)
        raise


class JobGone(JobFailed):
    """The job was deleted while it ran (by someone else): nothing is left to clean up."""


_KEEP_THE_JOB = (JobGone, StatusUnknown)
"""How a watch may end, besides success, without deleting the job."""


class _JobWatch:
    """The state of one job's watch: `tick()` reads it once and says what happens next."""

    def __init__(
        self, custom: Any, ref: JobRef, follower: _LogFollower, pods: _PodWatcher,
        timeout_s: float, poll_interval_s: float, status_read_grace_s: float,
    ) -> None:  # fmt: skip
        self.custom, self.ref, self.follower, self.pods = custom, ref, follower, pods
        self.timeout_s, self.poll_interval_s, self.grace_s = timeout_s, poll_interval_s, status_read_grace_s
        self.deadline = time.monotonic() + timeout_s
        self.failing_since: float | None = None
        self.failed_reads = 0

    def tick(self) -> tuple[dict[str, Any] | None, float]:
        """(the job once it succeeded, else None and the seconds to wait before the next
        tick); raises JobFailed (or a subclass) when the watch must end."""
        ref = self.ref
        job = self._read()
        if job is None:  # a transient read error: back off
            return None, min(30.0, self.poll_interval_s * 2 ** min(self.failed_reads - 1, 5))
        self.follower.poll()
        outcome, message = job_outcome(ref.kind, job.get("status"))
        if outcome == "succeeded":
            return job, 0.0
        if outcome == "failed":
            raise JobFailed(f"{ref.kind} {ref.namespace}/{ref.name} failed: {message}")
        self.pods.check(job)  # PodStuck
        if time.monotonic() >= self.deadline:
            raise JobTimedOut(
                f"{ref.kind} {ref.namespace}/{ref.name} did not finish within {self.timeout_s:.0f} s "
                "(job_timeout_s); it was deleted. Raise job_timeout_s or look at its pods' logs"
            )
        return None, self.poll_interval_s

    def _read(self) -> dict[str, Any] | None:
        """The job, or None after a transient error within the grace period."""
        from kubernetes.client.exceptions import ApiException

        ref = self.ref
        try:
            job: dict[str, Any] = self.custom.get_namespaced_custom_object(
                ref.group, ref.version, ref.namespace, ref.plural, ref.name
            )
        except Exception as exc:
            if isinstance(exc, ApiException) and exc.status == 404:
                raise JobGone(f"{ref.kind} {ref.name} was deleted while it ran") from exc
            if not is_transient(exc):
                raise JobFailed(f"could not read {ref.kind} {ref.name}: {_api_error(exc)}") from exc
            now = time.monotonic()
            self.failing_since = self.failing_since if self.failing_since is not None else now
            if now - self.failing_since >= self.grace_s:
                raise StatusUnknown(
                    f"could not read {ref.kind} {ref.namespace}/{ref.name} for {now - self.failing_since:.0f} s "
                    f"({_api_error(exc)}); the job was left running: check it with kubectl, the "
                    "exit handler deletes it if the run fails"
                ) from exc
            self.failed_reads += 1
            log.warning("reading %s %s failed (%s); retrying", ref.kind, ref.name, _api_error(exc))
            return None
        self.failing_since, self.failed_reads = None, 0
        return job


def delete_run_jobs(api_client: Any, namespace: str, run_id: str) -> list[str]:
    """Delete every PyTorchJob and TrainJob that rtp's train step created for `run_id`
    (labelled managed-by=rtp and with the run id); returns 'Kind/name' deleted."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    if not run_id.strip():
        raise JobFailed("no run id: refusing to delete training jobs by label alone")
    custom = client.CustomObjectsApi(api_client)
    selector = f"{MANAGED_BY_LABEL}={MANAGED_BY_RTP},{RUN_ID_LABEL}={run_id_label_value(run_id)}"
    deleted = []
    for job_kind in JOB_KINDS.values():
        kind, plural = job_kind.kind, job_kind.plural
        group, version = job_kind.group_version
        try:
            items = custom.list_namespaced_custom_object(
                group, version, namespace, plural, label_selector=selector
            )["items"]
        except ApiException as exc:
            if exc.status == 404:  # that operator is not installed: nothing of its kind to delete
                continue
            raise JobFailed(f"could not list {kind}s in {namespace}: {_api_error(exc)}") from exc
        for item in items:
            ref = JobRef(kind, group, version, plural, namespace, item["metadata"]["name"])
            if delete_job(api_client, ref):
                deleted.append(f"{kind}/{ref.name}")
    return deleted
