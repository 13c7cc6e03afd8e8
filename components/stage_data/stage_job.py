"""The stage step across pods: an Indexed Job of `rtp stage --part I/N` pods, then the commit.

With the pipeline's `stage_workers` above 1 the stage step does not fetch the objects
itself. In a cluster it creates a `batch/v1` Job with `completionMode: Indexed` and N
completions, whose pods copy what the step's own pod has: its image, service account (the
IRSA role for S3), the volume holding the FSx mount, node selector, tolerations, pull
secrets and security context. Each pod runs `rtp stage ... --part $(JOB_COMPLETION_INDEX)/N`.
`backoffLimitPerIndex` retries a failed part alone, and `maxFailedIndexes: 0` fails the Job
once any part has used up its retries. The step waits for every index to succeed, deletes
the Job if it fails, times out or the step is stopped, and then commits the snapshot
(`parts.finish_stage`). Outside a cluster (`rtp local`, kfp.local) the parts run as N local
processes instead. The API calls go through an `ApiClient` the caller passes (tests pass
one pointed at a fake API server) or the pod's in-cluster configuration.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from components.stage_data.errors import StageError
from components.stage_data.parts import finish_stage
from components.stage_data.stage import StageResult

log = logging.getLogger(__name__)

PART_RETRIES = 3
"""Retries of each part's pod (backoffLimitPerIndex): S3 and node hiccups are worth it."""
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def stage_command(source: str, fsx_mount_path: str, dataset_name: str, endpoint_url: str | None) -> list[str]:
    """`rtp stage` for the snapshot, without its --part."""
    command = [
        "python",
        "-m",
        "rtp_cli.main",
        "stage",
        "--source",
        source,
        "--fsx-mount-path",
        fsx_mount_path,
    ]
    command += ["--dataset-name", dataset_name]
    return command + (["--endpoint-url", endpoint_url] if endpoint_url else [])


def _fsx_mounts(container: Mapping[str, Any], fsx_mount_path: str) -> list[dict[str, Any]]:
    """The container's volume mounts at or above `fsx_mount_path`."""
    wanted = os.path.normpath(fsx_mount_path)
    return [
        dict(m)
        for m in container.get("volumeMounts") or []
        if wanted == os.path.normpath(m["mountPath"])
        or wanted.startswith(os.path.normpath(m["mountPath"]) + "/")
    ]


