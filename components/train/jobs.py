"""Multi-node training job manifests, built as plain data: a PyTorchJob or a TrainJob.

When one pod is not enough, the train step hands the ranks to a distributed engine that
already runs on the cluster: the Kubeflow Training Operator (`PyTorchJob`,
`kubeflow.org/v1`) or Kubeflow Trainer v2 (`TrainJob`, `trainer.kubeflow.org/v1alpha1`,
against a torch-distributed `ClusterTrainingRuntime`). Every pod runs `ft_launcher` with a
c10d rendezvous on the engine's master address, mounts the FSx PVC at the same path as the
pipeline's pods, gets a memory-backed `/dev/shm` and reads MLflow's settings from the secret
the pipeline's steps read (rank 0, in a job pod, logs the live metrics). The builders here
are pure functions of a `JobSettings` (no Kubernetes client, no I/O), so `rtp render-job`
can print them and tests can validate them against the CRD schemas; `k8s_launcher` creates
and watches them.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from components.mlflow_access import DEFAULT_MLFLOW_SECRET, MLFLOW_SECRET_KEYS
from components.train.job_scale import JobScale, job_scale
from trainer.gpu_defaults import NCCL_ENV
from trainer.gpu_defaults import launcher_settings as gpu_launcher_settings
from trainer.launch import launcher_flags

PYTORCHJOB_API_VERSION = "kubeflow.org/v1"
PYTORCHJOB_PLURAL = "pytorchjobs"
TRAINJOB_API_VERSION = "trainer.kubeflow.org/v1alpha1"
TRAINJOB_PLURAL = "trainjobs"
LAUNCHERS = ("inpod", "pytorchjob", "trainjob")
JOB_LAUNCHERS = ("pytorchjob", "trainjob")
DEFAULT_LAUNCHER = "inpod"
DEFAULT_TRAINING_RUNTIME = "torch-distributed"
RUN_ID_LABEL = "rtp.kubeflow.org/run-id"
"""Every job carries its KFP run id here, so the exit handler can find and delete it."""
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
"""Kueue's queue label on a PyTorchJob or TrainJob: its webhook suspends the job until admitted."""
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY_RTP = "rtp"
GPU_RESOURCE = "nvidia.com/gpu"
EFA_RESOURCE = "vpc.amazonaws.com/efa"
# The Training Operator requires the container of a PyTorchJob replica to be named
# "pytorch"; the stock torch-distributed runtime of Trainer v2 names its trainer "node".
PYTORCHJOB_CONTAINER = "pytorch"
TRAINJOB_CONTAINER = "node"
TRAINJOB_REPLICATED_JOB = "node"
ISTIO_INJECT_ANNOTATION = "sidecar.istio.io/inject"
"""Kubeflow profile namespaces inject Istio sidecars; a training pod must not get one: the
sidecar keeps the master pod from reaching Succeeded, and c10d/NCCL traffic would pass Envoy."""
EFA_DEVICE_RDMA_INSTANCE_TYPES = frozenset(
    {"p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge", "p5e.48xlarge", "p5en.48xlarge"}
)
"""EC2 instance types whose EFA supports GPUDirect RDMA (FI_EFA_USE_DEVICE_RDMA=1), per the
EC2 user guide's EFA pages; on others (g5, g6, p3dn) libfabric would fail to register GPU memory."""
SHM_VOLUME = "dshm"
FSX_VOLUME = "fsx"
_DNS_LABEL = re.compile(r"[^a-z0-9-]+")
_LABEL_VALUE = re.compile(r"[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
"""A Kubernetes object name such as a secret's (RFC 1123 subdomain, at most 253 characters)."""


class JobSettingsError(ValueError):
    """A training-job setting is out of range; the message names it and what is allowed."""


@dataclass(kw_only=True, slots=True)
class JobSettings:
    """Everything a multi-node training job needs; one field per pipeline parameter."""

    name: str
    """Job name (a DNS label); `job_name(run_id)` derives one from the KFP run id."""
    namespace: str
    image: str
    trainer_args: list[str]
    """Arguments of `python -m trainer` (from `trainer.launch.trainer_arguments`)."""
    rank_module: str = "trainer"
    """What ft_launcher starts per rank: the trainer, or the rtp_prefork plugin that runs it."""
    run_id: str = ""
    """KFP run id, stored in the RUN_ID_LABEL label."""
    nnodes: int = 1
    nproc_per_node: int = 1
    gpus_per_node: int = 0
    """0 trains on CPU (gloo); otherwise each pod requests this many `nvidia.com/gpu`."""
    efa_per_node: int = 0
    """EFA interfaces each pod requests (`vpc.amazonaws.com/efa`); 0 uses TCP sockets."""
    instance_type: str = ""
    """EC2 instance type of the job's nodes; with EFA it decides whether device RDMA is on
    (EFA_DEVICE_RDMA_INSTANCE_TYPES). It does not schedule: match it with node_selector."""
    cpu_per_node: str | None = ""
    """CPU request (and limit) of each pod; None takes a p5 share from job_scale on GPU
    jobs and none on CPU; empty requests none."""
    memory_per_node: str | None = ""
    """Memory request (and limit) of each pod; None as for cpu_per_node."""
    pvc_name: str = "fsx-claim"
    mount_path: str = "/fsx"
    shm_size: str | None = ""
    """Size limit of the memory-backed /dev/shm; empty leaves it bounded by pod memory;
    None as for cpu_per_node."""
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    service_account: str = ""
    queue_name: str = ""
    """Kueue LocalQueue the job is submitted to (label KUEUE_QUEUE_LABEL): Kueue keeps it
    suspended until the queue's quota admits all of its pods at once; empty = no queue."""
    priority_class: str = ""
    """PriorityClass of the PyTorchJob's pods and its gang scheduling policy; empty = the
    cluster's default. A v2.3 TrainJob cannot set it (its runtime's pod template does)."""
    image_pull_policy: str = "IfNotPresent"
    image_pull_secrets: list[str] = field(default_factory=list)
    max_restarts: int | None = None
    """ft_launcher restarts of the worker group inside the pods before the pod fails;
    None takes job_scale's value for the GPU count."""
    backoff_limit: int | None = None
    """Pod-level retries the engine makes before the job is Failed (PyTorchJob); None
    takes job_scale's value."""
    termination_grace_s: int | None = None
    """The pods' terminationGracePeriodSeconds (ft_launcher's --term-timeout is 60 s less,
    at least half of it); None takes job_scale's value."""
    deadline_s: int = 24 * 3600
    """The job is stopped after this many seconds (activeDeadlineSeconds)."""
    ttl_after_finished_s: int = 3600
    training_runtime: str = DEFAULT_TRAINING_RUNTIME
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of every training container, as values; a name here wins over the
    same name from training_env's NCCL/EFA settings or from the MLflow secret."""
    mlflow_secret_name: str = DEFAULT_MLFLOW_SECRET
    """Secret in the job's namespace whose keys (MLFLOW_SECRET_KEYS) become the pods'
    MLFLOW_TRACKING_* variables, so rank 0 logs live metrics; referenced, never copied into
    the manifest, and required like in the pipeline's steps (a missing secret or key stops
    the pods at CreateContainerConfigError, which fails the step at once). Empty gives the
    pods no MLflow settings: training then logs only to files."""
    owner_references: list[dict[str, Any]] = field(default_factory=list)
    """The job's metadata.ownerReferences: the train step's own pod (`k8s_launcher.step_pod_owner`),
    so Kubernetes deletes the job with that pod even when no exit handler runs."""
    managed_by: str = MANAGED_BY_RTP
    """The job's app.kubernetes.io/managed-by label. The train step's jobs say `rtp`, and only
    those are ever deleted by rtp; `rtp render-job` output says `rtp-render-job`, so a job a
    person applies by hand is never deleted by a pipeline's exit handler."""

    def check(self) -> JobSettings:
        problems = []
        if not self.name or len(self.name) > 63 or _DNS_LABEL.search(self.name) or self.name[0] == "-":
            problems.append(f"job name {self.name!r} must be a DNS label (a-z, 0-9, '-', at most 63)")
        for label, value, low in (
            ("nnodes", self.nnodes, 1),
            ("nproc_per_node", self.nproc_per_node, 1),
            ("gpus_per_node", self.gpus_per_node, 0),
            ("efa_per_node", self.efa_per_node, 0),
            ("max_restarts", self.max_restarts if self.max_restarts is not None else 0, 0),
            ("backoff_limit", self.backoff_limit if self.backoff_limit is not None else 0, 0),
            (
                "termination_grace_s",
                self.termination_grace_s if self.termination_grace_s is not None else 2,
                2,
            ),
            ("deadline_s", self.deadline_s, 1),
        ):
            if value < low:
                problems.append(f"{label} must be at least {low}, got {value}")
        if self.gpus_per_node and self.nproc_per_node > self.gpus_per_node:
            problems.append(
                f"nproc_per_node ({self.nproc_per_node}) exceeds gpus_per_node ({self.gpus_per_node}): "
                "one process per GPU"
            )
        if self.queue_name and not _LABEL_VALUE.fullmatch(self.queue_name):
            problems.append(
                f"job_queue_name {self.queue_name!r} must be a Kueue LocalQueue name "
                "(a-z, 0-9, '-', '.', at most 63, alphanumeric at both ends) or empty for none"
            )
        if self.priority_class and (
            len(self.priority_class) > 253 or not _DNS_SUBDOMAIN.fullmatch(self.priority_class)
        ):
            problems.append(
                f"job_priority_class {self.priority_class!r} must be a PriorityClass name "
                "(a-z, 0-9, '-', '.', at most 253) or empty for the cluster's default"
            )
        secret = self.mlflow_secret_name
        if secret and (len(secret) > 253 or not _DNS_SUBDOMAIN.fullmatch(secret)):
            problems.append(
                f"mlflow_secret_name {secret!r} must be a Kubernetes secret name "
                "(a-z, 0-9, '-', '.', at most 253) or empty for none"
            )
        for owner in self.owner_references:
            missing = [key for key in ("apiVersion", "kind", "name", "uid") if not owner.get(key)]
            if missing:
                problems.append(f"owner reference {owner!r} lacks {', '.join(missing)}")
        if not self.mount_path.startswith("/"):
            problems.append(f"mount_path {self.mount_path!r} must be an absolute path")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in dict(self.node_selector).items()):
            problems.append(
                f"node_selector must map label names to string values, got {self.node_selector!r}"
            )
        if not all(isinstance(t, dict) and all(isinstance(k, str) for k in t) for t in self.tolerations):
            problems.append(
                f"tolerations must be Kubernetes toleration objects "
                f'(e.g. {{"key": "nvidia.com/gpu", "operator": "Exists"}}), got {list(self.tolerations)!r}'
            )
        if problems:
            raise JobSettingsError("; ".join(problems))
        return self

    @property
    def scale(self) -> JobScale:
        return job_scale(self.gpus_per_node)

    def resolved(self) -> JobSettings:
        """A copy with every unset (None) value taken from `job_scale` (what the pods get)."""
        scale = self.scale
        cpu, memory, shm = scale.resources(self.gpus_per_node)
        grace = (
            self.termination_grace_s if self.termination_grace_s is not None else scale.termination_grace_s
        )
        return dataclasses.replace(
            self,
            cpu_per_node=cpu if self.cpu_per_node is None else self.cpu_per_node,
            memory_per_node=memory if self.memory_per_node is None else self.memory_per_node,
            shm_size=shm if self.shm_size is None else self.shm_size,
            max_restarts=self.max_restarts if self.max_restarts is not None else scale.max_restarts,
            backoff_limit=self.backoff_limit if self.backoff_limit is not None else scale.backoff_limit,
            termination_grace_s=grace,
        )

    def term_timeout_s(self) -> int:
        """ft_launcher's --term-timeout: 60 s (at most half) below the grace period, so the
        launcher stops the ranks and exits on its own before the kubelet's SIGKILL."""
        grace = self.resolved().termination_grace_s
        assert grace is not None
        return max(grace // 2, grace - 60)


def job_name(run_id: str, prefix: str = "rtp-train") -> str:
    """A DNS-label job name unique to a KFP run (the cleanup task finds it by label)."""
    suffix = _DNS_LABEL.sub("-", (run_id or "manual").lower()).strip("-") or "manual"
    return f"{prefix}-{suffix}"[:63].rstrip("-")


def ft_launcher_command(settings: JobSettings, rdzv_host_env: str, rdzv_port_env: str) -> list[str]:
    """The command each pod runs: ft_launcher over a c10d rendezvous on the engine's master.

    `$(VAR)` is expanded by the kubelet from the container's environment, which the engine
    fills in (MASTER_ADDR/MASTER_PORT for PyTorchJob, PET_MASTER_* for TrainJob).
    """
    resolved = settings.resolved()
    assert resolved.max_restarts is not None
    nodes = settings.nnodes
    command = [
        "ft_launcher",
        f"--nnodes={nodes}:{nodes}",
        f"--nproc-per-node={settings.nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=$({rdzv_host_env}):$({rdzv_port_env})",
        f"--rdzv-id={settings.name}",
        # Multi-node jobs start slowly (NCCL set-up, loading a large checkpoint): every job
        # gets the GPU table's launcher timeouts (trainer/gpu_defaults.py), not the local defaults.
        *launcher_flags(gpu_launcher_settings(resolved.max_restarts), cpu=settings.gpus_per_node == 0),
        # After the kubelet's SIGTERM the ranks write their final checkpoint; the launcher
        # waits this long for them (its default, 1800 s, outlasts any grace period).
        f"--term-timeout={settings.term_timeout_s()}",
    ]
    return [*command, "-m", settings.rank_module, *settings.trainer_args]


def pod_command(settings: JobSettings, rdzv_host_env: str, rdzv_port_env: str) -> list[str]:
    """The node check (trainer/health.py: GPUs, EFA devices, /dev/shm, the shared volume),
    which then becomes ft_launcher; an unhealthy node exits 3 before any rank starts."""
    check = [
        "python",
        "-m",
        "trainer.health",
        f"--gpus={settings.gpus_per_node}",
        f"--efa={settings.efa_per_node}",
    ]
    return [*check, "--", *ft_launcher_command(settings, rdzv_host_env, rdzv_port_env)]


def efa_device_rdma(settings: JobSettings) -> bool:
    """GPUDirect RDMA over EFA: only with EFA, GPUs and an instance type known to support it."""
    return bool(settings.efa_per_node and settings.gpus_per_node) and (
        settings.instance_type in EFA_DEVICE_RDMA_INSTANCE_TYPES
    )


def training_env(settings: JobSettings) -> list[dict[str, Any]]:
    """NCCL/EFA and Python settings for every training container, the caller's extras, and
    references to the MLflow secret for any MLflow variable the extras do not set."""
    values = _value_env(settings)
    from_secret = [
        item for item in mlflow_secret_env(settings.mlflow_secret_name) if item["name"] not in values
    ]
    return [{"name": key, "value": value} for key, value in values.items()] + from_secret


def mlflow_secret_env(secret_name: str) -> list[dict[str, Any]]:
    """Env entries that make the kubelet read MLflow's settings from `secret_name` when it
    starts a pod: rank 0 of a job logs live metrics like the in-pod train step does, and the
    credentials never enter the job object (anyone who may read jobs could read them there).
    Required, as in the pipeline's steps: register needs MLflow, so a run whose job namespace
    lacks the secret fails before training (CreateContainerConfigError), not after it."""
    if not secret_name:
        return []
    return [
        {
            "name": variable,
            "valueFrom": {"secretKeyRef": {"name": secret_name, "key": key, "optional": False}},
        }
        for key, variable in MLFLOW_SECRET_KEYS.items()
    ]


def _value_env(settings: JobSettings) -> dict[str, str]:
    """The variables given as values: NCCL/EFA/Python settings for this shape, then the extras."""
    env = {"PYTHONUNBUFFERED": "1", "NCCL_DEBUG": "WARN", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    if settings.gpus_per_node:
        env.update(NCCL_ENV)  # what in-process restart needs on NCCL (the ranks also set it)
    if settings.gpus_per_node == 0:
        # gloo on CPU: one intra-op thread per rank, or the ranks oversubscribe the cores.
        env["OMP_NUM_THREADS"] = "1"
    if settings.efa_per_node:
        env.update(
            {
                # libfabric's EFA provider for NCCL's aws-ofi-nccl plugin (Dockerfile); INFO with
                # the INIT and NET subsystems prints which provider NCCL chose, once per rank
                # ("NET/OFI Selected Provider is efa", docs/eks.md), and little else.
                "FI_PROVIDER": "efa",
                "NCCL_DEBUG": "INFO",
                "NCCL_DEBUG_SUBSYS": "INIT,NET",
                # The data loader and the checkpoint writer fork; registered memory must survive it.
                "FI_EFA_FORK_SAFE": "1",
            }
        )
        if efa_device_rdma(settings):
            env["FI_EFA_USE_DEVICE_RDMA"] = "1"
    env.update(settings.env)
    return env


def _resources(settings: JobSettings) -> dict[str, dict[str, Any]]:
    amounts: dict[str, Any] = {}
    if settings.cpu_per_node:
        amounts["cpu"] = settings.cpu_per_node
    if settings.memory_per_node:
        amounts["memory"] = settings.memory_per_node
    if settings.gpus_per_node:
        amounts[GPU_RESOURCE] = settings.gpus_per_node
    if settings.efa_per_node:
        amounts[EFA_RESOURCE] = settings.efa_per_node
    return {"requests": dict(amounts), "limits": dict(amounts)} if amounts else {}


def _volumes(settings: JobSettings) -> list[dict[str, Any]]:
    shm: dict[str, Any] = {"medium": "Memory"}
    if settings.shm_size:
        shm["sizeLimit"] = settings.shm_size
    return [
        {"name": FSX_VOLUME, "persistentVolumeClaim": {"claimName": settings.pvc_name}},
        {"name": SHM_VOLUME, "emptyDir": shm},
    ]


def _volume_mounts(settings: JobSettings) -> list[dict[str, str]]:
    return [
        {"name": FSX_VOLUME, "mountPath": settings.mount_path},
        {"name": SHM_VOLUME, "mountPath": "/dev/shm"},
    ]


def run_id_label_value(run_id: str) -> str:
    """A KFP run id as a label value (at most 63 of [A-Za-z0-9._-], alphanumeric at both ends)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", run_id)[:63].strip("._-") or "manual"


def _labels(settings: JobSettings) -> dict[str, str]:
    labels = {MANAGED_BY_LABEL: settings.managed_by}
    if settings.run_id:
        labels[RUN_ID_LABEL] = run_id_label_value(settings.run_id)
    if settings.queue_name:
        labels[KUEUE_QUEUE_LABEL] = settings.queue_name
    return labels


def _metadata(settings: JobSettings) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "name": settings.name,
        "namespace": settings.namespace,
        "labels": _labels(settings),
    }
    if settings.owner_references:
        metadata["ownerReferences"] = [dict(owner) for owner in settings.owner_references]
    return metadata


def _pod_annotations() -> dict[str, str]:
    return {ISTIO_INJECT_ANNOTATION: "false"}


def _scheduling(settings: JobSettings) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if settings.node_selector:
        spec["nodeSelector"] = dict(settings.node_selector)
    if settings.tolerations:
        spec["tolerations"] = [dict(t) for t in settings.tolerations]
    if settings.service_account:
        spec["serviceAccountName"] = settings.service_account
    if settings.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": name} for name in settings.image_pull_secrets]
    return spec


RUN_AS_USER = 1000
"""The image's user (Dockerfile: `useradd --uid 1000 rtp`); the FSx volume must be writable by it."""


def pod_security_context() -> dict[str, Any]:
    """Training pods run as the image's non-root user under the runtime's seccomp profile."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context(settings: JobSettings) -> dict[str, Any]:
    """No privilege escalation and no capabilities, except IPC_LOCK with EFA: libfabric pins
    (locks) the buffers it registers with the NIC, which needs it beyond the memlock limit."""
    capabilities: dict[str, list[str]] = {"drop": ["ALL"]}
    if settings.efa_per_node:
        capabilities["add"] = ["IPC_LOCK"]
    return {"allowPrivilegeEscalation": False, "capabilities": capabilities}


def pytorchjob_manifest(settings: JobSettings) -> dict[str, Any]:
    """A `kubeflow.org/v1` PyTorchJob: one Master and nnodes-1 Workers, one pod per node."""
    settings = settings.check().resolved()
    container: dict[str, Any] = {
        "name": PYTORCHJOB_CONTAINER,
        "image": settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": pod_command(settings, "MASTER_ADDR", "MASTER_PORT"),
        "env": training_env(settings),
        "volumeMounts": _volume_mounts(settings),
        "securityContext": container_security_context(settings),
    }
    resources = _resources(settings)
    if resources:
        container["resources"] = resources

    def replica(count: int) -> dict[str, Any]:
        return {
            "replicas": count,
            # OnFailure: the operator restarts a failed pod in place (counted against
            # backoffLimit); ft_launcher has already retried inside the pod by then.
            "restartPolicy": "OnFailure",
            "template": {
                "metadata": {"labels": _labels(settings), "annotations": _pod_annotations()},
                "spec": {
                    **_scheduling(settings),
                    **({"priorityClassName": settings.priority_class} if settings.priority_class else {}),
                    "terminationGracePeriodSeconds": settings.termination_grace_s,
                    # Training needs no Kubernetes API access: no token in the pods.
                    "automountServiceAccountToken": False,
                    "securityContext": pod_security_context(),
                    "containers": [container],
                    "volumes": _volumes(settings),
                },
            },
        }

    replicas = {"Master": replica(1)}
    if settings.nnodes > 1:
        replicas["Worker"] = replica(settings.nnodes - 1)
    return {
        "apiVersion": PYTORCHJOB_API_VERSION,
        "kind": "PyTorchJob",
        "metadata": _metadata(settings),
        "spec": {
            "nprocPerNode": str(settings.nproc_per_node),
            "runPolicy": {
                "backoffLimit": settings.backoff_limit,
                "activeDeadlineSeconds": settings.deadline_s,
                "ttlSecondsAfterFinished": settings.ttl_after_finished_s,
                "cleanPodPolicy": "None",
                # What a gang scheduler (Volcano, scheduler-plugins) orders the job's pod group by.
                **(
                    {"schedulingPolicy": {"priorityClass": settings.priority_class}}
                    if settings.priority_class
                    else {}
                ),
            },
            "pytorchReplicaSpecs": replicas,
        },
    }


HOSTNAME_LABEL = "kubernetes.io/hostname"


def _affinity_avoiding(pod_spec: dict[str, Any], nodes: list[str]) -> dict[str, Any]:
    """The pod spec's affinity with `HOSTNAME_LABEL NotIn nodes` ANDed into every required
    node selector term (the terms are ORed, so each must exclude the nodes)."""
    affinity = copy.deepcopy(pod_spec.get("affinity") or {})
    required = affinity.setdefault("nodeAffinity", {}).setdefault(
        "requiredDuringSchedulingIgnoredDuringExecution", {}
    )
    avoid = {"key": HOSTNAME_LABEL, "operator": "NotIn", "values": sorted(set(nodes))}
    terms = []
    for term in required.get("nodeSelectorTerms") or [{}]:
        kept = [
            e
            for e in term.get("matchExpressions") or []
            if (e.get("key"), e.get("operator")) != (HOSTNAME_LABEL, "NotIn")
        ]
        terms.append({**term, "matchExpressions": [*kept, avoid]})
    required["nodeSelectorTerms"] = terms
    return affinity


def pytorchjob_avoiding(manifest: dict[str, Any], nodes: list[str]) -> dict[str, Any]:
    """A merge patch that keeps the PyTorchJob's pods created from now on off `nodes`: the
    operator builds a replaced pod from the job's current replica template."""
    replicas = manifest["spec"]["pytorchReplicaSpecs"]
    return {
        "spec": {
            "pytorchReplicaSpecs": {
                role: {
                    "template": {"spec": {"affinity": _affinity_avoiding(spec["template"]["spec"], nodes)}}
                }
                for role, spec in replicas.items()
            }
        }
    }


def trainjob_manifest(settings: JobSettings) -> dict[str, Any]:
    """A `trainer.kubeflow.org/v1alpha1` TrainJob on a torch-distributed ClusterTrainingRuntime.

    Volumes, scheduling and pull secrets go through `runtimePatches` (the v2.3 API for
    changing the runtime's pod template), and so do the Istio annotation (pod template
    metadata) and the grace period. The runtime owns the restart policy of the pods, their
    image pull policy and the JobSet's failure policy (no backoffLimit here); ft_launcher
    restarts the ranks inside each pod.
    """
    settings = settings.check().resolved()
    if settings.priority_class:
        raise JobSettingsError(
            f"job_priority_class {settings.priority_class!r}: a v2.3 TrainJob cannot set its pods' priority; "
            "set priorityClassName in the ClusterTrainingRuntime's pod template, or use launcher pytorchjob"
        )
    trainer: dict[str, Any] = {
        "image": settings.image,
        "numNodes": settings.nnodes,
        "numProcPerNode": settings.nproc_per_node,
        "command": pod_command(settings, "PET_MASTER_ADDR", "PET_MASTER_PORT"),
        "env": training_env(settings),
    }
    resources = _resources(settings)
    if resources:
        trainer["resourcesPerNode"] = resources
    # The v2.3 pod patch cannot set automountServiceAccountToken: pass a service account
    # that does not mount its token (--service-account), or set it in the runtime (docs/eks.md).
    pod_patch: dict[str, Any] = {
        **_scheduling(settings),
        "terminationGracePeriodSeconds": settings.termination_grace_s,
        "securityContext": pod_security_context(),
        "volumes": _volumes(settings),
        "containers": [
            {
                "name": TRAINJOB_CONTAINER,
                "volumeMounts": _volume_mounts(settings),
                "securityContext": container_security_context(settings),
            }
        ],
    }
    return {
        "apiVersion": TRAINJOB_API_VERSION,
        "kind": "TrainJob",
        "metadata": _metadata(settings),
        "spec": {
            "runtimeRef": {
                "apiGroup": "trainer.kubeflow.org",
                "kind": "ClusterTrainingRuntime",
                "name": settings.training_runtime,
            },
            "activeDeadlineSeconds": settings.deadline_s,
            "trainer": trainer,
            "runtimePatches": [
                {
                    "manager": "rtp",
                    "trainingRuntimeSpec": {
                        "template": {
                            "spec": {
                                "replicatedJobs": [
                                    {
                                        "name": TRAINJOB_REPLICATED_JOB,
                                        "template": {
                                            "spec": {
                                                "template": {
                                                    "metadata": {"annotations": _pod_annotations()},
                                                    "spec": pod_patch,
                                                }
                                            }
                                        },
                                    }
                                ]
                            }
                        }
                    },
                }
            ],
        },
    }


@dataclass(frozen=True)
class JobKind:
    """What differs between the job types: the API, the condition that means success, the
    engine that runs it, how its pods are labelled and how its manifest is built."""

    kind: str
    api_version: str
    plural: str
    success_condition: str
    engine: str
    job_label: str  # every pod of the job carries it, with the job's name
    rank0_labels: str  # with job_label, selects node 0's pod (whose ranks include rank 0)
    container: str
    build: Callable[[JobSettings], dict[str, Any]]
    avoiding: Callable[[dict[str, Any], list[str]], dict[str, Any]] | None
    """A merge patch keeping the job's new pods off the given nodes; None where the job's
    pod template cannot change while it runs (a TrainJob's belongs to its runtime)."""
    oldest_engine: str
    """The oldest engine release whose CRD declares every field the manifest sets (checked
    against the upstream CRDs of each release, docs/eks.md): an older API server drops the
    rest, so the job is created with strict field validation and refused otherwise."""

    @property
    def group_version(self) -> tuple[str, str]:
        group, version = self.api_version.split("/")
        return group, version

    def pods_selector(self, name: str) -> str:
        return f"{self.job_label}={name}"

    def rank0_pod_selector(self, name: str) -> str:
        return f"{self.pods_selector(name)},{self.rank0_labels}"


JOB_KINDS = {
    "pytorchjob": JobKind(
        kind="PyTorchJob",
        api_version=PYTORCHJOB_API_VERSION,
        plural=PYTORCHJOB_PLURAL,
        success_condition="Succeeded",
        engine="Kubeflow Training Operator",
        job_label="training.kubeflow.org/job-name",
        rank0_labels="training.kubeflow.org/replica-type=master,training.kubeflow.org/replica-index=0",
        container=PYTORCHJOB_CONTAINER,
        build=pytorchjob_manifest,
        avoiding=pytorchjob_avoiding,
        oldest_engine="v1.7.0",
    ),
    "trainjob": JobKind(
        kind="TrainJob",
        api_version=TRAINJOB_API_VERSION,
        plural=TRAINJOB_PLURAL,
        success_condition="Complete",
        engine="Kubeflow Trainer v2",
        job_label="jobset.sigs.k8s.io/jobset-name",
        rank0_labels=f"jobset.sigs.k8s.io/replicatedjob-name={TRAINJOB_REPLICATED_JOB},"
        "batch.kubernetes.io/job-completion-index=0",
        container=TRAINJOB_CONTAINER,
        build=trainjob_manifest,
        avoiding=None,
        # v2.1.0 (Kubeflow 1.11's) has no runtimePatches or activeDeadlineSeconds; v2.2.0's
        # runtime patch has no terminationGracePeriodSeconds.
        oldest_engine="v2.3.0",
    ),
}
"""By the train step's `launcher` value; `job_kind_of` finds one by a manifest's `kind`."""
assert tuple(JOB_KINDS) == JOB_LAUNCHERS


def job_kind_of(kind: str) -> JobKind | None:
    return next((job_kind for job_kind in JOB_KINDS.values() if job_kind.kind == kind), None)


def job_manifest(launcher: str, settings: JobSettings) -> dict[str, Any]:
    if launcher not in JOB_KINDS:
        raise JobSettingsError(f"launcher {launcher!r} creates no job: use one of {', '.join(JOB_LAUNCHERS)}")
    return JOB_KINDS[launcher].build(settings)
