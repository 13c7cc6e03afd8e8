"""Kubernetes settings of the compiled pipeline's pods, applied with kfp-kubernetes.

The pipeline's steps share one FSx for Lustre PVC (its name is a pipeline parameter; the
mount path is fixed at compile time because kfp-kubernetes 2.17.3 takes only a constant
`mount_path`), the trainer gets a memory-backed `/dev/shm`, the train step's pod gets
CPU/memory/GPU requests (compile time) and the GPU node selector and tolerations
(pipeline parameters), the train, validate and register steps read their MLflow
settings from a Kubernetes secret named by a parameter (the train step also hands that name
to a training job, whose pods read the same secret). No AWS keys appear anywhere: the
pods reach S3 through their service account (IRSA). These settings compile into the
YAML's second document (the platform spec); `kfp.local` ignores them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# One definition in components (the training job's manifest, components.train.jobs, reads
# it too, and components do not import the pipeline); re-exported with the other defaults.
from components.mlflow_access import DEFAULT_MLFLOW_SECRET as DEFAULT_MLFLOW_SECRET
from components.mlflow_access import MLFLOW_SECRET_KEYS

# The pods' memory formula lives in components: the check step compares a run's model with it.
from components.step_memory import model_step_memory

DEFAULT_FSX_MOUNT_PATH = "/fsx"
DEFAULT_PVC_NAME = "fsx-claim"
DEFAULT_GPU_TOLERATIONS = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
IMAGE_PULL_POLICIES = ("Always", "IfNotPresent", "Never")


@dataclass(kw_only=True, slots=True)
class PlatformOptions:
    """Compile-time settings (`rtp compile` flags); the rest are pipeline parameters."""

    fsx_mount_path: str = DEFAULT_FSX_MOUNT_PATH
    image_pull_policy: str = "IfNotPresent"
    image_pull_secrets: list[str] = field(default_factory=list)
    train_pod_cpu: str = "2"
    """CPU request of the train step's own pod (all of training with launcher inpod)."""
    train_pod_memory: str = "8Gi"
    train_pod_gpus: int = 0
    """GPUs the train step's own pod requests, for launcher inpod only; 0 requests none.
    With a job launcher that pod only watches the job, so a compile with a job launcher
    as the default refuses GPUs here (pipelines.pipeline.build_pipeline)."""
    shm_size: str = ""
    """Size limit of the trainer's /dev/shm; empty leaves it bounded by the pod's memory."""
    model_params: float = 0.0
    """Parameters of the largest model this pipeline trains (e.g. 8e9): sizes the memory of
    the validate and register pods (`model_step_memory`); 0 sizes them for the CPU presets."""

    def check(self) -> PlatformOptions:
        if not self.fsx_mount_path.startswith("/"):
            raise ValueError(f"the FSx mount path {self.fsx_mount_path!r} must be absolute, e.g. /fsx")
        if self.image_pull_policy not in IMAGE_PULL_POLICIES:
            raise ValueError(
                f"image pull policy {self.image_pull_policy!r} is not one of {', '.join(IMAGE_PULL_POLICIES)}"
            )
        if self.train_pod_gpus < 0:
            raise ValueError(f"train pod GPUs must be 0 or more, got {self.train_pod_gpus}")
        if self.model_params < 0:
            raise ValueError(f"model parameters must be 0 or more (e.g. 8e9), got {self.model_params:g}")
        return self


def size_model_step(task: Any, step: str, options: PlatformOptions) -> Any:
    """Request (and limit) the memory `model_step_memory` gives: the pod lands on a node
    that fits it, and is stopped at that size instead of starving its node."""
    memory = model_step_memory(step, options.model_params)
    return task.set_memory_request(memory).set_memory_limit(memory)


# kfp.kubernetes is imported inside the functions: the `rtp` CLI reads PlatformOptions
# while building its parser and must stay quick to start.


def apply_common(task: Any, options: PlatformOptions) -> Any:
    from kfp import kubernetes

    kubernetes.set_image_pull_policy(task, options.image_pull_policy)
    if options.image_pull_secrets:
        kubernetes.set_image_pull_secrets(task, list(options.image_pull_secrets))
    return task


def mount_fsx(task: Any, pvc_name: Any, options: PlatformOptions) -> Any:
    from kfp import kubernetes

    return kubernetes.mount_pvc(task, pvc_name=pvc_name, mount_path=options.fsx_mount_path)


def configure_train_pod(task: Any, *, options: PlatformOptions, node_selector: Any, tolerations: Any) -> Any:
    """Resources, shm and GPU-node scheduling of the train step's own pod.

    The requests are compile-time constants: kfp 2.17.3 compiles a resource request taken
    from a pipeline parameter inside a sub-DAG (our exit handler) into a reference to an
    input the sub-DAG never receives, and the run fails to resolve it.
    """
    from kfp import kubernetes

    task.set_cpu_request(options.train_pod_cpu).set_memory_request(options.train_pod_memory)
    if options.train_pod_gpus:
        task.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(options.train_pod_gpus)
    kubernetes.empty_dir_mount(
        task, volume_name="dshm", mount_path="/dev/shm", medium="Memory", size_limit=options.shm_size or None
    )
    if node_selector is not None:  # None: a pod that only watches a job stays off the GPU nodes
        kubernetes.add_node_selector_json(task, node_selector)
    if tolerations is not None:
        kubernetes.add_toleration_json(task, tolerations)
    return task


def use_mlflow_secret(task: Any, secret_name: Any) -> Any:
    """MLFLOW_TRACKING_* in `task`'s pod from the secret's keys (`MLFLOW_SECRET_KEYS`)."""
    from kfp import kubernetes

    return kubernetes.use_secret_as_env(task, secret_name=secret_name, secret_key_to_env=MLFLOW_SECRET_KEYS)
