"""The train step's multi-node path: training as a PyTorchJob or TrainJob, not in this pod.

`train_with_job` hands the pods the same config as the in-pod path (`--config`), wraps
them in a job manifest (`jobs`), runs it to the end (`k8s_launcher`), and then reads the
summary that global rank 0 wrote onto the shared FSx volume, which this pod mounts at
the same path as the job's pods. So the result looks exactly like `train_in_pod`'s, and
validate and register do not care which launcher trained the model. The job is owned by
this step's pod (`step_pod_owner`), so deleting the pod deletes the job.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import rtp_prefork
from components.train.job_scale import trainer_overrides
from components.train.jobs import JOB_LAUNCHERS, JobSettings, JobSettingsError, job_manifest, job_name
from components.train.k8s_launcher import (
    JobFailed,
    in_cluster_api_client,
    pod_namespace,
    run_job,
    step_pod_owner,
)
from components.train.pod_health import DEFAULT_PENDING_TIMEOUT_S
from components.train.train import TrainRequest, TrainResult, checked_result
from trainer.config import TrainConfig
from trainer.launch import CONFIG_FILE
from trainer.summary import TrainSummary


def job_settings_for_run(
    request: TrainRequest,
    *,
    run_id: str,
    namespace: str,
    image: str,
    nproc_per_node: int,
    **job_fields: Any,
) -> JobSettings:
    """JobSettings whose pods train this run into its run folder (checked, pure)."""
    request = scaled_request(request, job_fields.get("gpus_per_node", 0))
    config = _decided(request.config(), job_fields)
    return _job_settings(config, run_id, namespace, image, nproc_per_node, job_fields)


def scaled_request(request: TrainRequest, gpus_per_node: int) -> TrainRequest:
    """`request` with the trainer's timeouts for a job of this GPU count (job_scale) put
    before the user's overrides, which therefore still win."""
    scaled = " ".join([*trainer_overrides(gpus_per_node), request.overrides]).strip()
    return dataclasses.replace(request, overrides=scaled)


def _job_settings(
    config: TrainConfig,
    run_id: str,
    namespace: str,
    image: str,
    nproc_per_node: int,
    job_fields: dict[str, Any],
) -> JobSettings:
    # The config travels inline (compact JSON), so the manifest alone says what the pods
    # train; the step also writes it to <run>/train/config.json as the run's record.
    return JobSettings(
        name=job_name(run_id),
        namespace=namespace,
        image=image,
        trainer_args=[f"--config={config.to_compact_json()}"],
        rank_module=rtp_prefork.rank_module(config),
        run_id=run_id,
        nproc_per_node=nproc_per_node,
        **job_fields,
    ).check()


def train_with_job(
    launcher: str,
    request: TrainRequest,
    *,
    run_id: str,
    namespace: str = "",
    image: str,
    nproc_per_node: int,
    timeout_s: float,
    poll_interval_s: float = 10.0,
    pending_timeout_s: float = DEFAULT_PENDING_TIMEOUT_S,
    api_client: Any = None,
    **job_fields: Any,
) -> TrainResult:
    """Train as a `launcher` job; returns the summary rank 0 wrote and the config used."""
    if launcher not in JOB_LAUNCHERS:
        raise JobSettingsError(f"launcher {launcher!r} is not one of inpod, {', '.join(JOB_LAUNCHERS)}")
    if not image:
        raise JobSettingsError("no image for the job's pods: pass the pipeline's image (job_image)")
    # The engine's own deadline backs up this step's timeout for when the step's pod dies
    # without cleaning up (node loss) and the exit handler cannot run either.
    job_fields.setdefault("deadline_s", int(timeout_s) + 600)
    config = scaled_request(request, job_fields.get("gpus_per_node", 0)).config()
    config = _decided(config, job_fields)
    api_client = api_client if api_client is not None else in_cluster_api_client()
    namespace = pod_namespace(namespace)
    owner = step_pod_owner(api_client, namespace)
    job_fields.setdefault("owner_references", [owner] if owner else [])
    settings = _job_settings(config, run_id, namespace, image, nproc_per_node, job_fields)
    manifest = job_manifest(launcher, settings)
    config.write(request.workdir / CONFIG_FILE)
    summary_path = request.workdir / "summary.json"
    # A summary left by an earlier attempt must not pass for this job's result.
    summary_path.unlink(missing_ok=True)
    run_job(
        manifest,
        api_client=api_client,
        timeout_s=timeout_s,
        poll_interval_s=poll_interval_s,
        pending_timeout_s=pending_timeout_s,
        # A TrainJob has no backoffLimit of its own: the watcher allows what a PyTorchJob would.
        crash_restarts=settings.resolved().backoff_limit,
    )
    if not summary_path.is_file():
        raise JobFailed(
            f"{manifest['kind']} {settings.name} succeeded but wrote no {summary_path}: is the FSx PVC "
            f"{settings.pvc_name!r} mounted at {settings.mount_path} in both the step and the job?"
        )
    result = TrainResult(
        summary=TrainSummary.read(summary_path),
        config=config,
        preset=request.preset,
        launcher=launcher,
        job_name=settings.name,
    )
    return checked_result(result, request)


def _decided(config: Any, job_fields: dict[str, Any]) -> Any:
    """The job's ranks read a config with `auto` settings decided here, for the job's nodes and
    GPUs (the GPU's memory from the node selector's instance type, as the check step takes it)."""
    from components.check_run.memory_fit import gpu_memory_gib
    from trainer.launch import resolve_auto_settings

    gpus = int(job_fields.get("gpus_per_node", 0) or 0)
    return resolve_auto_settings(
        config,
        nnodes=int(job_fields.get("nnodes", 1) or 1),
        gpus_per_node=gpus,
        gpu_memory_gib=gpu_memory_gib(job_fields.get("node_selector")) if gpus else None,
    )
