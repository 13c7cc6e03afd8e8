"""A FAKE Kubernetes API server for the training-job launcher's tests.

No real cluster can run on the development machines (no kube-apiserver, kubelet, kind or
k3s can be installed there), so the launcher's create/watch/log/timeout/delete logic is
tested against this stand-in instead. It is an HTTP server on 127.0.0.1 (port 0) in a
thread, speaking the REST paths the `kubernetes` Python client uses for custom objects and
pods. It is stateful: created objects are stored and listed by label, deleting them
removes their pods. Every created custom object is validated against its CRD's
openAPIV3Schema the way a real server does it: a field the CRD does not declare is dropped
with a `Warning` header (the default, `fieldValidation=Warn`) or refused with 400 under
`fieldValidation=Strict`; any other violation is refused with 422. A kind whose CRD was
not loaded answers 404 like a cluster without that operator. Each read of a job advances
it one phase (Created -> Running -> Succeeded/Failed, or stays Running forever for a
"hang"). Once running, a job has one pod per node, labelled the way the Training Operator
or JobSet labels them; the rank-0 pod serves a growing log. A scenario can make pods
stuck the way a cluster shows it (`PodTrouble`): Pending and Unschedulable with the
scheduler's FailedScheduling event, ImagePullBackOff, CrashLoopBackOff, an init container
still running, a volume that does not mount (the kubelet's FailedMount events), a missing
secret (CreateContainerConfigError), pods the API server refuses to create (`pods_refused`:
no pod at all, the engine's FailedCreate events on the job), a node that fails the node check (`unhealthy-node`: the
container crash-loops with the check's exit code and reasons); events are listed by
`involvedObject` field selector. Each pod runs on a named node; a PATCH of a job (JSON merge
patch, validated against the CRD like a create) changes the template its pods are built from,
and a deleted job pod is recreated the way the operator and scheduler would: same name, new
uid, on the node it had unless the job's current node affinity excludes it (then on a spare
node). A job does not finish while one of its pods sits on an unhealthy node. `batch/v1` Jobs
(the stage step's parts) are checked against the client's V1Job model and kept; a test's
`batch_runner` runs their pods and says how they ended.
Deployments added with `add_deployment` (the KFP API server's, whose image `rtp upload` reads)
can be read by name, or answer 403 when `forbidden` holds `get-deployment`.
A job pod's volumes are the job's pod template's. Standalone pods (`add_pod`, the train
step's own pod) can be read by name; a job's `metadata.ownerReferences` are checked against
the client's V1OwnerReference model, and the garbage collector is imitated: a job none of
whose owners exists in its namespace is deleted (at once on creation, or when `delete_pod`
removes its owner), as Kubernetes does with a dependent whose owners are all absent. It is
not a Kubernetes implementation: no scheduling, no controllers, no watch streams, no
admission webhooks.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from tests.fakes.crd_schema import (
    CustomResource,
    load_custom_resources,
    unknown_field_paths,
    without_fields,
)
from trainer.health import EXIT_UNHEALTHY_NODE

_SUCCESS_CONDITION = {"PyTorchJob": "Succeeded", "TrainJob": "Complete"}


MOUNT_FAILURES = (
    "Unable to attach or mount volumes: unmounted volumes=[fsx], unattached volumes=[fsx dshm]: "
    "timed out waiting for the condition",
    'MountVolume.SetUp failed for volume "fsx-pv" : rpc error: code = Internal desc = Could not mount '
    '"fs-0123456789abcdef0.fsx.us-east-1.amazonaws.com@tcp:/abcdefgh" at "/var/lib/kubelet/pods/1/volumes/'
    'kubernetes.io~csi/fsx-pv/mount": mount failed: exit status 5',
)
"""What the kubelet reports about an FSx volume it cannot mount (e.g. port 988 or 1018-1023 closed)."""
SCHEDULER_MESSAGE = (
    "0/4 nodes are available: 2 Insufficient nvidia.com/gpu, 2 node(s) didn't match Pod's node "
    "affinity/selector. preemption: 0/4 nodes are available: 4 Preemption is not helpful for scheduling."
)


@dataclass
class PodTrouble:
    """What keeps one pod of a running job from getting anywhere, as the API shows it."""

    kind: str  # unschedulable | no-scale-up | image-pull | crash-loop | init-wait | mount-fail | creating | missing-secret | unhealthy-node
    since_s: float = 0.0
    """How long ago the trouble began (condition, init container start)."""
    restarts: int = 5
    """restartCount of a crash-looping container."""


@dataclass
class Scenario:
    """How the fake runs a job: the outcome, its log, and how many reads each phase lasts."""

    outcome: str = "succeed"  # succeed | fail | hang
    log_lines: list[str] = field(default_factory=lambda: ["rank 0: step 1 loss 5.5", "rank 0: done"])
    reads_per_phase: int = 1
    failure_message: str = "pod rtp-master-0 exited with code 1"
    pod_troubles: dict[int, PodTrouble] = field(default_factory=dict)
    """Troubles by node index (0 is the master / node 0, the rank-0 pod)."""
    pods_refused: str = ""
    """Why the API server refuses every pod the engine creates (e.g. a Pod Security
    violation): the job runs with no pods, and the engine's FailedCreate events say why."""


