"""KFP interface of the exit handler: delete the run's training jobs if it failed or was stopped."""

from kfp.dsl import PipelineTaskFinalStatus


def cleanup_training_jobs(
    launcher: str,
    run_id: str,
    job_namespace: str,
    status: PipelineTaskFinalStatus,
) -> None:
    """Delete the PyTorchJob/TrainJob this run created unless the run succeeded.

    Args:
        launcher: the train step's launcher (inpod, pytorchjob, trainjob); inpod leaves nothing behind.
        run_id: the KFP run id (filled in by the pipeline); jobs carry it as a label.
        job_namespace: namespace of the training jobs; empty is this pod's namespace.
        status: the final status of the tasks inside the exit handler (filled in by KFP).
    """
    from components.cleanup_jobs.cleanup import cleanup_after_run

    cleanup_after_run(launcher, status.state, run_id, job_namespace)
