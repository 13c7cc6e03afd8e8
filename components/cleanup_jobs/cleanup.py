"""What the pipeline's exit handler does: delete the run's training jobs unless it succeeded.

A KFP run that fails or is terminated stops its own pods, but a PyTorchJob or TrainJob the
train step created keeps its GPU pods running until its deadline. The exit task runs
after everything else, whatever happened, and calls `cleanup_after_run`: with the
`inpod` launcher, or after a successful run, there is nothing to delete (a finished job
is removed by its own TTL); otherwise every job labelled with the run id is deleted.
"""

from __future__ import annotations

from typing import Any

from components.train.jobs import JOB_LAUNCHERS


def cleanup_after_run(
    launcher: str, run_state: str, run_id: str, namespace: str = "", api_client: Any = None
) -> list[str]:
    """Delete this run's training jobs when it did not succeed; returns 'Kind/name' deleted."""
    if launcher not in JOB_LAUNCHERS:
        print(f"launcher {launcher!r} creates no Kubernetes job: nothing to clean up")
        return []
    if run_state == "SUCCEEDED":
        print("the run succeeded: its training job is left to its ttlSecondsAfterFinished")
        return []
    from components.train.k8s_launcher import delete_run_jobs, in_cluster_api_client, pod_namespace

    deleted = delete_run_jobs(
        api_client if api_client is not None else in_cluster_api_client(), pod_namespace(namespace), run_id
    )
    print(f"run {run_state.lower()}: deleted {', '.join(deleted) if deleted else 'no job (none was left)'}")
    return deleted