@dataclass
class _Job:
    resource: CustomResource
    body: dict[str, Any]
    scenario: Scenario
    reads: int = 0
    phase: str = "Created"
    nodes: dict[int, str] = field(default_factory=dict)
    """The node each pod (by node index) runs on."""
    generations: dict[int, int] = field(default_factory=dict)
    """How often each pod was recreated (its uid changes)."""
    bad_nodes: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        spec = self.body["spec"]
        if self.resource.kind == "PyTorchJob":
            count = sum(int(r.get("replicas", 1)) for r in spec["pytorchReplicaSpecs"].values())
        else:
            count = int(spec["trainer"].get("numNodes", 1))
        self.nodes = {i: f"ip-10-0-0-{i + 10}" for i in range(count)}
        self.generations = dict.fromkeys(self.nodes, 0)
        self.bad_nodes = {
            self.nodes[i] for i, t in self.scenario.pod_troubles.items() if t.kind == "unhealthy-node"
        }

    def avoided_nodes(self, index: int) -> set[str]:
        """The nodes the current pod template of node `index`'s replica may not run on."""
        if self.resource.kind != "PyTorchJob":
            return set()
        role = "Master" if index == 0 else "Worker"
        template = self.body["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"]
        required = (template.get("affinity") or {}).get("nodeAffinity", {})
        terms = required.get("requiredDuringSchedulingIgnoredDuringExecution", {}).get(
            "nodeSelectorTerms", []
        )
        avoided: set[str] | None = None
        for term in terms:  # ORed: a node is excluded when every term excludes it
            excluded = {
                value
                for e in term.get("matchExpressions") or []
                if e.get("key") == "kubernetes.io/hostname" and e.get("operator") == "NotIn"
                for value in e.get("values", [])
            }
            avoided = excluded if avoided is None else avoided & excluded
        return avoided or set()

    def recreate(self, index: int) -> None:
        """The operator recreates a deleted pod; the scheduler keeps its free node unless excluded."""
        self.generations[index] += 1
        avoided = self.avoided_nodes(index)
        if self.nodes[index] in avoided:
            used = set(self.nodes.values()) | avoided
            self.nodes[index] = next(f"ip-10-0-1-{k}" for k in range(100) if f"ip-10-0-1-{k}" not in used)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _matches(labels: dict[str, str], selector: str) -> bool:
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: objects merge key by key, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    merged = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = _merge_patch(merged.get(key), value)
    return merged


def _template_volumes(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The volumes of a job's pod template (PyTorchJob replicas, or a TrainJob's runtime patch)."""
    if body["kind"] == "PyTorchJob":
        return body["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"].get("volumes", [])
    for patch in body["spec"].get("runtimePatches", []):
        for replicated in patch["trainingRuntimeSpec"]["template"]["spec"].get("replicatedJobs", []):
            return replicated["template"]["spec"]["template"]["spec"].get("volumes", [])
    return []


def _secret_name(body: dict[str, Any]) -> str:
    """The secret a job's training container reads its MLflow variables from."""
    if body["kind"] == "PyTorchJob":
        env = body["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0].get(
            "env", []
        )
    else:
        env = body["spec"]["trainer"].get("env", [])
    refs = [e["valueFrom"]["secretKeyRef"]["name"] for e in env if "secretKeyRef" in e.get("valueFrom", {})]
    return refs[0] if refs else "?"


def _owner_reference_errors(body: dict[str, Any]) -> list[str]:
    """metadata.ownerReferences checked against the client's V1OwnerReference model: known
    fields only, and the required apiVersion, kind, name and uid."""
    from tests.fakes.k8s_models import unknown_fields

    errors = []
    for index, owner in enumerate(body.get("metadata", {}).get("ownerReferences") or []):
        path = f"metadata.ownerReferences[{index}]"
        errors += [f"{path}.{field}: unknown field" for field in unknown_fields(owner, "V1OwnerReference")]
        errors += [
            f"{path}.{key}: Required value"
            for key in ("apiVersion", "kind", "name", "uid")
            if not owner.get(key)
        ]
    return errors