def part_job_manifest(
    step_pod: Mapping[str, Any],
    *,
    name: str,
    parts: int,
    command: list[str],
    fsx_mount_path: str,
    owner: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The Indexed Job whose pod I runs `command --part I/parts`, shaped after `step_pod`."""
    spec = step_pod["spec"]
    containers = spec["containers"]
    main = next((c for c in containers if c["name"] == "main"), containers[0])  # KFP's user container
    mounts = _fsx_mounts(main, fsx_mount_path)
    if not mounts:
        raise StageError(
            f"the stage step's pod mounts nothing at {fsx_mount_path}: its part pods would not see the volume"
        )
    names = {m["name"] for m in mounts}
    container: dict[str, Any] = {
        "name": "stage",
        "image": main["image"],
        "command": [*command, "--part", f"$(JOB_COMPLETION_INDEX)/{parts}"],
        "env": [dict(e) for e in main.get("env") or [] if e["name"].startswith("AWS_")],
        "volumeMounts": mounts,
    }
    for key in ("resources", "securityContext", "imagePullPolicy"):
        if main.get(key):
            container[key] = main[key]
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [container],
        "volumes": [dict(v) for v in spec.get("volumes") or [] if v["name"] in names],
    }
    for key in ("serviceAccountName", "nodeSelector", "tolerations", "imagePullSecrets", "securityContext"):
        if spec.get(key):
            pod_spec[key] = spec[key]
    labels = {"app.kubernetes.io/managed-by": "rtp", "app.kubernetes.io/component": "stage-part"}
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": step_pod["metadata"]["namespace"],
        "labels": labels,
    }
    if owner:
        metadata["ownerReferences"] = [dict(owner)]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata,
        "spec": {
            "completionMode": "Indexed",
            "completions": parts,
            "parallelism": parts,
            "backoffLimitPerIndex": PART_RETRIES,
            "maxFailedIndexes": 0,
            "ttlSecondsAfterFinished": 3600,
            "template": {
                "metadata": {"labels": labels, "annotations": {"sidecar.istio.io/inject": "false"}},
                "spec": pod_spec,
            },
        },
    }


def _job_outcome(status: Mapping[str, Any], parts: int) -> str | None:
    """'succeeded', 'failed: <why>' or None while the Job runs."""
    for condition in status.get("conditions") or []:
        if condition.get("status") == "True" and condition.get("type") == "Failed":
            failed = f"; failed parts: {status['failedIndexes']}" if status.get("failedIndexes") else ""
            return f"failed: {condition.get('message') or condition.get('reason', '')}{failed}"
    if int(status.get("succeeded") or 0) >= parts:
        return "succeeded"
    return None


def run_part_job(
    api_client: Any, manifest: dict[str, Any], *, timeout_s: float, poll_interval_s: float = 10.0
) -> None:
    """Create the Job and wait until every part succeeded; delete it when it fails, times out
    or this process is interrupted."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    batch = client.BatchV1Api(api_client)
    namespace, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
    parts = int(manifest["spec"]["completions"])
    try:
        batch.create_namespaced_job(namespace, manifest)
    except ApiException as exc:
        if exc.status != 409:  # 409: a retried step finds its own Job: watch it
            raise StageError(
                f"could not create the staging Job {namespace}/{name}: {exc.reason} {exc.body}"
            ) from exc
    log.info("staging in %d parts: Job %s/%s", parts, namespace, name)
    deadline = time.monotonic() + timeout_s
    finished = False
    try:
        while True:
            try:
                job = api_client.sanitize_for_serialization(batch.read_namespaced_job(name, namespace))
            except ApiException as exc:
                if exc.status == 404:
                    raise StageError(f"the staging Job {namespace}/{name} was deleted while it ran") from exc
                log.warning("reading the staging Job failed (%s); retrying", exc.reason)
                job = {}
            outcome = _job_outcome(job.get("status") or {}, parts)
            if outcome == "succeeded":
                finished = True
                return
            if outcome is not None:
                raise StageError(
                    f"the staging Job {namespace}/{name} {outcome}; the logs of its pods say why"
                )
            if time.monotonic() >= deadline:
                raise StageError(
                    f"the staging Job {namespace}/{name} did not finish within {timeout_s:.0f} s"
                )
            time.sleep(poll_interval_s)
    finally:
        if not finished:
            with contextlib.suppress(ApiException):
                batch.delete_namespaced_job(name, namespace, propagation_policy="Background")


def run_parts_here(command: list[str], parts: int, environ: Mapping[str, str] | None = None) -> None:
    """The parts as local processes at once (no cluster: `rtp local`, kfp.local)."""
    command = [sys.executable if command[0] == "python" else command[0], *command[1:]]
    processes = [
        subprocess.Popen(
            [*command, "--part", f"{i}/{parts}"], env=dict(environ or os.environ), stdout=subprocess.DEVNULL
        )
        for i in range(parts)
    ]
    failed = [i for i, p in enumerate(processes) if p.wait() != 0]
    if failed:
        raise StageError(
            f"staging parts {failed} of {parts} failed (their errors are above); run the stage again"
        )


def in_cluster() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and (SERVICE_ACCOUNT / "token").is_file()


def stage_across_pods(
    source: str,
    fsx_mount_path: str,
    dataset_name: str,
    parts: int,
    *,
    endpoint_url: str | None = None,
    job_name: str = "",
    api_client: Any = None,
    read_step_pod: Callable[[], tuple[dict[str, Any], dict[str, str] | None]] | None = None,
    timeout_s: float = 6 * 3600,
    poll_interval_s: float = 10.0,
) -> StageResult:
    """Stage the snapshot in `parts` parts (a Job's pods in a cluster, local processes
    elsewhere), then commit it here."""
    if parts < 2:
        raise StageError(
            f"stage_workers {parts}: staging across pods needs at least 2 (1 stages in the step)"
        )
    started = time.perf_counter()
    command = stage_command(source, fsx_mount_path, dataset_name, endpoint_url)
    if api_client is None and not in_cluster():
        run_parts_here(command, parts)
    else:
        if api_client is None:
            from components.train.k8s_launcher import in_cluster_api_client

            api_client = in_cluster_api_client()
        step_pod, owner = (read_step_pod or (lambda: _read_step_pod(api_client)))()
        manifest = part_job_manifest(
            step_pod, name=job_name or f"{step_pod['metadata']['name'][:48]}-parts", parts=parts,
            command=command, fsx_mount_path=fsx_mount_path, owner=owner,
        )  # fmt: skip
        run_part_job(api_client, manifest, timeout_s=timeout_s, poll_interval_s=poll_interval_s)
    result = finish_stage(source, fsx_mount_path, dataset_name, parts, endpoint_url=endpoint_url)
    return dataclasses.replace(result, seconds=time.perf_counter() - started)  # the parts' time too


def _read_step_pod(api_client: Any) -> tuple[dict[str, Any], dict[str, str] | None]:
    """This step's own pod (its spec is the part pods' model) and an ownerReference to it."""
    from kubernetes import client

    from components.train.k8s_launcher import pod_namespace, step_pod_owner

    namespace = pod_namespace()
    name = os.environ.get("POD_NAME") or os.environ.get("KFP_POD_NAME") or os.environ.get("HOSTNAME", "")
    pod = client.CoreV1Api(api_client).read_namespaced_pod(name, namespace)
    return api_client.sanitize_for_serialization(pod), step_pod_owner(api_client, namespace)