class FakeKubernetes:
    """The fake server; `url` is its base address, `deleted` lists deleted job names."""

    def __init__(self, crd_dir: Path, kinds: tuple[str, ...] | None = None) -> None:
        resources = load_custom_resources(crd_dir)
        self.resources = {
            (r.group, r.version, r.plural): r for r in resources.values() if kinds is None or r.kind in kinds
        }
        self.jobs: dict[tuple[str, str, str], _Job] = {}  # (plural, namespace, name)
        self.deleted: list[str] = []
        self.created: list[dict[str, Any]] = []
        """Every job body the fake accepted, in order (kept after the job is deleted)."""
        self.rejected: list[str] = []
        self.pruned: list[str] = []
        """Unknown fields the fake dropped from a job without refusing it (no `fieldValidation=Strict`)."""
        self.default_scenario = Scenario()
        self.scenarios: dict[str, Scenario] = {}
        self.on_success: Callable[[dict[str, Any]], None] | None = None
        self.events_forbidden = False
        """Answer 403 to event lists, like a Role without `events`."""
        self.patches: list[dict[str, Any]] = []
        """Every merge patch the fake applied to a job, in order."""
        self.deleted_pods: list[str] = []
        """Job pods deleted through the API (each then recreated, as the operator would)."""
        self.forbidden: set[str] = set()
        """Verbs answered 403 (`patch`, `delete-pod`, `get-deployment`), like a Role without them."""
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        """Standalone pods by (namespace, name): the train step's own pod (`add_pod`)."""
        self.deployments: dict[tuple[str, str], dict[str, Any]] = {}
        """apps/v1 Deployments by (namespace, name) (`add_deployment`)."""
        self.batch_jobs: dict[tuple[str, str], dict[str, Any]] = {}
        """batch/v1 Jobs by (namespace, name), each checked against the client's V1Job model."""
        self.batch_runner: Callable[[dict[str, Any]], dict[str, Any]] | None = None
        """Runs a created batch Job's pods (in a thread) and returns the Job's final status."""
        self.deleted_batch_jobs: list[str] = []
        self.collected: list[str] = []
        """Jobs the imitated garbage collector deleted (all their owners absent)."""
        self.failing_reads: list[int] = []
        """HTTP statuses the next reads of a job answer with instead of the job (e.g. 503, 429):
        an API server hiccup; each is used once."""
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FakeKubernetes:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    # -- state changes ---------------------------------------------------------------

    def add_pod(self, namespace: str, name: str) -> dict[str, Any]:
        """A running pod outside any job (the train step's own pod); returns it, uid included."""
        with self._lock:
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "namespace": namespace,
                    "uid": f"pod-uid-{len(self.pods)}-{name}",
                    "creationTimestamp": _now(),
                },
                "spec": {"containers": [{"name": "main", "image": "fake"}]},
                "status": {"phase": "Running"},
            }
            self.pods[(namespace, name)] = pod
            return pod

    def add_deployment(self, namespace: str, name: str, containers: dict[str, str]) -> dict[str, Any]:
        """A Deployment whose pod template runs `containers` (name -> image); returns it."""
        with self._lock:
            labels = {"app": name}
            deployment = {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": name, "namespace": namespace, "uid": f"deployment-uid-{name}"},
                "spec": {
                    "selector": {"matchLabels": labels},
                    "template": {
                        "metadata": {"labels": labels},
                        "spec": {"containers": [{"name": c, "image": i} for c, i in containers.items()]},
                    },
                },
            }
            self.deployments[(namespace, name)] = deployment
            return deployment

    def delete_pod(self, namespace: str, name: str) -> None:
        """Delete a standalone pod; the garbage collector then deletes the jobs it owned alone."""
        with self._lock:
            del self.pods[(namespace, name)]
            self._collect_garbage()

    def _collect_garbage(self) -> None:
        """Delete every job that has owners, none of which exists in the job's namespace (an
        owner is looked up by uid in the dependent's own namespace: a cross-namespace owner
        counts as absent)."""
        for key, job in list(self.jobs.items()):
            owners = job.body["metadata"].get("ownerReferences") or []
            namespace = job.body["metadata"]["namespace"]
            alive = {p["metadata"]["uid"] for (ns, _), p in self.pods.items() if ns == namespace}
            if owners and not any(owner.get("uid") in alive for owner in owners):
                del self.jobs[key]
                self.collected.append(key[2])

    def _advance(self, job: _Job) -> None:
        job.reads += 1
        kind = job.resource.kind
        order = ["Created", "Running", "Finished"]
        step = min(job.reads // job.scenario.reads_per_phase, 2)
        if job.scenario.outcome == "hang" or job.bad_nodes & set(job.nodes.values()):
            step = min(step, 1)  # a rank on an unhealthy node never joins: the job stays Running
        phase = order[step]
        if phase == job.phase:
            return
        job.phase = phase
        conditions = job.body.setdefault("status", {}).setdefault("conditions", [])
        if phase == "Running":
            conditions.append(self._condition("Running" if kind == "PyTorchJob" else "Created", "Started"))
        elif job.scenario.outcome == "succeed":
            conditions.append(self._condition(_SUCCESS_CONDITION[kind], "JobSucceeded"))
            if self.on_success:
                self.on_success(job.body)
        else:
            conditions.append(self._condition("Failed", "JobFailed", message=job.scenario.failure_message))

    @staticmethod
    def _condition(kind: str, reason: str, message: str = "") -> dict[str, str]:
        return {
            "type": kind,
            "status": "True",
            "reason": reason,
            "message": message or reason,
            "lastTransitionTime": _now(),
        }

    def _job_pods(self, job: _Job) -> list[dict[str, Any]]:
        """One pod per node once the job runs; node 0's pod runs rank 0."""
        if job.phase == "Created" or job.scenario.pods_refused:
            return []
        name, namespace = job.body["metadata"]["name"], job.body["metadata"]["namespace"]
        pods = []
        if job.resource.kind == "PyTorchJob":
            replicas = job.body["spec"]["pytorchReplicaSpecs"]
            roles = [("master", 0)] + [
                ("worker", i) for i in range(replicas.get("Worker", {}).get("replicas", 0))
            ]
            for index, (role, replica_index) in enumerate(roles):
                labels = {
                    "training.kubeflow.org/job-name": name,
                    "training.kubeflow.org/replica-type": role,
                    "training.kubeflow.org/replica-index": str(replica_index),
                }
                pods.append((index, f"{name}-{role}-{replica_index}", labels, "pytorch", role == "worker"))
        else:
            for index in range(job.body["spec"]["trainer"].get("numNodes", 1)):
                labels = {
                    "jobset.sigs.k8s.io/jobset-name": name,
                    "jobset.sigs.k8s.io/replicatedjob-name": "node",
                    "batch.kubernetes.io/job-completion-index": str(index),
                }
                pods.append((index, f"{name}-node-0-{index}-abcde", labels, "node", False))
        made = []
        for index, pod_name, labels, container, has_init in pods:
            trouble = job.scenario.pod_troubles.get(index)
            if trouble and trouble.kind == "unhealthy-node" and job.nodes[index] not in job.bad_nodes:
                trouble = None  # moved to a healthy node
            pod = self._pod(job, pod_name, namespace, labels, container, has_init, trouble, job.nodes[index])
            pod["metadata"]["uid"] = f"{pod_name}-uid-{job.generations[index]}"
            made.append(pod)
        return made

    def _pod(
        self,
        job: _Job,
        name: str,
        namespace: str,
        labels: dict[str, str],
        container: str,
        has_init: bool,
        trouble: PodTrouble | None,
        node: str,
    ) -> dict[str, Any]:
        since = (datetime.now(UTC) - timedelta(seconds=trouble.since_s if trouble else 0)).strftime(
            "%Y-%m-%dT%H:%M:%SZ"
        )
        phase = "Running" if job.phase == "Running" else "Succeeded"
        status: dict[str, Any] = {"phase": phase, "startTime": since}
        spec: dict[str, Any] = {
            "containers": [{"name": container, "image": "fake"}],
            "volumes": _template_volumes(job.body),
        }
        if not trouble or trouble.kind not in ("unschedulable", "no-scale-up"):
            spec["nodeName"] = node  # scheduled
        if has_init:
            spec["initContainers"] = [{"name": "init-pytorch", "image": "alpine"}]
        base = {"name": container, "image": "fake", "imageID": "", "ready": False, "restartCount": 0}
        kind = trouble.kind if trouble else ""
        if kind in ("unschedulable", "no-scale-up"):
            status = {
                "phase": "Pending",
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": SCHEDULER_MESSAGE,
                        "lastTransitionTime": since,
                    }
                ],
            }
        elif kind == "image-pull":
            status = {
                "phase": "Pending",
                "startTime": since,
                "containerStatuses": [
                    {
                        **base,
                        "state": {
                            "waiting": {
                                "reason": "ImagePullBackOff",
                                "message": 'Back-off pulling image "example.com/rtp:1"',
                            }
                        },
                    }
                ],
            }
        elif kind == "crash-loop":
            assert trouble is not None
            status["containerStatuses"] = [
                {
                    **base,
                    "restartCount": trouble.restarts,
                    "state": {
                        "waiting": {"reason": "CrashLoopBackOff", "message": "back-off 5m0s restarting"}
                    },
                    "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}},
                }
            ]
        elif kind == "unhealthy-node":
            # The node check exits with its code and reasons; the kubelet restarts it in place.
            status["containerStatuses"] = [
                {
                    **base,
                    "restartCount": 1,
                    "state": {
                        "waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s restarting"}
                    },
                    "lastState": {
                        "terminated": {
                            "exitCode": EXIT_UNHEALTHY_NODE,
                            "reason": "Error",
                            "message": f"node {node} is unhealthy: efa: 0 EFA devices under "
                            "/sys/class/infiniband (none), 32 expected",
                        }
                    },
                }
            ]
        elif kind in ("mount-fail", "creating", "missing-secret"):
            # Scheduled, but the kubelet cannot create the containers: the volumes do not mount
            # (all wait, PodInitializing when there are init containers), or a secret is missing.
            waiting = {"reason": "PodInitializing" if has_init else "ContainerCreating"}
            if kind == "missing-secret":
                waiting = {
                    "reason": "CreateContainerConfigError",
                    "message": f'secret "{_secret_name(job.body)}" not found',
                }
            status = {
                "phase": "Pending",
                "startTime": since,
                "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": since}],
                "containerStatuses": [{**base, "state": {"waiting": waiting}}],
            }
            if has_init:
                status["initContainerStatuses"] = [
                    {**base, "name": "init-pytorch", "state": {"waiting": {"reason": "PodInitializing"}}}
                ]
        elif kind == "init-wait":
            status = {
                "phase": "Pending",
                "startTime": since,
                "initContainerStatuses": [
                    {**base, "name": "init-pytorch", "state": {"running": {"startedAt": since}}}
                ],
            }
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": labels, "creationTimestamp": since},
            "spec": spec,
            "status": status,
        }

    def _events(self, job: _Job, pod: dict[str, Any]) -> list[dict[str, Any]]:
        """What the scheduler, autoscaler and kubelet report about a troubled pod."""
        status = pod["status"]
        reasons = []
        if any(c.get("reason") == "Unschedulable" for c in status.get("conditions", [])):
            reasons.append(("FailedScheduling", "default-scheduler", SCHEDULER_MESSAGE))
            troubles = [t.kind for t in job.scenario.pod_troubles.values()]
            if "no-scale-up" in troubles:
                reasons.append(
                    (
                        "NotTriggerScaleUp",
                        "cluster-autoscaler",
                        "pod didn't trigger scale-up: 1 max node group size reached",
                    )
                )
        for container in status.get("containerStatuses", []):
            waiting = container.get("state", {}).get("waiting", {})
            if waiting.get("reason") == "ImagePullBackOff":
                reasons.append(("Failed", "kubelet", f"Error: {waiting['reason']}"))
        names = [p["metadata"]["name"] for p in self._job_pods(job)]
        index = names.index(pod["metadata"]["name"]) if pod["metadata"]["name"] in names else -1
        trouble = job.scenario.pod_troubles.get(index)
        if trouble and trouble.kind == "mount-fail":
            reasons += [("FailedMount", "kubelet", message) for message in MOUNT_FAILURES]
        return [
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {
                    "name": f"{pod['metadata']['name']}.{i}",
                    "namespace": pod["metadata"]["namespace"],
                },
                "involvedObject": {
                    "kind": "Pod",
                    "name": pod["metadata"]["name"],
                    "namespace": pod["metadata"]["namespace"],
                },
                "reason": reason,
                "message": message,
                "source": {"component": source},
                "type": "Warning",
                "lastTimestamp": _now(),
            }
            for i, (reason, source, message) in enumerate(reasons)
        ]

    def _creation_events(self, job: _Job) -> list[dict[str, Any]]:
        """The engine's events when its pods are refused: the Training Operator records
        `FailedCreatePod` on the PyTorchJob (kubeflow/trainer v1.9.4,
        pkg/controller.v1/control/pod_control.go); for a TrainJob, JobSet's child Job
        `<name>-node-0` gets the Job controller's `FailedCreate`."""
        if not job.scenario.pods_refused or job.phase == "Created":
            return []
        meta = job.body["metadata"]
        if job.resource.kind == "PyTorchJob":
            kind, name, reason, api_version = "PyTorchJob", meta["name"], "FailedCreatePod", "kubeflow.org/v1"
        else:
            kind, name, reason, api_version = "Job", f"{meta['name']}-node-0", "FailedCreate", "batch/v1"
        pod = f"{meta['name']}-node-0-0-abcde" if kind == "Job" else f"{meta['name']}-master-0"
        return [
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"name": f"{name}.create", "namespace": meta["namespace"]},
                "involvedObject": {
                    "apiVersion": api_version,
                    "kind": kind,
                    "name": name,
                    "namespace": meta["namespace"],
                },
                "reason": reason,
                "message": f'Error creating: pods "{pod}" is forbidden: {job.scenario.pods_refused}',
                "source": {"component": "job-controller" if kind == "Job" else "pytorchjob-controller"},
                "type": "Warning",
                "count": 7,
                "lastTimestamp": _now(),
            }
        ]

    def _log(self, job: _Job) -> str:
        lines = job.scenario.log_lines
        # The log grows with each read while running, and is complete once finished.
        shown = lines if job.phase == "Finished" else lines[: max(1, job.reads - 1)]
        return "".join(f"{line}\n" for line in shown)

    # -- HTTP ------------------------------------------------------------------------

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # quiet test output
                pass

            def _send(
                self, status: int, payload: Any, content_type: str = "application/json", warnings: tuple = ()
            ) -> None:
                data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
                self.send_response(status)
                for warning in warnings:  # how a real server reports the fields it dropped
                    self.send_header("Warning", f'299 - "{warning}"')
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _status(self, code: int, reason: str, message: str) -> None:
                self._send(
                    code,
                    {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "status": "Failure",
                        "reason": reason,
                        "message": message,
                        "code": code,
                    },
                )

            def _route(self) -> tuple[list[str], dict[str, str]]:
                parsed = urlparse(self.path)
                query = {k: v[0] for k, v in parse_qs(parsed.query).items()}
                return [p for p in parsed.path.split("/") if p], query

            def do_GET(self) -> None:
                parts, query = self._route()
                if parts[:2] == ["apis", "batch"] and len(parts) == 7:
                    with fake._lock:
                        job = fake.batch_jobs.get((parts[4], parts[6]))
                        if job is None:
                            return self._status(404, "NotFound", f'jobs.batch "{parts[6]}" not found')
                        return self._send(200, job)
                if parts[:3] == ["apis", "apps", "v1"] and len(parts) == 7 and parts[5] == "deployments":
                    with fake._lock:
                        if "get-deployment" in fake.forbidden:
                            return self._status(
                                403, "Forbidden", f'deployments.apps "{parts[6]}" is forbidden: cannot get'
                            )
                        deployment = fake.deployments.get((parts[4], parts[6]))
                        if deployment is None:
                            return self._status(404, "NotFound", f'deployments.apps "{parts[6]}" not found')
                        return self._send(200, deployment)
                with fake._lock:
                    if parts[:2] == ["api", "v1"] and len(parts) >= 4 and parts[2] == "namespaces":
                        return self._pods(parts, query)
                    if parts[:1] == ["apis"] and len(parts) in (6, 7):
                        return self._get_custom(parts, query)
                self._status(404, "NotFound", f"the fake has no route for GET {self.path}")

            def _resource(self, parts: list[str]) -> CustomResource | None:
                return fake.resources.get((parts[1], parts[2], parts[5]))

            def _get_custom(self, parts: list[str], query: dict[str, str]) -> None:
                resource = self._resource(parts)
                if resource is None:
                    return self._status(404, "NotFound", "the server could not find the requested resource")
                namespace, plural = parts[4], parts[5]
                if len(parts) == 6:
                    selector = query.get("labelSelector", "")
                    items = [
                        job.body
                        for (p, ns, _), job in fake.jobs.items()
                        if p == plural
                        and ns == namespace
                        and _matches(job.body["metadata"].get("labels", {}), selector)
                    ]
                    return self._send(
                        200,
                        {
                            "apiVersion": resource.api_version,
                            "kind": f"{resource.kind}List",
                            "metadata": {},
                            "items": items,
                        },
                    )
                if fake.failing_reads:
                    code = fake.failing_reads.pop(0)
                    return self._status(code, "ServiceUnavailable", f"injected transient error {code}")
                job = fake.jobs.get((plural, namespace, parts[6]))
                if job is None:
                    return self._status(404, "NotFound", f'{plural} "{parts[6]}" not found')
                fake._advance(job)
                self._send(200, job.body)

            def _pods(self, parts: list[str], query: dict[str, str]) -> None:
                namespace = parts[3]
                running = [j for (_, ns, _), j in fake.jobs.items() if ns == namespace]
                pods = [(p, j) for j in running for p in fake._job_pods(j)]
                if parts[4:] == ["events"]:
                    if fake.events_forbidden:
                        return self._status(
                            403, "Forbidden", 'events is forbidden: cannot list resource "events"'
                        )
                    wanted = dict(
                        term.split("=", 1)
                        for term in query.get("fieldSelector", "").split(",")
                        if "=" in term
                    )
                    every = [event for pod, job in pods for event in fake._events(job, pod)]
                    every += [event for job in running for event in fake._creation_events(job)]
                    items = [
                        event
                        for event in every
                        if all(
                            (
                                event["involvedObject"].get(key.removeprefix("involvedObject."))
                                if key.startswith("involvedObject.")
                                else event.get(key)
                            )
                            == value
                            for key, value in wanted.items()
                        )
                    ]
                    return self._send(
                        200, {"apiVersion": "v1", "kind": "EventList", "metadata": {}, "items": items}
                    )
                if len(parts) == 6 and parts[4] == "pods":
                    for pod in [*(p for p, _ in pods), *fake.pods.values()]:
                        if pod["metadata"]["name"] == parts[5] and pod["metadata"]["namespace"] == namespace:
                            return self._send(200, pod)
                    return self._status(404, "NotFound", f'pods "{parts[5]}" not found')
                if parts[4:] == ["pods"]:
                    selector = query.get("labelSelector", "")
                    standalone = [p for (ns, _), p in fake.pods.items() if ns == namespace]
                    items = [
                        p
                        for p in [*(p for p, _ in pods), *standalone]
                        if _matches(p["metadata"].get("labels", {}), selector)
                    ]
                    return self._send(
                        200, {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}
                    )
                if len(parts) == 7 and parts[4] == "pods" and parts[6] == "log":
                    for pod, job in pods:
                        if pod["metadata"]["name"] == parts[5]:
                            expected = pod["spec"]["containers"][0]["name"]
                            if query.get("container", expected) != expected:
                                return self._status(
                                    400, "BadRequest", f"container {query['container']} is not valid"
                                )
                            if pod["status"]["phase"] == "Pending":
                                return self._status(
                                    400, "BadRequest", f'container "{expected}" is waiting to start'
                                )
                            return self._send(200, fake._log(job), "text/plain")
                    return self._status(404, "NotFound", f'pods "{parts[5]}" not found')
                self._status(404, "NotFound", f"the fake has no route for GET {self.path}")

            def _create_batch_job(self, namespace: str, body: dict[str, Any]) -> None:
                from tests.fakes.k8s_models import core_object_errors

                errors = core_object_errors(body) + _owner_reference_errors(body)
                if errors:
                    fake.rejected.append("; ".join(errors))
                    return self._status(422, "Invalid", "Job.batch is invalid: " + "; ".join(errors))
                key = (namespace, body["metadata"]["name"])
                if key in fake.batch_jobs:
                    return self._status(409, "AlreadyExists", f'jobs.batch "{key[1]}" already exists')
                body["metadata"].update({"namespace": namespace, "uid": f"job-uid-{len(fake.batch_jobs)}"})
                body["status"] = {"active": body["spec"].get("parallelism", 1)}
                fake.batch_jobs[key] = body
                if fake.batch_runner is not None:
                    runner = fake.batch_runner

                    def run() -> None:
                        status = runner(copy.deepcopy(body))
                        with fake._lock:
                            if key in fake.batch_jobs:
                                fake.batch_jobs[key]["status"] = status

                    threading.Thread(target=run, daemon=True).start()
                self._send(201, body)

            def _field_validation(
                self, resource: CustomResource, body: dict[str, Any], query: dict[str, str]
            ) -> tuple[dict[str, Any] | None, list[str]]:
                """(the body to store, warnings) after the server's field validation, or
                (None, []) once it answered 400: `fieldValidation=Strict` refuses an unknown
                field, anything else (Warn, the default since Kubernetes 1.23, or Ignore)
                drops it and at most warns."""
                unknown = unknown_field_paths(resource, body)
                if not unknown:
                    return body, []
                what = ", ".join(f'unknown field "{path}"' for path in unknown)
                if query.get("fieldValidation") == "Strict":
                    fake.rejected.append(what)
                    self._status(
                        400,
                        "BadRequest",
                        f'{resource.kind} in version "{resource.version}" cannot be handled as a '
                        f"{resource.kind}: strict decoding error: {what}",
                    )
                    return None, []
                fake.pruned += unknown
                warnings = [f'unknown field "{path}"' for path in unknown]
                return without_fields(body, unknown), warnings if query.get(
                    "fieldValidation"
                ) != "Ignore" else []

            def do_POST(self) -> None:
                parts, query = self._route()
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length) or b"{}")
                if parts[:4] == ["apis", "batch", "v1", "namespaces"] and parts[5:] == ["jobs"]:
                    with fake._lock:
                        return self._create_batch_job(parts[4], body)
                with fake._lock:
                    if parts[:1] != ["apis"] or len(parts) != 6:
                        return self._status(404, "NotFound", f"the fake has no route for POST {self.path}")
                    resource = self._resource(parts)
                    if resource is None:
                        return self._status(
                            404, "NotFound", "the server could not find the requested resource"
                        )
                    checked, warnings = self._field_validation(resource, body, query)
                    if checked is None:
                        return None
                    body = checked
                    errors = resource.errors(body) + _owner_reference_errors(body)
                    namespace = parts[4]
                    if body.get("metadata", {}).get("namespace", namespace) != namespace:
                        errors.append("metadata.namespace does not match the request path")
                    if errors:
                        fake.rejected.append("; ".join(errors))
                        return self._status(
                            422, "Invalid", f"{resource.kind} is invalid: " + "; ".join(errors)
                        )
                    name = body["metadata"]["name"]
                    key = (parts[5], namespace, name)
                    if key in fake.jobs:
                        return self._status(409, "AlreadyExists", f'{parts[5]} "{name}" already exists')
                    body["metadata"].update(
                        {"namespace": namespace, "uid": f"uid-{len(fake.jobs)}", "creationTimestamp": _now()}
                    )
                    fake.jobs[key] = _Job(resource, body, fake.scenarios.get(name, fake.default_scenario))
                    fake.created.append(body)
                    # Collected before the answer, so a caller sees the outcome without racing the fake.
                    fake._collect_garbage()
                    self._send(201, body, warnings=tuple(warnings))

            def do_PATCH(self) -> None:
                parts, query = self._route()
                length = int(self.headers.get("Content-Length", "0"))
                patch = json.loads(self.rfile.read(length) or b"{}")
                with fake._lock:
                    if parts[:1] != ["apis"] or len(parts) != 7 or self._resource(parts) is None:
                        return self._status(404, "NotFound", f"the fake has no route for PATCH {self.path}")
                    if self.headers.get("Content-Type") != "application/merge-patch+json":
                        return self._status(
                            415,
                            "UnsupportedMediaType",
                            f"the fake takes merge patches, not {self.headers.get('Content-Type')}",
                        )
                    if "patch" in fake.forbidden:
                        return self._status(
                            403, "Forbidden", f'{parts[5]} is forbidden: cannot patch resource "{parts[5]}"'
                        )
                    job = fake.jobs.get((parts[5], parts[4], parts[6]))
                    if job is None:
                        return self._status(404, "NotFound", f'{parts[5]} "{parts[6]}" not found')
                    merged = _merge_patch(job.body, patch)
                    server_set = ("uid", "creationTimestamp")  # added by the fake on create
                    metadata = {k: v for k, v in merged["metadata"].items() if k not in server_set}
                    spec_only = {k: v for k, v in merged.items() if k != "status"}  # status is the operator's
                    checked, warnings = self._field_validation(
                        job.resource, {**spec_only, "metadata": metadata}, query
                    )
                    if checked is None:
                        return None
                    errors = job.resource.errors(checked)
                    if errors:
                        fake.rejected.append("; ".join(errors))
                        return self._status(
                            422, "Invalid", f"{job.resource.kind} is invalid: " + "; ".join(errors)
                        )
                    merged = {**checked, "metadata": merged["metadata"], "status": merged.get("status", {})}
                    job.body = merged
                    fake.patches.append(patch)
                    self._send(200, merged, warnings=tuple(warnings))

            def _delete_pod(self, parts: list[str]) -> None:
                namespace, name = parts[3], parts[5]
                if "delete-pod" in fake.forbidden:
                    return self._status(403, "Forbidden", 'pods is forbidden: cannot delete resource "pods"')
                for (_, ns, _), job in fake.jobs.items():
                    if ns != namespace:
                        continue
                    for index, pod in enumerate(fake._job_pods(job)):
                        if pod["metadata"]["name"] == name:
                            fake.deleted_pods.append(name)
                            job.recreate(index)
                            return self._send(200, pod)
                self._status(404, "NotFound", f'pods "{name}" not found')

            def do_DELETE(self) -> None:
                parts, _ = self._route()
                with fake._lock:
                    if parts[:2] == ["apis", "batch"] and len(parts) == 7:
                        if fake.batch_jobs.pop((parts[4], parts[6]), None) is None:
                            return self._status(404, "NotFound", f'jobs.batch "{parts[6]}" not found')
                        fake.deleted_batch_jobs.append(parts[6])
                        return self._send(200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})
                    if parts[:2] == ["api", "v1"] and len(parts) == 6 and parts[4] == "pods":
                        return self._delete_pod(parts)
                    if parts[:1] != ["apis"] or len(parts) != 7 or self._resource(parts) is None:
                        return self._status(404, "NotFound", f"the fake has no route for DELETE {self.path}")
                    job = fake.jobs.pop((parts[5], parts[4], parts[6]), None)
                    if job is None:
                        return self._status(404, "NotFound", f'{parts[5]} "{parts[6]}" not found')
                    fake.deleted.append(parts[6])
                    self._send(
                        200,
                        {
                            "kind": "Status",
                            "apiVersion": "v1",
                            "status": "Success",
                            "details": {"name": parts[6], "kind": parts[5]},
                        },
                    )

        return Handler
